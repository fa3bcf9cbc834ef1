//! The request transport port (PROTOCOLS.md §2): how the server hands one decided request to
//! one worker and gets its response back, as status, content type and a stream of body chunks.
//!
//! The relay owns everything around it (decision, load accounting, failover, SSE error events);
//! a transport only moves bytes. Implementations: the HTTP one in `infera-adapters`
//! (`--request-transport http`, POST to `worker.url + path`) and the NATS one in
//! `infera-backends` (`--request-transport nats`); the server holds one as an
//! `Arc<dyn RequestTransport>` and never knows which.
//!
//! # Contract
//! - [`RequestTransport::send`] resolves once the response's status is known. An `Err` there
//!   means no byte reached the client yet: [`TransportError::retry_elsewhere`] says whether the
//!   relay may try another worker.
//! - The body stream yields chunks in order; an `Err` item ends it (the relay stops reading). A
//!   transport that can cancel the worker's work does so when the stream is dropped before its
//!   end (the client went away) or ends with an error.
//! - [`Outbound::headers`] are built once by the caller and sent as they are by every transport
//!   (HTTP request headers; NATS message headers, which the worker's responder forwards): the
//!   client-facing request id, the engine's `X-Request-Id`, the [`DP_RANK_HEADER`] pin, and the
//!   attempt's trace context when traces are exported ([`super::trace`]).

use crate::event::WorkerRecord;
use crate::ids::{WorkerId, WorkerRank};
use async_trait::async_trait;
use bytes::Bytes;
use futures::stream::BoxStream;
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};

/// The request-id header the server echoes or generates (`x-infera-request-id`).
pub const REQUEST_ID_HEADER: HeaderName = HeaderName::from_static("x-infera-request-id");
/// The engine's own request id (`X-Request-Id`), set on the legs of a PD pair: some KV
/// connectors correlate the legs, or find their peers, through it.
pub const ENGINE_REQUEST_ID_HEADER: HeaderName = HeaderName::from_static("x-request-id");
/// The header that pins a request to one of an engine's data-parallel ranks: vLLM's API server
/// reads `X-data-parallel-rank`, SGLang's `X-Data-Parallel-Rank` (it wins over the body's
/// `routed_dp_rank`), ATOM's proxy sends it too; HTTP header names are case-insensitive.
pub const DP_RANK_HEADER: HeaderName = HeaderName::from_static("x-data-parallel-rank");

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
    /// The headers every transport sends with the request (see the module docs).
    pub headers: HeaderMap,
    /// How long the worker may take to its first byte, derived by the service from the
    /// request's work (see `service::deadline`); a transport configured with a fixed deadline
    /// applies that one instead. `None`: the service derived none (a PD leg, a migration).
    pub first_byte_deadline: Option<std::time::Duration>,
}

impl Outbound {
    /// A request for `worker` at `url + path` carrying `request_id` (the client-facing id).
    /// A request id that is not a valid header value is left out.
    pub fn new(
        worker: WorkerId,
        url: impl Into<String>,
        path: &'static str,
        body: Bytes,
        stream: bool,
        request_id: &str,
    ) -> Self {
        let mut headers = HeaderMap::with_capacity(3);
        if let Ok(v) = HeaderValue::from_str(request_id) {
            headers.insert(REQUEST_ID_HEADER, v);
        }
        Self {
            worker,
            url: url.into(),
            path,
            body,
            stream,
            headers,
            first_byte_deadline: None,
        }
    }

    /// Sets [`Outbound::first_byte_deadline`].
    #[must_use]
    pub fn with_first_byte_deadline(mut self, deadline: std::time::Duration) -> Self {
        self.first_byte_deadline = Some(deadline);
        self
    }

    /// Adds the engine's own request id (`X-Request-Id`); an invalid value is left out.
    #[must_use]
    pub fn with_engine_request_id(mut self, id: Option<&str>) -> Self {
        if let Some(v) = id.and_then(|v| HeaderValue::from_str(v).ok()) {
            self.headers.insert(ENGINE_REQUEST_ID_HEADER, v);
        }
        self
    }

    /// Pins the request to the engine's data-parallel rank `rank` (see [`engine_dp_rank`]).
    #[must_use]
    pub fn with_dp_rank(mut self, rank: Option<u32>) -> Self {
        if let Some(rank) = rank {
            self.headers.insert(DP_RANK_HEADER, HeaderValue::from(rank));
        }
        self
    }

    /// The client-facing request id, as sent.
    pub fn request_id(&self) -> &str {
        self.header(&REQUEST_ID_HEADER).unwrap_or_default()
    }

    /// The engine dp rank the request is pinned to, if any.
    pub fn dp_rank(&self) -> Option<u32> {
        self.header(&DP_RANK_HEADER)?.parse().ok()
    }

    /// The value of `name`, when it is set and text.
    pub fn header(&self, name: &HeaderName) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

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
    /// The status a client sees for this error (its [`crate::error::ErrorCode`]'s).
    pub fn status(&self) -> StatusCode {
        crate::error::ServiceError::code(self).http_status()
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

    /// Checks that `worker`'s engine answers at all (HTTP: `GET /health` answers 200), for the
    /// server's active health checks; the caller bounds the wait. A transport that cannot
    /// probe reports every worker healthy (the default).
    ///
    /// # Errors
    /// Why the worker failed the probe.
    async fn probe(&self, _worker: &WorkerRecord) -> Result<(), TransportError> {
        Ok(())
    }

    /// `worker` left the fleet (deregistered: it drains, or its lease expired, or its Pod went
    /// away). A transport whose replies cannot notice a dead worker by themselves (NATS: no
    /// connection breaks) bounds the wait on that worker's requests still in flight, so a dead
    /// worker's requests end soon while a draining worker's finish.
    fn worker_left(&self, _worker: &WorkerId) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_are_built_once_and_invalid_values_left_out() {
        let out = Outbound::new(
            WorkerId::new("w:1"),
            "http://w:1",
            "/v1/x",
            Bytes::new(),
            true,
            "r-1",
        )
        .with_engine_request_id(Some("e-1"))
        .with_dp_rank(Some(3));
        assert_eq!(out.request_id(), "r-1");
        assert_eq!(out.header(&ENGINE_REQUEST_ID_HEADER), Some("e-1"));
        assert_eq!(out.header(&DP_RANK_HEADER), Some("3"));
        assert_eq!(out.dp_rank(), Some(3));
        let bad = Outbound::new(WorkerId::new("w:1"), "u", "/p", Bytes::new(), false, "a\nb")
            .with_engine_request_id(Some("x\u{7f}"))
            .with_dp_rank(None);
        assert!(bad.headers.is_empty());
        assert_eq!(bad.request_id(), "");
    }
}
