//! Discovery backends (etcd, Kubernetes) and what they share: record decoding and reconnect
//! backoff. The port they implement ([`Discovery`], [`Registrar`] and their types) lives in
//! `infera_core::ports::discovery` and is re-exported here.
//!
//! The conformance suite every backend must pass is
//! [`crate::testing::discovery_conformance`].

#[cfg(feature = "etcd")]
pub mod etcd;
#[cfg(feature = "kubernetes")]
pub mod kubernetes;

use infera_core::event::WorkerRecord;
use std::time::Duration;

#[cfg(feature = "etcd")]
pub use etcd::{EtcdConfig, EtcdDiscovery};
pub use infera_core::ports::discovery::{
    Discovery, DiscoveryChange, DiscoveryError, DiscoveryStream, Registrar, Registration,
    RegistrationHandle, Result, WatchStats,
};
#[cfg(feature = "kubernetes")]
pub use kubernetes::{KubernetesConfig, KubernetesDiscovery, KubernetesRegistrar};

/// Decodes a stored record for the worker whose slot it was found in.
///
/// Fields the Python workers write as `null` where ours have a default (`dp_rank`, `dp_size`,
/// `request_transport`, `disagg_meta`, `kv_events_endpoint`, `kv`) are read as absent.
///
/// # Errors
/// A human-readable reason: not JSON, not a record (unknown engine, missing field), or a
/// `worker_id` other than `slot_worker`.
pub fn decode_record(slot_worker: &str, value: &[u8]) -> std::result::Result<WorkerRecord, String> {
    let mut json: serde_json::Value =
        serde_json::from_slice(value).map_err(|e| format!("not JSON: {e}"))?;
    if let Some(object) = json.as_object_mut() {
        for field in NULL_MEANS_DEFAULT {
            if object.get(*field).is_some_and(serde_json::Value::is_null) {
                object.remove(*field);
            }
        }
    }
    let record: WorkerRecord =
        serde_json::from_value(json).map_err(|e| format!("not a worker record: {e}"))?;
    if record.worker_id.as_str() != slot_worker {
        return Err(format!(
            "worker_id {:?} does not match its slot {slot_worker:?}",
            record.worker_id.as_str()
        ));
    }
    Ok(record)
}

const NULL_MEANS_DEFAULT: &[&str] = &[
    "dp_rank",
    "dp_size",
    "request_transport",
    "disagg_meta",
    "kv_events_endpoint",
    "kv",
];

/// Bounded exponential backoff for reconnect loops: `initial`, doubling, capped at `max`.
#[derive(Debug, Clone)]
pub struct Backoff {
    initial: Duration,
    max: Duration,
    next: Duration,
}

impl Backoff {
    /// A backoff starting at `initial` and never waiting longer than `max`.
    pub fn new(initial: Duration, max: Duration) -> Self {
        let initial = initial.max(Duration::from_millis(1));
        Self {
            initial,
            max: max.max(initial),
            next: initial,
        }
    }

    /// The delay to wait now; the next one doubles, up to the cap.
    pub fn next_delay(&mut self) -> Duration {
        let delay = self.next;
        self.next = (self.next * 2).min(self.max);
        delay
    }

    /// Waits for [`Backoff::next_delay`].
    pub async fn wait(&mut self) {
        tokio::time::sleep(self.next_delay()).await;
    }

    /// Back to the initial delay, after a success.
    pub fn reset(&mut self) {
        self.next = self.initial;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn python_record() -> serde_json::Value {
        serde_json::json!({
            "worker_id": "10.0.0.5:8000",
            "url": "http://10.0.0.5:8000",
            "model_name": "deepseek-ai/DeepSeek-V4",
            "engine": "sglang",
            "disagg_mode": null,
            "disagg_meta": null,
            "kv_events_endpoint": null,
            "kv_block_size": 64,
            "dp_rank": null,
            "dp_size": null,
            "request_transport": "http",
            "status": "active",
        })
    }

    #[test]
    fn python_nulls_read_as_defaults_and_extras_are_kept() {
        let bytes = serde_json::to_vec(&python_record()).unwrap();
        let record = decode_record("10.0.0.5:8000", &bytes).unwrap();
        assert_eq!(record.dp_rank, 0);
        assert_eq!(record.dp_size, 1);
        assert_eq!(record.disagg_mode, infera_core::event::Role::Mixed);
        assert_eq!(
            record.extra.get("status"),
            Some(&serde_json::json!("active"))
        );
    }

    #[test]
    fn invalid_records_are_reported() {
        assert!(decode_record("a:1", b"{not json").is_err());
        let mut unknown_engine = python_record();
        unknown_engine["engine"] = serde_json::json!("tensorrt");
        let bytes = serde_json::to_vec(&unknown_engine).unwrap();
        assert!(decode_record("10.0.0.5:8000", &bytes).is_err());
        let bytes = serde_json::to_vec(&python_record()).unwrap();
        let err = decode_record("10.0.0.6:8000", &bytes).unwrap_err();
        assert!(err.contains("does not match"), "{err}");
    }

    #[test]
    fn backoff_doubles_up_to_the_cap_and_resets() {
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_millis(350));
        let delays: Vec<_> = (0..4).map(|_| backoff.next_delay().as_millis()).collect();
        assert_eq!(delays, [100, 200, 350, 350]);
        backoff.reset();
        assert_eq!(backoff.next_delay(), Duration::from_millis(100));
    }
}
