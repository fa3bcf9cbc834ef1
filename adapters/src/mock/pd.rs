//! The mock's prefill/decode roles (`--disaggregation-mode prefill|decode` with
//! `--disaggregation-protocol`), so the server's two-leg dispatch is testable without GPUs.
//!
//! A PD-role mock checks that each request carries what its protocol's leg needs and answers
//! 400 naming what is missing otherwise (a wrong dispatch fails loudly):
//!
//! | protocol | prefill leg | decode leg |
//! |---|---|---|
//! | `sglang-bootstrap` | `bootstrap_host`, `bootstrap_port`, `bootstrap_room` (u63); generates one token, as SGLang's prefill server does | the same fields |
//! | vLLM / ATOM protocols | `kv_transfer_params.do_remote_decode: true`, `max_tokens: 1`, `stream: false` (and `transfer_id` for MoRI and Mooncake, the decode peer for ATOM) | `kv_transfer_params.do_remote_prefill: true` with the protocol's hand-off keys |
//!
//! A serial protocol's prefill answers a top-level `kv_transfer_params` hand-off shaped like its
//! connector's (`vllm-nixl`: `remote_engine_id`, `remote_block_ids`, `remote_host`,
//! `remote_port`; `vllm-mori-read`: the `transfer_id` it was given, `remote_engine_id`,
//! `remote_block_ids`; `atom-mooncake`: `transfer_id`, `first_token_id`, its address, `dp_rank`;
//! `vllm-mooncake` answers none, as vLLM's in-tree connector). Every accepted PD leg is logged
//! (the last [`LOG_LEN`]) and served at `GET /mock/pd-legs`, for tests to see which worker saw
//! which leg with which parameters (and the DP rank its `X-data-parallel-rank` header pinned
//! it to, `null` without one; SGLang legs also log their `rid` and `disagg_prefill_dp_rank`).

use super::openai::ApiError;
use infera_core::event::Role;
use infera_core::pd::PdProtocol;
use serde::Deserialize;
use serde_json::{Map, Value, json};
use std::collections::VecDeque;
use std::sync::Mutex;

/// Accepted PD legs kept for `GET /mock/pd-legs`.
pub const LOG_LEN: usize = 256;

/// A mock playing one leg of a PD pair.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MockPd {
    /// [`Role::Prefill`] or [`Role::Decode`].
    pub role: Role,
    /// The protocol it speaks (the one the launcher registers for it).
    pub protocol: PdProtocol,
    /// The engine id its hand-offs name.
    pub engine_id: String,
    /// The host its hand-offs name.
    pub host: String,
    /// The port its hand-offs name.
    pub port: u16,
}

/// The PD fields of a request body.
#[derive(Debug, Default, Deserialize)]
pub struct PdFields {
    #[serde(default)]
    pub kv_transfer_params: Option<Value>,
    #[serde(default)]
    pub bootstrap_host: Option<Value>,
    #[serde(default)]
    pub bootstrap_port: Option<Value>,
    #[serde(default)]
    pub bootstrap_room: Option<Value>,
    /// SGLang's request id (`/abort_request` names it).
    #[serde(default)]
    pub rid: Option<Value>,
    /// SGLang's DP rank of the prefill that holds a decode leg's KV.
    #[serde(default)]
    pub disagg_prefill_dp_rank: Option<Value>,
}

/// What an accepted leg changes in the answer.
#[derive(Debug, Default)]
pub(crate) struct Accepted {
    /// At most this many output tokens.
    pub cap: Option<u32>,
    /// A top-level `kv_transfer_params` for the (non-streamed) answer.
    pub handoff: Option<Value>,
}

/// The accepted legs, newest last.
#[derive(Debug, Default)]
pub(crate) struct LegLog(Mutex<VecDeque<Value>>);

impl LegLog {
    fn push(&self, entry: Value) {
        let mut log = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if log.len() == LOG_LEN {
            log.pop_front();
        }
        log.push_back(entry);
    }

    pub(crate) fn snapshot(&self) -> Vec<Value> {
        let log = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        log.iter().cloned().collect()
    }
}

fn reject(pd: &MockPd, what: &str) -> ApiError {
    ApiError::bad_request(format!(
        "this {}-role mock speaks {}: the request {what}",
        pd.role.as_str(),
        pd.protocol
    ))
}

/// Checks one request against the mock's PD role and logs it. See the module docs.
pub(crate) fn accept(
    pd: &MockPd,
    log: &LegLog,
    fields: &PdFields,
    dp_rank: Option<u32>,
    max_tokens: Option<i64>,
    stream: bool,
) -> Result<Accepted, ApiError> {
    let role = pd.role.as_str();
    if pd.protocol == PdProtocol::SglangBootstrap {
        let host = fields.bootstrap_host.as_ref().and_then(Value::as_str);
        let port = fields.bootstrap_port.as_ref().and_then(Value::as_u64);
        let room = fields
            .bootstrap_room
            .as_ref()
            .and_then(Value::as_u64)
            .filter(|r| *r < 1 << 63);
        let (Some(host), Some(port), Some(room)) = (host, port, room) else {
            return Err(reject(
                pd,
                "lacks bootstrap_host (string), bootstrap_port or bootstrap_room (u63)",
            ));
        };
        log.push(
            json!({"role": role, "protocol": pd.protocol.name(), "bootstrap_host": host,
            "bootstrap_port": port, "bootstrap_room": room, "rid": fields.rid,
            "disagg_prefill_dp_rank": fields.disagg_prefill_dp_rank, "dp_rank": dp_rank}),
        );
        return Ok(Accepted {
            cap: (pd.role == Role::Prefill).then_some(1),
            handoff: None,
        });
    }
    let Some(Value::Object(kv)) = &fields.kv_transfer_params else {
        return Err(reject(pd, "has no kv_transfer_params object"));
    };
    let missing = |keys: &[&str]| -> Vec<String> {
        keys.iter()
            .filter(|k| kv.get(**k).is_none_or(Value::is_null))
            .map(|k| (*k).to_owned())
            .collect()
    };
    let handoff = if pd.role == Role::Prefill {
        if kv.get("do_remote_decode") != Some(&Value::Bool(true)) {
            return Err(reject(
                pd,
                "lacks kv_transfer_params.do_remote_decode: true",
            ));
        }
        if max_tokens != Some(1) || stream {
            return Err(reject(pd, "must ask for max_tokens 1, not streamed"));
        }
        let required: &[&str] = match pd.protocol {
            PdProtocol::VllmMooncake | PdProtocol::VllmMoriRead | PdProtocol::VllmMoriWrite => {
                &["transfer_id"]
            }
            PdProtocol::AtomMooncake => &["remote_host", "remote_port", "remote_handshake_port"],
            _ => &[],
        };
        let absent = missing(required);
        if !absent.is_empty() {
            return Err(reject(pd, &format!("lacks kv_transfer_params {absent:?}")));
        }
        handoff(pd, kv)
    } else {
        if kv.get("do_remote_prefill") != Some(&Value::Bool(true)) {
            return Err(reject(
                pd,
                "lacks kv_transfer_params.do_remote_prefill: true",
            ));
        }
        let required: &[&str] = match pd.protocol {
            PdProtocol::VllmNixl => &[
                "remote_engine_id",
                "remote_block_ids",
                "remote_host",
                "remote_port",
            ],
            PdProtocol::VllmMooncake => {
                &["remote_bootstrap_addr", "remote_engine_id", "transfer_id"]
            }
            PdProtocol::VllmMoriRead => &["transfer_id", "remote_engine_id", "remote_block_ids"],
            PdProtocol::VllmMoriWrite => &["transfer_id"],
            _ => &["transfer_id", "remote_dp_size", "remote_tp_size"],
        };
        let absent = missing(required);
        if !absent.is_empty() {
            return Err(reject(pd, &format!("lacks kv_transfer_params {absent:?}")));
        }
        None
    };
    log.push(
        json!({"role": role, "protocol": pd.protocol.name(), "kv_transfer_params": kv,
        "max_tokens": max_tokens, "stream": stream, "dp_rank": dp_rank}),
    );
    Ok(Accepted { cap: None, handoff })
}

/// The hand-off a serial protocol's prefill answers.
fn handoff(pd: &MockPd, kv: &Map<String, Value>) -> Option<Value> {
    match pd.protocol {
        PdProtocol::VllmNixl => Some(json!({
            "do_remote_prefill": true,
            "do_remote_decode": false,
            "remote_engine_id": pd.engine_id,
            "remote_block_ids": [0],
            "remote_host": pd.host,
            "remote_port": pd.port,
            "tp_size": 1,
        })),
        PdProtocol::VllmMoriRead => Some(json!({
            "do_remote_prefill": true,
            "do_remote_decode": false,
            "transfer_id": kv.get("transfer_id"),
            "remote_engine_id": pd.engine_id,
            "remote_block_ids": [0],
        })),
        PdProtocol::AtomMooncake => Some(json!({
            "do_remote_prefill": true,
            "do_remote_decode": false,
            "transfer_id": 1,
            "first_token_id": 0,
            "remote_engine_id": pd.engine_id,
            "remote_block_ids": [0],
            "remote_host": pd.host,
            "remote_port": pd.port,
            "remote_handshake_port": 6301,
            "dp_rank": 0,
            "tp_size": 1,
        })),
        _ => None,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn mock(role: Role, protocol: &str) -> MockPd {
        MockPd {
            role,
            protocol: protocol.parse().unwrap(),
            engine_id: "eng".to_owned(),
            host: "127.0.0.1".to_owned(),
            port: 8000,
        }
    }

    fn fields(v: Value) -> PdFields {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn sglang_legs_need_the_bootstrap_and_prefill_makes_one_token() {
        let log = LegLog::default();
        let p = mock(Role::Prefill, "sglang-bootstrap");
        let ok = fields(json!({"bootstrap_host": "h", "bootstrap_port": 1, "bootstrap_room": 5}));
        assert_eq!(
            accept(&p, &log, &ok, None, Some(64), true).unwrap().cap,
            Some(1)
        );
        let d = mock(Role::Decode, "sglang-bootstrap");
        assert_eq!(
            accept(&d, &log, &ok, Some(1), Some(64), true).unwrap().cap,
            None
        );
        let e = accept(
            &d,
            &log,
            &fields(json!({"bootstrap_host": "h"})),
            None,
            None,
            true,
        )
        .unwrap_err();
        assert!(e.message.contains("bootstrap_room"), "{}", e.message);
        let logged = log.snapshot();
        assert_eq!(logged.len(), 2);
        assert_eq!(logged[0]["dp_rank"], Value::Null);
        assert_eq!(
            logged[1]["dp_rank"], 1,
            "the decode leg was pinned to rank 1"
        );
    }

    #[test]
    fn vllm_legs_need_their_kv_transfer_params() {
        let log = LegLog::default();
        let p = mock(Role::Prefill, "vllm-nixl");
        let kv = fields(json!({"kv_transfer_params": {"do_remote_decode": true}}));
        let ok = accept(&p, &log, &kv, None, Some(1), false).unwrap();
        assert_eq!(ok.handoff.unwrap()["remote_engine_id"], "eng");
        assert!(
            accept(&p, &log, &kv, None, Some(5), false).is_err(),
            "more than one token"
        );
        assert!(accept(&p, &log, &fields(json!({})), None, Some(1), false).is_err());
        let d = mock(Role::Decode, "vllm-nixl");
        let partial = fields(json!({"kv_transfer_params": {"do_remote_prefill": true,
            "remote_engine_id": "e"}}));
        let e = accept(&d, &log, &partial, None, Some(9), true).unwrap_err();
        assert!(e.message.contains("remote_block_ids"), "{}", e.message);
        let mooncake = mock(Role::Decode, "vllm-mooncake");
        let full = fields(json!({"kv_transfer_params": {"do_remote_prefill": true,
            "remote_engine_id": "e", "remote_bootstrap_addr": "http://h:1", "transfer_id": "x"}}));
        assert!(accept(&mooncake, &log, &full, None, Some(9), true).is_ok());
    }
}
