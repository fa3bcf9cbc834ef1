//! `GET` / `POST /v1/admin/scale` (`--enable-scaling-api`), as the Python Infera serves them:
//! read and resize the worker pools of the deployment this server belongs to, through the
//! [`PoolScaler`] port set with [`ServerState::set_scaler`] (the binary wires the Kubernetes one).
//!
//! `GET` answers every pool's requested and observed size (a [`PoolSnapshot`]). `POST` takes
//! `{"services": {"<name>": {"replicas": N}}}` (or `{"<name>": N}`), resizes all the named pools
//! or none, and answers the snapshot after the write. Without a scaler both answer 403, naming the
//! flag. Errors carry the OpenAI-style `error` object and, for the Python Infera's callers, its
//! FastAPI `detail` with the same sentence. The routes sit behind the admin token guard.

use super::ServerState;
use super::http::{ApiError, read_body};
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse as _, Response};
use infera_core::ports::scaling::{PoolScaler, PoolSnapshot, ScalingError, parse_request};
use std::sync::Arc;

/// Largest resize body read.
const MAX_BODY_BYTES: usize = 64 << 10;

impl ServerState {
    /// Serves `/v1/admin/scale` through `scaler` (`--enable-scaling-api`); without one the
    /// endpoint answers 403.
    pub fn set_scaler(&self, scaler: Arc<dyn PoolScaler>) {
        *self
            .inner
            .scaler
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(scaler);
    }

    fn scaler(&self) -> Option<Arc<dyn PoolScaler>> {
        self.inner
            .scaler
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }
}

/// The answer without a scaler.
fn disabled() -> Response {
    refusal(ApiError::new(
        StatusCode::FORBIDDEN,
        "scaling API disabled; start the server with --enable-scaling-api",
    ))
}

/// An error answer with the Python Infera's `detail` beside the `error` object.
fn refusal(error: ApiError) -> Response {
    let mut body = error.body();
    body["detail"] = error.message.clone().into();
    (error.status, axum::Json(body)).into_response()
}

fn answer(result: Result<PoolSnapshot, ScalingError>) -> Response {
    match result {
        Ok(snapshot) => axum::Json(snapshot).into_response(),
        Err(e) => {
            tracing::info!("scaling request refused: {e}");
            refusal(ApiError::new(e.code.http_status(), e.message))
        }
    }
}

pub(crate) async fn get_scale(State(st): State<ServerState>) -> Response {
    match st.scaler() {
        Some(scaler) => answer(scaler.snapshot().await),
        None => disabled(),
    }
}

pub(crate) async fn post_scale(
    State(st): State<ServerState>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let Some(scaler) = st.scaler() else {
        return disabled();
    };
    let bytes = match read_body(body, &headers, MAX_BODY_BYTES).await {
        Ok(bytes) => bytes,
        Err(e) => return refusal(e),
    };
    match parse_request(&bytes) {
        Ok(requested) => answer(scaler.scale(&requested).await),
        Err(e) => answer(Err(e)),
    }
}
