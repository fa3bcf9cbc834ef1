//! The Kubernetes manifests of `bins/deploy/kubernetes/`, checked three ways:
//!
//! 1. `kubectl apply --dry-run=client -o json -f bins/deploy/kubernetes` against the in-process API
//!    server of `infera_backends::testing::kube_api` (kubectl needs a server to map kinds to
//!    resources; that one serves the discovery documents). It has no OpenAPI schema to offer, so
//!    kubectl runs with `--validate=false`; the schema check is step 2.
//! 2. Every object kubectl printed is read into its Kubernetes API type (`k8s-openapi`) and
//!    written back: a field the API does not have, or a value of the wrong type, fails.
//! 3. What the fleet relies on: namespaced RBAC with exactly the verbs discovery needs, the
//!    downward-API environment, `/health` probes, a grace period that covers the drain timeout, a
//!    server selector that matches every worker template, and arguments the `infera` binary itself
//!    accepts (`--check-config`).
//!
//! The endpoint picker's manifests (`gaie/`: its Deployment and Service, and the InferencePool,
//! a kind of the Gateway API Inference Extension's CRDs that kubectl reads offline) are checked
//! against the fleet's: the same workers, selector and KV-event transport, gRPC health probes,
//! and a pool whose target port is the workers' and whose picker is the picker's Service.

use infera_backends::discovery::kubernetes::k8s_openapi;
use infera_backends::testing::kube_api::KubeApiServer;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{
    Container, Namespace, PersistentVolumeClaim, Probe, Service, ServiceAccount,
};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

const NAMESPACE: &str = "infera";

/// Time a worker needs after its drain to stop the engine and exit.
const ENGINE_STOP_MARGIN: Duration = Duration::from_secs(15);

fn manifests_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/kubernetes")
}

fn kubectl() -> PathBuf {
    std::env::var_os("PATH")
        .and_then(|path| {
            std::env::split_paths(&path)
                .map(|dir| dir.join("kubectl"))
                .find(|candidate| candidate.is_file())
        })
        .unwrap_or_else(|| {
            panic!(
                "kubectl not found on PATH; install Debian's kubernetes-client \
                 (`cargo xtask test` installs it)"
            )
        })
}

/// The objects `kubectl apply --dry-run=client` makes of the manifests.
async fn kubectl_dry_run(dir: &Path) -> Vec<Value> {
    let server = KubeApiServer::start(NAMESPACE).await.expect("API server");
    let home = tempfile::tempdir().expect("temp dir");
    let kubeconfig = home.path().join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster:\n    server: {}\n\
             contexts:\n- name: test\n  context:\n    cluster: test\n    user: test\n\
             current-context: test\nusers:\n- name: test\n  user:\n    token: test\n",
            server.url()
        ),
    )
    .expect("kubeconfig");
    let mut command = Command::new(kubectl());
    command
        .arg("--kubeconfig")
        .arg(&kubeconfig)
        .arg("--cache-dir")
        .arg(home.path().join("cache"))
        .args([
            "apply",
            "--dry-run=client",
            "--validate=false",
            "-o",
            "json",
            "-f",
        ])
        .arg(dir)
        .env("HOME", home.path())
        .env_remove("KUBECONFIG");
    let output = tokio::task::spawn_blocking(move || command.output())
        .await
        .expect("join")
        .expect("run kubectl");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "kubectl apply --dry-run=client failed ({}):\n{stderr}\n{stdout}",
        output.status
    );
    let printed: Value = serde_json::from_str(&stdout)
        .unwrap_or_else(|e| panic!("kubectl printed no JSON ({e}):\n{stdout}\n{stderr}"));
    match printed["kind"].as_str() {
        Some("List") => printed["items"].as_array().cloned().unwrap_or_default(),
        _ => vec![printed],
    }
}

/// Paths where `a` and `b` differ (nulls count as absent).
fn differences(path: &str, a: &Value, b: &Value, out: &mut Vec<String>) {
    match (a, b) {
        (Value::Object(a), Value::Object(b)) => {
            let keys: BTreeSet<&String> = a.keys().chain(b.keys()).collect();
            for key in keys {
                let null = Value::Null;
                let left = a.get(key).unwrap_or(&null);
                let right = b.get(key).unwrap_or(&null);
                differences(&format!("{path}.{key}"), left, right, out);
            }
        }
        (Value::Array(a), Value::Array(b)) if a.len() == b.len() => {
            for (i, (left, right)) in a.iter().zip(b).enumerate() {
                differences(&format!("{path}[{i}]"), left, right, out);
            }
        }
        (a, b) if a == b => {}
        (a, b) => out.push(format!("{path}: {a} became {b}")),
    }
}

/// Reads `object` as `T` and checks that writing it back loses nothing.
fn check_typed<T: DeserializeOwned + Serialize>(object: &Value) -> Result<T, String> {
    let name = format!("{} {}", object["kind"], object["metadata"]["name"]);
    let value: T = serde_json::from_value(object.clone())
        .map_err(|e| format!("{name} is not a valid API object: {e}"))?;
    let back = serde_json::to_value(&value).map_err(|e| e.to_string())?;
    let mut diffs = Vec::new();
    differences("", object, &back, &mut diffs);
    if diffs.is_empty() {
        Ok(value)
    } else {
        Err(format!(
            "{name} has fields the API type does not know, or values of the wrong type: {diffs:#?}"
        ))
    }
}

fn typed<T: DeserializeOwned + Serialize>(object: &Value) -> T {
    check_typed(object).unwrap_or_else(|e| panic!("{e}"))
}

/// Everything the manifests define, typed.
#[derive(Default)]
struct Manifests {
    roles: BTreeMap<String, Role>,
    bindings: BTreeMap<String, RoleBinding>,
    accounts: BTreeSet<String>,
    deployments: BTreeMap<String, Deployment>,
    services: BTreeMap<String, Service>,
    claims: BTreeSet<String>,
}

fn classify(objects: &[Value]) -> Manifests {
    let mut manifests = Manifests::default();
    for object in objects {
        let kind = object["kind"].as_str().unwrap_or_default();
        let name = object["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        if kind != "Namespace" {
            assert_eq!(
                object["metadata"]["namespace"], NAMESPACE,
                "{kind} {name} must be namespaced to {NAMESPACE}"
            );
        }
        match kind {
            "Namespace" => {
                typed::<Namespace>(object);
            }
            "ServiceAccount" => {
                typed::<ServiceAccount>(object);
                manifests.accounts.insert(name);
            }
            "Role" => {
                manifests.roles.insert(name, typed(object));
            }
            "RoleBinding" => {
                manifests.bindings.insert(name, typed(object));
            }
            "Deployment" => {
                manifests.deployments.insert(name, typed(object));
            }
            "Service" => {
                manifests.services.insert(name, typed(object));
            }
            "PersistentVolumeClaim" => {
                typed::<PersistentVolumeClaim>(object);
                manifests.claims.insert(name);
            }
            other => {
                panic!("unexpected kind {other} ({name}); cluster-wide objects are not wanted")
            }
        }
    }
    manifests
}

/// Verbs on pods each Role grants (rules on other resources are refused).
fn pod_verbs(role: &Role) -> BTreeSet<String> {
    let mut verbs = BTreeSet::new();
    for rule in role.rules.iter().flatten() {
        assert_eq!(
            rule.api_groups.as_deref(),
            Some(&[String::new()][..]),
            "core group only"
        );
        assert_eq!(
            rule.resources.as_deref(),
            Some(&["pods".to_owned()][..]),
            "pods only"
        );
        verbs.extend(rule.verbs.iter().cloned());
    }
    verbs
}

fn container(deployment: &Deployment) -> &Container {
    let spec = deployment
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .expect("pod spec");
    assert_eq!(spec.containers.len(), 1, "one container per Pod");
    &spec.containers[0]
}

fn service_account(deployment: &Deployment) -> Option<&str> {
    deployment
        .spec
        .as_ref()?
        .template
        .spec
        .as_ref()?
        .service_account_name
        .as_deref()
}

fn template_labels(deployment: &Deployment) -> BTreeMap<String, String> {
    deployment
        .spec
        .as_ref()
        .and_then(|s| s.template.metadata.as_ref())
        .and_then(|m| m.labels.clone())
        .unwrap_or_default()
}

fn args(container: &Container) -> Vec<String> {
    container.args.clone().unwrap_or_default()
}

/// The value after `flag` in `args`.
fn flag<'a>(args: &'a [String], flag: &str) -> Option<&'a str> {
    args.iter()
        .position(|a| a == flag)
        .and_then(|i| args.get(i + 1))
        .map(String::as_str)
}

/// Checks a `/health` HTTP probe on the container's port.
fn assert_health_probe(what: &str, probe: Option<&Probe>, container: &Container) {
    let probe = probe.unwrap_or_else(|| panic!("{what} is missing on {}", container.name));
    let get = probe
        .http_get
        .as_ref()
        .unwrap_or_else(|| panic!("{what} of {} must be an HTTP GET", container.name));
    assert_eq!(
        get.path.as_deref(),
        Some("/health"),
        "{what} of {}",
        container.name
    );
    let ports = container.ports.as_deref().unwrap_or_default();
    let port_known = ports.iter().any(|p| match &get.port {
        k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(n) => *n == p.container_port,
        k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String(s) => {
            p.name.as_deref() == Some(s.as_str())
        }
    });
    assert!(
        port_known,
        "{what} of {} probes a port it does not expose",
        container.name
    );
}

/// `30s`, `2m`, `90` (seconds).
fn seconds(text: &str) -> u64 {
    let (number, unit) = text
        .find(|c: char| !c.is_ascii_digit())
        .map_or((text, "s"), |at| text.split_at(at));
    let number: u64 = number
        .parse()
        .unwrap_or_else(|_| panic!("duration {text:?}"));
    match unit {
        "s" => number,
        "m" => number * 60,
        other => panic!("duration unit {other:?} in {text:?}"),
    }
}

fn env_field_path<'a>(container: &'a Container, name: &str) -> Option<&'a str> {
    container
        .env
        .as_ref()?
        .iter()
        .find(|e| e.name == name)?
        .value_from
        .as_ref()?
        .field_ref
        .as_ref()
        .map(|f| f.field_path.as_str())
}

/// `key=value,key=value` as a map (the equality selectors the server manifest uses).
fn equality_selector(selector: &str) -> BTreeMap<String, String> {
    selector
        .split(',')
        .map(|part| {
            let (key, value) = part
                .split_once('=')
                .unwrap_or_else(|| panic!("{part:?} is not an equality requirement"));
            (key.trim().to_owned(), value.trim().to_owned())
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_manifests_pass_kubectl_and_the_api_types() {
    let objects = kubectl_dry_run(&manifests_dir()).await;
    // namespace, models claim, 2 × (account, role, binding), server + service, 4 workers
    assert_eq!(objects.len(), 14, "kubectl printed every object");
    let manifests = classify(&objects);

    // The type check catches a misspelled field and a mistyped value.
    let worker = objects
        .iter()
        .find(|o| o["metadata"]["name"] == "infera-worker-mock")
        .expect("mock worker");
    let mut misspelled = worker.clone();
    misspelled["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] =
        worker["spec"]["template"]["spec"]["containers"][0]["readinessProbe"].clone();
    let err = check_typed::<Deployment>(&misspelled).expect_err("unknown field");
    assert!(err.contains("readinessProbes"), "{err}");
    let mut mistyped = worker.clone();
    mistyped["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = "45s".into();
    assert!(check_typed::<Deployment>(&mistyped).is_err());

    // RBAC: namespaced, with exactly what discovery needs.
    assert_eq!(
        manifests.accounts,
        BTreeSet::from(["infera-server".to_owned(), "infera-worker".to_owned()])
    );
    let verbs = |role: &str| {
        pod_verbs(
            manifests
                .roles
                .get(role)
                .unwrap_or_else(|| panic!("Role {role} missing")),
        )
    };
    let set = |v: &[&str]| v.iter().map(|s| (*s).to_owned()).collect::<BTreeSet<_>>();
    assert_eq!(verbs("infera-server"), set(&["get", "list", "watch"]));
    assert_eq!(verbs("infera-worker"), set(&["get", "patch"]));
    for (name, binding) in &manifests.bindings {
        assert_eq!(
            binding.role_ref.kind, "Role",
            "{name} binds a namespaced Role"
        );
        assert_eq!(&binding.role_ref.name, name);
        let subjects = binding.subjects.as_deref().unwrap_or_default();
        assert_eq!(subjects.len(), 1, "{name}");
        assert_eq!(subjects[0].kind, "ServiceAccount");
        assert_eq!(&subjects[0].name, name);
        assert_eq!(subjects[0].namespace.as_deref(), Some(NAMESPACE));
    }
    assert_eq!(manifests.bindings.len(), 2);

    // The server.
    let server = manifests
        .deployments
        .get("infera-server")
        .expect("server Deployment");
    assert_eq!(service_account(server), Some("infera-server"));
    let server_container = container(server);
    let server_args = args(server_container);
    assert_eq!(server_args.first().map(String::as_str), Some("server"));
    assert_eq!(
        flag(&server_args, "--discovery-backend"),
        Some("kubernetes")
    );
    let selector = equality_selector(
        flag(&server_args, "--k8s-label-selector").expect("--k8s-label-selector"),
    );
    assert_health_probe(
        "readinessProbe",
        server_container.readiness_probe.as_ref(),
        server_container,
    );
    assert_health_probe(
        "livenessProbe",
        server_container.liveness_probe.as_ref(),
        server_container,
    );
    let service = manifests
        .services
        .get("infera-server")
        .expect("server Service");
    let service_selector = service
        .spec
        .as_ref()
        .and_then(|s| s.selector.clone())
        .unwrap_or_default();
    let server_labels = template_labels(server);
    assert!(
        service_selector
            .iter()
            .all(|(k, v)| server_labels.get(k) == Some(v)),
        "the Service selects the server Pods"
    );

    // The workers: one template per engine.
    let mut engines = BTreeSet::new();
    for (name, deployment) in &manifests.deployments {
        if name == "infera-server" {
            continue;
        }
        let worker = container(deployment);
        let worker_args = args(worker);
        assert_eq!(
            worker_args.first().map(String::as_str),
            Some("worker"),
            "{name}"
        );
        let engine = worker_args.get(1).cloned().expect("engine");
        engines.insert(engine.clone());
        assert_eq!(service_account(deployment), Some("infera-worker"), "{name}");
        for key in [
            "--discovery-backend",
            "--request-transport",
            "--kv-event-transport",
        ] {
            assert_eq!(
                flag(&worker_args, key),
                flag(&server_args, key),
                "{name}: {key} must match the server's"
            );
        }
        assert_eq!(
            flag(&worker_args, "--advertise-host"),
            Some("$(POD_IP)"),
            "{name}"
        );
        for (var, path) in [
            ("POD_NAME", "metadata.name"),
            ("POD_NAMESPACE", "metadata.namespace"),
            ("POD_IP", "status.podIP"),
        ] {
            assert_eq!(
                env_field_path(worker, var),
                Some(path),
                "{name}: downward API {var}"
            );
        }
        assert_health_probe("readinessProbe", worker.readiness_probe.as_ref(), worker);
        assert_health_probe("livenessProbe", worker.liveness_probe.as_ref(), worker);
        let labels = template_labels(deployment);
        assert!(
            selector.iter().all(|(k, v)| labels.get(k) == Some(v)),
            "{name}: the server's --k8s-label-selector must match its Pods ({labels:?})"
        );
        assert!(
            !service_selector
                .iter()
                .all(|(k, v)| labels.get(k) == Some(v)),
            "{name}: worker Pods must not be behind the server's Service"
        );
        let drain = Duration::from_secs(seconds(
            flag(&worker_args, "--drain-timeout").unwrap_or("30s"),
        ));
        let grace = deployment
            .spec
            .as_ref()
            .and_then(|s| s.template.spec.as_ref())
            .and_then(|s| s.termination_grace_period_seconds)
            .map(|g| Duration::from_secs(u64::try_from(g).expect("non-negative grace")))
            .unwrap_or(Duration::from_secs(30));
        assert!(
            grace >= drain + ENGINE_STOP_MARGIN,
            "{name}: terminationGracePeriodSeconds {grace:?} must cover --drain-timeout {drain:?} \
             plus {ENGINE_STOP_MARGIN:?} for the engine to stop"
        );
    }
    assert_eq!(engines, set(&["atom", "mock", "sglang", "vllm"]));
    assert!(manifests.claims.contains("infera-models"));
}

/// Replaces `$(VAR)` as the kubelet would, and `/models` by `models`.
fn as_run_by_the_kubelet(args: &[String], models: &Path) -> Vec<String> {
    args.iter()
        .map(|arg| {
            let arg = arg.replace("$(POD_IP)", "10.1.0.7");
            match arg.strip_prefix("/models/") {
                Some(rest) => models.join(rest).display().to_string(),
                None => arg,
            }
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_accepts_the_manifests_arguments() {
    let objects = kubectl_dry_run(&manifests_dir()).await;
    let manifests = classify(&objects);
    let models = tempfile::tempdir().expect("temp dir");
    std::fs::write(models.path().join("tokenizer.json"), b"{}").expect("tokenizer");
    std::fs::create_dir(models.path().join("model")).expect("model dir");
    for (name, deployment) in &manifests.deployments {
        let container = container(deployment);
        assert_eq!(
            container.command.as_deref(),
            Some(&["infera".to_owned()][..]),
            "{name}"
        );
        let mut argv = as_run_by_the_kubelet(&args(container), models.path());
        argv.push("--check-config".to_owned());
        let output = Command::new(env!("CARGO_BIN_EXE_infera"))
            .args(&argv)
            .env("POD_NAME", "pod-0")
            .env("POD_NAMESPACE", NAMESPACE)
            .env_remove("INFERA_K8S_LABEL_SELECTOR")
            .output()
            .expect("run infera");
        assert!(
            output.status.success(),
            "{name}: `infera {}` was refused:\n{}{}",
            argv.join(" "),
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(stdout.contains("kubernetes"), "{name}: {stdout}");
    }
}

fn gaie_dir() -> PathBuf {
    manifests_dir().join("gaie")
}

/// An object of a CRD kind (the in-process API server maps only built-in kinds), as kubectl
/// reads it offline (`kubectl annotate --local`, its annotation taken off again).
fn kubectl_local(file: &Path) -> Value {
    let output = Command::new(kubectl())
        .args(["annotate", "--local", "-o", "json", "-f"])
        .arg(file)
        .arg("infera.test/read=1")
        .env("KUBECONFIG", "/dev/null")
        .output()
        .expect("run kubectl");
    assert!(
        output.status.success(),
        "kubectl cannot read {}:\n{}",
        file.display(),
        String::from_utf8_lossy(&output.stderr)
    );
    let mut object: Value = serde_json::from_slice(&output.stdout).expect("kubectl JSON");
    let annotations = object["metadata"]["annotations"]
        .as_object_mut()
        .expect("the annotation kubectl added");
    annotations.remove("infera.test/read");
    if annotations.is_empty() {
        object["metadata"]
            .as_object_mut()
            .expect("metadata")
            .remove("annotations");
    }
    object
}

/// Checks a gRPC health probe of `service` on `port`.
fn assert_grpc_probe(what: &str, probe: Option<&Probe>, port: i32) {
    let grpc = probe
        .and_then(|p| p.grpc.as_ref())
        .unwrap_or_else(|| panic!("{what} must be a gRPC probe"));
    assert_eq!(grpc.port, port, "{what} port");
    assert_eq!(
        grpc.service.as_deref(),
        Some("inference-extension"),
        "{what}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_endpoint_picker_manifests_pick_among_the_fleets_workers() {
    let fleet = classify(&kubectl_dry_run(&manifests_dir()).await);
    let objects = kubectl_dry_run(&gaie_dir().join("epp.yaml")).await;
    assert_eq!(objects.len(), 2, "the picker's Deployment and Service");
    let epp = classify(&objects);
    let deployment = epp
        .deployments
        .get("infera-gaie")
        .expect("picker Deployment");
    let picker = container(deployment);
    let picker_args = args(picker);
    assert_eq!(picker_args.first().map(String::as_str), Some("gaie"));
    // It watches the workers as the server does, with the server's rights.
    assert_eq!(service_account(deployment), Some("infera-server"));
    assert!(fleet.accounts.contains("infera-server"));
    let server_args = args(container(&fleet.deployments["infera-server"]));
    for key in [
        "--discovery-backend",
        "--k8s-label-selector",
        "--kv-event-transport",
    ] {
        assert_eq!(flag(&picker_args, key), flag(&server_args, key), "{key}");
    }
    let port_of = |key: &str| -> i32 { flag(&picker_args, key).expect(key).parse().expect(key) };
    let exposed: BTreeSet<i32> = picker
        .ports
        .iter()
        .flatten()
        .map(|p| p.container_port)
        .collect();
    assert_eq!(
        exposed,
        BTreeSet::from([port_of("--grpc-port"), port_of("--grpc-health-port")])
    );
    let health = port_of("--grpc-health-port");
    assert_grpc_probe("readinessProbe", picker.readiness_probe.as_ref(), health);
    assert_grpc_probe("livenessProbe", picker.liveness_probe.as_ref(), health);
    let service = epp.services.get("infera-gaie").expect("picker Service");
    let spec = service.spec.as_ref().expect("Service spec");
    let labels = template_labels(deployment);
    let selector = spec.selector.clone().unwrap_or_default();
    assert!(
        selector.iter().all(|(k, v)| labels.get(k) == Some(v)),
        "the Service selects the picker"
    );
    let grpc_port = spec
        .ports
        .iter()
        .flatten()
        .find(|p| p.name.as_deref() == Some("grpc"))
        .expect("the Service's grpc port")
        .port;

    // The pool: the fleet's worker Pods on the port the picker names, and the picker's Service.
    let pool = kubectl_local(&gaie_dir().join("inferencepool.yaml"));
    assert_eq!(pool["apiVersion"], "inference.networking.k8s.io/v1");
    assert_eq!(pool["kind"], "InferencePool");
    assert_eq!(pool["metadata"]["namespace"], NAMESPACE);
    let destination = port_of("--destination-port");
    assert_eq!(
        pool["spec"]["targetPorts"],
        serde_json::json!([{"number": destination}])
    );
    let picker_ref = &pool["spec"]["endpointPickerRef"];
    assert_eq!(picker_ref["name"], "infera-gaie");
    assert_eq!(picker_ref["port"]["number"], grpc_port);
    assert_eq!(picker_ref["failureMode"], "FailClose");
    let pool_selector: BTreeMap<String, String> =
        serde_json::from_value(pool["spec"]["selector"]["matchLabels"].clone()).expect("labels");
    let workers: Vec<&Deployment> = fleet
        .deployments
        .iter()
        .filter(|(name, _)| *name != "infera-server")
        .map(|(_, d)| d)
        .collect();
    assert_eq!(workers.len(), 4);
    for worker in workers {
        let labels = template_labels(worker);
        assert!(
            pool_selector.iter().all(|(k, v)| labels.get(k) == Some(v)),
            "{labels:?}"
        );
        let ports = container(worker).ports.clone().unwrap_or_default();
        assert!(
            ports.iter().any(|p| p.container_port == destination),
            "{ports:?}"
        );
    }

    // The binary takes the picker's arguments.
    let models = tempfile::tempdir().expect("temp dir");
    std::fs::write(models.path().join("tokenizer.json"), b"{}").expect("tokenizer");
    let mut argv = as_run_by_the_kubelet(&picker_args, models.path());
    argv.push("--check-config".to_owned());
    let output = Command::new(env!("CARGO_BIN_EXE_infera"))
        .args(&argv)
        .env("POD_NAMESPACE", NAMESPACE)
        .env_remove("INFERA_K8S_LABEL_SELECTOR")
        .env_remove("INFERA_EPP_SECURE")
        .output()
        .expect("run infera");
    assert!(
        output.status.success(),
        "`infera {}` was refused:\n{}",
        argv.join(" "),
        String::from_utf8_lossy(&output.stderr)
    );
    let config: Value = serde_json::from_slice(&output.stdout).expect("config JSON");
    assert_eq!(
        config["grpc"]["secure_serving"], true,
        "TLS, as gateways connect"
    );
    assert_eq!(config["grpc"]["destination_port"], destination);
}
