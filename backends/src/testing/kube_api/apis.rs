//! Discovery documents (`/version`, `/api`, `/apis`, resource lists), enough for `kubectl` to map
//! the kinds of Infera's manifests to resources: core v1, apps v1, batch v1, rbac v1 and policy
//! v1.

use super::json_response;
use super::store::status;
use axum::extract::Path;
use axum::http::StatusCode;
use axum::response::Response;
use serde_json::{Value, json};

pub(super) async fn version() -> Response {
    json_response(
        StatusCode::OK,
        &json!({
            "major": "1", "minor": "33", "gitVersion": "v1.33.0-infera-test",
            "gitCommit": "", "gitTreeState": "clean", "buildDate": "2026-01-01T00:00:00Z",
            "goVersion": "go1.24", "compiler": "gc", "platform": "linux/amd64",
        }),
    )
}

pub(super) async fn api_versions() -> Response {
    json_response(
        StatusCode::OK,
        &json!({
            "kind": "APIVersions", "versions": ["v1"],
            "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": "127.0.0.1"}],
        }),
    )
}

/// A served resource: plural name, kind, whether it is namespaced.
type ResourceInfo = (&'static str, &'static str, bool);

/// The groups served besides core, with their resources.
const GROUPS: &[(&str, &str, &[ResourceInfo])] = &[
    (
        "apps",
        "v1",
        &[
            ("deployments", "Deployment", true),
            ("statefulsets", "StatefulSet", true),
            ("daemonsets", "DaemonSet", true),
            ("replicasets", "ReplicaSet", true),
        ],
    ),
    ("batch", "v1", &[("jobs", "Job", true)]),
    (
        "rbac.authorization.k8s.io",
        "v1",
        &[
            ("roles", "Role", true),
            ("rolebindings", "RoleBinding", true),
            ("clusterroles", "ClusterRole", false),
            ("clusterrolebindings", "ClusterRoleBinding", false),
        ],
    ),
    (
        "policy",
        "v1",
        &[("poddisruptionbudgets", "PodDisruptionBudget", true)],
    ),
];

const CORE: &[ResourceInfo] = &[
    ("pods", "Pod", true),
    ("services", "Service", true),
    ("serviceaccounts", "ServiceAccount", true),
    ("configmaps", "ConfigMap", true),
    ("secrets", "Secret", true),
    ("persistentvolumeclaims", "PersistentVolumeClaim", true),
    ("namespaces", "Namespace", false),
];

pub(super) async fn api_groups() -> Response {
    let groups: Vec<Value> = GROUPS
        .iter()
        .map(|(group, version, _)| {
            let gv = json!({"groupVersion": format!("{group}/{version}"), "version": version});
            json!({"name": group, "versions": [gv.clone()], "preferredVersion": gv})
        })
        .collect();
    json_response(
        StatusCode::OK,
        &json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}),
    )
}

fn resource_list(group_version: &str, resources: &[ResourceInfo]) -> Response {
    let resources: Vec<Value> = resources
        .iter()
        .map(|(plural, kind, namespaced)| {
            json!({
                "name": plural, "singularName": kind.to_lowercase(), "namespaced": namespaced,
                "kind": kind,
                "verbs": ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"],
            })
        })
        .collect();
    json_response(
        StatusCode::OK,
        &json!({
            "kind": "APIResourceList", "apiVersion": "v1", "groupVersion": group_version,
            "resources": resources,
        }),
    )
}

pub(super) async fn core_resources() -> Response {
    resource_list("v1", CORE)
}

pub(super) async fn group_resources(Path((group, version)): Path<(String, String)>) -> Response {
    match GROUPS.iter().find(|(g, v, _)| *g == group && *v == version) {
        Some((_, _, resources)) => resource_list(&format!("{group}/{version}"), resources),
        None => super::status_response(status(
            404,
            "NotFound",
            &format!("the server could not find the requested resource ({group}/{version})"),
        )),
    }
}
