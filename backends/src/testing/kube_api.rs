//! An in-process Kubernetes API server for Pods, speaking the real HTTP/JSON protocol, so that
//! the real `kube` client (and `kubectl`) can be tested without a cluster.
//!
//! # What it implements
//!
//! | request | behaviour |
//! |---|---|
//! | `GET /api/v1[/namespaces/{ns}]/pods?labelSelector=` | `PodList` with the store's `resourceVersion` |
//! | `GET …/pods?watch=true&resourceVersion=&allowWatchBookmarks=&timeoutSeconds=` | newline-delimited `{"type","object"}` events: ADDED / MODIFIED / DELETED, BOOKMARK on [`KubeApiServer::send_bookmarks`]; no or `0` version → the current Pods as ADDED first; a compacted version → one ERROR event with a 410 `Expired` `Status` |
//! | `GET /api/v1/namespaces/{ns}/pods/{name}` | the Pod, or 404 `NotFound` |
//! | `PATCH` of the same path | `application/merge-patch+json` (RFC 7386) and `application/strategic-merge-patch+json` (maps merge the same way; lists are replaced and `$` directives are refused with 400); an unchanged object keeps its version and emits no event; a `metadata.resourceVersion` in the patch is a precondition (409 on mismatch) |
//! | `GET`, merge-`PATCH` `/apis/{group}/{version}/namespaces/{ns}/{plural}/{name}` | a custom object put by [`KubeApiServer::put_custom`] (not listed or watched) |
//! | `/api`, `/apis`, `/api/v1`, `/apis/{group}/{version}`, `/version` | discovery documents for the core, apps, batch, rbac and policy groups, so that `kubectl apply --dry-run=client` can map kinds |
//! | anything else | 404 `NotFound` `Status` |
//!
//! RBAC: [`KubeApiServer::deny`] makes a verb on `pods` answer 403 `Forbidden` with the API
//! server's message, [`KubeApiServer::deny_on`] a verb on another resource. Kubelet and controller behaviour (phase, readiness, deletion) is driven by the
//! test through the handle, as is the transport: [`KubeApiServer::drop_watches`] breaks every
//! watch connection mid-stream, [`KubeApiServer::compact`] makes old versions expire,
//! [`KubeApiServer::stop`] and [`KubeApiServer::restart`] take the whole server away and back on
//! the same port. Every request and mutation notifies [`KubeApiServer::wait_until`], so tests wait
//! on conditions, never on time.

mod apis;
mod custom;
mod selector;
mod store;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use futures::StreamExt;
use selector::Selector;
use serde_json::{Value, json};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use store::{Store, merge_patch, status, strategic_directive};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};

/// Counters of the requests served, for tests to wait on and assert.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ApiStats {
    /// Pod list requests answered 200.
    pub lists: u64,
    /// Watch requests answered 200.
    pub watches: u64,
    /// Single-Pod GETs answered 200.
    pub gets: u64,
    /// Pod patches answered 200.
    pub patches: u64,
    /// Requests answered 403.
    pub denied: u64,
    /// Watches answered with a 410 Expired event.
    pub expired: u64,
    /// Watch requests that waited at a [`KubeApiServer::hold_watches`] gate.
    pub held_watches: u64,
    /// The `resourceVersion` of the latest watch request.
    pub last_watch_version: Option<String>,
    /// The store's resourceVersion (bumped by every change).
    pub revision: u64,
    /// The bodies of the custom-object patches answered 200, in order.
    pub custom_patches: Vec<Value>,
}

struct Shared {
    namespace: String,
    store: Mutex<Store>,
    stats: watch::Sender<ApiStats>,
    /// `true` while watch requests are served; `false` holds them at the door.
    watch_gate: watch::Sender<bool>,
}

impl Shared {
    fn store(&self) -> MutexGuard<'_, Store> {
        // A panic while holding the lock is a test bug; keep serving the state as it is.
        self.store
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn count(&self, f: impl FnOnce(&mut ApiStats)) {
        let revision = self.store().revision();
        self.stats.send_modify(|stats| {
            f(stats);
            stats.revision = revision;
        });
    }
}

/// The in-process API server. Dropping it stops serving.
pub struct KubeApiServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    serving: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for KubeApiServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeApiServer")
            .field("addr", &self.addr)
            .field("namespace", &self.shared.namespace)
            .finish_non_exhaustive()
    }
}

impl KubeApiServer {
    /// Starts serving on a free loopback port; `namespace` is where the Pod helpers act.
    ///
    /// # Errors
    /// If no loopback port can be bound.
    pub async fn start(namespace: &str) -> std::io::Result<Self> {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
        let addr = listener.local_addr()?;
        let (stats, _) = watch::channel(ApiStats::default());
        let shared = Arc::new(Shared {
            namespace: namespace.to_owned(),
            store: Mutex::new(Store::default()),
            stats,
            watch_gate: watch::channel(true).0,
        });
        let server = Self {
            addr,
            shared,
            serving: Mutex::new(None),
        };
        server.serve(listener);
        Ok(server)
    }

    /// `http://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The namespace the Pod helpers act in.
    pub fn namespace(&self) -> &str {
        &self.shared.namespace
    }

    fn serve(&self, listener: TcpListener) {
        let app = router(self.shared.clone());
        let task = tokio::spawn(async move {
            // Owned here, so aborting this task closes every connection.
            let mut connections = JoinSet::new();
            loop {
                tokio::select! {
                    accepted = listener.accept() => {
                        let Ok((stream, _)) = accepted else { continue };
                        let service = hyper_util::service::TowerToHyperService::new(app.clone());
                        connections.spawn(async move {
                            let io = hyper_util::rt::TokioIo::new(stream);
                            let _ = hyper::server::conn::http1::Builder::new()
                                .serve_connection(io, service)
                                .await;
                        });
                    }
                    Some(_) = connections.join_next(), if !connections.is_empty() => {}
                }
            }
        });
        if let Some(old) = self.serving_slot().replace(task) {
            old.abort();
        }
    }

    fn serving_slot(&self) -> MutexGuard<'_, Option<JoinHandle<()>>> {
        self.serving.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes the server away: the port refuses connections and every open connection (watches
    /// included) is cut.
    pub async fn stop(&self) {
        let task = self.serving_slot().take();
        if let Some(task) = task {
            task.abort();
            let _ = task.await;
        }
        self.shared.store().end_watches(false);
    }

    /// Serves again on the same port, with the same state.
    ///
    /// # Errors
    /// If the port cannot be bound again.
    pub async fn restart(&self) -> std::io::Result<()> {
        let listener = TcpListener::bind(self.addr).await?;
        self.serve(listener);
        Ok(())
    }

    /// Current request counters.
    pub fn stats(&self) -> ApiStats {
        self.shared.stats.borrow().clone()
    }

    /// Waits until `condition` holds, re-checking after every request or change.
    ///
    /// # Panics
    /// If it does not hold within `timeout`, naming `what`.
    pub async fn wait_until(
        &self,
        what: &str,
        timeout: Duration,
        mut condition: impl FnMut(&Self) -> bool,
    ) {
        let mut changes = self.shared.stats.subscribe();
        let wait = async {
            loop {
                changes.borrow_and_update();
                if condition(self) {
                    return;
                }
                if changes.changed().await.is_err() {
                    return;
                }
            }
        };
        if tokio::time::timeout(timeout, wait).await.is_err() {
            panic!("the API server did not see {what} within {timeout:?}");
        }
    }

    /// Makes `verb` (`get`, `list`, `watch`, `patch`) on pods answer 403.
    pub fn deny(&self, verb: &str) {
        self.deny_on("pods", verb);
    }

    /// Makes `verb` on `resource` (its plural, e.g. `inferadeployments`) answer 403.
    pub fn deny_on(&self, resource: &str, verb: &str) {
        self.shared
            .store()
            .denied
            .insert(format!("{resource}/{verb}"));
    }

    /// Lifts a [`KubeApiServer::deny`].
    pub fn allow(&self, verb: &str) {
        self.shared.store().denied.remove(&format!("pods/{verb}"));
    }

    /// Puts a namespaced custom object (`apiVersion` `<group>/<version>`, resource `plural`) in
    /// its `metadata.namespace`, or the server's namespace, as its operator or `kubectl apply`
    /// would; returns it as stored.
    ///
    /// # Panics
    /// If the object has no `apiVersion` or no name.
    pub fn put_custom(&self, plural: &str, object: Value) -> Value {
        let key = self.custom_key(plural, &object);
        let stored = self.shared.store().put_custom(key, object);
        self.shared.count(|_| {});
        stored
    }

    /// The custom object `name` of resource `plural` and `api_version` in the server's
    /// namespace, as stored.
    pub fn custom(&self, api_version: &str, plural: &str, name: &str) -> Option<Value> {
        let key = (
            api_version.to_owned(),
            plural.to_owned(),
            self.shared.namespace.clone(),
            name.to_owned(),
        );
        self.shared.store().custom(&key).cloned()
    }

    fn custom_key(&self, plural: &str, object: &Value) -> store::CustomKey {
        let field = |pointer: &str| object.pointer(pointer).and_then(Value::as_str);
        let api_version = field("/apiVersion").expect("a custom object has an apiVersion");
        let name = field("/metadata/name").expect("a custom object has a name");
        let namespace = field("/metadata/namespace").unwrap_or(&self.shared.namespace);
        (
            api_version.to_owned(),
            plural.to_owned(),
            namespace.to_owned(),
            name.to_owned(),
        )
    }

    /// Holds new watch requests (they wait, connected, until [`KubeApiServer::release_watches`]),
    /// so a test can change the state between a client's decision to watch and the server's
    /// answer.
    pub fn hold_watches(&self) {
        self.shared.watch_gate.send_replace(false);
    }

    /// Serves the held watch requests and every later one.
    pub fn release_watches(&self) {
        self.shared.watch_gate.send_replace(true);
    }

    /// Forgets the change history: every watch resumed from a version older than the current one
    /// gets 410.
    pub fn compact(&self) {
        self.shared.store().compact();
    }

    /// Breaks every open watch connection mid-stream; returns how many there were.
    pub fn drop_watches(&self) -> usize {
        self.shared.store().end_watches(true)
    }

    /// Ends every open watch cleanly, as `timeoutSeconds` does; returns how many there were.
    pub fn end_watches(&self) -> usize {
        self.shared.store().end_watches(false)
    }

    /// Number of watches currently connected.
    pub fn open_watches(&self) -> usize {
        self.shared.store().open_watches()
    }

    /// Sends a BOOKMARK at the current version to the watches that allowed bookmarks.
    pub fn send_bookmarks(&self) {
        self.shared.store().bookmark();
        self.shared.count(|_| {});
    }

    /// Creates a Pod in its `metadata.namespace`, or the server's namespace.
    ///
    /// # Panics
    /// If the Pod has no name or already exists.
    pub fn create_pod(&self, pod: Value) -> Value {
        let namespace = pod
            .pointer("/metadata/namespace")
            .and_then(Value::as_str)
            .unwrap_or(&self.shared.namespace)
            .to_owned();
        let created = self.shared.store().create(&namespace, pod);
        self.shared.count(|_| {});
        created.unwrap_or_else(|status| panic!("create_pod: {status}"))
    }

    /// Changes a Pod of the server's namespace as a controller would; `None` if it is absent.
    pub fn modify_pod(&self, name: &str, f: impl FnOnce(&mut Value)) -> Option<Value> {
        let modified = self.shared.store().modify(&self.shared.namespace, name, f);
        self.shared.count(|_| {});
        modified
    }

    /// Sets the Pod's `Ready` condition (and `ContainersReady`), as the kubelet does.
    pub fn set_ready(&self, name: &str, ready: bool) -> Option<Value> {
        self.modify_pod(name, |pod| {
            let value = if ready { "True" } else { "False" };
            if let Some(conditions) = pod
                .pointer_mut("/status/conditions")
                .and_then(Value::as_array_mut)
            {
                for condition in conditions {
                    if matches!(
                        condition["type"].as_str(),
                        Some("Ready" | "ContainersReady")
                    ) {
                        condition["status"] = json!(value);
                    }
                }
            }
            if let Some(statuses) = pod
                .pointer_mut("/status/containerStatuses")
                .and_then(Value::as_array_mut)
            {
                for container in statuses {
                    container["ready"] = json!(ready);
                }
            }
        })
    }

    /// Sets `status.phase`.
    pub fn set_phase(&self, name: &str, phase: &str) -> Option<Value> {
        self.modify_pod(name, |pod| pod["status"]["phase"] = json!(phase))
    }

    /// Sets or removes one annotation, as `kubectl annotate` would.
    pub fn set_annotation(&self, name: &str, key: &str, value: Option<&str>) -> Option<Value> {
        self.modify_pod(name, |pod| {
            merge_patch(pod, &json!({"metadata": {"annotations": {key: value}}}));
        })
    }

    /// Marks the Pod for deletion (`deletionTimestamp`), as a graceful delete does first.
    pub fn begin_deletion(&self, name: &str, grace_seconds: u64) -> Option<Value> {
        self.modify_pod(name, |pod| {
            pod["metadata"]["deletionTimestamp"] = json!(now_rfc3339());
            pod["metadata"]["deletionGracePeriodSeconds"] = json!(grace_seconds);
        })
    }

    /// Removes the Pod (a DELETED event).
    pub fn delete_pod(&self, name: &str) -> Option<Value> {
        let deleted = self.shared.store().delete(&self.shared.namespace, name);
        self.shared.count(|_| {});
        deleted
    }

    /// The Pod as stored.
    pub fn pod(&self, name: &str) -> Option<Value> {
        self.shared
            .store()
            .pod(&self.shared.namespace, name)
            .cloned()
    }

    /// One annotation of a Pod.
    pub fn annotation(&self, name: &str, key: &str) -> Option<String> {
        self.pod(name)?
            .pointer("/metadata/annotations")?
            .get(key)?
            .as_str()
            .map(str::to_owned)
    }
}

impl Drop for KubeApiServer {
    fn drop(&mut self) {
        if let Some(task) = self.serving_slot().take() {
            task.abort();
        }
    }
}

/// A Pod as a Deployment's worker Pod looks once scheduled: Running and Ready, with an IP.
pub fn worker_pod(name: &str, ip: &str, labels: Value) -> Value {
    json!({
        "metadata": {
            "name": name,
            "labels": labels,
            "annotations": {"kubectl.kubernetes.io/default-container": "worker"},
            "ownerReferences": [{
                "apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "infera-worker-5d9c7",
                "uid": "7a1f0c2e-0000-4000-8000-000000000001", "controller": true,
                "blockOwnerDeletion": true,
            }],
        },
        "spec": {
            "containers": [{
                "name": "worker",
                "image": "infera:latest",
                "args": ["worker", "mock", "--discovery-backend", "kubernetes"],
                "ports": [{"containerPort": 8000, "name": "http", "protocol": "TCP"}],
                "env": [
                    {"name": "POD_NAME", "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.name"}}},
                    {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}}},
                ],
                "readinessProbe": {"httpGet": {"path": "/health", "port": 8000, "scheme": "HTTP"}, "periodSeconds": 5},
            }],
            "restartPolicy": "Always",
            "terminationGracePeriodSeconds": 60,
            "serviceAccountName": "infera-worker",
            "nodeName": "node-1",
        },
        "status": {
            "phase": "Running",
            "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "Initialized", "status": "True"},
                {"type": "ContainersReady", "status": "True"},
                {"type": "Ready", "status": "True"},
            ],
            "hostIP": "10.0.0.1",
            "podIP": ip,
            "podIPs": [{"ip": ip}],
            "startTime": now_rfc3339(),
            "containerStatuses": [{
                "name": "worker", "ready": true, "restartCount": 0, "started": true,
                "image": "infera:latest", "imageID": "", "containerID": "containerd://0",
                "state": {"running": {"startedAt": now_rfc3339()}},
            }],
            "qosClass": "BestEffort",
        },
    })
}

/// The current time as RFC 3339 (UTC, whole seconds), as the API server writes timestamps.
pub(crate) fn now_rfc3339() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let days = i64::try_from(secs / 86_400).unwrap_or(0);
    let rem = secs % 86_400;
    let (year, month, day) = infera_core::clock::civil_from_days(days);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

fn router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/version", get(apis::version))
        .route("/api", get(apis::api_versions))
        .route("/apis", get(apis::api_groups))
        .route("/api/v1", get(apis::core_resources))
        .route("/apis/{group}/{version}", get(apis::group_resources))
        .route("/api/v1/pods", get(list_or_watch_all))
        .route("/api/v1/namespaces/{ns}/pods", get(list_or_watch))
        .route(
            "/api/v1/namespaces/{ns}/pods/{name}",
            get(get_pod).patch(patch_pod),
        )
        .route(
            "/apis/{group}/{version}/namespaces/{ns}/{plural}/{name}",
            get(custom::get_object).patch(custom::patch_object),
        )
        .fallback(not_found)
        .with_state(shared)
}

fn json_response(code: StatusCode, body: &Value) -> Response {
    (
        code,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

fn status_response(status_body: Value) -> Response {
    let code = status_body["code"]
        .as_u64()
        .and_then(|c| u16::try_from(c).ok())
        .and_then(|c| StatusCode::from_u16(c).ok())
        .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    json_response(code, &status_body)
}

/// 403 with the API server's wording, if `verb` on `resource` (API group, plural) is denied.
fn check_rbac(
    shared: &Shared,
    (group, resource): (&str, &str),
    verb: &str,
    namespace: &str,
    name: Option<&str>,
) -> Option<Response> {
    if !shared
        .store()
        .denied
        .contains(&format!("{resource}/{verb}"))
    {
        return None;
    }
    shared.count(|s| s.denied += 1);
    let qualified = if group.is_empty() {
        resource.to_owned()
    } else {
        format!("{resource}.{group}")
    };
    let subject = match name {
        Some(name) => format!("{qualified} {name:?}"),
        None => qualified,
    };
    let message = format!(
        "{subject} is forbidden: User \"system:serviceaccount:{namespace}:infera\" cannot {verb} \
         resource \"{resource}\" in API group \"{group}\" in the namespace \"{namespace}\""
    );
    let mut body = status(403, "Forbidden", &message);
    body["details"] = json!({"kind": resource, "name": name.unwrap_or_default()});
    Some(status_response(body))
}

async fn not_found(uri: axum::http::Uri) -> Response {
    status_response(status(
        404,
        "NotFound",
        &format!(
            "the server could not find the requested resource ({})",
            uri.path()
        ),
    ))
}

async fn list_or_watch(
    State(shared): State<Arc<Shared>>,
    Path(ns): Path<String>,
    Query(query): Query<HashMap<String, String>>,
) -> Response {
    pods_collection(&shared, Some(&ns), &query).await
}

async fn list_or_watch_all(
    State(shared): State<Arc<Shared>>,
    Query(query): Query<HashMap<String, String>>,
) -> Response {
    pods_collection(&shared, None, &query).await
}

async fn pods_collection(
    shared: &Arc<Shared>,
    ns: Option<&str>,
    query: &HashMap<String, String>,
) -> Response {
    let flag = |key: &str| query.get(key).is_some_and(|v| v == "true" || v == "1");
    let watching = flag("watch");
    let verb = if watching { "watch" } else { "list" };
    if let Some(denied) = check_rbac(shared, ("", "pods"), verb, ns.unwrap_or_default(), None) {
        return denied;
    }
    let selector = match Selector::parse(query.get("labelSelector").map_or("", String::as_str)) {
        Ok(selector) => selector,
        Err(message) => return status_response(status(400, "BadRequest", &message)),
    };
    if !watching {
        let list = shared.store().list(ns, &selector);
        shared.count(|s| s.lists += 1);
        return json_response(StatusCode::OK, &list);
    }
    let version = query.get("resourceVersion").cloned();
    let mut gate = shared.watch_gate.subscribe();
    if !*gate.borrow_and_update() {
        shared.count(|s| {
            s.held_watches += 1;
            s.last_watch_version.clone_from(&version);
        });
        let _ = gate.wait_for(|open| *open).await;
    }
    let start = shared.store().watch(
        ns,
        selector,
        query.get("resourceVersion").map(String::as_str),
        flag("allowWatchBookmarks"),
    );
    let start = match start {
        Ok(start) => start,
        Err(status_body) => return status_response(status_body),
    };
    let expired = start.live.is_none();
    shared.count(|s| {
        s.watches += 1;
        s.last_watch_version = version;
        if expired {
            s.expired += 1;
        }
    });
    let timeout = query
        .get("timeoutSeconds")
        .and_then(|t| t.parse::<u64>().ok())
        .map_or(Duration::from_secs(1800), Duration::from_secs);
    let initial = futures::stream::iter(start.initial.into_iter().map(Ok::<Bytes, std::io::Error>));
    let live = futures::stream::unfold(start.live, |live| async move {
        let mut rx = live?;
        let chunk = rx.recv().await?;
        Some((chunk, Some(rx)))
    });
    let body = initial.chain(live).take_until(tokio::time::sleep(timeout));
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from_stream(body))
        .unwrap_or_else(|e| status_response(status(500, "InternalError", &e.to_string())))
}

async fn get_pod(
    State(shared): State<Arc<Shared>>,
    Path((ns, name)): Path<(String, String)>,
) -> Response {
    if let Some(denied) = check_rbac(&shared, ("", "pods"), "get", &ns, Some(&name)) {
        return denied;
    }
    let pod = shared.store().pod(&ns, &name).cloned();
    match pod {
        Some(pod) => {
            shared.count(|s| s.gets += 1);
            json_response(StatusCode::OK, &pod)
        }
        None => pod_not_found(&name),
    }
}

fn pod_not_found(name: &str) -> Response {
    let mut body = status(404, "NotFound", &format!("pods {name:?} not found"));
    body["details"] = json!({"name": name, "kind": "pods"});
    status_response(body)
}

async fn patch_pod(
    State(shared): State<Arc<Shared>>,
    Path((ns, name)): Path<(String, String)>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if let Some(denied) = check_rbac(&shared, ("", "pods"), "patch", &ns, Some(&name)) {
        return denied;
    }
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    let strategic = match content_type {
        "application/merge-patch+json" => false,
        "application/strategic-merge-patch+json" => true,
        other => {
            return status_response(status(
                415,
                "UnsupportedMediaType",
                &format!(
                    "the body of the request was in an unknown format - accepted media types include: application/merge-patch+json, application/strategic-merge-patch+json (got {other:?})"
                ),
            ));
        }
    };
    let patch: Value = match serde_json::from_slice(&body) {
        Ok(patch @ Value::Object(_)) => patch,
        Ok(_) | Err(_) => {
            return status_response(status(400, "BadRequest", "the patch is not a JSON object"));
        }
    };
    if strategic && let Some(directive) = strategic_directive(&patch) {
        return status_response(status(
            400,
            "BadRequest",
            &format!(
                "strategic merge directive {directive:?} is not supported by this test server"
            ),
        ));
    }
    let precondition = patch
        .pointer("/metadata/resourceVersion")
        .and_then(Value::as_str)
        .map(str::to_owned);
    let outcome = {
        let mut store = shared.store();
        match store.pod(&ns, &name) {
            None => None,
            Some(current) => {
                let current_version = current["metadata"]["resourceVersion"]
                    .as_str()
                    .map(str::to_owned);
                if precondition.is_some() && precondition != current_version {
                    Some(Err(status(
                        409,
                        "Conflict",
                        &format!(
                            "Operation cannot be fulfilled on pods {name:?}: the object has been modified; please apply your changes to the latest version and try again"
                        ),
                    )))
                } else {
                    Some(Ok(store.modify(&ns, &name, |pod| merge_patch(pod, &patch))))
                }
            }
        }
    };
    match outcome {
        None | Some(Ok(None)) => pod_not_found(&name),
        Some(Err(conflict)) => status_response(conflict),
        Some(Ok(Some(pod))) => {
            shared.count(|s| s.patches += 1);
            json_response(StatusCode::OK, &pod)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use store::event_line;

    #[test]
    fn timestamps_are_rfc3339() {
        let now = now_rfc3339();
        assert_eq!(now.len(), 20, "{now}");
        assert!(now.starts_with("20") && now.ends_with('Z'), "{now}");
        assert_eq!(&now[10..11], "T");
    }

    #[test]
    fn an_event_line_is_one_json_object_per_line() {
        let line = event_line("ADDED", &json!({"kind": "Pod"}));
        assert!(line.ends_with(b"\n"));
        let parsed: Value = serde_json::from_slice(&line).unwrap();
        assert_eq!(parsed["type"], "ADDED");
    }
}
