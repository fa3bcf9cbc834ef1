//! The mock's lower tier: KV blocks saved to and loaded from a [`KvBlockStore`] (kvd), so that
//! a fleet of mocks shows L2/L3 hits end to end ([`MockConfig::kv_store`](super::MockConfig)).
//!
//! - **Keys**: the engine connectors' keys ([`scoped_block_keys`], a SHA-256 chain over the
//!   prompt's token ids, started from the request's identity when it has an adapter or a salt),
//!   in the namespace `(served model, compat key)`: what a real engine's connector and
//!   `POST /v1/cache/prewarm` use, so a prewarm promotes what the mocks load.
//! - **Bytes**: a block's token ids, 4 bytes little-endian each. A load checks them, so a block
//!   saved under the wrong key is a miss, never a hit.
//! - **Load** (before the request enters the engine): `exists` for the prompt's complete blocks,
//!   then `get` of the leading run the store holds; the leading blocks whose bytes check are the
//!   request's lower-tier prefix. The engine model loads from it what its GPU prefix cache
//!   misses; those blocks count in `cached_tokens` and in `infera_mock_kvd_hit_tokens_total`.
//!   The lookup runs before the engine knows its GPU hit, so blocks the GPU still holds are read
//!   too (a cost of the simulation, not of a real connector, which asks only past the GPU hit).
//! - **Save** (when the request finishes, before its answer ends, as vLLM's connector saves
//!   before the request completes): the prompt's blocks after that prefix, with the request's
//!   `kv_transfer_params.infera_retention` (default `long`); `none` is never saved.
//! - A store that fails or times out costs the request nothing but the hit: the error is logged
//!   and counted (`infera_mock_kvd_errors_total`).

use super::metrics::MockMetrics;
use super::openai::ApiError;
use infera_core::event::Retention;
use infera_core::hashing::KvIdentity;
use infera_core::kv_events::kvd::identity_scope;
use infera_core::ports::kv_store::{BlockNamespace, KvBlockStore, StoredBlock, scoped_block_keys};
use serde_json::Value;
use std::sync::Arc;

/// Most keys in one store call; longer prompts are asked in several.
const MAX_KEYS_PER_CALL: usize = 4096;

/// The block store a mock engine saves to and loads from.
#[derive(Debug, Clone)]
pub struct MockKvStore {
    /// The store (kvd's client in the binary).
    pub store: Arc<dyn KvBlockStore>,
    /// The namespace's compat key (`""` as the prewarm's default).
    pub compat_key: String,
}

/// The store bound to one mock: its namespace and block size.
#[derive(Debug)]
pub(crate) struct Tier {
    store: Arc<dyn KvBlockStore>,
    ns: BlockNamespace,
    block_size: usize,
}

/// What a finished request saves.
#[derive(Debug)]
pub(crate) struct SaveJob {
    /// The keys of the prompt's complete blocks, and its tokens.
    pub keys: Vec<Vec<u8>>,
    pub tokens: Vec<u32>,
    /// Blocks before this one are in the store already.
    pub from: usize,
    pub retention: Retention,
}

/// The bytes a mock stores for a block: its token ids, 4 bytes little-endian each.
pub fn block_value(tokens: &[u32]) -> Vec<u8> {
    tokens.iter().flat_map(|t| t.to_le_bytes()).collect()
}

/// The request's `kv_transfer_params.infera_retention` (PROTOCOLS.md §5), `long` when absent.
///
/// # Errors
/// 400 when it is present and not a retention class.
pub(crate) fn retention_of(kv_transfer_params: Option<&Value>) -> Result<Retention, ApiError> {
    match kv_transfer_params.and_then(|p| p.get("infera_retention")) {
        None | Some(Value::Null) => Ok(Retention::Long),
        Some(Value::String(s)) => Retention::parse(s).ok_or_else(|| {
            ApiError::bad_request(format!(
                "kv_transfer_params.infera_retention {s:?} is not one of none, ephemeral, \
                 short, long"
            ))
        }),
        Some(other) => Err(ApiError::bad_request(format!(
            "kv_transfer_params.infera_retention must be a string, got {other}"
        ))),
    }
}

impl Tier {
    pub(crate) fn new(config: MockKvStore, model: &str, block_size: u32) -> Self {
        Self {
            store: config.store,
            ns: BlockNamespace {
                model: model.to_owned(),
                compat_key: config.compat_key,
            },
            block_size: block_size as usize,
        }
    }

    fn block_tokens<'a>(&self, tokens: &'a [u32], i: usize) -> &'a [u32] {
        tokens
            .get(i * self.block_size..(i + 1) * self.block_size)
            .unwrap_or_default()
    }

    /// Looks a request up before it enters the engine, its keys scoped by its identity (as the
    /// vLLM connector scopes them, so an adapter's or a tenant's blocks stay its own): the leading blocks the store holds, and
    /// what to save once it finished (`None` for retention `none`).
    pub(crate) async fn admit(
        &self,
        tokens: &[u32],
        identity: &KvIdentity,
        retention: Retention,
        metrics: &MockMetrics,
    ) -> (usize, Option<SaveJob>) {
        let keys = scoped_block_keys(tokens, self.block_size, &identity_scope(identity));
        let found = self.lookup(&keys, tokens, metrics).await;
        let save = (retention != Retention::None).then(|| SaveJob {
            tokens: tokens[..(keys.len() * self.block_size).min(tokens.len())].to_vec(),
            keys,
            from: found,
            retention,
        });
        (found, save)
    }

    /// How many leading blocks of the prompt the store holds with the expected bytes.
    async fn lookup(&self, keys: &[Vec<u8>], tokens: &[u32], metrics: &MockMetrics) -> usize {
        let mut found = 0;
        for keys in keys.chunks(MAX_KEYS_PER_CALL) {
            let present = match self.store.exists(&self.ns, keys).await {
                Ok(present) => present,
                Err(e) => return self.failed(found, "exists", &e, metrics),
            };
            let run = present.iter().take_while(|p| **p).count().min(keys.len());
            if run == 0 {
                break;
            }
            let values = match self.store.get(&self.ns, &keys[..run]).await {
                Ok(values) => values,
                Err(e) => return self.failed(found, "get", &e, metrics),
            };
            let start = found;
            let good = values
                .iter()
                .enumerate()
                .take_while(|(i, v)| {
                    v.as_deref()
                        .is_some_and(|v| v == block_value(self.block_tokens(tokens, start + i)))
                })
                .count();
            found += good;
            if good < keys.len() {
                break;
            }
        }
        metrics.kvd_loaded_blocks.inc_by(found as u64);
        found
    }

    fn failed(
        &self,
        found: usize,
        op: &str,
        error: &dyn std::error::Error,
        metrics: &MockMetrics,
    ) -> usize {
        tracing::warn!(op, error = %error, model = %self.ns.model,
            "kvd lookup failed; the request goes on without the blocks it did not get");
        metrics.kvd_errors.inc();
        metrics.kvd_loaded_blocks.inc_by(found as u64);
        found
    }

    /// Saves a finished request's blocks (see the module docs).
    pub(crate) async fn save(&self, job: SaveJob, metrics: &MockMetrics) {
        if job.retention == Retention::None || job.from >= job.keys.len() {
            return;
        }
        let blocks: Vec<StoredBlock> = job.keys[job.from..]
            .iter()
            .enumerate()
            .map(|(i, key)| StoredBlock {
                key: key.clone(),
                value: block_value(self.block_tokens(&job.tokens, job.from + i)),
            })
            .collect();
        for chunk in blocks.chunks(MAX_KEYS_PER_CALL) {
            match self
                .store
                .set(&self.ns, chunk.to_vec(), job.retention)
                .await
            {
                Ok(accepted) => {
                    metrics.kvd_saved_blocks.inc_by(accepted as u64);
                }
                Err(e) => {
                    tracing::warn!(error = %e, model = %self.ns.model,
                        "kvd save failed; these blocks will be recomputed by other engines");
                    metrics.kvd_errors.inc();
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn retention_comes_from_kv_transfer_params_and_defaults_to_long() {
        assert_eq!(retention_of(None).unwrap(), Retention::Long);
        assert_eq!(retention_of(Some(&json!({}))).unwrap(), Retention::Long);
        let none = json!({"infera_retention": "none"});
        assert_eq!(retention_of(Some(&none)).unwrap(), Retention::None);
        let short = json!({"infera_retention": "short"});
        assert_eq!(retention_of(Some(&short)).unwrap(), Retention::Short);
        assert!(retention_of(Some(&json!({"infera_retention": "forever"}))).is_err());
        assert!(retention_of(Some(&json!({"infera_retention": 3}))).is_err());
    }

    #[test]
    fn an_adapter_or_a_salt_scopes_the_keys_and_plain_text_does_not() {
        let plain = KvIdentity::default();
        let sql = KvIdentity {
            lora: Some("sql".into()),
            ..KvIdentity::default()
        };
        let chat = KvIdentity {
            lora: Some("chat".into()),
            ..KvIdentity::default()
        };
        assert!(identity_scope(&plain).is_empty());
        assert!(!identity_scope(&sql).is_empty());
        assert_ne!(identity_scope(&sql), identity_scope(&chat));
    }

    #[test]
    fn values_are_the_token_ids_little_endian() {
        assert_eq!(block_value(&[1, 256]), vec![1, 0, 0, 0, 0, 1, 0, 0]);
    }
}
