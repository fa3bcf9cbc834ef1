//! Namespaced custom resources (an operator's CRDs, such as the InferaDeployment the scaling API
//! edits): `GET` and merge-`PATCH` of one object at
//! `/apis/{group}/{version}/namespaces/{ns}/{plural}/{name}`. Objects are put and changed by the
//! test through the handle, as the operator would; they are not listed or watched.

use super::store::{CustomKey, merge_patch, status};
use super::{Shared, check_rbac, json_response, status_response};
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::Response;
use serde_json::{Value, json};
use std::sync::Arc;

/// The path segments of one object: group, version, namespace, plural, name.
pub(super) type ObjectPath = (String, String, String, String, String);

fn key((group, version, ns, plural, name): ObjectPath) -> CustomKey {
    (format!("{group}/{version}"), plural, ns, name)
}

fn not_found(plural: &str, group: &str, name: &str) -> Response {
    let mut body = status(
        404,
        "NotFound",
        &format!("{plural}.{group} {name:?} not found"),
    );
    body["details"] = json!({"name": name, "group": group, "kind": plural});
    status_response(body)
}

pub(super) async fn get_object(
    State(shared): State<Arc<Shared>>,
    Path(path): Path<ObjectPath>,
) -> Response {
    let (group, _, ns, plural, name) = &path;
    if let Some(denied) = check_rbac(
        &shared,
        (group.as_str(), plural.as_str()),
        "get",
        ns,
        Some(name),
    ) {
        return denied;
    }
    let object = shared.store().custom(&key(path.clone())).cloned();
    match object {
        Some(object) => json_response(StatusCode::OK, &object),
        None => not_found(&path.3, &path.0, &path.4),
    }
}

pub(super) async fn patch_object(
    State(shared): State<Arc<Shared>>,
    Path(path): Path<ObjectPath>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let (group, _, ns, plural, name) = &path;
    if let Some(denied) = check_rbac(
        &shared,
        (group.as_str(), plural.as_str()),
        "patch",
        ns,
        Some(name),
    ) {
        return denied;
    }
    // Custom resources take no strategic merge patch, as on a real API server.
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    if content_type != "application/merge-patch+json" {
        return status_response(status(
            415,
            "UnsupportedMediaType",
            &format!(
                "the body of the request was in an unknown format - accepted media types \
                 include: application/json-patch+json, application/merge-patch+json, \
                 application/apply-patch+yaml (got {content_type:?})"
            ),
        ));
    }
    let Ok(patch @ Value::Object(_)) = serde_json::from_slice::<Value>(&body) else {
        return status_response(status(400, "BadRequest", "the patch is not a JSON object"));
    };
    let key = key(path.clone());
    let patched = {
        let mut store = shared.store();
        store.custom(&key).cloned().map(|mut object| {
            merge_patch(&mut object, &patch);
            store.put_custom(key, object)
        })
    };
    match patched {
        Some(object) => {
            shared.count(|s| s.custom_patches.push(patch));
            json_response(StatusCode::OK, &object)
        }
        None => not_found(&path.3, &path.0, &path.4),
    }
}
