//! `--request-transport nats`, server side: [`NatsTransport`] publishes each request on its
//! worker's subject with a fresh reply inbox and turns the replies into an
//! [`Inbound`] (the request transport port of `infera_core::ports::transport`).
//!
//! # Behaviour
//! - Admission: with `max_pending`, a worker with that many requests in flight from this server
//!   is refused at once ([`TransportError::Overloaded`], 429 with `Retry-After: 1`), which the
//!   relay retries on another worker; so is a request the worker refused at its own
//!   `--nats-req-max-pending` (an `error` reply with `rs-status: 429`). The count is released when the reply ends or is dropped.
//!   It is this server's own count (the Python Infera reads a JetStream work queue's backlog
//!   instead), so each server replica admits up to the limit.
//! - Status: a stream whose first chunk is SSE is answered 200 `text/event-stream` at once;
//!   anything else (a non-stream request, or an engine that answered a stream request with a
//!   JSON body) is collected until `done`, whose `rs-status` becomes the status.
//! - Timeouts: `idle_timeout` bounds the wait for each reply, `max_duration` the whole request;
//!   either one ends it with [`TransportError::Timeout`] (504). So does an `error` reply with
//!   `rs-status: 504`, the worker's own max duration (it has cancelled the engine request
//!   itself, so no cancel is sent and no other worker is tried).
//! - Order: replies carrying `rs-seq` must arrive as 0, 1, 2 …; anything else ends the request
//!   with [`TransportError::Sequence`], so a lost chunk is never relayed as a complete stream.
//! - Cancel: a reply stream dropped before `done` or `error` (client gone, timeout, sequence
//!   error) publishes its inbox on `infera.cancel.<token>`.
//! - Failover: no subscriber on the subject (the broker's no-responders status) or an `error`
//!   reply before any data is [`TransportError::Unreachable`], retried on another worker.
//! - Broker restarts: a request sent while the broker is away waits in the client's buffer and
//!   goes out on the reconnect; if its worker has not resubscribed yet, it is re-sent every
//!   200 ms for up to 6 s before it counts as unreachable, so it is not lost to the race
//!   between the two reconnects.
//!
//! - A worker that leaves the fleet (deregistered: drained, or dead with its lease expired) gets
//!   at most [`LEFT_IDLE`] per reply from then on ([`RequestTransport::worker_left`]): a draining
//!   worker finishes its streams, a killed one (which breaks no connection here) ends them with
//!   a 504 error event soon after it leaves instead of at the idle timeout.
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
use infera_core::ids::WorkerId;
use infera_core::ports::transport::{
    BodyStream, Inbound, Outbound, RequestTransport, TransportError,
};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

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
/// How long a request published while the broker was away is re-sent to a worker that has no
/// subscription yet (it reconnects with its own backoff, up to 4 s).
const REDELIVERY_WINDOW: Duration = Duration::from_secs(6);
/// The pause between those re-sends.
const REDELIVERY_STEP: Duration = Duration::from_millis(200);
/// Longest wait for each reply from a worker that left the fleet: one that drains keeps
/// sending; one that died sends nothing, and its request ends this long after it left.
pub const LEFT_IDLE: Duration = Duration::from_secs(5);

/// The NATS request transport. See the module docs.
#[derive(Debug)]
pub struct NatsTransport {
    client: async_nats::Client,
    config: NatsRequestConfig,
    pending: Mutex<HashMap<WorkerId, Arc<AtomicU32>>>,
    cancels: mpsc::Sender<Cancel>,
    /// Per worker, cancelled when it leaves the fleet ([`RequestTransport::worker_left`]).
    present: Mutex<HashMap<WorkerId, CancellationToken>>,
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
            present: Mutex::new(HashMap::new()),
        }
    }

    /// The token that `worker`'s departure cancels.
    fn presence(&self, worker: &WorkerId) -> CancellationToken {
        self.present
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(worker.clone())
            .or_default()
            .clone()
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

    fn worker_left(&self, worker: &WorkerId) {
        let token = self
            .present
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(worker);
        if let Some(token) = token {
            token.cancel();
        }
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
        let mut headers = vec![("content-type", "application/json")];
        headers.extend(
            req.headers
                .iter()
                .filter_map(|(k, v)| Some((k.as_str(), v.to_str().ok()?))),
        );
        let payload = Bytes::from(encode_request(req.path, req.stream, &headers, &req.body));
        // Published while the broker is away, the request waits in the client's buffer and
        // goes out on the reconnect, possibly before the worker has resubscribed.
        let offline = self.client.connection_state() != async_nats::connection::State::Connected;
        let publish = || {
            self.client
                .publish_with_reply(subject.clone(), inbox.clone(), payload.clone())
        };
        publish()
            .await
            .map_err(|e| TransportError::Unreachable(format!("nats publish failed: {e}")))?;
        let mut reply = Reply {
            sub,
            left: self.presence(&req.worker),
            worker: req.worker.clone(),
            next_seq: 0,
            started: Instant::now(),
            config: self.config,
            cancel: CancelOnDrop {
                tx: self.cancels.clone(),
                subject: Some(cancel_subject(worker)),
                inbox: inbox.clone(),
            },
            _permit: permit,
        };
        let redeliver_until = offline.then(|| Instant::now() + REDELIVERY_WINDOW);
        let first = loop {
            match reply.next().await {
                // No subscriber yet after a reconnect: give the worker time to resubscribe.
                Err(TransportError::Unreachable(_))
                    if redeliver_until.is_some_and(|t| Instant::now() < t) =>
                {
                    tokio::time::sleep(REDELIVERY_STEP).await;
                    reply.cancel.subject = Some(cancel_subject(worker));
                    publish().await.map_err(|e| {
                        TransportError::Unreachable(format!("nats publish failed: {e}"))
                    })?;
                }
                other => break other,
            }
        };
        let first = match first {
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
                status: http::StatusCode::OK,
                content_type: Some(http::HeaderValue::from_static("text/event-stream")),
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
                                content_type: Some(http::HeaderValue::from_static(
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

#[derive(Debug, PartialEq)]
enum Chunk {
    Data(Bytes),
    Done(http::StatusCode),
}

/// Reads one reply message of `worker`: its `rs-seq` (checked against `next_seq`, which it
/// advances), `rs-type` and `rs-status`. A missing `rs-type` is `data` and a missing or invalid
/// `rs-status` is 200, as the Python Infera reads them; a missing `rs-seq` is not checked.
fn parse_reply(
    msg: &async_nats::Message,
    next_seq: &mut u64,
    worker: &str,
) -> Result<Chunk, TransportError> {
    if msg.status == Some(async_nats::StatusCode::NO_RESPONDERS) {
        return Err(TransportError::Unreachable(format!(
            "worker {worker} is not subscribed to {}",
            request_subject(worker)
        )));
    }
    let header = |name: &str| {
        msg.headers
            .as_ref()
            .and_then(|h| h.get(name))
            .map(|v| v.as_str().to_owned())
    };
    if let Some(seq) = header(HDR_SEQ) {
        let expected = *next_seq;
        match seq.trim().parse::<u64>() {
            Ok(n) if n == expected => *next_seq += 1,
            _ => {
                return Err(TransportError::Sequence(format!(
                    "worker {worker} sent reply {seq:?} where {expected} was due; a chunk was \
                     lost or reordered, so the rest of the reply is dropped"
                )));
            }
        }
    }
    match header(HDR_TYPE).as_deref().unwrap_or(TYPE_DATA) {
        TYPE_DATA => Ok(Chunk::Data(msg.payload.clone())),
        TYPE_DONE => Ok(Chunk::Done(
            header(HDR_STATUS)
                .and_then(|s| s.trim().parse::<u16>().ok())
                .and_then(|s| http::StatusCode::from_u16(s).ok())
                .unwrap_or(http::StatusCode::OK),
        )),
        // The worker is at its --nats-req-max-pending: try another one.
        TYPE_ERROR if header(HDR_STATUS).is_some_and(|s| s.trim() == "429") => {
            Err(TransportError::Overloaded {
                message: format!("worker {worker}: {}", String::from_utf8_lossy(&msg.payload)),
                retry_after_s: 1,
            })
        }
        // The worker's own --nats-req-max-duration or idle timeout ended it: a timeout, not a
        // failed worker.
        TYPE_ERROR if header(HDR_STATUS).is_some_and(|s| s.trim() == "504") => {
            Err(TransportError::Timeout(format!(
                "worker {worker}: {}",
                String::from_utf8_lossy(&msg.payload)
            )))
        }
        TYPE_ERROR => Err(TransportError::Failed(
            String::from_utf8_lossy(&msg.payload).into_owned(),
        )),
        other => Err(TransportError::Failed(format!(
            "worker {worker} sent a reply of unknown {HDR_TYPE} {other:?}"
        ))),
    }
}

/// The replies of one request.
struct Reply {
    sub: async_nats::Subscriber,
    /// Cancelled when the worker leaves the fleet.
    left: CancellationToken,
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
            let parsed = parse_reply(&msg, &mut self.next_seq, self.worker.as_str());
            if matches!(
                parsed,
                Ok(Chunk::Done(_))
                    | Err(TransportError::Failed(_)
                        | TransportError::Unreachable(_)
                        | TransportError::Timeout(_))
            ) {
                // The worker is done with it (or never had it): nothing to cancel.
                self.cancel.disarm();
            }
            match parsed {
                Ok(Chunk::Data(data)) if data.is_empty() => {}
                other => return other,
            }
        }
    }

    async fn recv(&mut self) -> Result<async_nats::Message, TransportError> {
        loop {
            let now = Instant::now();
            // A worker that left the fleet may be draining (it still sends) or dead (it never
            // will): it gets at most LEFT_IDLE per reply.
            let left = self.left.is_cancelled();
            let idle = match (self.config.idle_timeout, left) {
                (Some(d), true) => Some(d.min(LEFT_IDLE)),
                (None, true) => Some(LEFT_IDLE),
                (d, false) => d,
            };
            let total = self.config.max_duration.map(|d| self.started + d);
            let deadline = match (idle.map(|d| now + d), total) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            let token = self.left.clone();
            let next = async {
                tokio::select! {
                    msg = self.sub.next() => Some(msg),
                    () = token.cancelled(), if !left => None,
                }
            };
            let next = match deadline {
                None => Ok(next.await),
                Some(at) => tokio::time::timeout_at(at, next).await,
            };
            let msg = match next {
                Ok(Some(msg)) => msg,
                // The worker just left: wait again, on the shorter clock.
                Ok(None) => continue,
                Err(_) => {
                    let at = deadline.unwrap_or(now);
                    let why = match (total, self.config.max_duration) {
                        (Some(t), Some(d)) if t <= at => {
                            format!("the request ran past --nats-req-max-duration ({d:?})")
                        }
                        _ if left => format!(
                            "it left the fleet and sent nothing for {:?}",
                            idle.unwrap_or(LEFT_IDLE)
                        ),
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
            };
            return msg.ok_or_else(|| {
                TransportError::Failed("the nats reply subscription closed".to_owned())
            });
        }
    }

    fn into_stream(self) -> BodyStream {
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

#[cfg(test)]
mod tests;
