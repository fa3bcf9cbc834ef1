//! Prefill/decode (PD) two-leg dispatch (PROTOCOLS §7): how one request decided onto a prefill
//! and a decode worker is driven through both, per the PD protocol the pair registered in
//! `disagg_meta.protocol` (both legs must agree).
//!
//! | protocol | legs | prefill body | decode body |
//! |---|---|---|---|
//! | `sglang-bootstrap` | both at once | the client's, plus `bootstrap_host`, `bootstrap_port` (the prefill's registration), a fresh random u63 `bootstrap_room` and `rid` `infera-<room, 16 hex digits>` | the same, plus `disagg_prefill_dp_rank` (the prefill's rank) when the prefill fronts several DP ranks |
//! | `vllm-mori-write` | both at once | one token, not streamed; `kv_transfer_params {do_remote_decode: true, transfer_id, remote_dp_size, tp_size, remote_tp_size}` of the decode | the client's; `{do_remote_prefill: true, transfer_id, …}` of the prefill |
//! | `vllm-nixl` | prefill, then decode | one token, not streamed; `{do_remote_decode: true, do_remote_prefill: false, remote_engine_id: null, remote_block_ids: null, remote_host: null, remote_port: null}` | the client's, with the `kv_transfer_params` the prefill answered |
//! | `vllm-mooncake` | prefill, then decode | one token; `{do_remote_decode: true, do_remote_prefill: false, transfer_id}` | the client's; `{do_remote_prefill: true, remote_bootstrap_addr, remote_engine_id, transfer_id}` from the prefill's registration (`remote_engine_id` is `<engine_id>_dp<rank>` for a prefill of several DP ranks, as vLLM registers each rank), overlaid by whatever the prefill answered |
//! | `vllm-mori-read` | prefill, then decode | as `vllm-mori-write` | the client's; the prefill's `transfer_id`, `remote_engine_id`, `remote_block_ids`, plus its parallelism |
//! | `atom-mooncake` | prefill, then decode (completions and chat alike: ATOM answers `kv_transfer_params` on both) | one token; the decode's `remote_host`, `remote_port`, `remote_handshake_port`, `remote_dp_size`, `remote_tp_size` | the client's; the prefill's answer verbatim plus its `remote_dp_size`, `remote_tp_size`, `remote_dp_rank` (the rank it answered) |
//!
//! "One token" is `max_tokens: 1` (and `max_completion_tokens: 1` on chat), `stream: false`,
//! no `stream_options`, no `min_tokens` (vLLM's disaggregated proxy does the same). The decode
//! leg keeps the client's `max_tokens` and `stream`. Every leg's `kv_transfer_params` keeps the
//! server's `infera_retention` stamp (PROTOCOLS §5). MoRI parses peer addresses out of the
//! engine's request id, so both MoRI legs carry a forged `X-Request-Id`
//! (`___prefill_addr_host:H,handshake:P,notify:N___decode_addr_…_<room>`); the other
//! protocols get the attempt's request id there, the same on both legs.
//!
//! # DP ranks
//! A leg whose worker fronts several DP ranks (`dp_size > 1`) is pinned to the rank the router
//! chose with `X-data-parallel-rank` (its rank within the worker's registration), every
//! protocol alike. For a prefill of several ranks the room's residue modulo its `dp_size` is
//! that rank (SGLang's `follow_bootstrap_room` balancer places a PD request by it), and the
//! decode leg names it where its connector needs it (SGLang's `disagg_prefill_dp_rank`,
//! Mooncake's per-rank engine id); ATOM reports the rank that served its prefill itself.
//!
//! # Failures
//! Everything here happens before the client's first byte. The relay ([`super::relay`]) retries
//! a [`LegError`] on another pair when the failed leg's worker could not take the request (or
//! answered 5xx), as it does for one leg. A concurrent dispatch drops the other leg as soon as
//! one fails — for HTTP that closes its connection, which vLLM takes as an abort; SGLang also
//! gets `POST /abort_request` for each leg left running, then and whenever the client goes away
//! or the decode stream fails later ([`super::pd_abort`]) — and the client gets the decode
//! leg's response only once the prefill leg has answered with a success status. The prefill's
//! body is then drained in the background (a failure there is logged; the decode leg reports
//! its own outcome). The prefill leg has completed (`RequestPrefilled`) when its whole answer
//! arrived. A pair whose protocols differ, or whose registration lacks a parameter the
//! protocol needs, is a 500 naming both workers; a prefill answer the decode leg cannot be
//! built from is a 502.

use super::pd_abort::{AbortGuard, LegTarget, PrefillMark};
use super::transport::{Inbound, Outbound, RequestTransport, TransportError, engine_dp_rank};
use axum::body::Bytes;
use futures::StreamExt as _;
use infera_core::event::{Role, WorkerRecord};
use infera_core::ids::WorkerRank;
use infera_core::rng::splitmix64;
use serde_json::{Map, Value, json};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// A PD protocol, named as workers register it in `disagg_meta.protocol`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Protocol {
    SglangBootstrap,
    VllmMooncake,
    VllmNixl,
    VllmMoriRead,
    VllmMoriWrite,
    AtomMooncake,
}

impl Protocol {
    /// Every protocol, in the order error messages list them.
    pub(crate) const ALL: [Protocol; 6] = [
        Protocol::SglangBootstrap,
        Protocol::VllmMooncake,
        Protocol::VllmNixl,
        Protocol::VllmMoriRead,
        Protocol::VllmMoriWrite,
        Protocol::AtomMooncake,
    ];

    pub(crate) fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|p| p.name() == name)
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            Protocol::SglangBootstrap => "sglang-bootstrap",
            Protocol::VllmMooncake => "vllm-mooncake",
            Protocol::VllmNixl => "vllm-nixl",
            Protocol::VllmMoriRead => "vllm-mori-read",
            Protocol::VllmMoriWrite => "vllm-mori-write",
            Protocol::AtomMooncake => "atom-mooncake",
        }
    }

    /// Whether both legs are sent at once (else: prefill, then decode with its answer).
    pub(crate) fn concurrent(self) -> bool {
        matches!(self, Protocol::SglangBootstrap | Protocol::VllmMoriWrite)
    }
}

/// One leg's worker.
#[derive(Debug, Clone)]
pub(crate) struct Leg {
    pub(crate) rank: WorkerRank,
    /// The worker's URL, without a trailing slash.
    pub(crate) url: String,
    pub(crate) record: WorkerRecord,
}

impl Leg {
    /// The engine-side DP rank this leg is steered to, when its worker fronts several
    /// ([`engine_dp_rank`]).
    pub(crate) fn engine_dp_rank(&self) -> Option<u32> {
        engine_dp_rank(&self.rank, &self.record)
    }
}

/// The two workers of one decision.
#[derive(Debug, Clone)]
pub(crate) struct Pair {
    pub(crate) prefill: Leg,
    pub(crate) decode: Leg,
}

/// Why a pair cannot be driven.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum PdError {
    /// The legs registered different protocols (or one registered none).
    #[error(
        "PD protocol mismatch: prefill worker {prefill} registers {prefill_protocol}, decode \
         worker {decode} registers {decode_protocol}; both legs of a pair must register the same \
         disagg_meta.protocol"
    )]
    Mismatch {
        prefill: String,
        prefill_protocol: String,
        decode: String,
        decode_protocol: String,
    },
    /// Both legs registered a protocol this server does not speak.
    #[error(
        "PD protocol {protocol:?} of prefill worker {prefill} and decode worker {decode} is not \
         one this server speaks ({known})"
    )]
    Unknown {
        protocol: String,
        prefill: String,
        decode: String,
        known: String,
    },
    /// A registration lacks a parameter the protocol needs.
    #[error("{role} worker {worker} ({protocol}): disagg_meta.params.{key} is missing or invalid")]
    Meta {
        role: &'static str,
        worker: String,
        protocol: &'static str,
        key: &'static str,
    },
    /// The prefill's answer does not carry what the decode leg needs.
    #[error("prefill worker {worker} ({protocol}): {message}")]
    Handoff {
        worker: String,
        protocol: &'static str,
        message: String,
    },
}

impl PdError {
    /// The status the client gets: 500 for the fleet's configuration, 502 for a prefill answer.
    pub(crate) fn status(&self) -> axum::http::StatusCode {
        match self {
            PdError::Handoff { .. } => axum::http::StatusCode::BAD_GATEWAY,
            _ => axum::http::StatusCode::INTERNAL_SERVER_ERROR,
        }
    }
}

fn registered_protocol(record: &WorkerRecord) -> Option<&str> {
    record.disagg_meta.as_ref()?.get("protocol")?.as_str()
}

/// The protocol both workers registered.
///
/// # Errors
/// [`PdError::Mismatch`] when they differ or one has none, [`PdError::Unknown`] for a name this
/// server does not speak.
pub(crate) fn resolve(prefill: &WorkerRecord, decode: &WorkerRecord) -> Result<Protocol, PdError> {
    let p = registered_protocol(prefill);
    let d = registered_protocol(decode);
    match (p, d) {
        (Some(p), Some(d)) if p == d => Protocol::parse(p).ok_or_else(|| PdError::Unknown {
            protocol: p.to_owned(),
            prefill: prefill.worker_id.to_string(),
            decode: decode.worker_id.to_string(),
            known: Protocol::ALL.map(Protocol::name).join(", "),
        }),
        _ => Err(PdError::Mismatch {
            prefill: prefill.worker_id.to_string(),
            prefill_protocol: p.unwrap_or("no protocol").to_owned(),
            decode: decode.worker_id.to_string(),
            decode_protocol: d.unwrap_or("no protocol").to_owned(),
        }),
    }
}

static NEXT_ROOM: AtomicU64 = AtomicU64::new(0);

/// A fresh random u63 (SGLang's `bootstrap_room`; the other protocols derive their
/// `transfer_id` from it): SplitMix64 over a per-process seed and a counter, so two requests
/// never share one within a process and processes do not collide in practice.
pub(crate) fn new_room(seed: u64) -> u64 {
    let mut state = seed
        ^ NEXT_ROOM
            .fetch_add(1, Ordering::Relaxed)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15);
    splitmix64(&mut state) >> 1
}

/// What the protocol needs to know about one request.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Shape<'a> {
    pub(crate) protocol: Protocol,
    pub(crate) pair: &'a Pair,
    pub(crate) room: u64,
    /// A chat completion (`max_completion_tokens` is capped too).
    pub(crate) chat: bool,
}

impl<'a> Shape<'a> {
    /// The shape of one attempt, its `room` drawn by [`new_room`] and aligned to the prefill's
    /// DP rank ([`align_room`]).
    pub(crate) fn new(protocol: Protocol, pair: &'a Pair, room: u64, chat: bool) -> Self {
        Shape {
            protocol,
            pair,
            room: align_room(room, &pair.prefill),
            chat,
        }
    }
}

/// `room` with its residue modulo the prefill's DP size set to the prefill leg's engine rank,
/// the high bits kept: SGLang's default `follow_bootstrap_room` balancer sends a PD request to
/// DP rank `bootstrap_room % dp_size` and fails a leg that lands elsewhere. The result stays a
/// u63. A prefill of one rank keeps the room as drawn.
pub(crate) fn align_room(room: u64, prefill: &Leg) -> u64 {
    let Some(rank) = prefill.engine_dp_rank() else {
        return room;
    };
    let size = u64::from(prefill.record.dp_size);
    let aligned = room - room % size + u64::from(rank);
    if aligned >= 1 << 63 {
        aligned - size
    } else {
        aligned
    }
}

/// SGLang's request id of both legs of a room (`rid`), which `POST /abort_request` names. The
/// engine matches an abort's `rid` as a prefix, so every id has the same length (16 hex
/// digits): no id is a prefix of another.
pub(crate) fn sglang_rid(room: u64) -> String {
    format!("infera-{room:016x}")
}

fn params(record: &WorkerRecord) -> Option<&Map<String, Value>> {
    record.disagg_meta.as_ref()?.get("params")?.as_object()
}

impl Shape<'_> {
    fn meta_error(&self, role: Role, key: &'static str) -> PdError {
        let leg = if role == Role::Prefill {
            &self.pair.prefill
        } else {
            &self.pair.decode
        };
        PdError::Meta {
            role: role.as_str(),
            worker: leg.record.worker_id.to_string(),
            protocol: self.protocol.name(),
            key,
        }
    }

    fn leg(&self, role: Role) -> &Leg {
        if role == Role::Prefill {
            &self.pair.prefill
        } else {
            &self.pair.decode
        }
    }

    /// A registration parameter of the `role` leg.
    fn param(&self, role: Role, key: &'static str) -> Result<&Value, PdError> {
        params(&self.leg(role).record)
            .and_then(|p| p.get(key))
            .filter(|v| !v.is_null())
            .ok_or_else(|| self.meta_error(role, key))
    }

    /// SGLang's bootstrap address: `bootstrap_host` + `bootstrap_port` (our launcher) or
    /// `bootstrap_addr` `"host:port"` (the Python Infera worker).
    fn bootstrap(&self) -> Result<(String, u64), PdError> {
        let p = params(&self.pair.prefill.record);
        let host = p
            .and_then(|p| p.get("bootstrap_host"))
            .and_then(Value::as_str);
        let port = p.and_then(|p| p.get("bootstrap_port")).and_then(|v| {
            v.as_u64()
                .or_else(|| v.as_str().and_then(|s| s.parse().ok()))
        });
        if let (Some(host), Some(port)) = (host, port) {
            return Ok((host.to_owned(), port));
        }
        p.and_then(|p| p.get("bootstrap_addr"))
            .and_then(Value::as_str)
            .and_then(|addr| addr.rsplit_once(':'))
            .and_then(|(h, port)| Some((h.to_owned(), port.parse().ok()?)))
            .ok_or_else(|| self.meta_error(Role::Prefill, "bootstrap_host"))
    }

    /// MoRI's tensor-parallel size of a leg (`kv_connector_extra_config.tp_size`, default 1).
    fn mori_tp(&self, role: Role) -> u64 {
        params(&self.leg(role).record)
            .and_then(|p| p.get("kv_connector_extra_config"))
            .and_then(|e| e.get("tp_size"))
            .and_then(Value::as_u64)
            .unwrap_or(1)
    }

    fn mori_address(&self, role: Role) -> Result<String, PdError> {
        let leg = self.leg(role);
        let host = url_host(&leg.url);
        let extra = params(&leg.record).and_then(|p| p.get("kv_connector_extra_config"));
        let port = |key: &'static str| {
            extra
                .and_then(|e| e.get(key))
                .and_then(|v| {
                    v.as_u64()
                        .or_else(|| v.as_str().and_then(|s| s.parse().ok()))
                })
                .ok_or_else(|| self.meta_error(role, key))
        };
        Ok(format!(
            "host:{host},handshake:{},notify:{}",
            port("handshake_port")?,
            port("notify_port")?
        ))
    }

    /// The engine request id (`X-Request-Id`) both legs carry, when the protocol needs one.
    pub(crate) fn engine_request_id(&self) -> Result<Option<String>, PdError> {
        match self.protocol {
            Protocol::VllmMoriRead | Protocol::VllmMoriWrite => Ok(Some(format!(
                "___prefill_addr_{}___decode_addr_{}_{:032x}",
                self.mori_address(Role::Prefill)?,
                self.mori_address(Role::Decode)?,
                self.room
            ))),
            _ => Ok(None),
        }
    }

    fn mori_prefill_params(&self) -> Map<String, Value> {
        let tp = self.mori_tp(Role::Decode);
        object(json!({
            "do_remote_decode": true,
            "do_remote_prefill": false,
            "remote_engine_id": null,
            "remote_block_ids": null,
            "transfer_id": format!("tx-{:032x}", self.room),
            "remote_dp_size": self.pair.decode.record.dp_size.max(1),
            "tp_size": tp,
            "remote_tp_size": tp,
        }))
    }

    /// The prefill leg's body, from the client's (already stamped) body.
    pub(crate) fn prefill_body(
        &self,
        base: &Map<String, Value>,
    ) -> Result<Map<String, Value>, PdError> {
        let params = match self.protocol {
            Protocol::SglangBootstrap => return self.sglang_body(base, Role::Prefill),
            Protocol::VllmNixl => object(json!({
                "do_remote_decode": true,
                "do_remote_prefill": false,
                "remote_engine_id": null,
                "remote_block_ids": null,
                "remote_host": null,
                "remote_port": null,
            })),
            Protocol::VllmMooncake => object(json!({
                "do_remote_decode": true,
                "do_remote_prefill": false,
                "transfer_id": self.mooncake_transfer_id(),
            })),
            Protocol::VllmMoriRead | Protocol::VllmMoriWrite => self.mori_prefill_params(),
            Protocol::AtomMooncake => object(json!({
                "remote_dp_size": self.param(Role::Decode, "dp_size")?,
                "remote_tp_size": self.param(Role::Decode, "tp_size")?,
                "do_remote_decode": true,
                "do_remote_prefill": false,
                "remote_handshake_port": self.param(Role::Decode, "handshake_port")?,
                "remote_engine_id": null,
                "remote_block_ids": null,
                "remote_host": self.param(Role::Decode, "host")?,
                "remote_port": self.param(Role::Decode, "http_port")?,
            })),
        };
        Ok(with_kv(single_token(base, self.chat), params, base))
    }

    /// An SGLang leg: the client's body with the prefill's bootstrap, the room and the legs'
    /// shared `rid`; the decode leg also names the prefill's DP rank that holds its KV
    /// (`disagg_prefill_dp_rank`) when the prefill fronts several.
    fn sglang_body(
        &self,
        base: &Map<String, Value>,
        role: Role,
    ) -> Result<Map<String, Value>, PdError> {
        let (host, port) = self.bootstrap()?;
        let mut out = base.clone();
        out.insert("bootstrap_host".into(), host.into());
        out.insert("bootstrap_port".into(), port.into());
        out.insert("bootstrap_room".into(), self.room.into());
        out.insert("rid".into(), sglang_rid(self.room).into());
        if role == Role::Decode
            && let Some(rank) = self.pair.prefill.engine_dp_rank()
        {
            out.insert("disagg_prefill_dp_rank".into(), rank.into());
        }
        Ok(out)
    }

    /// The Mooncake engine id of the prefill rank that holds the KV: vLLM suffixes each DP
    /// rank's `kv_transfer_config.engine_id` with `_dp{local rank}` (and registers that in the
    /// prefill's bootstrap server), so a prefill of several ranks is addressed by its chosen
    /// rank's id; one of one rank keeps the registered id.
    fn mooncake_engine_id(&self) -> Result<Value, PdError> {
        let id = self.param(Role::Prefill, "engine_id")?;
        match (self.pair.prefill.engine_dp_rank(), id.as_str()) {
            (None, _) => Ok(id.clone()),
            (Some(rank), Some(id)) => Ok(format!("{id}_dp{rank}").into()),
            (Some(_), None) => Err(self.meta_error(Role::Prefill, "engine_id")),
        }
    }

    fn mooncake_transfer_id(&self) -> String {
        format!("xfer-{:032x}", self.room)
    }

    /// The decode leg's body: the client's, with the protocol's `kv_transfer_params` built from
    /// the registrations and (serial protocols) the prefill's answer `handoff`.
    pub(crate) fn decode_body(
        &self,
        base: &Map<String, Value>,
        handoff: Option<Map<String, Value>>,
    ) -> Result<Map<String, Value>, PdError> {
        let need = |handoff: Option<Map<String, Value>>| {
            handoff.ok_or_else(|| self.handoff_error("its answer carries no kv_transfer_params"))
        };
        let params = match self.protocol {
            Protocol::SglangBootstrap => return self.sglang_body(base, Role::Decode),
            Protocol::VllmNixl => need(handoff)?,
            Protocol::VllmMooncake => {
                let engine_id = self.mooncake_engine_id()?;
                let mut p = object(json!({
                    "do_remote_decode": false,
                    "do_remote_prefill": true,
                    "remote_bootstrap_addr": self.param(Role::Prefill, "bootstrap_addr")?,
                    "remote_engine_id": engine_id,
                    "transfer_id": self.mooncake_transfer_id(),
                }));
                // Connector versions that answer the hand-off themselves know it best.
                p.extend(handoff.unwrap_or_default());
                p
            }
            Protocol::VllmMoriRead => {
                let h = need(handoff)?;
                let field = |key: &'static str| {
                    h.get(key).cloned().ok_or_else(|| {
                        self.handoff_error(&format!("kv_transfer_params.{key} is missing"))
                    })
                };
                let tp = self.mori_tp(Role::Prefill);
                object(json!({
                    "do_remote_decode": false,
                    "do_remote_prefill": true,
                    "transfer_id": field("transfer_id")?,
                    "remote_engine_id": field("remote_engine_id")?,
                    "remote_block_ids": field("remote_block_ids")?,
                    "remote_dp_size": self.pair.prefill.record.dp_size.max(1),
                    "tp_size": tp,
                    "remote_tp_size": tp,
                }))
            }
            Protocol::VllmMoriWrite => {
                let tp = self.mori_tp(Role::Prefill);
                object(json!({
                    "do_remote_decode": false,
                    "do_remote_prefill": true,
                    "remote_engine_id": null,
                    "remote_block_ids": null,
                    "transfer_id": format!("tx-{:032x}", self.room),
                    "remote_dp_size": self.pair.prefill.record.dp_size.max(1),
                    "tp_size": tp,
                    "remote_tp_size": tp,
                }))
            }
            Protocol::AtomMooncake => {
                let mut p = need(handoff)?;
                if !p.contains_key("transfer_id") {
                    return Err(self.handoff_error("kv_transfer_params.transfer_id is missing"));
                }
                let tp = self.param(Role::Prefill, "tp_size")?.clone();
                p.insert(
                    "remote_dp_size".into(),
                    self.param(Role::Prefill, "dp_size")?.clone(),
                );
                p.insert("remote_tp_size".into(), tp.clone());
                p.entry("tp_size").or_insert(tp);
                if let Some(rank) = p.get("dp_rank").filter(|v| v.is_u64()).cloned() {
                    p.insert("remote_dp_rank".into(), rank);
                }
                p
            }
        };
        Ok(with_kv(base.clone(), params, base))
    }

    fn handoff_error(&self, message: &str) -> PdError {
        PdError::Handoff {
            worker: self.pair.prefill.record.worker_id.to_string(),
            protocol: self.protocol.name(),
            message: message.to_owned(),
        }
    }

    /// The `kv_transfer_params` of the prefill's (JSON) answer, if it has any.
    ///
    /// # Errors
    /// [`PdError::Handoff`] when the answer is not a JSON object or its `kv_transfer_params` is
    /// not an object.
    pub(crate) fn handoff(&self, body: &[u8]) -> Result<Option<Map<String, Value>>, PdError> {
        let v: Value = serde_json::from_slice(body)
            .map_err(|e| self.handoff_error(&format!("its answer is not JSON: {e}")))?;
        match v.get("kv_transfer_params") {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Object(p)) => Ok(Some(p.clone())),
            Some(other) => {
                Err(self
                    .handoff_error(&format!("its kv_transfer_params is not an object: {other}")))
            }
        }
    }
}

fn object(v: Value) -> Map<String, Value> {
    match v {
        Value::Object(m) => m,
        _ => Map::new(),
    }
}

/// `body` with `kv_transfer_params` replaced by `params`, keeping the retention stamp of `base`.
fn with_kv(
    mut body: Map<String, Value>,
    mut params: Map<String, Value>,
    base: &Map<String, Value>,
) -> Map<String, Value> {
    if let Some(r) = base
        .get("kv_transfer_params")
        .and_then(|p| p.get("infera_retention"))
    {
        params
            .entry("infera_retention")
            .or_insert_with(|| r.clone());
    }
    body.insert("kv_transfer_params".into(), Value::Object(params));
    body
}

/// The client's body run for one token, not streamed (vLLM's disaggregated proxy does the same;
/// `min_tokens` cannot be honoured by one token).
fn single_token(base: &Map<String, Value>, chat: bool) -> Map<String, Value> {
    let mut out = base.clone();
    out.insert("max_tokens".into(), 1.into());
    if chat || out.contains_key("max_completion_tokens") {
        out.insert("max_completion_tokens".into(), 1.into());
    }
    out.insert("stream".into(), false.into());
    out.remove("stream_options");
    out.remove("min_tokens");
    out.remove("min_completion_tokens");
    out
}

/// The host of `http://host:port[/…]` (brackets kept off an IPv6 host).
fn url_host(url: &str) -> &str {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = rest.split('/').next().unwrap_or(rest);
    if let Some(v6) = authority.strip_prefix('[') {
        return v6.split(']').next().unwrap_or(v6);
    }
    authority.rsplit_once(':').map_or(authority, |(h, _)| h)
}

/// A leg that failed before the client's first byte.
#[derive(Debug)]
pub(crate) enum LegError {
    /// The leg's transport failed.
    Transport {
        role: Role,
        rank: WorkerRank,
        error: TransportError,
    },
    /// The prefill leg answered an error status.
    Status { rank: WorkerRank, response: Inbound },
    /// The pair cannot be driven.
    Pd(PdError),
}

impl From<PdError> for LegError {
    fn from(e: PdError) -> Self {
        LegError::Pd(e)
    }
}

/// Sends one attempt's two legs and resolves to the decode leg's response. See the module docs.
///
/// `prefilled` runs once the prefill leg has completed (its whole answer arrived with a success
/// status), at most once, and not at all when it failed.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn send(
    transport: &Arc<dyn RequestTransport>,
    shape: Shape<'_>,
    path: &'static str,
    base: &Map<String, Value>,
    stream: bool,
    request_id: &str,
    max_handoff_bytes: usize,
    prefilled: impl FnOnce() + Send + 'static,
) -> Result<Inbound, LegError> {
    let pair = shape.pair;
    let engine_id = shape
        .engine_request_id()?
        .unwrap_or_else(|| request_id.to_owned());
    let outbound = |leg: &Leg, body: &Map<String, Value>, stream: bool| Outbound {
        worker: leg.rank.worker.clone(),
        url: leg.url.clone(),
        path,
        body: Bytes::from(serde_json::to_vec(body).unwrap_or_default()),
        stream,
        request_id: request_id.to_owned(),
        engine_request_id: Some(engine_id.clone()),
        dp_rank: leg.engine_dp_rank(),
    };
    let prefill_body = shape.prefill_body(base)?;
    let prefill_stream = prefill_body
        .get("stream")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let prefill_out = outbound(&pair.prefill, &prefill_body, prefill_stream);
    let prefill = async {
        match transport.send(prefill_out).await {
            Err(error) => Err(LegError::Transport {
                role: Role::Prefill,
                rank: pair.prefill.rank.clone(),
                error: on_leg(Role::Prefill, error),
            }),
            Ok(response) if !response.status.is_success() => Err(LegError::Status {
                rank: pair.prefill.rank.clone(),
                response,
            }),
            Ok(response) => Ok(response),
        }
    };
    let send_decode = |body: Map<String, Value>| async move {
        transport
            .send(outbound(&pair.decode, &body, stream))
            .await
            .map_err(|error| LegError::Transport {
                role: Role::Decode,
                rank: pair.decode.rank.clone(),
                error: on_leg(Role::Decode, error),
            })
    };
    if shape.protocol.concurrent() {
        let decode_body = shape.decode_body(base, None)?;
        // SGLang needs an explicit abort of a leg left running (see `pd_abort`); for the
        // others, dropping a leg closes its connection, which the engine takes as an abort.
        let mut guard = (shape.protocol == Protocol::SglangBootstrap).then(|| {
            let target = |leg: &Leg| LegTarget {
                worker: leg.rank.worker.clone(),
                url: leg.url.clone(),
            };
            AbortGuard::new(
                transport.clone(),
                sglang_rid(shape.room),
                request_id.to_owned(),
                target(&pair.prefill),
                target(&pair.decode),
            )
        });
        let mark = guard.as_ref().map(AbortGuard::prefill);
        let prefill = async {
            let r = prefill.await;
            if r.is_err()
                && let Some(mark) = &mark
            {
                mark.ended();
            }
            r
        };
        // The first leg to fail drops the other; the guard (dropped with this attempt) aborts
        // the leg that was left running.
        let (prefill, mut decode) =
            match futures::future::try_join(prefill, send_decode(decode_body)).await {
                Ok(legs) => legs,
                Err(e) => {
                    if let (Some(g), LegError::Transport { role, .. }) = (&mut guard, &e)
                        && *role == Role::Decode
                    {
                        g.decode_failed();
                    }
                    return Err(e);
                }
            };
        tokio::spawn(drain_prefill(
            prefill,
            pair.prefill.rank.clone(),
            mark,
            prefilled,
        ));
        if let Some(mut g) = guard {
            if decode.status.is_success() {
                decode.body = g.guard_body(decode.body);
            } else {
                // The decode leg refused the request: nothing runs there, and a prefill still
                // running waits for a peer that never comes (the guard aborts it here).
                g.decode_failed();
            }
        }
        return Ok(decode);
    }
    let prefill = prefill.await?;
    let answer =
        collect(prefill, max_handoff_bytes)
            .await
            .map_err(|error| LegError::Transport {
                role: Role::Prefill,
                rank: pair.prefill.rank.clone(),
                error: on_leg(Role::Prefill, error),
            })?;
    prefilled();
    let handoff = shape.handoff(&answer)?;
    send_decode(shape.decode_body(base, handoff)?).await
}

/// `error` with the leg it happened on named first (same kind, so the same status and retry).
fn on_leg(role: Role, error: TransportError) -> TransportError {
    let leg = |m: String| format!("{} leg: {m}", role.as_str());
    match error {
        TransportError::Unreachable(m) => TransportError::Unreachable(leg(m)),
        TransportError::Overloaded {
            message,
            retry_after_s,
        } => TransportError::Overloaded {
            message: leg(message),
            retry_after_s,
        },
        TransportError::Timeout(m) => TransportError::Timeout(leg(m)),
        TransportError::Sequence(m) => TransportError::Sequence(leg(m)),
        TransportError::Failed(m) => TransportError::Failed(leg(m)),
    }
}

/// The whole body of a (small) response, up to `max` bytes.
async fn collect(response: Inbound, max: usize) -> Result<Vec<u8>, TransportError> {
    let mut body = response.body;
    let mut out = Vec::new();
    while let Some(chunk) = body.next().await {
        out.extend_from_slice(&chunk?);
        if out.len() > max {
            return Err(TransportError::Failed(format!(
                "the prefill answer is larger than {max} bytes"
            )));
        }
    }
    Ok(out)
}

/// Reads a concurrent prefill leg's answer to its end, so the engine finishes the hand-off;
/// then the leg has completed (`prefilled`) and is no longer running (`mark`). A failure
/// midway is logged; the leg then counts as running (an SGLang abort still reaches it).
async fn drain_prefill(
    response: Inbound,
    rank: WorkerRank,
    mark: Option<PrefillMark>,
    prefilled: impl FnOnce(),
) {
    let mut body = response.body;
    while let Some(chunk) = body.next().await {
        if let Err(e) = chunk {
            tracing::warn!(worker = %rank.worker.as_str(), dp_rank = rank.dp_rank, error = %e,
                "PD prefill leg failed after the decode leg started");
            return;
        }
    }
    if let Some(mark) = mark {
        mark.ended();
    }
    prefilled();
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::server::test_support::record;

    fn leg(id: &str, role: Role, meta: Value) -> Leg {
        let mut record = record(id);
        record.disagg_mode = role;
        record.disagg_meta = Some(meta);
        Leg {
            rank: WorkerRank::new(id, 0),
            url: format!("http://{id}"),
            record,
        }
    }

    fn pair(protocol: &str, prefill_params: Value, decode_params: Value) -> Pair {
        Pair {
            prefill: leg(
                "10.0.0.1:8000",
                Role::Prefill,
                json!({"protocol": protocol, "params": prefill_params}),
            ),
            decode: leg(
                "10.0.0.2:8000",
                Role::Decode,
                json!({"protocol": protocol, "params": decode_params}),
            ),
        }
    }

    fn base(extra: Value) -> Map<String, Value> {
        let mut b = object(json!({
            "model": "m",
            "prompt": "hi",
            "max_tokens": 64,
            "stream": true,
            "stream_options": {"include_usage": true},
            "min_tokens": 4,
            "kv_transfer_params": {"infera_retention": "short"},
        }));
        b.extend(object(extra));
        b
    }

    fn shape(protocol: Protocol, pair: &Pair, chat: bool) -> Shape<'_> {
        Shape {
            protocol,
            pair,
            room: 0xabc,
            chat,
        }
    }

    #[test]
    fn sglang_legs_carry_the_prefill_bootstrap_and_one_room() {
        let pair = pair(
            "sglang-bootstrap",
            json!({"bootstrap_host": "node1", "bootstrap_port": 9000}),
            json!({}),
        );
        let s = shape(Protocol::SglangBootstrap, &pair, false);
        let b = base(json!({}));
        let p = s.prefill_body(&b).unwrap();
        let d = s.decode_body(&b, None).unwrap();
        assert_eq!(p, d, "SGLang's legs get the same body");
        assert_eq!(p["bootstrap_host"], "node1");
        assert_eq!(p["bootstrap_port"], 9000);
        assert_eq!(p["bootstrap_room"], 0xabc);
        // Everything else is the client's, stream and max_tokens included.
        assert_eq!(p["max_tokens"], 64);
        assert_eq!(p["stream"], true);
        assert_eq!(
            p["kv_transfer_params"],
            json!({"infera_retention": "short"})
        );
        assert_eq!(s.engine_request_id().unwrap(), None);
    }

    #[test]
    fn sglang_reads_the_python_workers_bootstrap_addr() {
        let pair = pair(
            "sglang-bootstrap",
            json!({"bootstrap_addr": "10.1.2.3:8998"}),
            json!({}),
        );
        let p = shape(Protocol::SglangBootstrap, &pair, false)
            .prefill_body(&base(json!({})))
            .unwrap();
        assert_eq!(p["bootstrap_host"], "10.1.2.3");
        assert_eq!(p["bootstrap_port"], 8998);
    }

    #[test]
    fn sglang_without_a_bootstrap_is_a_meta_error_naming_the_prefill() {
        let pair = pair("sglang-bootstrap", json!({}), json!({}));
        let e = shape(Protocol::SglangBootstrap, &pair, false)
            .prefill_body(&base(json!({})))
            .unwrap_err();
        assert!(
            e.to_string().contains("prefill worker 10.0.0.1:8000"),
            "{e}"
        );
        assert_eq!(e.status(), axum::http::StatusCode::INTERNAL_SERVER_ERROR);
    }

    #[test]
    fn nixl_prefill_runs_one_token_and_decode_takes_the_answered_params() {
        let pair = pair("vllm-nixl", json!({"engine_id": "p"}), json!({}));
        let s = shape(Protocol::VllmNixl, &pair, true);
        let b = base(json!({"max_completion_tokens": 50}));
        let p = s.prefill_body(&b).unwrap();
        assert_eq!(p["max_tokens"], 1);
        assert_eq!(p["max_completion_tokens"], 1);
        assert_eq!(p["stream"], false);
        assert!(p.get("stream_options").is_none() && p.get("min_tokens").is_none());
        assert_eq!(
            p["kv_transfer_params"],
            json!({"do_remote_decode": true, "do_remote_prefill": false,
                "remote_engine_id": null, "remote_block_ids": null,
                "remote_host": null, "remote_port": null, "infera_retention": "short"})
        );
        let answer = json!({"id": "x", "kv_transfer_params": {
            "do_remote_prefill": true, "do_remote_decode": false,
            "remote_engine_id": "p", "remote_block_ids": [1, 2],
            "remote_host": "10.0.0.1", "remote_port": 5600}});
        let handoff = s.handoff(answer.to_string().as_bytes()).unwrap();
        let d = s.decode_body(&b, handoff).unwrap();
        assert_eq!(
            d["max_tokens"], 64,
            "the decode leg keeps the client's budget"
        );
        assert_eq!(d["max_completion_tokens"], 50);
        assert_eq!(d["stream"], true);
        assert_eq!(d["stream_options"], json!({"include_usage": true}));
        assert_eq!(d["min_tokens"], 4);
        let mut expected = answer["kv_transfer_params"].clone();
        expected["infera_retention"] = "short".into();
        assert_eq!(d["kv_transfer_params"], expected);
    }

    #[test]
    fn a_chat_prefill_caps_max_completion_tokens_too() {
        let pair = pair("vllm-nixl", json!({}), json!({}));
        let chat = shape(Protocol::VllmNixl, &pair, true)
            .prefill_body(&base(json!({})))
            .unwrap();
        assert_eq!(chat["max_completion_tokens"], 1);
        let completion = shape(Protocol::VllmNixl, &pair, false)
            .prefill_body(&base(json!({})))
            .unwrap();
        assert!(completion.get("max_completion_tokens").is_none());
    }

    #[test]
    fn nixl_decode_without_an_answered_handoff_is_a_502() {
        let pair = pair("vllm-nixl", json!({}), json!({}));
        let s = shape(Protocol::VllmNixl, &pair, false);
        let handoff = s.handoff(br#"{"id": "x"}"#).unwrap();
        let e = s.decode_body(&base(json!({})), handoff).unwrap_err();
        assert_eq!(e.status(), axum::http::StatusCode::BAD_GATEWAY);
        assert!(s.handoff(b"not json").is_err());
        assert!(s.handoff(br#"{"kv_transfer_params": 3}"#).is_err());
    }

    #[test]
    fn mooncake_decode_addresses_the_prefill_bootstrap_with_a_shared_transfer_id() {
        let pair = pair(
            "vllm-mooncake",
            json!({"engine_id": "eng-p", "bootstrap_addr": "http://10.0.0.1:8998"}),
            json!({"engine_id": "eng-d"}),
        );
        let s = shape(Protocol::VllmMooncake, &pair, false);
        let b = base(json!({}));
        let p = s.prefill_body(&b).unwrap();
        let xfer = format!("xfer-{:032x}", 0xabc);
        assert_eq!(
            p["kv_transfer_params"],
            json!({"do_remote_decode": true, "do_remote_prefill": false,
                "transfer_id": xfer, "infera_retention": "short"})
        );
        // A connector that answers nothing: the registration says where to pull from.
        let d = s.decode_body(&b, None).unwrap();
        assert_eq!(
            d["kv_transfer_params"],
            json!({"do_remote_decode": false, "do_remote_prefill": true,
                "remote_bootstrap_addr": "http://10.0.0.1:8998", "remote_engine_id": "eng-p",
                "transfer_id": xfer, "infera_retention": "short"})
        );
        // One that answers: its values win.
        let answered = object(json!({"remote_engine_id": "eng-p_dp1"}));
        let d = s.decode_body(&b, Some(answered)).unwrap();
        assert_eq!(d["kv_transfer_params"]["remote_engine_id"], "eng-p_dp1");
        // Without the prefill's bootstrap address the pair cannot run.
        let bad = self::pair("vllm-mooncake", json!({"engine_id": "e"}), json!({}));
        let e = shape(Protocol::VllmMooncake, &bad, false)
            .decode_body(&b, None)
            .unwrap_err();
        assert!(e.to_string().contains("bootstrap_addr"), "{e}");
    }

    #[test]
    fn mori_forges_the_peer_addressed_request_id_and_read_pulls_the_answer() {
        let extra = |h: u16, n: u16| json!({"kv_connector_extra_config": {"handshake_port": h, "notify_port": n, "tp_size": 2}});
        let pair = pair("vllm-mori-read", extra(6301, 6401), extra(7301, 7401));
        let s = shape(Protocol::VllmMoriRead, &pair, false);
        assert_eq!(
            s.engine_request_id().unwrap().unwrap(),
            format!(
                "___prefill_addr_host:10.0.0.1,handshake:6301,notify:6401___decode_addr_host:10.0.0.2,handshake:7301,notify:7401_{:032x}",
                0xabc
            )
        );
        let b = base(json!({}));
        let p = s.prefill_body(&b).unwrap();
        assert_eq!(p["kv_transfer_params"]["do_remote_decode"], true);
        assert_eq!(p["kv_transfer_params"]["remote_tp_size"], 2);
        let answer = br#"{"kv_transfer_params": {"transfer_id": "tx-1", "remote_engine_id": "e", "remote_block_ids": [3]}}"#;
        let d = s.decode_body(&b, s.handoff(answer).unwrap()).unwrap();
        assert_eq!(
            d["kv_transfer_params"],
            json!({"do_remote_decode": false, "do_remote_prefill": true, "transfer_id": "tx-1",
                "remote_engine_id": "e", "remote_block_ids": [3], "remote_dp_size": 1,
                "tp_size": 2, "remote_tp_size": 2, "infera_retention": "short"})
        );
        let missing = br#"{"kv_transfer_params": {"transfer_id": "tx-1"}}"#;
        assert!(s.decode_body(&b, s.handoff(missing).unwrap()).is_err());
        // Without the side-channel ports MoRI cannot address its peers.
        let bare = self::pair("vllm-mori-write", json!({}), json!({}));
        assert!(
            shape(Protocol::VllmMoriWrite, &bare, false)
                .engine_request_id()
                .is_err()
        );
    }

    #[test]
    fn mori_write_decode_needs_no_answer() {
        let pair = pair("vllm-mori-write", json!({}), json!({}));
        let d = shape(Protocol::VllmMoriWrite, &pair, false)
            .decode_body(&base(json!({})), None)
            .unwrap();
        assert_eq!(d["kv_transfer_params"]["do_remote_prefill"], true);
        assert_eq!(
            d["kv_transfer_params"]["transfer_id"],
            format!("tx-{:032x}", 0xabc)
        );
    }

    #[test]
    fn atom_prefill_names_the_decode_peer_and_decode_reuses_the_answer() {
        let atom = |host: &str, port: u16| json!({"host": host, "http_port": port, "handshake_port": 6301, "tp_size": 8, "dp_size": 1});
        let pair = pair(
            "atom-mooncake",
            atom("10.0.0.1", 8000),
            atom("10.0.0.2", 8001),
        );
        let s = shape(Protocol::AtomMooncake, &pair, false);
        let b = base(json!({}));
        let p = s.prefill_body(&b).unwrap();
        assert_eq!(p["kv_transfer_params"]["remote_host"], "10.0.0.2");
        assert_eq!(p["kv_transfer_params"]["remote_port"], 8001);
        assert_eq!(p["kv_transfer_params"]["remote_handshake_port"], 6301);
        assert_eq!(p["kv_transfer_params"]["remote_tp_size"], 8);
        let answer = br#"{"kv_transfer_params": {"transfer_id": 7, "first_token_id": 11, "dp_rank": 0, "do_remote_prefill": true}}"#;
        let d = s.decode_body(&b, s.handoff(answer).unwrap()).unwrap();
        assert_eq!(
            d["kv_transfer_params"],
            json!({"transfer_id": 7, "first_token_id": 11, "dp_rank": 0,
                "do_remote_prefill": true, "remote_dp_size": 1, "remote_tp_size": 8,
                "tp_size": 8, "remote_dp_rank": 0, "infera_retention": "short"})
        );
        assert_eq!(d["max_tokens"], 64);
        let no_transfer = br#"{"kv_transfer_params": {"dp_rank": 0}}"#;
        assert!(s.decode_body(&b, s.handoff(no_transfer).unwrap()).is_err());
    }

    #[test]
    fn mismatched_or_unknown_protocols_name_both_workers() {
        let mut p = pair("sglang-bootstrap", json!({}), json!({}));
        p.decode.record.disagg_meta = Some(json!({"protocol": "vllm-nixl"}));
        let e = resolve(&p.prefill.record, &p.decode.record).unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("10.0.0.1:8000 registers sglang-bootstrap")
                && text.contains("10.0.0.2:8000 registers vllm-nixl"),
            "{text}"
        );
        p.decode.record.disagg_meta = None;
        let e = resolve(&p.prefill.record, &p.decode.record).unwrap_err();
        assert!(e.to_string().contains("no protocol"), "{e}");
        let odd = pair("carrier-pigeon", json!({}), json!({}));
        let e = resolve(&odd.prefill.record, &odd.decode.record).unwrap_err();
        assert!(e.to_string().contains("carrier-pigeon"), "{e}");
        let ok = pair("vllm-mooncake", json!({}), json!({}));
        assert_eq!(
            resolve(&ok.prefill.record, &ok.decode.record).unwrap(),
            Protocol::VllmMooncake
        );
    }

    #[test]
    fn rooms_are_u63_and_fresh() {
        let rooms: std::collections::HashSet<u64> = (0..1000).map(|_| new_room(42)).collect();
        assert_eq!(rooms.len(), 1000);
        assert!(rooms.iter().all(|r| *r < 1 << 63));
    }

    /// `pair` with the prefill fronting `p_size` ranks from `p_first`, steered to `p_rank`, and
    /// the decode fronting `d_size` ranks, steered to `d_rank`.
    fn dp(
        mut pair: Pair,
        (p_first, p_size, p_rank): (u32, u32, u32),
        (d_size, d_rank): (u32, u32),
    ) -> Pair {
        pair.prefill.record.dp_rank = p_first;
        pair.prefill.record.dp_size = p_size;
        pair.prefill.rank.dp_rank = p_rank;
        pair.decode.record.dp_size = d_size;
        pair.decode.rank.dp_rank = d_rank;
        pair
    }

    #[test]
    fn an_sglang_dp_prefill_gets_a_room_of_its_rank_and_the_decode_names_it() {
        let pair = dp(
            pair(
                "sglang-bootstrap",
                json!({"bootstrap_host": "node1", "bootstrap_port": 9000}),
                json!({}),
            ),
            (0, 4, 2),
            (2, 1),
        );
        for drawn in [0, 1, 2, 3, 0xabc, (1 << 63) - 1] {
            let s = Shape::new(Protocol::SglangBootstrap, &pair, drawn, false);
            assert_eq!(s.room % 4, 2, "room {drawn}");
            assert!(s.room < 1 << 63, "room {drawn} stays a u63");
            let b = base(json!({}));
            let p = s.prefill_body(&b).unwrap();
            let d = s.decode_body(&b, None).unwrap();
            assert_eq!(p["bootstrap_room"], s.room);
            assert_eq!(d["bootstrap_room"], s.room);
            assert_eq!(p["rid"], sglang_rid(s.room));
            assert_eq!(d["rid"], p["rid"], "one rid for both legs");
            assert_eq!(d["disagg_prefill_dp_rank"], 2);
            assert!(p.get("disagg_prefill_dp_rank").is_none());
        }
        assert_eq!(pair.prefill.engine_dp_rank(), Some(2));
        assert_eq!(pair.decode.engine_dp_rank(), Some(1));
        // A prefill of one rank: the room as drawn, no rank named.
        let one = self::pair(
            "sglang-bootstrap",
            json!({"bootstrap_addr": "h:1"}),
            json!({}),
        );
        let s = Shape::new(Protocol::SglangBootstrap, &one, 0xabc, false);
        assert_eq!(s.room, 0xabc);
        let d = s.decode_body(&base(json!({})), None).unwrap();
        assert!(d.get("disagg_prefill_dp_rank").is_none());
        assert_eq!(one.prefill.engine_dp_rank(), None);
    }

    #[test]
    fn sglang_rids_have_one_length_so_none_prefixes_another() {
        assert_eq!(sglang_rid(0xab), "infera-00000000000000ab");
        assert_eq!(sglang_rid((1 << 63) - 1).len(), sglang_rid(1).len());
    }

    #[test]
    fn mooncake_decode_names_the_chosen_prefill_ranks_engine_id() {
        let meta = json!({"engine_id": "eng-p", "bootstrap_addr": "http://10.0.0.1:8998"});
        // The worker registered ranks 4..6 and the router chose rank 5: vLLM's local rank 1.
        let pair = dp(
            pair("vllm-mooncake", meta.clone(), json!({})),
            (4, 2, 5),
            (1, 0),
        );
        let s = Shape::new(Protocol::VllmMooncake, &pair, 0xabc, false);
        let d = s.decode_body(&base(json!({})), None).unwrap();
        assert_eq!(d["kv_transfer_params"]["remote_engine_id"], "eng-p_dp1");
        // One rank: the registered id as is.
        let one = self::pair("vllm-mooncake", meta, json!({}));
        let d = Shape::new(Protocol::VllmMooncake, &one, 0xabc, false)
            .decode_body(&base(json!({})), None)
            .unwrap();
        assert_eq!(d["kv_transfer_params"]["remote_engine_id"], "eng-p");
        // An engine id that is not a string cannot be suffixed: a registration error.
        let bad = dp(
            self::pair(
                "vllm-mooncake",
                json!({"engine_id": 7, "bootstrap_addr": "http://h:1"}),
                json!({}),
            ),
            (0, 2, 1),
            (1, 0),
        );
        let e = Shape::new(Protocol::VllmMooncake, &bad, 1, false)
            .decode_body(&base(json!({})), None)
            .unwrap_err();
        assert!(e.to_string().contains("engine_id"), "{e}");
    }

    /// Records every request; answers each leg with its status and a nixl-shaped hand-off,
    /// and an abort with 200 (reported on `aborts`).
    #[derive(Debug)]
    struct Fake {
        sent: std::sync::Mutex<Vec<Outbound>>,
        prefill_status: axum::http::StatusCode,
        decode_status: axum::http::StatusCode,
        aborts: tokio::sync::mpsc::Sender<Outbound>,
        events: Arc<std::sync::Mutex<Vec<String>>>,
    }

    #[async_trait::async_trait]
    impl RequestTransport for Fake {
        fn name(&self) -> &'static str {
            "fake"
        }

        async fn send(&self, req: Outbound) -> Result<Inbound, TransportError> {
            let worker = req.worker.as_str().to_owned();
            let is_abort = req.path == super::super::pd_abort::ABORT_PATH;
            self.events
                .lock()
                .unwrap()
                .push(format!("{worker} {}", req.path));
            self.sent.lock().unwrap().push(req.clone());
            if is_abort {
                let _ = self.aborts.send(req).await;
            }
            let status = match (worker.as_str(), is_abort) {
                (_, true) => axum::http::StatusCode::OK,
                ("10.0.0.1:8000", false) => self.prefill_status,
                _ => self.decode_status,
            };
            let body = br#"{"kv_transfer_params": {"do_remote_prefill": true}}"#;
            Ok(Inbound {
                status,
                content_type: None,
                body: futures::stream::iter([Ok(Bytes::from_static(body))]).boxed(),
            })
        }
    }

    /// A [`Fake`] whose prefill (`10.0.0.1:8000`) answers `prefill_status` and whose decode
    /// answers `decode_status`.
    fn fake(
        prefill_status: axum::http::StatusCode,
        decode_status: axum::http::StatusCode,
    ) -> (Arc<Fake>, tokio::sync::mpsc::Receiver<Outbound>) {
        let (tx, rx) = tokio::sync::mpsc::channel(8);
        let f = Fake {
            sent: std::sync::Mutex::new(Vec::new()),
            prefill_status,
            decode_status,
            aborts: tx,
            events: Arc::default(),
        };
        (Arc::new(f), rx)
    }

    async fn drive(
        f: &Arc<Fake>,
        shape: Shape<'_>,
        prefilled: tokio::sync::oneshot::Sender<()>,
    ) -> Result<Inbound, LegError> {
        let transport: Arc<dyn RequestTransport> = f.clone();
        let events = f.events.clone();
        send(
            &transport,
            shape,
            "/v1/completions",
            &base(json!({})),
            true,
            "req-1",
            1 << 16,
            move || {
                events.lock().unwrap().push("prefilled".into());
                let _ = prefilled.send(());
            },
        )
        .await
    }

    #[tokio::test]
    async fn each_leg_is_pinned_to_its_dp_rank_and_a_serial_prefill_completes_before_decode() {
        let pair = dp(pair("vllm-nixl", json!({}), json!({})), (0, 4, 3), (2, 1));
        let (f, _aborts) = fake(axum::http::StatusCode::OK, axum::http::StatusCode::OK);
        let (tx, rx) = tokio::sync::oneshot::channel();
        let shape = Shape::new(Protocol::VllmNixl, &pair, 7, false);
        let decode = drive(&f, shape, tx).await.unwrap();
        assert_eq!(decode.status, axum::http::StatusCode::OK);
        rx.await.unwrap();
        let ranks: Vec<Option<u32>> = f.sent.lock().unwrap().iter().map(|o| o.dp_rank).collect();
        assert_eq!(ranks, [Some(3), Some(1)], "prefill, then decode");
        assert_eq!(
            *f.events.lock().unwrap(),
            [
                "10.0.0.1:8000 /v1/completions",
                "prefilled",
                "10.0.0.2:8000 /v1/completions"
            ],
            "the prefill leg completed before the decode leg was sent"
        );
        // Workers of one rank are not steered.
        let plain = pair_one();
        let (f, _aborts) = fake(axum::http::StatusCode::OK, axum::http::StatusCode::OK);
        let (tx, _rx) = tokio::sync::oneshot::channel();
        drive(&f, Shape::new(Protocol::VllmNixl, &plain, 7, false), tx)
            .await
            .unwrap();
        assert!(f.sent.lock().unwrap().iter().all(|o| o.dp_rank.is_none()));
    }

    fn pair_one() -> Pair {
        pair("vllm-nixl", json!({}), json!({}))
    }

    #[tokio::test]
    async fn a_concurrent_prefill_is_prefilled_when_its_answer_ends() {
        let pair = pair(
            "sglang-bootstrap",
            json!({"bootstrap_addr": "h:1"}),
            json!({}),
        );
        let (f, aborts) = fake(axum::http::StatusCode::OK, axum::http::StatusCode::OK);
        let (tx, rx) = tokio::sync::oneshot::channel();
        let shape = Shape::new(Protocol::SglangBootstrap, &pair, 7, false);
        let decode = drive(&f, shape, tx).await.unwrap();
        // The prefill's answer is drained in the background; then it counts as prefilled.
        rx.await.unwrap();
        // Reading the decode leg to its end aborts nothing: once the pair is gone, no abort
        // task holds the transport (whose `aborts` sender then closes).
        let (mut body, mut aborts) = (decode.body, aborts);
        while body.next().await.is_some() {}
        drop((body, f));
        assert!(aborts.recv().await.is_none());
    }

    #[tokio::test]
    async fn an_sglang_prefill_that_fails_aborts_the_decode_leg_it_left_running() {
        let pair = pair(
            "sglang-bootstrap",
            json!({"bootstrap_addr": "h:1"}),
            json!({}),
        );
        let (f, mut aborts) = fake(
            axum::http::StatusCode::SERVICE_UNAVAILABLE,
            axum::http::StatusCode::OK,
        );
        let (tx, rx) = tokio::sync::oneshot::channel();
        let shape = Shape::new(Protocol::SglangBootstrap, &pair, 7, false);
        let rid = sglang_rid(shape.room);
        let e = drive(&f, shape, tx).await.unwrap_err();
        assert!(matches!(e, LegError::Status { .. }), "{e:?}");
        assert!(rx.await.is_err(), "a failed prefill is never prefilled");
        // Every abort, once the last abort task let go of the transport.
        drop(f);
        let mut aborted = Vec::new();
        while let Some(abort) = aborts.recv().await {
            assert_eq!(
                serde_json::from_slice::<Value>(&abort.body).unwrap(),
                json!({"rid": rid})
            );
            aborted.push(abort.worker.as_str().to_owned());
        }
        assert_eq!(
            aborted,
            ["10.0.0.2:8000"],
            "the decode leg, not the failed prefill"
        );
    }

    #[tokio::test]
    async fn an_sglang_decode_that_refuses_aborts_the_prefill_leg_still_running() {
        let pair = pair(
            "sglang-bootstrap",
            json!({"bootstrap_addr": "h:1"}),
            json!({}),
        );
        let (f, mut aborts) = fake(
            axum::http::StatusCode::OK,
            axum::http::StatusCode::BAD_REQUEST,
        );
        let (tx, _rx) = tokio::sync::oneshot::channel();
        let shape = Shape::new(Protocol::SglangBootstrap, &pair, 7, false);
        let decode = drive(&f, shape, tx).await.unwrap();
        assert_eq!(decode.status, axum::http::StatusCode::BAD_REQUEST);
        drop((decode, f));
        let mut aborted = Vec::new();
        while let Some(abort) = aborts.recv().await {
            aborted.push(abort.worker.as_str().to_owned());
        }
        assert_eq!(
            aborted,
            ["10.0.0.1:8000"],
            "the prefill leg, not the decode"
        );
    }

    #[test]
    fn url_hosts() {
        assert_eq!(url_host("http://10.0.0.1:8000"), "10.0.0.1");
        assert_eq!(url_host("http://[::1]:8000/x"), "::1");
        assert_eq!(url_host("node"), "node");
    }
}
