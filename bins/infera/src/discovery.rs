//! The discovery backend a command uses, picked from its validated [`DiscoveryConfig`]: the
//! worker side ([`registrar`]) and the server side ([`watch`]). Every backend implements the
//! ports of [`infera_backends::discovery`]; nothing else in the binary names a backend.

use crate::config::DiscoveryConfig;
use anyhow::Context as _;
use infera_backends::discovery::etcd::endpoint::EtcdEndpoint;
use infera_backends::discovery::{
    Discovery, DiscoveryStream, EtcdConfig, EtcdDiscovery, KubernetesConfig, KubernetesDiscovery,
    KubernetesRegistrar, Registrar,
};
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
        DiscoveryConfig::Etcd { endpoint, prefix } => {
            Ok(Arc::new(etcd(endpoint, prefix, lease_ttl).await?))
        }
        DiscoveryConfig::Kubernetes { .. } => Ok(Arc::new(
            KubernetesRegistrar::connect(kubernetes(config))
                .await
                .context("cannot register through the Kubernetes API")?,
        )),
    }
}

/// Connects the server side of the configured backend and starts watching the fleet.
///
/// # Errors
/// The backend cannot be reached, or is not part of this build.
pub async fn watch(config: &DiscoveryConfig) -> anyhow::Result<DiscoveryStream> {
    let discovery: Arc<dyn Discovery> = match config {
        DiscoveryConfig::Etcd { endpoint, prefix } => {
            Arc::new(etcd(endpoint, prefix, EtcdConfig::default().lease_ttl).await?)
        }
        DiscoveryConfig::Kubernetes { .. } => Arc::new(
            KubernetesDiscovery::connect(kubernetes(config))
                .await
                .context("cannot watch worker Pods through the Kubernetes API")?,
        ),
    };
    discovery
        .watch()
        .await
        .with_context(|| format!("cannot watch the fleet ({})", describe(config)))
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

/// The Kubernetes settings of `config`, completed from the Pod's downward-API environment
/// (`POD_NAME`, `POD_NAMESPACE`) and service-account mount.
fn kubernetes(config: &DiscoveryConfig) -> KubernetesConfig {
    let (namespace, selector) = match config {
        DiscoveryConfig::Kubernetes {
            namespace,
            label_selector,
        } => (
            namespace.clone(),
            label_selector.clone().unwrap_or_default(),
        ),
        DiscoveryConfig::Etcd { .. } => (None, String::new()),
    };
    KubernetesConfig {
        namespace,
        ..KubernetesConfig::new(selector)
    }
    .with_pod_environment()
}

/// The etcd backend for `--etcd-endpoint` (one endpoint or a comma-separated list).
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
