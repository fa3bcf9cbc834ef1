//! Typed events and their envelope: the only way router state changes.
//!
//! Every fact the router acts on is one [`Event`] wrapped in an [`Envelope`] and appended to the
//! [`crate::log::EventLog`]; projections ([`crate::fleet::FleetState`], the KV index) fold the log in
//! sequence order. Persisted form is JSON (`serde`), versioned by [`EVENT_FORMAT_VERSION`]; new fields
//! are `#[serde(default)]` so old logs keep parsing. A new kind of event is a new version, because a
//! build that does not know it cannot fold it: readers refuse envelopes newer than the version they
//! were built with (and say to upgrade) instead of failing on an unknown `type`.
//!
//! Each version has a golden file in `fixtures/events/` that must always decode, covering every
//! event kind of that version:
//!
//! | version | golden file | adds |
//! |---|---|---|
//! | 1 | `v1.jsonl` | the first eight kinds |
//! | 2 | `v2.jsonl` | [`Event::WorkerDraining`] |
//! | 3 | `v3.jsonl` | [`Event::RecentLoad`] |
//! | 4 | `v4.jsonl` | [`Event::TierLoadMeasured`] |
//! | 5 | `v5.jsonl` | [`Event::RouterRetuned`] |

use crate::clock::Micros;
use crate::ids::{BlockHash, EngineHash, RequestId, WorkerId, WorkerRank};
use serde::{Deserialize, Serialize};

/// The version written into every envelope (see the module docs for what each version added).
pub const EVENT_FORMAT_VERSION: u16 = 5;

/// Position of an event in one log. Starts at 1; 0 means "before the first event".
pub type Seq = u64;

/// Where an event came from, for gap detection and attribution.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Source {
    pub worker: WorkerId,
    #[serde(default)]
    pub dp_rank: u32,
    /// The source's own sequence number (e.g. the engine's ZMQ seq), if it has one.
    #[serde(default)]
    pub seq: Option<u64>,
}

/// An event as stored in a log.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Envelope {
    /// Format version of this record.
    #[serde(default = "default_version")]
    pub v: u16,
    /// Log sequence number, assigned by the log on append.
    pub seq: Seq,
    /// When the log accepted the event (microseconds on the log's clock).
    pub ts_us: Micros,
    #[serde(default)]
    pub source: Option<Source>,
    pub event: Event,
}

fn default_version() -> u16 {
    EVENT_FORMAT_VERSION
}

/// Every kind of fact in the log.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type")]
pub enum Event {
    WorkerRegistered(WorkerRegistered),
    WorkerDeregistered(WorkerDeregistered),
    /// Since v2.
    WorkerDraining(WorkerDraining),
    KvBlocksStored(KvBlocksStored),
    KvBlocksRemoved(KvBlocksRemoved),
    KvCacheCleared(KvCacheCleared),
    RequestRouted(RequestRouted),
    RequestPrefilled(RequestPrefilled),
    RequestFinished(RequestFinished),
    /// Since v3; written by snapshots only.
    RecentLoad(RecentLoad),
    /// Since v4.
    TierLoadMeasured(TierLoadMeasured),
    /// Since v5.
    RouterRetuned(RouterRetuned),
}

impl Event {
    /// A short name for logs and metrics labels.
    pub fn kind(&self) -> &'static str {
        match self {
            Event::WorkerRegistered(_) => "worker_registered",
            Event::WorkerDeregistered(_) => "worker_deregistered",
            Event::WorkerDraining(_) => "worker_draining",
            Event::KvBlocksStored(_) => "kv_blocks_stored",
            Event::KvBlocksRemoved(_) => "kv_blocks_removed",
            Event::KvCacheCleared(_) => "kv_cache_cleared",
            Event::RequestRouted(_) => "request_routed",
            Event::RequestPrefilled(_) => "request_prefilled",
            Event::RequestFinished(_) => "request_finished",
            Event::RecentLoad(_) => "recent_load",
            Event::TierLoadMeasured(_) => "tier_load_measured",
            Event::RouterRetuned(_) => "router_retuned",
        }
    }
}

/// Engines Infera launches. The wire value is what the Python server accepts (PROTOCOLS.md §1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Engine {
    Vllm,
    Sglang,
    Atom,
}

/// A worker's role in prefill/decode disaggregation.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Serialize, Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    #[default]
    Mixed,
    Prefill,
    Decode,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Mixed => "mixed",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

/// How a worker receives requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RequestTransport {
    #[default]
    Nats,
    Http,
}

/// The registration record a worker publishes (PROTOCOLS.md §1, compat).
///
/// Unknown fields are kept in `extra` so that a record written by a newer worker survives a round
/// trip through this server unchanged.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkerRecord {
    pub worker_id: WorkerId,
    pub url: String,
    pub model_name: String,
    pub engine: Engine,
    #[serde(default, deserialize_with = "null_as_mixed")]
    pub disagg_mode: Role,
    #[serde(default)]
    pub disagg_meta: Option<serde_json::Value>,
    #[serde(default)]
    pub kv_events_endpoint: Option<String>,
    /// Tokens per KV block; 0 when the worker does not say (the Python SGLang worker writes
    /// `null` with KV events off): such a worker is routed by load only.
    #[serde(default, deserialize_with = "null_as_zero")]
    pub kv_block_size: u32,
    #[serde(default)]
    pub dp_rank: u32,
    #[serde(default = "one")]
    pub dp_size: u32,
    #[serde(default)]
    pub request_transport: RequestTransport,
    #[serde(default)]
    pub kv: Option<serde_json::Value>,
    /// Fields this version does not know, kept verbatim.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

/// Our registration field (kept in [`WorkerRecord::extra`], which the Python server ignores):
/// the engine's KV-event replay socket, `tcp://HOST:PORT` of rank `dp_rank` (higher ranks add
/// their offset to the port, as for `kv_events_endpoint`).
pub const KV_EVENTS_REPLAY_ENDPOINT: &str = "kv_events_replay_endpoint";

/// Our registration field (in [`WorkerRecord::extra`]): the LoRA adapters the engine serves on
/// top of `model_name`, as the names clients send in `model` (vLLM's `--lora-modules NAME=…`,
/// listed by its `/v1/models` with `"parent": model_name`). A launcher re-registers when the
/// engine's list changes.
pub const LORA_ADAPTERS: &str = "lora_adapters";

/// Our registration field (in [`WorkerRecord::extra`]): the prompt tokens the engine prefills
/// in one step (vLLM's `--max-num-batched-tokens`, SGLang's `--chunked-prefill-size`), the
/// unit in which the router's queue measures a worker's saturation.
pub const MAX_NUM_BATCHED_TOKENS: &str = "max_num_batched_tokens";

/// Our registration field (in [`WorkerRecord::extra`]): the prompt tokens per second the
/// engine prefills, against which the router weighs loading a block from a lower tier.
pub const PREFILL_TOKENS_PER_S: &str = "prefill_tokens_per_s";

/// Our registration field (in [`WorkerRecord::extra`]): the engine's GPU KV cache in blocks
/// (vLLM's `num_gpu_blocks`), which the server's shadow replay sizes its simulated engines by.
pub const KV_CAPACITY_BLOCKS: &str = "kv_capacity_blocks";

/// The prefill speed of a worker that registers none: a mid-size dense model on one current
/// GPU (vLLM prefills 8B-class models at 10–30k tokens/s on an H100).
pub const DEFAULT_PREFILL_TOKENS_PER_S: f64 = 16_384.0;

/// The prefill budget of a worker that registers none: vLLM's default `max_num_batched_tokens`
/// for its OpenAI server.
pub const DEFAULT_PREFILL_BUDGET: u32 = 8192;

impl WorkerRecord {
    /// The prompt tokens the engine prefills in one step ([`MAX_NUM_BATCHED_TOKENS`], else
    /// [`DEFAULT_PREFILL_BUDGET`]).
    pub fn prefill_budget(&self) -> u32 {
        self.extra
            .get(MAX_NUM_BATCHED_TOKENS)
            .and_then(serde_json::Value::as_u64)
            .and_then(|n| u32::try_from(n).ok())
            .filter(|n| *n > 0)
            .unwrap_or(DEFAULT_PREFILL_BUDGET)
    }

    /// The prompt tokens per second the engine prefills ([`PREFILL_TOKENS_PER_S`], else
    /// [`DEFAULT_PREFILL_TOKENS_PER_S`]).
    pub fn prefill_tokens_per_s(&self) -> f64 {
        self.extra
            .get(PREFILL_TOKENS_PER_S)
            .and_then(serde_json::Value::as_f64)
            .filter(|v| v.is_finite() && *v > 0.0)
            .unwrap_or(DEFAULT_PREFILL_TOKENS_PER_S)
    }

    /// The engine's GPU KV cache in blocks ([`KV_CAPACITY_BLOCKS`]), if it says.
    pub fn kv_capacity_blocks(&self) -> Option<u64> {
        self.extra
            .get(KV_CAPACITY_BLOCKS)
            .and_then(serde_json::Value::as_u64)
            .filter(|n| *n > 0)
    }

    /// Advertises the engine's prefill budget.
    pub fn set_prefill_budget(&mut self, tokens: u32) {
        self.extra
            .insert(MAX_NUM_BATCHED_TOKENS.to_owned(), tokens.into());
    }

    /// A mixed (non-PD) worker of one DP rank reached over HTTP, with nothing else registered:
    /// the record a plain engine's launcher writes, and the base the others change.
    pub fn mixed(
        worker_id: WorkerId,
        url: String,
        model_name: &str,
        engine: Engine,
        kv_block_size: u32,
    ) -> Self {
        Self {
            worker_id,
            url,
            model_name: model_name.to_owned(),
            engine,
            disagg_mode: Role::Mixed,
            disagg_meta: None,
            kv_events_endpoint: None,
            kv_block_size,
            dp_rank: 0,
            dp_size: 1,
            request_transport: RequestTransport::Http,
            kv: None,
            extra: serde_json::Map::new(),
        }
    }

    /// The LoRA adapters the worker serves (see [`LORA_ADAPTERS`]); names that are not strings
    /// are ignored.
    pub fn lora_adapters(&self) -> impl Iterator<Item = &str> {
        self.extra
            .get(LORA_ADAPTERS)
            .and_then(serde_json::Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(serde_json::Value::as_str)
    }

    /// Advertises the adapters the worker serves (an empty list removes the field).
    pub fn set_lora_adapters(&mut self, adapters: &[String]) {
        if adapters.is_empty() {
            self.extra.remove(LORA_ADAPTERS);
        } else {
            self.extra
                .insert(LORA_ADAPTERS.to_owned(), adapters.to_vec().into());
        }
    }

    /// Whether the worker serves `model`: its base model or one of its adapters.
    pub fn serves(&self, model: &str) -> bool {
        self.model_name == model || self.lora_adapters().any(|a| a == model)
    }

    /// Where the engine replays KV-event batches it already published, if it says.
    pub fn kv_events_replay_endpoint(&self) -> Option<&str> {
        self.extra
            .get(KV_EVENTS_REPLAY_ENDPOINT)
            .and_then(serde_json::Value::as_str)
    }

    /// Advertises (or, with `None`, withdraws) the replay socket.
    pub fn set_kv_events_replay_endpoint(&mut self, endpoint: Option<String>) {
        match endpoint {
            Some(e) => {
                self.extra
                    .insert(KV_EVENTS_REPLAY_ENDPOINT.to_owned(), e.into());
            }
            None => {
                self.extra.remove(KV_EVENTS_REPLAY_ENDPOINT);
            }
        }
    }
}

fn one() -> u32 {
    1
}

fn null_as_zero<'de, D: serde::Deserializer<'de>>(d: D) -> Result<u32, D::Error> {
    Ok(Option::<u32>::deserialize(d)?.unwrap_or(0))
}

fn null_as_mixed<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Role, D::Error> {
    Ok(Option::<Role>::deserialize(d)?.unwrap_or_default())
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkerRegistered {
    pub record: WorkerRecord,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkerDeregistered {
    pub worker: WorkerId,
    /// Why it left (lease expired, pod deleted, shutdown…), for operators.
    #[serde(default)]
    pub reason: String,
}

/// A registered worker is shutting down (a Kubernetes Pod with a `deletionTimestamp`): it stays
/// listed and finishes its in-flight work, but takes no new requests. A later `WorkerRegistered`
/// for it cancels the drain; a `WorkerDeregistered` ends it. Ignored for a worker that is not
/// registered. Since format v2.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkerDraining {
    pub worker: WorkerId,
    /// Why it drains, for operators.
    #[serde(default)]
    pub reason: String,
}

/// The recent-pick window of an older load model (a decayed charge per pick) as format v3
/// snapshots kept it: the blocks charged to each rank per time bucket. Since format v3. The
/// fleet no longer keeps such a window (its load is what is in flight, [`crate::fleet`]): it
/// still parses, folds as nothing, and no snapshot writes it anymore.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RecentLoad {
    /// When the latest pick was made: where the window ends.
    pub latest_us: Micros,
    /// Oldest first.
    pub buckets: Vec<RecentLoadBucket>,
}

/// One time bucket of a [`RecentLoad`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RecentLoadBucket {
    /// The bucket's start.
    pub at_us: Micros,
    pub charges: Vec<RecentCharge>,
}

/// The blocks that picks in one bucket charged to one rank.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RecentCharge {
    pub worker: WorkerRank,
    pub blocks: u64,
}

/// How fast a source of KV blocks (a kvd, an engine's own offload tiers) loads blocks of one
/// tier back into an engine: the median of its recent loads. The router credits a hit in that
/// tier by it (`policy::tiers`). Since v4.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TierLoadMeasured {
    pub source: WorkerRank,
    pub tier: Tier,
    /// Bytes per second, the median of the source's recent loads from the tier.
    pub bytes_per_s: f64,
    /// The mean size of the blocks it loaded, in bytes.
    pub block_bytes: u64,
}

/// The router's tunables changed at run time (`infera server --auto-tune apply`): the decisions
/// after this event use `to`. It carries what decided the change, so a replay of the log (and
/// an operator reading it) sees who moved the router, when, from where to where, and on what
/// evidence. Since v5.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RouterRetuned {
    pub from: Tunables,
    pub to: Tunables,
    /// Who changed it (`auto-tune`).
    pub by: String,
    /// `adopt` (the shadow replay predicted a gain) or `rollback` (the gain did not come).
    pub reason: String,
    /// The shadow replay's hit rate for `to` over the window that decided (a fraction of the
    /// prompt tokens).
    #[serde(default)]
    pub predicted_hit_rate: Option<f64>,
    /// The hit rate the engines reported over that window, under `from`.
    #[serde(default)]
    pub realised_hit_rate: Option<f64>,
}

/// The router's settings that `infera server --auto-tune` searches (see `policy::RouterConfig`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Tunables {
    /// `--kv-overlap-weight`.
    pub overlap_weight: f64,
    /// `--kv-prefill-overlap-weight`, on a disaggregated fleet.
    #[serde(default)]
    pub prefill_overlap_weight: Option<f64>,
    /// `--router-resident-weight`.
    pub resident_weight: f64,
    /// `--router-balance-tokens`.
    pub balance_tokens: u32,
}

/// Where a cached block lives, fastest first.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Serialize, Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Tier {
    #[default]
    Gpu,
    Host,
    Disk,
    External,
}

impl Tier {
    pub const ALL: [Tier; 4] = [Tier::Gpu, Tier::Host, Tier::Disk, Tier::External];

    pub fn index(self) -> usize {
        self as usize
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Tier::Gpu => "gpu",
            Tier::Host => "host",
            Tier::Disk => "disk",
            Tier::External => "external",
        }
    }
}

/// Blocks an engine stored, as consecutive blocks of one sequence.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KvBlocksStored {
    pub worker: WorkerRank,
    #[serde(default)]
    pub tier: Tier,
    pub block_size: u32,
    /// The engine's keys, one per block.
    pub engine_hashes: Vec<EngineHash>,
    /// The router's hashes of the same blocks, computed from the event's token ids.
    pub router_hashes: Vec<BlockHash>,
    /// The engine key of the block before the first one, if any.
    #[serde(default)]
    pub parent: Option<EngineHash>,
}

/// Blocks an engine evicted.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KvBlocksRemoved {
    pub worker: WorkerRank,
    #[serde(default)]
    pub tier: Tier,
    pub engine_hashes: Vec<EngineHash>,
    /// The router hashes the engine keys mapped to when the event was ingested (informative; the
    /// index resolves removals through its own map).
    #[serde(default)]
    pub router_hashes: Vec<BlockHash>,
}

/// An engine dropped its whole cache (or restarted).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KvCacheCleared {
    pub worker: WorkerRank,
    /// `None` clears every tier.
    #[serde(default)]
    pub tier: Option<Tier>,
}

/// Retention class of a request's KV blocks (PROTOCOLS.md §5), lowest to highest.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Serialize, Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Retention {
    None,
    Ephemeral,
    Short,
    #[default]
    Long,
}

impl Retention {
    pub const ALL: [Retention; 4] = [
        Retention::None,
        Retention::Ephemeral,
        Retention::Short,
        Retention::Long,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Retention::None => "none",
            Retention::Ephemeral => "ephemeral",
            Retention::Short => "short",
            Retention::Long => "long",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "none" => Retention::None,
            "ephemeral" => Retention::Ephemeral,
            "short" => Retention::Short,
            "long" => Retention::Long,
            _ => return None,
        })
    }
}

/// One scored candidate of a routing decision, kept for "why did it go there".
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CandidateScore {
    pub worker: WorkerRank,
    pub overlap_blocks: u32,
    pub cost: f64,
}

/// One leg of a routed request (a single leg, or the prefill and decode legs in PD mode).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RoutedLeg {
    pub worker: WorkerRank,
    pub role: Role,
    pub overlap_blocks: u32,
}

/// The router's decision for one request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RequestRouted {
    pub request_id: RequestId,
    pub model: String,
    pub legs: Vec<RoutedLeg>,
    /// The request's complete-block router hashes (at the chosen worker's block size).
    pub blocks: Vec<BlockHash>,
    /// Prompt tokens (for queued-prefill accounting).
    #[serde(default)]
    pub prompt_tokens: u32,
    pub policy: String,
    /// The overlap weight(s) used, by role.
    #[serde(default)]
    pub weights: Vec<(Role, f64)>,
    /// The best few candidates, cheapest first.
    #[serde(default)]
    pub top: Vec<CandidateScore>,
    /// The client's retention hint, if it gave one (it scales the overlap weight).
    #[serde(default)]
    pub retention: Option<Retention>,
    /// When the decision was made (microseconds on the router's clock); load decay is computed
    /// from this, so a rebuilt state decays exactly like the original.
    pub at_us: Micros,
    /// The tenant the request was admitted for (`--api-keys`; absent without a key file):
    /// replicas sharing a durable log charge each other's requests to their tenants' limits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    /// The request's conversation, when the client named one: every replica pins the session to
    /// the legs' ranks (see `fleet::sessions`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<crate::ids::SessionKey>,
}

/// The request's prompt has been processed (first token produced): it no longer queues prefill.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RequestPrefilled {
    pub request_id: RequestId,
}

/// How a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RequestStatus {
    Ok,
    ClientError,
    Cancelled,
    WorkerError,
    Timeout,
    Rejected,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RequestFinished {
    pub request_id: RequestId,
    pub status: RequestStatus,
    /// Time to first token, if one was produced.
    #[serde(default)]
    pub ttft_us: Option<u64>,
    #[serde(default)]
    pub tokens_in: u32,
    #[serde(default)]
    pub tokens_out: u32,
    /// `usage.prompt_tokens_details.cached_tokens` as the engine reported it.
    #[serde(default)]
    pub cached_tokens: Option<u32>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registration_record_parses_python_shape_and_keeps_unknown_fields() {
        let json = r#"{"worker_id":"10.0.0.5:30000","url":"http://10.0.0.5:30000",
            "model_name":"m","engine":"sglang","disagg_mode":null,"disagg_meta":null,
            "kv_events_endpoint":"tcp://10.0.0.5:5557","kv_block_size":16,"dp_rank":0,
            "dp_size":1,"request_transport":"http","capacity_blocks":4096}"#;
        let r: WorkerRecord = serde_json::from_str(json).expect("parse");
        assert_eq!(r.disagg_mode, Role::Mixed);
        assert_eq!(r.engine, Engine::Sglang);
        assert_eq!(r.extra["capacity_blocks"], 4096);
        let back = serde_json::to_value(&r).expect("ser");
        assert_eq!(back["capacity_blocks"], 4096);
    }

    #[test]
    fn a_null_block_size_means_unknown() {
        let json = r#"{"worker_id":"a:1","url":"http://a:1","model_name":"m","engine":"sglang",
            "kv_block_size":null,"kv_events_endpoint":null}"#;
        let r: WorkerRecord = serde_json::from_str(json).expect("parse");
        assert_eq!(r.kv_block_size, 0);
    }

    #[test]
    fn unknown_engine_is_rejected() {
        let json = r#"{"worker_id":"a:1","url":"http://a:1","model_name":"m","engine":"mock",
            "kv_block_size":16}"#;
        assert!(serde_json::from_str::<WorkerRecord>(json).is_err());
    }

    /// The kinds of a golden file, checking that every line is an envelope of `version` and
    /// survives a round trip unchanged.
    fn golden_kinds(text: &str, version: u16) -> std::collections::BTreeSet<&'static str> {
        let mut kinds = std::collections::BTreeSet::new();
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            let env: Envelope = serde_json::from_str(line).expect("golden event");
            assert_eq!(env.v, version, "{line}");
            let again: Envelope =
                serde_json::from_str(&serde_json::to_string(&env).expect("encode"))
                    .expect("decode");
            assert_eq!(again, env);
            kinds.insert(env.event.kind());
        }
        kinds
    }

    #[test]
    fn golden_v1_event_log_still_parses() {
        let kinds = golden_kinds(include_str!("../../fixtures/events/v1.jsonl"), 1);
        assert_eq!(
            kinds.len(),
            8,
            "v1 golden file covers v1's kinds: {kinds:?}"
        );
        assert!(!kinds.contains("worker_draining"));
    }

    #[test]
    fn golden_v2_event_log_still_parses() {
        let kinds = golden_kinds(include_str!("../../fixtures/events/v2.jsonl"), 2);
        assert_eq!(
            kinds.len(),
            9,
            "v2 golden file covers v2's kinds: {kinds:?}"
        );
        assert!(!kinds.contains("recent_load"));
    }

    #[test]
    fn golden_v3_event_log_still_parses() {
        let kinds = golden_kinds(include_str!("../../fixtures/events/v3.jsonl"), 3);
        assert_eq!(
            kinds.len(),
            10,
            "v3 golden file covers v3's kinds: {kinds:?}"
        );
        assert!(!kinds.contains("tier_load_measured"));
    }

    #[test]
    fn golden_v4_event_log_still_parses() {
        let kinds = golden_kinds(include_str!("../../fixtures/events/v4.jsonl"), 4);
        assert_eq!(
            kinds.len(),
            11,
            "v4 golden file covers v4's kinds: {kinds:?}"
        );
        assert!(!kinds.contains("router_retuned"));
    }

    #[test]
    fn golden_v5_event_log_covers_every_kind() {
        let kinds = golden_kinds(include_str!("../../fixtures/events/v5.jsonl"), 5);
        assert_eq!(
            EVENT_FORMAT_VERSION, 5,
            "a new version needs its own golden file"
        );
        assert_eq!(
            kinds.len(),
            12,
            "v5 golden file covers every kind: {kinds:?}"
        );
    }

    #[test]
    fn a_draining_event_without_a_reason_reads_as_empty() {
        let json = r#"{"type":"WorkerDraining","worker":"a:1"}"#;
        let event: Event = serde_json::from_str(json).expect("parse");
        assert_eq!(
            event,
            Event::WorkerDraining(WorkerDraining {
                worker: WorkerId::new("a:1"),
                reason: String::new(),
            })
        );
        assert_eq!(event.kind(), "worker_draining");
    }
}
