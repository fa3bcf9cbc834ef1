//! `--request-transport http`: the request transport port
//! ([`infera_core::ports::transport`]) over HTTP/1 — POST to `worker.url + path` with
//! hyper-util's pooled client (plain HTTP: workers are in-cluster), the port's headers as they
//! are. A dropped body closes the connection, which an engine sees as a client disconnect.
//!
//! # Deadlines ([`HttpDeadlines`], the `--http-req-*` flags; `None` is off)
//! - `connect`: the TCP connect to a worker. Past it the attempt is
//!   [`TransportError::Unreachable`] (nothing was started there: another worker is tried).
//! - `first_byte`: from sending the request to the first byte of the response *body* (the head
//!   alone is not enough: a streaming engine sends it before its first token). Past it the
//!   attempt is [`TransportError::Timeout`]; the relay may still try another worker, since the
//!   client has seen nothing. Unless a fixed one is configured, each request's own deadline
//!   applies ([`Outbound::first_byte_deadline`], which the service derives from the prompt's
//!   uncached tokens and the worker's prefill rate), or [`UNDERIVED_FIRST_BYTE`] for a request
//!   it derived none for.
//! - `idle`: the longest gap between two body chunks after the first (and before the first when
//!   `first_byte` is off). Past it the body stream ends with [`TransportError::Timeout`].
//! - `max_duration`: the whole response, head to last byte.
//!
//! Every expiry drops the request, which closes its connection: the engine aborts the request.

use async_trait::async_trait;
use axum::body::Bytes;
use axum::http::{Request, StatusCode, header};
use futures::StreamExt as _;
use http_body_util::{BodyExt as _, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use infera_core::event::WorkerRecord;
use infera_core::ports::transport::{
    BodyStream, Inbound, Outbound, RequestTransport, TransportError,
};
use std::time::Duration;
use tokio::time::Instant;

/// The first-byte deadline of a request the service derived none for (a PD leg, a migration).
pub const UNDERIVED_FIRST_BYTE: Duration = Duration::from_secs(900);

/// Request sent → first body byte (`--http-req-first-byte-timeout`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum FirstByteDeadline {
    /// Each request's own ([`Outbound::first_byte_deadline`], else [`UNDERIVED_FIRST_BYTE`]).
    #[default]
    Derived,
    /// None: the wait is unbounded (`0`).
    Off,
    /// The same for every request.
    Fixed(Duration),
}

/// The deadlines of requests to workers. See the module docs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HttpDeadlines {
    /// TCP connect (`--http-req-connect-timeout`).
    pub connect: Option<Duration>,
    /// Request sent → first body byte.
    pub first_byte: FirstByteDeadline,
    /// Gap between body chunks (`--http-req-idle-timeout`).
    pub idle: Option<Duration>,
    /// The whole response (`--http-req-max-duration`).
    pub max_duration: Option<Duration>,
}

/// The HTTP request transport. See the module docs.
#[derive(Debug, Clone)]
pub struct HttpTransport {
    client: Client<HttpConnector, Full<Bytes>>,
    deadlines: HttpDeadlines,
}

impl HttpTransport {
    /// A transport with its own connection pool and no deadlines.
    pub fn new() -> Self {
        Self::with_deadlines(HttpDeadlines::default())
    }

    /// A transport with its own connection pool and `deadlines`.
    pub fn with_deadlines(deadlines: HttpDeadlines) -> Self {
        let mut connector = nodelay_connector();
        connector.set_connect_timeout(deadlines.connect);
        Self {
            client: Client::builder(TokioExecutor::new()).build(connector),
            deadlines,
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

/// `e` and its causes, `: `-separated (hyper's own message is only "client error (Connect)").
fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        out.push_str(": ");
        out.push_str(&c.to_string());
        cause = c.source();
    }
    out
}

/// The earlier of two optional instants.
fn earliest(a: Option<Instant>, b: Option<Instant>) -> Option<Instant> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// Awaits `fut` until `deadline` (forever when `None`); `None` when it expired.
async fn until<F: std::future::Future>(deadline: Option<Instant>, fut: F) -> Option<F::Output> {
    match deadline {
        Some(d) => tokio::time::timeout_at(d, fut).await.ok(),
        None => Some(fut.await),
    }
}

/// What the body stream of one response waits on.
struct BodyDeadlines {
    deadlines: HttpDeadlines,
    /// When the first body byte is due (from the request's start), until it came.
    first_byte: Option<Instant>,
    /// What set `first_byte`, for the error message.
    first_byte_flag: &'static str,
    /// When the whole response is due.
    end: Option<Instant>,
    started: bool,
    worker: String,
}

impl BodyDeadlines {
    /// The deadline of the next chunk, and the flag that set it (for the error message).
    fn next(&self) -> (Option<Instant>, &'static str) {
        let gap = if self.started || self.first_byte.is_none() {
            self.deadlines.idle.map(|d| Instant::now() + d)
        } else {
            self.first_byte
        };
        let flag = if !self.started && self.first_byte.is_some() {
            self.first_byte_flag
        } else {
            "--http-req-idle-timeout"
        };
        match (gap, self.end) {
            (Some(g), Some(e)) if e < g => (Some(e), "--http-req-max-duration"),
            (None, Some(e)) => (Some(e), "--http-req-max-duration"),
            (g, _) => (g, flag),
        }
    }
}

/// `body` with the deadlines applied: an expiry yields one [`TransportError::Timeout`] and ends
/// the stream (dropping the connection).
fn bounded(body: BodyStream, deadlines: BodyDeadlines) -> BodyStream {
    futures::stream::unfold(Some((body, deadlines)), |state| async move {
        let (mut body, mut d) = state?;
        let (deadline, flag) = d.next();
        match until(deadline, body.next()).await {
            Some(Some(Ok(chunk))) => {
                d.started |= !chunk.is_empty();
                Some((Ok(chunk), Some((body, d))))
            }
            Some(Some(Err(e))) => Some((Err(e), None)),
            Some(None) => None,
            None => {
                let what = if d.started {
                    "went silent mid-response"
                } else {
                    "sent no response byte"
                };
                let e = TransportError::Timeout(format!(
                    "worker {} {what} within its deadline ({flag}); the request was dropped",
                    d.worker
                ));
                Some((Err(e), None))
            }
        }
    })
    .boxed()
}

#[async_trait]
impl RequestTransport for HttpTransport {
    fn name(&self) -> &'static str {
        "http"
    }

    async fn send(&self, req: Outbound) -> Result<Inbound, TransportError> {
        let start = Instant::now();
        let (first_byte, first_byte_flag) = match self.deadlines.first_byte {
            FirstByteDeadline::Fixed(fixed) => (Some(fixed), "--http-req-first-byte-timeout"),
            FirstByteDeadline::Derived => (
                Some(req.first_byte_deadline.unwrap_or(UNDERIVED_FIRST_BYTE)),
                "the first-byte deadline derived from the prompt; \
                 --http-req-first-byte-timeout fixes one",
            ),
            FirstByteDeadline::Off => (None, "--http-req-first-byte-timeout"),
        };
        let first_byte = first_byte.map(|d| start + d);
        let end = self.deadlines.max_duration.map(|d| start + d);
        let target = format!("{}{}", req.url, req.path);
        let mut builder = Request::post(&target).header(header::CONTENT_TYPE, "application/json");
        if let Some(headers) = builder.headers_mut() {
            headers.extend(req.headers);
        }
        let http_req = builder.body(Full::new(req.body)).map_err(|e| {
            TransportError::Failed(format!("cannot build the request to {target}: {e}"))
        })?;
        let worker = format!("{} at {}", req.worker.as_str(), req.url);
        let Some(sent) = until(earliest(first_byte, end), self.client.request(http_req)).await
        else {
            let flag = if earliest(first_byte, end) == first_byte {
                first_byte_flag
            } else {
                "--http-req-max-duration"
            };
            return Err(TransportError::Timeout(format!(
                "worker {worker} sent no response within its deadline ({flag}); \
                 the request was dropped"
            )));
        };
        let resp = sent
            .map_err(|e| TransportError::Unreachable(format!("worker {worker}: {}", chain(&e))))?;
        let (parts, body) = resp.into_parts();
        let body = body
            .into_data_stream()
            .map(|r| r.map_err(|e| TransportError::Failed(chain(&e))))
            .boxed();
        let body = if first_byte.is_none() && end.is_none() && self.deadlines.idle.is_none() {
            body
        } else {
            bounded(
                body,
                BodyDeadlines {
                    deadlines: self.deadlines,
                    first_byte,
                    first_byte_flag,
                    end,
                    started: false,
                    worker,
                },
            )
        };
        Ok(Inbound {
            status: parts.status,
            content_type: parts.headers.get(header::CONTENT_TYPE).cloned(),
            body,
        })
    }

    /// `GET /health` on the worker's URL: 200 passes. The body is drained, at most a few KiB,
    /// so the connection returns to the pool.
    async fn probe(&self, worker: &WorkerRecord) -> Result<(), TransportError> {
        let target = format!("{}/health", worker.url.trim_end_matches('/'));
        let req = Request::get(&target)
            .body(Full::new(Bytes::new()))
            .map_err(|e| {
                TransportError::Failed(format!("cannot build a probe of {target}: {e}"))
            })?;
        let resp = self
            .client
            .request(req)
            .await
            .map_err(|e| TransportError::Unreachable(format!("{target}: {}", chain(&e))))?;
        let status = resp.status();
        let _ = http_body_util::Limited::new(resp.into_body(), 64 << 10)
            .collect()
            .await;
        if status == StatusCode::OK {
            Ok(())
        } else {
            Err(TransportError::Failed(format!(
                "{target} answered {status}"
            )))
        }
    }
}
