//! The server front over real sockets on 127.0.0.1, in front of mock engines: completions
//! (streaming and not) relayed through the router, KV-aware routing fed by the mocks' KV events,
//! failover before the first byte, and the error statuses a client relies on.
//!
//! Workers are registered directly as `WorkerRegistered` events (no discovery backend). Nothing
//! sleeps to synchronise: a mock puts a request's KV events in its sink before the response ends.

mod common;

use axum::body::Bytes;
use common::fleet::{Front, MODEL, Mock, options, record, tokenizer};
use common::{TIMEOUT, body_of, exchange, get, post, post_raw, request, request_with};
use futures::StreamExt as _;
use infera_adapters::server::ServerState;
use infera_core::event::{Role, WorkerRecord};
use infera_core::ids::WorkerRank;
use infera_core::policy::PolicyKind;
use serde_json::{Value, json};
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

fn long_prompt(seed: &str, words: usize) -> String {
    let mut s = format!("{seed}:");
    for i in 0..words {
        s.push_str(&format!(" word{}", i % 97));
    }
    s
}

fn cached(v: &Value) -> u64 {
    v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or_else(|| panic!("cached_tokens in {v}"))
}

fn error_status(v: &Value) -> u64 {
    assert!(v["error"]["message"].is_string(), "OpenAI error shape: {v}");
    assert!(v["error"]["type"].is_string(), "OpenAI error shape: {v}");
    v["error"]["code"].as_u64().expect("error code")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_are_relayed_streaming_and_not() {
    let mock = Mock::start().await;
    let front = Front::start(PolicyKind::KV_AWARE, 1).await;
    front.state.register_worker(record(mock.addr));

    let (status, body) = post(
        front.addr,
        "/v1/completions",
        &json!({"model": MODEL, "prompt": "hello there", "max_tokens": 4}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["usage"]["completion_tokens"], 4, "{body}");

    let (status, body) = post(
        front.addr,
        "/v1/chat/completions",
        &json!({"model": MODEL, "max_tokens": 3,
            "messages": [{"role": "user", "content": "hi"}]}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["usage"]["completion_tokens"], 3, "{body}");

    let req = json!({"model": MODEL, "prompt": [1, 2, 3, 4], "max_tokens": 5, "stream": true});
    let ex = request(
        front.addr,
        "POST",
        "/v1/completions",
        req.to_string().into_bytes(),
    )
    .await;
    assert_eq!(ex.response.status(), 200);
    assert!(ex.response.headers().contains_key("x-infera-request-id"));
    assert_eq!(ex.response.headers()["content-type"], "text/event-stream");
    let (_, text) = body_of(ex).await;
    let events: Vec<&str> = text.split("\n\n").filter(|e| !e.is_empty()).collect();
    assert_eq!(events.last(), Some(&"data: [DONE]"), "{text}");
    assert!(events.len() >= 2, "{text}");

    // Every attempt finished: nothing is left in flight, and the echo header works.
    assert_eq!(
        front.state.service().with_fleet(|f| f.inflight_requests()),
        0
    );
    let (status, health) = exchange(front.addr, "GET", "/health", Vec::new()).await;
    assert_eq!(status, 200);
    let health: Value = serde_json::from_str(&health).expect("json");
    assert_eq!(health, json!({"status": "ok", "active_workers": 1}));
    let (_, models) = exchange(front.addr, "GET", "/v1/models", Vec::new()).await;
    assert!(models.contains(MODEL), "{models}");
    let (_, workers) = exchange(front.addr, "GET", "/v1/workers", Vec::new()).await;
    assert!(workers.contains(&mock.addr.to_string()), "{workers}");
    let (_, metrics) = exchange(front.addr, "GET", "/metrics", Vec::new()).await;
    assert!(
        metrics.contains("infera_router_decisions_total{outcome=\"routed\"} 3"),
        "{metrics}"
    );
    assert!(
        metrics.contains("infera_request_inflight{router=\"mixed\"} 0"),
        "{metrics}"
    );
    assert!(
        metrics.contains("infera_active_workers{disagg_mode=\"mixed\"} 1"),
        "{metrics}"
    );

    front.stop().await;
    mock.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeated_prompt_goes_to_the_worker_holding_its_kv() {
    let mut mocks = vec![
        Mock::start().await,
        Mock::start().await,
        Mock::start().await,
    ];
    let front = Front::start(PolicyKind::KV_AWARE, 1).await;
    for m in &mocks {
        front.state.register_worker(record(m.addr));
    }
    let req = json!({"model": MODEL, "prompt": long_prompt("shared", 400), "max_tokens": 2});

    let (status, first) = post(front.addr, "/v1/completions", &req).await;
    assert_eq!(status, 200, "{first}");
    assert_eq!(cached(&first), 0, "{first}");
    let fed: Vec<usize> = mocks.iter_mut().map(|m| m.feed(&front.state)).collect();
    let holder = fed
        .iter()
        .position(|n| *n > 0)
        .expect("one mock stored the prompt");
    assert_eq!(fed.iter().filter(|n| **n > 0).count(), 1, "{fed:?}");
    let holder_rank = WorkerRank::new(mocks[holder].id(), 0);
    let held = front.state.service().with_fleet(|f| {
        f.index()
            .blocks_of(&holder_rank, infera_core::event::Tier::Gpu)
    });
    assert!(held > 10, "index holds the prompt's blocks: {held}");

    for round in 0..3 {
        let (status, again) = post(front.addr, "/v1/completions", &req).await;
        assert_eq!(status, 200, "{again}");
        assert!(cached(&again) > 0, "round {round}: {again}");
        for (i, m) in mocks.iter_mut().enumerate() {
            let n = m.feed(&front.state);
            if i != holder {
                assert_eq!(n, 0, "round {round}: mock {i} got the request");
            }
        }
    }
    assert!(front.state.service().metrics().picks_total() >= 4);

    front.stop().await;
    for m in mocks {
        m.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusing_worker_is_retried_on_another() {
    let mock = Mock::start().await;
    // A port that refuses connections: bound, then closed.
    let dead = {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        l.local_addr().expect("addr")
    };
    let front = Front::start(PolicyKind::ROUND_ROBIN, 2).await;
    front.state.register_worker(record(dead));
    front.state.register_worker(record(mock.addr));

    for i in 0..4 {
        let (status, body) = post(
            front.addr,
            "/v1/completions",
            &json!({"model": MODEL, "prompt": format!("request {i}"), "max_tokens": 2}),
        )
        .await;
        assert_eq!(status, 200, "request {i}: {body}");
    }
    assert!(front.state.service().metrics().retries_total() >= 1);
    assert_eq!(
        front.state.service().with_fleet(|f| f.inflight_requests()),
        0
    );

    // With only the dead worker left, the failure is an honest 502 after the retries.
    front.state.deregister_worker(mock.id(), "test".to_owned());
    let (status, body) = post(
        front.addr,
        "/v1/completions",
        &json!({"model": MODEL, "prompt": "x", "max_tokens": 1}),
    )
    .await;
    assert_eq!(status, 502, "{body}");
    assert_eq!(error_status(&body), 502);

    front.stop().await;
    mock.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_honest_statuses() {
    let mock = Mock::start().await;
    let front = Front::start(PolicyKind::KV_AWARE, 1).await;
    front.state.register_worker(record(mock.addr));

    let (status, body) = post_raw(front.addr, "/v1/completions", b"{not json".to_vec()).await;
    assert_eq!((status, error_status(&body)), (400, 400), "{body}");
    let (status, body) = post(
        front.addr,
        "/v1/completions",
        &json!({"model": 7, "prompt": "x"}),
    )
    .await;
    assert_eq!((status, error_status(&body)), (400, 400), "{body}");
    let (status, body) = post(
        front.addr,
        "/v1/chat/completions",
        &json!({"model": MODEL, "messages": "hi"}),
    )
    .await;
    assert_eq!((status, error_status(&body)), (400, 400), "{body}");
    let (status, body) = post(
        front.addr,
        "/v1/completions",
        &json!({"model": "nope", "prompt": "x"}),
    )
    .await;
    assert_eq!((status, error_status(&body)), (404, 404), "{body}");
    let huge = json!({"model": MODEL, "prompt": "y".repeat(100 << 10)});
    let (status, body) = post(front.addr, "/v1/completions", &huge).await;
    assert_eq!((status, error_status(&body)), (413, 413), "{body}");
    // Nothing was routed for any of them.
    assert_eq!(front.state.service().metrics().picks_total(), 0);

    front.stop().await;
    mock.stop().await;
}

/// A scripted worker: answers each of `n` connections with `reply` (raw HTTP bytes) after
/// reading the request head and body, then closes the socket (mid-body if `reply` is cut).
/// Each request's head (lowercased) is reported on the returned channel.
async fn scripted_worker(
    reply: &'static [u8],
    n: usize,
) -> (SocketAddr, mpsc::Receiver<String>, JoinHandle<()>) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (heads, heads_rx) = mpsc::channel(n.max(1));
    let task = tokio::spawn(async move {
        for _ in 0..n {
            let (mut s, _) = listener.accept().await.expect("accept");
            let mut buf = Vec::new();
            let mut chunk = [0u8; 4096];
            // Read the head, then the body by its content-length.
            let body_start = loop {
                let k = s.read(&mut chunk).await.expect("read");
                assert!(k > 0, "client closed early");
                buf.extend_from_slice(&chunk[..k]);
                if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                    break i + 4;
                }
            };
            let head = String::from_utf8_lossy(&buf[..body_start]).to_ascii_lowercase();
            let len: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .map(|v| v.trim().parse().expect("length"))
                .unwrap_or(0);
            while buf.len() < body_start + len {
                let k = s.read(&mut chunk).await.expect("read");
                assert!(k > 0, "client closed early");
                buf.extend_from_slice(&chunk[..k]);
            }
            s.write_all(reply).await.expect("write");
            s.flush().await.expect("flush");
            drop(s);
            // Room for every head: a test that does not read them never blocks the worker.
            let _ = heads.try_send(head);
        }
    });
    (addr, heads_rx, task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_5xx_before_the_first_byte_fails_over_and_a_broken_stream_ends_with_an_error() {
    let mock = Mock::start().await;
    let (failing, _, failing_task) = scripted_worker(
        b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}",
        1,
    )
    .await;
    let front = Front::start(PolicyKind::ROUND_ROBIN, 1).await;
    front.state.register_worker(record(failing));
    front.state.register_worker(record(mock.addr));
    // Round robin over [failing, mock] (by worker id) sends one of the two first requests to
    // the failing worker first; both succeed.
    for i in 0..2 {
        let (status, body) = post(
            front.addr,
            "/v1/completions",
            &json!({"model": MODEL, "prompt": format!("r{i}"), "max_tokens": 1}),
        )
        .await;
        assert_eq!(status, 200, "{body}");
    }
    assert_eq!(front.state.service().metrics().retries_total(), 1);
    tokio::time::timeout(TIMEOUT, failing_task)
        .await
        .expect("scripted worker done")
        .expect("scripted worker ok");
    front.stop().await;
    mock.stop().await;

    // A stream that breaks after its first event.
    let (broken, _, broken_task) = scripted_worker(
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n\
          f\r\ndata: {\"a\":1}\n\n\r\n",
        1,
    )
    .await;
    let front = Front::start(PolicyKind::ROUND_ROBIN, 1).await;
    front.state.register_worker(record(broken));
    let req = json!({"model": MODEL, "prompt": "s", "max_tokens": 3, "stream": true});
    let (status, text) = exchange(
        front.addr,
        "POST",
        "/v1/completions",
        req.to_string().into_bytes(),
    )
    .await;
    assert_eq!(status, 200);
    let events: Vec<&str> = text.split("\n\n").filter(|e| !e.is_empty()).collect();
    assert_eq!(events.len(), 3, "{text}");
    assert_eq!(events[0], "data: {\"a\":1}");
    let err: Value = serde_json::from_str(events[1].strip_prefix("data: ").expect("data"))
        .expect("error event is JSON");
    assert!(err["error"]["message"].is_string(), "{err}");
    assert_eq!(events[2], "data: [DONE]");
    assert_eq!(
        front.state.service().with_fleet(|f| f.inflight_requests()),
        0
    );
    tokio::time::timeout(TIMEOUT, broken_task)
        .await
        .expect("scripted worker done")
        .expect("scripted worker ok");
    front.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn direct_mode_routes_to_the_worker_the_picker_named() {
    let a = Mock::start().await;
    let b = Mock::start().await;
    let front = Front::start_with(PolicyKind::KV_AWARE, 1, true).await;
    front.state.register_worker(record(a.addr));
    front.state.register_worker(record(b.addr));
    let body = json!({"model": MODEL, "prompt": long_prompt("direct", 200), "max_tokens": 2});
    let send = |headers: Vec<(&'static str, String)>| {
        let body = body.to_string().into_bytes();
        async move {
            let headers: Vec<(&str, &str)> =
                headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
            let ex = request_with(front.addr, "POST", "/v1/completions", &headers, body).await;
            body_of(ex).await
        }
    };
    // Every request goes where the header says, whatever the cache would suggest.
    for target in [a.addr, b.addr, a.addr] {
        let (status, text) = send(vec![("x-worker-instance-id", target.to_string())]).await;
        assert_eq!(status, 200, "{text}");
    }
    let (_, metrics_a) = get(a.addr, "/metrics").await;
    let (_, metrics_b) = get(b.addr, "/metrics").await;
    assert!(
        metrics_a.contains("vllm:request_success_total{model_name=\"mock-model\"} 2"),
        "{metrics_a}"
    );
    assert!(
        metrics_b.contains("vllm:request_success_total{model_name=\"mock-model\"} 1"),
        "{metrics_b}"
    );

    // No header: the policy picks one of the workers, as without --router-mode direct.
    let (status, text) = send(vec![]).await;
    assert_eq!(status, 200, "{text}");
    let served = |metrics: &str| -> u64 {
        metrics
            .lines()
            .find_map(|l| l.strip_prefix("vllm:request_success_total{model_name=\"mock-model\"} "))
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or(0)
    };
    let (_, metrics_a) = get(a.addr, "/metrics").await;
    let (_, metrics_b) = get(b.addr, "/metrics").await;
    assert_eq!(
        served(&metrics_a) + served(&metrics_b),
        4,
        "{metrics_a}\n{metrics_b}"
    );
    // A bad rank, an unknown worker: clear errors, nothing forwarded.
    let (status, _) = send(vec![
        ("x-worker-instance-id", a.addr.to_string()),
        ("x-dp-rank", "x".to_owned()),
    ])
    .await;
    assert_eq!(status, 400);
    let (status, text) = send(vec![("x-worker-instance-id", "10.9.9.9:1".to_owned())]).await;
    assert_eq!(status, 503, "{text}");
    assert!(text.contains("not registered"), "{text}");
    front.stop().await;
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_messages_are_served_through_the_same_pipeline() {
    let mock = Mock::start().await;
    let front = Front::start(PolicyKind::KV_AWARE, 1).await;
    front.state.register_worker(record(mock.addr));
    let text = long_prompt("messages", 300);
    let req = json!({"model": MODEL, "max_tokens": 3, "system": "Be brief.",
        "messages": [{"role": "user", "content": [{"type": "text", "text": text}]}]});

    let (status, body) = post(front.addr, "/v1/messages", &req).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["type"], "message");
    assert_eq!(body["role"], "assistant");
    assert_eq!(body["content"][0]["type"], "text");
    assert_eq!(body["stop_reason"], "max_tokens", "{body}");
    assert_eq!(body["usage"]["output_tokens"], 3, "{body}");
    assert!(body["usage"]["input_tokens"].as_u64() > Some(300), "{body}");

    // Streaming, and the repeat is a prefix hit reported as Anthropic's cache read.
    let mut streaming = req.clone();
    streaming["stream"] = json!(true);
    let ex = request(
        front.addr,
        "POST",
        "/v1/messages",
        streaming.to_string().into_bytes(),
    )
    .await;
    assert_eq!(ex.response.status(), 200);
    assert_eq!(ex.response.headers()["content-type"], "text/event-stream");
    let (_, text) = body_of(ex).await;
    let names: Vec<&str> = text
        .split("\n\n")
        .filter_map(|e| e.lines().next()?.strip_prefix("event: "))
        .collect();
    assert_eq!(names.first(), Some(&"message_start"), "{text}");
    assert_eq!(names.last(), Some(&"message_stop"), "{text}");
    assert!(names.contains(&"content_block_delta"), "{text}");
    let delta = text
        .split("\n\n")
        .find(|e| e.starts_with("event: message_delta"))
        .and_then(|e| e.lines().nth(1)?.strip_prefix("data: "))
        .map(|d| serde_json::from_str::<Value>(d).expect("json"))
        .expect("a message_delta event");
    assert!(
        delta["usage"]["cache_read_input_tokens"].as_u64() > Some(0),
        "{delta}"
    );

    // Errors come back in Anthropic's shape.
    let (status, body) = post(
        front.addr,
        "/v1/messages",
        &json!({"model": MODEL, "messages": [{"role": "user", "content": "x"}]}),
    )
    .await;
    assert_eq!(status, 400);
    assert_eq!(body["type"], "error");
    assert_eq!(body["error"]["type"], "invalid_request_error", "{body}");
    let (status, body) = post(
        front.addr,
        "/v1/messages",
        &json!({"model": "nope", "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi"}]}),
    )
    .await;
    assert_eq!(status, 404);
    assert_eq!(body["error"]["type"], "not_found_error", "{body}");
    assert_eq!(
        front.state.service().with_fleet(|f| f.inflight_requests()),
        0
    );
    front.stop().await;
    mock.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prewarm_without_a_kv_cache_daemon_is_unavailable() {
    let front = Front::start(PolicyKind::KV_AWARE, 0).await;
    let (status, body) = post(
        front.addr,
        "/v1/cache/prewarm",
        &json!({"model": MODEL, "block_hashes": ["00ff"]}),
    )
    .await;
    assert_eq!(status, 503, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("--kvd-socket-path")),
        "{body}"
    );
    front.stop().await;
}

/// An engine that counts the profiler calls it gets, by path.
async fn profiled_engine() -> (SocketAddr, mpsc::UnboundedReceiver<String>) {
    let (tx, rx) = mpsc::unbounded_channel();
    let app = axum::Router::new().fallback(move |uri: axum::http::Uri| {
        let tx = tx.clone();
        async move {
            let _ = tx.send(uri.path().to_owned());
            "ok"
        }
    });
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, app).await });
    (addr, rx)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn profiling_fans_out_to_the_chosen_engines_only_when_enabled() {
    let (engine, mut calls) = profiled_engine().await;
    // A worker whose engine is gone: its port is free again.
    let gone = TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind")
        .local_addr()
        .expect("addr");
    let front = Front::start(PolicyKind::KV_AWARE, 0).await;
    front.state.register_worker(record(engine));
    front.state.register_worker(record(gone));

    let (status, _) = post(front.addr, "/v1/admin/profile/start", &json!({})).await;
    assert_eq!(status, 403, "off unless --enable-profiling");
    front.state.set_profiling(true);

    let only = json!({"worker_id": engine.to_string()});
    let (status, body) = post(front.addr, "/v1/admin/profile/start", &only).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body["results"],
        json!([{"worker_id": engine.to_string(), "status": 200}])
    );
    assert_eq!(calls.recv().await.as_deref(), Some("/start_profile"));

    // Every worker: the dead one is reported, and the answer says not all succeeded.
    let (status, body) = post(front.addr, "/v1/admin/profile/stop", &json!({})).await;
    assert_eq!(status, 502, "{body}");
    let results = body["results"].as_array().expect("results");
    assert_eq!(results.len(), 2, "{body}");
    assert!(results.iter().any(|r| r["status"] == 200));
    assert!(results.iter().any(|r| r["error"].is_string()));
    assert_eq!(calls.recv().await.as_deref(), Some("/stop_profile"));

    let (status, _) = post(
        front.addr,
        "/v1/admin/profile/start",
        &json!({"model": "nope"}),
    )
    .await;
    assert_eq!(status, 404);
    let (status, _) = post(front.addr, "/v1/admin/profile/pause", &json!({})).await;
    assert_eq!(status, 404);
    let (status, _) = post(front.addr, "/v1/admin/profile/start", &json!({"role": 3})).await;
    assert_eq!(status, 400);
    front.stop().await;
}

/// A unary completion of one token, as raw HTTP.
const ONE_TOKEN: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\
content-length: 166\r\nconnection: close\r\n\r\n\
{\"id\":\"c\",\"object\":\"text_completion\",\"choices\":[{\"index\":0,\"text\":\" ok\",\
\"finish_reason\":\"length\"}],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":1,\"total_tokens\":4}}";

fn dp_header(head: &str) -> Option<&str> {
    head.lines()
        .find_map(|l| l.strip_prefix("x-data-parallel-rank:"))
        .map(str::trim)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_of_several_dp_ranks_is_pinned_to_the_chosen_rank() {
    let (multi, mut multi_heads, multi_task) = scripted_worker(ONE_TOKEN, 2).await;
    let (single, mut single_heads, single_task) = scripted_worker(ONE_TOKEN, 1).await;
    let front = Front::start_with(PolicyKind::KV_AWARE, 0, true).await;
    // Ranks 4..8 behind one endpoint (a vLLM with --data-parallel-start-rank 4, say).
    let mut rec = record(multi);
    rec.dp_rank = 4;
    rec.dp_size = 4;
    front.state.register_worker(rec);
    front.state.register_worker(record(single));
    let body = json!({"model": MODEL, "prompt": "pinned", "max_tokens": 1}).to_string();
    let send = |worker: SocketAddr, rank: Option<&'static str>| {
        let body = body.clone().into_bytes();
        async move {
            let worker = worker.to_string();
            let mut headers = vec![("x-worker-instance-id", worker.as_str())];
            if let Some(r) = rank {
                headers.push(("x-dp-rank", r));
            }
            let ex = request_with(front.addr, "POST", "/v1/completions", &headers, body).await;
            body_of(ex).await
        }
    };
    for (rank, engine_rank) in [("6", "2"), ("4", "0")] {
        let (status, text) = send(multi, Some(rank)).await;
        assert_eq!(status, 200, "{text}");
        let head = multi_heads.recv().await.expect("request seen");
        assert_eq!(
            dp_header(&head),
            Some(engine_rank),
            "rank {rank} is the engine's rank {engine_rank}: {head}"
        );
    }
    // A worker of one rank is not steered.
    let (status, text) = send(single, None).await;
    assert_eq!(status, 200, "{text}");
    let head = single_heads.recv().await.expect("request seen");
    assert_eq!(dp_header(&head), None, "{head}");
    multi_task.await.expect("worker task");
    single_task.await.expect("worker task");
    front.stop().await;
}

/// A PD record of `mock` in `role` for `protocol` with `params`, fronting two DP ranks.
fn pd_record(mock: &Mock, role: Role, protocol: &str, params: Value) -> WorkerRecord {
    let mut rec = record(mock.addr);
    rec.disagg_mode = role;
    rec.disagg_meta = Some(json!({"protocol": protocol, "params": params}));
    rec.dp_size = 2;
    rec
}

async fn legs_of(mock: &Mock) -> Vec<Value> {
    let (status, text) = get(mock.addr, "/mock/pd-legs").await;
    assert_eq!(status, 200, "{text}");
    serde_json::from_str::<Value>(&text).expect("json")["legs"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pd_legs_are_pinned_to_their_dp_ranks_and_the_decode_names_the_prefill_rank() {
    for (protocol, params) in [
        (
            "sglang-bootstrap",
            json!({"bootstrap_host": "127.0.0.1", "bootstrap_port": 18998}),
        ),
        (
            "vllm-mooncake",
            json!({"engine_id": "eng-p", "bootstrap_addr": "http://127.0.0.1:18998"}),
        ),
    ] {
        let prefill = Mock::start_pd(Role::Prefill, protocol).await;
        let decode = Mock::start_pd(Role::Decode, protocol).await;
        let front = Front::start_with(PolicyKind::KV_AWARE, 0, true).await;
        front
            .state
            .register_worker(pd_record(&prefill, Role::Prefill, protocol, params));
        front
            .state
            .register_worker(pd_record(&decode, Role::Decode, protocol, json!({})));
        let body = json!({"model": MODEL, "prompt": long_prompt("dp", 40), "max_tokens": 4});
        let (p, d) = (prefill.addr.to_string(), decode.addr.to_string());
        for rank in ["1", "0"] {
            let headers = [
                ("x-prefill-instance-id", p.as_str()),
                ("x-worker-instance-id", d.as_str()),
                ("x-dp-rank", rank),
            ];
            let ex = request_with(
                front.addr,
                "POST",
                "/v1/completions",
                &headers,
                body.to_string().into_bytes(),
            )
            .await;
            let (status, text) = body_of(ex).await;
            assert_eq!(status, 200, "{protocol}: {text}");
        }
        let (p_legs, d_legs) = (legs_of(&prefill).await, legs_of(&decode).await);
        assert_eq!(p_legs.len(), 2, "{p_legs:?}");
        assert_eq!(d_legs.len(), 2, "{d_legs:?}");
        for (i, rank) in [1u64, 0].into_iter().enumerate() {
            let (pl, dl) = (&p_legs[i], &d_legs[i]);
            assert_eq!(pl["dp_rank"], rank, "{protocol}: {pl}");
            assert_eq!(dl["dp_rank"], rank, "{protocol}: {dl}");
            if protocol == "sglang-bootstrap" {
                let room = pl["bootstrap_room"].as_u64().expect("room");
                assert_eq!(room % 2, rank, "the room addresses the prefill rank: {pl}");
                assert_eq!(dl["disagg_prefill_dp_rank"], rank, "{dl}");
                assert_eq!(pl["disagg_prefill_dp_rank"], Value::Null, "{pl}");
                assert_eq!(pl["rid"], dl["rid"], "one rid for both legs");
            } else {
                assert_eq!(
                    dl["kv_transfer_params"]["remote_engine_id"],
                    format!("eng-p_dp{rank}"),
                    "the decode pulls from the chosen prefill rank: {dl}"
                );
            }
        }
        front.stop().await;
        prefill.stop().await;
        decode.stop().await;
    }
}

/// A serial PD pair whose legs the test releases: the prefill's answer and the decode's body
/// wait until the test sends them (dropping a sender ends that body).
#[derive(Debug)]
struct HeldPair {
    prefill: String,
    calls: mpsc::Sender<String>,
    bodies: std::sync::Mutex<Vec<(String, mpsc::Receiver<Bytes>)>>,
}

#[async_trait::async_trait]
impl infera_core::ports::transport::RequestTransport for HeldPair {
    fn name(&self) -> &'static str {
        "held"
    }

    async fn send(
        &self,
        req: infera_core::ports::transport::Outbound,
    ) -> Result<infera_core::ports::transport::Inbound, infera_core::ports::transport::TransportError>
    {
        let worker = req.worker.as_str().to_owned();
        let rx = {
            let mut bodies = self.bodies.lock().expect("lock");
            let i = bodies
                .iter()
                .position(|(w, _)| *w == worker)
                .expect("a body for every leg");
            bodies.remove(i).1
        };
        self.calls.send(worker.clone()).await.expect("test listens");
        let body =
            futures::stream::unfold(
                rx,
                |mut rx| async move { rx.recv().await.map(|b| (Ok(b), rx)) },
            )
            .boxed();
        let content_type = if worker == self.prefill {
            "application/json"
        } else {
            "text/event-stream"
        };
        Ok(infera_core::ports::transport::Inbound {
            status: axum::http::StatusCode::OK,
            content_type: Some(axum::http::HeaderValue::from_static(content_type)),
            body,
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pd_request_is_prefilled_when_the_prefill_answers_not_at_the_first_byte() {
    let (p_tx, p_rx) = mpsc::channel(4);
    let (d_tx, d_rx) = mpsc::channel(4);
    let (calls, mut called) = mpsc::channel(4);
    let (p, d) = ("10.0.0.1:8000".to_owned(), "10.0.0.2:8000".to_owned());
    let transport = HeldPair {
        prefill: p.clone(),
        calls,
        bodies: std::sync::Mutex::new(vec![(p.clone(), p_rx), (d.clone(), d_rx)]),
    };
    let state = ServerState::with_transport(
        options(PolicyKind::KV_AWARE, 0, false),
        tokenizer(),
        Arc::new(transport),
    );
    let front = Front::serve(state).await;
    for (id, role) in [(&p, Role::Prefill), (&d, Role::Decode)] {
        let mut rec = record(id.parse().expect("addr"));
        rec.disagg_mode = role;
        rec.disagg_meta = Some(json!({"protocol": "vllm-nixl", "params": {}}));
        front.state.register_worker(rec);
    }
    let queued = |id: &str| {
        front
            .state
            .service()
            .with_fleet(|f| f.queued_prefill_tokens(&WorkerRank::new(id, 0)))
    };
    let inflight = |id: &str| {
        front
            .state
            .service()
            .with_fleet(|f| f.inflight_on(&WorkerRank::new(id, 0)))
    };
    let body = json!({"model": MODEL, "prompt": long_prompt("held", 64), "max_tokens": 4,
        "stream": true});
    let addr = front.addr;
    let client = tokio::spawn(async move {
        body_of(
            request(
                addr,
                "POST",
                "/v1/completions",
                body.to_string().into_bytes(),
            )
            .await,
        )
        .await
    });

    assert_eq!(called.recv().await.as_deref(), Some(p.as_str()));
    assert!(
        queued(&p) > 0,
        "the prompt queues on the prefill until it answers"
    );
    p_tx.send(Bytes::from_static(
        br#"{"kv_transfer_params": {"do_remote_prefill": true, "remote_engine_id": "e"}}"#,
    ))
    .await
    .expect("prefill body");
    drop(p_tx);

    // The decode leg is sent and has not answered a byte: the request is prefilled already.
    assert_eq!(called.recv().await.as_deref(), Some(d.as_str()));
    assert_eq!(queued(&p), 0, "prefilled when the prefill answered");
    assert_eq!(queued(&d), 0);
    assert_eq!(inflight(&d), 1, "still in flight");

    d_tx.send(Bytes::from_static(
        b"data: {\"choices\":[{\"text\":\" ok\"}]}\n\ndata: [DONE]\n\n",
    ))
    .await
    .expect("decode body");
    drop(d_tx);
    let (status, text) = client.await.expect("client task");
    assert_eq!(status, 200, "{text}");
    assert!(text.contains("data: [DONE]"), "{text}");
    assert_eq!(inflight(&d), 0);
    front.stop().await;
}
