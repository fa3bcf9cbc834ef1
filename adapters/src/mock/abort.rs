//! SGLang's request abort for the mock: a request whose body names an `rid` (SGLang's request
//! id) can be aborted by `POST /abort_request` with body `{"rid": "..."}`, as on SGLang.
//!
//! An abort that finds its request live ends it: a stream ends with a chunk whose
//! `finish_reason` is `"abort"` and `data: [DONE]`, a unary answer carries `"abort"` as its
//! `finish_reason`, and the engine drops the request at the end of its step (as when the client
//! goes away). An `rid` is matched exactly (SGLang matches a prefix; the server's ids all have
//! one length, so the two agree for them). Every abort is logged, with whether it found a live
//! request (the last [`LOG_LEN`]), and served at `GET /mock/pd-aborts` for tests. A body without
//! a non-empty string `rid` is a 400 (SGLang's `abort_all` is not played).

use super::openai::ApiError;
use serde_json::{Value, json};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};
use tokio_util::sync::CancellationToken;

/// Aborts kept for `GET /mock/pd-aborts`.
pub const LOG_LEN: usize = 256;

#[derive(Debug, Default)]
struct Inner {
    /// Live requests by `rid`, each with its registration number.
    live: HashMap<String, (u64, CancellationToken)>,
    next: u64,
    log: VecDeque<Value>,
}

/// The live `rid`s and the abort log.
#[derive(Debug, Default)]
pub(crate) struct Aborts(Arc<Mutex<Inner>>);

/// A live request's registration: its token fires on an abort; dropping it forgets the `rid`.
#[derive(Debug)]
pub(crate) struct LiveRid {
    aborts: Arc<Mutex<Inner>>,
    rid: String,
    number: u64,
    pub(crate) token: CancellationToken,
}

impl Drop for LiveRid {
    fn drop(&mut self) {
        let mut inner = self.aborts.lock().unwrap_or_else(PoisonError::into_inner);
        // A later request may have taken the same rid: only this one's entry goes.
        if inner
            .live
            .get(&self.rid)
            .is_some_and(|(n, _)| *n == self.number)
        {
            inner.live.remove(&self.rid);
        }
    }
}

impl Aborts {
    /// Registers a live request named `rid` (a later one of the same `rid` replaces it).
    pub(crate) fn register(&self, rid: &str) -> LiveRid {
        let token = CancellationToken::new();
        let mut inner = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let number = inner.next;
        inner.next += 1;
        inner.live.insert(rid.to_owned(), (number, token.clone()));
        LiveRid {
            aborts: self.0.clone(),
            rid: rid.to_owned(),
            number,
            token,
        }
    }

    /// Handles the body of `POST /abort_request`. See the module docs.
    ///
    /// # Errors
    /// 400 when the body has no non-empty string `rid`.
    pub(crate) fn abort(&self, body: &Value) -> Result<Value, ApiError> {
        let rid = body
            .get("rid")
            .and_then(Value::as_str)
            .filter(|r| !r.is_empty())
            .ok_or_else(|| {
                ApiError::bad_request(
                    "/abort_request needs a non-empty string `rid` (the mock does not play \
                     abort_all)",
                )
            })?;
        let mut inner = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let found = match inner.live.remove(rid) {
            Some((_, token)) => {
                token.cancel();
                true
            }
            None => false,
        };
        if inner.log.len() == LOG_LEN {
            inner.log.pop_front();
        }
        inner.log.push_back(json!({"rid": rid, "found": found}));
        Ok(json!({}))
    }

    /// The aborts received, oldest first.
    pub(crate) fn snapshot(&self) -> Vec<Value> {
        let inner = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        inner.log.iter().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_abort_fires_the_live_request_and_is_logged() {
        let aborts = Aborts::default();
        let live = aborts.register("infera-01");
        assert!(!live.token.is_cancelled());
        assert_eq!(
            aborts.abort(&json!({"rid": "infera-01"})).unwrap(),
            json!({})
        );
        assert!(live.token.is_cancelled());
        // The request is gone: a second abort finds nothing.
        aborts.abort(&json!({"rid": "infera-01"})).unwrap();
        assert_eq!(
            aborts.snapshot(),
            [
                json!({"rid": "infera-01", "found": true}),
                json!({"rid": "infera-01", "found": false})
            ]
        );
    }

    #[test]
    fn a_finished_request_forgets_its_rid() {
        let aborts = Aborts::default();
        drop(aborts.register("r"));
        aborts.abort(&json!({"rid": "r"})).unwrap();
        assert_eq!(aborts.snapshot(), [json!({"rid": "r", "found": false})]);
    }

    #[test]
    fn an_abort_without_an_rid_is_a_400() {
        let aborts = Aborts::default();
        for bad in [
            json!({}),
            json!({"rid": ""}),
            json!({"rid": 3}),
            json!({"abort_all": true}),
        ] {
            let e = aborts.abort(&bad).unwrap_err();
            assert!(e.message.contains("rid"), "{}", e.message);
        }
        assert!(aborts.snapshot().is_empty());
    }
}
