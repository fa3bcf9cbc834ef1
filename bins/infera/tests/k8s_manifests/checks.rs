//! The checks every rendered fleet passes, and the per-overlay ones that return their problems.

use super::*;

/// The checks every rendered fleet passes.
pub(super) fn assert_fleet(fleet: &Fleet) {
    // RBAC: namespaced, with exactly what discovery needs.
    assert_eq!(
        fleet.accounts,
        BTreeSet::from(["infera-server".to_owned(), "infera-worker".to_owned()])
    );
    let verbs = |role: &str| {
        pod_verbs(
            fleet
                .roles
                .get(role)
                .unwrap_or_else(|| panic!("Role {role} missing")),
        )
    };
    let set = |v: &[&str]| v.iter().map(|s| (*s).to_owned()).collect::<BTreeSet<_>>();
    assert_eq!(verbs("infera-server"), set(&["get", "list", "watch"]));
    assert_eq!(verbs("infera-worker"), set(&["get", "patch"]));
    for (name, binding) in &fleet.bindings {
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
    assert_eq!(fleet.bindings.len(), 2);
    assert!(fleet.claims.contains_key("infera-models"));

    // The server.
    let server = server(fleet);
    assert_eq!(service_account(server), Some("infera-server"));
    let server_container = container(server);
    let server_args = server_args(fleet);
    assert_eq!(server_args.first().map(String::as_str), Some("server"));
    assert_eq!(
        flag(&server_args, "--discovery-backend"),
        Some("kubernetes")
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
    let service = fleet.services.get("infera-server").expect("server Service");
    let service_selector = service
        .spec
        .as_ref()
        .and_then(|s| s.selector.clone())
        .unwrap_or_default();
    assert!(
        matches(&service_selector, &template_labels(server)),
        "the Service selects the server Pods"
    );

    // The workers.
    let workers = workers(fleet);
    assert!(!workers.is_empty(), "a fleet without workers");
    for (name, (deployment, _)) in &workers {
        let worker = container(deployment);
        let worker_args = args(worker);
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
        assert!(
            !matches(&service_selector, &template_labels(deployment)),
            "{name}: worker Pods must not be behind the server's Service"
        );
        let drain = Duration::from_secs(seconds(
            flag(&worker_args, "--drain-timeout").unwrap_or("30s"),
        ));
        let grace = pod_spec(deployment_template(deployment))
            .termination_grace_period_seconds
            .map(|g| Duration::from_secs(u64::try_from(g).expect("non-negative grace")))
            .unwrap_or(Duration::from_secs(30));
        assert!(
            grace >= drain + ENGINE_STOP_MARGIN,
            "{name}: terminationGracePeriodSeconds {grace:?} must cover --drain-timeout {drain:?} \
             plus {ENGINE_STOP_MARGIN:?} for the engine to stop"
        );
    }
    let problems: Vec<String> = [
        selector_problems(fleet),
        image_problems(fleet),
        service_monitor_problems(fleet),
    ]
    .concat();
    assert!(problems.is_empty(), "{problems:#?}");
}

/// The server's `--k8s-label-selector` picks exactly the worker Pods, and no two controllers
/// select each other's Pods.
pub(super) fn selector_problems(fleet: &Fleet) -> Vec<String> {
    let mut problems = Vec::new();
    let selector = worker_selector(fleet);
    let workers = workers(fleet);
    let all = templates(fleet);
    for (owner, template, own_selector) in &all {
        let labels = labels_of(template);
        let is_worker = owner
            .strip_prefix("Deployment ")
            .is_some_and(|name| workers.contains_key(name));
        if matches(&selector, &labels) != is_worker {
            problems.push(format!(
                "{owner}: the server's --k8s-label-selector {selector:?} must match worker Pods \
                 and no others ({labels:?})"
            ));
        }
        if !matches(own_selector, &labels) {
            problems.push(format!("{owner}: its selector misses its own template"));
        }
        for (other, other_template, _) in &all {
            if other != owner && matches(own_selector, &labels_of(other_template)) {
                problems.push(format!("{owner} selects the Pods of {other}"));
            }
        }
    }
    problems
}

/// `infera:latest` for what the infera image runs alone (server, picker, kvd, mock worker), an
/// engine's image for its worker.
pub(super) fn image_problems(fleet: &Fleet) -> Vec<String> {
    let mut problems = Vec::new();
    for (owner, template, _) in templates(fleet) {
        let container = pod_container(template);
        let args = args(container);
        let expected = match (
            args.first().map(String::as_str),
            args.get(1).map(String::as_str),
        ) {
            (Some("worker"), Some(engine)) if engine != "mock" => format!("infera-{engine}:latest"),
            _ => "infera:latest".to_owned(),
        };
        if container.image.as_deref() != Some(expected.as_str()) {
            problems.push(format!(
                "{owner}: image {:?}, expected {expected}",
                container.image
            ));
        }
        if container.command.as_deref() != Some(&["infera".to_owned()][..]) {
            problems.push(format!("{owner}: command must be [infera]"));
        }
    }
    problems
}

/// The ServiceMonitor (a CRD kind, checked field by field): it selects the server's Service in
/// its namespace and scrapes `/metrics` on a port the Service names.
pub(super) fn service_monitor_problems(fleet: &Fleet) -> Vec<String> {
    let mut problems = Vec::new();
    if fleet.service_monitors.len() != 1 {
        problems.push(format!(
            "one ServiceMonitor expected, found {:?}",
            fleet.service_monitors.keys().collect::<Vec<_>>()
        ));
    }
    for (name, monitor) in &fleet.service_monitors {
        let mut problem = |text: String| problems.push(format!("ServiceMonitor {name}: {text}"));
        if monitor["apiVersion"] != "monitoring.coreos.com/v1" {
            problem(format!("apiVersion {}", monitor["apiVersion"]));
        }
        let known: BTreeSet<&str> = ["namespaceSelector", "selector", "endpoints"].into();
        for key in monitor["spec"]
            .as_object()
            .into_iter()
            .flatten()
            .map(|(k, _)| k)
        {
            if !known.contains(key.as_str()) {
                problem(format!("unexpected spec field {key}"));
            }
        }
        let namespaces = &monitor["spec"]["namespaceSelector"]["matchNames"];
        if !namespaces.is_null() && *namespaces != json!([NAMESPACE]) {
            problem(format!("namespaceSelector {namespaces}"));
        }
        if !monitor["spec"]["selector"]["matchExpressions"].is_null() {
            problem("matchLabels only".to_owned());
        }
        let selector: BTreeMap<String, String> =
            match serde_json::from_value(monitor["spec"]["selector"]["matchLabels"].clone()) {
                Ok(selector) => selector,
                Err(e) => {
                    problem(format!("selector.matchLabels: {e}"));
                    continue;
                }
            };
        let selected: Vec<(&String, &Service)> = fleet
            .services
            .iter()
            .filter(|(_, service)| {
                let labels = service.metadata.labels.clone().unwrap_or_default();
                !selector.is_empty() && matches(&selector, &labels)
            })
            .collect();
        let [(service_name, service)] = selected[..] else {
            problem(format!(
                "selects the Services {:?}, not the server's alone",
                selected.iter().map(|(n, _)| n).collect::<Vec<_>>()
            ));
            continue;
        };
        if service_name != "infera-server" {
            problem(format!("selects {service_name}, not infera-server"));
        }
        let port_names: BTreeSet<&str> = service
            .spec
            .iter()
            .flat_map(|s| s.ports.iter().flatten())
            .filter_map(|p| p.name.as_deref())
            .collect();
        let endpoints = monitor["spec"]["endpoints"].as_array().cloned();
        let endpoints = endpoints.unwrap_or_default();
        if endpoints.is_empty() {
            problem("no endpoints".to_owned());
        }
        for endpoint in &endpoints {
            let port = endpoint["port"].as_str().unwrap_or_default();
            if !port_names.contains(port) {
                problem(format!(
                    "endpoint port {:?} is not a port of the Service ({port_names:?})",
                    endpoint["port"]
                ));
            }
            if endpoint["path"] != "/metrics" {
                problem(format!("endpoint path {}", endpoint["path"]));
            }
            for key in ["interval", "scrapeTimeout"] {
                if let Some(text) = endpoint[key].as_str()
                    && (text.is_empty() || !text.ends_with(['s', 'm']))
                {
                    problem(format!("{key} {text:?} is not a duration"));
                }
            }
        }
    }
    problems
}

/// Replaces `$(VAR)` as the kubelet would, and `/models` by `models`.
pub(super) fn as_run_by_the_kubelet(
    args: &[String],
    models: &Path,
    mounts: &[(String, PathBuf)],
) -> Vec<String> {
    args.iter()
        .map(|arg| {
            let arg = arg.replace("$(POD_IP)", "10.1.0.7");
            if let Some(rest) = arg.strip_prefix("/models/") {
                return models.join(rest).display().to_string();
            }
            for (mount, dir) in mounts {
                if let Some(rest) = arg.strip_prefix(mount.as_str()) {
                    return dir.join(rest.trim_start_matches('/')).display().to_string();
                }
            }
            arg
        })
        .collect()
}

/// The Secret volumes `container` mounts in `template`, as the kubelet lays them out: each
/// mount path with the Secret's files (`stringData`, or `data` decoded).
pub(super) fn secret_files(
    fleet: &Fleet,
    template: &PodTemplateSpec,
    container: &Container,
) -> Vec<(String, BTreeMap<String, Vec<u8>>)> {
    let volumes = pod_spec(template).volumes.clone().unwrap_or_default();
    let mut out = Vec::new();
    for mount in container.volume_mounts.iter().flatten() {
        let Some(secret) = volumes
            .iter()
            .find(|v| v.name == mount.name)
            .and_then(|v| v.secret.as_ref())
        else {
            continue;
        };
        let name = secret
            .secret_name
            .as_deref()
            .expect("a secret volume names its Secret");
        let object = fleet.secrets.get(name).unwrap_or_else(|| {
            panic!(
                "the volume {} mounts a Secret {name} not in the fleet",
                mount.name
            )
        });
        let mut files: BTreeMap<String, Vec<u8>> = BTreeMap::new();
        for (k, v) in object.data.iter().flatten() {
            files.insert(k.clone(), v.0.clone());
        }
        for (k, v) in object.string_data.iter().flatten() {
            files.insert(k.clone(), v.clone().into_bytes());
        }
        out.push((mount.mount_path.clone(), files));
    }
    out
}

/// `infera <args> --check-config` for `container`, with the Secret files it mounts; its
/// resolved configuration.
pub(super) fn check_config(
    owner: &str,
    container: &Container,
    secrets: &[(String, BTreeMap<String, Vec<u8>>)],
) -> Value {
    let models = tempfile::tempdir().expect("temp dir");
    std::fs::write(models.path().join("tokenizer.json"), b"{}").expect("tokenizer");
    std::fs::create_dir(models.path().join("model")).expect("model dir");
    let mut mounts = Vec::new();
    for (i, (path, files)) in secrets.iter().enumerate() {
        let dir = models.path().join(format!("secret-{i}"));
        std::fs::create_dir(&dir).expect("secret dir");
        for (name, content) in files {
            std::fs::write(dir.join(name), content).expect("secret file");
        }
        mounts.push((path.clone(), dir));
    }
    let mut argv = as_run_by_the_kubelet(&args(container), models.path(), &mounts);
    argv.push("--check-config".to_owned());
    let output = Command::new(env!("CARGO_BIN_EXE_infera"))
        .args(&argv)
        .env("POD_NAME", "pod-0")
        .env("POD_NAMESPACE", NAMESPACE)
        .env_remove("INFERA_K8S_LABEL_SELECTOR")
        .env_remove("INFERA_EPP_SECURE")
        .output()
        .expect("run infera");
    assert!(
        output.status.success(),
        "{owner}: `infera {}` was refused:\n{}{}",
        argv.join(" "),
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout)
        .unwrap_or_else(|e| panic!("{owner}: --check-config printed no JSON: {e}"))
}

/// The binary takes every container's arguments; the server, workers and picker discover
/// through Kubernetes.
pub(super) fn assert_binary_accepts(fleet: &Fleet) {
    for (owner, template, _) in templates(fleet) {
        let container = pod_container(template);
        let config = check_config(&owner, container, &secret_files(fleet, template, container));
        if args(container).first().map(String::as_str) != Some("kvd") {
            assert!(
                config.to_string().contains("\"kubernetes\""),
                "{owner}: {config}"
            );
        }
    }
}

/// The `kind` (`requests`, `limits`) of `resource` of `container`.
pub(super) fn resource<'a>(
    container: &'a Container,
    kind: &str,
    resource: &str,
) -> Option<&'a str> {
    let resources = container.resources.as_ref()?;
    let map = match kind {
        "requests" => resources.requests.as_ref()?,
        "limits" => resources.limits.as_ref()?,
        other => panic!("{other}"),
    };
    map.get(resource).map(|q| q.0.as_str())
}

/// The PD legs: exactly one prefill and one decode Deployment, each with its `kv_role` on the
/// same RDMA connector, labelled with its role; the server weighs the roles.
pub(super) fn pd_problems(fleet: &Fleet) -> Vec<String> {
    let mut problems = Vec::new();
    let mut legs: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    let mut connectors = BTreeSet::new();
    for (name, (deployment, engine)) in workers(fleet) {
        let worker = container(deployment);
        let worker_args = args(worker);
        if engine != "vllm" {
            problems.push(format!("{name}: a {engine} worker in a vLLM PD fleet"));
            continue;
        }
        let Some(transfer) = flag(&worker_args, "--kv-transfer-config") else {
            problems.push(format!("{name}: no --kv-transfer-config: a mixed worker"));
            continue;
        };
        let transfer: Value = match serde_json::from_str(transfer) {
            Ok(v) => v,
            Err(e) => {
                problems.push(format!("{name}: --kv-transfer-config is not JSON: {e}"));
                continue;
            }
        };
        let role = match transfer["kv_role"].as_str() {
            Some("kv_producer") => "prefill",
            Some("kv_consumer") => "decode",
            other => {
                problems.push(format!("{name}: kv_role {other:?} is not a PD leg"));
                continue;
            }
        };
        legs.entry(role).or_default().push(name);
        let connector = transfer["kv_connector"].as_str().unwrap_or_default();
        connectors.insert(connector.to_owned());
        if !PD_CONNECTORS.contains(&connector) {
            problems.push(format!(
                "{name}: kv_connector {connector:?} moves no KV between nodes ({PD_CONNECTORS:?})"
            ));
        }
        if worker_args
            .iter()
            .any(|a| a == "--disaggregation-allow-tcp")
        {
            problems.push(format!(
                "{name}: --disaggregation-allow-tcp is for benchmarks"
            ));
        }
        if template_labels(deployment)
            .get("infera.amd.com/role")
            .map(String::as_str)
            != Some(role)
        {
            problems.push(format!(
                "{name}: its Pods must carry infera.amd.com/role: {role}"
            ));
        }
        if role == "prefill"
            && connector == "MooncakeConnector"
            && !exposes(worker, &IntOrString::Int(8998))
        {
            problems.push(format!("{name}: the Mooncake bootstrap port 8998"));
        }
    }
    for role in ["prefill", "decode"] {
        let found = legs.get(role).map_or(0, Vec::len);
        if found != 1 {
            problems.push(format!(
                "{found} {role} Deployments, expected one: {legs:?}"
            ));
        }
    }
    if connectors.len() > 1 {
        problems.push(format!(
            "the legs speak different connectors: {connectors:?}"
        ));
    }
    let server_args = server_args(fleet);
    for key in ["--kv-prefill-overlap-weight", "--kv-decode-overlap-weight"] {
        if flag(&server_args, key)
            .and_then(|w| w.parse::<f64>().ok())
            .is_none()
        {
            problems.push(format!("the server has no {key}"));
        }
    }
    problems
}

/// The host path a container reaches `path` at, through its hostPath volume mounts.
pub(super) fn host_path(spec: &PodSpec, container: &Container, path: &str) -> Option<String> {
    container
        .volume_mounts
        .iter()
        .flatten()
        .filter_map(|mount| {
            let rest = path.strip_prefix(&mount.mount_path)?.strip_prefix('/')?;
            let volume = spec
                .volumes
                .iter()
                .flatten()
                .find(|v| v.name == mount.name)?;
            let host = volume.host_path.as_ref()?;
            Some(format!("{}/{rest}", host.path.trim_end_matches('/')))
        })
        .next()
}

pub(super) fn run_as_user(spec: &PodSpec, container: &Container) -> Option<i64> {
    container
        .security_context
        .as_ref()
        .and_then(|c| c.run_as_user)
        .or_else(|| spec.security_context.as_ref().and_then(|c| c.run_as_user))
}

/// kvd: one DaemonSet whose socket, in a hostPath folder, is the one every vLLM worker but the
/// decode legs is given, at the same host path and as the same user (the socket is 0700).
pub(super) fn kvd_problems(fleet: &Fleet) -> Vec<String> {
    let mut problems = Vec::new();
    let [(kvd_name, kvd)] = fleet.daemon_sets.iter().collect::<Vec<_>>()[..] else {
        return vec![format!(
            "one kvd DaemonSet expected: {:?}",
            fleet.daemon_sets.keys().collect::<Vec<_>>()
        )];
    };
    let kvd_spec = pod_spec(daemon_set_template(kvd));
    let kvd_container = pod_container(daemon_set_template(kvd));
    let kvd_args = args(kvd_container);
    if kvd_args.first().map(String::as_str) != Some("kvd") {
        problems.push(format!("DaemonSet {kvd_name} does not run `infera kvd`"));
    }
    let socket = flag(&kvd_args, "--socket").unwrap_or("/var/run/infera-kvd.sock");
    let Some(host_socket) = host_path(kvd_spec, kvd_container, socket) else {
        problems.push(format!(
            "kvd's socket {socket} is not in a hostPath volume the engines can mount"
        ));
        return problems;
    };
    problems.extend(kvd_monitor_problems(fleet, kvd, &kvd_args));
    let kvd_user = run_as_user(kvd_spec, kvd_container);
    let mut wired = 0;
    for (name, (deployment, engine)) in workers(fleet) {
        let spec = pod_spec(deployment_template(deployment));
        let worker = container(deployment);
        let worker_args = args(worker);
        let given = flag(&worker_args, "--infera-kvd-socket");
        let decode = template_labels(deployment)
            .get("infera.amd.com/role")
            .is_some_and(|r| r == "decode");
        if engine != "vllm" || decode {
            if given.is_some() {
                problems.push(format!(
                    "{name}: a {engine} decode leg never reads from kvd"
                ));
            }
            continue;
        }
        wired += 1;
        if given != Some(socket) {
            problems.push(format!(
                "{name}: --infera-kvd-socket {given:?}, but kvd listens on {socket}"
            ));
            continue;
        }
        match host_path(spec, worker, socket) {
            Some(host) if host == host_socket => {}
            other => problems.push(format!(
                "{name}: {socket} is {other:?} on the host, kvd's is {host_socket}"
            )),
        }
        let user = run_as_user(spec, worker);
        if user != kvd_user && user != Some(0) {
            problems.push(format!(
                "{name}: runs as {user:?}, kvd as {kvd_user:?}: the 0700 socket refuses it"
            ));
        }
    }
    if wired == 0 {
        problems.push("no vLLM worker uses kvd".to_owned());
    }
    problems
}

/// The PodMonitor scrapes `/metrics` on a named container port of kvd's Pods, the port of its
/// `--metrics-bind`.
pub(super) fn kvd_monitor_problems(
    fleet: &Fleet,
    kvd: &DaemonSet,
    kvd_args: &[String],
) -> Vec<String> {
    let mut problems = Vec::new();
    let [monitor] = fleet.pod_monitors.values().collect::<Vec<_>>()[..] else {
        return vec![format!(
            "one kvd PodMonitor expected: {:?}",
            fleet.pod_monitors.keys().collect::<Vec<_>>()
        )];
    };
    let template = daemon_set_template(kvd);
    let selector: BTreeMap<String, String> =
        serde_json::from_value(monitor["spec"]["selector"]["matchLabels"].clone())
            .unwrap_or_default();
    if selector.is_empty() || !matches(&selector, &labels_of(template)) {
        problems.push(format!(
            "the PodMonitor's selector {selector:?} misses kvd's Pods"
        ));
    }
    let bind_port = flag(kvd_args, "--metrics-bind")
        .and_then(|bind| bind.rsplit_once(':'))
        .and_then(|(_, port)| port.parse::<i32>().ok());
    let endpoints = monitor["spec"]["podMetricsEndpoints"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    if endpoints.is_empty() {
        problems.push("the PodMonitor has no endpoint".to_owned());
    }
    for endpoint in endpoints {
        let name = endpoint["port"].as_str().unwrap_or_default();
        let port = pod_container(template)
            .ports
            .iter()
            .flatten()
            .find(|p| p.name.as_deref() == Some(name))
            .map(|p| p.container_port);
        if port.is_none() || port != bind_port {
            problems.push(format!(
                "the PodMonitor scrapes port {name:?} ({port:?}), kvd serves metrics on {bind_port:?}"
            ));
        }
        if endpoint["path"].as_str() != Some("/metrics") {
            problems.push(format!(
                "the PodMonitor scrapes {}, not /metrics",
                endpoint["path"]
            ));
        }
    }
    problems
}
