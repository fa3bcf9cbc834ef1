//! The Kustomize deployments of `bins/deploy/kubernetes/`: every overlay under `overlays/`, and
//! the compositions the README documents (the SGLang and ATOM workers, kvd on a PD fleet, the
//! tenants' key file from a Secret), are
//! rendered with `kubectl kustomize` and checked three ways:
//!
//! 1. The built-in kinds go through `kubectl apply --dry-run=client -o json` against the
//!    in-process API server of `infera_backends::testing::kube_api` (kubectl needs a server to
//!    map kinds to resources; that one serves the discovery documents of core, apps, batch and rbac). It
//!    has no OpenAPI schema to offer, so kubectl runs with `--validate=false`; the schema check is
//!    step 2. The CRD kinds (the Prometheus Operator's ServiceMonitor, the Inference Extension's
//!    InferencePool) are unknown to that server and to `k8s-openapi`: kubectl reads them offline
//!    (`kubectl annotate --local`) and their fields are checked one by one.
//! 2. Every built-in object kubectl printed is read into its Kubernetes API type (`k8s-openapi`)
//!    and written back: a field the API does not have, or a value of the wrong type, fails.
//! 3. What the fleet relies on: namespaced RBAC with exactly the verbs discovery needs, the
//!    downward-API environment, `/health` probes, a grace period that covers the drain timeout, a
//!    server selector that matches every worker template and nothing else, Deployments that own
//!    disjoint Pods, the images, a ServiceMonitor that scrapes the server's Service, and
//!    arguments the `infera` binary itself accepts (`--check-config`). Per overlay: small
//!    requests for dev-mock, one prefill and one decode leg for pd, the picker and its pool for
//!    gaie, one socket path for kvd and its workers.
//!
//! The checks that decide the overlays' purpose return their problems, and
//! `the_checks_catch_mistakes` feeds them broken copies, so each can fail. And `kubectl apply -k`
//! itself, as a user runs it, on a cluster without the CRDs: it applies every built-in object and
//! refuses only the CRD kinds (no CRD can be dry-run offline: kubectl maps kinds through the
//! server's discovery, which the in-process server has for built-in groups only).

mod checks;
mod fleet;
mod render;
mod replay;

use checks::*;
use fleet::*;
use infera_backends::discovery::kubernetes::k8s_openapi;
use infera_backends::testing::kube_api::KubeApiServer;
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{
    Container, Namespace, PersistentVolumeClaim, PodSpec, PodTemplateSpec, Probe, Secret, Service,
    ServiceAccount,
};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use render::*;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

const NAMESPACE: &str = "infera";

/// Every folder of `overlays/`, each with its own test below.
const OVERLAYS: [&str; 5] = ["dev-mock", "gaie", "kvd", "pd", "vllm"];

/// Every folder of `workers/`: one worker Deployment per engine.
const ENGINES: [&str; 4] = ["atom", "mock", "sglang", "vllm"];

/// vLLM connectors the launcher registers a PD protocol for (RDMA transports).
const PD_CONNECTORS: [&str; 3] = ["MooncakeConnector", "MoRIIOConnector", "NixlConnector"];

/// Time a worker needs after its drain to stop the engine and exit.
const ENGINE_STOP_MARGIN: Duration = Duration::from_secs(15);

#[test]
fn every_overlay_and_engine_has_its_checks() {
    let folders = |dir: &str| -> BTreeSet<String> {
        std::fs::read_dir(kubernetes_dir().join(dir))
            .unwrap_or_else(|e| panic!("{dir}: {e}"))
            .map(|entry| entry.expect("entry"))
            .filter(|entry| entry.path().join("kustomization.yaml").is_file())
            .map(|entry| entry.file_name().to_string_lossy().into_owned())
            .collect()
    };
    let set = |names: &[&str]| {
        names
            .iter()
            .map(|s| (*s).to_owned())
            .collect::<BTreeSet<_>>()
    };
    assert_eq!(
        folders("overlays"),
        set(&OVERLAYS),
        "a new overlay needs a test here"
    );
    assert_eq!(folders("workers"), set(&ENGINES));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dev_mock_overlay_is_small_and_gpu_free() {
    let fleet = checked_render(&overlay_dir("dev-mock")).await;
    assert_eq!(engines(&fleet), BTreeSet::from(["mock".to_owned()]));
    assert!(fleet.daemon_sets.is_empty() && fleet.pools.is_empty());
    for (owner, template, _) in templates(&fleet) {
        let container = pod_container(template);
        for kind in ["requests", "limits"] {
            let cpu =
                resource(container, kind, "cpu").unwrap_or_else(|| panic!("{owner}: cpu {kind}"));
            let memory = resource(container, kind, "memory")
                .unwrap_or_else(|| panic!("{owner}: memory {kind}"));
            assert!(milli(cpu) <= milli("1"), "{owner}: cpu {kind} {cpu}");
            assert!(
                milli(memory) <= milli("1Gi"),
                "{owner}: memory {kind} {memory}"
            );
        }
        let resources = container.resources.as_ref().expect("resources");
        for map in [&resources.requests, &resources.limits]
            .into_iter()
            .flatten()
        {
            assert!(
                map.keys().all(|k| k == "cpu" || k == "memory"),
                "{owner}: no GPU in dev-mock: {map:?}"
            );
        }
        assert_eq!(
            container.image_pull_policy.as_deref(),
            Some("IfNotPresent"),
            "{owner}: a kind/minikube node has the image loaded, not pulled"
        );
    }
    let claim = &fleet.claims["infera-models"];
    let spec = claim.spec.as_ref().expect("claim spec");
    let storage = spec
        .resources
        .as_ref()
        .and_then(|r| r.requests.as_ref())
        .and_then(|r| r.get("storage"))
        .expect("storage");
    assert!(milli(&storage.0) <= milli("1Gi"), "{storage:?}");
    assert_eq!(
        spec.access_modes.as_deref(),
        Some(&["ReadWriteOnce".to_owned()][..])
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_overlay_runs_vllm_workers_on_gpus() {
    let fleet = checked_render(&overlay_dir("vllm")).await;
    assert_eq!(engines(&fleet), BTreeSet::from(["vllm".to_owned()]));
    assert!(fleet.daemon_sets.is_empty() && fleet.pools.is_empty());
    for (name, (deployment, _)) in workers(&fleet) {
        let worker = container(deployment);
        assert_eq!(
            resource(worker, "limits", "amd.com/gpu"),
            Some("1"),
            "{name}"
        );
        assert!(
            flag(&args(worker), "--kv-transfer-config").is_none(),
            "{name}: a mixed worker"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pd_overlay_has_one_prefill_and_one_decode_leg() {
    let fleet = checked_render(&overlay_dir("pd")).await;
    let problems = pd_problems(&fleet);
    assert!(problems.is_empty(), "{problems:#?}");
    assert_eq!(
        workers(&fleet).into_keys().collect::<Vec<_>>(),
        ["infera-worker-vllm-decode", "infera-worker-vllm-prefill"]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kvd_overlay_gives_the_workers_the_daemons_socket() {
    let fleet = checked_render(&overlay_dir("kvd")).await;
    let problems = kvd_problems(&fleet);
    assert!(problems.is_empty(), "{problems:#?}");
    assert_eq!(engines(&fleet), BTreeSet::from(["vllm".to_owned()]));
    let kvd = &fleet.daemon_sets["infera-kvd"];
    let spec = pod_spec(daemon_set_template(kvd));
    assert_eq!(spec.automount_service_account_token, Some(false));
    let kvd_container = pod_container(daemon_set_template(kvd));
    let memory = resource(kvd_container, "limits", "memory").expect("kvd memory limit");
    let kvd_args = args(kvd_container);
    let l2 = flag(&kvd_args, "--max-bytes").expect("--max-bytes");
    let l2 = l2.strip_suffix("GiB").expect("GiB").to_owned() + "Gi";
    assert!(
        milli(memory) > milli(&l2),
        "kvd's memory limit {memory} must cover its L2 (and shared arena) {l2}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kvd_on_a_pd_fleet_wires_the_prefill_leg_only() {
    let fleet = checked_composition(&["overlays/pd"], &["kvd"]).await;
    let problems = [pd_problems(&fleet), kvd_problems(&fleet)].concat();
    assert!(problems.is_empty(), "{problems:#?}");
    let wired: Vec<&str> = workers(&fleet)
        .into_iter()
        .filter(|(_, (d, _))| flag(&args(container(d)), "--infera-kvd-socket").is_some())
        .map(|(name, _)| name)
        .collect();
    assert_eq!(wired, ["infera-worker-vllm-prefill"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tenants_component_gives_the_server_its_key_file_from_a_secret() {
    let fleet = checked_composition(&["overlays/dev-mock"], &["tenants"]).await;
    let server = server(&fleet);
    let c = container(server);
    let path = flag(&args(c), "--api-keys").expect("--api-keys").to_owned();
    let mounted = secret_files(&fleet, deployment_template(server), c);
    let (mount, files) = mounted
        .iter()
        .find(|(m, _)| path.starts_with(&format!("{m}/")))
        .expect("the key file is on a Secret volume");
    let how = c
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| &m.mount_path == mount)
        .expect("the mount");
    assert!(
        how.sub_path.is_none(),
        "a subPath mount never sees the Secret change"
    );
    let name = path.rsplit('/').next().expect("a file name");
    let text = std::str::from_utf8(&files[name]).expect("utf-8");
    let tenants = infera_core::tenancy::Tenants::parse(text, None, 0).expect("a valid key file");
    let a = tenants
        .find(b"sk-example-team-a-0000")
        .expect("the example key");
    assert_eq!(&*a.name, "team-a");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_and_atom_workers_join_the_base_fleet() {
    let fleet = checked_composition(&["base", "workers/sglang", "workers/atom"], &[]).await;
    assert_eq!(
        engines(&fleet),
        BTreeSet::from(["atom".to_owned(), "sglang".to_owned()])
    );
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
async fn gaie_overlay_picks_among_the_fleets_workers() {
    let fleet = checked_render(&overlay_dir("gaie")).await;
    assert_eq!(engines(&fleet), BTreeSet::from(["vllm".to_owned()]));
    let deployment = fleet
        .deployments
        .get("infera-gaie")
        .expect("picker Deployment");
    let picker = container(deployment);
    let picker_args = args(picker);
    assert_eq!(picker_args.first().map(String::as_str), Some("gaie"));
    // It watches the workers as the server does, with the server's rights.
    assert_eq!(service_account(deployment), Some("infera-server"));
    let server_args = server_args(&fleet);
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
    let service = fleet.services.get("infera-gaie").expect("picker Service");
    let spec = service.spec.as_ref().expect("Service spec");
    let selector = spec.selector.clone().unwrap_or_default();
    assert!(
        matches(&selector, &template_labels(deployment)),
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
    assert_eq!(
        fleet.pools.keys().collect::<Vec<_>>(),
        ["infera"],
        "one InferencePool"
    );
    let pool = &fleet.pools["infera"];
    assert_eq!(pool["apiVersion"], "inference.networking.k8s.io/v1");
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
    for (owner, template, _) in templates(&fleet) {
        let is_worker = args(pod_container(template)).first().map(String::as_str) == Some("worker");
        assert_eq!(
            matches(&pool_selector, &labels_of(template)),
            is_worker,
            "{owner}: the pool holds the worker Pods only"
        );
        if is_worker {
            assert!(
                exposes(pod_container(template), &IntOrString::Int(destination)),
                "{owner} serves on {destination}"
            );
        }
    }

    // The binary serves the picker over TLS, on the pool's port.
    let config = check_config("infera-gaie", picker, &[]);
    assert_eq!(
        config["grpc"]["secure_serving"], true,
        "TLS, as gateways connect"
    );
    assert_eq!(config["grpc"]["destination_port"], destination);
}

/// The problem checks, fed broken copies of the overlays, each find the break.
#[test]
fn the_checks_catch_mistakes() {
    // The type check catches a misspelled field and a mistyped value.
    let dev = render(&overlay_dir("dev-mock"));
    let worker = dev
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

    /// `objects` with `change` made to the object named `name`, classified.
    fn broken(objects: &[Value], name: &str, change: impl Fn(&mut Value)) -> Fleet {
        let mut objects = objects.to_vec();
        let object = objects
            .iter_mut()
            .find(|o| o["metadata"]["name"] == name)
            .unwrap_or_else(|| panic!("{name}"));
        change(object);
        classify(&objects)
    }
    let found = |problems: Vec<String>, what: &str| {
        assert!(
            problems.iter().any(|p| p.contains(what)),
            "expected a problem about {what:?}: {problems:#?}"
        );
    };
    fn container_of(o: &mut Value) -> &mut Value {
        &mut o["spec"]["template"]["spec"]["containers"][0]
    }
    let set_arg = |o: &mut Value, key: &str, value: &str| {
        let args = container_of(o)["args"].as_array_mut().expect("args");
        let at = args.iter().position(|a| a == key).expect(key);
        args[at + 1] = value.into();
    };

    // The unchanged renders pass.
    assert!(service_monitor_problems(&classify(&dev)).is_empty());
    assert!(selector_problems(&classify(&dev)).is_empty());
    assert!(image_problems(&classify(&dev)).is_empty());
    // ServiceMonitor: a port the Service does not name, another path, the workers' labels.
    let without_monitor: Vec<Value> = dev
        .iter()
        .filter(|o| o["kind"] != "ServiceMonitor")
        .cloned()
        .collect();
    let monitor = dev
        .iter()
        .find(|o| o["kind"] == "ServiceMonitor")
        .expect("ServiceMonitor");
    let with_monitor = |change: &dyn Fn(&mut Value)| {
        let mut monitor = monitor.clone();
        change(&mut monitor);
        let mut objects = without_monitor.clone();
        objects.push(monitor);
        classify(&objects)
    };
    found(
        service_monitor_problems(&with_monitor(&|m| {
            m["spec"]["endpoints"][0]["port"] = "metrics".into();
        })),
        "not a port of the Service",
    );
    found(
        service_monitor_problems(&with_monitor(&|m| {
            m["spec"]["endpoints"][0]["path"] = "/health".into();
        })),
        "endpoint path",
    );
    found(
        service_monitor_problems(&with_monitor(&|m| {
            m["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] = "worker".into();
        })),
        "not the server's alone",
    );
    // Selectors: a worker the server does not see; a worker image that is not the infera one.
    found(
        selector_problems(&broken(&dev, "infera-worker-mock", |o| {
            o["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] =
                "mock".into();
            o["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] = "mock".into();
        })),
        "--k8s-label-selector",
    );
    found(
        image_problems(&broken(&dev, "infera-worker-mock", |o| {
            container_of(o)["image"] = "infera-vllm:latest".into();
        })),
        "expected infera:latest",
    );

    // PD: two prefill legs; a TCP-only connector.
    let pd = render(&overlay_dir("pd"));
    assert!(pd_problems(&classify(&pd)).is_empty());
    found(
        pd_problems(&broken(&pd, "infera-worker-vllm-decode", |o| {
            set_arg(
                o,
                "--kv-transfer-config",
                r#"{"kv_connector":"MooncakeConnector","kv_role":"kv_producer"}"#,
            );
        })),
        "0 decode Deployments",
    );
    found(
        pd_problems(&broken(&pd, "infera-worker-vllm-decode", |o| {
            set_arg(
                o,
                "--kv-transfer-config",
                r#"{"kv_connector":"P2pNcclConnector","kv_role":"kv_consumer"}"#,
            );
        })),
        "moves no KV between nodes",
    );
    // Two Deployments owning each other's Pods (the legs' role label dropped from a selector).
    found(
        selector_problems(&broken(&pd, "infera-worker-vllm-decode", |o| {
            let labels = o["spec"]["selector"]["matchLabels"]
                .as_object_mut()
                .expect("matchLabels");
            labels.remove("infera.amd.com/role");
        })),
        "selects the Pods of Deployment infera-worker-vllm-prefill",
    );

    // kvd: the worker given another socket; kvd's socket outside the shared host folder; its
    // metrics port or Pods missed by the PodMonitor.
    let kvd = render(&overlay_dir("kvd"));
    assert!(kvd_problems(&classify(&kvd)).is_empty());
    found(
        kvd_problems(&broken(&kvd, "infera-worker-vllm", |o| {
            set_arg(o, "--infera-kvd-socket", "/run/infera/other.sock");
        })),
        "but kvd listens on",
    );
    found(
        kvd_problems(&broken(&kvd, "infera-kvd", |o| {
            set_arg(o, "--socket", "/tmp/kvd.sock");
        })),
        "not in a hostPath volume",
    );
    found(
        kvd_problems(&broken(&kvd, "infera-worker-vllm", |o| {
            o["spec"]["template"]["spec"]["volumes"]
                .as_array_mut()
                .expect("volumes")
                .iter_mut()
                .filter(|v| v["hostPath"].is_object())
                .for_each(|v| v["hostPath"]["path"] = "/var/run/elsewhere".into());
        })),
        "on the host, kvd's is /run/infera/kvd.sock",
    );
    found(
        kvd_problems(&broken(&kvd, "infera-worker-vllm", |o| {
            container_of(o)["securityContext"]["runAsUser"] = 1000.into();
        })),
        "the 0700 socket refuses it",
    );
    found(
        kvd_problems(&broken(&kvd, "infera-kvd", |o| {
            set_arg(o, "--metrics-bind", "0.0.0.0:9500");
        })),
        "kvd serves metrics on Some(9500)",
    );
    found(
        kvd_problems(&broken(&kvd, "infera-kvd-metrics", |o| {
            o["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] = "server".into();
        })),
        "misses kvd's Pods",
    );
}

/// `kubectl apply -k overlays/<name>` as a user runs it, against a cluster without the CRDs:
/// kubectl applies every built-in object and refuses only the CRD kinds, naming them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apply_k_without_the_crds_applies_the_rest_and_names_the_crd_kinds() {
    let cluster = Cluster::start().await;
    for overlay in OVERLAYS {
        let dir = overlay_dir(overlay);
        let objects = render(&dir);
        let custom: BTreeSet<String> = objects
            .iter()
            .filter(|o| is_custom(o))
            .map(|o| o["kind"].as_str().unwrap_or_default().to_owned())
            .collect();
        assert!(custom.contains("ServiceMonitor"), "{overlay}");
        let output = cluster.dry_run("name", &["-k"], &dir).await;
        let stdout = String::from_utf8_lossy(&output.stdout);
        let stderr = String::from_utf8_lossy(&output.stderr);
        let applied = stdout.lines().filter(|l| !l.trim().is_empty()).count();
        assert_eq!(
            applied,
            objects.len() - objects.iter().filter(|o| is_custom(o)).count(),
            "{overlay}: every built-in object applied:\n{stdout}\n{stderr}"
        );
        assert!(
            !output.status.success(),
            "{overlay}: the CRD kinds are refused"
        );
        for kind in &custom {
            assert!(
                stderr.contains(&format!("no matches for kind \"{kind}\"")),
                "{overlay}: {kind} named:\n{stderr}"
            );
        }
        assert_eq!(
            stderr.matches("no matches for kind").count(),
            objects.iter().filter(|o| is_custom(o)).count(),
            "{overlay}: only the CRD kinds refused:\n{stderr}"
        );
    }
}
