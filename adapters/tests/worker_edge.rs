//! The server's edge toward workers over HTTP, over real sockets on 127.0.0.1: a worker that
//! accepts and never answers, or answers its head and goes silent, is cancelled at the
//! first-byte deadline and the request failed over (504 when no worker is left); a stream whose
//! worker goes silent ends with an SSE error event and `[DONE]`; a worker that keeps failing is
//! taken out of routing by its circuit breaker until a probe succeeds.
//!
//! The fake workers are axum apps whose behaviour a test switches through a handle; a request
//! the server gave up on is seen by the worker as its future (or body) being dropped. Breaker
//! cooldowns run on a virtual clock. Deadlines are short real ones, never asserted as timings.

mod common;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use common::fleet::{Front, MODEL, options, tokenizer};
use common::{TIMEOUT, exchange, get, post};
use futures::StreamExt as _;
use infera_adapters::server::{
    BreakerConfig, BreakerState, FirstByteDeadline, HttpDeadlines, HttpTransport, ServerState,
};
use infera_core::clock::VirtualClock;
use infera_core::event::{Engine, WorkerRecord};
use infera_core::ids::WorkerId;
use infera_core::policy::PolicyKind;
use serde_json::{Value, json};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// What a fake worker does with each request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum Behaviour {
    /// A completion, at once.
    Answer,
    /// 500.
    Fail,
    /// Accepts and never answers.
    Hang,
    /// Sends a 200 event-stream head, then nothing.
    HeadThenHang,
    /// Sends a 200 event-stream head and one event, then nothing.
    OneEventThenHang,
}

#[derive(Clone)]
struct FakeState {
    behaviour: Arc<AtomicU8>,
    hits: Arc<AtomicUsize>,
    abandoned: mpsc::Sender<()>,
}

/// Reports a request the server gave up on, when dropped.
struct Abandoned(mpsc::Sender<()>);

impl Drop for Abandoned {
    fn drop(&mut self) {
        let _ = self.0.try_send(());
    }
}

async fn handle(State(s): State<FakeState>, _body: Bytes) -> Response {
    s.hits.fetch_add(1, Ordering::SeqCst);
    let behaviour = s.behaviour.load(Ordering::SeqCst);
    let sse = |first: Option<&'static str>| {
        let guard = Abandoned(s.abandoned.clone());
        let rest = futures::stream::pending::<Result<Bytes, std::io::Error>>().map(move |x| {
            let _held = &guard;
            x
        });
        let body =
            futures::stream::iter(first.map(|f| Ok(Bytes::from_static(f.as_bytes())))).chain(rest);
        (
            [(header::CONTENT_TYPE, "text/event-stream")],
            Body::from_stream(body),
        )
            .into_response()
    };
    match behaviour {
        b if b == Behaviour::Answer as u8 => axum::Json(json!({
            "id": "cmpl-1", "object": "text_completion", "model": MODEL,
            "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
        }))
        .into_response(),
        b if b == Behaviour::Fail as u8 => {
            (StatusCode::INTERNAL_SERVER_ERROR, "{}").into_response()
        }
        b if b == Behaviour::Hang as u8 => {
            let _guard = Abandoned(s.abandoned.clone());
            std::future::pending::<Response>().await
        }
        b if b == Behaviour::HeadThenHang as u8 => sse(None),
        _ => sse(Some("data: {\"a\":1}\n\n")),
    }
}

struct Fake {
    addr: SocketAddr,
    behaviour: Arc<AtomicU8>,
    hits: Arc<AtomicUsize>,
    abandoned: mpsc::Receiver<()>,
    task: JoinHandle<()>,
}

impl Fake {
    async fn start(behaviour: Behaviour) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (tx, abandoned) = mpsc::channel(64);
        let state = FakeState {
            behaviour: Arc::new(AtomicU8::new(behaviour as u8)),
            hits: Arc::new(AtomicUsize::new(0)),
            abandoned: tx,
        };
        let (behaviour, hits) = (state.behaviour.clone(), state.hits.clone());
        let app = axum::Router::new()
            .route("/v1/completions", axum::routing::post(handle))
            .with_state(state);
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Self {
            addr,
            behaviour,
            hits,
            abandoned,
            task,
        }
    }

    fn id(&self) -> WorkerId {
        WorkerId::new(self.addr.to_string())
    }

    fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }

    fn set(&self, behaviour: Behaviour) {
        self.behaviour.store(behaviour as u8, Ordering::SeqCst);
    }

    /// Waits until the server has given up on one of this worker's requests.
    async fn abandoned(&mut self) {
        tokio::time::timeout(TIMEOUT, self.abandoned.recv())
            .await
            .expect("the server dropped the request in time")
            .expect("fake worker alive");
    }

    fn record(&self) -> WorkerRecord {
        record_at(self.addr)
    }
}

impl Drop for Fake {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The server front, round-robin over HTTP with `deadlines`, retrying `max_retries` times.
async fn start_front(max_retries: u32, deadlines: HttpDeadlines) -> Front {
    let transport = Arc::new(HttpTransport::with_deadlines(deadlines));
    let options = options(PolicyKind::ROUND_ROBIN, max_retries, false);
    Front::serve(ServerState::with_transport(options, tokenizer(), transport)).await
}

/// Completion number `i` through `front`.
async fn complete(front: &Front, i: usize) -> (u16, Value) {
    post(
        front.addr,
        "/v1/completions",
        &json!({"model": MODEL, "prompt": format!("request {i}"), "max_tokens": 1}),
    )
    .await
}

/// An unlabelled sample of `front`'s `/metrics`.
async fn metric(front: &Front, name: &str) -> u64 {
    let (_, text) = get(front.addr, "/metrics").await;
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("{name} in /metrics:\n{text}"))
}

fn breaker_off() -> BreakerConfig {
    BreakerConfig {
        failure_threshold: 0,
        ..BreakerConfig::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_never_answers_is_cancelled_at_the_first_byte_deadline_and_failed_over() {
    let mut hung = Fake::start(Behaviour::Hang).await;
    let mut head_only = Fake::start(Behaviour::HeadThenHang).await;
    let good = Fake::start(Behaviour::Answer).await;
    let deadlines = HttpDeadlines {
        connect: Some(Duration::from_secs(5)),
        first_byte: FirstByteDeadline::Fixed(Duration::from_millis(200)),
        ..HttpDeadlines::default()
    };
    let front = start_front(2, deadlines).await;
    front
        .state
        .service()
        .set_breaker(breaker_off(), Arc::new(VirtualClock::new(0)));
    for w in [&hung, &head_only, &good] {
        front.state.register_worker(w.record());
    }
    // Round robin starts each of the three requests on another worker.
    for i in 0..3 {
        let (status, body) = complete(&front, i).await;
        assert_eq!(status, 200, "request {i}: {body}");
        assert_eq!(body["choices"][0]["text"], "ok");
    }
    assert!(hung.hits() >= 1 && head_only.hits() >= 1);
    hung.abandoned().await;
    head_only.abandoned().await;
    assert!(front.state.service().metrics().retries_total() >= 2);
    assert!(metric(&front, "infera_transport_timeouts_total").await >= 2);
    assert_eq!(
        front.state.service().with_fleet(|f| f.inflight_requests()),
        0
    );

    // With only the silent workers left, the client gets an honest 504, streaming or not.
    front.state.deregister_worker(good.id(), "test".to_owned());
    let (status, body) = complete(&front, 9).await;
    assert_eq!(status, 504, "{body}");
    let message = body["error"]["message"].as_str().expect("message");
    assert!(
        message.contains("--http-req-first-byte-timeout"),
        "{message}"
    );
    let req = json!({"model": MODEL, "prompt": "s", "max_tokens": 1, "stream": true});
    let (status, text) = exchange(
        front.addr,
        "POST",
        "/v1/completions",
        req.to_string().into_bytes(),
    )
    .await;
    assert_eq!(status, 504, "{text}");
    assert_eq!(
        front.state.service().with_fleet(|f| f.inflight_requests()),
        0
    );
    front.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_goes_silent_mid_stream_ends_the_stream_with_an_error_event() {
    let mut silent = Fake::start(Behaviour::OneEventThenHang).await;
    let deadlines = HttpDeadlines {
        first_byte: FirstByteDeadline::Fixed(Duration::from_secs(10)),
        idle: Some(Duration::from_millis(200)),
        ..HttpDeadlines::default()
    };
    let front = start_front(1, deadlines).await;
    front.state.register_worker(silent.record());
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
    assert_eq!(err["error"]["code"], 504, "{err}");
    let message = err["error"]["message"].as_str().expect("message");
    assert!(message.contains("--http-req-idle-timeout"), "{message}");
    assert_eq!(events[2], "data: [DONE]");
    silent.abandoned().await;
    assert_eq!(front.state.service().metrics().retries_total(), 0);
    assert_eq!(
        front.state.service().with_fleet(|f| f.inflight_requests()),
        0
    );
    front.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_worker_is_taken_out_of_routing_until_a_probe_succeeds() {
    let bad = Fake::start(Behaviour::Fail).await;
    let good = Fake::start(Behaviour::Answer).await;
    let front = start_front(1, HttpDeadlines::default()).await;
    let clock = Arc::new(VirtualClock::new(1_000_000));
    front
        .state
        .service()
        .set_breaker(BreakerConfig::default(), clock.clone());
    front.state.register_worker(bad.record());
    front.state.register_worker(good.record());
    let mut i = 0;
    let mut complete_ok = async |front: &Front| {
        i += 1;
        let (status, body) = complete(front, i).await;
        assert_eq!(status, 200, "{body}");
    };

    // Three consecutive 5xx open the breaker; every request still succeeds elsewhere.
    for _ in 0..12 {
        if bad.hits() == 3 {
            break;
        }
        complete_ok(&front).await;
    }
    assert_eq!(bad.hits(), 3);
    assert_eq!(
        front.state.service().breaker_state(&bad.id()),
        BreakerState::Open
    );
    assert_eq!(front.state.service().metrics().breaker_trips_total(), 1);
    assert_eq!(metric(&front, "infera_breaker_open_workers").await, 1);
    let (_, text) = get(front.addr, "/metrics").await;
    let id = bad.id();
    for line in [
        format!(
            r#"infera_router_worker_breaker_state{{worker_id="{}"}} 2"#,
            id.as_str()
        ),
        format!(
            r#"infera_router_worker_breaker_trips_total{{worker_id="{}"}} 1"#,
            id.as_str()
        ),
    ] {
        assert!(text.contains(&format!("{line}\n")), "{line} in\n{text}");
    }
    let (_, workers) = get(front.addr, "/v1/workers").await;
    let workers: serde_json::Value = serde_json::from_str(&workers).unwrap();
    let bad_entry = workers["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["record"]["worker_id"] == bad.id().as_str())
        .unwrap();
    assert_eq!(bad_entry["breaker"], "open", "{workers}");
    let retries = front.state.service().metrics().retries_total();
    for _ in 0..6 {
        complete_ok(&front).await;
    }
    assert_eq!(bad.hits(), 3, "no traffic during the cooldown");
    assert_eq!(front.state.service().metrics().retries_total(), retries);

    // After the 5 s cooldown one probe goes through; it fails and doubles the cooldown.
    clock.advance(5_000_000);
    for _ in 0..2 {
        if bad.hits() == 4 {
            break;
        }
        complete_ok(&front).await;
    }
    assert_eq!(bad.hits(), 4, "one probe");
    assert_eq!(
        front.state.service().breaker_state(&bad.id()),
        BreakerState::Open
    );
    assert_eq!(front.state.service().metrics().breaker_trips_total(), 2);
    clock.advance(5_000_000);
    for _ in 0..4 {
        complete_ok(&front).await;
    }
    assert_eq!(bad.hits(), 4, "the second cooldown is 10 s");

    // The worker recovers: the next probe closes the breaker and it is routed again.
    bad.set(Behaviour::Answer);
    clock.advance(5_000_000);
    for _ in 0..2 {
        if bad.hits() == 5 {
            break;
        }
        complete_ok(&front).await;
    }
    assert_eq!(bad.hits(), 5);
    assert_eq!(
        front.state.service().breaker_state(&bad.id()),
        BreakerState::Closed
    );
    for _ in 0..4 {
        complete_ok(&front).await;
    }
    assert_eq!(bad.hits(), 7, "round robin again");
    assert_eq!(metric(&front, "infera_breaker_open_workers").await, 0);
    assert_eq!(
        front.state.service().with_fleet(|f| f.inflight_requests()),
        0
    );
    front.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_whose_breaker_is_open_is_still_tried_when_it_is_the_only_one() {
    let bad = Fake::start(Behaviour::Fail).await;
    let front = start_front(0, HttpDeadlines::default()).await;
    front
        .state
        .service()
        .set_breaker(BreakerConfig::default(), Arc::new(VirtualClock::new(0)));
    front.state.register_worker(bad.record());
    for i in 0..5 {
        let (status, body) = complete(&front, i).await;
        assert_eq!(status, 500, "the worker's own answer: {body}");
    }
    assert_eq!(bad.hits(), 5);
    assert_eq!(
        front.state.service().breaker_state(&bad.id()),
        BreakerState::Open
    );
    assert_eq!(front.state.service().metrics().breaker_trips_total(), 1);
    front.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_transport_ends_a_response_past_its_max_duration_with_a_timeout() {
    use infera_core::ports::transport::{Outbound, RequestTransport as _, TransportError};
    let mut slow = Fake::start(Behaviour::OneEventThenHang).await;
    let transport = HttpTransport::with_deadlines(HttpDeadlines {
        max_duration: Some(Duration::from_millis(200)),
        ..HttpDeadlines::default()
    });
    let out = Outbound::new(
        slow.id(),
        format!("http://{}", slow.addr),
        "/v1/completions",
        Bytes::from_static(b"{}"),
        true,
        "r-1",
    );
    let mut inbound = tokio::time::timeout(TIMEOUT, transport.send(out))
        .await
        .expect("head in time")
        .expect("head");
    assert_eq!(inbound.status, StatusCode::OK);
    let first = inbound.body.next().await.expect("a chunk").expect("data");
    assert_eq!(&first[..], b"data: {\"a\":1}\n\n");
    let end = tokio::time::timeout(TIMEOUT, inbound.body.next())
        .await
        .expect("the deadline ends the body");
    match end {
        Some(Err(TransportError::Timeout(m))) => {
            assert!(m.contains("--http-req-max-duration"), "{m}");
        }
        other => panic!("expected a timeout, got {other:?}"),
    }
    assert!(
        inbound.body.next().await.is_none(),
        "the stream ends after its error"
    );
    drop(inbound);
    slow.abandoned().await;
}

/// A completion stream frame of `id` carrying `text`.
fn frame(id: &str, text: &str, finish: Option<&str>) -> String {
    let v = json!({"id": id, "object": "text_completion", "model": MODEL,
        "choices": [{"index": 0, "text": text, "finish_reason": finish}]});
    format!("data: {v}\n\n")
}

/// A streaming worker that sends "Hello" and ",", then dies (its connection breaks) when `die`
/// is notified.
async fn dying_worker(die: Arc<tokio::sync::Notify>) -> (SocketAddr, JoinHandle<()>) {
    let handler = move |_body: Bytes| {
        let die = die.clone();
        async move {
            let head = futures::stream::iter([
                Ok(Bytes::from(frame("cmpl-A", "Hello", None))),
                Ok(Bytes::from(frame("cmpl-A", ",", None))),
            ]);
            let death = futures::stream::once(async move {
                die.notified().await;
                Err::<Bytes, _>(std::io::Error::other("engine died"))
            });
            (
                [(header::CONTENT_TYPE, "text/event-stream")],
                Body::from_stream(head.chain(death)),
            )
        }
    };
    serve_app(axum::Router::new().route("/v1/completions", axum::routing::post(handler))).await
}

/// A streaming worker that finishes any generation with " world" and reports each request body.
async fn continuing_worker(bodies: mpsc::Sender<Value>) -> (SocketAddr, JoinHandle<()>) {
    let handler = move |body: Bytes| {
        let bodies = bodies.clone();
        async move {
            let _ = bodies.try_send(serde_json::from_slice(&body).unwrap_or(Value::Null));
            let frames = [
                frame("cmpl-B", " world", None),
                frame("cmpl-B", "", Some("length")),
                "data: [DONE]\n\n".to_owned(),
            ];
            let body =
                futures::stream::iter(frames.map(|f| Ok::<_, std::io::Error>(Bytes::from(f))));
            (
                [(header::CONTENT_TYPE, "text/event-stream")],
                Body::from_stream(body),
            )
        }
    };
    serve_app(axum::Router::new().route("/v1/completions", axum::routing::post(handler))).await
}

async fn serve_app(app: axum::Router) -> (SocketAddr, JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    (addr, task)
}

fn record_at(addr: SocketAddr) -> WorkerRecord {
    let id = WorkerId::new(addr.to_string());
    WorkerRecord::mixed(id, format!("http://{addr}"), MODEL, Engine::Vllm, 16)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_whose_worker_dies_is_continued_on_another_worker_with_the_text_so_far() {
    use http_body_util::BodyExt as _;
    let die = Arc::new(tokio::sync::Notify::new());
    let (dying, dying_task) = dying_worker(die.clone()).await;
    let (bodies_tx, mut bodies) = mpsc::channel(4);
    let (healthy, healthy_task) = continuing_worker(bodies_tx).await;
    let front = start_front(1, HttpDeadlines::default()).await;
    front.state.service().set_migration_limit(1);
    front.state.register_worker(record_at(dying));

    let req = json!({"model": MODEL, "prompt": "Say:", "max_tokens": 8, "stream": true});
    let ex = common::request(
        front.addr,
        "POST",
        "/v1/completions",
        req.to_string().into_bytes(),
    )
    .await;
    assert_eq!(ex.response.status(), 200);
    let mut body = ex.response.into_body();
    let mut text = String::new();
    // The first worker's two frames reach the client; then the second worker joins and the
    // first one dies.
    while text.matches("\n\n").count() < 2 {
        let f = tokio::time::timeout(TIMEOUT, body.frame())
            .await
            .expect("frame in time")
            .expect("a frame")
            .expect("frame ok");
        text.push_str(&String::from_utf8_lossy(&f.into_data().unwrap_or_default()));
    }
    front.state.register_worker(record_at(healthy));
    die.notify_one();
    let rest = tokio::time::timeout(TIMEOUT, body.collect())
        .await
        .expect("the rest in time")
        .expect("the rest")
        .to_bytes();
    text.push_str(&String::from_utf8_lossy(&rest));

    let events: Vec<&str> = text.split("\n\n").filter(|e| !e.is_empty()).collect();
    assert_eq!(events.len(), 5, "{text}");
    let pieces: Vec<Value> = events[..4]
        .iter()
        .map(|e| serde_json::from_str(e.strip_prefix("data: ").expect("data")).expect("json"))
        .collect();
    for p in &pieces {
        assert_eq!(p["id"], "cmpl-A", "one stream id throughout: {p}");
        assert!(p.get("error").is_none(), "{p}");
    }
    let said: String = pieces
        .iter()
        .map(|p| p["choices"][0]["text"].as_str().unwrap_or_default())
        .collect();
    assert_eq!(said, "Hello, world");
    assert_eq!(pieces[3]["choices"][0]["finish_reason"], "length");
    assert_eq!(events[4], "data: [DONE]");

    // The continuation carried the text so far and the rest of the token budget.
    let sent = bodies.recv().await.expect("the continuation");
    assert_eq!(sent["prompt"], "Say:Hello,");
    assert_eq!(sent["max_tokens"], 6);
    assert_eq!(front.state.service().metrics().migrations_total(), 1);
    assert_eq!(
        front.state.service().with_fleet(|f| f.inflight_requests()),
        0
    );

    // Without another worker (the healthy one gone, the dying one already failed this stream),
    // the stream ends with an error event, as without migration.
    front
        .state
        .deregister_worker(WorkerId::new(healthy.to_string()), "test".to_owned());
    let ex = common::request(
        front.addr,
        "POST",
        "/v1/completions",
        req.to_string().into_bytes(),
    )
    .await;
    let mut body = ex.response.into_body();
    let first = tokio::time::timeout(TIMEOUT, body.frame())
        .await
        .expect("frame in time");
    assert!(first.is_some());
    die.notify_one();
    let rest = tokio::time::timeout(TIMEOUT, body.collect())
        .await
        .expect("the rest in time")
        .expect("the rest")
        .to_bytes();
    let rest = String::from_utf8_lossy(&rest);
    assert!(rest.contains("\"error\""), "{rest}");
    assert!(rest.ends_with("data: [DONE]\n\n"), "{rest}");
    assert_eq!(front.state.service().metrics().migrations_total(), 1);
    // The Python Infera's families say the same: one carried, one with no candidate.
    let (_, text) = get(front.addr, "/metrics").await;
    for line in [
        r#"infera_migrations_total{reason="stream_broken"} 1"#,
        r#"infera_migrations_failed_total{reason="no_candidate"} 1"#,
    ] {
        assert!(text.contains(&format!("{line}\n")), "{line} in\n{text}");
    }
    front.stop().await;
    dying_task.abort();
    healthy_task.abort();
}
