//! The bodies of both legs, per PD protocol (the table in [`super`]'s docs): what each
//! protocol adds to the client's body, read from the pair's registrations.

use super::{Leg, Pair, PdError};
use infera_core::event::Role;
use infera_core::pd::{PdProtocol, Registered};
use serde_json::{Map, Value, json};

/// What the protocol needs to know about one request.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Shape<'a> {
    pub(crate) protocol: PdProtocol,
    pub(crate) pair: &'a Pair,
    pub(crate) room: u64,
    /// A chat completion (`max_completion_tokens` is capped too).
    pub(crate) chat: bool,
}

impl<'a> Shape<'a> {
    /// The shape of one attempt, its `room` drawn by [`new_room`] and aligned to the prefill's
    /// DP rank ([`align_room`]).
    pub(crate) fn new(protocol: PdProtocol, pair: &'a Pair, room: u64, chat: bool) -> Self {
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
        Registered::of(&self.leg(role).record)
            .param(key)
            .ok_or_else(|| self.meta_error(role, key))
    }

    /// SGLang's bootstrap address: `bootstrap_host` + `bootstrap_port` (our launcher) or
    /// `bootstrap_addr` `"host:port"` (the Python Infera worker).
    fn bootstrap(&self) -> Result<(String, u64), PdError> {
        let p = Registered::of(&self.pair.prefill.record);
        let host = p.param("bootstrap_host").and_then(Value::as_str);
        let port = p.param("bootstrap_port").and_then(|v| {
            v.as_u64()
                .or_else(|| v.as_str().and_then(|s| s.parse().ok()))
        });
        if let (Some(host), Some(port)) = (host, port) {
            return Ok((host.to_owned(), port));
        }
        p.param("bootstrap_addr")
            .and_then(Value::as_str)
            .and_then(|addr| addr.rsplit_once(':'))
            .and_then(|(h, port)| Some((h.to_owned(), port.parse().ok()?)))
            .ok_or_else(|| self.meta_error(Role::Prefill, "bootstrap_host"))
    }

    /// MoRI's tensor-parallel size of a leg (`kv_connector_extra_config.tp_size`, default 1).
    fn mori_tp(&self, role: Role) -> u64 {
        Registered::of(&self.leg(role).record)
            .param("kv_connector_extra_config")
            .and_then(|e| e.get("tp_size"))
            .and_then(Value::as_u64)
            .unwrap_or(1)
    }

    fn mori_address(&self, role: Role) -> Result<String, PdError> {
        let leg = self.leg(role);
        let host = url_host(&leg.url);
        let extra = Registered::of(&leg.record).param("kv_connector_extra_config");
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
            PdProtocol::VllmMoriRead | PdProtocol::VllmMoriWrite => Ok(Some(format!(
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
            PdProtocol::SglangBootstrap => return self.sglang_body(base, Role::Prefill),
            PdProtocol::VllmNixl => object(json!({
                "do_remote_decode": true,
                "do_remote_prefill": false,
                "remote_engine_id": null,
                "remote_block_ids": null,
                "remote_host": null,
                "remote_port": null,
            })),
            PdProtocol::VllmMooncake => object(json!({
                "do_remote_decode": true,
                "do_remote_prefill": false,
                "transfer_id": self.mooncake_transfer_id(),
            })),
            PdProtocol::VllmMoriRead | PdProtocol::VllmMoriWrite => self.mori_prefill_params(),
            PdProtocol::AtomMooncake => object(json!({
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
            PdProtocol::SglangBootstrap => return self.sglang_body(base, Role::Decode),
            PdProtocol::VllmNixl => need(handoff)?,
            PdProtocol::VllmMooncake => {
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
            PdProtocol::VllmMoriRead => {
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
            PdProtocol::VllmMoriWrite => {
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
            PdProtocol::AtomMooncake => {
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

pub(super) fn object(v: Value) -> Map<String, Value> {
    match v {
        Value::Object(m) => m,
        _ => Map::new(),
    }
}

/// `body` with `kv_transfer_params` replaced by `params`, keeping the retention stamp of `base`.
pub(super) fn with_kv(
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
pub(super) fn single_token(base: &Map<String, Value>, chat: bool) -> Map<String, Value> {
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
pub(super) fn url_host(url: &str) -> &str {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = rest.split('/').next().unwrap_or(rest);
    if let Some(v6) = authority.strip_prefix('[') {
        return v6.split(']').next().unwrap_or(v6);
    }
    authority.rsplit_once(':').map_or(authority, |(h, _)| h)
}
