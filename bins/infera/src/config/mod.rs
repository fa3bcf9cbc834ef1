//! Validated configuration of each command, built from its clap arguments.
//!
//! Each command has one `*Config` type ([`ServerConfig`], [`WorkerConfig`], [`KvdConfig`],
//! [`GaieConfig`]) and
//! exactly one way to obtain it: `TryFrom<*Args>`, which performs every check that can be made
//! before anything starts (required flags, mutually exclusive flags, positive sizes and counts,
//! readable files). A failed check is a [`ConfigError`]: one line naming the flag, which the
//! binary prints and turns into exit code 2. Checks that need the running system (resolving the
//! Pod's own namespace, loading the tokenizer, reaching a broker) belong to the runtimes.
//!
//! Configs serialize to the JSON that `--check-config` prints, and deserialize from it
//! (`deny_unknown_fields`), so a printed config is a complete, reloadable description.
//! The enums shared by the argument structs and the configs live here.

pub mod gaie;
pub mod hf;
pub mod kvd;
pub mod server;
pub mod units;
pub mod worker;

pub use gaie::GaieConfig;
pub use kvd::KvdConfig;
pub use server::ServerConfig;
pub use worker::WorkerConfig;

use crate::cli::{DiscoveryArgs, OverlapWeightArgs};
use crate::wiring::{self, Backend};
use serde::{Deserialize, Serialize};
use std::fs::File;
use std::path::Path;

/// A configuration that failed validation: the flag at fault and what is wrong with it.
/// Displays as a single line, `--flag reason`, so reasons are phrased to follow the flag
/// ("must be greater than 0 (got 0)", "is required with ...").
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{flag} {reason}")]
pub struct ConfigError {
    /// The flag (or flags, e.g. `--long-path/--long-paths`) the user must change.
    pub flag: &'static str,
    /// What is wrong and, where it helps, what to pass instead; reads as a sentence after the flag.
    pub reason: String,
}

impl ConfigError {
    /// A failed check of `flag`.
    pub fn new(flag: &'static str, reason: impl Into<String>) -> Self {
        Self {
            flag,
            reason: reason.into(),
        }
    }
}

/// How workers announce themselves and how the server finds them (`--discovery-backend`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DiscoveryBackend {
    /// Worker Pods carry their record in an annotation; the server watches Pods.
    Kubernetes,
    /// Workers put their record under a leased etcd key; the server watches the prefix.
    Etcd,
}

/// How the server forwards a request to a worker (`--request-transport`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RequestTransport {
    /// Request/reply over the worker's NATS subject, with timeouts and admission control.
    Nats,
    /// Plain HTTP to the worker's URL.
    Http,
}

/// How KV-cache events travel from workers to the router (`--kv-event-transport`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KvEventTransport {
    /// Workers republish engine events on NATS subjects.
    Nats,
    /// The router subscribes to each worker's ZeroMQ endpoint directly.
    Zmq,
}

/// Where workers are discovered, with the settings of the chosen backend.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum DiscoveryConfig {
    /// Kubernetes Pods and annotations.
    Kubernetes {
        /// Namespace to use; `None` means the Pod's own, read at runtime from the service
        /// account mount (never during validation).
        namespace: Option<String>,
        /// Label selector of worker Pods; `None` selects every Pod that carries a worker record.
        label_selector: Option<String>,
    },
    /// etcd v3 keys attached to leases.
    Etcd {
        /// `--etcd-endpoint` as given, checked against the endpoint grammar: `host:port`, `host`,
        /// `http(s)://…`, or a comma-separated list of them that the client fails over along.
        endpoint: String,
        /// Key prefix the fleet registers under.
        prefix: String,
    },
}

/// `--router-profile`: where the router's unset tunables come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RouterProfile {
    /// Near-best without tuning on every trace of the routing-quality suite
    /// (docs/benchmarks.md): --kv-overlap-weight 16, --router-balance-tokens 512.
    Infera,
    /// The Python Infera's, the seed's defaults: --kv-overlap-weight 1.0, no balance charge.
    #[default]
    Python,
}

impl RouterProfile {
    fn tunables(self) -> infera_core::event::Tunables {
        match self {
            RouterProfile::Infera => infera_core::policy::INFERA_PROFILE,
            RouterProfile::Python => infera_core::policy::PYTHON_PROFILE,
        }
    }

    /// `--kv-overlap-weight` when it is not given.
    pub fn overlap_weight(self) -> f64 {
        self.tunables().overlap_weight
    }

    /// `--router-balance-tokens` when it is not given.
    pub fn balance_tokens(self) -> u32 {
        self.tunables().balance_tokens
    }
}

impl OverlapWeightArgs {
    /// The overall, prefill and decode weights, each checked non-negative, the overall one
    /// `--router-profile`'s when not given.
    pub(crate) fn validated(self) -> Result<(f64, Option<f64>, Option<f64>), ConfigError> {
        let optional = |flag, weight: Option<f64>| weight.map(|w| non_negative_f64(flag, w));
        let overall = self
            .kv_overlap_weight
            .unwrap_or(self.router_profile.overlap_weight());
        Ok((
            non_negative_f64("--kv-overlap-weight", overall)?,
            optional(
                "--kv-prefill-overlap-weight",
                self.kv_prefill_overlap_weight,
            )
            .transpose()?,
            optional("--kv-decode-overlap-weight", self.kv_decode_overlap_weight).transpose()?,
        ))
    }
}

impl DiscoveryArgs {
    /// The discovery of a router (`infera server`, `infera gaie`). As in the Python server and
    /// picker, kubernetes discovery needs a label selector there: without one the router would
    /// route to every annotated Pod of the namespace, other deployments' workers included.
    pub(crate) fn for_router(self) -> Result<DiscoveryConfig, ConfigError> {
        if self.discovery_backend == DiscoveryBackend::Kubernetes
            && non_empty(self.k8s_label_selector.clone()).is_none()
        {
            return Err(ConfigError::new(
                "--k8s-label-selector",
                "is required with --discovery-backend kubernetes (or $INFERA_K8S_LABEL_SELECTOR), \
                 e.g. 'infera.amd.com/deployment=<name>'",
            ));
        }
        DiscoveryConfig::try_from(self)
    }
}

impl TryFrom<DiscoveryArgs> for DiscoveryConfig {
    type Error = ConfigError;

    fn try_from(flags: DiscoveryArgs) -> Result<Self, ConfigError> {
        match flags.discovery_backend {
            DiscoveryBackend::Kubernetes => {
                Backend::Kubernetes.require("--discovery-backend", "kubernetes")?;
                Ok(Self::Kubernetes {
                    namespace: non_empty(flags.k8s_namespace),
                    label_selector: non_empty(flags.k8s_label_selector),
                })
            }
            DiscoveryBackend::Etcd => {
                Backend::Etcd.require("--discovery-backend", "etcd")?;
                let endpoint = non_empty(flags.etcd_endpoint).ok_or_else(|| {
                    ConfigError::new(
                        "--etcd-endpoint",
                        "is required with --discovery-backend etcd \
                         (e.g. --etcd-endpoint http://127.0.0.1:2379)",
                    )
                })?;
                wiring::validate_etcd_endpoint(&endpoint)?;
                if flags.etcd_prefix.is_empty() {
                    return Err(ConfigError::new(
                        "--etcd-prefix",
                        "must not be empty with --discovery-backend etcd \
                         (the default is /infera/workers/)",
                    ));
                }
                Ok(Self::Etcd {
                    endpoint,
                    prefix: flags.etcd_prefix,
                })
            }
        }
    }
}

impl RequestTransport {
    /// Refuses `--request-transport nats` in a build without NATS.
    pub(crate) fn require_built(self) -> Result<(), ConfigError> {
        match self {
            RequestTransport::Nats => Backend::Nats.require("--request-transport", "nats"),
            RequestTransport::Http => Ok(()),
        }
    }
}

impl KvEventTransport {
    /// Refuses a `--kv-event-transport` whose backend this build lacks.
    pub(crate) fn require_built(self) -> Result<(), ConfigError> {
        match self {
            KvEventTransport::Nats => Backend::Nats.require("--kv-event-transport", "nats"),
            KvEventTransport::Zmq => Backend::Zmq.require("--kv-event-transport", "zmq"),
        }
    }
}

/// Refuses a transport this worker would use that the build lacks: NATS for its requests, and
/// for its KV events whatever it reads or writes itself. The mock publishes its own events; a
/// real engine publishes on ZeroMQ, which the server reads directly, or which the worker relays
/// onto NATS (so `nats` needs ZeroMQ too).
pub(crate) fn require_worker_transports(config: &WorkerConfig) -> Result<(), ConfigError> {
    config.request_transport.require_built()?;
    if !config.kv_events.enabled {
        return Ok(());
    }
    match (config.kv_events.transport, &config.launch) {
        (transport, worker::LaunchConfig::Mock(_)) => transport.require_built(),
        (KvEventTransport::Zmq, worker::LaunchConfig::Process(_)) => Ok(()),
        (KvEventTransport::Nats, worker::LaunchConfig::Process(_)) => {
            KvEventTransport::Nats.require_built()?;
            Backend::Zmq.require("--kv-event-transport", "nats")
        }
    }
}

/// `None` for an absent or blank value (an empty environment variable counts as unset).
pub(crate) fn non_empty(value: Option<String>) -> Option<String> {
    value.filter(|text| !text.trim().is_empty())
}

/// Checks that a count is positive.
pub(crate) fn positive<T: PartialOrd + Default + std::fmt::Display>(
    flag: &'static str,
    value: T,
) -> Result<T, ConfigError> {
    if value > T::default() {
        Ok(value)
    } else {
        Err(ConfigError::new(
            flag,
            format!("must be greater than 0 (got {value})"),
        ))
    }
}

/// Checks that a weight or temperature is a finite number ≥ 0.
pub(crate) fn non_negative_f64(flag: &'static str, value: f64) -> Result<f64, ConfigError> {
    if value.is_finite() && value >= 0.0 {
        Ok(value)
    } else {
        Err(ConfigError::new(
            flag,
            format!("must be a finite number >= 0 (got {value})"),
        ))
    }
}

/// Checks that a factor is a finite number > 0.
pub(crate) fn positive_f64(flag: &'static str, value: f64) -> Result<f64, ConfigError> {
    if value.is_finite() && value > 0.0 {
        Ok(value)
    } else {
        Err(ConfigError::new(
            flag,
            format!("must be a finite number greater than 0 (got {value})"),
        ))
    }
}

/// Checks that `path` is a regular file this process can open for reading.
pub(crate) fn readable_file(flag: &'static str, path: &Path) -> Result<(), ConfigError> {
    if path.is_dir() {
        return Err(ConfigError::new(
            flag,
            format!(
                "names {}, which is a directory; expected a file",
                path.display()
            ),
        ));
    }
    File::open(path).map(drop).map_err(|error| {
        ConfigError::new(
            flag,
            format!("names {}, which cannot be read: {error}", path.display()),
        )
    })
}

/// Checks a validation result against the backends its flags select, for tests that run in
/// every build: accepted when this build has them all, else refused at the first one missing
/// (in `needs`, given in the order validation checks them) with the line naming its feature.
#[cfg(test)]
pub(crate) fn assert_accepted_iff_built<T: std::fmt::Debug>(
    result: &Result<T, ConfigError>,
    needs: &[(Backend, &'static str, &str)],
) {
    let missing = needs.iter().find(|(backend, _, _)| !backend.built());
    match (result, missing) {
        (Ok(_), None) => {}
        (Err(error), Some((backend, flag, value))) => {
            assert_eq!(error, &backend.not_built(flag, value), "{needs:?}");
        }
        (result, missing) => panic!("{needs:?}: expected {missing:?} missing, got {result:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flags(backend: DiscoveryBackend) -> DiscoveryArgs {
        DiscoveryArgs {
            discovery_backend: backend,
            etcd_endpoint: None,
            etcd_prefix: "/infera/workers/".into(),
            k8s_namespace: None,
            k8s_label_selector: Some("app=worker".into()),
        }
    }

    #[test]
    fn etcd_discovery_needs_an_endpoint() {
        let error = DiscoveryConfig::try_from(flags(DiscoveryBackend::Etcd)).unwrap_err();
        assert_eq!(error.flag, "--etcd-endpoint");
        assert!(error.to_string().contains("--discovery-backend etcd"));

        let mut with_endpoint = flags(DiscoveryBackend::Etcd);
        with_endpoint.etcd_endpoint = Some("127.0.0.1:2379".into());
        assert_eq!(
            DiscoveryConfig::try_from(with_endpoint).unwrap(),
            DiscoveryConfig::Etcd {
                endpoint: "127.0.0.1:2379".into(),
                prefix: "/infera/workers/".into()
            }
        );
    }

    fn etcd_endpoint(flag: &str) -> Result<DiscoveryConfig, ConfigError> {
        let mut with_endpoint = flags(DiscoveryBackend::Etcd);
        with_endpoint.etcd_endpoint = Some(flag.into());
        DiscoveryConfig::try_from(with_endpoint)
    }

    #[test]
    fn etcd_endpoints_take_the_python_forms_and_lists() {
        for good in [
            "etcd",
            "etcd:2379",
            "https://etcd.example:2379/",
            "etcd-0:2379,etcd-1:2379, http://etcd-2:2379",
        ] {
            assert!(etcd_endpoint(good).is_ok(), "{good}");
        }
        let error = etcd_endpoint("etcd:2379,,etcd-1").unwrap_err();
        assert_eq!(error.flag, "--etcd-endpoint");
        assert!(error.to_string().contains("empty entry"), "{error}");
        let error = etcd_endpoint("grpc://etcd:2379").unwrap_err();
        assert!(
            error.to_string().contains("use http:// or https://"),
            "{error}"
        );
        let error = etcd_endpoint("etcd:23790000").unwrap_err();
        assert!(error.to_string().contains("from 1 to 65535"), "{error}");
    }

    #[test]
    fn kubernetes_discovery_leaves_the_namespace_to_runtime() {
        let mut blank_namespace = flags(DiscoveryBackend::Kubernetes);
        blank_namespace.k8s_namespace = Some(" ".into());
        assert_eq!(
            DiscoveryConfig::try_from(blank_namespace).unwrap(),
            DiscoveryConfig::Kubernetes {
                namespace: None,
                label_selector: Some("app=worker".into())
            }
        );
    }

    #[test]
    fn numeric_checks_name_the_flag_and_the_value() {
        assert_eq!(positive("--n", 3u32), Ok(3));
        let error = positive("--n", 0u32).unwrap_err();
        assert_eq!(error.to_string(), "--n must be greater than 0 (got 0)");
        assert!(non_negative_f64("--w", 0.0).is_ok());
        assert!(non_negative_f64("--w", -0.5).is_err());
        assert!(non_negative_f64("--w", f64::NAN).is_err());
        assert!(positive_f64("--s", 0.0).is_err());
        assert!(positive_f64("--s", f64::INFINITY).is_err());
        assert_eq!(positive_f64("--s", 2.5), Ok(2.5));
    }

    #[test]
    fn readable_file_rejects_missing_files_and_directories() {
        let dir = tempfile::tempdir().unwrap();
        let missing = readable_file("--f", &dir.path().join("nope")).unwrap_err();
        assert!(missing.reason.contains("cannot be read"), "{missing}");
        let directory = readable_file("--f", dir.path()).unwrap_err();
        assert!(directory.reason.contains("is a directory"), "{directory}");
        let file = dir.path().join("ok");
        std::fs::write(&file, b"{}").unwrap();
        assert!(readable_file("--f", &file).is_ok());
    }
}
