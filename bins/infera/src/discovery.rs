//! The discovery backend a command uses, picked from its validated [`DiscoveryConfig`]: the
//! worker side ([`registrar`]) and the server side ([`watch`]). Every backend implements the
//! ports of [`infera_backends::discovery`]; nothing else in the binary names a backend.

use crate::config::DiscoveryConfig;
use anyhow::{Context as _, bail};
use infera_backends::discovery::{
    Discovery, DiscoveryStream, EtcdConfig, EtcdDiscovery, Registrar,
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
        DiscoveryConfig::Kubernetes { .. } => {
            bail!("--discovery-backend kubernetes is not available in this build yet (use etcd)")
        }
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
        DiscoveryConfig::Kubernetes { .. } => {
            bail!("--discovery-backend kubernetes is not available in this build yet (use etcd)")
        }
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

async fn etcd(endpoint: &str, prefix: &str, lease_ttl: Duration) -> anyhow::Result<EtcdDiscovery> {
    EtcdDiscovery::connect(EtcdConfig {
        prefix: prefix.to_owned(),
        lease_ttl,
        ..EtcdConfig::new([endpoint.to_owned()])
    })
    .await
    .with_context(|| format!("cannot connect to etcd at {endpoint}"))
}
