//! The scaling port on Kubernetes ([`KubernetesScaler`], `--enable-scaling-api`), compatible with
//! the Python Infera's `DeploymentScaler`: it edits the InferaDeployment the operator reconciles
//! and nothing else (the generated Deployments are rewritten on every reconcile pass, so scaling
//! them would be silently undone).
//!
//! # Wire layout
//!
//! ```text
//! which:   GET   /api/v1/namespaces/<ns>/pods/<POD_NAME>     metadata.labels["infera.amd.com/deployment"]
//! read:    GET   /apis/infera.amd.com/v1alpha1/namespaces/<ns>/inferadeployments/<name>
//!                spec.services.<svc>.{replicas, role, numberOfNodes}
//!                status.services.<svc>.{replicas, readyReplicas}, status.state
//! why:     GET   /api/v1/namespaces/<ns>/pods?labelSelector=infera.amd.com/deployment=<name>,infera.amd.com/service=<svc>
//! write:   PATCH the deployment, application/merge-patch+json
//!                {"spec":{"services":{"<svc>":{"replicas":N}, …}}}          (one patch for all)
//! ```
//!
//! The deployment is the one the server's own Pod is labelled with (read once, then kept), never
//! configured, so the two cannot disagree. Nothing is contacted before the first call: a server
//! whose service account lacks the scaling permissions starts and serves, and the endpoint says
//! what to grant. Each API call is bounded by [`KubernetesConfig::request_timeout`].

use super::{Connection, KubernetesConfig};
use async_trait::async_trait;
use infera_core::error::ErrorCode;
use infera_core::ports::scaling::{PoolScaler, PoolSize, PoolSnapshot, ScalingError, validate};
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::{ApiResource, DynamicObject, ListParams, Patch, PatchParams};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::future::Future;
use tokio::sync::OnceCell;

/// The label the operator puts on every workload it generates, naming its InferaDeployment.
pub const DEPLOYMENT_LABEL: &str = "infera.amd.com/deployment";
/// The label naming the service (pool) a workload belongs to.
pub const SERVICE_LABEL: &str = "infera.amd.com/service";

/// Container waits a Pod does not recover from on its own (unlike ContainerCreating and
/// PodInitializing, which resolve in seconds).
const TERMINAL_WAITS: [&str; 4] = [
    "ImagePullBackOff",
    "ErrImagePull",
    "CrashLoopBackOff",
    "CreateContainerConfigError",
];

/// The InferaDeployment resource.
fn inferadeployments() -> ApiResource {
    ApiResource {
        group: "infera.amd.com".to_owned(),
        version: "v1alpha1".to_owned(),
        api_version: "infera.amd.com/v1alpha1".to_owned(),
        kind: "InferaDeployment".to_owned(),
        plural: "inferadeployments".to_owned(),
    }
}

/// Reads and resizes the pools of the InferaDeployment the server's Pod belongs to.
#[derive(Debug)]
pub struct KubernetesScaler {
    config: KubernetesConfig,
    connection: OnceCell<Connection>,
    deployment: OnceCell<String>,
}

impl KubernetesScaler {
    /// A scaler for the Pod [`KubernetesConfig::pod_name`] in [`KubernetesConfig::namespace`]
    /// (else its own namespace); connects on first use.
    pub fn new(config: KubernetesConfig) -> Self {
        Self {
            config,
            connection: OnceCell::new(),
            deployment: OnceCell::new(),
        }
    }

    async fn connection(&self) -> Result<&Connection, ScalingError> {
        self.connection
            .get_or_try_init(|| async {
                Connection::open(&self.config).await.map_err(|e| {
                    ScalingError::caused_by(
                        ErrorCode::Unavailable,
                        format!("cannot reach the Kubernetes API: {e}"),
                        e,
                    )
                })
            })
            .await
    }

    /// Runs one API call under the request deadline; `refusals` words the statuses that need
    /// the operator's attention (403, 404), the rest are reported as the API server's.
    async fn call<T>(
        &self,
        connection: &Connection,
        refusals: &[(u16, ErrorCode, &str)],
        call: impl Future<Output = kube::Result<T>>,
    ) -> Result<T, ScalingError> {
        let timeout = self.config.request_timeout;
        let result = tokio::time::timeout(timeout, call).await.map_err(|_| {
            ScalingError::new(
                ErrorCode::Unavailable,
                format!(
                    "no answer within {timeout:?} from the Kubernetes API server at {}",
                    connection.url
                ),
            )
        })?;
        result.map_err(|e| match &e {
            kube::Error::Api(status) => {
                let code = status.code;
                match refusals.iter().find(|(c, _, _)| *c == code) {
                    Some((_, error_code, message)) => {
                        ScalingError::caused_by(*error_code, *message, e)
                    }
                    None => {
                        let message = format!(
                            "the Kubernetes API server answered {code}: {}",
                            status.message
                        );
                        ScalingError::caused_by(ErrorCode::BadGateway, message, e)
                    }
                }
            }
            other => ScalingError::new(
                ErrorCode::Unavailable,
                format!(
                    "cannot reach the Kubernetes API server at {}: {other}",
                    connection.url
                ),
            ),
        })
    }

    /// The InferaDeployment named by the server's own Pod's label.
    async fn deployment(&self, connection: &Connection) -> Result<&str, ScalingError> {
        let name = self
            .deployment
            .get_or_try_init(|| async {
                let Some(pod_name) = &self.config.pod_name else {
                    return Err(ScalingError::new(
                        ErrorCode::Unavailable,
                        "scaling needs POD_NAME (downward API) to find its own deployment",
                    ));
                };
                let ns = &connection.namespace;
                let not_found = format!(
                    "router Pod {ns}/{pod_name} not found; cannot resolve deployment to scale"
                );
                let refusals = [
                    (
                        403,
                        ErrorCode::Forbidden,
                        "the router's ServiceAccount cannot read its own Pod; re-apply the \
                         operator RBAC",
                    ),
                    (404, ErrorCode::Unavailable, not_found.as_str()),
                ];
                let pod = self
                    .call(connection, &refusals, connection.pods().get(pod_name))
                    .await?;
                pod.metadata
                    .labels
                    .and_then(|mut labels| labels.remove(DEPLOYMENT_LABEL))
                    .ok_or_else(|| {
                        ScalingError::new(
                            ErrorCode::Conflict,
                            format!(
                                "this router was not created by the operator (no \
                                 {DEPLOYMENT_LABEL} label), so there is no deployment to scale"
                            ),
                        )
                    })
            })
            .await?;
        Ok(name)
    }

    fn deployments(connection: &Connection) -> Api<DynamicObject> {
        Api::namespaced_with(
            connection.client.clone(),
            &connection.namespace,
            &inferadeployments(),
        )
    }

    /// The deployment's `spec` and `status`.
    async fn fetch(&self, connection: &Connection, name: &str) -> Result<Value, ScalingError> {
        let missing = format!("InferaDeployment {name:?} not found");
        let refusals = [
            (
                403,
                ErrorCode::Forbidden,
                "the router's ServiceAccount cannot read InferaDeployments; re-apply the \
                 operator RBAC",
            ),
            (404, ErrorCode::NotFound, missing.as_str()),
        ];
        let object = self
            .call(
                connection,
                &refusals,
                Self::deployments(connection).get(name),
            )
            .await?;
        Ok(object.data)
    }

    async fn snapshot_of(
        &self,
        connection: &Connection,
        name: &str,
    ) -> Result<PoolSnapshot, ScalingError> {
        let cr = self.fetch(connection, name).await?;
        let count = |value: &Value, key: &str, default: u64| {
            value.get(key).and_then(Value::as_u64).unwrap_or(default)
        };
        let mut services = BTreeMap::new();
        for (service, spec) in cr
            .pointer("/spec/services")
            .and_then(Value::as_object)
            .into_iter()
            .flatten()
        {
            let observed = cr
                .pointer(&format!("/status/services/{service}"))
                .unwrap_or(&Value::Null);
            let mut pool = PoolSize {
                role: spec
                    .get("role")
                    .and_then(Value::as_str)
                    .filter(|role| !role.is_empty())
                    .unwrap_or("mixed")
                    .to_owned(),
                replicas: count(spec, "replicas", 1),
                current_replicas: count(observed, "replicas", 0),
                ready_replicas: count(observed, "readyReplicas", 0),
                nodes_per_replica: count(spec, "numberOfNodes", 1),
                blocked: None,
            };
            if pool.ready_replicas < pool.replicas {
                pool.blocked = self.blocked_reason(connection, name, service).await;
            }
            services.insert(service.clone(), pool);
        }
        Ok(PoolSnapshot {
            deployment: name.to_owned(),
            namespace: connection.namespace.clone(),
            state: cr
                .pointer("/status/state")
                .and_then(Value::as_str)
                .unwrap_or("unknown")
                .to_owned(),
            services,
        })
    }

    /// Why a pool's Pods are not running, in the scheduler's or the kubelet's words, if the
    /// cluster says so. Best effort: a pool short of replicas is reported without a reason when
    /// the Pods cannot be read.
    async fn blocked_reason(
        &self,
        connection: &Connection,
        name: &str,
        service: &str,
    ) -> Option<String> {
        let selector = format!("{DEPLOYMENT_LABEL}={name},{SERVICE_LABEL}={service}");
        let pods = self
            .call(
                connection,
                &[],
                connection
                    .pods()
                    .list(&ListParams::default().labels(&selector)),
            )
            .await
            .inspect_err(|e| tracing::debug!(%name, %service, "cannot read the pool's Pods: {e}"))
            .ok()?;
        pods.items.iter().find_map(pending_reason)
    }
}

/// The reason a Pending Pod will not run: unschedulable, or a container wait it does not recover
/// from.
fn pending_reason(pod: &Pod) -> Option<String> {
    let status = pod.status.as_ref()?;
    if status.phase.as_deref() != Some("Pending") {
        return None;
    }
    let unscheduled = status
        .conditions
        .iter()
        .flatten()
        .find(|c| c.type_ == "PodScheduled" && c.status == "False");
    if let Some(condition) = unscheduled {
        return Some(one_line(
            condition.reason.as_deref(),
            condition.message.as_deref(),
        ));
    }
    status
        .container_statuses
        .iter()
        .flatten()
        .filter_map(|c| c.state.as_ref()?.waiting.as_ref())
        .find(|waiting| {
            waiting
                .reason
                .as_deref()
                .is_some_and(|reason| TERMINAL_WAITS.contains(&reason))
        })
        .map(|waiting| one_line(waiting.reason.as_deref(), waiting.message.as_deref()))
}

/// A reason and its detail on one line, short enough to log (scheduler messages list every node).
fn one_line(reason: Option<&str>, message: Option<&str>) -> String {
    let mut text = message
        .unwrap_or_default()
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ");
    if text.chars().count() > 300 {
        text = text.chars().take(297).collect::<String>() + "...";
    }
    match (reason.filter(|r| !r.is_empty()), text.is_empty()) {
        (Some(reason), false) => format!("{reason}: {text}"),
        (Some(reason), true) => reason.to_owned(),
        (None, false) => text,
        (None, true) => "unknown".to_owned(),
    }
}

#[async_trait]
impl PoolScaler for KubernetesScaler {
    async fn snapshot(&self) -> Result<PoolSnapshot, ScalingError> {
        let connection = self.connection().await?;
        let name = self.deployment(connection).await?;
        self.snapshot_of(connection, name).await
    }

    async fn scale(
        &self,
        requested: &BTreeMap<String, Value>,
    ) -> Result<PoolSnapshot, ScalingError> {
        if requested.is_empty() {
            return Err(ScalingError::bad_request("no services named"));
        }
        let connection = self.connection().await?;
        let name = self.deployment(connection).await?;
        let cr = self.fetch(connection, name).await?;
        let known = cr.pointer("/spec/services").and_then(Value::as_object);
        let counts = validate(
            requested,
            known.into_iter().flatten().map(|(k, _)| k.as_str()),
        )?;
        let services: serde_json::Map<String, Value> = counts
            .iter()
            .map(|(service, count)| (service.clone(), json!({"replicas": count})))
            .collect();
        let patch = json!({"spec": {"services": services}});
        let refusals = [(
            403,
            ErrorCode::Forbidden,
            "the router's ServiceAccount cannot patch InferaDeployments; re-apply the operator \
             RBAC",
        )];
        let deployments = Self::deployments(connection);
        let (params, merge) = (PatchParams::default(), Patch::Merge(&patch));
        self.call(
            connection,
            &refusals,
            deployments.patch(name, &params, &merge),
        )
        .await?;
        let summary: Vec<String> = counts.iter().map(|(s, n)| format!("{s}={n}")).collect();
        tracing::info!(deployment = %name, "scaled: {}", summary.join(", "));
        self.snapshot_of(connection, name).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(status: Value) -> Pod {
        serde_json::from_value(json!({"metadata": {"name": "p"}, "status": status})).unwrap()
    }

    #[test]
    fn a_pending_pod_says_why_it_will_not_run() {
        let unschedulable = pod(json!({"phase": "Pending", "conditions": [{
            "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
            "message": "0/4 nodes are available:\n 4 Insufficient amd.com/gpu.",
        }]}));
        assert_eq!(
            pending_reason(&unschedulable).as_deref(),
            Some("Unschedulable: 0/4 nodes are available: 4 Insufficient amd.com/gpu.")
        );
        let pull = pod(json!({"phase": "Pending", "containerStatuses": [{
            "name": "w", "ready": false, "restartCount": 0, "image": "i", "imageID": "",
            "state": {"waiting": {"reason": "ImagePullBackOff", "message": "back-off"}},
        }]}));
        assert_eq!(
            pending_reason(&pull).as_deref(),
            Some("ImagePullBackOff: back-off")
        );
        let starting = pod(json!({"phase": "Pending", "containerStatuses": [{
            "name": "w", "ready": false, "restartCount": 0, "image": "i", "imageID": "",
            "state": {"waiting": {"reason": "ContainerCreating"}},
        }]}));
        assert_eq!(pending_reason(&starting), None);
        assert_eq!(pending_reason(&pod(json!({"phase": "Running"}))), None);
    }

    #[test]
    fn long_messages_are_cut_to_one_short_line() {
        let long = "x ".repeat(400);
        let line = one_line(Some("R"), Some(&long));
        assert!(line.starts_with("R: x x"));
        assert_eq!(line.chars().count(), "R: ".len() + 300);
        assert!(line.ends_with("..."));
        assert_eq!(one_line(None, None), "unknown");
    }
}
