//! `atom-mooncake`: a one-token prefill naming its decode peer, then the decode with the
//! prefill's answer plus its parallelism.

use super::{Shape, object};
use crate::event::Role;
use crate::service::pd::PdError;
use serde_json::{Map, Value, json};

impl Shape<'_> {
    /// The prefill leg's `kv_transfer_params`: the decode peer's address and parallelism.
    pub(super) fn atom_prefill_params(&self) -> Result<Map<String, Value>, PdError> {
        Ok(object(json!({
            "remote_dp_size": self.param(Role::Decode, "dp_size")?,
            "remote_tp_size": self.param(Role::Decode, "tp_size")?,
            "do_remote_decode": true,
            "do_remote_prefill": false,
            "remote_handshake_port": self.param(Role::Decode, "handshake_port")?,
            "remote_engine_id": null,
            "remote_block_ids": null,
            "remote_host": self.param(Role::Decode, "host")?,
            "remote_port": self.param(Role::Decode, "http_port")?,
        })))
    }

    /// The decode leg's `kv_transfer_params`: the prefill's answer verbatim, plus its
    /// parallelism and the DP rank it answered.
    pub(super) fn atom_decode_params(
        &self,
        handoff: Option<Map<String, Value>>,
    ) -> Result<Map<String, Value>, PdError> {
        let mut p = self.need_handoff(handoff)?;
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
        Ok(p)
    }
}
