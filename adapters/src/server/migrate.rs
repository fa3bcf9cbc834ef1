//! Stream migration (`--migration-limit`, the Python Infera's flag; 0, the default, is off): a
//! stream whose worker fails mid-stream is continued on another worker instead of ending with an
//! error event, up to the limit per request, never on a worker that already failed it.
//!
//! # How
//! While relaying, every complete SSE frame the client received is read: the generated text
//! (`choices[0].text`, or `choices[0].delta.content` for chat) and its count of content frames
//! (one token each on vLLM and SGLang) are kept, with the stream's `id`. On a failure the
//! request is re-issued with that text appended (completions: to the prompt; chat: as a final
//! assistant message with `continue_final_message`) and its token budget (`max_tokens`,
//! `max_completion_tokens`) reduced by what was produced. The continuation's frames are relayed
//! with the first stream's `id`, and a chat continuation's role-only opening frame is dropped,
//! so the client reads one stream. The new worker is decided like any attempt (a new
//! `RequestRouted`, the failed ranks and open circuit breakers excluded; its answer before the
//! first byte feeds its breaker), and must answer its first byte before it is used; otherwise
//! the stream ends with the error event as without migration. A mid-stream failure itself is
//! not held against a worker's breaker.
//!
//! # Limits
//! Only mixed (not prefill/decode) streams of one choice (`n`, `best_of` ≤ 1) with a text prompt
//! or chat messages, broken on a frame boundary. Text is carried, not token ids: the
//! continuation re-tokenizes it (the same words, not provably the same tokens), and sampling
//! state does not move, so a fixed seed is not reproduced.

use super::ServerState;
use super::attempt::{Attempt, attempt_id};
use super::breaker::{Judge, Outcome, answer_outcome, breaker_outcome};
use super::metrics::inc;
use super::relay::first_chunk;
use axum::body::Bytes;
use futures::StreamExt as _;
use infera_core::ids::WorkerRank;
use infera_core::policy::{RouteError, RouteRequest};
use infera_core::ports::transport::{BodyStream, Outbound};
use serde_json::{Map, Value, json};

/// One stream's migration state. See the module docs.
pub(super) struct Migration {
    st: ServerState,
    req: RouteRequest,
    path: &'static str,
    body: Map<String, Value>,
    chat: bool,
    client_id: String,
    left: u32,
    /// The rank serving the stream now.
    current: WorkerRank,
    text: String,
    tokens: u64,
    finished: bool,
    stream_id: Option<String>,
    /// A frame the client has only part of.
    partial: Vec<u8>,
    /// Relaying a continuation: its frames are rewritten ([`Migration::rewrite`]).
    continued: bool,
    /// A continuation frame not yet complete.
    incoming: Vec<u8>,
}

impl ServerState {
    /// Sets `--migration-limit`: how many times one stream may move to another worker when its
    /// own fails mid-stream (0, the default, turns migration off).
    pub fn set_migration_limit(&self, limit: u32) {
        self.inner
            .migration_limit
            .store(limit, std::sync::atomic::Ordering::Relaxed);
    }
}

impl Migration {
    /// The migration state of a stream to `rank`, when `limit` > 0 and the request can move.
    pub(super) fn new(
        st: &ServerState,
        req: &RouteRequest,
        path: &'static str,
        body: &Bytes,
        rank: WorkerRank,
        client_id: &str,
    ) -> Option<Box<Self>> {
        let limit = st
            .inner
            .migration_limit
            .load(std::sync::atomic::Ordering::Relaxed);
        if limit == 0 {
            return None;
        }
        let Ok(Value::Object(body)) = serde_json::from_slice::<Value>(body) else {
            return None;
        };
        let one = |k: &str| body.get(k).and_then(Value::as_u64).is_none_or(|n| n <= 1);
        let chat = path == "/v1/chat/completions";
        let movable = one("n")
            && one("best_of")
            && if chat {
                body.get("messages").is_some_and(Value::is_array)
            } else {
                body.get("prompt").is_some_and(Value::is_string)
            };
        movable.then(|| {
            Box::new(Self {
                st: st.clone(),
                req: req.clone(),
                path,
                body,
                chat,
                client_id: client_id.to_owned(),
                left: limit,
                current: rank,
                text: String::new(),
                tokens: 0,
                finished: false,
                stream_id: None,
                partial: Vec::new(),
                continued: false,
                incoming: Vec::new(),
            })
        })
    }

    /// Whether the stream's frames pass through [`Migration::rewrite`].
    pub(super) fn continued(&self) -> bool {
        self.continued
    }

    /// Reads what the client is sent.
    pub(super) fn observe(&mut self, data: &[u8]) {
        self.partial.extend_from_slice(data);
        while let Some(end) = frame_end(&self.partial) {
            let frame: Vec<u8> = self.partial.drain(..end).collect();
            for payload in data_lines(&frame) {
                if payload == b"[DONE]" {
                    self.finished = true;
                    continue;
                }
                let Ok(v) = serde_json::from_slice::<Value>(payload) else {
                    continue;
                };
                if self.stream_id.is_none() {
                    self.stream_id = v.get("id").and_then(Value::as_str).map(str::to_owned);
                }
                let choice = &v["choices"][0];
                let piece = if self.chat {
                    &choice["delta"]["content"]
                } else {
                    &choice["text"]
                };
                if let Some(piece) = piece.as_str().filter(|p| !p.is_empty()) {
                    self.text.push_str(piece);
                    self.tokens += 1;
                }
                if !choice["finish_reason"].is_null() {
                    self.finished = true;
                }
            }
        }
    }

    /// A continuation's chunk as the client must see it: complete frames only, with the first
    /// stream's id, without a chat continuation's role-only frames.
    pub(super) fn rewrite(&mut self, data: &[u8]) -> Bytes {
        self.incoming.extend_from_slice(data);
        let mut out = Vec::with_capacity(self.incoming.len());
        while let Some(end) = frame_end(&self.incoming) {
            let frame: Vec<u8> = self.incoming.drain(..end).collect();
            let payload = data_lines(&frame).next();
            let Some(Ok(Value::Object(mut v))) = payload.map(serde_json::from_slice::<Value>)
            else {
                out.extend_from_slice(&frame);
                continue;
            };
            let delta = &v["choices"][0]["delta"];
            if self.chat
                && delta.get("role").is_some()
                && delta["content"].as_str().is_none_or(str::is_empty)
            {
                continue;
            }
            if let Some(id) = &self.stream_id {
                v.insert("id".to_owned(), Value::String(id.clone()));
            }
            out.extend_from_slice(b"data: ");
            out.extend_from_slice(Value::Object(v).to_string().as_bytes());
            out.extend_from_slice(b"\n\n");
        }
        Bytes::from(out)
    }

    /// Continues the stream on another worker after its worker failed; `None` when it cannot
    /// (no migration left, the stream had ended or broke mid-frame, no other worker, or the
    /// new one did not answer its first byte).
    pub(super) async fn resume(&mut self) -> Option<(Attempt, BodyStream)> {
        if self.left == 0 || self.finished || !self.partial.is_empty() {
            return None;
        }
        self.left -= 1;
        let body = self.continuation()?;
        let failed = self.current.clone();
        self.req.exclude.push(failed.clone());
        self.req.request_id = attempt_id(&self.st, &self.client_id);
        let (rank, url, dp_rank) = match super::relay::decide_single(&self.st, &mut self.req) {
            Ok(Some(x)) => x,
            Ok(None) | Err(RouteError::NoWorker { .. }) => {
                tracing::warn!(request_id = %self.client_id, "no other worker to migrate to");
                return None;
            }
            Err(e) => {
                tracing::warn!(request_id = %self.client_id, error = %e, "cannot migrate");
                return None;
            }
        };
        let mut guard = Attempt::new(&self.st, &self.req, false);
        let judge = Judge::new(&self.st, vec![rank.worker.clone()]);
        let out = Outbound::new(
            rank.worker.clone(),
            url,
            self.path,
            body,
            true,
            &self.client_id,
        )
        .with_dp_rank(dp_rank);
        let mut resp = match self.st.inner.transport.send(out).await {
            Ok(r) if r.status.is_success() => r,
            Ok(r) => {
                judge.record(&rank, answer_outcome(r.status));
                guard.finish_failed();
                return None;
            }
            Err(e) => {
                judge.record(&rank, breaker_outcome(&e));
                guard.finish_failed();
                return None;
            }
        };
        match first_chunk(&mut resp.body).await {
            Some(Ok(chunk)) => {
                judge.record(&rank, Outcome::Success);
                tracing::warn!(request_id = %self.client_id, from = %failed.worker.as_str(),
                    to = %rank.worker.as_str(), tokens = self.tokens,
                    "stream migrated to another worker");
                inc(&self.st.inner.metrics.migrations, 1);
                self.current = rank;
                self.continued = true;
                guard.first_byte();
                let body = futures::stream::once(async move { Ok(chunk) })
                    .chain(resp.body)
                    .boxed();
                Some((guard, body))
            }
            _ => {
                judge.record(&rank, Outcome::Failure);
                guard.finish_failed();
                None
            }
        }
    }

    /// The request that continues the generation; `None` when its token budget is spent.
    fn continuation(&self) -> Option<Bytes> {
        let mut body = self.body.clone();
        for key in ["max_tokens", "max_completion_tokens"] {
            if let Some(n) = body.get(key).and_then(Value::as_u64) {
                let left = n.checked_sub(self.tokens).filter(|l| *l > 0)?;
                body.insert(key.to_owned(), json!(left));
            }
        }
        if self.chat {
            let messages = body.get_mut("messages")?.as_array_mut()?;
            messages.push(json!({"role": "assistant", "content": self.text}));
            body.insert("continue_final_message".to_owned(), json!(true));
            body.insert("add_generation_prompt".to_owned(), json!(false));
        } else {
            let prompt = body.get("prompt")?.as_str()?;
            let carried = format!("{prompt}{}", self.text);
            body.insert("prompt".to_owned(), Value::String(carried));
        }
        serde_json::to_vec(&body).ok().map(Bytes::from)
    }
}

/// The end (exclusive) of the first complete SSE frame in `buf`.
fn frame_end(buf: &[u8]) -> Option<usize> {
    buf.windows(2).position(|w| w == b"\n\n").map(|i| i + 2)
}

/// The payloads of a frame's `data: ` lines.
fn data_lines(frame: &[u8]) -> impl Iterator<Item = &[u8]> {
    frame
        .split(|b| *b == b'\n')
        .filter_map(|l| {
            l.strip_prefix(b"data: ")
                .or_else(|| l.strip_prefix(b"data:"))
        })
        .map(|p| p.strip_suffix(b"\r").unwrap_or(p))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::server::test_support::state;
    use infera_core::ids::RequestId;

    fn migration(st: &ServerState, path: &'static str, body: Value) -> Option<Box<Migration>> {
        let req = RouteRequest {
            request_id: RequestId::new("r#1"),
            model: "m".into(),
            prompt_tokens: 1,
            hashes: Vec::new(),
            retention: None,
            exclude: Vec::new(),
        };
        let body = Bytes::from(body.to_string());
        Migration::new(st, &req, path, &body, WorkerRank::new("w:1", 0), "r")
    }

    #[test]
    fn a_chat_stream_is_read_across_chunks_and_its_continuation_rewritten() {
        let st = state();
        let body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 5, "stream": true});
        assert!(
            migration(&st, "/v1/chat/completions", body.clone()).is_none(),
            "off"
        );
        st.set_migration_limit(2);
        let mut m = migration(&st, "/v1/chat/completions", body).expect("movable");
        let first = br#"data: {"id":"c-1","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}

data: {"id":"c-1","choices":[{"index":0,"delta":{"content":"Hel"#;
        m.observe(first);
        assert!(!m.partial.is_empty(), "a frame is incomplete");
        m.observe(b"lo\"},\"finish_reason\":null}]}\n\n");
        assert_eq!(
            (m.text.as_str(), m.tokens, m.partial.len()),
            ("Hello", 1, 0)
        );
        let cont: Value = serde_json::from_slice(&m.continuation().expect("budget left")).unwrap();
        assert_eq!(cont["max_completion_tokens"], 4);
        assert_eq!(
            cont["messages"][1],
            json!({"role": "assistant", "content": "Hello"})
        );
        assert_eq!(cont["continue_final_message"], true);
        assert_eq!(cont["add_generation_prompt"], false);
        // The continuation's role-only opening frame is dropped, its ids replaced, its frames
        // released whole.
        let out = m.rewrite(
            b"data: {\"id\":\"c-2\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\"}}]}\n\ndata: {\"id\":\"c-2\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\" you\"}}]}\n\ndata: [DO",
        );
        let text = String::from_utf8_lossy(&out).into_owned();
        assert_eq!(text.matches("data: ").count(), 1, "{text}");
        assert!(
            text.contains("\"id\":\"c-1\"") && text.contains(" you"),
            "{text}"
        );
        assert_eq!(&m.rewrite(b"NE]\n\n")[..], b"data: [DONE]\n\n");
    }

    #[test]
    fn only_single_choice_text_prompts_move_and_a_spent_budget_does_not() {
        let st = state();
        st.set_migration_limit(1);
        let path = "/v1/completions";
        for body in [
            json!({"prompt": [1, 2, 3]}),
            json!({"prompt": ["a", "b"]}),
            json!({"prompt": "x", "n": 2}),
            json!({"prompt": "x", "best_of": 3}),
            json!("not an object"),
        ] {
            assert!(migration(&st, path, body.clone()).is_none(), "{body}");
        }
        let mut m = migration(&st, path, json!({"prompt": "x", "max_tokens": 1})).unwrap();
        m.observe(
            b"data: {\"id\":\"a\",\"choices\":[{\"text\":\"y\",\"finish_reason\":null}]}\n\n",
        );
        assert!(m.continuation().is_none(), "no tokens left to generate");
    }
}
