//! vLLM's KV connectors: NIXL and Mooncake (prefill, then decode), MoRIIO in read mode
//! (prefill, then decode) and write mode (both at once). Each leg's `kv_transfer_params`.

use super::{Shape, object, url_host};
use crate::event::Role;
use crate::pd::{PdProtocol, Registered};
use crate::service::pd::PdError;
use serde_json::{Map, Value, json};

impl Shape<'_> {
    /// The prefill leg's `kv_transfer_params`.
    pub(super) fn vllm_prefill_params(&self) -> Map<String, Value> {
        match self.protocol {
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
            _ => self.mori_prefill_params(),
        }
    }

    /// The decode leg's `kv_transfer_params`, from the registrations and the prefill's answer.
    pub(super) fn vllm_decode_params(
        &self,
        handoff: Option<Map<String, Value>>,
    ) -> Result<Map<String, Value>, PdError> {
        Ok(match self.protocol {
            PdProtocol::VllmNixl => self.need_handoff(handoff)?,
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
                let h = self.need_handoff(handoff)?;
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
            _ => {
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
        })
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

    /// MoRI's engine request id: the peers' addresses and the room, which its connector parses.
    pub(super) fn mori_request_id(&self) -> Result<String, PdError> {
        Ok(format!(
            "___prefill_addr_{}___decode_addr_{}_{:032x}",
            self.mori_address(Role::Prefill)?,
            self.mori_address(Role::Decode)?,
            self.room
        ))
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
}
