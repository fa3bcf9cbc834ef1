//! `infera server` and `infera worker mock` end to end with Kubernetes discovery: the real
//! binaries talk to the in-process API server of `infera_backends::testing::kube_api` through a
//! throwaway kubeconfig (`KUBECONFIG`), as they would to a cluster's.
//!
//! The test plays the Deployment and the kubelet through the API server's handle: it creates the
//! worker Pods (Running, Ready, labelled), gives each worker process its Pod's downward-API
//! environment (`POD_NAME`, `POD_NAMESPACE`, `POD_IP`), marks a Pod for deletion, deletes one.
//! The workers patch their own Pod's annotation; the server watches the Pods, subscribes to the
//! workers' ZeroMQ KV events and routes through them.
//!
//! The server and workers are other processes, so convergence is observed through the server's
//! status pages and the API server's state, polled under a deadline.
#![allow(clippy::unwrap_used)]

mod common;

use common::{
    DEADLINE, Proc, eventually, free_mock_port, free_port, get_json, http, tokenizer_dir,
};

use infera_backends::discovery::kubernetes::{DEPLOYMENT_LABEL, WORKER_INFO_ANNOTATION};
use infera_backends::testing::kube_api::{KubeApiServer, worker_pod};
use serde_json::{Value, json};
use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const NAMESPACE: &str = "infera-e2e";
const SELECTOR: &str = "app=infera-worker";

/// The server's `active_workers` (routable workers), `None` while it does not answer.
fn active_workers(server: u16) -> Option<u64> {
    get_json(server, "/health")?["active_workers"].as_u64()
}

/// `/v1/workers` as worker id → (draining, GPU-cached blocks of rank 0).
fn listed_workers(server: u16) -> Vec<(String, bool, u64)> {
    let Some(workers) = get_json(server, "/v1/workers") else {
        return Vec::new();
    };
    let mut out: Vec<(String, bool, u64)> = workers["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| {
            (
                w["record"]["worker_id"].as_str().unwrap().to_owned(),
                w["draining"].as_bool().expect("draining is a boolean"),
                w["load"][0]["cached_blocks"].as_u64().unwrap_or(0),
            )
        })
        .collect();
    out.sort();
    out
}

/// Requests the mock at `port` accepted (its own `/metrics`).
fn mock_requests(port: u16) -> u64 {
    let (_, text) = http(port, "GET", "/metrics", "").expect("mock metrics");
    text.lines()
        .find(|l| l.starts_with("infera_mock_requests_total{"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse::<f64>().ok())
        .map(|v| v as u64)
        .expect("infera_mock_requests_total")
}

fn completion(server: u16, model: &str, prompt: &str) -> Value {
    let req = json!({"model": model, "prompt": prompt, "max_tokens": 2}).to_string();
    let (status, body) = http(server, "POST", "/v1/completions", &req).expect("server answers");
    assert_eq!(status, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

/// A kubeconfig whose current context is the API server at `url`, in [`NAMESPACE`].
fn write_kubeconfig(dir: &Path, url: &str) -> PathBuf {
    let path = dir.join("kubeconfig");
    std::fs::write(
        &path,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: e2e\n  cluster:\n    server: {url}\n\
             contexts:\n- name: e2e\n  context:\n    cluster: e2e\n    user: e2e\n    \
             namespace: {NAMESPACE}\ncurrent-context: e2e\nusers:\n- name: e2e\n  user: {{}}\n"
        ),
    )
    .unwrap();
    path
}

/// The in-process API server, on a runtime of its own: the test thread blocks on processes
/// and HTTP while the API server keeps answering them.
struct Api {
    server: Option<KubeApiServer>,
    runtime: tokio::runtime::Runtime,
}

impl Api {
    fn start() -> Self {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let server = runtime
            .block_on(KubeApiServer::start(NAMESPACE))
            .expect("in-process API server");
        Self {
            server: Some(server),
            runtime,
        }
    }

    fn server(&self) -> &KubeApiServer {
        self.server.as_ref().unwrap()
    }
}

impl Drop for Api {
    fn drop(&mut self) {
        // Stop serving inside the runtime, before the runtime goes.
        let _guard = self.runtime.enter();
        self.server.take();
    }
}

/// `infera worker mock` in Pod `pod`, on `0.0.0.0:port`: under Kubernetes discovery it
/// advertises its `POD_IP`.
fn mock_worker(kubeconfig: &Path, pod: &str, port: u16, stderr: Stdio) -> Proc {
    let tok = tokenizer_dir();
    Proc(
        Command::new(env!("CARGO_BIN_EXE_infera"))
            .args(["worker", "mock", "--model-path", &tok, "--host", "0.0.0.0"])
            .args(["--port", &port.to_string(), "--block-size", "16"])
            .args(["--speedup", "1000"])
            .args(["--discovery-backend", "kubernetes"])
            .args(["--request-transport", "http", "--kv-event-transport", "zmq"])
            .env("KUBECONFIG", kubeconfig)
            .env("POD_NAME", pod)
            .env("POD_NAMESPACE", NAMESPACE)
            .env("POD_IP", "127.0.0.1")
            .env_remove("KUBERNETES_SERVICE_HOST")
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .unwrap(),
    )
}

/// `infera server` under Kubernetes discovery of [`SELECTOR`] in [`NAMESPACE`], running as Pod
/// `pod` (its downward-API environment), with `extra` flags.
fn k8s_server(kubeconfig: &Path, port: u16, pod: &str, extra: &[&str]) -> Proc {
    let tok = tokenizer_dir();
    Proc(
        Command::new(env!("CARGO_BIN_EXE_infera"))
            .args(["server", "--router-tokenizer-path", &tok])
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["--discovery-backend", "kubernetes"])
            .args([
                "--k8s-namespace",
                NAMESPACE,
                "--k8s-label-selector",
                SELECTOR,
            ])
            .args(["--request-transport", "http", "--kv-event-transport", "zmq"])
            .args(extra)
            .env("KUBECONFIG", kubeconfig)
            .env("POD_NAME", pod)
            .env("POD_NAMESPACE", NAMESPACE)
            .env_remove("KUBERNETES_SERVICE_HOST")
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    )
}

fn labels() -> Value {
    json!({"app": "infera-worker", "engine": "mock"})
}

#[test]
fn workers_in_pods_register_drain_leave_and_deregister_through_the_kubernetes_api() {
    let api = Api::start();
    let k8s = api.server();
    let home = tempfile::tempdir().unwrap();
    let kubeconfig = write_kubeconfig(home.path(), &k8s.url());
    let tok = tokenizer_dir();

    // The Deployment's three Pods, scheduled and Ready, not yet annotated; and a Pod the
    // selector leaves out.
    let pods = ["worker-a", "worker-b", "worker-c"];
    for (i, pod) in pods.iter().enumerate() {
        k8s.create_pod(worker_pod(pod, &format!("10.4.0.{}", i + 1), labels()));
    }
    k8s.create_pod(worker_pod(
        "frontend",
        "10.4.0.9",
        json!({"app": "frontend"}),
    ));

    let server_port = free_port();
    let mut server = k8s_server(&kubeconfig, server_port, "infera-router-0", &[]);
    eventually("the server to serve", || {
        active_workers(server_port).is_some()
    });
    let (status, body) = http(server_port, "GET", "/v1/admin/scale", "").unwrap();
    assert_eq!(status, 403, "{body}");
    let body: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        body["detail"],
        json!("scaling API disabled; start the server with --enable-scaling-api")
    );
    assert_eq!(
        active_workers(server_port),
        Some(0),
        "Pods without the annotation are not routed"
    );

    let mut ports: Vec<u16> = Vec::new();
    for _ in &pods {
        let port = free_mock_port();
        ports.push(port);
    }
    let mut workers: Vec<Proc> = pods
        .iter()
        .zip(&ports)
        .map(|(pod, port)| mock_worker(&kubeconfig, pod, *port, Stdio::null()))
        .collect();
    let ids: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();

    // Each worker patches its own Pod's annotation with its record (advertising the Pod IP),
    // and all three enter routing.
    eventually("every Pod annotated by its worker", || {
        pods.iter()
            .all(|pod| k8s.annotation(pod, WORKER_INFO_ANNOTATION).is_some())
    });
    for (pod, id) in pods.iter().zip(&ids) {
        let raw = k8s.annotation(pod, WORKER_INFO_ANNOTATION).unwrap();
        let record: Value = serde_json::from_str(&raw).unwrap();
        assert_eq!(record["worker_id"], json!(id), "{pod}: {record}");
        assert_eq!(record["url"], json!(format!("http://{id}")), "{pod}");
    }
    eventually("the three workers to be routed to", || {
        active_workers(server_port) == Some(3)
    });
    let listed = listed_workers(server_port);
    let mut expected: Vec<(String, bool)> = ids.iter().map(|id| (id.clone(), false)).collect();
    expected.sort();
    assert_eq!(
        listed
            .iter()
            .map(|(id, draining, _)| (id.clone(), *draining))
            .collect::<Vec<_>>(),
        expected
    );

    // Completions through the server succeed.
    for i in 0..6 {
        let reply = completion(server_port, &tok, &format!("short prompt number {i}"));
        assert!(reply["choices"][0]["text"].is_string(), "{reply}");
    }

    // A long prompt, twice: its blocks reach the server's index over ZeroMQ after the first
    // run, and the second run is routed to them.
    let mut long = String::from("k8s e2e:");
    for i in 0..300 {
        long.push_str(&format!(" word{}", i % 89));
    }
    completion(server_port, &tok, &long);
    let mut hot = String::new();
    eventually(
        "the long prompt's blocks in the server's index",
        || match listed_workers(server_port)
            .into_iter()
            .find(|(_, _, cached)| *cached > 10)
        {
            Some((id, _, _)) => {
                hot = id;
                true
            }
            None => false,
        },
    );
    let again = completion(server_port, &tok, &long);
    assert!(
        again["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64() > Some(0),
        "the repeated prompt hits the cache: {again}"
    );

    // The Pod of the worker that holds the prompt's cache is marked for deletion: it drains.
    let hot_at = ids.iter().position(|id| *id == hot).unwrap();
    k8s.begin_deletion(pods[hot_at], 60);
    eventually("the deleted Pod's worker to drain", || {
        active_workers(server_port) == Some(2)
    });
    let listed = listed_workers(server_port);
    assert_eq!(
        listed.len(),
        3,
        "a draining worker stays listed: {listed:?}"
    );
    for (id, draining, _) in &listed {
        assert_eq!(*draining, *id == hot, "{id} in {listed:?}");
    }
    // No request reaches it, not even the one whose prefix it caches.
    let before: Vec<u64> = ports.iter().map(|p| mock_requests(*p)).collect();
    completion(server_port, &tok, &long);
    for i in 0..8 {
        completion(server_port, &tok, &format!("after the drain {i}"));
    }
    let after: Vec<u64> = ports.iter().map(|p| mock_requests(*p)).collect();
    assert_eq!(
        after[hot_at], before[hot_at],
        "a draining worker is never routed to"
    );
    let served: u64 = after.iter().sum::<u64>() - before.iter().sum::<u64>();
    assert_eq!(served, 9, "every request served by the others");

    // Deleting a routed worker's Pod takes it out of routing; time it.
    let deleted_at = (0..3).find(|i| *i != hot_at).unwrap();
    let start = Instant::now();
    k8s.delete_pod(pods[deleted_at]).expect("the Pod existed");
    while active_workers(server_port) != Some(1) {
        assert!(
            start.elapsed() < DEADLINE,
            "the deleted Pod is still routed"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let left = start.elapsed();
    println!("Pod DELETE → worker out of routing (/health): {left:?}");
    assert!(left < Duration::from_secs(2), "took {left:?}");
    assert!(
        listed_workers(server_port)
            .iter()
            .all(|(id, _, _)| *id != ids[deleted_at]),
        "a deleted Pod's worker is no longer listed"
    );

    // SIGTERM on the last routed worker: it removes its annotation first, then exits 0.
    let last = (0..3).find(|i| *i != hot_at && *i != deleted_at).unwrap();
    let status = workers[last].terminate();
    assert!(status.success(), "worker exit: {status:?}");
    assert_eq!(
        k8s.annotation(pods[last], WORKER_INFO_ANNOTATION),
        None,
        "the record is removed before the worker exits"
    );
    assert!(k8s.pod(pods[last]).is_some(), "only the annotation goes");
    eventually("the terminated worker to leave", || {
        active_workers(server_port) == Some(0)
    });
    assert_eq!(
        listed_workers(server_port)
            .iter()
            .map(|(id, draining, _)| (id.clone(), *draining))
            .collect::<Vec<_>>(),
        vec![(hot.clone(), true)],
        "only the draining worker is left listed"
    );
    // With no routable worker, the model's requests are refused, not sent to the draining one.
    let req = json!({"model": tok, "prompt": "nobody routable", "max_tokens": 2}).to_string();
    let (status, body) = http(server_port, "POST", "/v1/completions", &req).unwrap();
    assert!(status >= 500, "{status}: {body}");
    assert_eq!(mock_requests(ports[hot_at]), after[hot_at]);

    // The draining Pod's deletion completes: its worker leaves the list too.
    k8s.delete_pod(pods[hot_at]).expect("the Pod existed");
    eventually("the drained worker to leave the list", || {
        get_json(server_port, "/v1/workers")
            .is_some_and(|w| w["data"].as_array().is_some_and(Vec::is_empty))
    });

    let status = server.terminate();
    assert!(status.success(), "server exit: {status:?}");
}

#[test]
fn a_worker_refused_the_patch_verb_exits_1_naming_the_verb_and_the_resource() {
    let api = Api::start();
    let k8s = api.server();
    let home = tempfile::tempdir().unwrap();
    let kubeconfig = write_kubeconfig(home.path(), &k8s.url());
    k8s.create_pod(worker_pod("worker-rbac", "10.4.0.7", labels()));
    k8s.deny("patch");

    let port = free_mock_port();
    let mut worker = mock_worker(&kubeconfig, "worker-rbac", port, Stdio::piped());
    let mut stderr = String::new();
    worker
        .0
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    let status = worker.0.wait().unwrap();
    assert_eq!(status.code(), Some(1), "{stderr}");
    let errors: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("infera worker: error:"))
        .collect();
    assert_eq!(errors.len(), 1, "one error line: {stderr}");
    let line = errors[0];
    println!("{line}");
    for part in [
        "forbidden",
        "verb \"patch\"",
        "resource \"pods\"",
        NAMESPACE,
        "rbac.yaml",
    ] {
        assert!(line.contains(part), "{line:?} lacks {part:?}");
    }
    assert!(k8s.stats().denied >= 1);
    assert_eq!(k8s.annotation("worker-rbac", WORKER_INFO_ANNOTATION), None);
}

#[test]
fn the_scaling_api_resizes_the_inferadeployment_of_the_servers_own_pod() {
    let api = Api::start();
    let k8s = api.server();
    let home = tempfile::tempdir().unwrap();
    let kubeconfig = write_kubeconfig(home.path(), &k8s.url());
    let router_labels = json!({"app": "infera-router", DEPLOYMENT_LABEL: "qwen"});
    k8s.create_pod(worker_pod("infera-router-0", "10.4.0.20", router_labels));
    k8s.put_custom(
        "inferadeployments",
        json!({
            "apiVersion": "infera.amd.com/v1alpha1", "kind": "InferaDeployment",
            "metadata": {"name": "qwen"},
            "spec": {"services": {
                "prefill": {"role": "prefill", "replicas": 2},
                "decode": {"role": "decode", "replicas": 4, "numberOfNodes": 2},
            }},
            "status": {"state": "Ready", "services": {
                "prefill": {"replicas": 2, "readyReplicas": 2},
                "decode": {"replicas": 4, "readyReplicas": 4},
            }},
        }),
    );
    let port = free_port();
    let _server = k8s_server(
        &kubeconfig,
        port,
        "infera-router-0",
        &["--enable-scaling-api"],
    );
    eventually("the server to serve", || active_workers(port).is_some());

    let (status, body) = http(port, "GET", "/v1/admin/scale", "").unwrap();
    assert_eq!(status, 200, "{body}");
    let snapshot: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        snapshot,
        json!({"deployment": "qwen", "namespace": NAMESPACE, "state": "Ready", "services": {
            "decode": {"role": "decode", "replicas": 4, "current_replicas": 4,
                       "ready_replicas": 4, "nodes_per_replica": 2},
            "prefill": {"role": "prefill", "replicas": 2, "current_replicas": 2,
                        "ready_replicas": 2, "nodes_per_replica": 1},
        }})
    );

    let resize = r#"{"services": {"prefill": {"replicas": 3}, "decode": 6}}"#;
    let (status, body) = http(port, "POST", "/v1/admin/scale", resize).unwrap();
    assert_eq!(status, 200, "{body}");
    let after: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(after["services"]["prefill"]["replicas"], json!(3));
    assert_eq!(after["services"]["decode"]["replicas"], json!(6));
    let patch =
        json!({"spec": {"services": {"decode": {"replicas": 6}, "prefill": {"replicas": 3}}}});
    assert_eq!(k8s.stats().custom_patches, vec![patch.clone()]);

    // Refusals carry the OpenAI-style error and the Python Infera's `detail`; nothing is written.
    let refusals = [
        (
            r#"{"services": {"decode": 0}}"#,
            400,
            "BadRequestError",
            "refusing to scale to 0",
        ),
        ("not json", 400, "BadRequestError", "body must be JSON"),
        (
            r#"{"services": {"router": 2}}"#,
            400,
            "BadRequestError",
            "no such service(s): router",
        ),
    ];
    for (body, code, kind, detail) in refusals {
        let (status, answer) = http(port, "POST", "/v1/admin/scale", body).unwrap();
        assert_eq!(status, code, "{body}: {answer}");
        let answer: Value = serde_json::from_str(&answer).unwrap();
        assert!(
            answer["detail"].as_str().unwrap().contains(detail),
            "{answer}"
        );
        assert_eq!(answer["error"]["message"], answer["detail"], "{answer}");
        assert_eq!(answer["error"]["type"], json!(kind), "{answer}");
    }
    k8s.deny_on("inferadeployments", "patch");
    let (status, answer) = http(port, "POST", "/v1/admin/scale", resize).unwrap();
    assert_eq!(status, 403, "{answer}");
    let answer: Value = serde_json::from_str(&answer).unwrap();
    assert!(
        answer["detail"]
            .as_str()
            .unwrap()
            .contains("cannot patch InferaDeployments"),
        "{answer}"
    );
    assert_eq!(answer["error"]["type"], json!("PermissionDeniedError"));
    assert_eq!(k8s.stats().custom_patches, vec![patch]);
}
