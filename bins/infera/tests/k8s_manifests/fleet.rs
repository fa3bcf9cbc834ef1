//! Reading a rendered [`Fleet`](super::render::Fleet): its Pod templates, containers, flags and
//! the server and worker Deployments.

use super::*;

/// Verbs on pods each Role grants (rules on other resources are refused).
pub(super) fn pod_verbs(role: &Role) -> BTreeSet<String> {
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

pub(super) fn deployment_template(deployment: &Deployment) -> &PodTemplateSpec {
    &deployment.spec.as_ref().expect("Deployment spec").template
}

pub(super) fn daemon_set_template(daemon_set: &DaemonSet) -> &PodTemplateSpec {
    &daemon_set.spec.as_ref().expect("DaemonSet spec").template
}

pub(super) fn pod_spec(template: &PodTemplateSpec) -> &PodSpec {
    template.spec.as_ref().expect("pod spec")
}

pub(super) fn pod_container(template: &PodTemplateSpec) -> &Container {
    let spec = pod_spec(template);
    assert_eq!(spec.containers.len(), 1, "one container per Pod");
    &spec.containers[0]
}

pub(super) fn container(deployment: &Deployment) -> &Container {
    pod_container(deployment_template(deployment))
}

pub(super) fn service_account(deployment: &Deployment) -> Option<&str> {
    pod_spec(deployment_template(deployment))
        .service_account_name
        .as_deref()
}

pub(super) fn labels_of(template: &PodTemplateSpec) -> BTreeMap<String, String> {
    template
        .metadata
        .as_ref()
        .and_then(|m| m.labels.clone())
        .unwrap_or_default()
}

pub(super) fn template_labels(deployment: &Deployment) -> BTreeMap<String, String> {
    labels_of(deployment_template(deployment))
}

pub(super) fn args(container: &Container) -> Vec<String> {
    container.args.clone().unwrap_or_default()
}

/// The value after `flag` in `args`.
pub(super) fn flag<'a>(args: &'a [String], flag: &str) -> Option<&'a str> {
    args.iter()
        .position(|a| a == flag)
        .and_then(|i| args.get(i + 1))
        .map(String::as_str)
}

/// Every Pod template of the fleet with its owner's name and kind, and its selector.
pub(super) fn templates(
    fleet: &Fleet,
) -> Vec<(String, &PodTemplateSpec, BTreeMap<String, String>)> {
    let selector = |s: &k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector| {
        assert!(s.match_expressions.is_none(), "match labels only: {s:?}");
        s.match_labels.clone().unwrap_or_default()
    };
    let mut all = Vec::new();
    for (name, deployment) in &fleet.deployments {
        let spec = deployment.spec.as_ref().expect("Deployment spec");
        all.push((
            format!("Deployment {name}"),
            &spec.template,
            selector(&spec.selector),
        ));
    }
    for (name, daemon_set) in &fleet.daemon_sets {
        let spec = daemon_set.spec.as_ref().expect("DaemonSet spec");
        all.push((
            format!("DaemonSet {name}"),
            &spec.template,
            selector(&spec.selector),
        ));
    }
    all
}

pub(super) fn matches(
    selector: &BTreeMap<String, String>,
    labels: &BTreeMap<String, String>,
) -> bool {
    selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

/// Checks a `/health` HTTP probe on the container's port.
pub(super) fn assert_health_probe(what: &str, probe: Option<&Probe>, container: &Container) {
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
    assert!(
        exposes(container, &get.port),
        "{what} of {} probes a port it does not expose",
        container.name
    );
}

pub(super) fn exposes(container: &Container, port: &IntOrString) -> bool {
    container.ports.iter().flatten().any(|p| match port {
        IntOrString::Int(n) => *n == p.container_port,
        IntOrString::String(s) => p.name.as_deref() == Some(s.as_str()),
    })
}

/// `30s`, `2m`, `90` (seconds).
pub(super) fn seconds(text: &str) -> u64 {
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

/// A Kubernetes quantity (`250m`, `2`, `512Mi`, `1Gi`) in thousandths of its unit.
pub(super) fn milli(quantity: &str) -> u128 {
    let at = quantity
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(quantity.len());
    let (number, suffix) = quantity.split_at(at);
    let number: u128 = number
        .parse()
        .unwrap_or_else(|_| panic!("quantity {quantity:?}"));
    let factor: u128 = match suffix {
        "m" => 1,
        "" => 1_000,
        "Ki" => 1_000 << 10,
        "Mi" => 1_000 << 20,
        "Gi" => 1_000 << 30,
        "Ti" => 1_000 << 40,
        other => panic!("quantity suffix {other:?} in {quantity:?}"),
    };
    number * factor
}

pub(super) fn env_field_path<'a>(container: &'a Container, name: &str) -> Option<&'a str> {
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
pub(super) fn equality_selector(selector: &str) -> BTreeMap<String, String> {
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

pub(super) fn server(fleet: &Fleet) -> &Deployment {
    fleet
        .deployments
        .get("infera-server")
        .expect("server Deployment")
}

pub(super) fn server_args(fleet: &Fleet) -> Vec<String> {
    args(container(server(fleet)))
}

/// The server's `--k8s-label-selector`.
pub(super) fn worker_selector(fleet: &Fleet) -> BTreeMap<String, String> {
    equality_selector(
        flag(&server_args(fleet), "--k8s-label-selector").expect("--k8s-label-selector"),
    )
}

/// The worker Deployments (`infera worker …`) and their engines.
pub(super) fn workers(fleet: &Fleet) -> BTreeMap<&str, (&Deployment, String)> {
    fleet
        .deployments
        .iter()
        .filter_map(|(name, deployment)| {
            let args = args(container(deployment));
            (args.first().map(String::as_str) == Some("worker")).then(|| {
                let engine = args.get(1).cloned().expect("engine");
                (name.as_str(), (deployment, engine))
            })
        })
        .collect()
}

pub(super) fn engines(fleet: &Fleet) -> BTreeSet<String> {
    workers(fleet).into_values().map(|(_, e)| e).collect()
}
