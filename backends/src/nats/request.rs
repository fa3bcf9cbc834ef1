//! `--request-transport nats`, server side: [`NatsTransport`] publishes each request on its
//! worker's subject with a fresh reply inbox and turns the replies into an
//! [`Inbound`](infera_adapters::server::transport::Inbound).
//!
//! # Behaviour
//! - Admission: with `max_pending`, a worker with that many requests in flight from this server
//!   is refused at once ([`TransportError::Overloaded`], 429 with `Retry-After: 1`), which the
//!   relay retries on another worker. The count is released when the reply ends or is dropped.
//!   It is this server's own count (the Python Infera reads a JetStream work queue's backlog
//!   instead), so each server replica admits up to the limit.
//! - Status: a stream whose first chunk is SSE is answered 200 `text/event-stream` at once;
//!   anything else (a non-stream request, or an engine that answered a stream request with a
//!   JSON body) is collected until `done`, whose `rs-status` becomes the status.
//! - Timeouts: `idle_timeout` bounds the wait for each reply, `max_duration` the whole request;
//!   either one ends it with [`TransportError::Timeout`] (504).
//! - Order: replies carrying `rs-seq` must arrive as 0, 1, 2 …; anything else ends the request
//!   with [`TransportError::Sequence`], so a lost chunk is never relayed as a complete stream.
//! - Cancel: a reply stream dropped before `done` or `error` (client gone, timeout, sequence
//!   error) publishes its inbox on `infera.cancel.<token>`.
//! - Failover: no subscriber on the subject (the broker's no-responders status) or an `error`
//!   reply before any data is [`TransportError::Unreachable`], retried on another worker.
//!
//! Cancels are published by one task owned by the transport; it ends when the transport is
//! dropped. A cancel that finds its queue full is logged and dropped.

use super::{
    HDR_SEQ, HDR_STATUS, HDR_TYPE, TYPE_DATA, TYPE_DONE, TYPE_ERROR, cancel_subject,
    encode_request, request_subject,
};
use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use futures::StreamExt as _;
use infera_adapters::server::RequestTransport;
use infera_adapters::server::transport::{Inbound, Outbound, TransportError};
use infera_core::ids::WorkerId;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::time::Instant;

/// Limits of NATS requests (`--nats-req-*`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NatsRequestConfig {
    /// Longest wait for the next reply (`--nats-req-idle-timeout`); `None` waits forever.
    pub idle_timeout: Option<Duration>,
    /// Longest whole request (`--nats-req-max-duration`); `None` is unbounded.
    pub max_duration: Option<Duration>,
    /// In-flight requests per worker (`--nats-req-max-pending`); `None` is unbounded.
    pub max_pending: Option<u32>,
}

/// Cancels waiting to be published.
const CANCEL_QUEUE: usize = 4096;

/// The NATS request transport. See the module docs.
#[derive(Debug)]
pub struct NatsTransport {
    client: async_nats::Client,
    config: NatsRequestConfig,
    pending: Mutex<HashMap<WorkerId, Arc<AtomicU32>>>,
    cancels: mpsc::Sender<Cancel>,
}

#[derive(Debug)]
struct Cancel {
    subject: String,
    inbox: String,
}

impl NatsTransport {
    /// A transport on `client`. Must be called inside a tokio runtime (it starts the task that
    /// publishes cancels).
    pub fn new(client: async_nats::Client, config: NatsRequestConfig) -> Self {
        let (cancels, mut queue) = mpsc::channel::<Cancel>(CANCEL_QUEUE);
        let publisher = client.clone();
        tokio::spawn(async move {
            while let Some(c) = queue.recv().await {
                if let Err(e) = publisher
                    .publish(c.subject.clone(), Bytes::from(c.inbox))
                    .await
                {
                    tracing::warn!(subject = %c.subject, error = %e, "cannot publish a cancel");
                }
            }
        });
        Self {
            client,
            config,
            pending: Mutex::new(HashMap::new()),
            cancels,
        }
    }

    fn admit(&self, worker: &WorkerId) -> Result<Option<Permit>, TransportError> {
        let Some(max) = self.config.max_pending else {
            return Ok(None);
        };
        let counter = Arc::clone(
            self.pending
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .entry(worker.clone())
                .or_default(),
        );
        counter
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .map_err(|n| TransportError::Overloaded {
                message: format!(
                    "worker {} has {n} requests in flight, its limit (--nats-req-max-pending)",
                    worker.as_str()
                ),
                retry_after_s: 1,
            })?;
        Ok(Some(Permit(counter)))
    }
}

/// One admitted in-flight request; released on drop.
#[derive(Debug)]
struct Permit(Arc<AtomicU32>);

impl Drop for Permit {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

#[async_trait]
impl RequestTransport for NatsTransport {
    fn name(&self) -> &'static str {
        "nats"
    }

    async fn send(&self, req: Outbound) -> Result<Inbound, TransportError> {
        let permit = self.admit(&req.worker)?;
        let worker = req.worker.as_str();
        let subject = request_subject(worker);
        let inbox = self.client.new_inbox();
        let sub = self
            .client
            .subscribe(inbox.clone())
            .await
            .map_err(|e| TransportError::Unreachable(format!("nats subscribe failed: {e}")))?;
        let payload = encode_request(
            req.path,
            req.stream,
            &[
                ("content-type", "application/json"),
                ("x-infera-request-id", &req.request_id),
            ],
            &req.body,
        );
        self.client
            .publish_with_reply(subject.clone(), inbox.clone(), Bytes::from(payload))
            .await
            .map_err(|e| TransportError::Unreachable(format!("nats publish failed: {e}")))?;
        let mut reply = Reply {
            sub,
            worker: req.worker.clone(),
            next_seq: 0,
            started: Instant::now(),
            config: self.config,
            cancel: CancelOnDrop {
                tx: self.cancels.clone(),
                subject: Some(cancel_subject(worker)),
                inbox,
            },
            _permit: permit,
        };
        let first = match reply.next().await {
            Ok(first) => first,
            Err(TransportError::Failed(e)) => {
                return Err(TransportError::Unreachable(format!(
                    "worker {worker} failed the request: {e}"
                )));
            }
            Err(e) => return Err(e),
        };
        match first {
            Chunk::Done(status) => Ok(Inbound {
                status,
                content_type: None,
                body: futures::stream::empty().boxed(),
            }),
            Chunk::Data(data) if req.stream && !data.starts_with(b"{") => Ok(Inbound {
                status: axum::http::StatusCode::OK,
                content_type: Some(axum::http::HeaderValue::from_static("text/event-stream")),
                body: futures::stream::once(async move { Ok(data) })
                    .chain(reply.into_stream())
                    .boxed(),
            }),
            Chunk::Data(data) => {
                let mut body = BytesMut::from(&data[..]);
                loop {
                    match reply.next().await? {
                        Chunk::Data(more) => body.extend_from_slice(&more),
                        Chunk::Done(status) => {
                            let body = body.freeze();
                            return Ok(Inbound {
                                status,
                                content_type: Some(axum::http::HeaderValue::from_static(
                                    "application/json",
                                )),
                                body: futures::stream::once(async move { Ok(body) }).boxed(),
                            });
                        }
                    }
                }
            }
        }
    }
}

/// Publishes the inbox on the cancel subject when dropped while armed.
#[derive(Debug)]
struct CancelOnDrop {
    tx: mpsc::Sender<Cancel>,
    /// `None` once disarmed.
    subject: Option<String>,
    inbox: String,
}

impl CancelOnDrop {
    fn disarm(&mut self) {
        self.subject = None;
    }
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if let Some(subject) = self.subject.take() {
            let inbox = std::mem::take(&mut self.inbox);
            if self.tx.try_send(Cancel { subject, inbox }).is_err() {
                tracing::warn!("cancel queue full; a worker keeps generating for nobody");
            }
        }
    }
}

enum Chunk {
    Data(Bytes),
    Done(axum::http::StatusCode),
}

/// The replies of one request.
struct Reply {
    sub: async_nats::Subscriber,
    worker: WorkerId,
    next_seq: u64,
    started: Instant,
    config: NatsRequestConfig,
    cancel: CancelOnDrop,
    _permit: Option<Permit>,
}

impl Reply {
    /// The next data or done reply. An `Err` ends the request.
    async fn next(&mut self) -> Result<Chunk, TransportError> {
        loop {
            let msg = self.recv().await?;
            if msg.status == Some(async_nats::StatusCode::NO_RESPONDERS) {
                self.cancel.disarm();
                return Err(TransportError::Unreachable(format!(
                    "worker {} is not subscribed to {}",
                    self.worker.as_str(),
                    request_subject(self.worker.as_str())
                )));
            }
            let header = |name: &str| {
                msg.headers
                    .as_ref()
                    .and_then(|h| h.get(name))
                    .map(|v| v.as_str().to_owned())
            };
            if let Some(seq) = header(HDR_SEQ) {
                let expected = self.next_seq;
                match seq.trim().parse::<u64>() {
                    Ok(n) if n == expected => self.next_seq += 1,
                    _ => {
                        return Err(TransportError::Sequence(format!(
                            "worker {} sent reply {seq:?} where {expected} was due; a chunk \
                             was lost or reordered, so the rest of the reply is dropped",
                            self.worker.as_str()
                        )));
                    }
                }
            }
            match header(HDR_TYPE).as_deref().unwrap_or(TYPE_DATA) {
                TYPE_DATA if msg.payload.is_empty() => {}
                TYPE_DATA => return Ok(Chunk::Data(msg.payload)),
                TYPE_DONE => {
                    self.cancel.disarm();
                    let status = header(HDR_STATUS)
                        .and_then(|s| s.trim().parse::<u16>().ok())
                        .and_then(|s| axum::http::StatusCode::from_u16(s).ok())
                        .unwrap_or(axum::http::StatusCode::OK);
                    return Ok(Chunk::Done(status));
                }
                TYPE_ERROR => {
                    self.cancel.disarm();
                    return Err(TransportError::Failed(
                        String::from_utf8_lossy(&msg.payload).into_owned(),
                    ));
                }
                other => {
                    return Err(TransportError::Failed(format!(
                        "worker {} sent a reply of unknown {HDR_TYPE} {other:?}",
                        self.worker.as_str()
                    )));
                }
            }
        }
    }

    async fn recv(&mut self) -> Result<async_nats::Message, TransportError> {
        let now = Instant::now();
        let idle = self.config.idle_timeout.map(|d| now + d);
        let total = self.config.max_duration.map(|d| self.started + d);
        let deadline = match (idle, total) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let msg = match deadline {
            None => self.sub.next().await,
            Some(at) => match tokio::time::timeout_at(at, self.sub.next()).await {
                Ok(msg) => msg,
                Err(_) => {
                    let why = match (total, self.config.max_duration) {
                        (Some(t), Some(d)) if t <= at => {
                            format!("the request ran past --nats-req-max-duration ({d:?})")
                        }
                        _ => format!(
                            "no reply for --nats-req-idle-timeout ({:?})",
                            self.config.idle_timeout.unwrap_or_default()
                        ),
                    };
                    return Err(TransportError::Timeout(format!(
                        "worker {}: {why}; the worker was told to cancel",
                        self.worker.as_str()
                    )));
                }
            },
        };
        msg.ok_or_else(|| TransportError::Failed("the nats reply subscription closed".to_owned()))
    }

    fn into_stream(self) -> infera_adapters::server::transport::BodyStream {
        futures::stream::unfold(Some(self), |state| async move {
            let mut reply = state?;
            match reply.next().await {
                Ok(Chunk::Data(data)) => Some((Ok(data), Some(reply))),
                Ok(Chunk::Done(_)) => None,
                Err(e) => Some((Err(e), None)),
            }
        })
        .boxed()
    }
}
