//! Encoding of requests and replies into frames: a list of [`Bytes`] parts, the length prefix
//! first, values of at least [`ZERO_COPY_PART`] bytes as their own parts (never copied).

use super::{ExtendedStats, Namespace, Request, Response, StatsReply, ZERO_COPY_PART};
use bytes::Bytes;
use infera_core::event::Retention;
use rmpv::Value;

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
                kv_events_endpoint,
                kv_events_replay_endpoint,
            } => {
                let ours = [
                    ("kv_events_endpoint", kv_events_endpoint),
                    ("kv_events_replay_endpoint", kv_events_replay_endpoint),
                ];
                let given = ours.iter().filter(|(_, v)| v.is_some()).count();
                e.begin(op, 3 + given, id);
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
                for (name, value) in ours {
                    if let Some(value) = value {
                        e.field(name);
                        e.str(value);
                    }
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
            Response::GetShared(slot) => {
                e.begin(op, 5, id);
                e.field("slot_offset");
                e.uint(slot.slot_offset);
                e.field("length");
                e.uint(slot.length);
                e.field("version");
                e.uint(slot.version);
                e.field("retention");
                opt_retention(&mut e, slot.retention);
                e.field("slot_size");
                e.uint(slot.slot_size);
            }
            Response::BatchGetShared { slots, slot_size } => {
                e.begin(op, 5, id);
                e.field("offsets");
                e.array(slots.len());
                for s in slots {
                    match s {
                        Some(s) => e.sint(s.slot_offset as i64),
                        None => e.sint(-1),
                    }
                }
                e.field("lengths");
                e.array(slots.len());
                slots.iter().for_each(|s| e.uint(s.map_or(0, |s| s.length)));
                e.field("versions");
                e.array(slots.len());
                slots
                    .iter()
                    .for_each(|s| e.uint(s.map_or(0, |s| s.version)));
                e.field("retentions");
                e.array(slots.len());
                slots
                    .iter()
                    .for_each(|s| opt_retention(&mut e, s.and_then(|s| s.retention)));
                e.field("slot_size");
                e.uint(*slot_size);
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
    let extra = s.extended.as_ref().map(ExtendedStats::fields);
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
