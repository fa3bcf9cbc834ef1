//! The SSE answer of a streaming generation request: one `data: {chunk}` per generated token
//! (the last one with `finish_reason`), an optional usage chunk, then `data: [DONE]`; the
//! request's blocks are saved to the block store (when the mock has one) before `[DONE]`.

use super::engine::{Outcome, Progress};
use super::http::{AppState, engine_stopped, rejected};
use super::kvd::SaveJob;
use super::openai::{ResponseMeta, filler, usage};
use axum::body::{Body, Bytes};
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;
use tokio::sync::watch;

/// The state of one SSE answer.
pub(super) struct StreamState {
    pub(super) app: Arc<AppState>,
    /// Saved when the request finishes, before its last chunk.
    pub(super) save: Option<SaveJob>,
    pub(super) rx: watch::Receiver<Progress>,
    pub(super) meta: ResponseMeta,
    pub(super) prompt_tokens: u32,
    pub(super) include_usage: bool,
    /// Tokens already turned into chunks.
    pub(super) sent: u32,
    /// Where the answer starts in the filler cycle.
    pub(super) first_word: u32,
    /// With `return_token_ids`: the prompt's ids (on the first chunk), and each chunk's ids.
    pub(super) prompt_ids: Option<Vec<u32>>,
    pub(super) queue: VecDeque<Bytes>,
    pub(super) done: bool,
    /// The request's `rid` registration, when it named one: an abort ends the stream.
    pub(super) live: Option<super::abort::LiveRid>,
}

impl StreamState {
    fn push_json(&mut self, value: &Value) {
        self.queue
            .push_back(Bytes::from(format!("data: {value}\n\n")));
    }

    fn push_done(&mut self) {
        self.queue
            .push_back(Bytes::from_static(b"data: [DONE]\n\n"));
        self.done = true;
    }

    /// `/abort_request` named this request: a last chunk with `finish_reason` `"abort"`, then
    /// `[DONE]`; the request leaves the engine once the stream (its receiver) is dropped.
    fn abort(&mut self) {
        let mut chunk = self.meta.chunk("", self.sent == 0, true);
        chunk["choices"][0]["finish_reason"] = "abort".into();
        self.push_json(&chunk);
        self.push_done();
        self.live = None;
    }

    /// Turns new progress into chunks; `closed`: the engine dropped the request's channel.
    fn advance(&mut self, p: Progress, closed: bool) {
        let finished = p.outcome == Some(Outcome::Finished);
        for i in self.sent..p.tokens {
            let last = finished && i + 1 == p.tokens;
            let word = self.first_word + i;
            let mut chunk = self.meta.chunk(&filler(word, word + 1), i == 0, last);
            if let Some(ids) = &self.prompt_ids {
                chunk["choices"][0]["token_ids"] = json!(self.app.word_ids(word));
                if i == 0 {
                    chunk["prompt_token_ids"] = json!(ids);
                }
            }
            self.push_json(&chunk);
        }
        let had_tokens = p.tokens > self.sent;
        self.sent = self.sent.max(p.tokens);
        match p.outcome {
            Some(Outcome::Finished) => {
                if !had_tokens {
                    let chunk = self.meta.chunk("", self.sent == 0, true);
                    self.push_json(&chunk);
                }
                if self.include_usage {
                    let chunk =
                        self.meta
                            .usage_chunk(usage(self.prompt_tokens, p.tokens, p.cached_tokens));
                    self.push_json(&chunk);
                }
                self.push_done();
            }
            Some(Outcome::Rejected) => {
                self.push_json(&rejected().body());
                self.push_done();
            }
            None if closed => {
                self.push_json(&engine_stopped().body());
                self.push_done();
            }
            None => {}
        }
    }
}

pub(super) fn sse_response(state: StreamState) -> Response {
    let stream = futures::stream::unfold(state, |mut s| async move {
        loop {
            if let Some(bytes) = s.queue.pop_front() {
                return Some((Ok::<_, Infallible>(bytes), s));
            }
            if s.done {
                return None;
            }
            let token = s.live.as_ref().map(|l| l.token.clone());
            let aborted = async {
                match token {
                    Some(t) => t.cancelled_owned().await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                changed = s.rx.changed() => {
                    let closed = changed.is_err();
                    let p = *s.rx.borrow_and_update();
                    if p.outcome == Some(Outcome::Finished)
                        && let (Some(tier), Some(job)) = (&s.app.kvd, s.save.take())
                    {
                        tier.save(job, &s.app.metrics).await;
                    }
                    s.advance(p, closed);
                }
                () = aborted => s.abort(),
            }
        }
    });
    (
        [
            (
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/event-stream"),
            ),
            (header::CACHE_CONTROL, HeaderValue::from_static("no-cache")),
        ],
        Body::from_stream(stream),
    )
        .into_response()
}
