//! The request transport port (PROTOCOLS §2): how the server hands one decided request to one
//! worker and gets its response back, as status, content type and a stream of body chunks.
//!
//! The relay ([`super::relay`]) owns everything around it (decision, load accounting, failover,
//! SSE error events); a transport only moves bytes. Two implementations exist: [`HttpTransport`]
//! here (`--request-transport http`, POST to `worker.url + path`) and the NATS one in
//! `infera-backends` (`--request-transport nats`); the server is handed one as an
//! `Arc<dyn RequestTransport>` and never knows which.
//!
//! # Contract
//! - [`RequestTransport::send`] resolves once the response's status is known. An `Err` there
//!   means no byte reached the client yet: [`TransportError::retry_elsewhere`] says whether the
//!   relay may try another worker.
//! - The body stream yields chunks in order; an `Err` item ends it (the relay stops reading). A
//!   transport that can cancel the worker's work does so when the stream is dropped before its
//!   end (the client went away) or ends with an error.
//! - The engine sees [`Outbound::engine_request_id`] as `X-Request-Id` and [`Outbound::dp_rank`]
//!   as [`DP_RANK_HEADER`], whichever transport carried the request (NATS puts them in the
//!   request's headers, which the worker's responder forwards).

use async_trait::async_trait;
use axum::body::Bytes;
use axum::http::{HeaderValue, Request, StatusCode, header};
use futures::StreamExt as _;
use futures::stream::BoxStream;
use http_body_util::{BodyExt as _, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use infera_core::event::WorkerRecord;
use infera_core::ids::{WorkerId, WorkerRank};

/// One request for one worker.
#[derive(Debug, Clone)]
pub struct Outbound {
    /// The worker chosen by the router.
    pub worker: WorkerId,
    /// The worker's registered URL, without a trailing slash.
    pub url: String,
    /// The API path, e.g. `/v1/completions`.
    pub path: &'static str,
    /// The JSON body to send (already re-encoded by the server).
    pub body: Bytes,
    /// Whether the client asked for a stream.
    pub stream: bool,
    /// The client-facing request id (`x-infera-request-id`).
    pub request_id: String,
    /// The engine's own request id (`X-Request-Id`), set on the legs of a PD pair: some KV
    /// connectors correlate the legs, or find their peers, through it.
    pub engine_request_id: Option<String>,
    /// The data-parallel rank to pin the request to, for a worker that fronts several ranks
    /// behind one endpoint (its rank within the worker's registration, see
    /// [`engine_dp_rank`]): sent as [`DP_RANK_HEADER`], which vLLM, SGLang and ATOM read.
    pub dp_rank: Option<u32>,
}

/// The header that pins a request to one of an engine's data-parallel ranks: vLLM's API server
/// reads `X-data-parallel-rank`, SGLang's `X-Data-Parallel-Rank` (it wins over the body's
/// `routed_dp_rank`), ATOM's proxy sends it too; HTTP header names are case-insensitive.
pub const DP_RANK_HEADER: &str = "x-data-parallel-rank";

/// The engine-side rank of `rank` on the worker `record`: its index among the ranks the worker
/// registered (`rank - record.dp_rank`), when the worker fronts more than one (`dp_size > 1`).
/// A worker of one rank needs no steering (`None`), whatever rank number it registered.
pub fn engine_dp_rank(rank: &WorkerRank, record: &WorkerRecord) -> Option<u32> {
    (record.dp_size > 1).then(|| rank.dp_rank.saturating_sub(record.dp_rank))
}

/// The body of a response, chunk by chunk.
pub type BodyStream = BoxStream<'static, Result<Bytes, TransportError>>;

/// A worker's response, once its status is known.
pub struct Inbound {
    /// The HTTP status the engine answered.
    pub status: StatusCode,
    /// The engine's content type, when the transport knows it.
    pub content_type: Option<HeaderValue>,
    /// The body.
    pub body: BodyStream,
}

impl std::fmt::Debug for Inbound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inbound")
            .field("status", &self.status)
            .field("content_type", &self.content_type)
            .finish_non_exhaustive()
    }
}

/// Why a request did not (fully) go through.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransportError {
    /// The worker could not be reached (nothing was started there); try another one.
    #[error("{0}")]
    Unreachable(String),
    /// The worker is at its admission limit; try another one, or tell the client to come back
    /// after `retry_after_s` (429).
    #[error("{message}")]
    Overloaded { message: String, retry_after_s: u32 },
    /// The worker went quiet for too long, or the request ran past its time (504). The worker
    /// was told to cancel.
    #[error("{0}")]
    Timeout(String),
    /// The reply stream lost or reordered a chunk (502): the rest of it cannot be trusted.
    #[error("{0}")]
    Sequence(String),
    /// The worker or the link failed (502).
    #[error("{0}")]
    Failed(String),
}

impl TransportError {
    /// The status a client sees for this error.
    pub fn status(&self) -> StatusCode {
        match self {
            Self::Overloaded { .. } => StatusCode::TOO_MANY_REQUESTS,
            Self::Timeout(_) => StatusCode::GATEWAY_TIMEOUT,
            Self::Unreachable(_) | Self::Sequence(_) | Self::Failed(_) => StatusCode::BAD_GATEWAY,
        }
    }

    /// Whether another worker may be tried (only before the first response byte).
    pub fn retry_elsewhere(&self) -> bool {
        matches!(self, Self::Unreachable(_) | Self::Overloaded { .. })
    }
}

/// Moves one request to one worker and its response back. See the module docs.
#[async_trait]
pub trait RequestTransport: Send + Sync + std::fmt::Debug {
    /// The transport's name, for logs (`http`, `nats`).
    fn name(&self) -> &'static str;

    /// Sends `req` and resolves once the response status is known.
    ///
    /// # Errors
    /// [`TransportError`]; none of them has delivered a byte to the client.
    async fn send(&self, req: Outbound) -> Result<Inbound, TransportError>;

    /// `worker` left the fleet (deregistered: it drains, or its lease expired, or its Pod went
    /// away). A transport whose replies cannot notice a dead worker by themselves (NATS: no
    /// connection breaks) bounds the wait on that worker's requests still in flight, so a dead
    /// worker's requests end soon while a draining worker's finish.
    fn worker_left(&self, _worker: &WorkerId) {}
}

/// `--request-transport http`: POST to `worker.url + path` with hyper-util's pooled HTTP/1
/// client (plain HTTP: workers are in-cluster). A dropped body closes the connection, which an
/// engine sees as a client disconnect.
#[derive(Debug, Clone)]
pub struct HttpTransport {
    client: Client<HttpConnector, Full<Bytes>>,
}

impl HttpTransport {
    /// A transport with its own connection pool.
    pub fn new() -> Self {
        Self {
            client: Client::builder(TokioExecutor::new()).build(nodelay_connector()),
        }
    }
}

/// An HTTP connector with `TCP_NODELAY`, so small writes (a request's head and body, streamed
/// chunks) are not held back by Nagle's algorithm. Every client that talks to engines uses it.
pub fn nodelay_connector() -> HttpConnector {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector
}

impl Default for HttpTransport {
    fn default() -> Self {
        Self::new()
    }
}

#[async_trait]
impl RequestTransport for HttpTransport {
    fn name(&self) -> &'static str {
        "http"
    }

    async fn send(&self, req: Outbound) -> Result<Inbound, TransportError> {
        let target = format!("{}{}", req.url, req.path);
        let mut builder = Request::post(&target).header(header::CONTENT_TYPE, "application/json");
        if let Ok(v) = HeaderValue::from_str(&req.request_id) {
            builder = builder.header(super::http::REQUEST_ID, v);
        }
        if let Some(v) = req
            .engine_request_id
            .as_deref()
            .and_then(|v| HeaderValue::from_str(v).ok())
        {
            builder = builder.header("x-request-id", v);
        }
        if let Some(rank) = req.dp_rank {
            builder = builder.header(DP_RANK_HEADER, rank);
        }
        let http_req = builder.body(Full::new(req.body)).map_err(|e| {
            TransportError::Failed(format!("cannot build the request to {target}: {e}"))
        })?;
        let resp = self.client.request(http_req).await.map_err(|e| {
            TransportError::Unreachable(format!(
                "worker {} at {}: {e}",
                req.worker.as_str(),
                req.url
            ))
        })?;
        let (parts, body) = resp.into_parts();
        let body = body
            .into_data_stream()
            .map(|r| r.map_err(|e| TransportError::Failed(e.to_string())))
            .boxed();
        Ok(Inbound {
            status: parts.status,
            content_type: parts.headers.get(header::CONTENT_TYPE).cloned(),
            body,
        })
    }
}
