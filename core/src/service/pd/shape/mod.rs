//! The bodies of both legs, per PD protocol (the table in [`super`]'s docs): what each
//! protocol adds to the client's body, read from the pair's registrations. What is common to
//! every protocol is here; each engine family's own parameters are in its module (`sglang`,
//! `vllm`, `atom`).

mod atom;
mod sglang;
mod vllm;

pub(crate) use sglang::sglang_rid;

use super::{Leg, Pair, PdError};
use crate::event::Role;
use crate::pd::{PdFamily, PdProtocol, Registered};
use serde_json::{Map, Value};

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

impl Shape<'_> {
    pub(crate) fn meta_error(&self, role: Role, key: &'static str) -> PdError {
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

    pub(crate) fn leg(&self, role: Role) -> &Leg {
        if role == Role::Prefill {
            &self.pair.prefill
        } else {
            &self.pair.decode
        }
    }

    /// A registration parameter of the `role` leg.
    pub(crate) fn param(&self, role: Role, key: &'static str) -> Result<&Value, PdError> {
        Registered::of(&self.leg(role).record)
            .param(key)
            .ok_or_else(|| self.meta_error(role, key))
    }

    /// The engine request id (`X-Request-Id`) both legs carry, when the protocol needs one
    /// (MoRI's, which carries the peers' addresses).
    pub(crate) fn engine_request_id(&self) -> Result<Option<String>, PdError> {
        match self.protocol {
            PdProtocol::VllmMoriRead | PdProtocol::VllmMoriWrite => {
                self.mori_request_id().map(Some)
            }
            _ => Ok(None),
        }
    }

    /// The prefill leg's body, from the client's (already stamped) body.
    pub(crate) fn prefill_body(
        &self,
        base: &Map<String, Value>,
    ) -> Result<Map<String, Value>, PdError> {
        let params = match self.protocol.family() {
            PdFamily::Sglang => return self.sglang_body(base, Role::Prefill),
            PdFamily::Vllm => self.vllm_prefill_params(),
            PdFamily::Atom => self.atom_prefill_params()?,
        };
        Ok(with_kv(single_token(base, self.chat), params, base))
    }

    /// The decode leg's body: the client's, with the protocol's `kv_transfer_params` built from
    /// the registrations and (serial protocols) the prefill's answer `handoff`.
    pub(crate) fn decode_body(
        &self,
        base: &Map<String, Value>,
        handoff: Option<Map<String, Value>>,
    ) -> Result<Map<String, Value>, PdError> {
        let params = match self.protocol.family() {
            PdFamily::Sglang => return self.sglang_body(base, Role::Decode),
            PdFamily::Vllm => self.vllm_decode_params(handoff)?,
            PdFamily::Atom => self.atom_decode_params(handoff)?,
        };
        Ok(with_kv(base.clone(), params, base))
    }

    /// The prefill's hand-off, which a serial protocol's decode leg is built from.
    pub(crate) fn need_handoff(
        &self,
        handoff: Option<Map<String, Value>>,
    ) -> Result<Map<String, Value>, PdError> {
        handoff.ok_or_else(|| self.handoff_error("its answer carries no kv_transfer_params"))
    }

    pub(crate) fn handoff_error(&self, message: &str) -> PdError {
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

pub(crate) fn object(v: Value) -> Map<String, Value> {
    match v {
        Value::Object(m) => m,
        _ => Map::new(),
    }
}

/// `body` with `kv_transfer_params` replaced by `params`, keeping the retention stamp of `base`.
pub(crate) fn with_kv(
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
pub(crate) fn single_token(base: &Map<String, Value>, chat: bool) -> Map<String, Value> {
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
pub(crate) fn url_host(url: &str) -> &str {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = rest.split('/').next().unwrap_or(rest);
    if let Some(v6) = authority.strip_prefix('[') {
        return v6.split(']').next().unwrap_or(v6);
    }
    authority.rsplit_once(':').map_or(authority, |(h, _)| h)
}
