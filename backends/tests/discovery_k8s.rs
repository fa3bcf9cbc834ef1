//! The Kubernetes discovery backend: the real `kube` client against the in-process API server of
//! `infera_backends::testing::kube_api`, which speaks the Pod list/watch/patch protocol.
//!
//! The test plays kubelet and controllers through the server's handle (phase, readiness,
//! deletion); disconnects are real (watch connections broken mid-stream, the whole server taken
//! away and back). Every wait is on the discovery stream or on the server's notifications, with a
//! timeout; nothing sleeps to synchronise.

use async_trait::async_trait;
use infera_backends::discovery::kubernetes::{DRAINING_REASON, WORKER_INFO_ANNOTATION};
use infera_backends::discovery::{
    Discovery, DiscoveryChange, DiscoveryError, DiscoveryStream, KubernetesConfig,
    KubernetesDiscovery, KubernetesRegistrar, Registrar, Registration, WatchStats,
};
use infera_backends::testing::kube_api::{KubeApiServer, worker_pod};
use infera_backends::testing::{DiscoveryFixture, discovery_conformance, sample_record};
use infera_core::event::{Engine, Role, WorkerRecord};
use infera_core::ids::WorkerId;
use serde_json::json;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::{Instant, timeout};

const WAIT: Duration = Duration::from_secs(15);
const NAMESPACE: &str = "infera-test";
const SELECTOR: &str = "app=infera-worker";

async fn api_server() -> Arc<KubeApiServer> {
    Arc::new(
        KubeApiServer::start(NAMESPACE)
            .await
            .expect("in-process API server"),
    )
}

/// Fast reconnects, so that tests spend their time on behaviour rather than backoff.
fn config(server: &KubeApiServer) -> KubernetesConfig {
    KubernetesConfig {
        namespace: Some(NAMESPACE.to_owned()),
        request_timeout: Duration::from_secs(5),
        backoff_initial: Duration::from_millis(10),
        backoff_max: Duration::from_millis(200),
        ..KubernetesConfig::new(SELECTOR)
    }
    .with_api_url(&server.url())
    .expect("API URL")
}

fn worker_config(server: &KubeApiServer, pod: &str) -> KubernetesConfig {
    KubernetesConfig {
        pod_name: Some(pod.to_owned()),
        namespace: None,
        own_namespace: Some(NAMESPACE.to_owned()),
        ..config(server)
    }
}

async fn watch(server: &KubeApiServer) -> DiscoveryStream {
    KubernetesDiscovery::connect(config(server))
        .await
        .expect("discovery client")
        .watch()
        .await
        .expect("watch")
}

fn labels() -> serde_json::Value {
    json!({"app": "infera-worker", "engine": "vllm"})
}

/// A Running, Ready worker Pod whose annotation holds `record`.
fn annotated_pod(server: &KubeApiServer, name: &str, record: &WorkerRecord) {
    let mut pod = worker_pod(name, "10.1.0.7", labels());
    pod["metadata"]["annotations"][WORKER_INFO_ANNOTATION] =
        json!(serde_json::to_string(record).expect("record JSON"));
    server.create_pod(pod);
}

async fn next(stream: &mut DiscoveryStream) -> DiscoveryChange {
    timeout(WAIT, stream.recv())
        .await
        .expect("a change within the timeout")
        .expect("stream open")
}

/// Waits until the discovery client has its watch open.
async fn watching(server: &KubeApiServer) {
    server
        .wait_until("an open watch", WAIT, |s| s.open_watches() >= 1)
        .await;
}

fn registered(record: &WorkerRecord) -> DiscoveryChange {
    DiscoveryChange::Registered(record.clone())
}

#[track_caller]
fn assert_left(change: &DiscoveryChange, worker: &str, reason_part: &str) {
    match change {
        DiscoveryChange::Deregistered { worker: w, reason } => {
            assert_eq!(w.as_str(), worker, "{change:?}");
            assert!(
                reason.contains(reason_part),
                "reason {reason:?} lacks {reason_part:?}"
            );
        }
        other => panic!("expected {worker} to leave ({reason_part}), got {other:?}"),
    }
}

#[track_caller]
fn assert_draining(change: &DiscoveryChange, worker: &str) {
    assert_eq!(
        change,
        &DiscoveryChange::Draining {
            worker: WorkerId::new(worker),
            reason: DRAINING_REASON.to_owned(),
        }
    );
}

/// Applies a change to the listed workers (a draining worker stays listed).
fn apply(fleet: &mut HashMap<String, WorkerRecord>, change: DiscoveryChange) {
    match change {
        DiscoveryChange::Registered(record) => {
            fleet.insert(record.worker_id.to_string(), record);
        }
        DiscoveryChange::Deregistered { worker, .. } => {
            fleet.remove(worker.as_str());
        }
        DiscoveryChange::Draining { worker, .. } => {
            assert!(
                fleet.contains_key(worker.as_str()),
                "Draining for {worker}, which is not registered on this stream"
            );
        }
    }
}

/// Applies changes until the fleet equals `expected`.
async fn converge(
    stream: &mut DiscoveryStream,
    fleet: &mut HashMap<String, WorkerRecord>,
    expected: &HashMap<String, WorkerRecord>,
) -> Vec<DiscoveryChange> {
    let deadline = Instant::now() + WAIT;
    let mut seen = Vec::new();
    while fleet != expected {
        assert!(
            Instant::now() < deadline,
            "no convergence: {fleet:?} != {expected:?}"
        );
        let change = next(stream).await;
        seen.push(change.clone());
        apply(fleet, change);
    }
    seen
}

/// Each worker of the suite is its own Pod, as in a cluster: registering creates the Pod (the
/// Deployment's part) and connects a registrar for it from the downward-API settings.
#[derive(Debug)]
struct PodPerWorker {
    server: Arc<KubeApiServer>,
}

fn pod_name_of(worker: &str) -> String {
    worker.replace(':', "-").to_lowercase()
}

impl PodPerWorker {
    fn ensure_pod(&self, worker: &str) -> String {
        let name = pod_name_of(worker);
        if self.server.pod(&name).is_none() {
            self.server
                .create_pod(worker_pod(&name, "10.1.0.9", labels()));
        }
        name
    }
}

#[async_trait]
impl Registrar for PodPerWorker {
    async fn register(&self, record: &WorkerRecord) -> Result<Registration, DiscoveryError> {
        let pod = self.ensure_pod(record.worker_id.as_str());
        let registrar = KubernetesRegistrar::connect(worker_config(&self.server, &pod)).await?;
        registrar.register(record).await
    }
}

struct K8sFixture {
    server: Arc<KubeApiServer>,
}

#[async_trait]
impl DiscoveryFixture for K8sFixture {
    async fn registrar(&self) -> Arc<dyn Registrar> {
        Arc::new(PodPerWorker {
            server: self.server.clone(),
        })
    }

    async fn discovery(&self) -> Arc<dyn Discovery> {
        Arc::new(
            KubernetesDiscovery::connect(config(&self.server))
                .await
                .expect("discovery client"),
        )
    }

    async fn publish_raw(&self, worker: &str, value: &[u8]) {
        let pod = PodPerWorker {
            server: self.server.clone(),
        }
        .ensure_pod(worker);
        let value = String::from_utf8_lossy(value);
        self.server
            .set_annotation(&pod, WORKER_INFO_ANNOTATION, Some(&value))
            .expect("pod");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubernetes_passes_the_discovery_conformance_suite() {
    let server = api_server().await;
    discovery_conformance(&K8sFixture { server }).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_running_ready_annotated_pods_of_the_selector_and_namespace_are_routed() {
    let server = api_server().await;
    let a = sample_record("10.1.0.7:8000");
    annotated_pod(&server, "a", &a);
    // Not routed: another namespace, another app, not yet Running.
    let mut elsewhere = worker_pod("other-ns", "10.1.0.8", labels());
    elsewhere["metadata"]["namespace"] = json!("elsewhere");
    elsewhere["metadata"]["annotations"][WORKER_INFO_ANNOTATION] =
        json!(serde_json::to_string(&sample_record("10.1.0.8:8000")).expect("json"));
    server.create_pod(elsewhere);
    let mut unlabelled = worker_pod("frontend", "10.1.0.9", json!({"app": "frontend"}));
    unlabelled["metadata"]["annotations"][WORKER_INFO_ANNOTATION] =
        json!(serde_json::to_string(&sample_record("10.1.0.9:8000")).expect("json"));
    server.create_pod(unlabelled);
    let b = sample_record("10.1.0.10:8000");
    annotated_pod(&server, "b", &b);
    server.set_phase("b", "Pending");
    server.set_ready("b", false);

    let mut stream = watch(&server).await;
    assert_eq!(next(&mut stream).await, registered(&a), "a is listed first");

    // b's kubelet reports it Running, then Ready: routed only then.
    server.set_phase("b", "Running");
    server.set_ready("b", true);
    assert_eq!(next(&mut stream).await, registered(&b));

    // Readiness flips take it out and back.
    server.set_ready("b", false);
    assert_left(&next(&mut stream).await, "10.1.0.10:8000", "not Ready");
    server.set_ready("b", true);
    assert_eq!(next(&mut stream).await, registered(&b));

    // A Pod relabelled out of the selector leaves (the watch reports it DELETED).
    server.modify_pod("b", |pod| {
        pod["metadata"]["labels"]["app"] = json!("retired")
    });
    assert_left(&next(&mut stream).await, "10.1.0.10:8000", "pod deleted");

    // A failed Pod leaves; a deleted one too.
    server.set_phase("a", "Failed");
    assert_left(&next(&mut stream).await, "10.1.0.7:8000", "Failed");
    server.set_phase("a", "Running");
    assert_eq!(next(&mut stream).await, registered(&a));
    server.delete_pod("a");
    assert_left(&next(&mut stream).await, "10.1.0.7:8000", "pod deleted");
    assert_eq!(WatchStats::get(&stream.stats().invalid_records), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_with_a_deletion_timestamp_drains_once_then_leaves_when_not_ready() {
    let server = api_server().await;
    let mut stream = watch(&server).await;
    let a = sample_record("10.1.0.7:8000");
    annotated_pod(&server, "a", &a);
    assert_eq!(next(&mut stream).await, registered(&a));

    // Still Running and Ready, annotation intact: only the deletionTimestamp is new.
    server.begin_deletion("a", 60);
    assert_draining(&next(&mut stream).await, "10.1.0.7:8000");

    // Status updates and record changes of a draining Pod say nothing more…
    server.modify_pod("a", |pod| {
        pod["status"]["containerStatuses"][0]["restartCount"] = json!(1)
    });
    let mut changed = a.clone();
    changed.model_name = "changed-while-draining".to_owned();
    server.set_annotation(
        "a",
        WORKER_INFO_ANNOTATION,
        Some(&serde_json::to_string(&changed).expect("json")),
    );
    // …until it stops being Ready: then it leaves, once.
    server.set_ready("a", false);
    assert_left(&next(&mut stream).await, "10.1.0.7:8000", "not Ready");
    server.delete_pod("a");
    let sentinel = sample_record("10.1.0.8:8000");
    annotated_pod(&server, "sentinel", &sentinel);
    assert_eq!(
        next(&mut stream).await,
        registered(&sentinel),
        "nothing more about the drained Pod"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_worker_leaves_when_it_removes_its_annotation_or_its_pod_is_deleted() {
    let server = api_server().await;
    let mut stream = watch(&server).await;

    // The usual order in a cluster: the Pod is marked for deletion, the kubelet sends SIGTERM,
    // and the worker removes its own record before it drains.
    server.create_pod(worker_pod("w", "10.1.0.7", labels()));
    let registrar = KubernetesRegistrar::connect(worker_config(&server, "w"))
        .await
        .expect("registrar");
    let record = sample_record("10.1.0.7:8000");
    let registration = registrar.register(&record).await.expect("register");
    assert_eq!(next(&mut stream).await, registered(&record));
    server.begin_deletion("w", 30);
    assert_draining(&next(&mut stream).await, "10.1.0.7:8000");
    registration.deregister().await.expect("deregister");
    assert_left(&next(&mut stream).await, "10.1.0.7:8000", "absent");

    // Deleted outright while draining (grace period over): it leaves as deleted.
    let b = sample_record("10.1.0.8:8000");
    annotated_pod(&server, "b", &b);
    assert_eq!(next(&mut stream).await, registered(&b));
    server.begin_deletion("b", 0);
    assert_draining(&next(&mut stream).await, "10.1.0.8:8000");
    server.delete_pod("b");
    assert_left(&next(&mut stream).await, "10.1.0.8:8000", "pod deleted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_already_being_deleted_is_never_routed() {
    let server = api_server().await;
    let listed = sample_record("10.1.0.7:8000");
    annotated_pod(&server, "listed", &listed);
    server.begin_deletion("listed", 60);
    let mut stream = watch(&server).await;

    // Neither from the list nor from a watch event.
    let watched = sample_record("10.1.0.8:8000");
    let mut pod = worker_pod("watched", "10.1.0.8", labels());
    pod["metadata"]["annotations"][WORKER_INFO_ANNOTATION] =
        json!(serde_json::to_string(&watched).expect("json"));
    pod["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
    server.create_pod(pod);
    server.delete_pod("listed");
    server.delete_pod("watched");
    let sentinel = sample_record("10.1.0.9:8000");
    annotated_pod(&server, "sentinel", &sentinel);
    assert_eq!(
        next(&mut stream).await,
        registered(&sentinel),
        "Pods being deleted are neither registered, drained nor deregistered"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_that_began_while_disconnected_is_reported_by_the_relist() {
    let server = api_server().await;
    let a = sample_record("10.1.0.7:8000");
    let b = sample_record("10.1.0.8:8000");
    annotated_pod(&server, "a", &a);
    annotated_pod(&server, "b", &b);
    let mut stream = watch(&server).await;
    let mut fleet = HashMap::new();
    let both: HashMap<String, WorkerRecord> = [
        (a.worker_id.to_string(), a.clone()),
        (b.worker_id.to_string(), b.clone()),
    ]
    .into();
    converge(&mut stream, &mut fleet, &both).await;
    watching(&server).await;

    server.hold_watches();
    server.drop_watches();
    server
        .wait_until("the client watching again", WAIT, |s| {
            s.stats().held_watches >= 1
        })
        .await;
    server.begin_deletion("a", 60);
    server.compact();
    server.release_watches();

    assert_draining(&next(&mut stream).await, "10.1.0.7:8000");
    assert!(WatchStats::get(&stream.stats().relists) >= 1);
    // And it leaves on the watch that follows the list.
    server.delete_pod("a");
    assert_left(&next(&mut stream).await, "10.1.0.7:8000", "pod deleted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn annotation_changes_update_remove_and_invalidate_workers() {
    let server = api_server().await;
    let mut stream = watch(&server).await;
    let a = sample_record("10.1.0.7:8000");
    annotated_pod(&server, "a", &a);
    assert_eq!(next(&mut stream).await, registered(&a));

    // Status-only changes of a routed Pod are not repeated.
    server.modify_pod("a", |pod| {
        pod["status"]["containerStatuses"][0]["restartCount"] = json!(1)
    });
    let mut changed = a.clone();
    changed.model_name = "changed".to_owned();
    server.set_annotation(
        "a",
        WORKER_INFO_ANNOTATION,
        Some(&serde_json::to_string(&changed).expect("json")),
    );
    assert_eq!(next(&mut stream).await, registered(&changed));

    // The annotation removed (kubectl annotate pod a infera.amd.com/worker-info-).
    server.set_annotation("a", WORKER_INFO_ANNOTATION, None);
    assert_left(&next(&mut stream).await, "10.1.0.7:8000", "absent");
    server.set_annotation(
        "a",
        WORKER_INFO_ANNOTATION,
        Some(&serde_json::to_string(&a).expect("json")),
    );
    assert_eq!(next(&mut stream).await, registered(&a));

    // Garbage leaves routing and is counted once, not on every status update.
    server.set_annotation("a", WORKER_INFO_ANNOTATION, Some("{\"worker_id\": 1"));
    assert_left(&next(&mut stream).await, "10.1.0.7:8000", "invalid");
    server.set_ready("a", false);
    server.set_ready("a", true);
    let b = sample_record("10.1.0.8:8000");
    annotated_pod(&server, "b", &b);
    assert_eq!(next(&mut stream).await, registered(&b));
    assert_eq!(WatchStats::get(&stream.stats().invalid_records), 1);

    // A second Pod claiming b's worker id is a conflict: it waits and takes over when b leaves.
    annotated_pod(&server, "b-twin", &b);
    server.delete_pod("b");
    assert_left(&next(&mut stream).await, "10.1.0.8:8000", "pod deleted");
    assert_eq!(
        next(&mut stream).await,
        registered(&b),
        "the twin takes over"
    );
    assert_eq!(WatchStats::get(&stream.stats().invalid_records), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_records_in_the_annotation_are_routed() {
    let server = api_server().await;
    let python = json!({
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
        "request_transport": "nats",
        "kv": {"tokenizer_canary": "abc123"},
    });
    let mut pod = worker_pod("python-worker", "10.0.0.5", labels());
    pod["metadata"]["annotations"][WORKER_INFO_ANNOTATION] = json!(python.to_string());
    server.create_pod(pod);
    let mut stream = watch(&server).await;
    let DiscoveryChange::Registered(record) = next(&mut stream).await else {
        panic!("expected the Python worker");
    };
    assert_eq!(record.worker_id.as_str(), "10.0.0.5:8000");
    assert_eq!(record.engine, Engine::Sglang);
    assert_eq!(record.disagg_mode, Role::Mixed);
    assert_eq!((record.dp_rank, record.dp_size), (0, 1));
    assert!(record.kv.is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_watch_resumes_from_its_version_without_missing_changes() {
    let server = api_server().await;
    let a = sample_record("10.1.0.7:8000");
    annotated_pod(&server, "a", &a);
    let mut stream = watch(&server).await;
    assert_eq!(next(&mut stream).await, registered(&a));

    // The connection breaks; changes made before the client watches again are replayed.
    watching(&server).await;
    server.hold_watches();
    assert_eq!(server.drop_watches(), 1);
    server
        .wait_until("the client watching again", WAIT, |s| {
            s.stats().held_watches >= 1
        })
        .await;
    let b = sample_record("10.1.0.8:8000");
    annotated_pod(&server, "b", &b);
    server.delete_pod("a");
    server.release_watches();

    assert_eq!(next(&mut stream).await, registered(&b));
    assert_left(&next(&mut stream).await, "10.1.0.7:8000", "pod deleted");
    let stats = stream.stats();
    assert!(WatchStats::get(&stats.reconnects) >= 1);
    assert_eq!(
        WatchStats::get(&stats.relists),
        0,
        "a resumable watch resumes, it does not list again"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_410_gone_relists_and_routes_no_stale_worker() {
    let server = api_server().await;
    let a = sample_record("10.1.0.7:8000");
    let b = sample_record("10.1.0.8:8000");
    annotated_pod(&server, "a", &a);
    annotated_pod(&server, "b", &b);
    let mut stream = watch(&server).await;
    let mut fleet = HashMap::new();
    converge(
        &mut stream,
        &mut fleet,
        &[
            (a.worker_id.to_string(), a.clone()),
            (b.worker_id.to_string(), b.clone()),
        ]
        .into(),
    )
    .await;
    let lists_before = server.stats().lists;
    watching(&server).await;

    // While the client is between watches: a is deleted, b changes, c appears, history is
    // compacted, so its resume version is gone.
    server.hold_watches();
    server.drop_watches();
    server
        .wait_until("the client watching again", WAIT, |s| {
            s.stats().held_watches >= 1
        })
        .await;
    server.delete_pod("a");
    let mut b_v2 = b.clone();
    b_v2.model_name = "changed-while-disconnected".to_owned();
    server.set_annotation(
        "b",
        WORKER_INFO_ANNOTATION,
        Some(&serde_json::to_string(&b_v2).expect("json")),
    );
    let c = sample_record("10.1.0.9:8000");
    annotated_pod(&server, "c", &c);
    server.compact();
    server.release_watches();

    let expected: HashMap<String, WorkerRecord> = [
        (b.worker_id.to_string(), b_v2.clone()),
        (c.worker_id.to_string(), c.clone()),
    ]
    .into();
    let seen = converge(&mut stream, &mut fleet, &expected).await;
    assert!(
        seen.iter().any(|change| matches!(change,
            DiscoveryChange::Deregistered { worker, reason }
                if worker.as_str() == "10.1.0.7:8000" && reason.contains("listed again"))),
        "the vanished worker is deregistered by the re-list: {seen:?}"
    );
    assert!(server.stats().expired >= 1, "the server answered 410");
    assert!(
        server.stats().lists > lists_before,
        "the client listed again"
    );
    assert!(WatchStats::get(&stream.stats().relists) >= 1);

    // And the watch goes on from the new list.
    server.delete_pod("c");
    assert_left(&next(&mut stream).await, "10.1.0.9:8000", "pod deleted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_watch_survives_an_api_server_outage() {
    let server = api_server().await;
    let a = sample_record("10.1.0.7:8000");
    annotated_pod(&server, "a", &a);
    let mut stream = watch(&server).await;
    assert_eq!(next(&mut stream).await, registered(&a));
    watching(&server).await;

    server.stop().await;
    server.delete_pod("a");
    let b = sample_record("10.1.0.8:8000");
    annotated_pod(&server, "b", &b);
    server.restart().await.expect("restart on the same port");

    let mut fleet = HashMap::from([(a.worker_id.to_string(), a.clone())]);
    converge(
        &mut stream,
        &mut fleet,
        &[(b.worker_id.to_string(), b.clone())].into(),
    )
    .await;
    assert!(WatchStats::get(&stream.stats().reconnects) >= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_watch_request_lists_again_after_a_backoff() {
    let server = api_server().await;
    let a = sample_record("10.1.0.7:8000");
    annotated_pod(&server, "a", &a);
    let mut stream = watch(&server).await;
    assert_eq!(next(&mut stream).await, registered(&a));
    watching(&server).await;

    // The watch is cut and refused from now on (as while a Role is being fixed); listing works.
    server.deny("watch");
    server.end_watches();
    server
        .wait_until("a refused watch", WAIT, |s| s.stats().denied >= 1)
        .await;
    server.delete_pod("a");
    let b = sample_record("10.1.0.8:8000");
    annotated_pod(&server, "b", &b);
    let mut fleet = HashMap::from([(a.worker_id.to_string(), a.clone())]);
    let seen = converge(
        &mut stream,
        &mut fleet,
        &[(b.worker_id.to_string(), b.clone())].into(),
    )
    .await;
    assert!(
        seen.iter().all(|c| !matches!(c, DiscoveryChange::Deregistered { reason, .. } if reason == "pod deleted")),
        "the changes were learnt from a re-list, not from a watch: {seen:?}"
    );
    assert!(WatchStats::get(&stream.stats().relists) >= 1);

    // Once allowed again, the watch resumes its work.
    server.allow("watch");
    watching(&server).await;
    server.delete_pod("b");
    assert_left(&next(&mut stream).await, "10.1.0.8:8000", "pod deleted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bookmarks_move_the_resume_version_forward() {
    let server = api_server().await;
    let a = sample_record("10.1.0.7:8000");
    annotated_pod(&server, "a", &a);
    let mut stream = watch(&server).await;
    assert_eq!(next(&mut stream).await, registered(&a));
    let listed_at = server.stats().revision;

    // Changes outside the selector move the store on without an event for this watch.
    server.create_pod(worker_pod(
        "frontend",
        "10.1.0.20",
        json!({"app": "frontend"}),
    ));
    server.set_ready("frontend", false);
    let now = server.stats().revision;
    assert!(now > listed_at);
    watching(&server).await;
    server.send_bookmarks();
    server.hold_watches();
    // The bookmark is delivered before the break: both go through the same connection in order.
    server.end_watches();
    server
        .wait_until("the client watching again", WAIT, |s| {
            s.stats().held_watches >= 1
        })
        .await;
    assert_eq!(
        server.stats().last_watch_version,
        Some(now.to_string()),
        "the client resumes from the bookmark's version"
    );
    server.release_watches();
    server.delete_pod("a");
    assert_left(&next(&mut stream).await, "10.1.0.7:8000", "pod deleted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rbac_denials_name_the_verb_and_the_resource() {
    let server = api_server().await;
    server.deny("list");
    let discovery = KubernetesDiscovery::connect(config(&server))
        .await
        .expect("client");
    let err = discovery.watch().await.expect_err("list is denied");
    assert!(
        matches!(err, DiscoveryError::Rejected { .. }) && !err.is_retryable(),
        "{err}"
    );
    let text = err.to_string();
    for part in ["verb \"list\"", "\"pods\"", NAMESPACE, "rbac.yaml"] {
        assert!(text.contains(part), "{text:?} lacks {part:?}");
    }
    server.allow("list");

    server.create_pod(worker_pod("w", "10.1.0.7", labels()));
    server.deny("get");
    let err = KubernetesRegistrar::connect(worker_config(&server, "w"))
        .await
        .expect_err("get is denied");
    assert!(err.to_string().contains("verb \"get\""), "{err}");
    server.allow("get");

    server.deny("patch");
    let registrar = KubernetesRegistrar::connect(worker_config(&server, "w"))
        .await
        .expect("get is allowed");
    let err = registrar
        .register(&sample_record("10.1.0.7:8000"))
        .await
        .expect_err("patch is denied");
    assert!(!err.is_retryable());
    assert!(err.to_string().contains("verb \"patch\""), "{err}");
    assert!(server.stats().denied >= 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registrar_startup_errors_say_what_is_missing() {
    let server = api_server().await;
    let outside_a_pod = KubernetesConfig {
        pod_name: None,
        ..config(&server)
    };
    let err = KubernetesRegistrar::connect(outside_a_pod)
        .await
        .expect_err("no POD_NAME");
    assert!(matches!(err, DiscoveryError::InvalidConfig(_)), "{err}");
    assert!(err.to_string().contains("POD_NAME"), "{err}");

    let err = KubernetesRegistrar::connect(worker_config(&server, "no-such-pod"))
        .await
        .expect_err("the Pod does not exist");
    assert!(!err.is_retryable());
    assert!(
        err.to_string().contains("no-such-pod") && err.to_string().contains("POD_NAME"),
        "{err}"
    );

    // A port that was free a moment ago: nothing listens there.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("probe socket");
    let url = format!("http://{}", closed.local_addr().expect("addr"));
    drop(closed);
    let unreachable = KubernetesConfig {
        pod_name: Some("w".to_owned()),
        ..KubernetesConfig::new(SELECTOR)
            .with_api_url(&url)
            .expect("url")
    };
    let err = KubernetesRegistrar::connect(unreachable)
        .await
        .expect_err("nothing listens");
    assert!(err.is_retryable(), "{err}");
    assert!(
        err.to_string()
            .contains("cannot reach the Kubernetes API server"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_registrar_patches_reasserts_and_removes_its_annotation() {
    let server = api_server().await;
    let mut pod = worker_pod("w", "10.1.0.7", labels());
    pod["metadata"]["annotations"][WORKER_INFO_ANNOTATION] = json!("{\"stale\": true}");
    server.create_pod(pod);
    let config = KubernetesConfig {
        refresh_interval: Duration::from_millis(50),
        ..worker_config(&server, "w")
    };
    let registrar = KubernetesRegistrar::connect(config).await.expect("connect");
    assert_eq!((registrar.pod(), registrar.namespace()), ("w", NAMESPACE));
    assert_eq!(
        server.annotation("w", WORKER_INFO_ANNOTATION),
        None,
        "a record left by an earlier container is cleared at start"
    );

    let record = sample_record("10.1.0.7:8000");
    let registration = registrar.register(&record).await.expect("register");
    let stored = server
        .annotation("w", WORKER_INFO_ANNOTATION)
        .expect("annotation set");
    let stored: serde_json::Value = serde_json::from_str(&stored).expect("JSON record");
    assert_eq!(stored, serde_json::to_value(&record).expect("json"));
    for field in [
        "worker_id",
        "url",
        "model_name",
        "engine",
        "kv_block_size",
        "request_transport",
    ] {
        assert!(stored.get(field).is_some(), "missing {field}");
    }

    // One Pod, one worker.
    let err = registrar
        .register(&sample_record("10.1.0.7:9000"))
        .await
        .expect_err("a second worker on the same Pod");
    assert!(matches!(err, DiscoveryError::InvalidRecord { .. }), "{err}");

    // Stripped behind its back, the record comes back at the next refresh.
    server.set_annotation("w", WORKER_INFO_ANNOTATION, None);
    server
        .wait_until("the annotation re-asserted", WAIT, |s| {
            s.annotation("w", WORKER_INFO_ANNOTATION).is_some()
        })
        .await;

    let mut updated = record.clone();
    updated.model_name = "v2".to_owned();
    registration.update(&updated).await.expect("update");
    let stored = server.annotation("w", WORKER_INFO_ANNOTATION).expect("set");
    assert!(stored.contains("\"v2\""), "{stored}");

    registration.deregister().await.expect("deregister");
    assert_eq!(server.annotation("w", WORKER_INFO_ANNOTATION), None);

    // The Pod is free again for this process's next registration.
    let again = registrar.register(&updated).await.expect("register again");
    again.deregister().await.expect("deregister again");
    assert_eq!(server.annotation("w", WORKER_INFO_ANNOTATION), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_pod_leaves_routing_within_a_second() {
    let server = api_server().await;
    let mut stream = watch(&server).await;
    let mut latencies = Vec::new();
    for i in 0..50u32 {
        let record = sample_record(&format!("10.2.0.{i}:8000"));
        let name = format!("w-{i}");
        annotated_pod(&server, &name, &record);
        assert_eq!(next(&mut stream).await, registered(&record));
        let deleted_at = Instant::now();
        server.delete_pod(&name);
        assert_left(
            &next(&mut stream).await,
            record.worker_id.as_str(),
            "pod deleted",
        );
        latencies.push(deleted_at.elapsed());
    }
    latencies.sort();
    let p50 = latencies[latencies.len() / 2];
    let p99 = latencies[latencies.len() * 99 / 100];
    let max = latencies[latencies.len() - 1];
    println!(
        "DELETED → Deregistered over {} pods: p50 {p50:?}, p99 {p99:?}, max {max:?}",
        latencies.len()
    );
    assert!(
        max <= Duration::from_secs(1),
        "a deletion took {max:?} to leave routing"
    );
}
