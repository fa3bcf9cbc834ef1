//! The NATS transports (PROTOCOLS.md §2 and §3), compatible with the Python Infera's subjects and
//! headers: requests from the server to a worker ([`NatsTransport`] on the server,
//! [`NatsResponder`] on the worker) and KV events from a worker to the servers ([`kv`]).
//!
//! # Wire layout
//!
//! Every subject names its worker by a token: the URL-safe base64 of the worker id's UTF-8 bytes,
//! `=` padding stripped ([`subject_token`]).
//!
//! ```text
//! request   server → infera.req.<token>, reply = a fresh inbox
//!           payload JSON {"path": "/v1/...", "stream": bool, "headers": {..}|null,
//!                         "body": {..}, "migratable": bool}
//! reply     worker → inbox, one message per chunk, header rs-type:
//!             data   payload = raw engine bytes (an SSE chunk, or the whole JSON body)
//!             done   payload empty, header rs-status = the engine's HTTP status
//!             error  payload = UTF-8 text of a transport or proxy failure; ours adds
//!                    rs-status 504 when the worker's own --nats-req-max-duration ended it
//!           ours adds rs-seq: 0, 1, 2 … over the replies of one request; a reply whose seq
//!           is not the next one ends the request with an error (a peer without rs-seq is
//!           not checked)
//! health    ours: a request of path /health (body null) is the server's health probe; our
//!           worker answers it with the engine's GET /health (a Python worker POSTs it, and
//!           the engine's 405 still shows it alive)
//! cancel    server → infera.cancel.<token>, payload = the request's inbox
//! jetstream with --nats-req-max-pending > 0 on servers and workers ([`jetstream`]): requests
//!           go through the work-queue stream INFERA_REQUESTS (one durable consumer per worker,
//!           named by its token) with the inbox in header rs-inbox; replies and cancels as above;
//!           servers admit by the consumer's backlog
//! kv events worker → infera.kv.events.<token>.<dp_rank>, payload = the engine batch verbatim,
//!           ours adds headers infera-kv-seq (the engine's seq of the batch; the mock's own
//!           count from 0 per rank) and infera-kv-epoch (fixed for the life of the worker)
//! ```
//!
//! # Connection
//! [`connect`] fails fast when the broker is unreachable at startup (a clear error naming
//! `--nats-server`), then reconnects forever: subscriptions are re-established by the client,
//! and messages published while disconnected are buffered and sent after the reconnect, so a
//! broker restart loses only the replies that were in flight. In JetStream mode the memory-backed
//! request stream is lost with the broker: servers re-create it when a publish finds it missing,
//! workers re-create it and their consumer after every reconnect.

pub mod jetstream;
pub mod kv;
mod request;
mod responder;

pub use async_nats::{Client, HeaderMap, Message, Subscriber};
pub use jetstream::{HDR_INBOX, REQUEST_STREAM, request_durable};
pub use request::{NatsRequestConfig, NatsTransport};
pub use responder::{DRAINING_REFUSAL, NatsResponder, ResponderConfig};

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::time::Duration;

/// Reply header: `data`, `done` or `error`.
pub const HDR_TYPE: &str = "rs-type";
/// The path of the server's health probe (see the module docs).
pub const HEALTH_PATH: &str = "/health";
/// Reply header of `done`: the engine's HTTP status.
pub const HDR_STATUS: &str = "rs-status";
/// Reply header (ours): the reply's position in its request's reply stream, from 0.
pub const HDR_SEQ: &str = "rs-seq";
/// `rs-type` of a body chunk.
pub const TYPE_DATA: &str = "data";
/// `rs-type` of the end of a reply.
pub const TYPE_DONE: &str = "done";
/// `rs-type` of a failure.
pub const TYPE_ERROR: &str = "error";

/// Why a NATS operation failed.
#[derive(Debug, thiserror::Error)]
pub enum NatsError {
    /// The broker did not answer at startup; retrying later may work.
    #[error(
        "cannot connect to NATS at {url}: {reason} (start nats-server there, or pass \
         --nats-server / NATS_SERVER)"
    )]
    Connect { url: String, reason: String },
    /// A subscription could not be made.
    #[error("cannot subscribe to {subject}: {reason}")]
    Subscribe { subject: String, reason: String },
}

/// The subject token of a worker id: URL-safe base64, no padding.
pub fn subject_token(worker_id: &str) -> String {
    URL_SAFE_NO_PAD.encode(worker_id.as_bytes())
}

/// `infera.req.<token>`.
pub fn request_subject(worker_id: &str) -> String {
    format!("infera.req.{}", subject_token(worker_id))
}

/// `infera.cancel.<token>`.
pub fn cancel_subject(worker_id: &str) -> String {
    format!("infera.cancel.{}", subject_token(worker_id))
}

/// Connects to the broker at `url` as `name`, reconnecting forever after the first success.
///
/// # Errors
/// [`NatsError::Connect`] when the broker does not answer within a few seconds.
pub async fn connect(url: &str, name: &str) -> Result<async_nats::Client, NatsError> {
    let logged_url = url.to_owned();
    async_nats::ConnectOptions::new()
        .name(name)
        .connection_timeout(Duration::from_secs(5))
        .event_callback(move |event| {
            let url = logged_url.clone();
            async move {
                match event {
                    async_nats::Event::Disconnected => {
                        tracing::warn!(%url, "disconnected from NATS; reconnecting");
                    }
                    async_nats::Event::Connected => tracing::info!(%url, "connected to NATS"),
                    other => tracing::debug!(%url, event = %other, "nats event"),
                }
            }
        })
        .connect(url)
        .await
        .map_err(|e| NatsError::Connect {
            url: url.to_owned(),
            reason: e.to_string(),
        })
}

/// The request payload as a worker reads it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RequestPayload {
    /// The API path (must start with `/`).
    pub path: String,
    /// Whether the client asked for a stream.
    #[serde(default)]
    pub stream: bool,
    /// Headers to pass to the engine.
    #[serde(default)]
    pub headers: Option<Map<String, Value>>,
    /// The JSON body.
    pub body: Value,
    /// Whether the request may be moved to another worker (informational).
    #[serde(default)]
    pub migratable: bool,
}

impl RequestPayload {
    /// Parses and checks a payload.
    ///
    /// # Errors
    /// A message naming what is wrong: not JSON, a missing field, or a path that does not
    /// start with `/`.
    pub fn parse(bytes: &[u8]) -> Result<Self, String> {
        let payload: Self = serde_json::from_slice(bytes)
            .map_err(|e| format!("the request payload is not a valid request: {e}"))?;
        if !payload.path.starts_with('/') {
            return Err(format!(
                "the request path must start with '/', got {:?}",
                payload.path
            ));
        }
        Ok(payload)
    }
}

/// Encodes a request payload around `body`, which must already be JSON, without re-parsing it.
pub fn encode_request(path: &str, stream: bool, headers: &[(&str, &str)], body: &[u8]) -> Vec<u8> {
    let headers: Map<String, Value> = headers
        .iter()
        .map(|(k, v)| ((*k).to_owned(), Value::String((*v).to_owned())))
        .collect();
    let head = serde_json::json!({"path": path, "stream": stream, "headers": headers,
        "migratable": false});
    let mut out = serde_json::to_vec(&head).unwrap_or_default();
    // `{... }` → `{..., "body": <body>}`
    out.pop();
    out.extend_from_slice(b",\"body\":");
    out.extend_from_slice(body);
    out.push(b'}');
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn subjects_match_the_python_encoding() {
        assert_eq!(subject_token("10.0.0.1:8080"), "MTAuMC4wLjE6ODA4MA");
        assert_eq!(
            subject_token("host.example.com:8000"),
            "aG9zdC5leGFtcGxlLmNvbTo4MDAw"
        );
        // URL-safe alphabet, padding stripped: "[::1]:8000" has '+'/'/' candidates.
        let token = subject_token("[::1]:8000?>");
        assert!(!token.contains(['+', '/', '=', '.', '*', '>']), "{token}");
        assert_eq!(
            request_subject("10.0.0.1:8080"),
            "infera.req.MTAuMC4wLjE6ODA4MA"
        );
        assert_eq!(
            cancel_subject("10.0.0.1:8080"),
            "infera.cancel.MTAuMC4wLjE6ODA4MA"
        );
    }

    #[test]
    fn an_encoded_request_parses_back() {
        let body = br#"{"model":"m","prompt":"hi","stream":true}"#;
        let bytes = encode_request(
            "/v1/completions",
            true,
            &[("x-infera-request-id", "r1")],
            body,
        );
        let p = RequestPayload::parse(&bytes).unwrap();
        assert_eq!(p.path, "/v1/completions");
        assert!(p.stream);
        assert!(!p.migratable);
        assert_eq!(
            p.body,
            json!({"model": "m", "prompt": "hi", "stream": true})
        );
        assert_eq!(p.headers.unwrap()["x-infera-request-id"], "r1");
    }

    #[test]
    fn a_python_payload_without_our_fields_parses() {
        let p =
            RequestPayload::parse(br#"{"path":"/v1/chat/completions","body":{"a":1}}"#).unwrap();
        assert!(!p.stream && p.headers.is_none());
    }

    #[test]
    fn bad_payloads_are_errors_not_panics() {
        for bad in [
            &b"not json"[..],
            b"",
            b"[]",
            br#"{"path":"/v1/x"}"#,
            br#"{"path":"http://evil/","body":{}}"#,
            br#"{"path":7,"body":{}}"#,
            b"\xff\xfe",
        ] {
            let err = RequestPayload::parse(bad).unwrap_err();
            assert!(!err.is_empty());
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(512))]

        /// A worker reads any bytes as a request or a message saying why not; never a panic.
        #[test]
        fn any_payload_is_a_request_or_a_reason(
            bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..256),
        ) {
            if let Err(reason) = RequestPayload::parse(&bytes) {
                proptest::prop_assert!(!reason.is_empty());
            }
        }

        /// What the server encodes, the worker reads back field for field.
        #[test]
        fn encoded_requests_parse_back(
            path in "/[a-z/]{0,16}",
            stream in proptest::prelude::any::<bool>(),
            header in "[a-z-]{1,12}",
            value in "[ -~]{0,16}",
            text in "[ -~]{0,32}",
        ) {
            let body = json!({"model": "m", "prompt": text});
            let bytes = encode_request(&path, stream, &[(&header, &value)], body.to_string().as_bytes());
            let payload = RequestPayload::parse(&bytes).unwrap();
            proptest::prop_assert_eq!(payload.path, path);
            proptest::prop_assert_eq!(payload.stream, stream);
            proptest::prop_assert_eq!(payload.body, body);
            let headers = payload.headers.unwrap_or_default();
            proptest::prop_assert_eq!(headers.get(&header), Some(&Value::String(value)));
        }
    }
}
