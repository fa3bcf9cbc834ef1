//! `--nats-req-max-pending` against a real nats-server with JetStream: the request path through
//! the work-queue stream `INFERA_REQUESTS`, laid out as the Python Infera lays it out, so a
//! Python server can send to our worker and our server to a Python worker. The engine is an
//! in-process HTTP server whose every request the test holds, answers chunk by chunk, or sees
//! cancelled; each wait is on a handle or a condition, never a sleep.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use async_nats::jetstream::{self, consumer, stream};
use bytes::Bytes;
use futures::StreamExt as _;
use infera_backends::nats::jetstream::{
    REQUEST_ACK_WAIT, bind_worker_consumer, ensure_request_stream, request_consumer_info,
};
use infera_backends::nats::{
    self, DRAINING_REFUSAL, HDR_INBOX, HDR_SEQ, HDR_STATUS, HDR_TYPE, NatsRequestConfig,
    NatsResponder, NatsTransport, REQUEST_STREAM, RequestPayload, ResponderConfig, request_durable,
};
use infera_backends::testing::NatsServer;
use infera_core::ids::WorkerId;
use infera_core::ports::transport::{
    BodyStream, Inbound, Outbound, RequestTransport as _, TransportError,
};
use serde_json::{Value, json};
use std::future::Future;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};
use tokio::time::{Instant, timeout};

const WORKER: &str = "127.0.0.1:9";
const DEADLINE: Duration = Duration::from_secs(30);

// ---------------------------------------------------------------------------------------------
// The engine

/// One request the engine received and holds until the test answers it.
struct Arrival {
    path: String,
    body: Value,
    /// Each chunk sent is one piece of the response body; dropping this ends the response.
    chunks: mpsc::UnboundedSender<Bytes>,
    /// Resolves when the response body is dropped: finished, or the client went away.
    gone: oneshot::Receiver<()>,
}

impl Arrival {
    fn send(&self, chunk: &str) {
        self.chunks.send(Bytes::from(chunk.to_owned())).unwrap();
    }

    /// Sends `chunk` and ends the response.
    fn finish(self, chunk: &str) {
        self.send(chunk);
    }
}

/// Fires its sender when dropped.
struct OnDrop(Option<oneshot::Sender<()>>);

impl Drop for OnDrop {
    fn drop(&mut self) {
        if let Some(tx) = self.0.take() {
            let _ = tx.send(());
        }
    }
}

/// An engine on a free loopback port that hands every request to the returned receiver.
async fn engine() -> (String, mpsc::UnboundedReceiver<Arrival>) {
    let (tx, rx) = mpsc::unbounded_channel::<Arrival>();
    let app = axum::Router::new().fallback(move |req: axum::extract::Request| {
        let tx = tx.clone();
        async move {
            let path = req.uri().path().to_owned();
            let bytes = axum::body::to_bytes(req.into_body(), usize::MAX)
                .await
                .unwrap();
            let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
            let (chunks, chunk_rx) = mpsc::unbounded_channel::<Bytes>();
            let (gone_tx, gone) = oneshot::channel();
            let _ = tx.send(Arrival {
                path,
                body,
                chunks,
                gone,
            });
            let stream = futures::stream::unfold(
                (chunk_rx, OnDrop(Some(gone_tx))),
                |(mut rx, guard)| async move {
                    let chunk = rx.recv().await?;
                    Some((Ok::<_, std::io::Error>(chunk), (rx, guard)))
                },
            );
            axum::response::Response::builder()
                .header("content-type", "text/event-stream")
                .body(axum::body::Body::from_stream(stream))
                .unwrap()
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, rx)
}

/// Answers every request at once with `{"ok":true}` (for tests that do not hold any).
fn answer_all(mut arrivals: mpsc::UnboundedReceiver<Arrival>) {
    tokio::spawn(async move {
        while let Some(a) = arrivals.recv().await {
            a.finish(r#"{"ok":true}"#);
        }
    });
}

async fn next_arrival(arrivals: &mut mpsc::UnboundedReceiver<Arrival>) -> Arrival {
    timeout(DEADLINE, arrivals.recv())
        .await
        .expect("a request reaches the engine in time")
        .unwrap()
}

// ---------------------------------------------------------------------------------------------
// Fleet pieces

async fn connect(broker: &NatsServer, name: &str) -> nats::Client {
    nats::connect(&broker.url(), name).await.unwrap()
}

fn worker_config(engine_url: &str, max_pending: Option<u32>) -> ResponderConfig {
    ResponderConfig {
        worker_id: WORKER.to_owned(),
        engine_url: engine_url.to_owned(),
        max_duration: None,
        idle_timeout: None,
        max_pending,
    }
}

async fn worker(client: &nats::Client, engine_url: &str, limit: u32) -> NatsResponder {
    NatsResponder::start(client.clone(), worker_config(engine_url, Some(limit)))
        .await
        .unwrap()
}

/// One server replica with the backlog limit `limit`, on its own connection.
async fn server(broker: &NatsServer, limit: u32) -> NatsTransport {
    let client = connect(broker, "server").await;
    NatsTransport::new(
        client,
        NatsRequestConfig {
            max_pending: Some(limit),
            ..NatsRequestConfig::default()
        },
    )
}

fn stream_request(prompt: &str) -> Outbound {
    Outbound::new(
        WorkerId::new(WORKER),
        "http://unused",
        "/v1/completions",
        Bytes::from(json!({"model": "m", "prompt": prompt, "stream": true}).to_string()),
        true,
        "r-1",
    )
}

fn unary_request(prompt: &str) -> Outbound {
    Outbound::new(
        WorkerId::new(WORKER),
        "http://unused",
        "/v1/completions",
        Bytes::from(json!({"model": "m", "prompt": prompt}).to_string()),
        false,
        "r-1",
    )
}

/// Sends a stream request and answers its first chunk, so the request is in flight at the
/// worker when this returns.
async fn hold(
    transport: &NatsTransport,
    arrivals: &mut mpsc::UnboundedReceiver<Arrival>,
    prompt: &str,
) -> (Inbound, Arrival) {
    let send = transport.send(stream_request(prompt));
    let answer = async {
        let arrival = next_arrival(arrivals).await;
        assert_eq!(arrival.path, "/v1/completions");
        assert_eq!(arrival.body["prompt"], prompt);
        arrival.send("data: {\"n\":0}\n\n");
        arrival
    };
    let (resp, arrival) = tokio::join!(send, answer);
    let resp = resp.unwrap();
    assert_eq!(resp.status, 200);
    (resp, arrival)
}

async fn collect(mut body: BodyStream) -> String {
    let mut out = Vec::new();
    while let Some(chunk) = timeout(DEADLINE, body.next()).await.unwrap() {
        out.extend_from_slice(&chunk.unwrap());
    }
    String::from_utf8(out).unwrap()
}

/// Waits, bounded, until `check` holds; each check is a round trip to the broker.
/// Sends one unary request through `transport` and checks the engine's whole answer came back.
async fn answered(transport: &NatsTransport, prompt: &str) {
    let resp = timeout(DEADLINE, transport.send(unary_request(prompt)))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(resp.status, 200);
    assert_eq!(collect(resp.body).await, r#"{"ok":true}"#);
}

async fn until<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + DEADLINE;
    while !check().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `num_pending + num_ack_pending` of the worker's consumer.
async fn backlog(js: &jetstream::Context) -> u64 {
    let info = request_consumer_info(js, &request_durable(WORKER))
        .await
        .unwrap();
    info.num_pending + info.num_ack_pending as u64
}

async fn stream_messages(js: &jetstream::Context) -> u64 {
    js.get_stream(REQUEST_STREAM)
        .await
        .unwrap()
        .info()
        .await
        .unwrap()
        .state
        .messages
}

/// A JetStream API call made with raw JSON, as another client library sends it.
async fn raw_api(client: &nats::Client, subject: String, body: Value) -> Value {
    let msg = client
        .request(subject, Bytes::from(body.to_string()))
        .await
        .unwrap();
    serde_json::from_slice(&msg.payload).unwrap()
}

fn header(msg: &async_nats::Message, name: &str) -> Option<String> {
    msg.headers
        .as_ref()?
        .get(name)
        .map(|v| v.as_str().to_owned())
}

// ---------------------------------------------------------------------------------------------
// Tests

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stream_and_the_consumer_have_the_python_names_and_config() {
    let broker = NatsServer::start().await.unwrap();
    let client = connect(&broker, "worker").await;
    let (url, _arrivals) = engine().await;
    let responder = worker(&client, &url, 2).await;
    let js = jetstream::new(client.clone());

    let info = js
        .get_stream(REQUEST_STREAM)
        .await
        .unwrap()
        .info()
        .await
        .unwrap()
        .clone();
    assert_eq!(info.config.name, "INFERA_REQUESTS");
    assert_eq!(info.config.subjects, vec!["infera.req.>".to_owned()]);
    assert_eq!(info.config.retention, stream::RetentionPolicy::WorkQueue);
    assert_eq!(info.config.storage, stream::StorageType::Memory);
    assert_eq!(info.config.discard, stream::DiscardPolicy::Old);
    assert_eq!(info.config.max_messages, 1_000_000);

    // The consumer is the Python worker's: durable = the subject token, push, explicit ack,
    // ack_wait 3600 s, no redelivery, only this worker's subject.
    let durable = request_durable(WORKER);
    assert_eq!(durable, "MTI3LjAuMC4xOjk");
    let consumer = request_consumer_info(&js, &durable).await.unwrap();
    let c = &consumer.config;
    assert_eq!(c.durable_name.as_deref(), Some("MTI3LjAuMC4xOjk"));
    assert_eq!(c.filter_subject, "infera.req.MTI3LjAuMC4xOjk");
    assert_eq!(c.ack_policy, consumer::AckPolicy::Explicit);
    assert_eq!(c.ack_wait, Duration::from_secs(3600));
    assert_eq!(REQUEST_ACK_WAIT, Duration::from_secs(3600));
    assert_eq!(c.max_deliver, 1);
    assert_eq!(c.deliver_policy, consumer::DeliverPolicy::All);
    assert!(c.deliver_subject.is_some(), "a push consumer");
    assert!(consumer.push_bound, "the worker is subscribed to it");

    // nats-py's add_stream with the Python Infera's StreamConfig is accepted as the same stream
    // (it would otherwise fall back to update_stream).
    let python = raw_api(
        &client,
        format!("$JS.API.STREAM.CREATE.{REQUEST_STREAM}"),
        json!({
            "name": "INFERA_REQUESTS", "subjects": ["infera.req.>"], "retention": "workqueue",
            "max_msgs": 1_000_000, "discard": "old", "max_msgs_per_subject": -1,
            "max_msg_size": -1, "storage": "memory", "no_ack": false, "duplicate_window": 0,
            "sealed": false, "deny_delete": false, "deny_purge": false,
            "allow_rollup_hdrs": false,
        }),
    )
    .await;
    assert!(python.get("error").is_none(), "{python}");
    // And ours accepts a stream the Python Infera made.
    ensure_request_stream(&js).await.unwrap();

    // A finished worker leaves no consumer behind (a rebuilt Pod never reuses its id).
    responder.finish(DEADLINE).await;
    let err = request_consumer_info(&js, &durable).await.unwrap_err();
    assert!(err.contains("not found"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_backlog_limit_is_one_for_every_server_replica() {
    let broker = NatsServer::start().await.unwrap();
    let worker_client = connect(&broker, "worker").await;
    let (url, mut arrivals) = engine().await;
    let _responder = worker(&worker_client, &url, 2).await;
    let js = jetstream::new(worker_client.clone());
    let a = server(&broker, 2).await;
    let b = server(&broker, 2).await;

    // Replica A puts two requests in flight on the worker.
    let (resp1, held1) = hold(&a, &mut arrivals, "one").await;
    let (_resp2, _held2) = hold(&a, &mut arrivals, "two").await;
    assert_eq!(backlog(&js).await, 2);

    // Replica B, on another connection, sees the same backlog: refused before publishing.
    let err = b.send(stream_request("three")).await.unwrap_err();
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
    assert_eq!(err.status(), 429);
    assert!(err.retry_elsewhere(), "the relay tries another worker");
    assert!(err.to_string().contains("--nats-req-max-pending"), "{err}");
    assert!(arrivals.try_recv().is_err(), "nothing reached the engine");
    assert_eq!(stream_messages(&js).await, 2, "nothing was queued");

    // One request ends: the worker acks it and both replicas admit again.
    held1.finish("data: [DONE]\n\n");
    assert!(collect(resp1.body).await.ends_with("data: [DONE]\n\n"));
    until("the finished request to be acked", || async {
        backlog(&js).await == 1
    })
    .await;
    for (replica, prompt) in [(&b, "four"), (&a, "five")] {
        let send = async {
            loop {
                // A refusal read within the last 200 ms may be reused once more.
                match replica.send(unary_request(prompt)).await {
                    Ok(resp) => break resp,
                    Err(TransportError::Overloaded { .. }) => {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    Err(e) => panic!("{e}"),
                }
            }
        };
        let answer = async {
            let arrival = next_arrival(&mut arrivals).await;
            assert_eq!(arrival.body["prompt"], prompt);
            arrival.finish(r#"{"ok":true}"#);
        };
        let (resp, ()) = tokio::join!(send, answer);
        assert_eq!(resp.status, 200);
        assert_eq!(collect(resp.body).await, r#"{"ok":true}"#);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_style_request_is_answered_on_its_inbox_and_acked() {
    let broker = NatsServer::start().await.unwrap();
    let worker_client = connect(&broker, "worker").await;
    let (url, arrivals) = engine().await;
    answer_all(arrivals);
    let _responder = worker(&worker_client, &url, 4).await;

    // The Python server: a JetStream publish with the inbox in rs-inbox and its payload shape.
    let python = connect(&broker, "python-server").await;
    let js = jetstream::new(python.clone());
    let inbox = python.new_inbox();
    let mut replies = python.subscribe(inbox.clone()).await.unwrap();
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(HDR_INBOX, inbox.as_str());
    let payload = json!({"path": "/v1/chat/completions", "stream": false, "headers": null,
        "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}});
    let ack = js
        .publish_with_headers(
            nats::request_subject(WORKER),
            headers,
            Bytes::from(payload.to_string()),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    assert_eq!(ack.stream, REQUEST_STREAM);

    let data = timeout(DEADLINE, replies.next()).await.unwrap().unwrap();
    assert_eq!(header(&data, HDR_TYPE).as_deref(), Some("data"));
    assert_eq!(header(&data, HDR_SEQ).as_deref(), Some("0"));
    assert_eq!(&data.payload[..], br#"{"ok":true}"#);
    let done = timeout(DEADLINE, replies.next()).await.unwrap().unwrap();
    assert_eq!(header(&done, HDR_TYPE).as_deref(), Some("done"));
    assert_eq!(header(&done, HDR_STATUS).as_deref(), Some("200"));
    assert_eq!(header(&done, HDR_SEQ).as_deref(), Some("1"));

    // Acked: the work queue let go of it.
    until("the request to leave the work queue", || async {
        stream_messages(&js).await == 0
    })
    .await;
    assert_eq!(backlog(&js).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn our_server_sends_to_a_python_worker_and_reads_its_backlog() {
    let broker = NatsServer::start().await.unwrap();
    // The Python worker: _ensure_request_stream, then js.subscribe(subject, durable=token,
    // manual_ack=True, config=ConsumerConfig(ack_policy=EXPLICIT, ack_wait=3600,
    // max_deliver=1)), which creates a push consumer on a fresh inbox.
    let python = connect(&broker, "python-worker").await;
    let js = jetstream::new(python.clone());
    ensure_request_stream(&js).await.unwrap();
    let deliver = python.new_inbox();
    let mut delivered = python.subscribe(deliver.clone()).await.unwrap();
    let durable = request_durable(WORKER);
    let created = raw_api(
        &python,
        format!("$JS.API.CONSUMER.CREATE.{REQUEST_STREAM}.{durable}"),
        json!({"stream_name": REQUEST_STREAM, "config": {
            "durable_name": durable, "deliver_subject": deliver, "deliver_policy": "all",
            "ack_policy": "explicit", "ack_wait": 3_600_000_000_000u64, "max_deliver": 1,
            "filter_subject": nats::request_subject(WORKER), "replay_policy": "instant",
            "flow_control": false,
        }}),
    )
    .await;
    assert!(created.get("error").is_none(), "{created}");

    let transport = server(&broker, 1).await;
    let send = tokio::spawn(async move {
        let resp = transport.send(unary_request("to python")).await;
        (transport, resp)
    });
    let msg = timeout(DEADLINE, delivered.next()).await.unwrap().unwrap();
    let inbox = header(&msg, HDR_INBOX).expect("the inbox travels in rs-inbox");
    let ack_subject = msg.reply.clone().unwrap().to_string();
    assert!(
        ack_subject.starts_with(&format!("$JS.ACK.{REQUEST_STREAM}.{durable}.")),
        "{ack_subject}"
    );
    let request = RequestPayload::parse(&msg.payload).unwrap();
    assert_eq!(request.path, "/v1/completions");
    assert_eq!(request.body["prompt"], "to python");
    // The Python worker's replies: no rs-seq.
    let reply = |kind: &'static str, status: Option<&'static str>, body: &'static str| {
        let mut h = async_nats::HeaderMap::new();
        h.insert(HDR_TYPE, kind);
        if let Some(s) = status {
            h.insert(HDR_STATUS, s);
        }
        python.publish_with_headers(inbox.clone(), h, Bytes::from_static(body.as_bytes()))
    };
    // In flight and not acked: the one-request limit is reached for every replica.
    let other = server(&broker, 1).await;
    let err = other.send(unary_request("refused")).await.unwrap_err();
    assert!(matches!(err, TransportError::Overloaded { .. }), "{err:?}");

    reply("data", None, r#"{"from":"python"}"#).await.unwrap();
    reply("done", Some("200"), "").await.unwrap();
    python
        .publish(ack_subject, Bytes::from_static(b""))
        .await
        .unwrap();
    let (transport, resp) = send.await.unwrap();
    let resp = resp.unwrap();
    assert_eq!(resp.status, 200);
    assert_eq!(collect(resp.body).await, r#"{"from":"python"}"#);
    until("the Python worker's ack to empty the backlog", || async {
        backlog(&js).await == 0
    })
    .await;

    // A Python worker that stopped (unsubscribed, its consumer not yet deleted) would leave a
    // request queued for nobody: ours fails over instead.
    drop(delivered);
    python.flush().await.unwrap();
    until("the consumer to be unbound", || async {
        !request_consumer_info(&js, &durable)
            .await
            .unwrap()
            .push_bound
    })
    .await;
    let fresh = server(&broker, 1).await;
    let err = timeout(DEADLINE, fresh.send(unary_request("nobody")))
        .await
        .expect("refused at once, not queued for nobody")
        .unwrap_err();
    assert!(matches!(err, TransportError::Unreachable(_)), "{err:?}");
    assert!(err.retry_elsewhere());
    drop(transport);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_reply_cancels_the_engine_request_and_frees_the_backlog() {
    let broker = NatsServer::start().await.unwrap();
    let worker_client = connect(&broker, "worker").await;
    let (url, mut arrivals) = engine().await;
    let responder = worker(&worker_client, &url, 1).await;
    let js = jetstream::new(worker_client.clone());
    let transport = server(&broker, 1).await;
    let mut cancels = worker_client
        .subscribe(nats::cancel_subject(WORKER))
        .await
        .unwrap();

    let (resp, arrival) = hold(&transport, &mut arrivals, "long").await;
    assert_eq!(backlog(&js).await, 1);
    drop(resp); // the client went away
    let cancel = timeout(DEADLINE, cancels.next()).await.unwrap().unwrap();
    assert!(cancel.payload.starts_with(b"_INBOX."), "{cancel:?}");
    // The worker dropped the engine connection, so the engine stops generating.
    timeout(DEADLINE, arrival.gone)
        .await
        .expect("the engine request is cancelled")
        .unwrap();
    // And acked the request: the worker is free again for every replica.
    until("the cancelled request to be acked", || async {
        backlog(&js).await == 0 && stream_messages(&js).await == 0
    })
    .await;
    let fresh = server(&broker, 1).await;
    let send = fresh.send(unary_request("after"));
    let answer = async {
        let a = next_arrival(&mut arrivals).await;
        a.finish(r#"{"ok":1}"#);
    };
    let (resp, ()) = tokio::join!(send, answer);
    assert_eq!(resp.unwrap().status, 200);
    timeout(DEADLINE, responder.finish(DEADLINE)).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_workers_own_timeouts_end_the_request_and_ack_it() {
    let broker = NatsServer::start().await.unwrap();
    let worker_client = connect(&broker, "worker").await;
    let (url, mut arrivals) = engine().await;
    let mut config = worker_config(&url, Some(1));
    config.max_duration = Some(Duration::from_millis(500));
    let _responder = NatsResponder::start(worker_client.clone(), config)
        .await
        .unwrap();
    let js = jetstream::new(worker_client.clone());
    let transport = server(&broker, 1).await;

    // The engine takes the request and never answers.
    let send = transport.send(unary_request("stuck"));
    let (result, arrival) = tokio::join!(send, next_arrival(&mut arrivals));
    let err = result.unwrap_err();
    assert!(matches!(err, TransportError::Timeout(_)), "{err:?}");
    assert!(err.to_string().contains("--nats-req-max-duration"), "{err}");
    timeout(DEADLINE, arrival.gone).await.unwrap().unwrap();
    until("the timed-out request to be acked", || async {
        backlog(&js).await == 0
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_worker_serves_what_it_has_and_refuses_the_rest_which_fails_over() {
    let broker = NatsServer::start().await.unwrap();
    let worker_client = connect(&broker, "worker").await;
    let (url, mut arrivals) = engine().await;
    let responder = worker(&worker_client, &url, 4).await;
    let js = jetstream::new(worker_client.clone());
    let transport = server(&broker, 4).await;
    let (resp, held) = hold(&transport, &mut arrivals, "in flight").await;

    responder.stop_accepting().await;
    // A request that reaches the draining worker is answered at once, never started, and the
    // relay tries another worker.
    let err = timeout(DEADLINE, transport.send(unary_request("late")))
        .await
        .unwrap()
        .unwrap_err();
    assert!(matches!(err, TransportError::Unreachable(_)), "{err:?}");
    assert!(err.to_string().contains("draining"), "{err}");
    assert!(DRAINING_REFUSAL.starts_with("infera: worker draining"));
    assert!(arrivals.try_recv().is_err(), "nothing reached the engine");
    until("the refusal to be acked", || async {
        stream_messages(&js).await == 1
    })
    .await;

    // The request in flight finishes normally.
    held.send("data: {\"n\":1}\n\n");
    held.finish("data: [DONE]\n\n");
    let text = collect(resp.body).await;
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    timeout(DEADLINE, responder.finish(DEADLINE)).await.unwrap();
    until("every request to be acked", || async {
        stream_messages(&js).await == 0
    })
    .await;
    assert!(
        request_consumer_info(&js, &request_durable(WORKER))
            .await
            .is_err(),
        "the consumer is deleted"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_go_on_after_a_broker_restart_and_wait_for_a_broker_that_is_away() {
    let mut broker = NatsServer::start().await.unwrap();
    let worker_client = connect(&broker, "worker").await;
    let (url, arrivals) = engine().await;
    answer_all(arrivals);
    let _responder = worker(&worker_client, &url, 8).await;
    let transport = server(&broker, 8).await;
    let resp = transport.send(unary_request("before")).await.unwrap();
    assert_eq!(resp.status, 200);

    // The restart loses the memory stream and the consumer: both sides make them again.
    broker.restart().await.unwrap();
    answered(&transport, "after").await;

    // A request sent while the broker is down waits for it.
    broker.stop();
    let waiting = tokio::spawn(async move {
        let resp = transport.send(unary_request("while away")).await;
        (transport, resp)
    });
    broker.restart().await.unwrap();
    let (_transport, resp) = timeout(DEADLINE, waiting).await.unwrap().unwrap();
    let resp = resp.unwrap();
    assert_eq!(resp.status, 200);
    assert_eq!(collect(resp.body).await, r#"{"ok":true}"#);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn core_nats_keeps_working_beside_a_leftover_request_stream() {
    let broker = NatsServer::start().await.unwrap();
    let client = connect(&broker, "fleet").await;
    // JetStream mode ran here before: its stream captures every core request too (and acks it
    // to the reply inbox).
    ensure_request_stream(&jetstream::new(client.clone()))
        .await
        .unwrap();
    let (url, arrivals) = engine().await;
    answer_all(arrivals);
    let _responder = NatsResponder::start(client.clone(), worker_config(&url, None))
        .await
        .unwrap();
    let transport = NatsTransport::new(client.clone(), NatsRequestConfig::default());
    for _ in 0..3 {
        answered(&transport, "core").await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_without_the_limit_still_answers_a_server_with_it() {
    // Fail-open: no consumer to read, and the JetStream publish reaches the core subscriber,
    // which answers on rs-inbox (as the Python worker does).
    let broker = NatsServer::start().await.unwrap();
    let worker_client = connect(&broker, "worker").await;
    let (url, arrivals) = engine().await;
    answer_all(arrivals);
    let _responder = NatsResponder::start(worker_client.clone(), worker_config(&url, None))
        .await
        .unwrap();
    let transport = server(&broker, 1).await;
    for _ in 0..3 {
        answered(&transport, "mixed").await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stand_in_worker_bound_with_the_helper_holds_the_backlog() {
    // What a test's fake worker does to take part in JetStream mode.
    let broker = NatsServer::start().await.unwrap();
    let fake = connect(&broker, "fake").await;
    let deliver = fake.new_inbox();
    let mut requests = fake.subscribe(deliver.clone()).await.unwrap();
    fake.flush().await.unwrap();
    bind_worker_consumer(&fake, WORKER, &deliver).await.unwrap();
    let transport = server(&broker, 1).await;
    let send = tokio::spawn(async move {
        let resp = transport.send(unary_request("held")).await;
        (transport, resp)
    });
    let msg = timeout(DEADLINE, requests.next()).await.unwrap().unwrap();
    let inbox = header(&msg, HDR_INBOX).unwrap();
    let refused = server(&broker, 1).await;
    let err = refused.send(unary_request("one more")).await.unwrap_err();
    assert!(matches!(err, TransportError::Overloaded { .. }), "{err:?}");
    for (seq, kind, status, body) in [(0, "data", None, "{}"), (1, "done", Some("200"), "")] {
        let mut h = async_nats::HeaderMap::new();
        h.insert(HDR_TYPE, kind);
        h.insert(HDR_SEQ, seq.to_string().as_str());
        if let Some(s) = status {
            h.insert(HDR_STATUS, s);
        }
        fake.publish_with_headers(inbox.clone(), h, Bytes::from_static(body.as_bytes()))
            .await
            .unwrap();
    }
    let (_transport, resp) = send.await.unwrap();
    assert_eq!(resp.unwrap().status, 200);
}
