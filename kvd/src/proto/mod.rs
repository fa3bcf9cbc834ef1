//! The kvd wire protocol (PROTOCOLS.md §6, compatible with the Python Infera kvd and its vLLM
//! connector): typed requests and replies, and their msgpack codecs for both directions.
//!
//! # Frame layout
//! ```text
//! +----------------------+------------------------------------------------+
//! | u32 big-endian  len  | msgpack map, len bytes: {"op": NAME, ...fields} |
//! +----------------------+------------------------------------------------+
//! ```
//! Keys and values are msgpack `bin`, strings `str`, missing or `nil` optional fields take their
//! defaults. Every op except `hello` and `stats` carries `model` and `compat_key` (default `""`),
//! which namespace the keys. A request may carry an `id` (any msgpack scalar); the reply echoes
//! it, so a client can pipeline. Replies are always sent in request order.
//!
//! Extensions an old (Python) peer never sees: `id` is echoed only when sent; `stats` answers the
//! extra counters (per class, expiries, rejections) only when the request says `extended: true`,
//! because the Python client builds its reply dataclasses with `cls(**fields)` and refuses unknown
//! fields.
//!
//! # Errors
//! A frame whose body is not a msgpack map is *broken* ([`FrameError`]): the server answers
//! `error{code, message}` and closes. A well-formed map with an unknown op or a bad field is a
//! [`RequestError`]: the server answers `error` and the connection stays usable.
//!
//! Decoding is zero-copy for values: `bin` fields become [`Bytes`] slices of the frame buffer
//! (a value much smaller than its frame is copied, so one stored block never pins a large batch
//! frame; lookup keys are always slices, as they live only while the request is answered).
//!
//! # Decode cost
//! A frame is validated in one allocation-free pass (`msgpack.rs`), then only its top-level
//! fields (at most [`MAX_FIELDS`]) are kept as slices, and typed values are built from
//! validated lengths. A batch longer than [`Limits::max_keys`] is refused (`too_many_keys`)
//! before any of it is built. So a frame of `n` bytes decodes to at most `48 n` bytes (the
//! property test's bound, reached by `batch_set` items of one-byte fields; a lookup of
//! one-byte keys costs about `11 n`: one 32-byte handle per 3-byte key), and a whole request
//! is bounded by the batch limit: a full batch of [`DEFAULT_MAX_BATCH_KEYS`] one-byte keys,
//! answered, peaks at about 80 MiB in the daemon (lookup, reply and its encoding included).
//!
//! Encoding returns the frame as a list of [`Bytes`] parts, large values as their own parts,
//! so a reply is written without copying its blocks.
//!
//! # Shared arena
//! A client that says `hello{prefers_shared_arena: true}` to a daemon with an arena gets
//! `hello_ack.shared_arena = [arena_size, slot_size, server_pid]` followed on the same socket by
//! one byte `F` carrying the arena memfd as `SCM_RIGHTS` ancillary data. From then on its `get`
//! and `batch_get` of arena-resident values are answered with [`Response::GetShared`] /
//! [`Response::BatchGetShared`] (offsets, never bytes; a miss is still `get_response{nil}`), and
//! it may write through `set_reserve` → its own mmap → `set_commit`. The slot layout is in
//! [`crate::arena`].
//!
//! # Inventory endpoints
//! A daemon that publishes its inventory ([`crate::inventory`]) adds to `hello_ack` our fields
//! `kv_events_endpoint` and `kv_events_replay_endpoint` (strings, the bound endpoints; omitted
//! when off). Decoders ignore fields they do not know, so older clients read the reply as
//! before.
//!
//! Files: `mod.rs` (the types), `encode.rs`, `msgpack.rs` (the validating reader),
//! `fields.rs` (typed access to a decoded map, the limits), `decode.rs`.

mod decode;
mod encode;
mod fields;
mod msgpack;
#[cfg(test)]
mod tests;

pub use decode::{decode_request, decode_response};
pub use encode::{Encoder, frame_len};
pub use fields::{Limits, MAX_FIELDS};

use bytes::Bytes;
use infera_core::event::Retention;
use rmpv::Value;

/// The protocol version this crate speaks (`hello.protocol_version`).
pub const PROTOCOL_VERSION: u64 = 1;
/// The default largest frame accepted: 64 MiB of payload plus 1 MiB for the envelope.
pub const DEFAULT_MAX_FRAME_BYTES: usize = (64 << 20) + (1 << 20);
/// The default most keys (or items) in one batch request (`--max-batch-keys`): a 1M-token
/// context in 16-token blocks is 65,536; beyond this a batch is refused with `too_many_keys`.
pub const DEFAULT_MAX_BATCH_KEYS: usize = 131_072;
/// Values at least this large are written as their own frame part instead of being copied.
pub(crate) const ZERO_COPY_PART: usize = 8 << 10;
/// Deepest msgpack nesting accepted in a request (metadata maps included).
pub(crate) const MAX_DEPTH: usize = 32;

use std::sync::Arc;

/// The namespace of a key: `(model, compat_key)`; shared, so every block of a namespace
/// refers to one copy of it and cloning it allocates nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Namespace {
    /// The model name.
    pub model: Arc<str>,
    /// Anything else that makes blocks incompatible (quantization, layout, ...).
    pub compat_key: Arc<str>,
}

impl Namespace {
    /// A namespace from its two parts.
    pub fn new(model: impl Into<Arc<str>>, compat_key: impl Into<Arc<str>>) -> Self {
        Self {
            model: model.into(),
            compat_key: compat_key.into(),
        }
    }
}

/// One item of a `set` or `batch_set`.
#[derive(Debug, Clone, PartialEq)]
pub struct SetItem {
    /// The block key (the engine's block hash).
    pub key: Bytes,
    /// The block bytes.
    pub value: Bytes,
    /// The retention class (default `short`).
    pub retention: Retention,
    /// Engine metadata, stored and not interpreted: its msgpack encoding, `None` for `{}`.
    pub metadata: Option<Bytes>,
    /// Time to live; `None` for no expiry. Zero or negative: accepted and not stored.
    pub ttl_seconds: Option<f64>,
}

impl SetItem {
    /// A `short` item without TTL or metadata.
    pub fn new(key: impl Into<Bytes>, value: impl Into<Bytes>) -> Self {
        Self {
            key: key.into(),
            value: value.into(),
            retention: Retention::Short,
            metadata: None,
            ttl_seconds: None,
        }
    }

    /// The same item with another retention class.
    pub fn retention(mut self, retention: Retention) -> Self {
        self.retention = retention;
        self
    }

    /// The same item with a TTL.
    pub fn ttl_seconds(mut self, ttl: f64) -> Self {
        self.ttl_seconds = Some(ttl);
        self
    }
}

/// A request frame's op and fields.
#[derive(Debug, Clone, PartialEq)]
pub enum Request {
    /// `hello{client_id, protocol_version, prefers_shared_arena}`.
    Hello {
        client_id: String,
        protocol_version: u64,
        prefers_shared_arena: bool,
    },
    /// `get{key}`.
    Get { ns: Namespace, key: Bytes },
    /// `batch_get{keys}`.
    BatchGet { ns: Namespace, keys: Vec<Bytes> },
    /// `set{key, value, retention, metadata, ttl_seconds}`.
    Set { ns: Namespace, item: SetItem },
    /// `batch_set{keys, values, retentions, metadatas, ttls_seconds}` (parallel arrays).
    BatchSet { ns: Namespace, items: Vec<SetItem> },
    /// `set_reserve{size}` (shared arena).
    SetReserve { size: u64 },
    /// `set_commit{lease_token, key, length, retention, ttl_seconds}` (shared arena); a
    /// `ttl_seconds` of 0 means no expiry.
    SetCommit {
        ns: Namespace,
        lease_token: u64,
        key: Bytes,
        length: u64,
        retention: Retention,
        ttl_seconds: u64,
    },
    /// `set_cancel{lease_token}` (shared arena).
    SetCancel { lease_token: u64 },
    /// `prefetch_hint{keys, deadline_ms}`: one-way, no reply.
    PrefetchHint {
        ns: Namespace,
        keys: Vec<Bytes>,
        deadline_ms: u64,
    },
    /// `exists{keys}`.
    Exists { ns: Namespace, keys: Vec<Bytes> },
    /// `clear{}`: the namespace, or everything when both parts are empty.
    Clear { ns: Namespace },
    /// `stats{extended}`; `extended` is ours.
    Stats { extended: bool },
}

impl Request {
    /// The op name on the wire.
    pub fn op(&self) -> &'static str {
        match self {
            Request::Hello { .. } => "hello",
            Request::Get { .. } => "get",
            Request::BatchGet { .. } => "batch_get",
            Request::Set { .. } => "set",
            Request::BatchSet { .. } => "batch_set",
            Request::SetReserve { .. } => "set_reserve",
            Request::SetCommit { .. } => "set_commit",
            Request::SetCancel { .. } => "set_cancel",
            Request::PrefetchHint { .. } => "prefetch_hint",
            Request::Exists { .. } => "exists",
            Request::Clear { .. } => "clear",
            Request::Stats { .. } => "stats",
        }
    }

    /// Whether the server answers this request (`prefetch_hint` is one-way).
    pub fn expects_reply(&self) -> bool {
        !matches!(self, Request::PrefetchHint { .. })
    }
}

/// The counters of `stats_response`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StatsReply {
    pub entries: u64,
    pub host_bytes: u64,
    pub spillover_bytes: u64,
    pub long_bytes: u64,
    pub gets_total: u64,
    pub sets_total: u64,
    pub hits_total: u64,
    pub misses_total: u64,
    pub evictions_total: u64,
    /// Ours, present when the request asked for `extended`.
    pub extended: Option<ExtendedStats>,
}

/// Our additions to `stats_response`, sent only when the request says `extended: true`.
///
/// On the wire each field is one `name: uint` entry of the reply map (the per-class arrays as
/// `<class>_entries` and `<class>_class_bytes`), so [`ExtendedStats::fields`] is the one list
/// both codecs walk.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExtendedStats {
    /// Bytes charged against `--max-bytes` (values, keys, metadata and per-entry overhead).
    pub accounted_bytes: u64,
    /// `--max-bytes`.
    pub max_bytes: u64,
    /// Entries removed because their TTL passed.
    pub expired_total: u64,
    /// Writes answered `accepted=false`.
    pub rejected_total: u64,
    /// `prefetch_hint` frames received.
    pub prefetch_hints_total: u64,
    /// Blocks a prefetch hint promoted from L3 into L2.
    pub prefetch_promoted_total: u64,
    /// Hints dropped because the prefetch queue was full or their deadline passed.
    pub prefetch_dropped_total: u64,
    /// Per class, lowest first (`none`, `ephemeral`, `short`, `long`): entries held.
    pub class_entries: [u64; 4],
    /// Per class: bytes charged against `--max-bytes`.
    pub class_bytes: [u64; 4],
    /// The shared arena's size (0 = no arena).
    pub arena_bytes: u64,
    /// Its slot size (0 until the first write decides it).
    pub arena_slot_bytes: u64,
    /// L2 entries whose bytes live in the arena.
    pub arena_entries: u64,
    /// Open `set_reserve` leases.
    pub arena_leases: u64,
    /// Entries moved out of the arena to the heap to free a slot for a lease.
    pub arena_demotions_total: u64,
    /// L3 entries (all shards).
    pub l3_entries: u64,
    /// L3 region size.
    pub l3_capacity_bytes: u64,
    /// Blocks read from L3 (gets and prefetches).
    pub l3_reads_total: u64,
    /// Blocks written to L3.
    pub l3_writes_total: u64,
    /// `short` blocks written to L3 when L2 evicted them.
    pub l3_spills_total: u64,
    /// L3 reads whose slot failed its key, generation or checksum check (answered as a miss).
    pub l3_verify_failures_total: u64,
    /// L3 reads or writes the kernel failed.
    pub l3_io_errors_total: u64,
    /// L3 journal `fdatasync`s (durable writes share them).
    pub l3_journal_syncs_total: u64,
    /// L3 entries evicted to make room.
    pub l3_evictions_total: u64,
    /// L3 writes refused (no room without displacing a higher class, or too large).
    pub l3_rejected_total: u64,
    /// 1 when L3 uses O_DIRECT.
    pub l3_direct_io: u64,
    /// 1 when L3 uses io_uring.
    pub l3_io_uring: u64,
    /// The L4 tier's counters, on the wire as `l4_<field>`.
    pub l4: crate::stats::L4Stats,
}

impl ExtendedStats {
    /// Every field as `(wire name, value)`, in a stable order.
    pub fn fields(&self) -> Vec<(String, u64)> {
        let mut out: Vec<(String, u64)> = [
            ("accounted_bytes", self.accounted_bytes),
            ("max_bytes", self.max_bytes),
            ("expired_total", self.expired_total),
            ("rejected_total", self.rejected_total),
            ("prefetch_hints_total", self.prefetch_hints_total),
            ("prefetch_promoted_total", self.prefetch_promoted_total),
            ("prefetch_dropped_total", self.prefetch_dropped_total),
            ("arena_bytes", self.arena_bytes),
            ("arena_slot_bytes", self.arena_slot_bytes),
            ("arena_entries", self.arena_entries),
            ("arena_leases", self.arena_leases),
            ("arena_demotions_total", self.arena_demotions_total),
            ("l3_entries", self.l3_entries),
            ("l3_capacity_bytes", self.l3_capacity_bytes),
            ("l3_reads_total", self.l3_reads_total),
            ("l3_writes_total", self.l3_writes_total),
            ("l3_spills_total", self.l3_spills_total),
            ("l3_verify_failures_total", self.l3_verify_failures_total),
            ("l3_io_errors_total", self.l3_io_errors_total),
            ("l3_journal_syncs_total", self.l3_journal_syncs_total),
            ("l3_evictions_total", self.l3_evictions_total),
            ("l3_rejected_total", self.l3_rejected_total),
            ("l3_direct_io", self.l3_direct_io),
            ("l3_io_uring", self.l3_io_uring),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
        for class in Retention::ALL {
            let c = class as usize;
            out.push((format!("{}_entries", class.as_str()), self.class_entries[c]));
            out.push((
                format!("{}_class_bytes", class.as_str()),
                self.class_bytes[c],
            ));
        }
        out.extend(self.l4.fields().map(|(k, v)| (format!("l4_{k}"), v)));
        out
    }

    /// The inverse of [`ExtendedStats::fields`]: `get` answers a field by name (0 if absent).
    pub fn from_fields(get: impl Fn(&str) -> u64) -> Self {
        let mut x = Self {
            accounted_bytes: get("accounted_bytes"),
            max_bytes: get("max_bytes"),
            expired_total: get("expired_total"),
            rejected_total: get("rejected_total"),
            prefetch_hints_total: get("prefetch_hints_total"),
            prefetch_promoted_total: get("prefetch_promoted_total"),
            prefetch_dropped_total: get("prefetch_dropped_total"),
            arena_bytes: get("arena_bytes"),
            arena_slot_bytes: get("arena_slot_bytes"),
            arena_entries: get("arena_entries"),
            arena_leases: get("arena_leases"),
            arena_demotions_total: get("arena_demotions_total"),
            l3_entries: get("l3_entries"),
            l3_capacity_bytes: get("l3_capacity_bytes"),
            l3_reads_total: get("l3_reads_total"),
            l3_writes_total: get("l3_writes_total"),
            l3_spills_total: get("l3_spills_total"),
            l3_verify_failures_total: get("l3_verify_failures_total"),
            l3_io_errors_total: get("l3_io_errors_total"),
            l3_journal_syncs_total: get("l3_journal_syncs_total"),
            l3_evictions_total: get("l3_evictions_total"),
            l3_rejected_total: get("l3_rejected_total"),
            l3_direct_io: get("l3_direct_io"),
            l3_io_uring: get("l3_io_uring"),
            l4: crate::stats::L4Stats::from_fields(|name| get(&format!("l4_{name}"))),
            ..Self::default()
        };
        for class in Retention::ALL {
            let c = class as usize;
            x.class_entries[c] = get(&format!("{}_entries", class.as_str()));
            x.class_bytes[c] = get(&format!("{}_class_bytes", class.as_str()));
        }
        x
    }
}

/// `set_ack{accepted, reason}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SetAck {
    pub accepted: bool,
    /// Why a write was refused (`would_displace_higher_priority`, ...); `None` when accepted.
    pub reason: Option<String>,
}

impl SetAck {
    /// An accepted write.
    pub fn accepted() -> Self {
        Self {
            accepted: true,
            reason: None,
        }
    }

    /// A refused write.
    pub fn rejected(reason: &str) -> Self {
        Self {
            accepted: false,
            reason: Some(reason.to_owned()),
        }
    }
}

/// Where an arena-resident value lies: what `get_shared_response` carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SharedSlot {
    /// Offset of the payload in the arena (past the slot header).
    pub slot_offset: u64,
    /// Payload length.
    pub length: u64,
    /// The (even) slot version the reader must see before and after reading.
    pub version: u64,
    /// The entry's class.
    pub retention: Option<Retention>,
    /// The arena's slot size.
    pub slot_size: u64,
}

/// A reply frame.
#[derive(Debug, Clone, PartialEq)]
// `Stats` carries our extended counters inline; replies are built once per request and encoded
// at once, so boxing them would buy nothing.
#[allow(clippy::large_enum_variant)]
pub enum Response {
    /// `hello_ack{server_id, protocol_version, shared_arena: [arena_size, slot_size, pid] | nil}`,
    /// with ours `kv_events_endpoint` and `kv_events_replay_endpoint` when publishing.
    HelloAck {
        server_id: String,
        protocol_version: u64,
        shared_arena: Option<[u64; 3]>,
        /// Where the daemon publishes its inventory (omitted on the wire when `None`).
        kv_events_endpoint: Option<String>,
        /// Its replay socket (omitted on the wire when `None`).
        kv_events_replay_endpoint: Option<String>,
    },
    /// `get_response{value, retention}`; both nil on a miss.
    Get {
        value: Option<Bytes>,
        retention: Option<Retention>,
    },
    /// `batch_get_response{values, retentions}`, in request order.
    BatchGet {
        values: Vec<Option<Bytes>>,
        retentions: Vec<Option<Retention>>,
    },
    /// `get_shared_response{slot_offset, length, version, retention, slot_size}` (arena clients):
    /// `slot_offset` is the payload's offset in the arena; its 16-byte slot header sits just
    /// before it and must show `version` before and after the read.
    GetShared(SharedSlot),
    /// `batch_get_shared_response{offsets, lengths, versions, retentions, slot_size}`; a miss
    /// is `None` (offset -1, length 0 on the wire).
    BatchGetShared {
        slots: Vec<Option<SharedSlot>>,
        slot_size: u64,
    },
    /// `set_ack`.
    SetAck(SetAck),
    /// `batch_set_ack{accepted, reasons}`, in request order.
    BatchSetAck(Vec<SetAck>),
    /// `set_reserve_response{...}`; `lease_token` 0 is a refusal with `reason`.
    SetReserve {
        lease_token: u64,
        slot_id: i64,
        payload_offset: u64,
        payload_max_size: u64,
        reason: String,
    },
    /// `set_commit_response{accepted, reason}`.
    SetCommit { accepted: bool, reason: String },
    /// `set_cancel_response{}`.
    SetCancel,
    /// `exists_response{present}`.
    Exists { present: Vec<bool> },
    /// `clear_ack{cleared_entries}`.
    Clear { cleared_entries: u64 },
    /// `stats_response{...}`.
    Stats(StatsReply),
    /// `error{code, message}`.
    Error { code: String, message: String },
}

impl Response {
    /// The op name on the wire.
    pub fn op(&self) -> &'static str {
        match self {
            Response::HelloAck { .. } => "hello_ack",
            Response::Get { .. } => "get_response",
            Response::BatchGet { .. } => "batch_get_response",
            Response::GetShared(_) => "get_shared_response",
            Response::BatchGetShared { .. } => "batch_get_shared_response",
            Response::SetAck(_) => "set_ack",
            Response::BatchSetAck(_) => "batch_set_ack",
            Response::SetReserve { .. } => "set_reserve_response",
            Response::SetCommit { .. } => "set_commit_response",
            Response::SetCancel => "set_cancel_response",
            Response::Exists { .. } => "exists_response",
            Response::Clear { .. } => "clear_ack",
            Response::Stats(_) => "stats_response",
            Response::Error { .. } => "error",
        }
    }

    /// An `error` reply.
    pub fn error(code: &str, message: impl Into<String>) -> Self {
        Response::Error {
            code: code.to_owned(),
            message: message.into(),
        }
    }
}

/// A frame that cannot be parsed at all: answered with an error, then the connection closes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// The length prefix exceeds the configured maximum.
    #[error("frame of {len} bytes exceeds the maximum frame size of {max} bytes; split the batch")]
    TooLarge { len: u64, max: usize },
    /// The stream ended inside a frame.
    #[error("connection closed inside a frame: got {got} of {want} bytes")]
    Truncated { got: usize, want: usize },
    /// The body is not one msgpack value, or not a map.
    #[error("frame body is not a msgpack map: {0}")]
    Malformed(String),
    /// A started frame did not arrive whole in time (a stalled or half-sent frame).
    #[error(
        "the frame did not arrive within {after_ms} ms of its first byte (got {got} of {want} \
         bytes); send each frame whole"
    )]
    TimedOut {
        got: usize,
        want: usize,
        after_ms: u64,
    },
}

impl FrameError {
    /// The `error.code` for this failure.
    pub fn code(&self) -> &'static str {
        match self {
            FrameError::TooLarge { .. } => "frame_too_large",
            FrameError::Truncated { .. } => "truncated_frame",
            FrameError::Malformed(_) => "bad_frame",
            FrameError::TimedOut { .. } => "frame_timeout",
        }
    }
}

/// A well-formed frame with an unknown op or a bad field; the connection stays usable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct RequestError {
    /// `unknown_op`, `bad_request`, `batch_set_arity_mismatch` or `too_many_keys`.
    pub code: &'static str,
    /// What was wrong, naming the field.
    pub message: String,
}

impl RequestError {
    pub(crate) fn field(op: &str, field: &str, expected: &str) -> Self {
        Self {
            code: "bad_request",
            message: format!("{op}: field `{field}` must be {expected}"),
        }
    }

    /// The `error` reply for this failure.
    pub fn to_response(&self) -> Response {
        Response::error(self.code, self.message.clone())
    }
}

/// A decoded request frame: its `id` (echoed in the reply) and the request or why it is invalid.
#[derive(Debug, Clone, PartialEq)]
pub struct DecodedRequest {
    pub id: Option<Value>,
    pub request: Result<Request, RequestError>,
}

/// A decoded reply frame.
#[derive(Debug, Clone, PartialEq)]
pub struct DecodedResponse {
    pub id: Option<Value>,
    pub response: Response,
}
