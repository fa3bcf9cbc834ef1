//! `POST /v1/admin/profile/{start,stop}` (PROTOCOLS.md §4): fan a profiler start or stop out to the
//! engines, as vLLM and SGLang expose it (`POST /start_profile`, `POST /stop_profile`).
//!
//! The optional JSON body narrows the workers: `worker_id`, `model`, `role` (`mixed`, `prefill`,
//! `decode`). 403 unless the server runs with `--enable-profiling` ([`ServerState::set_profiling`]);
//! 404 when no registered worker matches; otherwise 200 when every engine answered 2xx and 502
//! when any did not, with one result per worker: `{"worker_id", "status"}` or `{"worker_id",
//! "error"}`. Engines are called over HTTP at their registered URL, concurrently, each bounded by
//! [`ENGINE_TIMEOUT`].

use super::ServerState;
use super::http::{ApiError, read_body};
use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, Method, Request, StatusCode};
use axum::response::{IntoResponse as _, Response};
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use infera_core::event::WorkerRecord;
use serde_json::{Value, json};
use std::sync::atomic::Ordering;
use std::time::Duration;

/// How long one engine may take to answer.
pub const ENGINE_TIMEOUT: Duration = Duration::from_secs(30);

impl ServerState {
    /// Serves the profiling endpoints (`--enable-profiling`); off by default (403).
    pub fn set_profiling(&self, enabled: bool) {
        self.inner.profiling.store(enabled, Ordering::Relaxed);
    }
}

fn err(status: StatusCode, message: impl Into<String>) -> Response {
    ApiError::new(status, message).into_response()
}

pub(crate) async fn profile(
    State(st): State<ServerState>,
    Path(action): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    if !st.inner.profiling.load(Ordering::Relaxed) {
        return err(
            StatusCode::FORBIDDEN,
            "profiling is disabled; start the server with --enable-profiling",
        );
    }
    let engine_path = match action.as_str() {
        "start" => "/start_profile",
        "stop" => "/stop_profile",
        _ => {
            return err(
                StatusCode::NOT_FOUND,
                "use /v1/admin/profile/start or /stop",
            );
        }
    };
    let bytes = match read_body(body, &headers, 64 << 10).await {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };
    let filter: Value = if bytes.iter().all(u8::is_ascii_whitespace) {
        json!({})
    } else {
        match serde_json::from_slice(&bytes) {
            Ok(v @ Value::Object(_)) => v,
            _ => return err(StatusCode::BAD_REQUEST, "the body must be a JSON object"),
        }
    };
    let field = |name: &str| -> Result<Option<String>, ApiError> {
        match filter.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(_) => Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                format!("`{name}` must be a string"),
            )),
        }
    };
    let (worker_id, model, role) = match (field("worker_id"), field("model"), field("role")) {
        (Ok(w), Ok(m), Ok(r)) => (w, m, r),
        (Err(e), _, _) | (_, Err(e), _) | (_, _, Err(e)) => return e.into_response(),
    };
    let workers: Vec<WorkerRecord> = st.service().with_fleet(|f| {
        f.workers()
            .filter(|w| {
                worker_id
                    .as_deref()
                    .is_none_or(|id| w.worker_id.as_str() == id)
            })
            .filter(|w| model.as_deref().is_none_or(|m| w.model_name == m))
            .filter(|w| role.as_deref().is_none_or(|r| w.disagg_mode.as_str() == r))
            .cloned()
            .collect()
    });
    if workers.is_empty() {
        return err(StatusCode::NOT_FOUND, "no registered worker matches");
    }
    let client: Client<_, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build(super::transport::nodelay_connector());
    let calls = workers.iter().map(|w| {
        let client = client.clone();
        let uri = format!("{}{engine_path}", w.url.trim_end_matches('/'));
        let id = w.worker_id.as_str().to_owned();
        async move {
            let req = Request::builder()
                .method(Method::POST)
                .uri(&uri)
                .body(Full::new(Bytes::new()));
            let outcome = match req {
                Err(e) => Err(format!("bad worker URL {uri}: {e}")),
                Ok(req) => match tokio::time::timeout(ENGINE_TIMEOUT, client.request(req)).await {
                    Err(_) => Err(format!("no answer within {ENGINE_TIMEOUT:?}")),
                    Ok(Err(e)) => Err(e.to_string()),
                    Ok(Ok(resp)) => Ok(resp.status().as_u16()),
                },
            };
            match outcome {
                Ok(status) => (
                    (200..300).contains(&status),
                    json!({"worker_id": id, "status": status}),
                ),
                Err(e) => (false, json!({"worker_id": id, "error": e})),
            }
        }
    });
    let results = futures::future::join_all(calls).await;
    let ok = results.iter().all(|(ok, _)| *ok);
    tracing::info!(action, workers = results.len(), ok, "profiler fan-out");
    let status = if ok {
        StatusCode::OK
    } else {
        StatusCode::BAD_GATEWAY
    };
    let results: Vec<Value> = results.into_iter().map(|(_, r)| r).collect();
    (
        status,
        axum::Json(json!({"action": action, "results": results})),
    )
        .into_response()
}
