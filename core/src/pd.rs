//! Prefill/decode disaggregation, typed once for every side that speaks it: the protocols a PD
//! pair is driven by ([`PdProtocol`]) and the `disagg_meta` a PD worker registers
//! ([`DisaggMeta`]; PROTOCOLS.md §1). The launcher builds the registration from the engine's
//! flags, the mock engine plays either leg of any protocol, and the server's dispatcher drives
//! the pair both legs registered; all three name protocols with this enum.
//!
//! On the wire `disagg_meta` stays the JSON object `{"protocol": NAME, "params": {…}}` with the
//! engine's own parameters (bootstrap address, engine id, connector extras) in `params`. A
//! registration is read without being rejected: a name this build does not know is kept as text
//! so the dispatcher's error can name it.

use crate::event::WorkerRecord;
use serde_json::{Map, Value};
use std::fmt;
use std::str::FromStr;

/// A PD protocol, named as workers register it in `disagg_meta.protocol` (its serde form is
/// that name).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PdProtocol {
    /// SGLang's bootstrap server: both legs at once, paired by `bootstrap_room`.
    SglangBootstrap,
    /// vLLM's Mooncake connector: prefill, then decode from the prefill's bootstrap address.
    VllmMooncake,
    /// vLLM's NIXL connector: prefill, then decode with the parameters the prefill answered.
    VllmNixl,
    /// vLLM's MoRIIO connector in read mode: the decode pulls what the prefill answered.
    VllmMoriRead,
    /// vLLM's MoRIIO connector in write mode: both legs at once, one transfer id.
    VllmMoriWrite,
    /// ATOM over Mooncake: prefill naming its decode peer, then decode.
    AtomMooncake,
}

/// The engine family a protocol belongs to (what its legs' bodies look like).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PdFamily {
    Sglang,
    Vllm,
    Atom,
}

impl PdProtocol {
    /// Every protocol, in the order error messages and `--help` list them.
    pub const ALL: [PdProtocol; 6] = [
        PdProtocol::SglangBootstrap,
        PdProtocol::VllmMooncake,
        PdProtocol::VllmNixl,
        PdProtocol::VllmMoriRead,
        PdProtocol::VllmMoriWrite,
        PdProtocol::AtomMooncake,
    ];

    /// The registered name.
    pub fn name(self) -> &'static str {
        match self {
            PdProtocol::SglangBootstrap => "sglang-bootstrap",
            PdProtocol::VllmMooncake => "vllm-mooncake",
            PdProtocol::VllmNixl => "vllm-nixl",
            PdProtocol::VllmMoriRead => "vllm-mori-read",
            PdProtocol::VllmMoriWrite => "vllm-mori-write",
            PdProtocol::AtomMooncake => "atom-mooncake",
        }
    }

    /// The protocol registered as `name`, if this build speaks it.
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|p| p.name() == name)
    }

    /// Every name, comma-separated (for error messages).
    pub fn known() -> String {
        Self::ALL.map(Self::name).join(", ")
    }

    /// Whether both legs are sent at once (else: prefill, then decode with its answer).
    pub fn concurrent(self) -> bool {
        matches!(
            self,
            PdProtocol::SglangBootstrap | PdProtocol::VllmMoriWrite
        )
    }

    pub fn family(self) -> PdFamily {
        match self {
            PdProtocol::SglangBootstrap => PdFamily::Sglang,
            PdProtocol::AtomMooncake => PdFamily::Atom,
            _ => PdFamily::Vllm,
        }
    }

    /// The protocol of a vLLM `kv_connector` class; MoRIIO reads instead of writing when vLLM's
    /// `VLLM_MORIIO_CONNECTOR_READ_MODE` is set (`mori_read`).
    pub fn of_vllm_connector(connector: &str, mori_read: bool) -> Option<Self> {
        match connector {
            "MooncakeConnector" | "MooncakeStoreConnector" => Some(PdProtocol::VllmMooncake),
            "MoRIIOConnector" if mori_read => Some(PdProtocol::VllmMoriRead),
            "MoRIIOConnector" => Some(PdProtocol::VllmMoriWrite),
            "NixlConnector" => Some(PdProtocol::VllmNixl),
            _ => None,
        }
    }
}

impl fmt::Display for PdProtocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A protocol name this build does not speak.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}: not a PD protocol (expected one of {known})", known = PdProtocol::known())]
pub struct UnknownProtocol(pub String);

impl FromStr for PdProtocol {
    type Err = UnknownProtocol;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s).ok_or_else(|| UnknownProtocol(s.to_owned()))
    }
}

/// A PD worker's `disagg_meta`: its protocol and the engine's parameters for it.
#[derive(Debug, Clone, PartialEq)]
pub struct DisaggMeta {
    pub protocol: PdProtocol,
    pub params: Map<String, Value>,
}

impl DisaggMeta {
    /// The registration's JSON, `{"protocol": NAME, "params": {…}}`.
    pub fn to_value(&self) -> Value {
        let mut meta = Map::new();
        meta.insert("protocol".into(), self.protocol.name().into());
        meta.insert("params".into(), Value::Object(self.params.clone()));
        Value::Object(meta)
    }
}

/// What a worker record registered, read without judging it: the protocol name as given (a
/// name this build does not know included) and the parameters, each absent when the record
/// lacks it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Registered<'a> {
    pub protocol: Option<&'a str>,
    pub params: Option<&'a Map<String, Value>>,
}

impl<'a> Registered<'a> {
    pub fn of(record: &'a WorkerRecord) -> Self {
        let meta = record.disagg_meta.as_ref();
        Registered {
            protocol: meta.and_then(|m| m.get("protocol")).and_then(Value::as_str),
            params: meta
                .and_then(|m| m.get("params"))
                .and_then(Value::as_object),
        }
    }

    /// One parameter, if registered (and not null).
    pub fn param(&self, key: &str) -> Option<&'a Value> {
        self.params?.get(key).filter(|v| !v.is_null())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn names_round_trip_and_unknown_names_are_listed() {
        for p in PdProtocol::ALL {
            assert_eq!(p.name().parse::<PdProtocol>(), Ok(p));
            assert_eq!(p.to_string(), p.name());
            assert_eq!(serde_json::to_value(p).unwrap(), json!(p.name()));
            assert_eq!(
                serde_json::from_value::<PdProtocol>(json!(p.name())).unwrap(),
                p
            );
        }
        let e = "vllm-p2p".parse::<PdProtocol>().unwrap_err();
        assert!(e.to_string().contains("vllm-p2p"));
        assert!(e.to_string().contains("sglang-bootstrap, vllm-mooncake"));
    }

    #[test]
    fn only_sglang_and_mori_write_send_both_legs_at_once() {
        let concurrent: Vec<_> = PdProtocol::ALL
            .into_iter()
            .filter(|p| p.concurrent())
            .collect();
        assert_eq!(
            concurrent,
            [PdProtocol::SglangBootstrap, PdProtocol::VllmMoriWrite]
        );
    }

    #[test]
    fn the_registration_keeps_its_wire_shape_and_reads_back() {
        let params = json!({"bootstrap_host": "10.0.0.1", "bootstrap_port": 8998});
        let meta = DisaggMeta {
            protocol: PdProtocol::SglangBootstrap,
            params: params.as_object().unwrap().clone(),
        };
        let value = meta.to_value();
        assert_eq!(
            value,
            json!({"protocol": "sglang-bootstrap", "params": params})
        );
        let mut record: WorkerRecord = serde_json::from_value(json!({
            "worker_id": "w", "url": "http://w", "model_name": "m", "engine": "sglang",
            "disagg_mode": "prefill", "disagg_meta": value,
        }))
        .unwrap();
        let reg = Registered::of(&record);
        assert_eq!(reg.protocol, Some("sglang-bootstrap"));
        assert_eq!(reg.param("bootstrap_port"), Some(&json!(8998)));
        assert_eq!(reg.param("engine_id"), None);
        record.disagg_meta = Some(json!({"protocol": "vllm-p2p"}));
        let reg = Registered::of(&record);
        assert_eq!((reg.protocol, reg.params), (Some("vllm-p2p"), None));
    }
}
