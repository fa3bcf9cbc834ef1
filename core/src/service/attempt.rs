//! One attempt of a request at a worker (or a PD pair), as the fleet sees it: [`Attempt`] owns
//! the attempt's load, appending `RequestPrefilled` at the first byte (a PD pair: when the
//! prefill leg answered) and exactly one `RequestFinished` — explicitly, or on drop
//! (`cancelled`) when the client goes away — with the usage the worker's answer reported
//! ([`usage_of`]). `RequestPrefilled` never follows `RequestFinished`.

use super::Service;
use super::deadline::Prefill;
use super::metrics::SlaSample;
use crate::event::{Event, RequestFinished, RequestPrefilled, RequestStatus};
use crate::ids::RequestId;
use crate::log::NewEvent;
use crate::policy::RouteRequest;
use crate::ports::trace::TARGET;
use http::StatusCode;
use serde_json::Value;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

/// One attempt's lifecycle in the fleet. See the module docs.
#[derive(Debug)]
pub struct Attempt {
    pub(crate) st: Service,
    id: RequestId,
    started: Instant,
    prompt_tokens: u32,
    ttft_us: Option<u64>,
    done: bool,
    pub(crate) prefill: PrefillState,
    /// A PD attempt: `RequestPrefilled` waits for the prefill leg, not the first byte.
    pd: bool,
    /// A PD attempt's decode worker (its route key): the decode leg is timed to the end.
    decode_worker: Option<String>,
    /// What the SLA histograms need (`--enable-sla-metrics`), when on.
    sla: Option<Sla>,
    /// The model the request named, for the per-model families.
    model: String,
    /// A single worker's attempt: the worker and the prompt tokens it prefills, a sample of its
    /// prefill rate at the first byte (see `deadline`).
    prefill_sample: Option<(crate::ids::WorkerId, Prefill)>,
    /// Whose request it is: the tenant's metrics and its generated-token limit.
    share: Option<super::Share>,
    /// The attempt's span (see [`crate::ports::trace`]): disabled unless traces are exported.
    span: tracing::Span,
}

/// An attempt's SLA bookkeeping: whether the client streams, and the stream's data frames (the
/// output length when the engine reports no usage).
#[derive(Debug)]
struct Sla {
    stream: bool,
    frames: u32,
}

/// Whether an attempt's `RequestPrefilled` was appended, or can no longer be (the attempt
/// finished first). Shared with a PD attempt's prefill leg, which may complete on another
/// task; the lock is held across the append, so `RequestPrefilled` never follows
/// `RequestFinished`.
#[derive(Debug, Clone)]
pub(crate) struct PrefillState {
    st: Service,
    id: RequestId,
    settled: Arc<Mutex<bool>>,
}

impl PrefillState {
    /// Appends `RequestPrefilled`, once, unless the attempt already finished.
    pub(crate) fn prefilled(&self) {
        let mut settled = self.settled.lock().unwrap_or_else(PoisonError::into_inner);
        if !std::mem::replace(&mut *settled, true) {
            self.st.apply(vec![NewEvent::new(Event::RequestPrefilled(
                RequestPrefilled {
                    request_id: self.id.clone(),
                },
            ))]);
        }
    }

    /// Appends `RequestFinished` (built by `finished`); no `RequestPrefilled` after it.
    fn finish(&self, finished: RequestFinished) {
        let mut settled = self.settled.lock().unwrap_or_else(PoisonError::into_inner);
        *settled = true;
        self.st
            .apply(vec![NewEvent::new(Event::RequestFinished(finished))]);
    }
}

impl Attempt {
    pub fn new(st: &Service, req: &RouteRequest, pd: bool) -> Self {
        Attempt {
            st: st.clone(),
            id: req.request_id.clone(),
            started: Instant::now(),
            prompt_tokens: req.prompt_tokens,
            ttft_us: None,
            done: false,
            prefill: PrefillState {
                st: st.clone(),
                id: req.request_id.clone(),
                settled: Arc::new(Mutex::new(false)),
            },
            pd,
            decode_worker: None,
            sla: None,
            model: req.model.clone(),
            prefill_sample: None,
            share: None,
            span: tracing::trace_span!(
                target: TARGET,
                "attempt",
                otel.kind = "client",
                infera.request_id = %req.request_id.0,
                infera.worker = tracing::field::Empty,
                infera.decode_worker = tracing::field::Empty,
                infera.ttft_ms = tracing::field::Empty,
                infera.outcome = tracing::field::Empty,
                gen_ai.usage.input_tokens = tracing::field::Empty,
                gen_ai.usage.output_tokens = tracing::field::Empty,
            ),
        }
        .counted()
    }

    /// Writes the attempt's trace context into the headers it is sent with, when traces are
    /// exported (the engine's spans become children of the attempt's).
    pub(crate) fn trace_into(&self, headers: &mut http::HeaderMap) {
        if let Some(trace) = self.st.trace_context()
            && !self.span.is_disabled()
        {
            trace.inject(&self.span, headers);
        }
    }

    /// Charges this attempt's outcome and generated tokens to `share`'s tenant.
    pub(crate) fn charge_to(&mut self, share: &super::Share) {
        self.share = Some(share.clone());
    }

    /// Records this attempt in the SLA histograms when it succeeds (`--enable-sla-metrics`).
    pub(crate) fn observe_sla(&mut self, stream: bool) {
        if self.st.inner.sla_metrics.load(Ordering::Relaxed) {
            self.sla = Some(Sla { stream, frames: 0 });
        }
    }

    /// Counts the token frames of a relayed stream chunk (`data:` lines other than `[DONE]`
    /// and usage frames), when the SLA histograms are on.
    pub(crate) fn count_frames(&mut self, chunk: &[u8]) {
        let Some(sla) = &mut self.sla else { return };
        let frames = chunk
            .split(|b| *b == b'\n')
            .map(<[u8]>::trim_ascii)
            .filter(|line| {
                line.starts_with(b"data:")
                    && !line.starts_with(b"data: [DONE]")
                    && !line.windows(7).any(|w| w == b"\"usage\"")
            })
            .count();
        sla.frames = sla
            .frames
            .saturating_add(u32::try_from(frames).unwrap_or(u32::MAX));
    }

    /// Counts the attempt in `infera_request_inflight` (until it finishes).
    fn counted(self) -> Self {
        self.inflight().inc();
        self
    }

    fn inflight(&self) -> prometheus_client::metrics::gauge::Gauge {
        self.st
            .inner
            .metrics
            .request_inflight
            .get_or_create_owned(&[("router", self.router())])
    }

    /// The Python Infera's `router` label: `disagg` for a PD pair, else `mixed`.
    fn router(&self) -> &'static str {
        if self.pd { "disagg" } else { "mixed" }
    }

    /// A PD attempt's legs, for `infera_pd_dispatch_duration_seconds`: returns what the pair's
    /// sender runs when the prefill leg completed (the prompt is processed; the prefill leg's
    /// duration ends); the decode leg's ends with the attempt.
    pub(crate) fn pd_legs(
        &mut self,
        prefill_worker: String,
        decode_worker: String,
    ) -> impl FnOnce() + Send + 'static {
        self.span.record("infera.worker", prefill_worker.as_str());
        self.span
            .record("infera.decode_worker", decode_worker.as_str());
        self.decode_worker = Some(decode_worker);
        let (prefill, started) = (self.prefill.clone(), self.started);
        move || {
            prefill.prefilled();
            prefill
                .st
                .inner
                .metrics
                .pd_dispatch_duration
                .get_or_create(&[("leg", "prefill".to_owned()), ("worker_id", prefill_worker)])
                .observe(started.elapsed().as_secs_f64());
        }
    }

    /// Marks the attempt as `worker` doing `work` before its first byte, which teaches the
    /// service the worker's prefill rate and is a sample of its time to first byte (see
    /// `outlier`).
    pub(crate) fn prefilling(&mut self, worker: crate::ids::WorkerId, work: Prefill) {
        self.span.record("infera.worker", worker.as_str());
        self.prefill_sample = Some((worker, work));
    }

    /// The client's first byte: the TTFT; for one leg, the prompt is processed too.
    pub fn first_byte(&mut self) {
        if self.ttft_us.is_some() {
            return;
        }
        let elapsed = self.started.elapsed();
        if let Some((worker, work)) = self.prefill_sample.take() {
            let inner = &self.st.inner;
            inner
                .first_byte
                .observe(&worker, work.uncached_tokens, elapsed);
            let tokens = u64::from(work.uncached_tokens).saturating_add(work.queued_tokens);
            inner
                .outliers
                .first_byte(&worker, tokens, elapsed, inner.clock.now_us());
        }
        self.ttft_us = Some(elapsed.as_micros() as u64);
        if !self.span.is_disabled() {
            let ms = elapsed.as_secs_f64() * 1e3;
            self.span.record("infera.ttft_ms", ms);
            tracing::trace!(target: TARGET, parent: &self.span, ttft_ms = ms, "first byte");
        }
        self.st
            .inner
            .metrics
            .models
            .first_byte(&self.model, elapsed.as_secs_f64());
        if !self.pd {
            self.prefill.prefilled();
        }
    }

    /// Finishes the attempt as a worker error.
    pub(crate) fn finish_failed(&mut self) {
        self.finish(RequestStatus::WorkerError, Usage::default());
    }

    pub fn finish(&mut self, status: RequestStatus, usage: Usage) {
        if std::mem::replace(&mut self.done, true) {
            return;
        }
        let m = &self.st.inner.metrics;
        let (ours, theirs) = match status {
            RequestStatus::Ok => ("ok", "ok"),
            RequestStatus::ClientError | RequestStatus::Rejected => ("client_error", "4xx"),
            RequestStatus::Cancelled => ("cancelled", "error"),
            RequestStatus::WorkerError | RequestStatus::Timeout => ("worker_error", "5xx"),
        };
        m.requests.get_or_create(&[("status", ours)]).inc();
        m.models.finished(&self.model, ours);
        if !self.span.is_disabled() {
            self.span.record("infera.outcome", ours);
            if let Some(n) = usage.prompt_tokens {
                self.span.record("gen_ai.usage.input_tokens", i64::from(n));
            }
            if let Some(n) = usage.completion_tokens {
                self.span.record("gen_ai.usage.output_tokens", i64::from(n));
            }
        }
        if let Some(share) = self.share.take() {
            let generated = u64::from(usage.completion_tokens.unwrap_or(0));
            if let Some(permit) = &share.permit {
                permit.generated(self.st.inner.clock.now_us(), generated);
            }
            let prompt = if status == RequestStatus::Ok {
                u64::from(self.prompt_tokens)
            } else {
                0
            };
            m.tenants.finished(&share.tenant, ours, prompt, generated);
        }
        let took = self.started.elapsed().as_secs_f64();
        m.request_duration
            .get_or_create(&[("router", self.router()), ("outcome", theirs)])
            .observe(took);
        self.inflight().dec();
        if let Some(sla) = self.sla.take()
            && status == RequestStatus::Ok
        {
            let sample = SlaSample {
                ttft_s: self
                    .ttft_us
                    .filter(|_| sla.stream)
                    .map(|us| us as f64 / 1e6),
                total_s: took,
                input_tokens: usage.prompt_tokens.unwrap_or(self.prompt_tokens),
                output_tokens: usage.completion_tokens.unwrap_or(sla.frames),
            };
            m.sla.observe(self.router(), &self.model, sample);
        }
        if let Some(worker) = self.decode_worker.take() {
            m.pd_dispatch_duration
                .get_or_create(&[("leg", "decode".to_owned()), ("worker_id", worker)])
                .observe(took);
        }
        self.prefill.finish(RequestFinished {
            request_id: self.id.clone(),
            status,
            ttft_us: self.ttft_us,
            tokens_in: usage.prompt_tokens.unwrap_or(self.prompt_tokens),
            tokens_out: usage.completion_tokens.unwrap_or(0),
            cached_tokens: usage.cached_tokens,
        });
    }
}

impl Drop for Attempt {
    fn drop(&mut self) {
        self.finish(RequestStatus::Cancelled, Usage::default());
    }
}

/// What a response says it used.
#[derive(Debug, Default, Clone, Copy)]
pub struct Usage {
    pub prompt_tokens: Option<u32>,
    pub completion_tokens: Option<u32>,
    pub cached_tokens: Option<u32>,
}

/// The `usage` object of a response body (or of one SSE chunk's payload). Everything else in
/// the body is skipped, not built: a response parsed into a `Value` cost as much as the rest
/// of relaying it. A count that is not a u32 is absent, as is a body that is not JSON.
pub(crate) fn usage_of(body: &[u8]) -> Usage {
    #[derive(serde::Deserialize)]
    struct Body {
        usage: Option<UsageWire>,
    }
    #[derive(serde::Deserialize)]
    struct UsageWire {
        prompt_tokens: Option<Value>,
        completion_tokens: Option<Value>,
        prompt_tokens_details: Option<Value>,
    }
    let Ok(Body { usage: Some(u) }) = serde_json::from_slice::<Body>(body) else {
        return Usage::default();
    };
    let n = |v: Option<&Value>| v?.as_u64().and_then(|n| u32::try_from(n).ok());
    Usage {
        prompt_tokens: n(u.prompt_tokens.as_ref()),
        completion_tokens: n(u.completion_tokens.as_ref()),
        cached_tokens: n(u
            .prompt_tokens_details
            .as_ref()
            .and_then(|d| d.get("cached_tokens"))),
    }
}

/// The request status of a worker's answer.
pub(crate) fn status_of(code: StatusCode) -> RequestStatus {
    if code.is_success() {
        RequestStatus::Ok
    } else if code.is_client_error() {
        RequestStatus::ClientError
    } else {
        RequestStatus::WorkerError
    }
}

#[cfg(test)]
mod tests {
    use super::usage_of;

    #[test]
    fn usage_is_read_from_a_whole_response_and_odd_counts_are_absent() {
        let u = usage_of(
            br#"{"id":"x","choices":[{"index":0,"text":"a \"usage\": {}","logprobs":null}],
               "usage":{"prompt_tokens":12,"completion_tokens":3,"total_tokens":15,
                        "prompt_tokens_details":{"cached_tokens":8}}}"#,
        );
        assert_eq!(
            (u.prompt_tokens, u.completion_tokens, u.cached_tokens),
            (Some(12), Some(3), Some(8))
        );
        let u = usage_of(
            br#"{"usage":{"prompt_tokens":1.5,"completion_tokens":-1,"prompt_tokens_details":7}}"#,
        );
        assert_eq!(
            (u.prompt_tokens, u.completion_tokens, u.cached_tokens),
            (None, None, None)
        );
        let u = usage_of(br#"{"usage":{"prompt_tokens":4294967296,"completion_tokens":2}}"#);
        assert_eq!((u.prompt_tokens, u.completion_tokens), (None, Some(2)));
        for body in [
            &b"not json"[..],
            br#"{"usage":null}"#,
            br#"{"usage":"x"}"#,
            b"[]",
        ] {
            let u = usage_of(body);
            assert_eq!(
                (u.prompt_tokens, u.completion_tokens, u.cached_tokens),
                (None, None, None)
            );
        }
    }
}
