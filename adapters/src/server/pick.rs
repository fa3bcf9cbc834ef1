//! Deciding without dispatching, for a gateway that sends the request itself (the Gateway API
//! Inference Extension's endpoint picker, `infera gaie`): [`ServerState::pick`] runs the HTTP
//! front's pipeline up to the decision — parse, tokenize, hash, decide, append `RequestRouted`
//! (both legs of a prefill/decode pair) — and hands back a [`Pick`] that owns the request's load
//! in the fleet, exactly as an attempt of the HTTP front does: [`Pick::first_byte`] appends
//! `RequestPrefilled`, [`Pick::finish`] appends `RequestFinished` (`ok` or a worker error), and
//! dropping an unfinished pick appends it as `cancelled`. No request is sent to a worker, no
//! failover is tried, and the circuit breaker is not fed (the gateway sees the worker's answer,
//! not the router).
//!
//! The body's shape is read from the body itself: a `messages` field makes it a chat request,
//! anything else a completions request (`prompt`), as the Python Infera's picker does.

use super::ServerState;
use super::body::Shape;
use super::http::route_error;
use axum::body::Bytes;
use infera_core::event::RequestStatus;
use infera_core::hashing::KvIdentity;
use infera_core::ids::SessionKey;
use infera_core::service::{Attempt, Prepared, RequestKeys, Route, Usage};
use serde::Deserialize;
use serde_json::value::RawValue;

/// Why a request could not be picked for: an HTTP status and a message for the client.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{status}: {message}")]
pub struct PickError {
    /// The status the HTTP front would answer (400 bad body, 404 unknown model, 503 no worker…).
    pub status: u16,
    /// What is wrong, for the client.
    pub message: String,
}

impl PickError {
    /// The HTTP front's error body for it: `{"error": {"message", "type", "code"}}`.
    pub fn body(&self) -> serde_json::Value {
        let status = axum::http::StatusCode::from_u16(self.status)
            .unwrap_or(axum::http::StatusCode::INTERNAL_SERVER_ERROR);
        super::http::ApiError::new(status, self.message.clone()).body()
    }
}

/// One decided request (see the module docs). Dropping it unfinished finishes it as cancelled.
#[derive(Debug)]
pub struct Pick {
    /// The worker the gateway sends the request to (a pair's decode worker).
    pub worker: String,
    /// That worker's registered URL (its engine), without a trailing slash.
    pub url: String,
    /// A prefill/decode pair's prefill worker.
    pub prefill: Option<String>,
    attempt: Attempt,
}

impl Pick {
    /// The worker's first response byte: the prompt is processed (`RequestPrefilled`).
    pub fn first_byte(&mut self) {
        self.attempt.first_byte();
    }

    /// The request ended: `ok`, or failed at the worker (`RequestFinished`).
    pub fn finish(mut self, ok: bool) {
        let status = if ok {
            RequestStatus::Ok
        } else {
            RequestStatus::WorkerError
        };
        self.attempt.finish(status, Usage::default());
    }
}

/// Whether a body has a top-level `messages` field.
#[derive(Deserialize)]
struct Sniff<'a> {
    #[serde(default, borrow)]
    messages: Option<&'a RawValue>,
}

impl ServerState {
    /// Decides a worker (or a prefill/decode pair) for an OpenAI completions or chat `body`
    /// without sending it, under `id` (see the module docs).
    ///
    /// # Errors
    /// The HTTP front's answer to the same body: 400 for a body that is not a request, 404 for
    /// a model no worker serves, 503 when none can take it, 500 when the tokenizer fails.
    pub async fn pick(&self, body: Bytes, id: &str) -> Result<Pick, PickError> {
        let to_pick = |e: super::http::ApiError| PickError {
            status: e.status.as_u16(),
            message: e.message,
        };
        let chat = serde_json::from_slice::<Sniff<'_>>(&body)
            .is_ok_and(|s| s.messages.is_some_and(|m| m.get() != "null"));
        let shape = if chat { Shape::Messages } else { Shape::Prompt };
        let default = self.inner.options.client.default_retention;
        let parsed = super::body::parse(body, shape, default).map_err(to_pick)?;
        let service = self.service();
        let key = service.request_key(id);
        let Prepared { mut req, .. } = service
            .prepare(
                self,
                &key,
                parsed.model,
                parsed.input,
                RequestKeys {
                    retention: parsed.retention,
                    direct: false,
                    identity: KvIdentity {
                        salt: parsed.cache_salt,
                        ..KvIdentity::default()
                    },
                    session: parsed.session_id.as_deref().map(SessionKey::of),
                },
            )
            .await
            .map_err(|e| to_pick(e.into()))?;
        req.request_id = service.attempt_id(&key);
        let route = service
            .decide(&mut req, None)
            .map_err(|e| to_pick(route_error(&e)))?;
        let (worker, url, prefill) = match route {
            Route::Single { rank, url, .. } => (rank.worker, url, None),
            Route::Pd(pair) => (
                pair.decode.rank.worker,
                pair.decode.url,
                Some(pair.prefill.rank.worker.as_str().to_owned()),
            ),
        };
        Ok(Pick {
            worker: worker.as_str().to_owned(),
            url,
            prefill,
            // A pair's prompt is processed when the gateway's request gets its first byte too:
            // the decode worker drives the prefill leg before answering.
            attempt: Attempt::new(service, &req, false),
        })
    }
}

#[cfg(test)]
mod tests {
    use crate::server::test_support::{record, state};
    use infera_core::event::Role;
    use infera_core::ids::{WorkerId, WorkerRank};

    fn inflight(st: &crate::server::ServerState, id: &str) -> (usize, u64) {
        let rank = WorkerRank::new(WorkerId::new(id), 0);
        st.service()
            .with_fleet(|f| (f.inflight_on(&rank), f.queued_prefill_tokens(&rank)))
    }

    #[tokio::test]
    async fn a_pick_loads_its_worker_until_it_is_finished_or_dropped() {
        let st = state();
        st.register_worker(record("w1:1"));
        let body = br#"{"model": "m", "messages": [{"role": "user", "content": "hello there"}]}"#;
        let mut pick = st.pick(body.to_vec().into(), "r").await.unwrap();
        assert_eq!(
            (pick.worker.as_str(), pick.url.as_str()),
            ("w1:1", "http://w1:1")
        );
        assert_eq!(pick.prefill, None);
        let (requests, queued) = inflight(&st, "w1:1");
        assert_eq!(requests, 1);
        assert!(
            queued > 0,
            "the chat prompt was tokenized and queued for prefill"
        );
        pick.first_byte();
        assert_eq!(inflight(&st, "w1:1"), (1, 0), "the prompt is processed");
        pick.finish(true);
        assert_eq!(inflight(&st, "w1:1"), (0, 0));

        let body = br#"{"model": "m", "prompt": "hi"}"#;
        drop(st.pick(body.to_vec().into(), "r").await.unwrap());
        assert_eq!(inflight(&st, "w1:1"), (0, 0), "a dropped pick is finished");
    }

    #[tokio::test]
    async fn a_pair_names_the_decode_worker_and_its_prefill_worker() {
        let st = state();
        for (id, role) in [("p:1", Role::Prefill), ("d:1", Role::Decode)] {
            st.register_worker(infera_core::event::WorkerRecord {
                disagg_mode: role,
                ..record(id)
            });
        }
        let pick = st
            .pick(br#"{"model": "m", "prompt": "hi"}"#.to_vec().into(), "r")
            .await
            .unwrap();
        assert_eq!(
            (pick.worker.as_str(), pick.prefill.as_deref()),
            ("d:1", Some("p:1"))
        );
        assert_eq!((inflight(&st, "d:1").0, inflight(&st, "p:1").0), (1, 1));
        pick.finish(false);
        assert_eq!((inflight(&st, "d:1").0, inflight(&st, "p:1").0), (0, 0));
    }

    #[tokio::test]
    async fn a_body_that_is_no_request_is_refused_with_the_fronts_status() {
        let st = state();
        st.register_worker(record("w1:1"));
        for (body, status, needle) in [
            (&b"[1]"[..], 400, "JSON object"),
            (br#"{"model": "m"}"#, 400, "`prompt` is required"),
            (br#"{"model": "other", "prompt": "x"}"#, 404, "other"),
        ] {
            let error = st.pick(body.to_vec().into(), "r").await.unwrap_err();
            assert_eq!(error.status, status, "{error}");
            assert!(error.message.contains(needle), "{error}");
            assert_eq!(error.body()["error"]["code"], status);
        }
    }
}
