//! The KV block store port: where an engine saves the KV blocks it computed and loads the ones
//! it misses (the kvd client, in the `infera` binary; PROTOCOLS.md §6). The mock engine uses it
//! under `infera up --kvd` and `infera worker mock --infera-kvd-socket`.
//!
//! Blocks are keyed bytes in a namespace `(model, compat_key)`; the keys are [`block_keys`], the
//! engine connectors' SHA-256 chain over the prompt's token ids, which the mock engine uses and
//! `POST /v1/cache/prewarm` derives from a prompt, so a prewarm promotes exactly what the
//! engines, real or mock, load. Every call answers within the
//! implementation's deadline, or fails with [`BlockStoreError::Timeout`].

use crate::event::Retention;
use async_trait::async_trait;

/// The registration field (`true`) of a worker whose engine saves and loads its KV blocks
/// through kvd (PROTOCOLS.md §1).
pub const KVD_BACKED_FIELD: &str = "kvd_backed";

/// Bytes of a block key.
pub const KEY_BYTES: usize = 16;

/// The keys of the full blocks of `tokens`: block `i`'s key chains block `i - 1`'s (empty for
/// the first) with the block's token ids, each a little-endian `u32`, through SHA-256, cut to
/// [`KEY_BYTES`]:
///
/// ```text
/// key[i] = sha256(key[i-1] + u32le(tokens[i*bs .. (i+1)*bs]))[..16]
/// ```
///
/// The engine connectors' scheme (`infera_kvd.keys`), so a real engine, the mock engine and a
/// prewarm name one prefix with one key. Nothing process-local enters it.
pub fn block_keys(tokens: &[u32], block_size: usize) -> Vec<Vec<u8>> {
    scoped_block_keys(tokens, block_size, &[])
}

/// [`block_keys`] of a request the engine keys by more than its tokens (an adapter, a salt,
/// images): with a non-empty `scope` the chain starts from
/// `sha256(b"infera-kv-scope\0" ‖ scope)[..16]`, as `infera_kvd.keys.block_keys(scope=…)` does, so
/// its blocks never share keys with another identity's.
pub fn scoped_block_keys(tokens: &[u32], block_size: usize, scope: &[u8]) -> Vec<Vec<u8>> {
    use sha2::{Digest as _, Sha256};
    if block_size == 0 {
        return Vec::new();
    }
    let seed = (!scope.is_empty()).then(|| {
        let mut hasher = Sha256::new();
        hasher.update(b"infera-kv-scope\0");
        hasher.update(scope);
        hasher.finalize()[..KEY_BYTES].to_vec()
    });
    let mut keys: Vec<Vec<u8>> = Vec::with_capacity(tokens.len() / block_size);
    for block in tokens.chunks_exact(block_size) {
        let mut hasher = Sha256::new();
        if let Some(previous) = keys.last().or(seed.as_ref()) {
            hasher.update(previous);
        }
        for token in block {
            hasher.update(token.to_le_bytes());
        }
        keys.push(hasher.finalize()[..KEY_BYTES].to_vec());
    }
    keys
}

/// The namespace of a set of blocks: blocks of different models or incompatible layouts never
/// meet.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct BlockNamespace {
    /// The served model name.
    pub model: String,
    /// Anything else that makes blocks incompatible (quantization, layout); `""` by default.
    pub compat_key: String,
}

/// One block to save: its key and its bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredBlock {
    pub key: Vec<u8>,
    pub value: Vec<u8>,
}

/// Why a call failed. Both are retryable: a later call may find the store back.
#[derive(Debug, thiserror::Error)]
pub enum BlockStoreError {
    /// The store could not be reached, or its connection failed mid-call.
    #[error("the kv block store is unavailable: {0}")]
    Unavailable(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The store did not answer within the call's deadline.
    #[error("the kv block store did not answer within {0} ms")]
    Timeout(u64),
}

/// Keyed KV blocks shared by engines (see the module docs).
#[async_trait]
pub trait KvBlockStore: Send + Sync + std::fmt::Debug {
    /// Which of `keys` the store holds, one flag per key, in order.
    ///
    /// # Errors
    /// [`BlockStoreError`] when the store did not answer.
    async fn exists(
        &self,
        ns: &BlockNamespace,
        keys: &[Vec<u8>],
    ) -> Result<Vec<bool>, BlockStoreError>;

    /// The bytes of `keys`, one entry per key, in order (`None` for a miss).
    ///
    /// # Errors
    /// [`BlockStoreError`] when the store did not answer.
    async fn get(
        &self,
        ns: &BlockNamespace,
        keys: &[Vec<u8>],
    ) -> Result<Vec<Option<Vec<u8>>>, BlockStoreError>;

    /// Saves `blocks` with `retention`; returns how many the store accepted (it may refuse a
    /// block that would displace a higher retention class). Callers never save
    /// [`Retention::None`] blocks.
    ///
    /// # Errors
    /// [`BlockStoreError`] when the store did not answer.
    async fn set(
        &self,
        ns: &BlockNamespace,
        blocks: Vec<StoredBlock>,
        retention: Retention,
    ) -> Result<usize, BlockStoreError>;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(keys: &[Vec<u8>]) -> Vec<String> {
        keys.iter()
            .map(|k| k.iter().map(|b| format!("{b:02x}")).collect())
            .collect()
    }

    #[test]
    fn keys_are_the_engine_connectors_keys() {
        // Computed by `infera_kvd.keys.block_keys` (kvd/python), the connectors' scheme.
        let tokens: Vec<u32> = (0..10).collect();
        assert_eq!(
            hex(&block_keys(&tokens, 4)),
            [
                "baed642339816affb3fe8719792d0e4c",
                "bedd165f7f7d59c7d8ade8eb75481d59"
            ]
        );
        assert_eq!(
            hex(&block_keys(&[u32::MAX, 0, 7, 100_000], 2)),
            [
                "72a4fa3544e43a836ffcb268ce06ccdb",
                "e2ab000db0f1145e2c40d763dd19d1bf"
            ]
        );
        assert!(block_keys(&tokens, 0).is_empty());
        assert!(block_keys(&tokens[..3], 4).is_empty(), "full blocks only");
        // `block_keys(range(10), 4, scope=b"sql")` in kvd/python: another chain from block 0.
        assert_eq!(
            hex(&scoped_block_keys(&tokens, 4, b"sql")),
            [
                "2c4ce5a7bd8a90b5dc6a5b3b08b861c2",
                "7706e4a19b08570068daaa9895821ba7"
            ]
        );
        assert_eq!(scoped_block_keys(&tokens, 4, b""), block_keys(&tokens, 4));
    }
}
