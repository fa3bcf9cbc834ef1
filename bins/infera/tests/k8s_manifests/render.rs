//! Rendering the overlays and reading what kubectl makes of them: `kubectl kustomize`, the
//! dry run against the in-process API server, and the typed round trip into [`Fleet`].

use super::*;

pub(super) fn kubernetes_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/kubernetes")
}

pub(super) fn overlay_dir(name: &str) -> PathBuf {
    kubernetes_dir().join("overlays").join(name)
}

pub(super) fn kubectl() -> PathBuf {
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

/// Runs kubectl offline (no kubeconfig) with `stdin`; its stdout.
pub(super) fn kubectl_offline(args: &[&str], dir: Option<&Path>, stdin: &[u8]) -> String {
    let mut command = Command::new(kubectl());
    command
        .args(args)
        .args(dir)
        .env("KUBECONFIG", "/dev/null")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = command.spawn().expect("run kubectl");
    let mut pipe = child.stdin.take().expect("stdin");
    let input = stdin.to_vec();
    let writer = std::thread::spawn(move || pipe.write_all(&input));
    let output = child.wait_with_output().expect("kubectl output");
    writer.join().expect("join").expect("write to kubectl");
    assert!(
        output.status.success(),
        "kubectl {} {} failed ({}):\n{}",
        args.join(" "),
        dir.map(|d| d.display().to_string()).unwrap_or_default(),
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).expect("UTF-8")
}

/// Concatenated JSON documents (or one `List`) as objects.
pub(super) fn json_objects(text: &str) -> Vec<Value> {
    let mut objects = Vec::new();
    for value in serde_json::Deserializer::from_str(text).into_iter::<Value>() {
        let value = value.unwrap_or_else(|e| panic!("kubectl printed no JSON ({e}):\n{text}"));
        match value["kind"].as_str() {
            Some("List") => objects.extend(value["items"].as_array().cloned().unwrap_or_default()),
            _ => objects.push(value),
        }
    }
    objects
}

/// `kubectl kustomize dir`, read into objects offline (`kubectl annotate --local`, its
/// annotation taken off again): kubectl needs no server to read any kind.
pub(super) fn render(dir: &Path) -> Vec<Value> {
    let yaml = kubectl_offline(&["kustomize"], Some(dir), b"");
    let printed = kubectl_offline(
        &[
            "annotate",
            "--local",
            "-o",
            "json",
            "-f",
            "-",
            "infera.test/read=1",
        ],
        None,
        yaml.as_bytes(),
    );
    let mut objects = json_objects(&printed);
    for object in &mut objects {
        let metadata = object["metadata"].as_object_mut().expect("metadata");
        let annotations = metadata
            .get_mut("annotations")
            .and_then(Value::as_object_mut)
            .expect("the annotation kubectl added");
        annotations.remove("infera.test/read");
        if annotations.is_empty() {
            metadata.remove("annotations");
        }
    }
    assert!(!objects.is_empty(), "{} renders nothing", dir.display());
    objects
}

/// Kinds of CRDs: unknown to the in-process API server and to `k8s-openapi`.
pub(super) fn is_custom(object: &Value) -> bool {
    let api_version = object["apiVersion"].as_str().unwrap_or_default();
    api_version.starts_with("monitoring.coreos.com/")
        || api_version.starts_with("inference.networking.k8s.io/")
}

/// A kubeconfig for the in-process API server, in a temporary home.
pub(super) struct Cluster {
    _server: KubeApiServer,
    home: tempfile::TempDir,
    kubeconfig: PathBuf,
}

impl Cluster {
    pub(super) async fn start() -> Self {
        let server = KubeApiServer::start(NAMESPACE).await.expect("API server");
        let home = tempfile::tempdir().expect("temp dir");
        let kubeconfig = home.path().join("kubeconfig");
        std::fs::write(
            &kubeconfig,
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster:\n    \
                 server: {}\ncontexts:\n- name: test\n  context:\n    cluster: test\n    \
                 user: test\ncurrent-context: test\nusers:\n- name: test\n  user:\n    \
                 token: test\n",
                server.url()
            ),
        )
        .expect("kubeconfig");
        Cluster {
            _server: server,
            home,
            kubeconfig,
        }
    }

    /// `kubectl apply --dry-run=client --validate=false -o FORMAT <args>` against the server.
    pub(super) async fn dry_run(
        &self,
        format: &str,
        args: &[&str],
        path: &Path,
    ) -> std::process::Output {
        let mut command = Command::new(kubectl());
        command
            .arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .arg("--cache-dir")
            .arg(self.home.path().join("cache"))
            .args([
                "apply",
                "--dry-run=client",
                "--validate=false",
                "-o",
                format,
            ])
            .args(args)
            .arg(path)
            .env("HOME", self.home.path())
            .env_remove("KUBECONFIG");
        tokio::task::spawn_blocking(move || command.output())
            .await
            .expect("join")
            .expect("run kubectl")
    }
}

/// The objects `kubectl apply --dry-run=client` makes of `objects`.
pub(super) async fn kubectl_dry_run(objects: &[Value]) -> Vec<Value> {
    let cluster = Cluster::start().await;
    let input = cluster.home.path().join("objects.json");
    let list = json!({"apiVersion": "v1", "kind": "List", "items": objects});
    std::fs::write(&input, serde_json::to_vec(&list).expect("JSON")).expect("objects");
    let output = cluster.dry_run("json", &["-f"], &input).await;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "kubectl apply --dry-run=client failed ({}):\n{stderr}\n{stdout}",
        output.status
    );
    json_objects(&stdout)
}

/// Paths where `a` and `b` differ (nulls count as absent).
pub(super) fn differences(path: &str, a: &Value, b: &Value, out: &mut Vec<String>) {
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
pub(super) fn check_typed<T: DeserializeOwned + Serialize>(object: &Value) -> Result<T, String> {
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

pub(super) fn typed<T: DeserializeOwned + Serialize>(object: &Value) -> T {
    check_typed(object).unwrap_or_else(|e| panic!("{e}"))
}

/// Everything an overlay defines, typed (the CRD kinds as kubectl read them).
#[derive(Default)]
pub(super) struct Fleet {
    pub(super) roles: BTreeMap<String, Role>,
    pub(super) bindings: BTreeMap<String, RoleBinding>,
    pub(super) accounts: BTreeSet<String>,
    pub(super) deployments: BTreeMap<String, Deployment>,
    pub(super) daemon_sets: BTreeMap<String, DaemonSet>,
    pub(super) jobs: BTreeMap<String, Job>,
    pub(super) services: BTreeMap<String, Service>,
    pub(super) claims: BTreeMap<String, PersistentVolumeClaim>,
    pub(super) secrets: BTreeMap<String, Secret>,
    pub(super) service_monitors: BTreeMap<String, Value>,
    pub(super) pod_monitors: BTreeMap<String, Value>,
    pub(super) pools: BTreeMap<String, Value>,
}

pub(super) fn classify(objects: &[Value]) -> Fleet {
    let mut fleet = Fleet::default();
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
                fleet.accounts.insert(name);
            }
            "Role" => {
                fleet.roles.insert(name, typed(object));
            }
            "RoleBinding" => {
                fleet.bindings.insert(name, typed(object));
            }
            "Deployment" => {
                fleet.deployments.insert(name, typed(object));
            }
            "DaemonSet" => {
                fleet.daemon_sets.insert(name, typed(object));
            }
            "Job" => {
                fleet.jobs.insert(name, typed(object));
            }
            "Service" => {
                fleet.services.insert(name, typed(object));
            }
            "PersistentVolumeClaim" => {
                fleet.claims.insert(name, typed(object));
            }
            "Secret" => {
                fleet.secrets.insert(name, typed(object));
            }
            "ServiceMonitor" => {
                fleet.service_monitors.insert(name, object.clone());
            }
            "PodMonitor" => {
                fleet.pod_monitors.insert(name, object.clone());
            }
            "InferencePool" => {
                fleet.pools.insert(name, object.clone());
            }
            other => {
                panic!("unexpected kind {other} ({name}); cluster-wide objects are not wanted")
            }
        }
    }
    fleet
}

/// `dir` rendered, its built-in objects through the dry run, all of them typed.
pub(super) async fn checked_render(dir: &Path) -> Fleet {
    let objects = render(dir);
    let (custom, builtin): (Vec<Value>, Vec<Value>) = objects.iter().cloned().partition(is_custom);
    let printed = kubectl_dry_run(&builtin).await;
    assert_eq!(
        printed.len(),
        builtin.len(),
        "{}: kubectl printed every object",
        dir.display()
    );
    let mut all = printed;
    all.extend(custom);
    let fleet = classify(&all);
    assert_fleet(&fleet);
    assert_binary_accepts(&fleet);
    fleet
}

/// `resources` and `components` (folders under `bins/deploy/kubernetes`) composed in a
/// kustomization of a temporary folder, as a user's own overlay would.
pub(super) async fn checked_composition(resources: &[&str], components: &[&str]) -> Fleet {
    let dir = tempfile::tempdir().expect("temp dir");
    let here = dir.path().canonicalize().expect("temp dir");
    let root = kubernetes_dir()
        .canonicalize()
        .expect("bins/deploy/kubernetes");
    // kustomize takes relative paths only: up to `/`, then down to the tree.
    let mut up = PathBuf::new();
    for _ in here.components().skip(1) {
        up.push("..");
    }
    let to = |folder: &str| {
        up.join(root.strip_prefix("/").expect("absolute"))
            .join(folder)
            .display()
            .to_string()
    };
    let list = |folders: &[&str]| {
        folders
            .iter()
            .map(|f| format!("  - {}\n", to(f)))
            .collect::<String>()
    };
    std::fs::write(
        here.join("kustomization.yaml"),
        format!(
            "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n{}\
             components:\n{}",
            list(resources),
            if components.is_empty() {
                "  []\n".to_owned()
            } else {
                list(components)
            }
        ),
    )
    .expect("kustomization");
    checked_render(&here).await
}
