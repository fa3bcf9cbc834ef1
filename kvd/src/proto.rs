//! The kvd wire protocol (PROTOCOLS §6, compatible with the Python Infera kvd and its vLLM
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
//! frame). Encoding returns the frame as a list of [`Bytes`] parts, large values as their own
//! parts, so a reply is written without copying its blocks.

use bytes::Bytes;
use infera_core::event::Retention;
use rmpv::{Value, ValueRef};

/// The protocol version this crate speaks (`hello.protocol_version`).
pub const PROTOCOL_VERSION: u64 = 1;
/// The default largest frame accepted: 64 MiB of payload plus 1 MiB for the envelope.
pub const DEFAULT_MAX_FRAME_BYTES: usize = (64 << 20) + (1 << 20);
/// Values at least this large are written as their own frame part instead of being copied.
const ZERO_COPY_PART: usize = 8 << 10;
/// Deepest msgpack nesting accepted in a request (metadata maps included).
const MAX_DEPTH: usize = 32;

/// The namespace of a key: `(model, compat_key)`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Namespace {
    /// The model name.
    pub model: String,
    /// Anything else that makes blocks incompatible (quantization, layout, ...).
    pub compat_key: String,
}

impl Namespace {
    /// A namespace from its two parts.
    pub fn new(model: impl Into<String>, compat_key: impl Into<String>) -> Self {
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
    /// `set_commit{lease_token, key, length, retention, ttl_seconds}` (shared arena).
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

/// Our additions to `stats_response`.
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
    /// Per class, lowest first (`none`, `ephemeral`, `short`, `long`): entries held.
    pub class_entries: [u64; 4],
    /// Per class: bytes charged against `--max-bytes`.
    pub class_bytes: [u64; 4],
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

/// A reply frame.
#[derive(Debug, Clone, PartialEq)]
pub enum Response {
    /// `hello_ack{server_id, protocol_version, shared_arena: [arena_size, slot_size, pid] | nil}`.
    HelloAck {
        server_id: String,
        protocol_version: u64,
        shared_arena: Option<[u64; 3]>,
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
}

impl FrameError {
    /// The `error.code` for this failure.
    pub fn code(&self) -> &'static str {
        match self {
            FrameError::TooLarge { .. } => "frame_too_large",
            FrameError::Truncated { .. } => "truncated_frame",
            FrameError::Malformed(_) => "bad_frame",
        }
    }
}

/// A well-formed frame with an unknown op or a bad field; the connection stays usable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct RequestError {
    /// `unknown_op`, `bad_request` or `batch_set_arity_mismatch`.
    pub code: &'static str,
    /// What was wrong, naming the field.
    pub message: String,
}

impl RequestError {
    fn field(op: &str, field: &str, expected: &str) -> Self {
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

// ---------------------------------------------------------------------------------------------
// Encoding
// ---------------------------------------------------------------------------------------------

/// Builds one frame as a list of parts; the first part is the length prefix.
#[derive(Debug, Default)]
pub struct Encoder {
    parts: Vec<Bytes>,
    cur: Vec<u8>,
    len: usize,
}

// Writes into a `Vec<u8>` cannot fail; the `Infallible` results are dropped below.
impl Encoder {
    fn new() -> Self {
        Self::default()
    }

    fn map(&mut self, n: usize) {
        let _ = rmp::encode::write_map_len(&mut self.cur, n as u32);
    }

    fn array(&mut self, n: usize) {
        let _ = rmp::encode::write_array_len(&mut self.cur, n as u32);
    }

    fn str(&mut self, s: &str) {
        let _ = rmp::encode::write_str(&mut self.cur, s);
    }

    fn uint(&mut self, v: u64) {
        let _ = rmp::encode::write_uint(&mut self.cur, v);
    }

    fn sint(&mut self, v: i64) {
        let _ = rmp::encode::write_sint(&mut self.cur, v);
    }

    fn float(&mut self, v: f64) {
        let _ = rmp::encode::write_f64(&mut self.cur, v);
    }

    fn boolean(&mut self, v: bool) {
        let _ = rmp::encode::write_bool(&mut self.cur, v);
    }

    fn nil(&mut self) {
        let _ = rmp::encode::write_nil(&mut self.cur);
    }

    fn bin(&mut self, b: &Bytes) {
        let _ = rmp::encode::write_bin_len(&mut self.cur, b.len() as u32);
        if b.len() >= ZERO_COPY_PART {
            self.flush_cur();
            self.len += b.len();
            self.parts.push(b.clone());
        } else {
            self.cur.extend_from_slice(b);
        }
    }

    fn opt_bin(&mut self, b: Option<&Bytes>) {
        match b {
            Some(b) => self.bin(b),
            None => self.nil(),
        }
    }

    fn opt_str(&mut self, s: Option<&str>) {
        match s {
            Some(s) => self.str(s),
            None => self.nil(),
        }
    }

    fn value(&mut self, v: &Value) {
        let _ = rmpv::encode::write_value(&mut self.cur, v);
    }

    /// A pre-encoded msgpack value (metadata), or `{}`.
    fn raw_or_empty_map(&mut self, raw: Option<&Bytes>) {
        match raw {
            Some(raw) => self.cur.extend_from_slice(raw),
            None => self.map(0),
        }
    }

    fn field(&mut self, name: &str) {
        self.str(name);
    }

    fn flush_cur(&mut self) {
        if !self.cur.is_empty() {
            self.len += self.cur.len();
            self.parts.push(Bytes::from(std::mem::take(&mut self.cur)));
        }
    }

    /// Starts the map of `op` with `fields` more entries (plus `id` when given).
    fn begin(&mut self, op: &str, fields: usize, id: Option<&Value>) {
        self.map(1 + fields + usize::from(id.is_some()));
        self.field("op");
        self.str(op);
        if let Some(id) = id {
            self.field("id");
            self.value(id);
        }
    }

    fn finish(mut self) -> Vec<Bytes> {
        self.flush_cur();
        let mut out = Vec::with_capacity(self.parts.len() + 1);
        out.push(Bytes::copy_from_slice(&(self.len as u32).to_be_bytes()));
        out.append(&mut self.parts);
        out
    }
}

fn ns_fields(e: &mut Encoder, ns: &Namespace) {
    e.field("model");
    e.str(&ns.model);
    e.field("compat_key");
    e.str(&ns.compat_key);
}

fn bin_array(e: &mut Encoder, name: &str, items: &[Bytes]) {
    e.field(name);
    e.array(items.len());
    for item in items {
        e.bin(item);
    }
}

fn opt_retention(e: &mut Encoder, r: Option<Retention>) {
    e.opt_str(r.map(Retention::as_str));
}

/// Total length of a frame's parts (the prefix included).
pub fn frame_len(parts: &[Bytes]) -> usize {
    parts.iter().map(Bytes::len).sum()
}

impl Request {
    /// Encodes the request as a frame (prefix first), with `id` when given.
    pub fn encode(&self, id: Option<&Value>) -> Vec<Bytes> {
        let mut e = Encoder::new();
        let op = self.op();
        match self {
            Request::Hello {
                client_id,
                protocol_version,
                prefers_shared_arena,
            } => {
                e.begin(op, 3, id);
                e.field("client_id");
                e.str(client_id);
                e.field("protocol_version");
                e.uint(*protocol_version);
                e.field("prefers_shared_arena");
                e.boolean(*prefers_shared_arena);
            }
            Request::Get { ns, key } => {
                e.begin(op, 3, id);
                ns_fields(&mut e, ns);
                e.field("key");
                e.bin(key);
            }
            Request::BatchGet { ns, keys } | Request::Exists { ns, keys } => {
                e.begin(op, 3, id);
                ns_fields(&mut e, ns);
                bin_array(&mut e, "keys", keys);
            }
            Request::Set { ns, item } => {
                e.begin(op, 7, id);
                ns_fields(&mut e, ns);
                e.field("key");
                e.bin(&item.key);
                e.field("value");
                e.bin(&item.value);
                e.field("retention");
                e.str(item.retention.as_str());
                e.field("metadata");
                e.raw_or_empty_map(item.metadata.as_ref());
                e.field("ttl_seconds");
                match item.ttl_seconds {
                    Some(t) => e.float(t),
                    None => e.nil(),
                }
            }
            Request::BatchSet { ns, items } => {
                let any_ttl = items.iter().any(|i| i.ttl_seconds.is_some());
                e.begin(op, 7, id);
                ns_fields(&mut e, ns);
                e.field("keys");
                e.array(items.len());
                items.iter().for_each(|i| e.bin(&i.key));
                e.field("values");
                e.array(items.len());
                items.iter().for_each(|i| e.bin(&i.value));
                e.field("retentions");
                e.array(items.len());
                items.iter().for_each(|i| e.str(i.retention.as_str()));
                e.field("metadatas");
                e.array(items.len());
                items
                    .iter()
                    .for_each(|i| e.raw_or_empty_map(i.metadata.as_ref()));
                e.field("ttls_seconds");
                if any_ttl {
                    e.array(items.len());
                    for i in items {
                        match i.ttl_seconds {
                            Some(t) => e.float(t),
                            None => e.nil(),
                        }
                    }
                } else {
                    e.nil();
                }
            }
            Request::SetReserve { size } => {
                e.begin(op, 1, id);
                e.field("size");
                e.uint(*size);
            }
            Request::SetCommit {
                ns,
                lease_token,
                key,
                length,
                retention,
                ttl_seconds,
            } => {
                e.begin(op, 7, id);
                ns_fields(&mut e, ns);
                e.field("lease_token");
                e.uint(*lease_token);
                e.field("key");
                e.bin(key);
                e.field("length");
                e.uint(*length);
                e.field("retention");
                e.str(retention.as_str());
                e.field("ttl_seconds");
                e.uint(*ttl_seconds);
            }
            Request::SetCancel { lease_token } => {
                e.begin(op, 1, id);
                e.field("lease_token");
                e.uint(*lease_token);
            }
            Request::PrefetchHint {
                ns,
                keys,
                deadline_ms,
            } => {
                e.begin(op, 4, id);
                ns_fields(&mut e, ns);
                bin_array(&mut e, "keys", keys);
                e.field("deadline_ms");
                e.uint(*deadline_ms);
            }
            Request::Clear { ns } => {
                e.begin(op, 2, id);
                ns_fields(&mut e, ns);
            }
            Request::Stats { extended } => {
                e.begin(op, usize::from(*extended), id);
                if *extended {
                    e.field("extended");
                    e.boolean(true);
                }
            }
        }
        e.finish()
    }
}

impl Response {
    /// Encodes the reply as a frame (prefix first), echoing `id` when given.
    pub fn encode(&self, id: Option<&Value>) -> Vec<Bytes> {
        let mut e = Encoder::new();
        let op = self.op();
        match self {
            Response::HelloAck {
                server_id,
                protocol_version,
                shared_arena,
            } => {
                e.begin(op, 3, id);
                e.field("server_id");
                e.str(server_id);
                e.field("protocol_version");
                e.uint(*protocol_version);
                e.field("shared_arena");
                match shared_arena {
                    Some(parts) => {
                        e.array(3);
                        parts.iter().for_each(|p| e.uint(*p));
                    }
                    None => e.nil(),
                }
            }
            Response::Get { value, retention } => {
                e.begin(op, 2, id);
                e.field("value");
                e.opt_bin(value.as_ref());
                e.field("retention");
                opt_retention(&mut e, *retention);
            }
            Response::BatchGet { values, retentions } => {
                e.begin(op, 2, id);
                e.field("values");
                e.array(values.len());
                values.iter().for_each(|v| e.opt_bin(v.as_ref()));
                e.field("retentions");
                e.array(retentions.len());
                retentions.iter().for_each(|r| opt_retention(&mut e, *r));
            }
            Response::SetAck(ack) => {
                e.begin(op, 2, id);
                e.field("accepted");
                e.boolean(ack.accepted);
                e.field("reason");
                e.opt_str(ack.reason.as_deref());
            }
            Response::BatchSetAck(acks) => {
                e.begin(op, 2, id);
                e.field("accepted");
                e.array(acks.len());
                acks.iter().for_each(|a| e.boolean(a.accepted));
                e.field("reasons");
                e.array(acks.len());
                acks.iter().for_each(|a| e.opt_str(a.reason.as_deref()));
            }
            Response::SetReserve {
                lease_token,
                slot_id,
                payload_offset,
                payload_max_size,
                reason,
            } => {
                e.begin(op, 5, id);
                e.field("lease_token");
                e.uint(*lease_token);
                e.field("slot_id");
                e.sint(*slot_id);
                e.field("payload_offset");
                e.uint(*payload_offset);
                e.field("payload_max_size");
                e.uint(*payload_max_size);
                e.field("reason");
                e.str(reason);
            }
            Response::SetCommit { accepted, reason } => {
                e.begin(op, 2, id);
                e.field("accepted");
                e.boolean(*accepted);
                e.field("reason");
                e.str(reason);
            }
            Response::SetCancel => e.begin(op, 0, id),
            Response::Exists { present } => {
                e.begin(op, 1, id);
                e.field("present");
                e.array(present.len());
                present.iter().for_each(|p| e.boolean(*p));
            }
            Response::Clear { cleared_entries } => {
                e.begin(op, 1, id);
                e.field("cleared_entries");
                e.uint(*cleared_entries);
            }
            Response::Stats(s) => encode_stats(&mut e, s, id),
            Response::Error { code, message } => {
                e.begin(op, 2, id);
                e.field("code");
                e.str(code);
                e.field("message");
                e.str(message);
            }
        }
        e.finish()
    }
}

fn encode_stats(e: &mut Encoder, s: &StatsReply, id: Option<&Value>) {
    let base = [
        ("entries", s.entries),
        ("host_bytes", s.host_bytes),
        ("spillover_bytes", s.spillover_bytes),
        ("long_bytes", s.long_bytes),
        ("gets_total", s.gets_total),
        ("sets_total", s.sets_total),
        ("hits_total", s.hits_total),
        ("misses_total", s.misses_total),
        ("evictions_total", s.evictions_total),
    ];
    let extra = s.extended.as_ref().map(|x| {
        let mut fields = vec![
            ("accounted_bytes".to_owned(), x.accounted_bytes),
            ("max_bytes".to_owned(), x.max_bytes),
            ("expired_total".to_owned(), x.expired_total),
            ("rejected_total".to_owned(), x.rejected_total),
            ("prefetch_hints_total".to_owned(), x.prefetch_hints_total),
        ];
        for class in Retention::ALL {
            let c = class as usize;
            fields.push((format!("{}_entries", class.as_str()), x.class_entries[c]));
            fields.push((format!("{}_class_bytes", class.as_str()), x.class_bytes[c]));
        }
        fields
    });
    let extra = extra.unwrap_or_default();
    e.begin("stats_response", base.len() + extra.len(), id);
    for (name, v) in base {
        e.field(name);
        e.uint(v);
    }
    for (name, v) in &extra {
        e.field(name);
        e.uint(*v);
    }
}

// ---------------------------------------------------------------------------------------------
// Decoding
// ---------------------------------------------------------------------------------------------

/// The fields of one decoded map, borrowing the frame.
struct Fields<'a> {
    frame: &'a Bytes,
    op: String,
    map: Vec<(ValueRef<'a>, ValueRef<'a>)>,
}

fn parse_map(frame: &Bytes) -> Result<(Option<Value>, Fields<'_>), FrameError> {
    let mut rd: &[u8] = &frame[..];
    let value = rmpv::decode::read_value_ref_with_max_depth(&mut rd, MAX_DEPTH)
        .map_err(|e| FrameError::Malformed(e.to_string()))?;
    if !rd.is_empty() {
        return Err(FrameError::Malformed(format!(
            "{} trailing bytes after the map",
            rd.len()
        )));
    }
    let ValueRef::Map(map) = value else {
        return Err(FrameError::Malformed(format!("got {}", kind_name(&value))));
    };
    let mut fields = Fields {
        frame,
        op: String::new(),
        map,
    };
    let id = fields
        .get("id")
        .filter(|v| !matches!(v, ValueRef::Map(_) | ValueRef::Array(_)))
        .map(ValueRef::to_owned);
    fields.op = match fields.get("op") {
        Some(ValueRef::String(s)) => s.as_str().unwrap_or_default().to_owned(),
        _ => String::new(),
    };
    Ok((id, fields))
}

fn kind_name(v: &ValueRef<'_>) -> &'static str {
    match v {
        ValueRef::Nil => "nil",
        ValueRef::Boolean(_) => "a boolean",
        ValueRef::Integer(_) => "an integer",
        ValueRef::F32(_) | ValueRef::F64(_) => "a float",
        ValueRef::String(_) => "a string",
        ValueRef::Binary(_) => "binary",
        ValueRef::Array(_) => "an array",
        ValueRef::Map(_) => "a map",
        ValueRef::Ext(..) => "an extension",
    }
}

impl<'a> Fields<'a> {
    /// The field's value; `nil` reads as absent.
    fn get(&self, name: &str) -> Option<&ValueRef<'a>> {
        self.map
            .iter()
            .find(|(k, _)| matches!(k, ValueRef::String(s) if s.as_str() == Some(name)))
            .map(|(_, v)| v)
            .filter(|v| !matches!(v, ValueRef::Nil))
    }

    fn bad(&self, field: &str, expected: &str) -> RequestError {
        RequestError::field(&self.op, field, expected)
    }

    fn string(&self, name: &str, default: &str) -> Result<String, RequestError> {
        match self.get(name) {
            None => Ok(default.to_owned()),
            Some(ValueRef::String(s)) => s
                .as_str()
                .map(str::to_owned)
                .ok_or_else(|| self.bad(name, "valid UTF-8")),
            Some(_) => Err(self.bad(name, "a string")),
        }
    }

    fn ns(&self) -> Result<Namespace, RequestError> {
        Ok(Namespace {
            model: self.string("model", "")?,
            compat_key: self.string("compat_key", "")?,
        })
    }

    fn to_bytes(&self, v: &ValueRef<'a>) -> Option<Bytes> {
        let slice: &[u8] = match v {
            ValueRef::Binary(b) => b,
            ValueRef::String(s) => s.as_bytes(),
            _ => return None,
        };
        // A value much smaller than the frame is copied so it never pins the whole frame.
        if slice.len() * 2 >= self.frame.len() {
            Some(self.frame.slice_ref(slice))
        } else {
            Some(Bytes::copy_from_slice(slice))
        }
    }

    fn bin(&self, name: &str) -> Result<Bytes, RequestError> {
        self.get(name)
            .and_then(|v| self.to_bytes(v))
            .ok_or_else(|| self.bad(name, "binary"))
    }

    fn array(&self, name: &str) -> Result<&[ValueRef<'a>], RequestError> {
        match self.get(name) {
            Some(ValueRef::Array(items)) => Ok(items),
            _ => Err(self.bad(name, "an array")),
        }
    }

    fn opt_array(&self, name: &str) -> Result<Option<&[ValueRef<'a>]>, RequestError> {
        match self.get(name) {
            None => Ok(None),
            Some(ValueRef::Array(items)) => Ok(Some(items)),
            Some(_) => Err(self.bad(name, "an array or nil")),
        }
    }

    fn bin_list(&self, name: &str) -> Result<Vec<Bytes>, RequestError> {
        self.array(name)?
            .iter()
            .map(|v| self.to_bytes(v))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| self.bad(name, "an array of binary keys"))
    }

    fn uint(&self, name: &str, default: Option<u64>) -> Result<u64, RequestError> {
        match self.get(name) {
            None => default.ok_or_else(|| self.bad(name, "present")),
            Some(v) => as_uint(v).ok_or_else(|| self.bad(name, "a non-negative integer")),
        }
    }

    fn boolean(&self, name: &str) -> Result<bool, RequestError> {
        match self.get(name) {
            None => Ok(false),
            Some(ValueRef::Boolean(b)) => Ok(*b),
            Some(_) => Err(self.bad(name, "a boolean")),
        }
    }

    fn retention(&self, v: Option<&ValueRef<'a>>, name: &str) -> Result<Retention, RequestError> {
        match v {
            None => Ok(Retention::Short),
            Some(ValueRef::String(s)) => match s.as_str() {
                Some("" | "default") => Ok(Retention::Short),
                Some(text) => Retention::parse(text)
                    .ok_or_else(|| self.bad(name, "one of none, ephemeral, short, long")),
                None => Err(self.bad(name, "valid UTF-8")),
            },
            Some(_) => Err(self.bad(name, "a retention string")),
        }
    }

    fn ttl(&self, v: Option<&ValueRef<'a>>, name: &str) -> Result<Option<f64>, RequestError> {
        match v {
            None | Some(ValueRef::Nil) => Ok(None),
            Some(v) => as_float(v)
                .filter(|t| !t.is_nan())
                .map(Some)
                .ok_or_else(|| self.bad(name, "a number of seconds or nil")),
        }
    }

    fn metadata(
        &self,
        v: Option<&ValueRef<'a>>,
        name: &str,
    ) -> Result<Option<Bytes>, RequestError> {
        match v {
            None | Some(ValueRef::Nil) => Ok(None),
            Some(ValueRef::Map(m)) if m.is_empty() => Ok(None),
            Some(v @ ValueRef::Map(_)) => {
                let mut out = Vec::new();
                rmpv::encode::write_value_ref(&mut out, v)
                    .map_err(|_| self.bad(name, "an encodable map"))?;
                Ok(Some(Bytes::from(out)))
            }
            Some(_) => Err(self.bad(name, "a map")),
        }
    }
}

fn as_uint(v: &ValueRef<'_>) -> Option<u64> {
    match v {
        ValueRef::Integer(i) => i.as_u64(),
        _ => None,
    }
}

fn as_sint(v: &ValueRef<'_>) -> Option<i64> {
    match v {
        ValueRef::Integer(i) => i.as_i64(),
        _ => None,
    }
}

fn as_float(v: &ValueRef<'_>) -> Option<f64> {
    match v {
        ValueRef::Integer(i) => i.as_f64(),
        ValueRef::F32(f) => Some(f64::from(*f)),
        ValueRef::F64(f) => Some(*f),
        _ => None,
    }
}

/// Decodes a request frame body (without its length prefix).
///
/// # Errors
/// [`FrameError::Malformed`] when the body is not one msgpack map; the caller answers and closes.
pub fn decode_request(frame: &Bytes) -> Result<DecodedRequest, FrameError> {
    let (id, f) = parse_map(frame)?;
    Ok(DecodedRequest {
        id,
        request: request_from(&f),
    })
}

fn request_from(f: &Fields<'_>) -> Result<Request, RequestError> {
    Ok(match f.op.as_str() {
        "hello" => Request::Hello {
            client_id: f.string("client_id", "")?,
            protocol_version: f.uint("protocol_version", Some(PROTOCOL_VERSION))?,
            prefers_shared_arena: f.boolean("prefers_shared_arena")?,
        },
        "get" => Request::Get {
            ns: f.ns()?,
            key: f.bin("key")?,
        },
        "batch_get" => Request::BatchGet {
            ns: f.ns()?,
            keys: f.bin_list("keys")?,
        },
        "exists" => Request::Exists {
            ns: f.ns()?,
            keys: f.bin_list("keys")?,
        },
        "set" => Request::Set {
            ns: f.ns()?,
            item: SetItem {
                key: f.bin("key")?,
                value: f.bin("value")?,
                retention: f.retention(f.get("retention"), "retention")?,
                metadata: f.metadata(f.get("metadata"), "metadata")?,
                ttl_seconds: f.ttl(f.get("ttl_seconds"), "ttl_seconds")?,
            },
        },
        "batch_set" => batch_set_from(f)?,
        "set_reserve" => Request::SetReserve {
            size: f.uint("size", None)?,
        },
        "set_commit" => Request::SetCommit {
            ns: f.ns()?,
            lease_token: f.uint("lease_token", None)?,
            key: f.bin("key")?,
            length: f.uint("length", None)?,
            retention: f.retention(f.get("retention"), "retention")?,
            ttl_seconds: f.uint("ttl_seconds", Some(0))?,
        },
        "set_cancel" => Request::SetCancel {
            lease_token: f.uint("lease_token", None)?,
        },
        "prefetch_hint" => Request::PrefetchHint {
            ns: f.ns()?,
            keys: f.bin_list("keys")?,
            deadline_ms: f.uint("deadline_ms", Some(1000))?,
        },
        "clear" => Request::Clear { ns: f.ns()? },
        "stats" => Request::Stats {
            extended: f.boolean("extended")?,
        },
        "" => {
            return Err(RequestError {
                code: "bad_request",
                message: "the frame has no string `op` field".to_owned(),
            });
        }
        other => {
            return Err(RequestError {
                code: "unknown_op",
                message: format!(
                    "unknown op `{other}`; known: hello, get, batch_get, set, batch_set, \
                     set_reserve, set_commit, set_cancel, prefetch_hint, exists, clear, stats"
                ),
            });
        }
    })
}

fn batch_set_from(f: &Fields<'_>) -> Result<Request, RequestError> {
    let keys = f.bin_list("keys")?;
    let values = f.bin_list("values")?;
    let retentions = f.array("retentions")?;
    let metadatas = f.opt_array("metadatas")?;
    let ttls = f.opt_array("ttls_seconds")?;
    let n = keys.len();
    let arity_ok = values.len() == n
        && retentions.len() == n
        && metadatas.is_none_or(|m| m.len() == n)
        && ttls.is_none_or(|t| t.len() == n);
    if !arity_ok {
        return Err(RequestError {
            code: "batch_set_arity_mismatch",
            message: format!(
                "batch_set arrays disagree: keys={n} values={} retentions={} metadatas={} \
                 ttls_seconds={}",
                values.len(),
                retentions.len(),
                metadatas.map_or_else(|| "nil".to_owned(), |m| m.len().to_string()),
                ttls.map_or_else(|| "nil".to_owned(), |t| t.len().to_string()),
            ),
        });
    }
    let mut items = Vec::with_capacity(n);
    for (i, (key, value)) in keys.into_iter().zip(values).enumerate() {
        items.push(SetItem {
            key,
            value,
            retention: f.retention(
                Some(&retentions[i]).filter(|v| !matches!(v, ValueRef::Nil)),
                "retentions",
            )?,
            metadata: f.metadata(metadatas.map(|m| &m[i]), "metadatas")?,
            ttl_seconds: f.ttl(ttls.map(|t| &t[i]), "ttls_seconds")?,
        });
    }
    Ok(Request::BatchSet { ns: f.ns()?, items })
}

/// Decodes a reply frame body (without its length prefix); used by the client.
///
/// # Errors
/// A [`FrameError`] when the body is not a map or a field does not have the documented type.
pub fn decode_response(frame: &Bytes) -> Result<DecodedResponse, FrameError> {
    let (id, f) = parse_map(frame)?;
    let response = response_from(&f).map_err(|e| FrameError::Malformed(e.message))?;
    Ok(DecodedResponse { id, response })
}

fn opt_retention_of(
    f: &Fields<'_>,
    v: &ValueRef<'_>,
    name: &str,
) -> Result<Option<Retention>, RequestError> {
    match v {
        ValueRef::Nil => Ok(None),
        ValueRef::String(s) => s
            .as_str()
            .and_then(Retention::parse)
            .map(Some)
            .ok_or_else(|| f.bad(name, "a retention class")),
        _ => Err(f.bad(name, "a retention class or nil")),
    }
}

fn opt_string_of(
    f: &Fields<'_>,
    v: &ValueRef<'_>,
    name: &str,
) -> Result<Option<String>, RequestError> {
    match v {
        ValueRef::Nil => Ok(None),
        ValueRef::String(s) => Ok(Some(s.as_str().unwrap_or_default().to_owned())),
        _ => Err(f.bad(name, "a string or nil")),
    }
}

fn response_from(f: &Fields<'_>) -> Result<Response, RequestError> {
    let nil = ValueRef::Nil;
    let field = |name: &str| f.get(name).unwrap_or(&nil);
    Ok(match f.op.as_str() {
        "hello_ack" => Response::HelloAck {
            server_id: f.string("server_id", "")?,
            protocol_version: f.uint("protocol_version", Some(PROTOCOL_VERSION))?,
            shared_arena: match f.opt_array("shared_arena")? {
                None => None,
                Some([a, b, c]) => Some([a, b, c].map(|v| as_uint(v).unwrap_or_default())),
                Some(_) => return Err(f.bad("shared_arena", "three integers or nil")),
            },
        },
        "get_response" => Response::Get {
            value: match field("value") {
                ValueRef::Nil => None,
                v => Some(
                    f.to_bytes(v)
                        .ok_or_else(|| f.bad("value", "binary or nil"))?,
                ),
            },
            retention: opt_retention_of(f, field("retention"), "retention")?,
        },
        "batch_get_response" => {
            let values = f
                .array("values")?
                .iter()
                .map(|v| match v {
                    ValueRef::Nil => Ok(None),
                    v => f
                        .to_bytes(v)
                        .map(Some)
                        .ok_or_else(|| f.bad("values", "binary or nil")),
                })
                .collect::<Result<_, _>>()?;
            let retentions = f
                .array("retentions")?
                .iter()
                .map(|v| opt_retention_of(f, v, "retentions"))
                .collect::<Result<_, _>>()?;
            Response::BatchGet { values, retentions }
        }
        "set_ack" => Response::SetAck(SetAck {
            accepted: f.boolean("accepted")?,
            reason: opt_string_of(f, field("reason"), "reason")?,
        }),
        "batch_set_ack" => {
            let accepted = f.array("accepted")?;
            let reasons = f.array("reasons")?;
            let acks = accepted
                .iter()
                .zip(reasons)
                .map(|(a, r)| {
                    Ok(SetAck {
                        accepted: matches!(a, ValueRef::Boolean(true)),
                        reason: opt_string_of(f, r, "reasons")?,
                    })
                })
                .collect::<Result<_, RequestError>>()?;
            Response::BatchSetAck(acks)
        }
        "set_reserve_response" => Response::SetReserve {
            lease_token: f.uint("lease_token", Some(0))?,
            slot_id: f.get("slot_id").and_then(as_sint).unwrap_or(-1),
            payload_offset: f.uint("payload_offset", Some(0))?,
            payload_max_size: f.uint("payload_max_size", Some(0))?,
            reason: f.string("reason", "")?,
        },
        "set_commit_response" => Response::SetCommit {
            accepted: f.boolean("accepted")?,
            reason: f.string("reason", "")?,
        },
        "set_cancel_response" => Response::SetCancel,
        "exists_response" => Response::Exists {
            present: f
                .array("present")?
                .iter()
                .map(|v| matches!(v, ValueRef::Boolean(true)))
                .collect(),
        },
        "clear_ack" => Response::Clear {
            cleared_entries: f.uint("cleared_entries", Some(0))?,
        },
        "stats_response" => Response::Stats(stats_from(f)?),
        "error" => Response::Error {
            code: f.string("code", "")?,
            message: f.string("message", "")?,
        },
        other => return Err(f.bad("op", &format!("a known reply op, not `{other}`"))),
    })
}

fn stats_from(f: &Fields<'_>) -> Result<StatsReply, RequestError> {
    let u = |name: &str| f.uint(name, Some(0));
    let extended = if f.get("expired_total").is_some() {
        let mut x = ExtendedStats {
            accounted_bytes: u("accounted_bytes")?,
            max_bytes: u("max_bytes")?,
            expired_total: u("expired_total")?,
            rejected_total: u("rejected_total")?,
            prefetch_hints_total: u("prefetch_hints_total")?,
            ..ExtendedStats::default()
        };
        for class in Retention::ALL {
            let c = class as usize;
            x.class_entries[c] = u(&format!("{}_entries", class.as_str()))?;
            x.class_bytes[c] = u(&format!("{}_class_bytes", class.as_str()))?;
        }
        Some(x)
    } else {
        None
    };
    Ok(StatsReply {
        entries: u("entries")?,
        host_bytes: u("host_bytes")?,
        spillover_bytes: u("spillover_bytes")?,
        long_bytes: u("long_bytes")?,
        gets_total: u("gets_total")?,
        sets_total: u("sets_total")?,
        hits_total: u("hits_total")?,
        misses_total: u("misses_total")?,
        evictions_total: u("evictions_total")?,
        extended,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(parts: Vec<Bytes>) -> Bytes {
        let mut all: Vec<u8> = parts.iter().flat_map(|p| p.iter().copied()).collect();
        let len = u32::from_be_bytes([all[0], all[1], all[2], all[3]]) as usize;
        assert_eq!(len, all.len() - 4, "the prefix counts the body");
        Bytes::from(all.split_off(4))
    }

    #[test]
    fn every_request_round_trips() {
        let ns = Namespace::new("m", "fp8");
        let big = Bytes::from(vec![7u8; 100_000]);
        let requests = vec![
            Request::Hello {
                client_id: "c".into(),
                protocol_version: 1,
                prefers_shared_arena: true,
            },
            Request::Get {
                ns: ns.clone(),
                key: Bytes::from_static(b"k"),
            },
            Request::BatchGet {
                ns: ns.clone(),
                keys: vec![Bytes::from_static(b"a"), Bytes::from_static(b"b")],
            },
            Request::Set {
                ns: ns.clone(),
                item: SetItem::new(&b"k"[..], big.clone())
                    .retention(Retention::Long)
                    .ttl_seconds(2.5),
            },
            Request::BatchSet {
                ns: ns.clone(),
                items: vec![
                    SetItem::new(&b"a"[..], &b"1"[..]),
                    SetItem::new(&b"b"[..], &b"2"[..]).ttl_seconds(1.0),
                ],
            },
            Request::SetReserve { size: 9 },
            Request::SetCommit {
                ns: ns.clone(),
                lease_token: 3,
                key: Bytes::from_static(b"k"),
                length: 4,
                retention: Retention::Ephemeral,
                ttl_seconds: 5,
            },
            Request::SetCancel { lease_token: 3 },
            Request::PrefetchHint {
                ns: ns.clone(),
                keys: vec![Bytes::from_static(b"a")],
                deadline_ms: 50,
            },
            Request::Exists {
                ns: ns.clone(),
                keys: vec![],
            },
            Request::Clear { ns },
            Request::Stats { extended: true },
        ];
        for (i, req) in requests.into_iter().enumerate() {
            let id = Value::from(i as u64);
            let decoded = decode_request(&body(req.encode(Some(&id)))).unwrap();
            assert_eq!(decoded.id, Some(id));
            assert_eq!(decoded.request, Ok(req));
        }
    }

    #[test]
    fn every_response_round_trips() {
        let mut stats = StatsReply {
            entries: 1,
            hits_total: 2,
            ..StatsReply::default()
        };
        let responses = vec![
            Response::HelloAck {
                server_id: "s".into(),
                protocol_version: 1,
                shared_arena: None,
            },
            Response::Get {
                value: Some(Bytes::from(vec![1u8; 20_000])),
                retention: Some(Retention::Long),
            },
            Response::Get {
                value: None,
                retention: None,
            },
            Response::BatchGet {
                values: vec![None, Some(Bytes::from_static(b"x"))],
                retentions: vec![None, Some(Retention::None)],
            },
            Response::SetAck(SetAck::rejected("would_displace_higher_priority")),
            Response::BatchSetAck(vec![SetAck::accepted(), SetAck::rejected("too_large")]),
            Response::SetReserve {
                lease_token: 0,
                slot_id: -1,
                payload_offset: 0,
                payload_max_size: 0,
                reason: "no_arena".into(),
            },
            Response::SetCommit {
                accepted: false,
                reason: "no_arena".into(),
            },
            Response::SetCancel,
            Response::Exists {
                present: vec![true, false],
            },
            Response::Clear { cleared_entries: 4 },
            Response::Stats(stats.clone()),
            Response::error("bad_request", "nope"),
        ];
        stats.extended = Some(ExtendedStats {
            class_entries: [1, 2, 3, 4],
            expired_total: 9,
            ..ExtendedStats::default()
        });
        for resp in responses.into_iter().chain([Response::Stats(stats)]) {
            let decoded = decode_response(&body(resp.encode(None))).unwrap();
            assert_eq!(decoded.id, None);
            assert_eq!(decoded.response, resp);
        }
    }

    #[test]
    fn bad_fields_keep_the_frame_but_not_the_request() {
        let mut buf = Vec::new();
        let v = Value::Map(vec![
            (Value::from("op"), Value::from("set")),
            (Value::from("key"), Value::from(3)),
            (Value::from("id"), Value::from("x")),
        ]);
        rmpv::encode::write_value(&mut buf, &v).unwrap();
        let d = decode_request(&Bytes::from(buf)).unwrap();
        assert_eq!(d.id, Some(Value::from("x")));
        let err = d.request.unwrap_err();
        assert_eq!(err.code, "bad_request");
        assert!(err.message.contains("`key`"), "{}", err.message);

        let mut buf = Vec::new();
        rmpv::encode::write_value(&mut buf, &Value::from(vec![Value::from(1)])).unwrap();
        assert!(matches!(
            decode_request(&Bytes::from(buf)),
            Err(FrameError::Malformed(_))
        ));
        assert!(decode_request(&Bytes::from_static(&[0xc1])).is_err());
    }

    #[test]
    fn batch_set_arity_mismatch_is_named() {
        let v = Value::Map(vec![
            (Value::from("op"), Value::from("batch_set")),
            (
                Value::from("keys"),
                Value::from(vec![Value::from(&b"a"[..])]),
            ),
            (Value::from("values"), Value::Array(vec![])),
            (Value::from("retentions"), Value::Array(vec![])),
            (Value::from("metadatas"), Value::Array(vec![])),
        ]);
        let mut buf = Vec::new();
        rmpv::encode::write_value(&mut buf, &v).unwrap();
        let err = decode_request(&Bytes::from(buf))
            .unwrap()
            .request
            .unwrap_err();
        assert_eq!(err.code, "batch_set_arity_mismatch");
    }
}
