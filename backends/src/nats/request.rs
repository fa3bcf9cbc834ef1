//! `--request-transport nats`, server side: [`NatsTransport`] publishes each request on its
//! worker's subject with a fresh reply inbox and turns the replies into an
//! [`Inbound`] (the request transport port of `infera_core::ports::transport`).
//!
//! # Behaviour
//! - Admission (`max_pending`, the Python Infera's semantics and wire format): requests go through
//!   JetStream ([`super::jetstream`]: the work-queue stream `INFERA_REQUESTS`, the inbox in the
//!   `rs-inbox` header). Before each one the server reads its worker's consumer backlog
//!   (`num_pending + num_ack_pending`: queued plus in flight, from every server replica, so the
//!   limit is one for the whole fleet), reusing a reading for [`BACKLOG_TTL`]; at the limit the
//!   request is refused at once ([`TransportError::Overloaded`], 429 with `Retry-After: 1`),
//!   which the relay retries on another worker. A backlog that cannot be read (no consumer yet:
//!   a worker starting, or one without the limit; the broker away) admits. Ours also fails over
//!   ([`TransportError::Unreachable`]) when the consumer exists but nothing is subscribed to it
//!   (a Python worker that stopped taking requests, a dead one) instead of queueing for nobody.
//!   The publish is retried while the broker is away and re-creates the stream when a broker
//!   restart lost it. A request given up before its worker took it is deleted from the stream.
//!   Without `max_pending` requests are core NATS publishes with a reply inbox; a JetStream ack
//!   on that inbox (an `INFERA_REQUESTS` stream left from JetStream mode captured the request)
//!   is ignored, with a warning once.
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
//! - Failover: no subscriber on the subject (the broker's no-responders status, core NATS) or an
//!   `error` reply before any data (a worker that is draining answers so in JetStream mode) is
//!   [`TransportError::Unreachable`], retried on another worker.
//! - Broker restarts: a request sent while the broker is away waits in the client's buffer and
//!   goes out on the reconnect; if its worker has not resubscribed yet, it is re-sent every
//!   200 ms for up to 6 s before it counts as unreachable, so it is not lost to the race
//!   between the two reconnects. In JetStream mode the request waits for the reconnect instead
//!   and then stays queued in the stream until the worker has re-created its consumer.
//!
//! - A worker that leaves the fleet (deregistered: drained, or dead with its lease expired) gets
//!   at most [`LEFT_IDLE`] per reply from then on ([`RequestTransport::worker_left`]): a draining
//!   worker finishes its streams, a killed one (which breaks no connection here) ends them with
//!   a 504 error event soon after it leaves instead of at the idle timeout.
//!
//! Cancels (and, in JetStream mode, the deletion of abandoned queued requests) are published by one
//! task owned by the transport; it ends when the transport is dropped. A cancel that finds its
//! queue full is logged and dropped.

use super::jetstream::{self as js, BACKLOG_TTL, HDR_INBOX};
use super::{HEALTH_PATH, cancel_subject, encode_request, request_subject};
mod reply;

use reply::{CancelOnDrop, Chunk, Reply};
#[cfg(test)]
use reply::{is_stray_pub_ack, parse_reply};

use async_nats::jetstream::context::PublishErrorKind;
use async_nats::jetstream::message::PublishMessage;
use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use futures::StreamExt as _;
use infera_core::event::WorkerRecord;
use infera_core::ids::WorkerId;
use infera_core::ports::transport::{Inbound, Outbound, RequestTransport, TransportError};
use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};
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
    /// Backlog limit per worker (`--nats-req-max-pending`): requests go through JetStream and
    /// a worker whose consumer holds this many (queued plus in flight, from every server) is
    /// refused. `None` (or 0) is core NATS and no limit.
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
    /// JetStream mode (`max_pending`).
    queue: Option<Queue>,
    cancels: mpsc::Sender<Cancel>,
    /// Per worker, cancelled when it leaves the fleet ([`RequestTransport::worker_left`]).
    present: Mutex<HashMap<WorkerId, CancellationToken>>,
}

/// The JetStream side of the transport.
#[derive(Debug)]
struct Queue {
    js: async_nats::jetstream::Context,
    limit: u32,
    /// The last backlog read per worker.
    backlogs: Mutex<HashMap<WorkerId, Backlog>>,
}

#[derive(Debug, Clone, Copy)]
struct Backlog {
    read_at: Instant,
    /// `num_pending + num_ack_pending`.
    count: u64,
    /// A push consumer that no client is subscribed to: its requests would wait for nobody.
    unbound: bool,
}

impl Queue {
    /// `worker`'s backlog, read at most every [`BACKLOG_TTL`]; `None` when it cannot be read.
    async fn backlog(&self, client: &async_nats::Client, worker: &WorkerId) -> Option<Backlog> {
        let cached = self
            .backlogs
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(worker)
            .copied();
        if let Some(b) = cached.filter(|b| b.read_at.elapsed() < BACKLOG_TTL) {
            return Some(b);
        }
        // A broker that is away cannot be asked; the publish waits for it.
        if client.connection_state() != async_nats::connection::State::Connected {
            return None;
        }
        let info = match js::request_consumer_info(&self.js, &js::request_durable(worker.as_str()))
            .await
        {
            Ok(info) => info,
            Err(e) => {
                tracing::debug!(worker = worker.as_str(), error = %e,
                    "request backlog unreadable; admitting");
                return None;
            }
        };
        let backlog = Backlog {
            read_at: Instant::now(),
            count: info.num_pending + info.num_ack_pending as u64,
            unbound: info.config.deliver_subject.is_some() && !info.push_bound,
        };
        self.backlogs
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(worker.clone(), backlog);
        Some(backlog)
    }
}

#[derive(Debug)]
struct Cancel {
    subject: String,
    inbox: String,
    /// The request's message in the stream, when no reply showed that a worker took it.
    queued: Option<u64>,
}

impl NatsTransport {
    /// A transport on `client`. Must be called inside a tokio runtime (it starts the task that
    /// publishes cancels, and in JetStream mode one that creates the request stream).
    pub fn new(client: async_nats::Client, config: NatsRequestConfig) -> Self {
        let queue = config.max_pending.filter(|n| *n > 0).map(|limit| Queue {
            js: js::context(client.clone()),
            limit,
            backlogs: Mutex::new(HashMap::new()),
        });
        if let Some(q) = &queue {
            let context = q.js.clone();
            tokio::spawn(async move {
                if let Err(e) = js::ensure_request_stream(&context).await {
                    tracing::warn!(error = %e, "cannot create the request stream yet");
                }
            });
        }
        let (cancels, mut pending) = mpsc::channel::<Cancel>(CANCEL_QUEUE);
        let publisher = client.clone();
        let context = queue.as_ref().map(|q| q.js.clone());
        tokio::spawn(async move {
            while let Some(c) = pending.recv().await {
                // Deleted first: a request still queued is then never delivered, and one already
                // delivered is delivered before the cancel reaches its worker.
                if let (Some(seq), Some(context)) = (c.queued, &context) {
                    js::delete_request(context, seq).await;
                }
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
            queue,
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

    /// JetStream mode: refuses a worker whose backlog reached the limit (fail-open when it
    /// cannot be read) or whose consumer nobody is subscribed to.
    async fn admit(&self, worker: &WorkerId) -> Result<(), TransportError> {
        let Some(queue) = &self.queue else {
            return Ok(());
        };
        let Some(backlog) = queue.backlog(&self.client, worker).await else {
            return Ok(());
        };
        if backlog.unbound {
            return Err(TransportError::Unreachable(format!(
                "worker {} is not subscribed to its JetStream request consumer (draining or gone)",
                worker.as_str()
            )));
        }
        if backlog.count >= u64::from(queue.limit) {
            return Err(TransportError::Overloaded {
                message: format!(
                    "worker {} has {} requests queued or in flight, its limit \
                     (--nats-req-max-pending {})",
                    worker.as_str(),
                    backlog.count,
                    queue.limit
                ),
                retry_after_s: 1,
            });
        }
        Ok(())
    }

    /// Publishes a request into the stream and returns its sequence there: waits while the
    /// broker is away, re-creates the stream a broker restart lost, and retries a lost ack (the
    /// `Nats-Msg-Id` makes the stream keep one copy). Bounded by the request's own timeouts.
    async fn enqueue(
        &self,
        context: &async_nats::jetstream::Context,
        subject: &str,
        inbox: &str,
        payload: Bytes,
        started: Instant,
    ) -> Result<u64, TransportError> {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(HDR_INBOX, inbox);
        let publish = || {
            PublishMessage::build()
                .headers(headers.clone())
                .payload(payload.clone())
                .message_id(inbox)
        };
        let deadline = [self.config.idle_timeout, self.config.max_duration]
            .into_iter()
            .flatten()
            .min()
            .map(|d| started + d);
        let mut connected_since: Option<Instant> = None;
        let mut last_error = String::from("the broker is away");
        loop {
            if self.client.connection_state() == async_nats::connection::State::Connected {
                let since = *connected_since.get_or_insert_with(Instant::now);
                let acked = match context.send_publish(subject.to_owned(), publish()).await {
                    Ok(ack) => ack.await,
                    Err(e) => Err(e),
                };
                match acked {
                    Ok(ack) => return Ok(ack.sequence),
                    Err(e) if e.kind() == PublishErrorKind::StreamNotFound => {
                        // A broker restart lost the (memory) stream: make it again.
                        if let Err(e) = js::ensure_request_stream(context).await {
                            last_error = e;
                        }
                    }
                    Err(e)
                        if matches!(
                            e.kind(),
                            PublishErrorKind::TimedOut | PublishErrorKind::BrokenPipe
                        ) =>
                    {
                        last_error = e.to_string();
                    }
                    Err(e) => {
                        return Err(TransportError::Unreachable(format!(
                            "JetStream refused the request to {subject}: {e}"
                        )));
                    }
                }
                if since.elapsed() >= REDELIVERY_WINDOW {
                    return Err(TransportError::Unreachable(format!(
                        "JetStream did not take the request to {subject}: {last_error}"
                    )));
                }
            } else {
                connected_since = None;
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(TransportError::Timeout(format!(
                    "the request to {subject} could not be queued in JetStream before its \
                     --nats-req-idle-timeout / --nats-req-max-duration: {last_error}"
                )));
            }
            tokio::time::sleep(REDELIVERY_STEP).await;
        }
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
        if let Some(queue) = &self.queue {
            queue
                .backlogs
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .remove(worker);
        }
    }

    /// A request of path `/health` through the worker (see the module docs of `nats`): an
    /// answer of 2xx, or the 405 of an engine that a Python worker POSTs it to, passes. In
    /// JetStream mode requests wait in the worker's queue, so workers are not probed there.
    async fn probe(&self, worker: &WorkerRecord) -> Result<(), TransportError> {
        if self.queue.is_some() {
            return Ok(());
        }
        let probe = Outbound::new(
            worker.worker_id.clone(),
            worker.url.clone(),
            HEALTH_PATH,
            Bytes::from_static(b"null"),
            false,
            "infera-health-probe",
        );
        let resp = self.send(probe).await?;
        let mut body = resp.body;
        while let Some(chunk) = body.next().await {
            chunk?;
        }
        if resp.status.is_success() || resp.status == http::StatusCode::METHOD_NOT_ALLOWED {
            Ok(())
        } else {
            Err(TransportError::Failed(format!(
                "worker {} answered its health probe {}",
                worker.worker_id.as_str(),
                resp.status
            )))
        }
    }

    async fn send(&self, req: Outbound) -> Result<Inbound, TransportError> {
        self.admit(&req.worker).await?;
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
        let mut reply = Reply {
            sub,
            left: self.presence(&req.worker),
            worker: req.worker.clone(),
            next_seq: 0,
            started: Instant::now(),
            config: self.config,
            core: self.queue.is_none(),
            cancel: CancelOnDrop {
                tx: self.cancels.clone(),
                subject: Some(cancel_subject(worker)),
                inbox: inbox.clone(),
                queued: None,
            },
        };
        let first = if let Some(queue) = &self.queue {
            // Armed from here: a request whose queueing failed may still have been stored.
            let seq = self
                .enqueue(&queue.js, &subject, &inbox, payload, reply.started)
                .await?;
            reply.cancel.queued = Some(seq);
            reply.next().await
        } else {
            // Published while the broker is away, the request waits in the client's buffer and
            // goes out on the reconnect, possibly before the worker has resubscribed.
            let offline =
                self.client.connection_state() != async_nats::connection::State::Connected;
            let publish = || {
                self.client
                    .publish_with_reply(subject.clone(), inbox.clone(), payload.clone())
            };
            if let Err(e) = publish().await {
                reply.cancel.disarm();
                return Err(TransportError::Unreachable(format!(
                    "nats publish failed: {e}"
                )));
            }
            let redeliver_until = offline.then(|| Instant::now() + REDELIVERY_WINDOW);
            loop {
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

#[cfg(test)]
mod tests;
