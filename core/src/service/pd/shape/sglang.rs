//! `sglang-bootstrap`: both legs at once, the client's body plus the prefill's bootstrap
//! server, a fresh room and the legs' shared `rid`.

use super::Shape;
use crate::event::Role;
use crate::pd::Registered;
use crate::service::pd::PdError;
use serde_json::{Map, Value};

/// SGLang's request id of both legs of a room (`rid`), which `POST /abort_request` names. The
/// engine matches an abort's `rid` as a prefix, so every id has the same length (16 hex
/// digits): no id is a prefix of another.
pub(crate) fn sglang_rid(room: u64) -> String {
    format!("infera-{room:016x}")
}

impl Shape<'_> {
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

    /// An SGLang leg: the client's body with the prefill's bootstrap, the room and the legs'
    /// shared `rid`; the decode leg also names the prefill's DP rank that holds its KV
    /// (`disagg_prefill_dp_rank`) when the prefill fronts several.
    pub(super) fn sglang_body(
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
}
