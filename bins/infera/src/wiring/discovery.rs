//! The discovery backend a command uses, picked from its validated [`DiscoveryConfig`]: the
//! worker side ([`registrar`]) and the server side ([`watch`]), both core's discovery ports.

use super::Backend;
use crate::config::server::ScalingApiConfig;
use crate::config::{ConfigError, DiscoveryConfig};
use anyhow::Context as _;
#[cfg(feature = "etcd")]
use infera_backends::discovery::etcd::endpoint::EtcdEndpoint;
#[cfg(feature = "kubernetes")]
use infera_backends::discovery::kubernetes::KubernetesScaler;
#[cfg(feature = "etcd")]
use infera_backends::discovery::{EtcdConfig, EtcdDiscovery};
#[cfg(feature = "kubernetes")]
use infera_backends::discovery::{KubernetesConfig, KubernetesDiscovery, KubernetesRegistrar};
use infera_core::ports::discovery::{Discovery, DiscoveryStream, Registrar};
use infera_core::ports::scaling::PoolScaler;
use std::sync::Arc;
use std::time::Duration;

/// Connects the worker side of the configured backend.
///
/// # Errors
/// The backend cannot be reached, or is not part of this build.
pub async fn registrar(
    config: &DiscoveryConfig,
    lease_ttl: Duration,
) -> anyhow::Result<Arc<dyn Registrar>> {
    match config {
        #[cfg(feature = "etcd")]
        DiscoveryConfig::Etcd { endpoint, prefix } => {
            Ok(Arc::new(etcd(endpoint, prefix, lease_ttl).await?))
        }
        #[cfg(feature = "kubernetes")]
        DiscoveryConfig::Kubernetes {
            namespace,
            label_selector,
        } => Ok(Arc::new(
            KubernetesRegistrar::connect(kubernetes(namespace, label_selector))
                .await
                .context("cannot register through the Kubernetes API")?,
        )),
        #[cfg(not(all(feature = "etcd", feature = "kubernetes")))]
        other => {
            let _ = lease_ttl;
            Err(not_built(other).into())
        }
    }
}

/// Connects the server side of the configured backend and starts watching the fleet.
///
/// # Errors
/// The backend cannot be reached, or is not part of this build.
pub async fn watch(config: &DiscoveryConfig) -> anyhow::Result<DiscoveryStream> {
    discovery(config)
        .await?
        .watch()
        .await
        .with_context(|| format!("cannot watch the fleet ({})", describe(config)))
}

/// The server side of the configured backend.
async fn discovery(config: &DiscoveryConfig) -> anyhow::Result<Arc<dyn Discovery>> {
    match config {
        #[cfg(feature = "etcd")]
        DiscoveryConfig::Etcd { endpoint, prefix } => Ok(Arc::new(
            etcd(endpoint, prefix, EtcdConfig::default().lease_ttl).await?,
        )),
        #[cfg(feature = "kubernetes")]
        DiscoveryConfig::Kubernetes {
            namespace,
            label_selector,
        } => Ok(Arc::new(
            KubernetesDiscovery::connect(kubernetes(namespace, label_selector))
                .await
                .context("cannot watch worker Pods through the Kubernetes API")?,
        )),
        #[cfg(not(all(feature = "etcd", feature = "kubernetes")))]
        other => Err(not_built(other).into()),
    }
}

/// One line naming the backend and where it is, for logs.
pub fn describe(config: &DiscoveryConfig) -> String {
    match config {
        DiscoveryConfig::Etcd { endpoint, prefix } => format!("etcd {endpoint} prefix {prefix}"),
        DiscoveryConfig::Kubernetes {
            namespace,
            label_selector,
        } => format!(
            "kubernetes namespace {} selector {}",
            namespace.as_deref().unwrap_or("(own)"),
            label_selector.as_deref().unwrap_or("(any)")
        ),
    }
}

/// Checks `--etcd-endpoint` (one endpoint or a comma-separated list) against the etcd client's
/// grammar; in a build without etcd, refuses `--discovery-backend etcd` instead.
///
/// # Errors
/// The flag at fault and why.
pub fn validate_etcd_endpoint(endpoint: &str) -> Result<(), ConfigError> {
    Backend::Etcd.require("--discovery-backend", "etcd")?;
    #[cfg(feature = "etcd")]
    EtcdEndpoint::parse_list(endpoint)
        .map_err(|e| ConfigError::new("--etcd-endpoint", e.to_string()))?;
    #[cfg(not(feature = "etcd"))]
    let _ = endpoint;
    Ok(())
}

/// The error for a configured backend this build lacks.
#[cfg(not(all(feature = "etcd", feature = "kubernetes")))]
fn not_built(config: &DiscoveryConfig) -> ConfigError {
    match config {
        DiscoveryConfig::Etcd { .. } => Backend::Etcd.not_built("--discovery-backend", "etcd"),
        DiscoveryConfig::Kubernetes { .. } => {
            Backend::Kubernetes.not_built("--discovery-backend", "kubernetes")
        }
    }
}

/// The scaling port of `--enable-scaling-api`: the InferaDeployment of the server's own Pod,
/// reached on first use.
///
/// # Errors
/// A build without the Kubernetes backend (refused at validation already).
pub fn scaler(config: &ScalingApiConfig) -> Result<Arc<dyn PoolScaler>, ConfigError> {
    #[cfg(feature = "kubernetes")]
    return Ok(Arc::new(KubernetesScaler::new(kubernetes(
        &config.namespace,
        &None,
    ))));
    #[cfg(not(feature = "kubernetes"))]
    {
        let _ = config;
        Err(Backend::Kubernetes.not_built("--enable-scaling-api", "on"))
    }
}

/// The Kubernetes settings, completed from the Pod's downward-API environment (`POD_NAME`,
/// `POD_NAMESPACE`) and service-account mount.
#[cfg(feature = "kubernetes")]
fn kubernetes(namespace: &Option<String>, label_selector: &Option<String>) -> KubernetesConfig {
    KubernetesConfig {
        namespace: namespace.clone(),
        ..KubernetesConfig::new(label_selector.clone().unwrap_or_default())
    }
    .with_pod_environment()
}

/// The etcd backend for `--etcd-endpoint` (one endpoint or a comma-separated list).
#[cfg(feature = "etcd")]
async fn etcd(endpoint: &str, prefix: &str, lease_ttl: Duration) -> anyhow::Result<EtcdDiscovery> {
    let members = EtcdEndpoint::parse_list(endpoint).context("--etcd-endpoint")?;
    EtcdDiscovery::connect(EtcdConfig {
        prefix: prefix.to_owned(),
        lease_ttl,
        ..EtcdConfig::new(members.iter().map(EtcdEndpoint::url))
    })
    .await
    .with_context(|| format!("cannot connect to etcd at {endpoint}"))
}
