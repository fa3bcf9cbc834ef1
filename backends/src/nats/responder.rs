//! `--request-transport nats`, worker side: [`NatsResponder`] subscribes to
//! `infera.req.<token>` and `infera.cancel.<token>` and proxies each request to the engine's
//! HTTP port, streaming every response chunk back to the request's inbox as it arrives
//! (`data` … `done`, each with `rs-seq`).
//!
//! # Contract
//! - A payload that does not parse, or an engine that cannot be reached, is answered with one
//!   `error` reply (never a panic); a message without a reply subject is logged and dropped.
//! - A cancel naming a request's inbox drops its engine connection (the engine sees a client
//!   disconnect and stops generating); nothing more is sent to that inbox.
//! - `max_duration` (the worker's `--nats-req-max-duration`) bounds each request locally, a
//!   backstop for a server that died or a cancel that was lost: past it the engine connection is
//!   dropped (the engine aborts the request) and the reply ends with an `error` carrying
//!   `rs-status: 504`, which the server reports as a timeout, not as a failed worker.
//!   `idle_timeout` (`--nats-req-idle-timeout`) does the same when the engine sends nothing
//!   (no response head, no chunk) for that long.
//! - `max_pending` (`--nats-req-max-pending`) admits at most that many requests at once; one
//!   more is answered at once with one `error` carrying `rs-status: 429` and nothing is sent to
//!   the engine. The server fails it over to another worker (a 429 of its own when every worker
//!   refused).
//! - [`NatsResponder::stop_accepting`] unsubscribes from requests and returns once the broker
//!   has it (the broker then answers the server "no responders", which fails over), while
//!   in-flight requests and cancels go on;
//!   [`NatsResponder::finish`] waits for them, bounded, then cancels the rest.
//!
//! One task owns the subscriptions and the request tasks (a `JoinSet`), so nothing outlives
//! [`NatsResponder::finish`] or the responder's drop.

use super::{
    HDR_SEQ, HDR_STATUS, HDR_TYPE, NatsError, RequestPayload, TYPE_DATA, TYPE_DONE, TYPE_ERROR,
    cancel_subject, request_subject,
};
use bytes::Bytes;
use futures::StreamExt as _;
use http_body_util::{BodyExt as _, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;
use tokio::task::{JoinHandle, JoinSet};
use tokio_util::sync::CancellationToken;

type HttpClient = Client<HttpConnector, Full<Bytes>>;

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
    /// Requests admitted at once; `None` is unlimited.
    pub max_pending: Option<u32>,
}

/// A running responder. See the module docs.
#[derive(Debug)]
pub struct NatsResponder {
    accepting: CancellationToken,
    /// Cancelled once the broker has the unsubscribe (or the loop ended).
    unsubscribed: CancellationToken,
    abort: CancellationToken,
    task: Option<JoinHandle<()>>,
}

type Inflight = Arc<Mutex<HashMap<String, CancellationToken>>>;

impl NatsResponder {
    /// Subscribes and starts serving.
    ///
    /// # Errors
    /// [`NatsError::Subscribe`] when a subscription cannot be made.
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
        let requests = subscribe(request_subject(&config.worker_id)).await?;
        let cancels = subscribe(cancel_subject(&config.worker_id)).await?;
        // Make sure the broker has both subscriptions before the worker registers.
        client.flush().await.map_err(|e| NatsError::Subscribe {
            subject: request_subject(&config.worker_id),
            reason: e.to_string(),
        })?;
        tracing::info!(worker = %config.worker_id, subject = %request_subject(&config.worker_id),
            engine = %config.engine_url, "serving nats requests");
        let accepting = CancellationToken::new();
        let unsubscribed = CancellationToken::new();
        let abort = CancellationToken::new();
        let task = tokio::spawn(run(
            client,
            config,
            Subs { requests, cancels },
            Tokens {
                accepting: accepting.clone(),
                unsubscribed: unsubscribed.clone(),
                abort: abort.clone(),
            },
        ));
        Ok(Self {
            accepting,
            unsubscribed,
            abort,
            task: Some(task),
        })
    }

    /// Unsubscribes from new requests and returns once the broker has the unsubscribe;
    /// in-flight requests go on.
    pub async fn stop_accepting(&self) {
        self.accepting.cancel();
        self.unsubscribed.cancelled().await;
    }

    /// Stops accepting, waits up to `timeout` for in-flight requests, then cancels the rest.
    pub async fn finish(mut self, timeout: Duration) {
        self.accepting.cancel();
        let Some(mut task) = self.task.take() else {
            return;
        };
        if tokio::time::timeout(timeout, &mut task).await.is_err() {
            tracing::warn!(
                ?timeout,
                "nats requests still in flight after the drain; cancelling"
            );
            self.abort.cancel();
            let _ = task.await;
        }
    }
}

impl Drop for NatsResponder {
    fn drop(&mut self) {
        self.abort.cancel();
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

struct Subs {
    requests: async_nats::Subscriber,
    cancels: async_nats::Subscriber,
}

struct Tokens {
    accepting: CancellationToken,
    unsubscribed: CancellationToken,
    abort: CancellationToken,
}

async fn run(client: async_nats::Client, config: ResponderConfig, subs: Subs, tokens: Tokens) {
    let Subs {
        mut requests,
        mut cancels,
    } = subs;
    let Tokens {
        accepting,
        unsubscribed,
        abort,
    } = tokens;
    // TCP_NODELAY: streamed chunks are small writes that Nagle's algorithm would hold back.
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let http: HttpClient = Client::builder(TokioExecutor::new()).build(connector);
    let inflight: Inflight = Arc::default();
    let mut tasks = JoinSet::new();
    let mut subscribed = true;
    loop {
        tokio::select! {
            () = abort.cancelled() => break,
            () = accepting.cancelled(), if subscribed => {
                subscribed = false;
                if let Err(e) = requests.unsubscribe().await {
                    tracing::warn!(error = %e, "cannot unsubscribe from nats requests");
                }
                if let Err(e) = client.flush().await {
                    tracing::warn!(error = %e, "cannot flush the nats unsubscribe");
                }
                unsubscribed.cancel();
                tracing::info!(worker = %config.worker_id, inflight = tasks.len(),
                    "stopped taking nats requests");
                if tasks.is_empty() {
                    break;
                }
            }
            msg = requests.next(), if subscribed => {
                let Some(msg) = msg else {
                    tracing::error!("the nats request subscription ended");
                    subscribed = false;
                    unsubscribed.cancel();
                    continue;
                };
                let Some(reply) = msg.reply.map(|s| s.to_string()) else {
                    tracing::warn!("nats request without a reply subject dropped");
                    continue;
                };
                if config.max_pending.is_some_and(|max| tasks.len() >= max as usize) {
                    refuse(&client, reply, tasks.len()).await;
                    continue;
                }
                let token = CancellationToken::new();
                inflight
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .insert(reply.clone(), token.clone());
                let job = Job {
                    client: client.clone(),
                    http: http.clone(),
                    engine_url: config.engine_url.clone(),
                    max_duration: config.max_duration,
                    idle_timeout: config.idle_timeout,
                    reply,
                    inflight: Arc::clone(&inflight),
                };
                tasks.spawn(job.run(msg.payload, token));
            }
            msg = cancels.next() => {
                let Some(msg) = msg else { continue };
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
            Some(_) = tasks.join_next(), if !tasks.is_empty() => {
                if !subscribed && tasks.is_empty() {
                    break;
                }
            }
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
    // Replies are buffered by the client: send them before the worker process may exit.
    if let Err(e) = client.flush().await {
        tracing::warn!(error = %e, "cannot flush the last nats replies");
    }
    unsubscribed.cancel();
}

/// Answers a request over the admission limit: one `error` with `rs-status: 429`.
async fn refuse(client: &async_nats::Client, reply: String, pending: usize) {
    tracing::debug!(%reply, pending, "nats request refused at --nats-req-max-pending");
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(HDR_TYPE, TYPE_ERROR);
    headers.insert(HDR_SEQ, "0");
    headers.insert(HDR_STATUS, "429");
    let text = format!("the worker has {pending} requests in flight, its --nats-req-max-pending");
    if let Err(e) = client
        .publish_with_headers(reply, headers, Bytes::from(text))
        .await
    {
        tracing::warn!(error = %e, "cannot publish a nats refusal");
    }
}

/// Why a request ended without `done`.
enum Failure {
    /// It ran past the worker's `max_duration` (the engine request was dropped).
    Timeout(Duration),
    /// The engine sent nothing for the worker's `idle_timeout` (the request was dropped).
    Idle(Duration),
    /// The payload, the engine or the link failed; the text says how.
    Other(String),
}

struct Job {
    client: async_nats::Client,
    http: HttpClient,
    engine_url: String,
    max_duration: Option<Duration>,
    idle_timeout: Option<Duration>,
    reply: String,
    inflight: Inflight,
}

impl Job {
    async fn run(self, payload: Bytes, cancel: CancellationToken) {
        let mut seq = 0u64;
        let outcome = tokio::select! {
            () = cancel.cancelled() => None,
            r = self.bounded(&payload, &mut seq) => Some(r),
        };
        match outcome {
            None => {} // the server gave up on it; nothing more to send
            Some(Ok(())) => {}
            Some(Err(Failure::Timeout(d))) => {
                let text = format!(
                    "the worker ended the request at its --nats-req-max-duration ({d:?}) and \
                     cancelled it in the engine"
                );
                tracing::warn!(reply = %self.reply, limit = ?d, "nats request timed out");
                self.publish(&mut seq, TYPE_ERROR, Some(504), Bytes::from(text))
                    .await;
            }
            Some(Err(Failure::Idle(d))) => {
                let text = format!(
                    "the engine sent nothing for the worker's --nats-req-idle-timeout ({d:?}); \
                     the request was cancelled in the engine"
                );
                tracing::warn!(reply = %self.reply, limit = ?d, "nats request idle");
                self.publish(&mut seq, TYPE_ERROR, Some(504), Bytes::from(text))
                    .await;
            }
            Some(Err(Failure::Other(text))) => {
                tracing::warn!(reply = %self.reply, error = %text, "nats request failed");
                self.publish(&mut seq, TYPE_ERROR, None, Bytes::from(text))
                    .await;
            }
        }
        self.inflight
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&self.reply);
    }

    async fn bounded(&self, payload: &[u8], seq: &mut u64) -> Result<(), Failure> {
        match self.max_duration {
            None => self.proxy(payload, seq).await,
            Some(d) => match tokio::time::timeout(d, self.proxy(payload, seq)).await {
                Ok(r) => r,
                Err(_) => Err(Failure::Timeout(d)),
            },
        }
    }

    /// `step` bounded by the idle timeout.
    async fn idle<T>(&self, step: impl Future<Output = T>) -> Result<T, Failure> {
        match self.idle_timeout {
            None => Ok(step.await),
            Some(d) => tokio::time::timeout(d, step)
                .await
                .map_err(|_| Failure::Idle(d)),
        }
    }

    async fn proxy(&self, payload: &[u8], seq: &mut u64) -> Result<(), Failure> {
        let req = RequestPayload::parse(payload).map_err(Failure::Other)?;
        let target = format!("{}{}", self.engine_url, req.path);
        let mut builder = hyper::Request::post(&target);
        let mut has_content_type = false;
        for (name, value) in req.headers.iter().flatten() {
            let lower = name.to_ascii_lowercase();
            if matches!(
                lower.as_str(),
                "host" | "content-length" | "connection" | "transfer-encoding"
            ) {
                continue;
            }
            let Some(value) = value.as_str() else {
                continue;
            };
            has_content_type |= lower == "content-type";
            builder = builder.header(lower.as_str(), value);
        }
        if !has_content_type {
            builder = builder.header("content-type", "application/json");
        }
        let body = serde_json::to_vec(&req.body).map_err(|e| Failure::Other(e.to_string()))?;
        let request = builder.body(Full::new(Bytes::from(body))).map_err(|e| {
            Failure::Other(format!("cannot build the engine request to {target}: {e}"))
        })?;
        let resp = self.idle(self.http.request(request)).await?.map_err(|e| {
            Failure::Other(format!("engine at {} unreachable: {e}", self.engine_url))
        })?;
        let status = resp.status();
        let mut body = resp.into_body().into_data_stream();
        while let Some(chunk) = self.idle(body.next()).await? {
            let chunk =
                chunk.map_err(|e| Failure::Other(format!("engine response failed midway: {e}")))?;
            if !chunk.is_empty() {
                self.publish(seq, TYPE_DATA, None, chunk).await;
            }
        }
        self.publish(seq, TYPE_DONE, Some(status.as_u16()), Bytes::new())
            .await;
        Ok(())
    }

    async fn publish(&self, seq: &mut u64, kind: &str, status: Option<u16>, payload: Bytes) {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(HDR_TYPE, kind);
        headers.insert(HDR_SEQ, seq.to_string().as_str());
        if let Some(s) = status {
            headers.insert(HDR_STATUS, s.to_string().as_str());
        }
        *seq += 1;
        if let Err(e) = self
            .client
            .publish_with_headers(self.reply.clone(), headers, payload)
            .await
        {
            tracing::warn!(reply = %self.reply, error = %e, "cannot publish a nats reply");
        }
    }
}
