//! Kubernetes discovery backend (PROTOCOLS.md §1, compatible with the Python Infera).
//!
//! # Wire layout
//!
//! ```text
//! where:   the worker's own Pod, metadata.annotations["infera.amd.com/worker-info"]
//! value:   the WorkerRecord as a JSON string   {"worker_id": "<host>:<port>", "url": …, "engine": …}
//! write:   PATCH /api/v1/namespaces/<POD_NAMESPACE>/pods/<POD_NAME>
//!          Content-Type: application/merge-patch+json
//!          {"metadata":{"annotations":{"infera.amd.com/worker-info": "<record>"}}}   (null removes it)
//! read:    GET  /api/v1/namespaces/<ns>/pods?labelSelector=<sel>                        (list)
//!          GET  /api/v1/namespaces/<ns>/pods?watch=true&resourceVersion=<rv>&…           (watch)
//! ```
//!
//! # Worker side ([`KubernetesRegistrar`])
//!
//! The worker names its Pod through the downward API (`POD_NAME`, `POD_NAMESPACE`, read once by
//! the binary into [`KubernetesConfig`]). `connect` reads the Pod, which surfaces a missing Pod,
//! an RBAC refusal (naming the verb and resource to grant) or an unreachable API server before the
//! engine is started, and clears a record left by an earlier container of the same Pod.
//! `register` patches the annotation, and a task owned by the registration patches it again every
//! [`KubernetesConfig::refresh_interval`] (self-heal if something strips it; identical patches
//! cause no watch event). `deregister` stops that task, waits for its in-flight patch, then removes
//! the annotation, so the record is gone before the worker drains. The Pod's lifetime is the
//! lease: a dropped registration leaves the annotation until the Pod stops being Ready or is
//! deleted. One Pod carries one record; a second registration for another worker on the same
//! registrar is refused.
//!
//! # Server side ([`KubernetesDiscovery`])
//!
//! Lists the Pods matching the label selector in the namespace, then watches from the list's
//! `resourceVersion` (with bookmarks, and a server-side timeout). A Pod is routed when it is
//! Running, Ready, not being deleted, and carries a valid record; it leaves routing
//! (`Deregistered`) when deleted, when it turns not Ready or not Running, and when the annotation
//! goes or becomes invalid. A routed Pod that gets a `deletionTimestamp` while still Ready and
//! annotated is draining: `Draining` with reason [`DRAINING_REASON`], once; it stays listed and
//! takes no new requests until one of those makes it leave (normally the worker removing its
//! annotation on SIGTERM). A Pod already being deleted when first seen is not routed.
//!
//! A watch that ends (server timeout, dropped or broken connection) resumes from the last
//! `resourceVersion` seen (events or bookmarks); a 410 Gone (the version was compacted), or watch
//! requests failing twice in a row (the API server unreachable or refusing), re-list:
//! `Deregistered` for Pods that vanished meanwhile, `Draining` for those that began deleting,
//! `Registered` for new or changed ones, then a watch from the list's version. Failures back off
//! exponentially, up to [`KubernetesConfig::backoff_max`].
//!
//! The slot a record is stored in is its Pod: the worker id is taken from the record (the Python
//! workers use `<advertise-host>:<port>`, which need not be the Pod IP). Two Pods claiming the same
//! worker id are a conflict: the first keeps it, the other is counted as invalid and waits; it is
//! routed if the first one leaves.
//!
//! # Scaling ([`KubernetesScaler`])
//!
//! The scaling port (`--enable-scaling-api`): resizes the pools of the InferaDeployment the
//! server's own Pod belongs to; see the `scaling` module.

mod fleet;
mod registrar;
mod scaling;
mod watcher;

pub use scaling::{DEPLOYMENT_LABEL, KubernetesScaler, SERVICE_LABEL};

use super::{
    Discovery, DiscoveryError, DiscoveryStream, Registrar, Registration, Result, WatchStats,
};
use async_trait::async_trait;
use infera_core::event::WorkerRecord;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

/// The kube client and its API types, re-exported so that callers build a [`kube::Config`]
/// without depending on a matching version themselves.
pub use k8s_openapi;
pub use kube;

/// The Pod annotation that carries a worker's record (Python Infera's `WORKER_INFO_ANNOTATION`).
pub const WORKER_INFO_ANNOTATION: &str = "infera.amd.com/worker-info";

/// Reason of the `Draining` sent for a routed Pod that got a `deletionTimestamp`.
pub const DRAINING_REASON: &str = "pod is being deleted (deletionTimestamp set)";

/// Where a Pod's service account namespace is mounted.
pub const SERVICE_ACCOUNT_NAMESPACE_FILE: &str =
    "/var/run/secrets/kubernetes.io/serviceaccount/namespace";

const BACKEND: &str = "kubernetes";

/// Settings of the Kubernetes backend.
#[derive(Debug, Clone)]
pub struct KubernetesConfig {
    /// Namespace to watch (server, `--k8s-namespace`) or of the worker's own Pod (worker);
    /// `None` means [`KubernetesConfig::own_namespace`], then the client's default namespace.
    pub namespace: Option<String>,
    /// Label selector of worker Pods (`--k8s-label-selector`); empty selects every Pod of the
    /// namespace (only annotated ones are routed).
    pub label_selector: String,
    /// The worker's own Pod (downward API `POD_NAME`); required by [`KubernetesRegistrar`].
    pub pod_name: Option<String>,
    /// The namespace this process runs in (`POD_NAMESPACE`, or the service account mount).
    pub own_namespace: Option<String>,
    /// How to reach the API server; `None` infers it (kubeconfig, then the in-cluster service
    /// account). Tests pass [`KubernetesConfig::with_api_url`].
    pub api: Option<kube::Config>,
    /// How often a registration patches its annotation again.
    pub refresh_interval: Duration,
    /// Bound on each API request (list, get, patch, opening a watch).
    pub request_timeout: Duration,
    /// Server-side timeout of one watch request; the watch resumes after it.
    pub watch_timeout: Duration,
    /// First reconnect delay; doubled on each failure.
    pub backoff_initial: Duration,
    /// Longest reconnect delay.
    pub backoff_max: Duration,
    /// Capacity of each watch stream's channel.
    pub channel_capacity: usize,
}

impl Default for KubernetesConfig {
    fn default() -> Self {
        Self {
            namespace: None,
            label_selector: String::new(),
            pod_name: None,
            own_namespace: None,
            api: None,
            refresh_interval: Duration::from_secs(30),
            request_timeout: Duration::from_secs(10),
            watch_timeout: Duration::from_secs(290),
            backoff_initial: Duration::from_millis(100),
            backoff_max: Duration::from_secs(30),
            channel_capacity: 1024,
        }
    }
}

impl KubernetesConfig {
    /// The default configuration for `label_selector`.
    pub fn new(label_selector: impl Into<String>) -> Self {
        Self {
            label_selector: label_selector.into(),
            ..Self::default()
        }
    }

    /// Fills [`Self::pod_name`] and [`Self::own_namespace`] from the downward API environment
    /// (`POD_NAME`, `POD_NAMESPACE`) and, for the namespace, the service account mount. Fields
    /// already set are kept. Meant to be called once by the binary.
    pub fn with_pod_environment(mut self) -> Self {
        let env = |name: &str| {
            std::env::var(name)
                .ok()
                .map(|v| v.trim().to_owned())
                .filter(|v| !v.is_empty())
        };
        if self.pod_name.is_none() {
            self.pod_name = env("POD_NAME");
        }
        if self.own_namespace.is_none() {
            self.own_namespace = env("POD_NAMESPACE").or_else(|| {
                std::fs::read_to_string(SERVICE_ACCOUNT_NAMESPACE_FILE)
                    .ok()
                    .map(|v| v.trim().to_owned())
                    .filter(|v| !v.is_empty())
            });
        }
        self
    }

    /// Talks to the API server at `url` (e.g. `http://127.0.0.1:6443`) without credentials.
    ///
    /// # Errors
    /// [`DiscoveryError::InvalidConfig`] if `url` is not a URL.
    pub fn with_api_url(mut self, url: &str) -> Result<Self> {
        let uri: http::Uri = url.parse().map_err(|e| {
            DiscoveryError::InvalidConfig(format!("Kubernetes API URL {url:?}: {e}"))
        })?;
        self.api = Some(kube::Config::new(uri));
        Ok(self)
    }

    fn validate(&self) -> Result<()> {
        let invalid = |msg: String| Err(DiscoveryError::InvalidConfig(msg));
        if self.refresh_interval.is_zero() {
            return invalid("the annotation refresh interval must be above zero".to_owned());
        }
        if self.request_timeout.is_zero() {
            return invalid("the Kubernetes request timeout must be above zero".to_owned());
        }
        if self.watch_timeout < Duration::from_secs(1) {
            return invalid(format!(
                "the watch timeout {:?} is below the API's granularity of 1 s",
                self.watch_timeout
            ));
        }
        if self.channel_capacity == 0 {
            return invalid("watch channel capacity must be at least 1".to_owned());
        }
        if let Some(ns) = &self.namespace
            && ns.trim().is_empty()
        {
            return invalid("--k8s-namespace must not be blank".to_owned());
        }
        Ok(())
    }
}

/// A connected client and the namespace it works in.
#[derive(Clone)]
struct Connection {
    client: kube::Client,
    namespace: String,
    /// For error messages.
    url: String,
}

impl Connection {
    async fn open(config: &KubernetesConfig) -> Result<Self> {
        config.validate()?;
        let kube_config = match &config.api {
            Some(api) => api.clone(),
            None => kube::Config::infer().await.map_err(|e| {
                DiscoveryError::InvalidConfig(format!(
                    "no Kubernetes API configuration: not running in a Pod with a service \
                     account (KUBERNETES_SERVICE_HOST unset) and no usable kubeconfig \
                     ($KUBECONFIG or ~/.kube/config): {e}"
                ))
            })?,
        };
        let url = kube_config.cluster_url.to_string();
        let namespace = config
            .namespace
            .clone()
            .or_else(|| config.own_namespace.clone())
            .unwrap_or_else(|| kube_config.default_namespace.clone());
        let client = kube::Client::try_from(kube_config).map_err(|e| {
            DiscoveryError::InvalidConfig(format!("Kubernetes client for {url}: {e}"))
        })?;
        Ok(Self {
            client,
            namespace,
            url,
        })
    }

    fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.client.clone(), &self.namespace)
    }
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection")
            .field("url", &self.url)
            .field("namespace", &self.namespace)
            .finish_non_exhaustive()
    }
}

/// Server side: watches worker Pods. Cheap to clone; clones share one HTTP client.
#[derive(Debug, Clone)]
pub struct KubernetesDiscovery {
    connection: Connection,
    config: Arc<KubernetesConfig>,
}

impl KubernetesDiscovery {
    /// Prepares a client. Nothing is requested yet: [`Discovery::watch`] reports an unreachable
    /// API server or missing permissions.
    ///
    /// # Errors
    /// [`DiscoveryError::InvalidConfig`] for an unusable configuration, or when no API server
    /// configuration can be found (not in a Pod, no kubeconfig).
    pub async fn connect(config: KubernetesConfig) -> Result<Self> {
        let connection = Connection::open(&config).await?;
        Ok(Self {
            connection,
            config: Arc::new(config),
        })
    }

    /// The namespace being watched.
    pub fn namespace(&self) -> &str {
        &self.connection.namespace
    }
}

#[async_trait]
impl Discovery for KubernetesDiscovery {
    async fn watch(&self) -> Result<DiscoveryStream> {
        let stats = Arc::new(WatchStats::default());
        let (tx, rx) = mpsc::channel(self.config.channel_capacity);
        let watcher = watcher::Watcher::start(
            self.connection.clone(),
            self.config.clone(),
            tx,
            stats.clone(),
        )
        .await?;
        let task = tokio::spawn(watcher.run());
        Ok(DiscoveryStream::new(rx, stats, task))
    }
}

/// Worker side: publishes the record in the worker's own Pod annotation.
#[derive(Debug, Clone)]
pub struct KubernetesRegistrar {
    inner: Arc<registrar::PodRecord>,
}

impl KubernetesRegistrar {
    /// Connects to the API server, checks that this process's Pod can be read, and removes a
    /// record an earlier container of the same Pod left behind.
    ///
    /// # Errors
    /// [`DiscoveryError::InvalidConfig`] without a Pod name (`POD_NAME` unset: not in a Pod, or
    /// the downward API env missing); [`DiscoveryError::Rejected`] when the Pod does not exist or
    /// the service account may not get or patch it (the message names the verb to grant);
    /// [`DiscoveryError::Unavailable`] when the API server cannot be reached.
    pub async fn connect(config: KubernetesConfig) -> Result<Self> {
        let Some(pod) = config.pod_name.clone().filter(|p| !p.trim().is_empty()) else {
            return Err(DiscoveryError::InvalidConfig(
                "POD_NAME is not set: a worker with --discovery-backend kubernetes must run in a \
                 Pod whose container sets POD_NAME (fieldRef metadata.name) and POD_NAMESPACE \
                 (fieldRef metadata.namespace) through the downward API; see \
                 bins/deploy/kubernetes/"
                    .to_owned(),
            ));
        };
        let connection = Connection::open(&config).await?;
        let inner = registrar::PodRecord::open(connection, pod, Arc::new(config)).await?;
        Ok(Self {
            inner: Arc::new(inner),
        })
    }

    /// The Pod this registrar writes to.
    pub fn pod(&self) -> &str {
        self.inner.pod()
    }

    /// The Pod's namespace.
    pub fn namespace(&self) -> &str {
        self.inner.namespace()
    }
}

#[async_trait]
impl Registrar for KubernetesRegistrar {
    async fn register(&self, record: &WorkerRecord) -> Result<Registration> {
        registrar::register(&self.inner, record).await
    }
}

/// What a request was, for error messages: `verb` and `resource` as RBAC names them.
#[derive(Debug, Clone, Copy)]
struct Op {
    /// The port-level operation (`list`, `watch`, `patch`…), as in [`DiscoveryError`].
    name: &'static str,
    /// The RBAC verb.
    verb: &'static str,
}

impl Op {
    const LIST: Op = Op {
        name: "list pods",
        verb: "list",
    };
    const WATCH: Op = Op {
        name: "watch pods",
        verb: "watch",
    };
    const GET: Op = Op {
        name: "get own pod",
        verb: "get",
    };
    const PATCH: Op = Op {
        name: "patch own pod",
        verb: "patch",
    };
}

/// Runs a kube call under the request timeout and maps its error.
async fn timed<T>(
    connection: &Connection,
    timeout: Duration,
    op: Op,
    call: impl Future<Output = kube::Result<T>>,
) -> Result<T> {
    match tokio::time::timeout(timeout, call).await {
        Ok(result) => result.map_err(|e| map_err(connection, op, &e)),
        Err(_) => Err(DiscoveryError::Unavailable {
            backend: BACKEND,
            op: op.name,
            message: format!(
                "no answer within {timeout:?} from the Kubernetes API server at {}",
                connection.url
            ),
        }),
    }
}

/// The HTTP status of an API error, if `e` is one.
fn api_code(e: &kube::Error) -> Option<u16> {
    match e {
        kube::Error::Api(status) => Some(status.code),
        _ => None,
    }
}

/// Maps a kube error: refusals (4xx but 408/429) are final and say what to fix; the rest may
/// pass.
fn map_err(connection: &Connection, op: Op, e: &kube::Error) -> DiscoveryError {
    let ns = &connection.namespace;
    let rejected = |message: String| DiscoveryError::Rejected {
        backend: BACKEND,
        op: op.name,
        message,
    };
    match e {
        kube::Error::Api(status) => match status.code {
            403 => rejected(format!(
                "forbidden: this service account may not {verb} pods in namespace {ns:?}; grant \
                 verb {verb:?} on resource \"pods\" with a Role and RoleBinding (the server needs \
                 get, list, watch; workers need get, patch: see bins/deploy/kubernetes/base/rbac.yaml). \
                 API server: {msg}",
                verb = op.verb,
                msg = status.message
            )),
            401 => rejected(format!(
                "unauthorized: the API server at {} rejected this process's credentials: {}",
                connection.url, status.message
            )),
            404 => rejected(format!(
                "not found in namespace {ns:?}: {} (POD_NAME and POD_NAMESPACE must name this \
                 process's own Pod, through the downward API)",
                status.message
            )),
            400 | 422 => rejected(format!("bad request: {}", status.message)),
            408 | 429 => DiscoveryError::Unavailable {
                backend: BACKEND,
                op: op.name,
                message: format!("API server busy ({}): {}", status.code, status.message),
            },
            code if (400..500).contains(&code) => rejected(format!("{code}: {}", status.message)),
            code => DiscoveryError::Unavailable {
                backend: BACKEND,
                op: op.name,
                message: format!("API server error {code}: {}", status.message),
            },
        },
        other => DiscoveryError::Unavailable {
            backend: BACKEND,
            op: op.name,
            message: format!(
                "cannot reach the Kubernetes API server at {}: {other}",
                connection.url
            ),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn connection() -> Connection {
        let config = kube::Config::new("http://127.0.0.1:1".parse().unwrap());
        Connection {
            client: kube::Client::try_from(config).unwrap(),
            namespace: "fleet".to_owned(),
            url: "http://127.0.0.1:1/".to_owned(),
        }
    }

    fn api_error(code: u16, message: &str) -> kube::Error {
        kube::Error::Api(
            kube::core::Status::failure(message, "Reason")
                .with_code(code)
                .boxed(),
        )
    }

    #[tokio::test]
    async fn a_forbidden_request_names_the_verb_and_the_resource_to_grant() {
        let e = map_err(&connection(), Op::PATCH, &api_error(403, "denied"));
        assert!(!e.is_retryable());
        let text = e.to_string();
        assert!(text.contains("verb \"patch\""), "{text}");
        assert!(text.contains("resource \"pods\""), "{text}");
        assert!(text.contains("\"fleet\""), "{text}");
        let e = map_err(&connection(), Op::WATCH, &api_error(403, "denied"));
        assert!(e.to_string().contains("verb \"watch\""), "{e}");
    }

    #[tokio::test]
    async fn server_errors_and_throttling_are_retryable_refusals_are_not() {
        for code in [500, 503, 429] {
            assert!(map_err(&connection(), Op::LIST, &api_error(code, "x")).is_retryable());
        }
        for code in [400, 401, 404, 422] {
            assert!(!map_err(&connection(), Op::LIST, &api_error(code, "x")).is_retryable());
        }
    }

    #[test]
    fn config_is_validated() {
        assert!(KubernetesConfig::new("app=worker").validate().is_ok());
        let blank = KubernetesConfig {
            namespace: Some(" ".to_owned()),
            ..KubernetesConfig::default()
        };
        assert!(blank.validate().is_err());
        let no_capacity = KubernetesConfig {
            channel_capacity: 0,
            ..KubernetesConfig::default()
        };
        assert!(no_capacity.validate().is_err());
        assert!(
            KubernetesConfig::default()
                .with_api_url("not a url")
                .is_err()
        );
    }
}
