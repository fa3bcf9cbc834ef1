//! Identifiers shared by every crate: workers, data-parallel ranks, requests, sessions, block
//! hashes.
//!
//! Block hashes come in two kinds that must never be confused: [`BlockHash`] is the router's own
//! chained XXH3-64 of a block's tokens (see [`crate::hashing`]); [`EngineHash`] is whatever opaque key
//! an engine published for a block (vLLM salts per process, SGLang sends signed ints, some builds send
//! 32-byte digests). The index keeps a per-(worker, dp rank) map from the second to the first.

use serde::{Deserialize, Serialize};
use std::fmt;

/// A worker's identity: `"host:port"` as registered (PROTOCOLS.md §1).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct WorkerId(pub String);

impl WorkerId {
    /// Creates a worker id from anything string-like.
    pub fn new(id: impl Into<String>) -> Self {
        Self(id.into())
    }

    /// The id as a string slice.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for WorkerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<&str> for WorkerId {
    fn from(s: &str) -> Self {
        Self(s.to_owned())
    }
}

impl From<String> for WorkerId {
    fn from(s: String) -> Self {
        Self(s)
    }
}

/// One routable unit: a worker's data-parallel rank. Each rank has its own KV cache.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct WorkerRank {
    pub worker: WorkerId,
    pub dp_rank: u32,
}

impl WorkerRank {
    pub fn new(worker: impl Into<WorkerId>, dp_rank: u32) -> Self {
        Self {
            worker: worker.into(),
            dp_rank,
        }
    }
}

impl fmt::Display for WorkerRank {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}#{}", self.worker, self.dp_rank)
    }
}

/// A request's id.
///
/// The client's id (`X-Infera-Request-Id`, or generated) names a request to its client and to the
/// engine; a client may send one id with many concurrent requests, so the router keys its own
/// accounting by ids it makes from it:
/// - the request key `<client id>#<n>`, made once per client request ([`RequestId::keyed`]);
/// - the attempt id `<request key>.<m>`, once per attempt: the first, each retry and each
///   migration ([`RequestId::attempt`]).
///
/// `n` and `m` are numbers the router never gives twice. An id of another shape is its own key
/// and its own client id.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct RequestId(pub String);

impl RequestId {
    pub fn new(id: impl Into<String>) -> Self {
        Self(id.into())
    }

    /// The key of client request number `n` sent with `client_id`.
    pub fn keyed(client_id: &str, n: u64) -> Self {
        Self(format!("{client_id}#{n}"))
    }

    /// Attempt number `m` of the request keyed `key`.
    pub fn attempt(key: &str, m: u64) -> Self {
        Self(format!("{key}.{m}"))
    }

    /// The request key this id belongs to (an attempt's request, or the key itself).
    pub fn request_key(&self) -> &str {
        split_request_id(&self.0).map_or(&self.0, |(_, key_end)| &self.0[..key_end])
    }

    /// The client's id inside this key or attempt id.
    pub fn client_id(&self) -> &str {
        split_request_id(&self.0).map_or(&self.0, |(client, _)| client)
    }
}

/// `<client>#<n>[.<m>]` → the client id and where the key `<client>#<n>` ends.
fn split_request_id(id: &str) -> Option<(&str, usize)> {
    let (client, tail) = id.rsplit_once('#')?;
    let (n, m) = match tail.split_once('.') {
        Some((n, m)) => (n, Some(m)),
        None => (tail, None),
    };
    let number = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    (number(n) && m.is_none_or(number)).then_some((client, client.len() + 1 + n.len()))
}

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A conversation's key: the XXH3-64 of the client's session id (`x-session-id`, or the body's
/// `prompt_cache_key` or `session_id`), so that events and traces never hold the id itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct SessionKey(pub u64);

impl SessionKey {
    /// The key of session id `id`; every replica computes the same one.
    pub fn of(id: &str) -> Self {
        Self(xxhash_rust::xxh3::xxh3_64(id.as_bytes()))
    }
}

/// The router's hash of one complete KV block, chained over its prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
#[repr(transparent)]
pub struct BlockHash(pub u64);

/// An engine's opaque key for one block, folded to 64 bits.
///
/// Unsigned ints are kept as they are, signed ints are reinterpreted bit for bit, and byte strings
/// (vLLM's 32-byte digests) are folded with XXH3-64. Equal wire values always give equal keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
#[repr(transparent)]
pub struct EngineHash(pub u64);

impl EngineHash {
    /// An engine hash sent as an unsigned int (vLLM, ATOM).
    pub fn from_u64(v: u64) -> Self {
        Self(v)
    }

    /// An engine hash sent as a signed int (SGLang).
    pub fn from_i64(v: i64) -> Self {
        Self(v as u64)
    }

    /// An engine hash sent as bytes (vLLM with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`).
    pub fn from_bytes(b: &[u8]) -> Self {
        Self(xxhash_rust::xxh3::xxh3_64(b))
    }
}

#[cfg(test)]
mod tests {
    use super::RequestId;

    #[test]
    fn attempts_and_keys_lead_back_to_the_client_id() {
        let key = RequestId::keyed("chat-42", 7);
        let attempt = RequestId::attempt(&key.0, 9);
        assert_eq!(attempt.0, "chat-42#7.9");
        assert_eq!(attempt.request_key(), key.0);
        assert_eq!(key.request_key(), key.0);
        assert_eq!(
            (attempt.client_id(), key.client_id()),
            ("chat-42", "chat-42")
        );
        // A client id that already holds `#<n>` keeps it.
        let odd = RequestId::attempt(&RequestId::keyed("a#1", 2).0, 3);
        assert_eq!((odd.client_id(), odd.request_key()), ("a#1", "a#1#2"));
    }

    #[test]
    fn ids_of_another_shape_are_their_own_key_and_client() {
        for plain in ["x", "x#", "x#1.", "x#a", "x#1.b", "x.1", ""] {
            let id = RequestId::new(plain);
            assert_eq!(
                (id.request_key(), id.client_id()),
                (plain, plain),
                "{plain:?}"
            );
        }
    }
}
