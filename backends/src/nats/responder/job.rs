//! One request on the worker: proxied to the local engine over HTTP, its replies published in
//! sequence to the server's inbox, bounded by the worker's own deadlines, acked when it ends in
//! JetStream mode.

use super::{HttpClient, Inflight, ack};
use crate::nats::{
    HDR_SEQ, HDR_STATUS, HDR_TYPE, HEALTH_PATH, RequestPayload, TYPE_DATA, TYPE_DONE, TYPE_ERROR,
};
use bytes::Bytes;
use futures::StreamExt as _;
use http_body_util::{BodyExt as _, Full};
use std::sync::PoisonError;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Why a request ended without `done`.
enum Failure {
    /// It ran past the worker's `max_duration` (the engine request was dropped).
    Timeout(Duration),
    /// The engine sent nothing for the worker's `idle_timeout` (the request was dropped).
    Idle(Duration),
    /// The payload, the engine or the link failed; the text says how.
    Other(String),
}

pub(super) struct Job {
    pub(super) client: async_nats::Client,
    pub(super) http: HttpClient,
    pub(super) engine_url: String,
    pub(super) max_duration: Option<Duration>,
    pub(super) idle_timeout: Option<Duration>,
    pub(super) reply: String,
    /// JetStream: the subject that acks the request, published when it ends.
    pub(super) ack: Option<String>,
    pub(super) inflight: Inflight,
}

impl Job {
    pub(super) async fn run(self, payload: Bytes, cancel: CancellationToken) {
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
        // Only now: until the ack the request counts in the backlog the servers admit by.
        ack(&self.client, self.ack.clone()).await;
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
        // The server's health probe (see `RequestTransport::probe`): the engine's GET /health.
        let probe = req.path == HEALTH_PATH;
        let mut builder = if probe {
            hyper::Request::get(&target)
        } else {
            hyper::Request::post(&target)
        };
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
        let body = if probe {
            Vec::new()
        } else {
            serde_json::to_vec(&req.body).map_err(|e| Failure::Other(e.to_string()))?
        };
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
