//! What the server asks of its clients, over real sockets on 127.0.0.1: the header, idle,
//! body and stalled-write deadlines and the connection cap of the serve loop (the mock engine's too), the admin token, and the parse budget
//! with token-id prompts read without a JSON tree.
//!
//! Deadlines are configured short and the tests wait on the socket's end (EOF), bounded by
//! [`TIMEOUT`]; nothing sleeps and no timing is asserted.

mod common;

use common::fleet::{Front, MODEL, tokenizer};
use common::{TIMEOUT, body_of, exchange, post, request_with};
use infera_adapters::mock::{MockConfig, MockServer};
use infera_adapters::serve::ServeLimits;
use infera_adapters::server::{AdminToken, ClientOptions, ParseBudget, ServerOptions, ServerState};
use infera_core::engine::EngineConfig;
use infera_core::event::{Engine, WorkerRecord};
use infera_core::fleet::FleetConfig;
use infera_core::ids::WorkerId;
use infera_core::policy::{PolicyKind, RouterConfig};
use infera_core::service::ServiceOptions;
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;

/// Deadlines off and a large cap: each test turns on what it checks.
fn no_limits() -> ServeLimits {
    ServeLimits {
        header_timeout: None,
        idle_timeout: None,
        body_timeout: None,
        write_timeout: None,
        max_connections: 1024,
    }
}

fn options(client: ClientOptions) -> ServerOptions {
    ServerOptions {
        service: ServiceOptions {
            router: RouterConfig {
                policy: PolicyKind::KV_AWARE,
                ..RouterConfig::default()
            },
            fleet: FleetConfig::default(),
            request_max_retries: 0,
            max_body_bytes: 4 << 20,
        },
        chat_template: None,
        template_defaults: Default::default(),
        per_worker_template_kwargs: true,
        model_tokenizers: Default::default(),
        lora_loading: None,
        direct: false,
        client,
    }
}

/// The server front with `client`'s bounds.
async fn front_of(client: ClientOptions) -> Front {
    Front::serve(ServerState::new(options(client), tokenizer())).await
}

/// The server front with `limits` and every other client option at its default.
async fn front_with_limits(limits: ServeLimits) -> Front {
    front_of(ClientOptions {
        limits,
        ..ClientOptions::default()
    })
    .await
}

/// Everything the peer sends until it closes the connection (a reset counts as a close).
async fn until_closed(tcp: &mut TcpStream) -> Vec<u8> {
    let mut got = Vec::new();
    let read = tokio::time::timeout(TIMEOUT, async {
        let mut buf = [0u8; 4096];
        loop {
            match tcp.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await;
    assert!(read.is_ok(), "the server closed the connection in time");
    got
}

const HEALTH: &[u8] = b"GET /health HTTP/1.1\r\nhost: test\r\n\r\n";
const HEALTH_THEN_CLOSE: &[u8] = b"GET /health HTTP/1.1\r\nhost: test\r\nconnection: close\r\n\r\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_half_sent_head_is_closed_at_its_deadline_while_others_are_served() {
    let front = front_with_limits(ServeLimits {
        header_timeout: Some(Duration::from_millis(500)),
        ..no_limits()
    })
    .await;
    let mut slow = TcpStream::connect(front.addr).await.expect("connect");
    slow.write_all(b"GET /he").await.expect("half a head");

    let (status, _) = exchange(front.addr, "GET", "/health", Vec::new()).await;
    assert_eq!(status, 200, "a normal client is served meanwhile");

    let got = until_closed(&mut slow).await;
    assert!(got.is_empty(), "{}", String::from_utf8_lossy(&got));
    front.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mock_engine_closes_a_half_sent_head_too() {
    let mut config = MockConfig::new(MODEL, EngineConfig::default());
    config.limits = ServeLimits {
        header_timeout: Some(Duration::from_millis(500)),
        ..no_limits()
    };
    let mock = MockServer::bind("127.0.0.1:0", config, None)
        .await
        .expect("mock binds");
    let addr = mock.local_addr();
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(mock.serve(async move {
        let _ = stopped.await;
    }));
    let mut slow = TcpStream::connect(addr).await.expect("connect");
    slow.write_all(b"GET /he").await.expect("half a head");
    let (status, _) = exchange(addr, "GET", "/health", Vec::new()).await;
    assert_eq!(status, 200, "a normal client is served meanwhile");
    assert!(until_closed(&mut slow).await.is_empty());
    let _ = stop.send(());
    tokio::time::timeout(TIMEOUT, task)
        .await
        .expect("mock stops in time")
        .expect("mock task did not panic")
        .expect("mock served without error");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_keep_alive_connections_are_closed() {
    let front = front_with_limits(ServeLimits {
        idle_timeout: Some(Duration::from_millis(300)),
        ..no_limits()
    })
    .await;
    let mut tcp = TcpStream::connect(front.addr).await.expect("connect");
    tcp.write_all(HEALTH).await.expect("request");
    let got = until_closed(&mut tcp).await;
    let text = String::from_utf8_lossy(&got);
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert_eq!(text.matches("HTTP/1.1").count(), 1, "{text}");
    front.stop().await;
}

/// A response body that never ends and reports when it is dropped.
struct Endless(Option<oneshot::Sender<()>>);

impl Drop for Endless {
    fn drop(&mut self) {
        if let Some(dropped) = self.0.take() {
            let _ = dropped.send(());
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_is_closed_and_its_response_dropped() {
    let (dropped_tx, dropped) = oneshot::channel();
    let dropped_tx = Arc::new(std::sync::Mutex::new(Some(dropped_tx)));
    let app = axum::Router::new().route(
        "/stream",
        axum::routing::get(move || {
            let guard = Endless(dropped_tx.lock().expect("lock").take());
            let chunks = futures::stream::repeat_with(move || {
                let _held = &guard;
                Ok::<_, std::convert::Infallible>(axum::body::Bytes::from(vec![b'x'; 64 << 10]))
            });
            async move { axum::body::Body::from_stream(chunks) }
        }),
    );
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let limits = ServeLimits {
        write_timeout: Some(Duration::from_millis(300)),
        ..no_limits()
    };
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(infera_adapters::serve::serve(
        listener,
        app,
        limits,
        async move {
            let _ = stopped.await;
        },
    ));
    let mut reader = TcpStream::connect(addr).await.expect("connect");
    reader
        .write_all(b"GET /stream HTTP/1.1\r\nhost: test\r\n\r\n")
        .await
        .expect("request");
    // The client reads nothing: once both sockets' buffers are full the server's writes stall,
    // and past the deadline the connection is closed and the endless body dropped.
    tokio::time::timeout(TIMEOUT, dropped)
        .await
        .expect("the stalled response is dropped in time")
        .expect("the body reports its drop");
    assert!(
        !until_closed(&mut reader).await.is_empty(),
        "what was sent before the stall still arrives, then the end"
    );
    let _ = stop.send(());
    tokio::time::timeout(TIMEOUT, task)
        .await
        .expect("stops in time")
        .expect("no panic")
        .expect("served without error");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_stops_arriving_is_answered_408() {
    let front = front_with_limits(ServeLimits {
        body_timeout: Some(Duration::from_millis(300)),
        idle_timeout: Some(Duration::from_millis(300)),
        ..no_limits()
    })
    .await;
    let mut tcp = TcpStream::connect(front.addr).await.expect("connect");
    tcp.write_all(
        b"POST /v1/completions HTTP/1.1\r\nhost: test\r\ncontent-length: 100\r\n\r\n{\"model\"",
    )
    .await
    .expect("part of a body");
    let got = until_closed(&mut tcp).await;
    let text = String::from_utf8_lossy(&got);
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(text.contains("TimeoutError"), "{text}");
    front.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_the_cap_new_clients_are_answered_at_once_and_served_once_a_slot_frees() {
    let front = front_with_limits(ServeLimits {
        max_connections: 2,
        ..no_limits()
    })
    .await;
    // Two connections that send nothing hold both slots (the backlog is accepted in order).
    let mut held: Vec<TcpStream> = Vec::new();
    for _ in 0..2 {
        held.push(TcpStream::connect(front.addr).await.expect("connect"));
    }
    for _ in 0..3 {
        let mut extra = TcpStream::connect(front.addr).await.expect("connect");
        let _ = extra.write_all(HEALTH).await;
        let got = until_closed(&mut extra).await;
        let text = String::from_utf8_lossy(&got);
        assert!(
            got.is_empty() || text.starts_with("HTTP/1.1 503"),
            "over the cap: 503 or a close, got {text}"
        );
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            assert!(head.contains("retry-after: 1"), "{text}");
            let body: Value = serde_json::from_str(body).expect("a whole JSON error");
            assert_eq!(body["error"]["code"], 503, "{body}");
        }
    }
    // The held connections are still served; one that ends frees its slot.
    let mut first = held.remove(0);
    first.write_all(HEALTH_THEN_CLOSE).await.expect("request");
    let got = until_closed(&mut first).await;
    assert!(String::from_utf8_lossy(&got).starts_with("HTTP/1.1 200"));
    let (status, _) = exchange(front.addr, "GET", "/health", Vec::new()).await;
    assert_eq!(status, 200, "a freed slot serves a new client");
    drop(held);
    front.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_routes_need_the_token_and_nothing_else_does() {
    let front = front_of(ClientOptions {
        admin_token: Some(AdminToken::new("s3cret")),
        ..ClientOptions::default()
    })
    .await;
    let call = |method: &'static str, path: &'static str, auth: Option<&'static str>| {
        let addr = front.addr;
        async move {
            let headers: Vec<(&str, &str)> =
                auth.map(|a| ("authorization", a)).into_iter().collect();
            let ex = request_with(addr, method, path, &headers, Vec::new()).await;
            let challenge = ex.response.headers().get("www-authenticate").cloned();
            let (status, text) = body_of(ex).await;
            (status, text, challenge)
        }
    };
    for auth in [
        None,
        Some("Bearer wrong"),
        Some("s3cret"),
        Some("Basic s3cret"),
    ] {
        let guarded = [
            ("GET", "/v1/workers"),
            ("POST", "/v1/admin/profile/start"),
            ("GET", "/v1/admin/scale"),
            ("POST", "/v1/admin/scale"),
        ];
        for (method, path) in guarded {
            let (status, text, challenge) = call(method, path, auth).await;
            assert_eq!(status, 401, "{method} {path} with {auth:?}: {text}");
            let body: Value = serde_json::from_str(&text).expect("json error");
            assert_eq!(body["error"]["type"], "AuthenticationError", "{body}");
            assert_eq!(body["error"]["code"], 401, "{body}");
            assert_eq!(
                challenge.as_ref().map(|v| v.as_bytes()),
                Some(&b"Bearer"[..])
            );
        }
    }
    let (status, text, _) = call("GET", "/v1/workers", Some("Bearer s3cret")).await;
    assert_eq!(status, 200, "{text}");
    // Past the guard, profiling and the scaling API are still off.
    let (status, _, _) = call("POST", "/v1/admin/profile/start", Some("Bearer s3cret")).await;
    assert_eq!(status, 403);
    let (status, text, _) = call("GET", "/v1/admin/scale", Some("Bearer s3cret")).await;
    assert_eq!(status, 403, "{text}");
    let body: Value = serde_json::from_str(&text).expect("json error");
    assert_eq!(body["error"]["type"], "PermissionDeniedError", "{body}");
    for path in ["/health", "/v1/models", "/metrics"] {
        let (status, text, _) = call("GET", path, None).await;
        assert_eq!(status, 200, "{path}: {text}");
    }
    let (status, body) = post(
        front.addr,
        "/v1/completions",
        &json!({"model": "x", "prompt": "hi"}),
    )
    .await;
    assert_eq!(status, 404, "completions need no token: {body}");
    front.stop().await;

    let open = front_of(ClientOptions::default()).await;
    let (status, text) = exchange(open.addr, "GET", "/v1/workers", Vec::new()).await;
    assert_eq!(status, 200, "no token configured: open as before: {text}");
    open.stop().await;
}

fn token_prompt(n: usize) -> Vec<u8> {
    let ids: Vec<u32> = (0..n as u32).map(|i| 100 + i % 5000).collect();
    json!({"model": MODEL, "prompt": ids, "max_tokens": 2})
        .to_string()
        .into_bytes()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_beyond_the_parse_budget_is_refused_and_the_server_keeps_serving() {
    let front = front_of(ClientOptions {
        parse_budget: ParseBudget::new(64 << 10),
        ..ClientOptions::default()
    })
    .await;
    let big = token_prompt(40_000);
    assert!(big.len() > 64 << 10);
    for _ in 0..2 {
        let ex = request_with(front.addr, "POST", "/v1/completions", &[], big.clone()).await;
        let retry = ex.response.headers().get("retry-after").cloned();
        let (status, text) = body_of(ex).await;
        assert_eq!(status, 503, "{text}");
        assert_eq!(retry.as_ref().map(|v| v.as_bytes()), Some(&b"1"[..]));
        assert!(text.contains("retry shortly"), "{text}");
        // Under the budget, the body is parsed (and the model is unknown): nothing was kept.
        let (status, body) = post(
            front.addr,
            "/v1/completions",
            &json!({"model": "x", "prompt": [1, 2]}),
        )
        .await;
        assert_eq!(status, 404, "{body}");
    }
    front.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_big_token_array_is_parsed_routed_and_forwarded_whole() {
    let engine = EngineConfig {
        gpu_blocks: 8192,
        block_size: 16,
        speedup: 1000.0,
        ..EngineConfig::default()
    };
    let mut config = MockConfig::new(MODEL, engine);
    config.tokenizer = Some(tokenizer());
    config.max_body_bytes = 4 << 20;
    let mock = MockServer::bind("127.0.0.1:0", config, None)
        .await
        .expect("mock binds");
    let mock_addr = mock.local_addr();
    let (stop_mock, mock_stopped) = oneshot::channel::<()>();
    let mock_task = tokio::spawn(mock.serve(async move {
        let _ = mock_stopped.await;
    }));
    let front = front_of(ClientOptions::default()).await;
    front.state.register_worker(WorkerRecord::mixed(
        WorkerId::new(mock_addr.to_string()),
        format!("http://{mock_addr}"),
        MODEL,
        Engine::Vllm,
        16,
    ));
    let n = 100_000;
    let body = token_prompt(n);
    let ex = request_with(front.addr, "POST", "/v1/completions", &[], body).await;
    let (status, text) = body_of(ex).await;
    assert_eq!(status, 200, "{text}");
    let answer: Value = serde_json::from_str(&text).expect("json");
    assert_eq!(
        answer["usage"]["prompt_tokens"], n,
        "the engine got every id"
    );
    assert_eq!(front.state.service().metrics().picks_total(), 1);
    front.stop().await;
    let _ = stop_mock.send(());
    tokio::time::timeout(TIMEOUT, mock_task)
        .await
        .expect("mock stops in time")
        .expect("mock task did not panic")
        .expect("mock served without error");
}
