//! etcd v3 discovery backend (PROTOCOLS.md §1, compatible with the Python Infera).
//!
//! # Key layout
//!
//! ```text
//! key:    <prefix><host>:<port>        prefix default "/infera/workers/" (--etcd-prefix)
//! value:  the WorkerRecord as JSON     {"worker_id": "<host>:<port>", "url": …, "engine": …}
//! lease:  one per registration         TTL 30 s by default, kept alive every TTL/3
//! ```
//!
//! Presence of the key means the worker is available. The worker grants a lease, puts the record
//! on it and keeps the lease alive from a task owned by its [`crate::discovery::Registration`]; if
//! etcd reports the lease gone (an outage longer than the TTL) the task grants a new one and puts
//! the current record again. Deregistering stops that task, then revokes the lease, which deletes
//! the key at once. A worker that dies stops renewing, and etcd deletes the key when the TTL runs
//! out.
//!
//! The server ranges the prefix, then watches it from the range's revision + 1. After a watch error
//! or disconnect it resumes from the revision after the last one it saw (a progress notification
//! also advances it); if that revision has been compacted it ranges again, emits `Deregistered` for
//! workers that vanished meanwhile and `Registered` for new or changed ones, and watches again.
//! Reconnects use bounded exponential backoff. A deleted key (revoked or expired lease, or a manual
//! delete; etcd does not tell them apart) becomes `Deregistered`.
//!
//! The gRPC client is our own ([`client`], messages in [`proto`]): no build script and no `protoc`.
//! It accepts several members ([`endpoint`] has the grammar) and fails over between them.

pub mod client;
pub mod endpoint;
pub mod proto;
mod registrar;
mod watcher;

use super::{
    Discovery, DiscoveryError, DiscoveryStream, Registrar, Registration, Result, WatchStats,
};
use async_trait::async_trait;
use client::{ClientOptions, EtcdClient, EtcdError};
use endpoint::EtcdEndpoint;
use infera_core::event::WorkerRecord;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

/// The key prefix upstream uses (`--etcd-prefix`).
pub const DEFAULT_PREFIX: &str = "/infera/workers/";

const BACKEND: &str = "etcd";

/// Settings of the etcd backend.
#[derive(Debug, Clone, PartialEq)]
pub struct EtcdConfig {
    /// Members, each in a form of [`endpoint`] (e.g. `http://127.0.0.1:2379`, `etcd-0:2379`);
    /// calls fail over between them in this order.
    pub endpoints: Vec<String>,
    /// Key prefix; a missing trailing `/` is added.
    pub prefix: String,
    /// Lease TTL of a registration (whole seconds, at least 1).
    pub lease_ttl: Duration,
    /// How often the lease is renewed; `None` means a third of the TTL.
    pub keepalive_interval: Option<Duration>,
    /// Bound on connecting and on each unary request.
    pub request_timeout: Duration,
    /// HTTP/2 keepalive ping interval; a connection that does not answer within the same time is
    /// considered dead, so a silent network failure still triggers a reconnect.
    pub http2_keepalive: Duration,
    /// First reconnect delay; doubled on each failure.
    pub backoff_initial: Duration,
    /// Longest reconnect delay.
    pub backoff_max: Duration,
    /// Capacity of each watch stream's channel.
    pub channel_capacity: usize,
}

impl Default for EtcdConfig {
    fn default() -> Self {
        Self {
            endpoints: vec!["http://127.0.0.1:2379".to_owned()],
            prefix: DEFAULT_PREFIX.to_owned(),
            lease_ttl: Duration::from_secs(30),
            keepalive_interval: None,
            request_timeout: Duration::from_secs(5),
            http2_keepalive: Duration::from_secs(10),
            backoff_initial: Duration::from_millis(100),
            backoff_max: Duration::from_secs(5),
            channel_capacity: 1024,
        }
    }
}

impl EtcdConfig {
    /// The default configuration for `endpoints`.
    pub fn new(endpoints: impl IntoIterator<Item = impl Into<String>>) -> Self {
        Self {
            endpoints: endpoints.into_iter().map(Into::into).collect(),
            ..Self::default()
        }
    }

    fn validate(&self) -> Result<()> {
        let invalid = |msg: String| Err(DiscoveryError::InvalidConfig(msg));
        if self.endpoints.is_empty() {
            return invalid("no etcd endpoint given (--etcd-endpoint)".to_owned());
        }
        if self.lease_ttl < Duration::from_secs(1) {
            return invalid(format!(
                "etcd lease TTL {:?} is below etcd's granularity of 1 s",
                self.lease_ttl
            ));
        }
        let interval = self.keepalive_interval();
        if interval.is_zero() || interval >= self.lease_ttl {
            return invalid(format!(
                "etcd keepalive interval {interval:?} must be above zero and below the lease TTL {:?}",
                self.lease_ttl
            ));
        }
        if self.channel_capacity == 0 {
            return invalid("watch channel capacity must be at least 1".to_owned());
        }
        Ok(())
    }

    fn keepalive_interval(&self) -> Duration {
        self.keepalive_interval.unwrap_or(self.lease_ttl / 3)
    }

    fn normalized_prefix(&self) -> String {
        if self.prefix.ends_with('/') {
            self.prefix.clone()
        } else {
            format!("{}/", self.prefix)
        }
    }
}

/// Discovery through etcd: a [`Registrar`] for workers and a [`Discovery`] for the server.
///
/// Cheap to clone; clones share the gRPC channels, which reconnect by themselves.
#[derive(Clone)]
pub struct EtcdDiscovery {
    client: EtcdClient,
    config: Arc<EtcdConfig>,
    prefix: Arc<str>,
}

impl std::fmt::Debug for EtcdDiscovery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdDiscovery")
            .field("endpoints", &self.config.endpoints)
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

impl EtcdDiscovery {
    /// Prepares a client for `config.endpoints`. Connections are made lazily, so this succeeds
    /// while etcd is down; the first request reports it.
    ///
    /// # Errors
    /// [`DiscoveryError::InvalidConfig`] for an unusable configuration or endpoint.
    pub async fn connect(config: EtcdConfig) -> Result<Self> {
        config.validate()?;
        let endpoints = config
            .endpoints
            .iter()
            .map(|text| EtcdEndpoint::parse(text))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| DiscoveryError::InvalidConfig(e.to_string()))?;
        let options = ClientOptions {
            request_timeout: config.request_timeout,
            http2_keepalive: config.http2_keepalive,
        };
        let client = EtcdClient::new(&endpoints, &options)
            .map_err(|e| DiscoveryError::InvalidConfig(e.to_string()))?;
        let prefix: Arc<str> = config.normalized_prefix().into();
        Ok(Self {
            client,
            config: Arc::new(config),
            prefix,
        })
    }

    /// The key prefix in use (always ends with `/`).
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The key a worker's record is stored under.
    pub fn key_for(&self, worker: &str) -> String {
        format!("{}{worker}", self.prefix)
    }
}

#[async_trait]
impl Registrar for EtcdDiscovery {
    async fn register(&self, record: &WorkerRecord) -> Result<Registration> {
        registrar::register(self, record).await
    }
}

#[async_trait]
impl Discovery for EtcdDiscovery {
    async fn watch(&self) -> Result<DiscoveryStream> {
        let stats = Arc::new(WatchStats::default());
        let (tx, rx) = mpsc::channel(self.config.channel_capacity);
        let watcher = watcher::Watcher::start(self.clone(), tx, stats.clone()).await?;
        let task = tokio::spawn(watcher.run());
        Ok(DiscoveryStream::new(rx, stats, task))
    }
}

/// Awaits a client call (each member's attempt is bounded by the request timeout) and maps its
/// error.
async fn call<T>(
    op: &'static str,
    call: impl Future<Output = std::result::Result<T, EtcdError>>,
) -> Result<T> {
    call.await.map_err(|e| map_err(op, e))
}

/// Maps a client error to the port's error: refusals are final, everything else may pass.
fn map_err(op: &'static str, e: EtcdError) -> DiscoveryError {
    let message = e.to_string();
    match e {
        EtcdError::Setup { .. } => DiscoveryError::InvalidConfig(message),
        e if e.is_final() => DiscoveryError::Rejected {
            backend: BACKEND,
            op,
            message,
        },
        _ => DiscoveryError::Unavailable {
            backend: BACKEND,
            op,
            message,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_is_validated_with_actionable_messages() {
        assert!(EtcdConfig::default().validate().is_ok());
        let no_endpoint = EtcdConfig::new(Vec::<String>::new());
        assert!(
            matches!(no_endpoint.validate(), Err(DiscoveryError::InvalidConfig(m)) if m.contains("--etcd-endpoint"))
        );
        let short_ttl = EtcdConfig {
            lease_ttl: Duration::from_millis(500),
            ..EtcdConfig::default()
        };
        assert!(short_ttl.validate().is_err());
        let slow_keepalive = EtcdConfig {
            keepalive_interval: Some(Duration::from_secs(30)),
            ..EtcdConfig::default()
        };
        assert!(slow_keepalive.validate().is_err());
        assert_eq!(
            EtcdConfig::default().keepalive_interval(),
            Duration::from_secs(10)
        );
    }

    #[test]
    fn the_prefix_always_ends_with_a_slash() {
        let config = EtcdConfig {
            prefix: "/custom/workers".to_owned(),
            ..EtcdConfig::default()
        };
        assert_eq!(config.normalized_prefix(), "/custom/workers/");
        assert_eq!(EtcdConfig::default().normalized_prefix(), DEFAULT_PREFIX);
    }

    #[test]
    fn client_errors_map_to_retry_decisions() {
        let status = |code, message: &str| EtcdError::Status {
            op: "put",
            endpoint: "http://e:2379".to_owned(),
            code,
            message: message.to_owned(),
        };
        let outage = map_err(
            "watch",
            status(tonic::Code::Unavailable, "tcp connect error"),
        );
        assert!(outage.is_retryable(), "{outage}");
        let timeout = map_err(
            "put",
            EtcdError::Timeout {
                op: "put",
                endpoint: "http://e:2379".to_owned(),
                timeout: Duration::from_secs(5),
            },
        );
        assert!(timeout.is_retryable(), "{timeout}");
        let bad = map_err(
            "put",
            status(tonic::Code::InvalidArgument, "key is not provided"),
        );
        assert!(!bad.is_retryable(), "{bad}");
        let lost = status(
            tonic::Code::NotFound,
            "etcdserver: requested lease not found",
        );
        assert!(lost.is_lease_not_found());
        assert!(!status(tonic::Code::Unavailable, "lease not found").is_lease_not_found());
    }

    #[tokio::test]
    async fn malformed_endpoints_are_refused_when_connecting() {
        let error = EtcdDiscovery::connect(EtcdConfig::new(["http://etcd:2379/v3"]))
            .await
            .expect_err("a path is refused");
        assert!(
            matches!(&error, DiscoveryError::InvalidConfig(m) if m.contains("paths")),
            "{error}"
        );
    }
}
