//! First-byte deadlines derived from the work (the default, without
//! `--http-req-first-byte-timeout`): an engine that takes 600 ms to its first byte is cut for a
//! short prompt, whose deadline is the floor, and given the time for a long one, whose uncached
//! tokens at the cold prefill rate earn a longer deadline; the long prompt's answer teaches the
//! service the worker's prefill rate. Deadlines are short real ones, configured for the test.

mod common;

use axum::response::IntoResponse;
use common::fleet::{Front, MODEL, options, record, tokenizer};
use common::post;
use infera_adapters::server::{HttpDeadlines, HttpTransport, ServerState};
use infera_core::ids::WorkerId;
use infera_core::policy::PolicyKind;
use infera_core::service::{FirstByteConfig, Prefill};
use serde_json::json;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use tokio::net::TcpListener;

/// What the fake engine takes to answer.
const ENGINE_TTFT: Duration = Duration::from_millis(600);

/// An engine that answers every completion after [`ENGINE_TTFT`]; counts what it started.
async fn slow_engine(hits: Arc<AtomicUsize>) -> std::net::SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let app = axum::Router::new().route(
        "/v1/completions",
        axum::routing::post(move || {
            let hits = hits.clone();
            async move {
                hits.fetch_add(1, Ordering::SeqCst);
                // The engine's prefill: what the deadline is about.
                tokio::time::sleep(ENGINE_TTFT).await;
                axum::Json(json!({
                    "id": "cmpl-1", "object": "text_completion", "model": MODEL,
                    "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
                }))
                .into_response()
            }
        }),
    );
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_byte_deadline_scales_with_the_uncached_prompt() {
    let hits = Arc::new(AtomicUsize::new(0));
    let addr = slow_engine(hits.clone()).await;
    let transport = Arc::new(HttpTransport::with_deadlines(HttpDeadlines::default()));
    let state = ServerState::with_transport(
        options(PolicyKind::KV_AWARE, 0, false),
        tokenizer(),
        transport,
    );
    let config = FirstByteConfig {
        floor: Duration::from_millis(200),
        cap: Duration::from_secs(10),
        factor: 4.0,
        cold_rate: 1_000.0,
        min_sample_tokens: 64,
    };
    state.service().set_first_byte(config);
    let front = Front::serve(state).await;
    front.state.register_worker(record(addr));
    let worker = WorkerId::new(addr.to_string());

    // A few tokens: the floor, shorter than the engine's 600 ms.
    let (status, body) = post(
        front.addr,
        "/v1/completions",
        &json!({"model": MODEL, "prompt": "hi", "max_tokens": 1}),
    )
    .await;
    assert_eq!(status, 504, "{body}");
    let message = body["error"]["message"].as_str().expect("message");
    assert!(message.contains("derived from the prompt"), "{message}");
    assert_eq!(front.state.service().prefill_rate(&worker), None);

    // Hundreds of uncached tokens at the cold 1,000 tokens/s, times 4: seconds.
    let long = "the quick brown fox jumps over the lazy dog ".repeat(40);
    let (status, body) = post(
        front.addr,
        "/v1/completions",
        &json!({"model": MODEL, "prompt": long, "max_tokens": 1}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(hits.load(Ordering::SeqCst), 2);
    // Its answer taught the service the worker's rate (tokens over time to first byte, at most
    // the tokens over the engine's 600 ms), so the same work now gets a deadline from it.
    let rate = front
        .state
        .service()
        .prefill_rate(&worker)
        .expect("a rate learned");
    assert!(rate > 0.0 && rate < 1_000.0, "{rate}");
    let work = Prefill {
        uncached_tokens: 10_000,
        queued_tokens: 0,
    };
    let expected = config.floor + Duration::from_secs_f64(4.0 * 10_000.0 / rate);
    let deadline = front.state.service().first_byte_deadline(&worker, work);
    assert!(
        deadline.abs_diff(expected.min(config.cap)) < Duration::from_millis(1),
        "{deadline:?} against {expected:?}"
    );
    front.stop().await;
}
