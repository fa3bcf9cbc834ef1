//! SGLang's explicit abort of a PD pair's legs (`sglang-bootstrap`): once both legs were sent,
//! a leg that is still running when the request is given up gets `POST /abort_request` with
//! body `{"rid": <the legs' rid>}` (SGLang's own endpoint; its `rid` is the one
//! [`super::pd::sglang_rid`] put in both legs' bodies).
//!
//! Dropping a leg's connection is not enough for SGLang: a prefill waits for its decode peer's
//! bootstrap (and a decode for its KV) without noticing that the other leg is gone, holding a
//! batch slot and KV until a transfer timeout. So:
//!
//! - one leg fails before the client's first byte: the other leg, which was sent, is aborted
//!   (the failed one is not: nothing runs there);
//! - the client goes away, or the decode leg's stream fails, after the first byte: the decode
//!   leg is aborted, and so is the prefill leg unless its answer has already ended;
//! - the decode leg ends normally: nothing is aborted (a prefill still finishing its answer
//!   ends on its own).
//!
//! [`AbortGuard`] holds that state; it aborts on drop. Aborts are sent through the request
//! transport (`/abort_request` on the worker, over HTTP or NATS alike), one task each, bounded
//! by [`ABORT_TIMEOUT`]; a failed abort is logged, never retried.

use crate::ids::WorkerId;
use crate::ports::transport::{BodyStream, Outbound, RequestTransport, TransportError};
use bytes::Bytes;
use futures::Stream;
use futures::StreamExt as _;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

/// SGLang's abort endpoint.
pub(crate) const ABORT_PATH: &str = "/abort_request";

/// How long one abort may take before it is given up (logged).
pub(crate) const ABORT_TIMEOUT: Duration = Duration::from_secs(5);

/// Where one leg runs.
#[derive(Debug, Clone)]
pub(crate) struct LegTarget {
    pub(crate) worker: WorkerId,
    /// The worker's URL, without a trailing slash.
    pub(crate) url: String,
}

#[derive(Debug)]
struct Shared {
    transport: Arc<dyn RequestTransport>,
    rid: String,
    request_id: String,
    prefill: LegTarget,
    decode: LegTarget,
    /// Whether the prefill leg may still be running (sent, its answer not yet ended).
    prefill_running: AtomicBool,
}

/// Marks the prefill leg as no longer running (its answer ended, or it failed).
#[derive(Debug, Clone)]
pub(crate) struct PrefillMark(Arc<Shared>);

impl PrefillMark {
    pub(crate) fn ended(&self) {
        self.0.prefill_running.store(false, Ordering::Release);
    }
}

/// The abort state of one pair's legs. See the module docs.
#[derive(Debug)]
pub(crate) struct AbortGuard {
    shared: Arc<Shared>,
    /// Whether the decode leg may still be running; `None` once the guard is disarmed.
    decode_running: Option<bool>,
}

impl AbortGuard {
    /// A guard for two legs that are about to be sent, both counted as running.
    pub(crate) fn new(
        transport: Arc<dyn RequestTransport>,
        rid: String,
        request_id: String,
        prefill: LegTarget,
        decode: LegTarget,
    ) -> Self {
        AbortGuard {
            shared: Arc::new(Shared {
                transport,
                rid,
                request_id,
                prefill,
                decode,
                prefill_running: AtomicBool::new(true),
            }),
            decode_running: Some(true),
        }
    }

    /// The handle that marks the prefill leg's end.
    pub(crate) fn prefill(&self) -> PrefillMark {
        PrefillMark(self.shared.clone())
    }

    /// The decode leg failed before it answered: nothing runs there.
    pub(crate) fn decode_failed(&mut self) {
        if let Some(running) = &mut self.decode_running {
            *running = false;
        }
    }

    /// The decode leg ended normally: nothing is aborted.
    pub(crate) fn disarm(&mut self) {
        self.decode_running = None;
    }

    /// `body` (the decode leg's), holding this guard until it ends: an end of stream disarms
    /// it, an error or a drop before the end aborts what still runs.
    pub(crate) fn guard_body(self, body: BodyStream) -> BodyStream {
        GuardedBody {
            inner: body,
            guard: Some(self),
        }
        .boxed()
    }
}

impl Drop for AbortGuard {
    fn drop(&mut self) {
        let Some(decode_running) = self.decode_running.take() else {
            return;
        };
        let s = &self.shared;
        let prefill_running = s.prefill_running.swap(false, Ordering::AcqRel);
        for (target, running) in [(&s.decode, decode_running), (&s.prefill, prefill_running)] {
            if running {
                spawn_abort(s.transport.clone(), target, &s.rid, &s.request_id);
            }
        }
    }
}

/// Posts one abort in its own task (see the module docs).
fn spawn_abort(
    transport: Arc<dyn RequestTransport>,
    target: &LegTarget,
    rid: &str,
    request_id: &str,
) {
    let body = serde_json::json!({ "rid": rid }).to_string();
    let out = Outbound::new(
        target.worker.clone(),
        target.url.clone(),
        ABORT_PATH,
        Bytes::from(body),
        false,
        request_id,
    );
    let rid = rid.to_owned();
    // Not an async context (a drop outside the runtime, at shutdown): nothing left to abort.
    let Ok(handle) = tokio::runtime::Handle::try_current() else {
        return;
    };
    handle.spawn(async move {
        let worker = out.worker.clone();
        let sent = tokio::time::timeout(ABORT_TIMEOUT, async {
            let response = transport.send(out).await?;
            let status = response.status;
            let mut body = response.body;
            while let Some(chunk) = body.next().await {
                chunk?;
            }
            Ok::<_, TransportError>(status)
        })
        .await;
        match sent {
            Ok(Ok(status)) if status.is_success() => {
                tracing::info!(worker = %worker.as_str(), %rid, "PD leg aborted");
            }
            Ok(Ok(status)) => {
                tracing::warn!(worker = %worker.as_str(), %rid, %status, "PD leg abort refused");
            }
            Ok(Err(e)) => {
                tracing::warn!(worker = %worker.as_str(), %rid, error = %e, "PD leg abort failed");
            }
            Err(_) => tracing::warn!(worker = %worker.as_str(), %rid,
                timeout_s = ABORT_TIMEOUT.as_secs(), "PD leg abort timed out"),
        }
    });
}

/// A decode body that holds its pair's [`AbortGuard`] until its end.
struct GuardedBody {
    inner: BodyStream,
    guard: Option<AbortGuard>,
}

impl Stream for GuardedBody {
    type Item = Result<Bytes, TransportError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let item = self.inner.poll_next_unpin(cx);
        match &item {
            Poll::Ready(None) => {
                if let Some(mut guard) = self.guard.take() {
                    guard.disarm();
                }
            }
            // The stream cannot be trusted past an error: the relay stops reading, and what
            // still runs is aborted.
            Poll::Ready(Some(Err(_))) => drop(self.guard.take()),
            _ => {}
        }
        item
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ports::transport::Inbound;
    use async_trait::async_trait;
    use http::StatusCode;
    use tokio::sync::mpsc;

    /// Records every request and answers 200 with an empty body.
    #[derive(Debug)]
    struct Recorder(mpsc::Sender<Outbound>);

    #[async_trait]
    impl RequestTransport for Recorder {
        fn name(&self) -> &'static str {
            "recorder"
        }

        async fn send(&self, req: Outbound) -> Result<Inbound, TransportError> {
            let _ = self.0.send(req).await;
            Ok(Inbound {
                status: StatusCode::OK,
                content_type: None,
                body: futures::stream::empty().boxed(),
            })
        }
    }

    fn guard() -> (AbortGuard, mpsc::Receiver<Outbound>) {
        let (tx, rx) = mpsc::channel(8);
        let target = |w: &str| LegTarget {
            worker: WorkerId::new(w),
            url: format!("http://{w}"),
        };
        let g = AbortGuard::new(
            Arc::new(Recorder(tx)),
            "infera-00000000000000ab".into(),
            "req-1".into(),
            target("p"),
            target("d"),
        );
        (g, rx)
    }

    /// The workers aborted, once every abort task has run (the guard is gone by then, so the
    /// channel closes when the last abort's sender is dropped with its transport).
    async fn aborted(mut rx: mpsc::Receiver<Outbound>) -> Vec<String> {
        let mut out = Vec::new();
        while let Some(req) = rx.recv().await {
            assert_eq!(req.path, ABORT_PATH);
            assert_eq!(
                serde_json::from_slice::<serde_json::Value>(&req.body).unwrap(),
                serde_json::json!({"rid": "infera-00000000000000ab"})
            );
            assert_eq!(req.url, format!("http://{}", req.worker.as_str()));
            out.push(req.worker.as_str().to_owned());
        }
        out.sort();
        out
    }

    #[tokio::test]
    async fn a_dropped_guard_aborts_both_running_legs() {
        let (g, rx) = guard();
        drop(g);
        assert_eq!(aborted(rx).await, ["d", "p"]);
    }

    #[tokio::test]
    async fn a_failed_prefill_aborts_only_the_decode_leg() {
        let (g, rx) = guard();
        g.prefill().ended();
        drop(g);
        assert_eq!(aborted(rx).await, ["d"]);
    }

    #[tokio::test]
    async fn a_failed_decode_aborts_only_the_prefill_leg() {
        let (mut g, rx) = guard();
        g.decode_failed();
        drop(g);
        assert_eq!(aborted(rx).await, ["p"]);
    }

    #[tokio::test]
    async fn a_decode_body_that_ends_aborts_nothing() {
        let (g, rx) = guard();
        let mut body = g.guard_body(futures::stream::iter([Ok(Bytes::from("x"))]).boxed());
        assert_eq!(body.next().await.unwrap().unwrap(), "x");
        assert!(body.next().await.is_none());
        drop(body);
        assert!(aborted(rx).await.is_empty());
    }

    #[tokio::test]
    async fn a_decode_body_dropped_midway_aborts_what_still_runs() {
        let (g, rx) = guard();
        let prefill = g.prefill();
        let mut body = g.guard_body(
            futures::stream::iter([Ok(Bytes::from("x")), Ok(Bytes::from("y"))]).boxed(),
        );
        assert_eq!(body.next().await.unwrap().unwrap(), "x");
        // The prefill's answer has ended: only the decode leg still runs.
        prefill.ended();
        drop(prefill);
        drop(body);
        assert_eq!(aborted(rx).await, ["d"]);
    }

    #[tokio::test]
    async fn a_decode_stream_error_aborts_at_once() {
        let (g, rx) = guard();
        let mut body = g.guard_body(
            futures::stream::iter([Err(TransportError::Failed("link".into()))]).boxed(),
        );
        assert!(body.next().await.unwrap().is_err());
        drop(body);
        assert_eq!(aborted(rx).await, ["d", "p"]);
    }
}
