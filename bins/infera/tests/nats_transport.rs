//! The NATS request transport against a real nats-server: the server side ([`NatsTransport`])
//! talking to the worker side ([`NatsResponder`]) in front of the in-process mock engine. (The
//! KV-event subjects are tested through the KV pipeline in `backends/tests/kv_pipeline.rs`; the
//! JetStream request path of `--nats-req-max-pending`, with its Python interop, in
//! `backends/tests/nats_jetstream.rs`.)
#![allow(clippy::unwrap_used)]

use bytes::Bytes;
use futures::StreamExt as _;
use infera_adapters::mock::{MockConfig, MockServer};
use infera_backends::nats::{
    self, HDR_SEQ, HDR_TYPE, NatsRequestConfig, NatsResponder, NatsTransport, ResponderConfig,
};
use infera_backends::testing::NatsServer;
use infera_core::engine::EngineConfig;
use infera_core::ids::WorkerId;
use infera_core::ports::transport::{
    BodyStream, DP_RANK_HEADER, Outbound, RequestTransport as _, TransportError,
};
use serde_json::{Value, json};
use std::time::Duration;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio::time::timeout;

const WORKER: &str = "127.0.0.1:9";
const DEADLINE: Duration = Duration::from_secs(30);

/// The mock engine on a free port, at `speedup`.
async fn engine(speedup: f64) -> (String, oneshot::Sender<()>, JoinHandle<()>) {
    let config = MockConfig::new(
        "m",
        EngineConfig {
            speedup,
            ..EngineConfig::default()
        },
    );
    let server = MockServer::bind("127.0.0.1:0", config, None).await.unwrap();
    let url = format!("http://{}", server.local_addr());
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        server
            .serve(async move {
                let _ = stopped.await;
            })
            .await
            .unwrap();
    });
    (url, stop, task)
}

/// An "engine" that accepts connections and never answers: its URL, and the task holding them.
async fn silent_engine() -> (String, JoinHandle<()>) {
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", silent.local_addr().unwrap());
    let held = tokio::spawn(async move {
        let mut conns = Vec::new();
        while let Ok((conn, _)) = silent.accept().await {
            conns.push(conn);
        }
    });
    (url, held)
}

async fn responder(client: &nats::Client, engine_url: &str) -> NatsResponder {
    bounded_responder(client, engine_url, |_| {}).await
}

/// A responder whose config `limit` changes (its timeouts and admission limit).
async fn bounded_responder(
    client: &nats::Client,
    engine_url: &str,
    limit: impl FnOnce(&mut ResponderConfig),
) -> NatsResponder {
    let mut config = ResponderConfig {
        worker_id: WORKER.to_owned(),
        engine_url: engine_url.to_owned(),
        max_duration: None,
        idle_timeout: None,
        max_pending: None,
    };
    limit(&mut config);
    NatsResponder::start(client.clone(), config).await.unwrap()
}

fn outbound(body: Value, stream: bool) -> Outbound {
    Outbound::new(
        WorkerId::new(WORKER),
        "http://unused",
        "/v1/completions",
        Bytes::from(body.to_string()),
        stream,
        "r-1",
    )
}

async fn collect(mut body: BodyStream) -> String {
    let mut out = Vec::new();
    while let Some(chunk) = body.next().await {
        out.extend_from_slice(&chunk.unwrap());
    }
    String::from_utf8(out).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_round_trip_through_the_responder_to_the_engine() {
    round_trip(None).await;
}

/// The same through JetStream (`--nats-req-max-pending` on both sides).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_round_trip_through_jetstream_with_max_pending() {
    round_trip(Some(8)).await;
}

async fn round_trip(max_pending: Option<u32>) {
    let broker = NatsServer::start().await.unwrap();
    let client = nats::connect(&broker.url(), "test").await.unwrap();
    let (url, _stop, _engine) = engine(1000.0).await;
    let responder = bounded_responder(&client, &url, |c| c.max_pending = max_pending).await;
    let transport = NatsTransport::new(
        client.clone(),
        NatsRequestConfig {
            max_pending,
            ..NatsRequestConfig::default()
        },
    );

    let resp = transport
        .send(outbound(
            json!({"model": "m", "prompt": "hello", "max_tokens": 3}),
            false,
        ))
        .await
        .unwrap();
    assert_eq!(resp.status, 200);
    let body: Value = serde_json::from_str(&collect(resp.body).await).unwrap();
    assert_eq!(body["usage"]["completion_tokens"], 3, "{body}");

    let resp = transport
        .send(outbound(
            json!({"model": "m", "prompt": "hello", "max_tokens": 5, "stream": true}),
            true,
        ))
        .await
        .unwrap();
    assert_eq!(resp.status, 200);
    assert_eq!(resp.content_type.unwrap(), "text/event-stream");
    let text = collect(resp.body).await;
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    assert!(text.matches("data: {").count() >= 5, "{text}");

    // The engine's own errors come back with their status.
    let resp = transport
        .send(outbound(json!({"model": "m"}), false))
        .await
        .unwrap();
    assert_eq!(resp.status, 400);

    // A worker that stopped accepting is unreachable: the server fails over (core NATS: no
    // responders; JetStream: the worker refuses it before starting it).
    responder.stop_accepting().await;
    let err = transport
        .send(outbound(json!({"model": "m", "prompt": "x"}), false))
        .await
        .unwrap_err();
    assert!(matches!(err, TransportError::Unreachable(_)), "{err:?}");
    assert!(err.retry_elsewhere());
    timeout(DEADLINE, responder.finish(DEADLINE)).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_reply_stream_cancels_the_engine_request() {
    let broker = NatsServer::start().await.unwrap();
    let client = nats::connect(&broker.url(), "test").await.unwrap();
    // Real speed: 4000 tokens take far longer than the drain bound below.
    let (url, _stop, _engine) = engine(1.0).await;
    let responder = responder(&client, &url).await;
    let transport = NatsTransport::new(client.clone(), NatsRequestConfig::default());
    let mut cancels = client
        .subscribe(nats::cancel_subject(WORKER))
        .await
        .unwrap();

    let resp = transport
        .send(outbound(
            json!({"model": "m", "prompt": "long", "max_tokens": 4000, "stream": true}),
            true,
        ))
        .await
        .unwrap();
    let mut body = resp.body;
    body.next().await.unwrap().unwrap();
    drop(body); // the client went away
    let cancel = timeout(DEADLINE, cancels.next()).await.unwrap().unwrap();
    assert!(cancel.payload.starts_with(b"_INBOX."), "{cancel:?}");
    // The responder dropped the engine request, so it has nothing left to drain.
    timeout(
        Duration::from_secs(10),
        responder.finish(Duration::from_secs(60)),
    )
    .await
    .expect("the cancelled request is not still generating");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_responders_own_max_duration_ends_a_request_with_a_timeout() {
    let broker = NatsServer::start().await.unwrap();
    let client = nats::connect(&broker.url(), "test").await.unwrap();
    // Real speed: 4000 tokens take minutes; the responder gives each request 1 s.
    let (url, _stop, _engine) = engine(1.0).await;
    let responder = bounded_responder(&client, &url, |c| {
        c.max_duration = Some(Duration::from_secs(1));
    })
    .await;
    // The server side has no timer of its own.
    let transport = NatsTransport::new(client.clone(), NatsRequestConfig::default());

    let err = timeout(
        DEADLINE,
        transport.send(outbound(
            json!({"model": "m", "prompt": "long", "max_tokens": 4000}),
            false,
        )),
    )
    .await
    .unwrap()
    .unwrap_err();
    assert!(matches!(err, TransportError::Timeout(_)), "{err:?}");
    assert!(err.to_string().contains("--nats-req-max-duration"), "{err}");
    assert!(!err.retry_elsewhere());

    // A stream that already sent data ends with the timeout as its last item.
    let resp = transport
        .send(outbound(
            json!({"model": "m", "prompt": "long", "max_tokens": 4000, "stream": true}),
            true,
        ))
        .await
        .unwrap();
    let mut body = resp.body;
    let mut last = None;
    while let Some(item) = timeout(DEADLINE, body.next()).await.unwrap() {
        last = Some(item);
    }
    let err = last.unwrap().unwrap_err();
    assert!(matches!(err, TransportError::Timeout(_)), "{err:?}");
    drop(body);
    // The worker ended both itself: nothing is left generating.
    timeout(
        Duration::from_secs(10),
        responder.finish(Duration::from_secs(60)),
    )
    .await
    .expect("the timed-out requests are not still generating");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_payloads_are_answered_with_an_error_and_serving_goes_on() {
    let broker = NatsServer::start().await.unwrap();
    let client = nats::connect(&broker.url(), "test").await.unwrap();
    let (url, _stop, _engine) = engine(1000.0).await;
    let _responder = responder(&client, &url).await;
    for (bad, says) in [
        (&b"not json"[..], "not a valid request"),
        (
            br#"{"path":"@evil.example/","body":{}}"#,
            "must start with '/'",
        ),
        (br#"{"path":"/v1/completions"}"#, "not a valid request"),
    ] {
        let inbox = client.new_inbox();
        let mut sub = client.subscribe(inbox.clone()).await.unwrap();
        client
            .publish_with_reply(
                nats::request_subject(WORKER),
                inbox,
                Bytes::from_static(bad),
            )
            .await
            .unwrap();
        let msg = timeout(DEADLINE, sub.next()).await.unwrap().unwrap();
        let headers = msg.headers.unwrap();
        assert_eq!(headers.get(HDR_TYPE).unwrap().as_str(), "error");
        assert_eq!(headers.get(HDR_SEQ).unwrap().as_str(), "0");
        let text = String::from_utf8(msg.payload.to_vec()).unwrap();
        assert!(text.contains(says), "{text}");
    }
    let transport = NatsTransport::new(client.clone(), NatsRequestConfig::default());
    let resp = transport
        .send(outbound(
            json!({"model": "m", "prompt": "still here", "max_tokens": 1}),
            false,
        ))
        .await
        .unwrap();
    assert_eq!(resp.status, 200);
}

/// `--nats-req-max-pending` is one limit on the worker's JetStream backlog, whichever server
/// replica sent the requests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_pending_refuses_with_429_across_server_replicas_until_a_request_ends() {
    let broker = NatsServer::start().await.unwrap();
    let client = nats::connect(&broker.url(), "worker").await.unwrap();
    let (url, _stop, _engine) = engine(1.0).await;
    let responder = bounded_responder(&client, &url, |c| c.max_pending = Some(1)).await;
    let replica = async |name: &str| {
        NatsTransport::new(
            nats::connect(&broker.url(), name).await.unwrap(),
            NatsRequestConfig {
                max_pending: Some(1),
                ..NatsRequestConfig::default()
            },
        )
    };
    let (a, b) = (replica("server-a").await, replica("server-b").await);
    let long = json!({"model": "m", "prompt": "long", "max_tokens": 4000, "stream": true});
    let held = a.send(outbound(long.clone(), true)).await.unwrap();
    // The other replica reads the worker's backlog (A's own reading, taken before it sent, may
    // be reused for up to 200 ms, as the Python Infera does).
    let backlog = nats::jetstream::worker_request_consumer(&client, WORKER)
        .await
        .unwrap();
    assert_eq!(backlog.num_pending + backlog.num_ack_pending as u64, 1);
    let err = b.send(outbound(long.clone(), true)).await.unwrap_err();
    assert_eq!(err.status(), 429);
    assert!(
        matches!(
            err,
            TransportError::Overloaded {
                retry_after_s: 1,
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("--nats-req-max-pending"), "{err}");
    assert!(err.retry_elsewhere(), "another worker is tried");
    drop(held);
    // Once the held stream's cancel reached the worker, its engine request ended and the worker
    // acked it, every replica admits again (a reading is reused for up to 200 ms).
    let again = loop {
        match timeout(DEADLINE, b.send(outbound(long.clone(), true)))
            .await
            .unwrap()
        {
            Ok(resp) => break resp,
            Err(TransportError::Overloaded { .. }) => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => panic!("{e}"),
        }
    };
    assert_eq!(again.status, 200);
    drop(again);
    timeout(DEADLINE, responder.finish(DEADLINE)).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_pinned_to_a_dp_rank_reaches_the_engine_with_its_rank_header() {
    // An engine that reports each request's X-data-parallel-rank (`None` without one).
    let (tx, mut ranks) = tokio::sync::mpsc::channel(4);
    let app = axum::Router::new().fallback(move |headers: axum::http::HeaderMap| {
        let tx = tx.clone();
        async move {
            let rank = headers
                .get(DP_RANK_HEADER)
                .map(|v| v.to_str().unwrap().to_owned());
            tx.send(rank).await.unwrap();
            axum::Json(json!({}))
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    let broker = NatsServer::start().await.unwrap();
    let client = nats::connect(&broker.url(), "test").await.unwrap();
    let _responder = responder(&client, &url).await;
    let transport = NatsTransport::new(client.clone(), NatsRequestConfig::default());
    for rank in [Some(3), None] {
        let out = outbound(json!({"model": "m", "prompt": "x"}), false).with_dp_rank(rank);
        let resp = transport.send(out).await.unwrap();
        assert_eq!(resp.status, 200);
        collect(resp.body).await;
        assert_eq!(
            timeout(DEADLINE, ranks.recv()).await.unwrap().unwrap(),
            rank.map(|r| r.to_string())
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_sends_nothing_is_ended_at_the_workers_idle_timeout() {
    let broker = NatsServer::start().await.unwrap();
    let client = nats::connect(&broker.url(), "test").await.unwrap();
    let (url, _held) = silent_engine().await;
    let _responder = bounded_responder(&client, &url, |c| {
        c.idle_timeout = Some(Duration::from_millis(500));
    })
    .await;
    // The server side has no timer of its own.
    let transport = NatsTransport::new(client.clone(), NatsRequestConfig::default());
    let err = timeout(
        DEADLINE,
        transport.send(outbound(json!({"model": "m", "prompt": "hi"}), false)),
    )
    .await
    .expect("the worker ends the request, the server does not hang")
    .unwrap_err();
    assert!(matches!(err, TransportError::Timeout(_)), "{err:?}");
    assert!(err.to_string().contains("--nats-req-idle-timeout"), "{err}");
}

/// A worker record of `WORKER`, as the server's health checks probe it.
fn record() -> infera_core::event::WorkerRecord {
    infera_backends::testing::sample_record(WORKER)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_health_probe_passes_through_a_live_worker_and_fails_on_a_silent_or_absent_one() {
    let broker = NatsServer::start().await.unwrap();
    let client = nats::connect(&broker.url(), "test").await.unwrap();
    let transport = NatsTransport::new(client.clone(), NatsRequestConfig::default());
    // No worker on the subject: no answer, or none within the server's probe timeout.
    let bound = Duration::from_secs(2);
    let absent = timeout(bound, transport.probe(&record())).await;
    assert!(
        !matches!(absent, Ok(Ok(()))),
        "an absent worker is never healthy: {absent:?}"
    );
    // The mock engine's GET /health through the worker.
    let (url, _stop, _engine) = engine(1000.0).await;
    let live = responder(&client, &url).await;
    timeout(DEADLINE, transport.probe(&record()))
        .await
        .expect("answered")
        .expect("a live engine passes");
    live.finish(Duration::from_secs(1)).await;
    // An engine that accepts connections and never answers: no answer within the bound.
    let (silent_url, _held) = silent_engine().await;
    let _wedged = responder(&client, &silent_url).await;
    let wedged = timeout(bound, transport.probe(&record())).await;
    assert!(
        !matches!(wedged, Ok(Ok(()))),
        "a wedged engine fails its probe: {wedged:?}"
    );
}
