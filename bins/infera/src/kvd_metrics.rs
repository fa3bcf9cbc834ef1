//! `infera kvd --metrics-bind HOST:PORT`: the daemon's counters at `GET /metrics`, in the
//! Prometheus text format (`infera_kvd::metrics_text`), for a scraper; the daemon itself only
//! speaks its Unix-socket protocol.

use axum::Router;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;
use infera_core::service::metrics::text::CONTENT_TYPE;
use infera_kvd::StatsReader;
use std::net::{SocketAddr, TcpListener};

/// Binds the exporter's listener before the daemon starts, so a taken port stops it at once.
///
/// # Errors
/// The address cannot be bound.
pub fn bind(addr: SocketAddr) -> anyhow::Result<TcpListener> {
    let listener = TcpListener::bind(addr)
        .map_err(|e| anyhow::anyhow!("--metrics-bind {addr}: cannot listen: {e}"))?;
    listener.set_nonblocking(true)?;
    Ok(listener)
}

/// Serves `/metrics` from `stats` on `listener` until the runtime stops; must run on the
/// daemon's runtime.
pub fn spawn(listener: TcpListener, stats: StatsReader) {
    let app =
        Router::new().route(
            "/metrics",
            get(move || {
                let stats = stats.clone();
                async move {
                    ([(header::CONTENT_TYPE, CONTENT_TYPE)], stats.metrics_text()).into_response()
                }
            }),
        );
    tokio::spawn(async move {
        let addr = listener.local_addr().ok();
        let served = match tokio::net::TcpListener::from_std(listener) {
            Ok(listener) => {
                tracing::info!(?addr, "kvd metrics at /metrics");
                axum::serve(listener, app).await
            }
            Err(e) => Err(e),
        };
        if let Err(error) = served {
            tracing::error!(%error, "kvd metrics exporter stopped");
        }
    });
}
