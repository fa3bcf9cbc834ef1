//! Identifiers shared by every crate: workers, data-parallel ranks, requests, block hashes.
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

/// A client request's id (`X-Infera-Request-Id`, or generated).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct RequestId(pub String);

impl RequestId {
    pub fn new(id: impl Into<String>) -> Self {
        Self(id.into())
    }
}

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
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
