//! `--request-transport nats`, worker side: [`NatsResponder`] takes the requests for its worker
//! id and listens on `infera.cancel.<token>`, and proxies each request to the engine's HTTP port,
//! streaming every response chunk back to the request's inbox as it arrives (`data` … `done`,
//! each with `rs-seq`).
//!
//! Requests come from one of two places, as the worker's `max_pending`
//! (`--nats-req-max-pending`) says, which must agree with the servers':
//! - unset: a core NATS subscription to `infera.req.<token>`; the inbox is the message's reply
//!   subject;
//! - set (any value above 0; the limit itself is applied by the servers, before they publish):
//!   the worker's durable consumer on the JetStream work queue `INFERA_REQUESTS`
//!   ([`super::jetstream`]), created (or re-pointed at this process) at start and again after
//!   every reconnect, since a broker restart loses the memory-backed stream; the inbox is the
//!   `rs-inbox` header; each request is acked when it ends (done, error, cancel or timeout), which
//!   is what takes it off the backlog the servers read.
//!
//! # Contract
//! - A payload that does not parse, or an engine that cannot be reached, is answered with one
//!   `error` reply (never a panic); a message without an inbox is logged and dropped (acked).
//! - A cancel naming a request's inbox drops its engine connection (the engine sees a client
//!   disconnect and stops generating); nothing more is sent to that inbox.
//! - `max_duration` (the worker's `--nats-req-max-duration`) bounds each request locally, a
//!   backstop for a server that died or a cancel that was lost: past it the engine connection is
//!   dropped (the engine aborts the request) and the reply ends with an `error` carrying
//!   `rs-status: 504`, which the server reports as a timeout, not as a failed worker.
//!   `idle_timeout` (`--nats-req-idle-timeout`) does the same when the engine sends nothing
//!   (no response head, no chunk) for that long.
//! - [`NatsResponder::stop_accepting`] stops taking new requests while in-flight requests and
//!   cancels go on. Core NATS: it unsubscribes and returns once the broker has it (the broker then
//!   answers the server "no responders", which fails over). JetStream: it first lets the stream
//!   deliver what is already queued for this worker (served as usual; polled every 200 ms, for
//!   up to 10 s), then answers every request delivered later at once with one `error`
//!   (`infera: worker draining`, acked; nothing reaches the engine), which servers — ours and
//!   the Python Infera's — retry on another worker before any byte went to the client.
//! - [`NatsResponder::finish`] waits for the in-flight requests, bounded, then cancels the rest;
//!   in JetStream mode it then deletes the worker's durable consumer (a restarted worker gets a
//!   new one; dropping the responder without `finish` deletes it best-effort).
//!
//! One task owns the subscriptions and the request tasks (a `JoinSet`), so nothing outlives
//! [`NatsResponder::finish`] or the responder's drop.

mod job;

use super::jetstream::{self as js, HDR_INBOX};
use super::{HDR_SEQ, HDR_TYPE, NatsError, TYPE_ERROR, cancel_subject, request_subject};
use bytes::Bytes;
use futures::StreamExt as _;
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use job::Job;
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;
use tokio::task::{JoinHandle, JoinSet};
use tokio_util::sync::CancellationToken;

type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// The error text a draining worker answers a request it did not start with. It begins with the
/// Python Infera's `DRAINING_NOTICE`, so its servers tell a planned departure from a fault.
pub const DRAINING_REFUSAL: &str =
    "infera: worker draining; the request was not started, try another worker";
/// Longest wait, when a JetStream worker stops accepting, for the requests still queued for it
/// to be delivered (they are served); whatever is delivered later is refused.
pub const QUEUED_WAIT: Duration = Duration::from_secs(10);
/// How often a JetStream worker checks whether its connection was re-established (after which
/// it re-creates the stream and its consumer, which a broker restart lost).
const RECONNECT_CHECK: Duration = Duration::from_millis(250);

/// What a responder serves.
#[derive(Debug, Clone)]
pub struct ResponderConfig {
    /// The worker id the server routes by (its subjects derive from it).
    pub worker_id: String,
    /// The engine's base URL, e.g. `http://127.0.0.1:8000`.
    pub engine_url: String,
    /// Local bound on each request; `None` is unbounded.
    pub max_duration: Option<Duration>,
    /// Longest wait for the engine's next response byte; `None` is unbounded.
    pub idle_timeout: Option<Duration>,
    /// `--nats-req-max-pending`: `Some` above 0 takes requests from JetStream (the servers apply
    /// the limit); `None` or 0 from core NATS.
    pub max_pending: Option<u32>,
}

/// A running responder. See the module docs.
#[derive(Debug)]
pub struct NatsResponder {
    accepting: CancellationToken,
    /// Cancelled once new requests are no longer taken (or the loop ended).
    stopped: CancellationToken,
    /// Cancelled by [`NatsResponder::finish`]: end once nothing is in flight.
    finishing: CancellationToken,
    abort: CancellationToken,
    /// JetStream mode.
    queue: Option<QueueSource>,
    task: Option<JoinHandle<()>>,
}

/// The JetStream consumer a responder reads.
#[derive(Debug, Clone)]
struct QueueSource {
    js: async_nats::jetstream::Context,
    worker_id: String,
    deliver_subject: String,
    /// The client's connect count when the consumer was made at start.
    bound_at: u64,
}

impl QueueSource {
    fn durable(&self) -> String {
        js::request_durable(&self.worker_id)
    }

    /// Makes the stream and the consumer (again).
    async fn bind(&self) -> Result<(), String> {
        js::ensure_request_stream(&self.js).await?;
        js::bind_request_consumer(&self.js, &self.worker_id, &self.deliver_subject).await
    }

    async fn delete(&self) {
        match self
            .js
            .delete_consumer_from_stream(self.durable(), js::REQUEST_STREAM)
            .await
        {
            Ok(_) => tracing::info!(durable = %self.durable(), "request consumer deleted"),
            Err(e) => tracing::debug!(error = %e, "cannot delete the request consumer"),
        }
    }
}

type Inflight = Arc<Mutex<HashMap<String, CancellationToken>>>;

impl NatsResponder {
    /// Subscribes (and in JetStream mode creates the stream and the worker's consumer) and
    /// starts serving.
    ///
    /// # Errors
    /// [`NatsError::Subscribe`] when a subscription, the stream or the consumer cannot be made.
    pub async fn start(
        client: async_nats::Client,
        config: ResponderConfig,
    ) -> Result<Self, NatsError> {
        let subscribe = |subject: String| {
            let client = client.clone();
            async move {
                client
                    .subscribe(subject.clone())
                    .await
                    .map_err(|e| NatsError::Subscribe {
                        subject,
                        reason: e.to_string(),
                    })
            }
        };
        let flush = || async {
            client.flush().await.map_err(|e| NatsError::Subscribe {
                subject: request_subject(&config.worker_id),
                reason: e.to_string(),
            })
        };
        let queue = config
            .max_pending
            .is_some_and(|n| n > 0)
            .then(|| QueueSource {
                js: js::context(client.clone()),
                worker_id: config.worker_id.clone(),
                deliver_subject: client.new_inbox(),
                bound_at: client.statistics().connects.load(Ordering::Relaxed),
            });
        let requests = match &queue {
            None => subscribe(request_subject(&config.worker_id)).await?,
            Some(q) => {
                // Subscribed before the consumer exists: a push consumer delivers at once, and
                // with max_deliver 1 a delivery nobody hears is never repeated.
                let sub = subscribe(q.deliver_subject.clone()).await?;
                flush().await?;
                q.bind().await.map_err(|reason| NatsError::Subscribe {
                    subject: request_subject(&config.worker_id),
                    reason,
                })?;
                sub
            }
        };
        let cancels = subscribe(cancel_subject(&config.worker_id)).await?;
        // Make sure the broker has both subscriptions before the worker registers.
        flush().await?;
        tracing::info!(worker = %config.worker_id, subject = %request_subject(&config.worker_id),
            jetstream = queue.is_some(), engine = %config.engine_url, "serving nats requests");
        let accepting = CancellationToken::new();
        let stopped = CancellationToken::new();
        let finishing = CancellationToken::new();
        let abort = CancellationToken::new();
        let task = tokio::spawn(run(
            client,
            config,
            Subs {
                requests,
                cancels,
                queue: queue.clone(),
            },
            Tokens {
                accepting: accepting.clone(),
                stopped: stopped.clone(),
                finishing: finishing.clone(),
                abort: abort.clone(),
            },
        ));
        Ok(Self {
            accepting,
            stopped,
            finishing,
            abort,
            queue,
            task: Some(task),
        })
    }

    /// Stops taking new requests (see the module docs for how, per mode) and returns once that
    /// is in effect; in-flight requests go on.
    pub async fn stop_accepting(&self) {
        self.stop(QUEUED_WAIT).await;
        self.stopped.cancelled().await;
    }

    async fn stop(&self, queued_wait: Duration) {
        if self.accepting.is_cancelled() {
            return;
        }
        if let Some(q) = &self.queue {
            js::wait_queued(&q.js, &q.durable(), queued_wait).await;
        }
        self.accepting.cancel();
    }

    /// Stops accepting, waits up to `timeout` for in-flight requests, then cancels the rest (and
    /// in JetStream mode deletes the worker's consumer).
    pub async fn finish(mut self, timeout: Duration) {
        let deadline = tokio::time::Instant::now() + timeout;
        self.stop(timeout).await;
        self.finishing.cancel();
        let Some(mut task) = self.task.take() else {
            return;
        };
        if tokio::time::timeout_at(deadline, &mut task).await.is_err() {
            tracing::warn!(
                ?timeout,
                "nats requests still in flight after the drain; cancelling"
            );
            self.abort.cancel();
            let _ = task.await;
        }
        // The task deleted the consumer.
        self.queue = None;
    }
}

impl Drop for NatsResponder {
    fn drop(&mut self) {
        self.abort.cancel();
        if let Some(task) = self.task.take() {
            task.abort();
        }
        // Best effort: the durable would outlive this process and keep what is queued for it.
        if let (Some(q), Ok(runtime)) = (self.queue.take(), tokio::runtime::Handle::try_current()) {
            runtime.spawn(async move { q.delete().await });
        }
    }
}

struct Subs {
    requests: async_nats::Subscriber,
    cancels: async_nats::Subscriber,
    queue: Option<QueueSource>,
}

struct Tokens {
    accepting: CancellationToken,
    stopped: CancellationToken,
    finishing: CancellationToken,
    abort: CancellationToken,
}

/// Re-creates the stream and the consumer whenever the connection was re-established (a broker
/// restart loses both; the client re-subscribes the delivery subject by itself), and retries
/// until that succeeds.
async fn keep_bound(client: async_nats::Client, queue: QueueSource, stop: CancellationToken) {
    let stats = client.statistics();
    let mut bound_at = queue.bound_at;
    let mut bound = true;
    let mut tick = tokio::time::interval(RECONNECT_CHECK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        let connects = stats.connects.load(Ordering::Relaxed);
        if (bound && connects == bound_at)
            || client.connection_state() != async_nats::connection::State::Connected
        {
            continue;
        }
        bound_at = connects;
        match queue.bind().await {
            Ok(()) => {
                if !bound {
                    tracing::info!(durable = %queue.durable(), "request consumer re-created");
                }
                bound = true;
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot re-create the request consumer; retrying");
                bound = false;
            }
        }
    }
}

/// What to do with one delivered request.
enum Intake {
    Serve { inbox: String, ack: Option<String> },
    Drop { ack: Option<String> },
}

/// Reads where to reply to `msg` and the subject that acks it (JetStream).
fn intake(msg: &async_nats::Message, jetstream: bool) -> Intake {
    // JetStream's own flow-control and heartbeat messages (not configured, but harmless).
    if msg.status.is_some() {
        return Intake::Drop { ack: None };
    }
    let reply = msg.reply.as_ref().map(ToString::to_string);
    let header = msg
        .headers
        .as_ref()
        .and_then(|h| h.get(HDR_INBOX))
        .map(|v| v.as_str().to_owned())
        .filter(|v| !v.is_empty());
    // The header wins in both modes: a JetStream-mode server's request also reaches a core
    // subscriber, whose reply subject is then the inbox of the publisher's JetStream ack.
    let (inbox, ack) = if jetstream {
        (header, reply)
    } else {
        (header.or(reply), None)
    };
    match inbox {
        Some(inbox) => Intake::Serve { inbox, ack },
        None => {
            tracing::warn!(
                jetstream,
                "nats request without a reply inbox dropped{}",
                if jetstream {
                    " (no rs-inbox header: is --nats-req-max-pending set on the server too?)"
                } else {
                    ""
                }
            );
            Intake::Drop { ack }
        }
    }
}

async fn ack(client: &async_nats::Client, ack: Option<String>) {
    if let Some(subject) = ack
        && let Err(e) = client.publish(subject, Bytes::from_static(b"+ACK")).await
    {
        tracing::warn!(error = %e, "cannot ack a nats request");
    }
}

async fn run(client: async_nats::Client, config: ResponderConfig, subs: Subs, tokens: Tokens) {
    let Subs {
        mut requests,
        mut cancels,
        queue,
    } = subs;
    let Tokens {
        accepting,
        stopped,
        finishing,
        abort,
    } = tokens;
    let jetstream = queue.is_some();
    let keeper = queue.clone().map(|q| {
        let stop = CancellationToken::new();
        (
            tokio::spawn(keep_bound(client.clone(), q, stop.clone())),
            stop,
        )
    });
    // TCP_NODELAY: streamed chunks are small writes that Nagle's algorithm would hold back.
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let http: HttpClient = Client::builder(TokioExecutor::new()).build(connector);
    let inflight: Inflight = Arc::default();
    let mut tasks = JoinSet::new();
    let mut subscribed = true;
    let mut taking = true;
    let mut finish_seen = false;
    let mut listening = true;
    loop {
        tokio::select! {
            () = abort.cancelled() => break,
            () = accepting.cancelled(), if taking => {
                taking = false;
                if !jetstream {
                    subscribed = false;
                    if let Err(e) = requests.unsubscribe().await {
                        tracing::warn!(error = %e, "cannot unsubscribe from nats requests");
                    }
                    if let Err(e) = client.flush().await {
                        tracing::warn!(error = %e, "cannot flush the nats unsubscribe");
                    }
                }
                stopped.cancel();
                tracing::info!(worker = %config.worker_id, inflight = tasks.len(),
                    "stopped taking nats requests");
            }
            () = finishing.cancelled(), if !finish_seen => finish_seen = true,
            msg = requests.next(), if subscribed => {
                let Some(msg) = msg else {
                    tracing::error!("the nats request subscription ended");
                    subscribed = false;
                    stopped.cancel();
                    continue;
                };
                let (inbox, ack_subject) = match intake(&msg, jetstream) {
                    Intake::Serve { inbox, ack } => (inbox, ack),
                    Intake::Drop { ack: a } => {
                        ack(&client, a).await;
                        continue;
                    }
                };
                if !taking {
                    refuse_draining(&client, inbox).await;
                    ack(&client, ack_subject).await;
                    continue;
                }
                let token = CancellationToken::new();
                let duplicate = {
                    let mut map = inflight.lock().unwrap_or_else(PoisonError::into_inner);
                    let duplicate = map.contains_key(&inbox);
                    if !duplicate {
                        map.insert(inbox.clone(), token.clone());
                    }
                    duplicate
                };
                if duplicate {
                    // A publish retried after a lost ack: already being served.
                    tracing::debug!(%inbox, "duplicate nats request dropped");
                    ack(&client, ack_subject).await;
                    continue;
                }
                let job = Job {
                    client: client.clone(),
                    http: http.clone(),
                    engine_url: config.engine_url.clone(),
                    max_duration: config.max_duration,
                    idle_timeout: config.idle_timeout,
                    reply: inbox,
                    ack: ack_subject,
                    inflight: Arc::clone(&inflight),
                };
                tasks.spawn(job.run(msg.payload, token));
            }
            msg = cancels.next(), if listening => {
                let Some(msg) = msg else {
                    tracing::error!("the nats cancel subscription ended");
                    listening = false;
                    continue;
                };
                let inbox = String::from_utf8_lossy(&msg.payload).into_owned();
                let token = inflight
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .remove(inbox.trim());
                match token {
                    Some(t) => {
                        tracing::info!(inbox = %inbox.trim(), "nats request cancelled by the server");
                        t.cancel();
                    }
                    None => tracing::debug!(inbox = %inbox.trim(), "cancel for no request in flight"),
                }
            }
            Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
        }
        // Core NATS: done once unsubscribed and idle. JetStream: requests keep arriving (and are
        // refused) until `finish`, so the consumer is not left with nobody answering.
        if !taking && tasks.is_empty() && (!jetstream || finishing.is_cancelled()) {
            break;
        }
    }
    for (_, t) in inflight
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .drain()
    {
        t.cancel();
    }
    while tasks.join_next().await.is_some() {}
    if let Some((keeper, stop)) = keeper {
        stop.cancel();
        let _ = keeper.await;
    }
    if let Some(q) = &queue {
        drop(requests);
        q.delete().await;
    }
    // Replies and acks are buffered by the client: send them before the worker process may exit.
    if let Err(e) = client.flush().await {
        tracing::warn!(error = %e, "cannot flush the last nats replies");
    }
    stopped.cancel();
}

/// Answers a request that arrived after the worker stopped accepting: one `error` that the
/// server fails over.
async fn refuse_draining(client: &async_nats::Client, inbox: String) {
    tracing::debug!(%inbox, "nats request refused: the worker is draining");
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(HDR_TYPE, TYPE_ERROR);
    headers.insert(HDR_SEQ, "0");
    if let Err(e) = client
        .publish_with_headers(
            inbox,
            headers,
            Bytes::from_static(DRAINING_REFUSAL.as_bytes()),
        )
        .await
    {
        tracing::warn!(error = %e, "cannot publish a nats refusal");
    }
}
