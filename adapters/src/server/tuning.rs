//! `GET /v1/admin/tuning`: what `infera server --auto-tune` published last (its window, the
//! shadow replay's candidates and recommendation, predicted against realised hit rates, and the
//! changes it made), as the binary hands it over with [`ServerState::publish_tuning`]. With
//! `--auto-tune off` it answers 404, naming the flag. Behind the admin token guard.

use super::ServerState;
use super::http::ApiError;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse as _, Response};
use std::sync::Arc;

impl ServerState {
    /// Replaces what `GET /v1/admin/tuning` answers.
    pub fn publish_tuning(&self, report: serde_json::Value) {
        *self
            .inner
            .tuning
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(Arc::new(report));
    }

    fn tuning(&self) -> Option<Arc<serde_json::Value>> {
        self.inner
            .tuning
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }
}

pub(crate) async fn get_tuning(State(st): State<ServerState>) -> Response {
    match st.tuning() {
        Some(report) => axum::Json(report.as_ref().clone()).into_response(),
        None => ApiError::new(
            StatusCode::NOT_FOUND,
            "the shadow replay is off; start the server with --auto-tune advise or apply",
        )
        .into_response(),
    }
}
