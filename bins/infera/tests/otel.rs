//! `infera server --otlp-endpoint` end to end: a real etcd, an engine stand-in that records the
//! `traceparent` of each request, and an independent OTLP/gRPC receiver
//! (`tests/peers/otlp_receiver.py`: OpenTelemetry's own protos on `grpcio`). A client request
//! with its own `traceparent` yields one trace: the request span under the client's, with its
//! parse, tokenize, route and attempt spans under it, and the engine's context under the
//! attempt's.
#![allow(clippy::unwrap_used)]

mod common;

use common::{
    DEADLINE, Peer, Proc, eventually, free_port, get_json, http_with_headers, python_peer,
    register_standin, server_command, tokenizer_dir,
};
use infera_backends::testing::EtcdServer;
use serde_json::{Value, json};
use std::time::{Duration, Instant};

const CLIENT_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CLIENT_SPAN: &str = "00f067aa0ba902b7";

/// The receiver: its port, and the spans it prints, one JSON object a line.
struct Receiver {
    peer: Peer,
    port: u16,
}

fn receiver() -> Receiver {
    let peer = python_peer(
        "otlp_receiver.py",
        "python3 with opentelemetry-proto and grpcio (cargo xtask tools installs them)",
    );
    let first = peer
        .lines
        .recv_timeout(DEADLINE)
        .expect("the receiver starts");
    let first: Value = serde_json::from_str(&first).unwrap();
    let port = first["port"].as_u64().expect("the receiver's port") as u16;
    Receiver { peer, port }
}

/// An engine that answers every completion and sends each request's `traceparent` (or "").
async fn engine() -> (u16, tokio::sync::mpsc::UnboundedReceiver<String>) {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let app = axum::Router::new()
        .route("/health", axum::routing::get(|| async { "ok" }))
        .fallback(move |headers: axum::http::HeaderMap| {
            let tx = tx.clone();
            async move {
                let parent = headers
                    .get("traceparent")
                    .map_or("", |v| v.to_str().unwrap())
                    .to_owned();
                let _ = tx.send(parent);
                axum::Json(json!({
                    "id": "cmpl-1", "object": "text_completion", "model": "m",
                    "choices": [{"index": 0, "text": "hi", "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
                }))
            }
        });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (port, rx)
}

/// The spans of `trace` the receiver got, by name, once every one of `names` is there.
fn spans_of(r: &Receiver, trace: &str, names: &[&str]) -> Vec<Value> {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut got: Vec<Value> = Vec::new();
    while !names.iter().all(|n| got.iter().any(|s| s["name"] == *n)) {
        let left = deadline.saturating_duration_since(Instant::now());
        let span: Value = match r.peer.lines.recv_timeout(left) {
            Ok(line) => serde_json::from_str(&line).unwrap(),
            Err(_) => panic!("spans {names:?} never all arrived; got {got:#?}"),
        };
        if span["trace_id"] == trace {
            got.push(span);
        }
    }
    got
}

fn named<'a>(spans: &'a [Value], name: &str) -> &'a Value {
    spans.iter().find(|s| s["name"] == name).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_is_one_trace_from_the_client_through_the_router_to_the_engine() {
    let etcd = EtcdServer::start().await.expect("etcd starts");
    let tok = tokenizer_dir();
    let (engine_port, mut parents) = engine().await;
    let id = format!("127.0.0.1:{engine_port}");
    let _registration = register_standin(&etcd.endpoint(), &id, &tok).await;
    let receiver = receiver();
    let port = free_port();
    let endpoint = format!("http://127.0.0.1:{}", receiver.port);
    let _server = Proc(
        server_command(
            &tok,
            &etcd.endpoint(),
            port,
            &["--otlp-endpoint", &endpoint],
        )
        // Export each batch at once rather than every 5 s.
        .env("OTEL_BSP_SCHEDULE_DELAY", "50")
        .spawn()
        .unwrap(),
    );
    eventually("the engine to be discovered", || {
        get_json(port, "/health").is_some_and(|h| h["active_workers"] == 1)
    });

    let traceparent = format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01");
    let body = json!({"model": tok, "prompt": "a traced request", "max_tokens": 1});
    let (status, raw) = tokio::task::spawn_blocking(move || {
        http_with_headers(
            port,
            "POST",
            "/v1/completions",
            &[("traceparent", &traceparent)],
            &body.to_string(),
        )
    })
    .await
    .unwrap()
    .unwrap();
    assert_eq!(status, 200, "{raw}");

    // The engine's parent: the same trace, a span of ours.
    let sent = parents.recv().await.unwrap();
    let parts: Vec<&str> = sent.split('-').collect();
    assert_eq!(parts.len(), 4, "a W3C traceparent: {sent:?}");
    assert_eq!((parts[0], parts[1], parts[3]), ("00", CLIENT_TRACE, "01"));
    assert_ne!(parts[2], CLIENT_SPAN);

    let names = [
        "POST /v1/completions",
        "parse",
        "tokenize",
        "route",
        "attempt",
    ];
    let spans = spans_of(&receiver, CLIENT_TRACE, &names);
    let request = named(&spans, "POST /v1/completions");
    assert_eq!(request["parent_span_id"], CLIENT_SPAN, "{request}");
    assert_eq!(request["service"], "infera-server");
    assert_eq!(request["kind"], 2, "a server span: {request}");
    let attrs = &request["attributes"];
    assert_eq!(attrs["http.response.status_code"], 200, "{request}");
    assert_eq!(attrs["gen_ai.request.model"], tok.as_str(), "{request}");
    for child in &names[1..] {
        let span = named(&spans, child);
        assert_eq!(
            span["parent_span_id"], request["span_id"],
            "{child}: {span}"
        );
    }
    let route = named(&spans, "route");
    assert_eq!(route["attributes"]["infera.worker"], id.as_str(), "{route}");
    let candidates = route["attributes"]["infera.candidates"].as_str().unwrap();
    assert!(candidates.starts_with(&format!("{id}:0 cost=")), "{route}");
    let attempt = named(&spans, "attempt");
    assert_eq!(
        attempt["span_id"], parts[2],
        "the engine's parent is the attempt"
    );
    assert_eq!(attempt["kind"], 3, "a client span: {attempt}");
    assert_eq!(attempt["attributes"]["infera.worker"], id.as_str());
    assert_eq!(attempt["attributes"]["infera.outcome"], "ok");
    assert!(attempt["attributes"]["infera.ttft_ms"].as_f64().unwrap() > 0.0);
    assert_eq!(attempt["events"], json!(["first byte"]));
}
