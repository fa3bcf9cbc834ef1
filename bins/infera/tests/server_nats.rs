//! `infera server` and `infera worker mock` on their default transports (NATS requests, NATS KV
//! events) with a real etcd and a real nats-server from the backends harness.
//!
//! Faults a real worker cannot be made to produce (a stall, a lost reply chunk, a held request)
//! come from a fake worker inside the test: a record registered in etcd and a NATS subscription
//! on its request subject that the test answers by hand.
#![allow(clippy::unwrap_used)]

mod common;

use common::{Proc, eventually, free_mock_port, free_port, get_json, http, metric, tokenizer_dir};

use futures::StreamExt as _;
use infera_backends::discovery::{EtcdConfig, EtcdDiscovery, Registrar as _, Registration};
use infera_backends::nats::kv::{HDR_KV_EPOCH, HDR_KV_SEQ, kv_subject};
use infera_backends::nats::{self, HDR_SEQ, HDR_STATUS, HDR_TYPE, RequestPayload};
use infera_backends::testing::{EtcdServer, NatsServer, sample_record};
use infera_core::event::RequestTransport;
use infera_core::kv_events::encode_batch_vllm;
use serde_json::{Value, json};
use std::io::Read as _;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// `infera worker mock` with default transports, 1000 times faster than real.
fn mock_worker(tok: &str, etcd: &str, nats: &str, port: u16) -> Proc {
    mock_worker_at(tok, etcd, nats, port, &["--speedup", "1000"])
}

/// `infera worker mock` with default transports and `extra` flags (e.g. `--speedup`).
fn mock_worker_at(tok: &str, etcd: &str, nats: &str, port: u16, extra: &[&str]) -> Proc {
    Proc(
        Command::new(env!("CARGO_BIN_EXE_infera"))
            .args(["worker", "mock", "--model-path", tok, "--host", "127.0.0.1"])
            .args(["--port", &port.to_string(), "--block-size", "16"])
            .args(["--discovery-backend", "etcd", "--etcd-endpoint", etcd])
            .args(["--nats-server", nats])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    )
}

/// `infera server` with default transports and `extra` flags.
fn server(tok: &str, etcd: &str, nats: &str, port: u16, extra: &[&str]) -> Proc {
    Proc(
        Command::new(env!("CARGO_BIN_EXE_infera"))
            .args(["server", "--router-tokenizer-path", tok])
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["--discovery-backend", "etcd", "--etcd-endpoint", etcd])
            .args(["--nats-server", nats])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    )
}

fn long_prompt(tag: &str) -> String {
    let mut prompt = format!("{tag}:");
    for i in 0..300 {
        prompt.push_str(&format!(" word{}", i % 89));
    }
    prompt
}

/// Cached blocks per worker port, from the server's `/v1/workers`.
fn cached_blocks(server_port: u16) -> Vec<(String, u64)> {
    let workers = get_json(server_port, "/v1/workers").unwrap();
    workers["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| {
            (
                w["record"]["worker_id"].as_str().unwrap().to_owned(),
                w["load"][0]["cached_blocks"].as_u64().unwrap_or(0),
            )
        })
        .collect()
}

async fn post(port: u16, body: Value) -> (u16, String) {
    tokio::task::spawn_blocking(move || {
        http(port, "POST", "/v1/completions", &body.to_string()).unwrap()
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn default_transports_route_unary_and_streams_with_kv_affinity_over_nats() {
    let etcd = EtcdServer::start().await.expect("etcd starts");
    let nats = NatsServer::start().await.expect("nats-server starts");
    let tok = tokenizer_dir();
    let tok = tok.as_str();
    let ports: Vec<u16> = (0..3).map(|_| free_mock_port()).collect();
    let _workers: Vec<Proc> = ports
        .iter()
        .map(|p| mock_worker(tok, &etcd.endpoint(), &nats.url(), *p))
        .collect();
    let server_port = free_port();
    let _server = server(tok, &etcd.endpoint(), &nats.url(), server_port, &[]);
    eventually("three workers to be discovered", || {
        get_json(server_port, "/health").is_some_and(|h| h["active_workers"] == 3)
    });
    let workers = get_json(server_port, "/v1/workers").unwrap();
    for w in workers["data"].as_array().unwrap() {
        assert_eq!(w["record"]["request_transport"], "nats", "{w}");
        assert!(w["record"]["kv_events_endpoint"].is_null(), "{w}");
    }

    // Unary over NATS.
    let req = json!({"model": tok, "prompt": long_prompt("affinity"), "max_tokens": 2});
    let (status, body) = post(server_port, req.clone()).await;
    assert_eq!(status, 200, "{body}");
    let first: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(first["usage"]["completion_tokens"], 2, "{first}");

    // Its KV events reach the server over NATS: one worker holds the prompt's blocks.
    eventually("the serving worker's blocks in the index", || {
        cached_blocks(server_port).iter().any(|(_, n)| *n > 10)
    });
    let holder = cached_blocks(server_port)
        .into_iter()
        .find(|(_, n)| *n > 10)
        .unwrap()
        .0;

    // The same prompt goes back to that worker and hits its cache.
    let (status, body) = post(server_port, req).await;
    assert_eq!(status, 200, "{body}");
    let again: Value = serde_json::from_str(&body).unwrap();
    assert!(
        again["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64() > Some(0),
        "{again}"
    );
    let holders: Vec<String> = cached_blocks(server_port)
        .into_iter()
        .filter(|(_, n)| *n > 0)
        .map(|(w, _)| w)
        .collect();
    assert_eq!(
        holders,
        vec![holder],
        "only the first worker caches the prompt"
    );

    // A stream over NATS: SSE chunks in order, ending with [DONE], no error.
    let stream_req = json!({"model": tok, "prompt": "stream me", "max_tokens": 20,
        "stream": true});
    let (status, body) = post(server_port, stream_req).await;
    assert_eq!(status, 200, "{body}");
    let events: Vec<&str> = body
        .split("\n\n")
        .filter(|e| e.contains("data: "))
        .collect();
    assert!(events.len() >= 20, "{body}");
    assert!(events.last().unwrap().contains("data: [DONE]"), "{body}");
    assert!(!body.contains("\"error\""), "{body}");
    assert_eq!(
        metric(server_port, "infera_transport_sequence_errors_total").unwrap_or(0),
        0
    );
}

/// A fake worker: registered in etcd with `request_transport: nats`, answered by the test.
struct FakeWorker {
    registration: Registration,
    client: nats::Client,
    requests: nats::Subscriber,
    cancels: nats::Subscriber,
}

/// One request the fake received.
struct Received {
    reply: String,
    payload: RequestPayload,
}

impl FakeWorker {
    /// `jetstream`: take requests from a durable consumer on the `INFERA_REQUESTS` work queue, as a
    /// worker with `--nats-req-max-pending` does (never acked: each one stays in its backlog).
    async fn start(etcd: &EtcdServer, nats_url: &str, model: &str, jetstream: bool) -> Self {
        let id = format!("127.0.0.1:{}", free_port());
        let client = nats::connect(nats_url, "fake-worker").await.unwrap();
        let requests = if jetstream {
            let deliver = client.new_inbox();
            let sub = client.subscribe(deliver.clone()).await.unwrap();
            client.flush().await.unwrap();
            nats::jetstream::bind_worker_consumer(&client, &id, &deliver)
                .await
                .unwrap();
            sub
        } else {
            client.subscribe(nats::request_subject(&id)).await.unwrap()
        };
        let cancels = client.subscribe(nats::cancel_subject(&id)).await.unwrap();
        client.flush().await.unwrap();
        let mut record = sample_record(&id);
        record.model_name = model.to_owned();
        record.kv_events_endpoint = None;
        record.request_transport = RequestTransport::Nats;
        let discovery = EtcdDiscovery::connect(EtcdConfig::new([etcd.endpoint()]))
            .await
            .unwrap();
        let registration = discovery.register(&record).await.unwrap();
        Self {
            registration,
            client,
            requests,
            cancels,
        }
    }

    fn id(&self) -> String {
        self.registration.worker().as_str().to_owned()
    }

    async fn next_request(&mut self) -> Received {
        let msg = tokio::time::timeout(common::DEADLINE, self.requests.next())
            .await
            .expect("a request in time")
            .unwrap();
        // JetStream mode carries the inbox in rs-inbox (the reply subject acks the message).
        let inbox = msg
            .headers
            .as_ref()
            .and_then(|h| h.get(nats::HDR_INBOX))
            .map(|v| v.as_str().to_owned());
        Received {
            reply: inbox.unwrap_or_else(|| msg.reply.unwrap().to_string()),
            payload: RequestPayload::parse(&msg.payload).unwrap(),
        }
    }

    async fn next_cancel(&mut self) -> String {
        let msg = tokio::time::timeout(common::DEADLINE, self.cancels.next())
            .await
            .expect("a cancel in time")
            .unwrap();
        String::from_utf8(msg.payload.to_vec()).unwrap()
    }

    async fn reply(&self, to: &str, seq: u64, kind: &str, status: Option<u16>, payload: &str) {
        let mut headers = nats::HeaderMap::new();
        headers.insert(HDR_TYPE, kind);
        headers.insert(HDR_SEQ, seq.to_string().as_str());
        if let Some(s) = status {
            headers.insert(HDR_STATUS, s.to_string().as_str());
        }
        self.client
            .publish_with_headers(to.to_owned(), headers, payload.to_owned().into())
            .await
            .unwrap();
        self.client.flush().await.unwrap();
    }
}

/// A server and a fake worker behind it, routed to directly by the fake's id.
async fn fake_setup(extra: &[&str]) -> (EtcdServer, NatsServer, Proc, u16, FakeWorker, String) {
    let etcd = EtcdServer::start().await.expect("etcd starts");
    let nats = NatsServer::start().await.expect("nats-server starts");
    let tok = tokenizer_dir();
    let jetstream = extra.contains(&"--nats-req-max-pending");
    let fake = FakeWorker::start(&etcd, &nats.url(), &tok, jetstream).await;
    let server_port = free_port();
    let server = server(&tok, &etcd.endpoint(), &nats.url(), server_port, extra);
    eventually("the fake worker to be discovered", || {
        get_json(server_port, "/health").is_some_and(|h| h["active_workers"] == 1)
    });
    (etcd, nats, server, server_port, fake, tok)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_worker_is_answered_504_after_the_idle_timeout_and_cancelled() {
    let (_etcd, _nats, _server, port, mut fake, tok) = fake_setup(&[
        "--nats-req-idle-timeout",
        "1s",
        "--request-max-retries",
        "0",
    ])
    .await;
    let started = Instant::now();
    let client = tokio::spawn(post(
        port,
        json!({"model": tok, "prompt": "stall", "max_tokens": 2}),
    ));
    let got = fake.next_request().await;
    assert_eq!(got.payload.path, "/v1/completions");
    assert!(!got.payload.stream);
    assert_eq!(got.payload.body["prompt"], "stall");
    // The fake never answers.
    let (status, body) = client.await.unwrap();
    assert_eq!(status, 504, "{body}");
    assert!(body.contains("--nats-req-idle-timeout"), "{body}");
    let waited = started.elapsed();
    assert!(waited >= Duration::from_secs(1), "{waited:?}");
    assert_eq!(fake.next_cancel().await, got.reply);
    assert_eq!(
        metric(port, "infera_transport_timeouts_total").unwrap_or(0),
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_past_the_max_duration_ends_with_a_504_event_and_a_cancel() {
    let (_etcd, _nats, _server, port, mut fake, tok) = fake_setup(&[
        "--nats-req-idle-timeout",
        "0",
        "--nats-req-max-duration",
        "2s",
    ])
    .await;
    let client = tokio::spawn(post(
        port,
        json!({"model": tok, "prompt": "forever", "max_tokens": 2, "stream": true}),
    ));
    let got = fake.next_request().await;
    assert!(got.payload.stream);
    // The fake streams a chunk every 100 ms, for ever, until it sees the cancel.
    let mut seq = 0;
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    let cancelled = loop {
        tokio::select! {
            _ = tick.tick() => {
                let chunk = format!("data: {{\"n\":{seq}}}\n\n");
                fake.reply(&got.reply, seq, "data", None, &chunk).await;
                seq += 1;
            }
            inbox = fake.next_cancel() => break inbox,
        }
    };
    assert_eq!(cancelled, got.reply);
    let (status, body) = client.await.unwrap();
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("data: {\"n\":0}"), "{body}");
    let error_at = body.find("data: {\"error\"").expect("an error event");
    assert!(body[error_at..].contains("\"code\":504"), "{body}");
    assert!(body.contains("--nats-req-max-duration"), "{body}");
    assert!(body[error_at..].contains("data: [DONE]"), "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_reply_chunk_ends_the_stream_with_an_error_never_a_corrupt_one() {
    let (_etcd, _nats, _server, port, mut fake, tok) = fake_setup(&[]).await;
    let client = tokio::spawn(post(
        port,
        json!({"model": tok, "prompt": "gap", "max_tokens": 2, "stream": true}),
    ));
    let got = fake.next_request().await;
    fake.reply(
        &got.reply,
        0,
        "data",
        None,
        "data: {\"part\":\"first\"}\n\n",
    )
    .await;
    // Reply 1 is "lost": 2 arrives next.
    fake.reply(
        &got.reply,
        2,
        "data",
        None,
        "data: {\"part\":\"third\"}\n\n",
    )
    .await;
    fake.reply(&got.reply, 3, "done", Some(200), "").await;
    let (status, body) = client.await.unwrap();
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("\"first\""), "{body}");
    assert!(!body.contains("\"third\""), "{body}");
    let error_at = body.find("data: {\"error\"").expect("an error event");
    assert!(body[error_at..].contains("lost or reordered"), "{body}");
    let done_at = body.find("data: [DONE]").expect("[DONE] ends the stream");
    assert!(error_at < done_at, "{body}");
    assert!(!body[done_at + 12..].contains("data:"), "{body}");
    assert_eq!(fake.next_cancel().await, got.reply);
    assert_eq!(
        metric(port, "infera_transport_sequence_errors_total").unwrap_or(0),
        1
    );

    // A reordered unary reply is a 502, not a spliced body.
    let client = tokio::spawn(post(
        port,
        json!({"model": tok, "prompt": "order", "max_tokens": 2}),
    ));
    let got = fake.next_request().await;
    fake.reply(&got.reply, 1, "data", None, "{\"tail\":1}")
        .await;
    fake.reply(&got.reply, 0, "data", None, "{\"head\":0}")
        .await;
    let (status, body) = client.await.unwrap();
    assert_eq!(status, 502, "{body}");
    assert!(body.contains("lost or reordered"), "{body}");

    // A malformed reply header and an error reply are errors too, never panics.
    let client = tokio::spawn(post(
        port,
        json!({"model": tok, "prompt": "error", "max_tokens": 2}),
    ));
    let got = fake.next_request().await;
    fake.reply(&got.reply, 0, "error", None, "engine exploded")
        .await;
    let (status, body) = client.await.unwrap();
    assert_eq!(status, 502, "{body}");
    assert!(body.contains("engine exploded"), "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_at_its_pending_limit_is_answered_429_or_failed_over() {
    let (etcd, nats, _server, port, mut fake, tok) = fake_setup(&[
        "--nats-req-max-pending",
        "1",
        "--request-max-retries",
        "1",
        "--router-policy",
        "round-robin",
    ])
    .await;
    // The fake holds one request.
    let held = tokio::spawn(post(
        port,
        json!({"model": tok, "prompt": "held", "max_tokens": 2}),
    ));
    let got = fake.next_request().await;
    // The server reuses a backlog reading for BACKLOG_TTL (the Python Infera's 0.2 s cache); the
    // one it took before sending the held request said 0.
    tokio::time::sleep(nats::jetstream::BACKLOG_TTL).await;
    // Alone, the fake is full (its JetStream backlog holds the unacked request): 429 with
    // Retry-After.
    let body = json!({"model": tok, "prompt": "refused", "max_tokens": 2}).to_string();
    let (status, text) = tokio::task::spawn_blocking(move || {
        common::http_with_headers(port, "POST", "/v1/completions", &[], &body).unwrap()
    })
    .await
    .unwrap();
    assert_eq!(status, 429, "{text}");
    assert!(
        text.to_ascii_lowercase().contains("retry-after: 1"),
        "{text}"
    );

    // With a real worker beside it, the refused attempt is retried there.
    let worker_port = free_mock_port();
    let _worker = mock_worker(&tok, &etcd.endpoint(), &nats.url(), worker_port);
    eventually("the mock worker to be discovered", || {
        get_json(port, "/health").is_some_and(|h| h["active_workers"] == 2)
    });
    let rejected = metric(port, "infera_transport_rejected_total").unwrap_or(0);
    for i in 0..2 {
        let (status, body) = post(
            port,
            json!({"model": tok, "prompt": format!("spill {i}"), "max_tokens": 2}),
        )
        .await;
        assert_eq!(status, 200, "{body}");
    }
    // Round-robin sent one of the two to the full fake first.
    assert_eq!(
        metric(port, "infera_transport_rejected_total").unwrap_or(0),
        rejected + 1
    );
    assert!(metric(port, "infera_router_retries_total").unwrap_or(0) >= 1);

    // The held request completes when the fake answers.
    fake.reply(&got.reply, 0, "data", None, "{\"ok\":true}")
        .await;
    fake.reply(&got.reply, 1, "done", Some(200), "").await;
    let (status, body) = held.await.unwrap();
    assert_eq!((status, body.as_str()), (200, "{\"ok\":true}"));
    assert!(!fake.id().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routing_resumes_after_a_nats_server_restart() {
    let etcd = EtcdServer::start().await.expect("etcd starts");
    let mut nats = NatsServer::start().await.expect("nats-server starts");
    let tok = tokenizer_dir();
    let tok = tok.as_str();
    let ports = [free_mock_port(), free_mock_port()];
    let _workers: Vec<Proc> = ports
        .iter()
        .map(|p| mock_worker(tok, &etcd.endpoint(), &nats.url(), *p))
        .collect();
    let server_port = free_port();
    let _server = server(
        tok,
        &etcd.endpoint(),
        &nats.url(),
        server_port,
        &["--nats-req-idle-timeout", "5s"],
    );
    eventually("both workers to be discovered", || {
        get_json(server_port, "/health").is_some_and(|h| h["active_workers"] == 2)
    });
    let req = |i: usize| json!({"model": tok, "prompt": format!("restart {i}"), "max_tokens": 2});
    let (status, body) = post(server_port, req(0)).await;
    assert_eq!(status, 200, "{body}");

    nats.restart().await.expect("nats-server restarts");
    // Both sides reconnect on their own (client backoff up to 4 s) and resubscribe.
    let deadline = Instant::now() + common::DEADLINE;
    loop {
        let (status, _) = post(server_port, req(1)).await;
        if status == 200 {
            break;
        }
        assert!(Instant::now() < deadline, "routing never resumed");
    }
    for i in 2..8 {
        let (status, body) = post(server_port, req(i)).await;
        assert_eq!(status, 200, "{body}");
    }
    // A request that arrives while the broker is down waits for it and is not lost.
    nats.stop();
    let picks = metric(server_port, "infera_router_picks_total").unwrap_or(0);
    let waiting = tokio::spawn(post(server_port, req(100)));
    eventually(
        "the request to be routed (and held by the transport)",
        || metric(server_port, "infera_router_picks_total").unwrap_or(0) > picks,
    );
    nats.restart().await.expect("nats-server starts again");
    let (status, body) = waiting.await.unwrap();
    assert_eq!(status, 200, "{body}");

    // KV events flow again too: a new prompt's blocks reach the index.
    let before: u64 = cached_blocks(server_port).iter().map(|(_, n)| n).sum();
    let (status, body) = post(
        server_port,
        json!({"model": tok, "prompt": long_prompt("after restart"), "max_tokens": 2}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    eventually("new blocks after the restart", || {
        cached_blocks(server_port)
            .iter()
            .map(|(_, n)| n)
            .sum::<u64>()
            > before + 10
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_disconnects_cancels_the_worker_request() {
    let (_etcd, _nats, _server, port, mut fake, tok) = fake_setup(&[]).await;
    let body = json!({"model": tok, "prompt": "bye", "max_tokens": 2, "stream": true}).to_string();
    let client = tokio::task::spawn_blocking(move || {
        let _open = common::open_stream(port, &body);
        // Dropping the socket is the client going away.
    });
    let got = fake.next_request().await;
    fake.reply(&got.reply, 0, "data", None, "data: {\"n\":0}\n\n")
        .await;
    client.await.unwrap();
    assert_eq!(fake.next_cancel().await, got.reply);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_kv_event_batch_clears_the_rank_and_later_batches_rebuild_it() {
    let (_etcd, _nats, _server, port, fake, _tok) = fake_setup(&[]).await;
    let stored =
        |first, blocks| bytes::Bytes::from(encode_batch_vllm(&common::stored(first, blocks)));
    let publish = async |seq: u64, payload| {
        let mut headers = nats::HeaderMap::new();
        headers.insert(HDR_KV_SEQ, seq.to_string().as_str());
        headers.insert(HDR_KV_EPOCH, "7");
        fake.client
            .publish_with_headers(kv_subject(&fake.id(), 0), headers, payload)
            .await
            .unwrap();
    };
    // The server subscribes to a worker's subject once it has discovered it, and a message
    // published before then reaches no one (core NATS), so the first batch is sent until it
    // lands. A copy after one that landed reads as a restart: the rank is cleared and gets the
    // same three blocks again.
    let deadline = Instant::now() + common::DEADLINE;
    while cached_blocks(port)[0].1 != 3 {
        assert!(
            Instant::now() < deadline,
            "timed out waiting for three blocks indexed"
        );
        publish(0, stored(100, 3)).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Batch 1 is lost; batch 2 reveals the gap, so the rank is cleared and rebuilt from it.
    publish(2, stored(200, 1)).await;
    eventually("the rank rebuilt from the batch after the gap", || {
        cached_blocks(port)[0].1 == 1
    });
    assert_eq!(metric(port, "infera_kv_event_gaps_total").unwrap_or(0), 1);
    publish(3, stored(300, 2)).await;
    eventually("later batches add to it", || cached_blocks(port)[0].1 == 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_engine_worker_serves_over_nats_and_relays_its_zmq_kv_events() {
    let etcd = EtcdServer::start().await.expect("etcd starts");
    let nats = NatsServer::start().await.expect("nats-server starts");
    let tok = tokenizer_dir();
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    // `infera worker vllm` with default transports over a stand-in engine that records its
    // command line and runs the mock engine (tests/peers/engine_standin.sh).
    let mut worker = Proc(
        Command::new(env!("CARGO_BIN_EXE_infera"))
            .args(["worker", "vllm", "--model", &tok, "--host", "127.0.0.1"])
            .args(["--port", &port.to_string()])
            .args([
                "--discovery-backend",
                "etcd",
                "--etcd-endpoint",
                &etcd.endpoint(),
            ])
            .args(["--nats-server", &nats.url(), "--drain-timeout", "10s"])
            .arg("--engine-cmd")
            .arg(
                std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                    .join("tests/peers/engine_standin.sh"),
            )
            .env("STANDIN_DIR", dir.path())
            .env("INFERA_BIN", env!("CARGO_BIN_EXE_infera"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let server_port = free_port();
    let _server = server(&tok, &etcd.endpoint(), &nats.url(), server_port, &[]);
    eventually("the worker to be discovered", || {
        get_json(server_port, "/health").is_some_and(|h| h["active_workers"] == 1)
    });
    let record = &get_json(server_port, "/v1/workers").unwrap()["data"][0]["record"];
    assert_eq!(record["request_transport"], "nats", "{record}");
    // The server reads the engine's events from NATS, not from the engine's socket.
    assert!(record["kv_events_endpoint"].is_null(), "{record}");

    let req = json!({"model": tok, "prompt": long_prompt("relay"), "max_tokens": 2});
    let (status, body) = post(server_port, req.clone()).await;
    assert_eq!(status, 200, "{body}");
    eventually(
        "the engine's blocks, relayed over nats, in the index",
        || cached_blocks(server_port)[0].1 > 10,
    );
    let (status, body) = post(server_port, req).await;
    assert_eq!(status, 200, "{body}");
    let again: Value = serde_json::from_str(&body).unwrap();
    assert!(
        again["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64() > Some(0),
        "{again}"
    );
    // SIGTERM: deregister, stop taking requests, drain, stop the engine, exit 0.
    let status = worker.terminate();
    assert!(status.success(), "worker exit: {status:?}");
    eventually("the worker to leave", || {
        get_json(server_port, "/health").is_some_and(|h| h["active_workers"] == 0)
    });
}

/// etcd, nats-server, one `infera worker mock` with `worker_flags` and `infera server` with
/// `server_flags`, both on default transports, once the server has discovered the worker.
/// Bind every field (no `..`): a field left out is dropped, and its process or service with it.
struct OneWorker {
    _etcd: EtcdServer,
    _nats: NatsServer,
    tok: String,
    worker: Proc,
    worker_port: u16,
    server: Proc,
    port: u16,
}

async fn one_worker(worker_flags: &[&str], server_flags: &[&str]) -> OneWorker {
    let etcd = EtcdServer::start().await.expect("etcd starts");
    let nats = NatsServer::start().await.expect("nats-server starts");
    let tok = tokenizer_dir();
    let worker_port = free_mock_port();
    let worker = mock_worker_at(
        &tok,
        &etcd.endpoint(),
        &nats.url(),
        worker_port,
        worker_flags,
    );
    let port = free_port();
    let server = server(&tok, &etcd.endpoint(), &nats.url(), port, server_flags);
    eventually("the worker to be discovered", || {
        get_json(port, "/health").is_some_and(|h| h["active_workers"] == 1)
    });
    OneWorker {
        _etcd: etcd,
        _nats: nats,
        tok,
        worker,
        worker_port,
        server,
        port,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_worker_finishes_its_nats_stream_and_takes_nothing_new() {
    // Real speed: 300 tokens take about two seconds.
    let OneWorker {
        _etcd,
        _nats,
        tok,
        mut worker,
        worker_port: _,
        server: _server,
        port: server_port,
    } = one_worker(&["--speedup", "1"], &[]).await;
    let body = json!({"model": tok, "prompt": "drain", "max_tokens": 300, "stream": true,
        "ignore_eos": true})
    .to_string();
    let (mut s, mut seen) = common::open_stream(server_port, &body);
    common::sigterm(&worker.0);
    // The worker leaves routing at once …
    eventually("the worker to leave routing", || {
        get_json(server_port, "/health").is_some_and(|h| h["active_workers"] == 0)
    });
    // … and its in-flight stream still ends whole.
    s.read_to_end(&mut seen).unwrap();
    let text = String::from_utf8_lossy(&seen);
    assert!(!text.contains("\"error\""), "{text}");
    assert!(text.contains("data: [DONE]"), "{text}");
    assert!(text.matches("data: {").count() >= 300, "{text}");
    let status = worker.0.wait().unwrap();
    assert!(status.success(), "worker exit: {status:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_worker_ends_its_nats_stream_with_an_error_when_its_lease_expires() {
    let OneWorker {
        _etcd,
        _nats,
        tok,
        mut worker,
        worker_port: _,
        server: _server,
        port,
    } = one_worker(&["--speedup", "1", "--etcd-lease-ttl", "2s"], &[]).await;
    let body = json!({"model": tok, "prompt": "keep talking", "max_tokens": 100000,
        "stream": true})
    .to_string();
    let (mut stream, head) = common::open_stream(port, &body);
    assert!(String::from_utf8_lossy(&head).starts_with("HTTP/1.1 200"));
    // The worker dies without a word: no deregistration, no reply, no broken connection.
    let killed = Command::new("kill")
        .args(["-KILL", &worker.0.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let _ = worker.0.wait();
    // Its lease expires, it leaves the fleet, and the stream ends with an error a few seconds
    // later — not at the 900 s idle timeout.
    let start = Instant::now();
    stream.set_read_timeout(Some(common::DEADLINE)).unwrap();
    let mut rest = Vec::new();
    let _ = stream.read_to_end(&mut rest);
    let text = String::from_utf8_lossy(&rest);
    assert!(start.elapsed() < common::DEADLINE, "the stream hung");
    assert!(text.contains("left the fleet and sent nothing"), "{text}");
    assert!(
        text.trim_end().ends_with("data: [DONE]") || text.contains("data: [DONE]"),
        "{text}"
    );
    assert_eq!(
        get_json(port, "/health").map(|h| h["active_workers"].clone()),
        Some(json!(0))
    );
}

/// The mock engine at `port` aborted one request whose client (the worker's proxy) went away,
/// and runs nothing.
fn engine_aborted_one(port: u16) -> bool {
    metric(port, "infera_mock_requests_detached_total") == Some(1)
        && metric(port, "vllm:num_requests_running") == Some(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_ends_a_request_at_its_own_max_duration_when_the_server_has_no_timer() {
    // Real speed: 4000 tokens take minutes; the worker gives each request 1 s. The server
    // waits for ever: no idle timeout, no max duration, no retry.
    let OneWorker {
        _etcd,
        _nats,
        tok,
        worker: _worker,
        worker_port,
        server: _server,
        port,
    } = one_worker(
        &["--speedup", "1", "--nats-req-max-duration", "1s"],
        &["--nats-req-idle-timeout", "0", "--request-max-retries", "0"],
    )
    .await;
    let (status, body) = post(
        port,
        json!({"model": tok, "prompt": "go on", "max_tokens": 4000}),
    )
    .await;
    assert_eq!(status, 504, "{body}");
    assert!(body.contains("--nats-req-max-duration (1s)"), "{body}");
    assert!(body.contains(&format!("127.0.0.1:{worker_port}")), "{body}");
    eventually("the engine to abort the request", || {
        engine_aborted_one(worker_port)
    });
    assert_eq!(
        metric(port, "infera_transport_timeouts_total").unwrap_or(0),
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_bounds_a_stream_whose_server_was_killed() {
    let OneWorker {
        _etcd,
        _nats,
        tok,
        worker: _worker,
        worker_port,
        mut server,
        port,
    } = one_worker(&["--speedup", "1", "--nats-req-max-duration", "2s"], &[]).await;
    let body = json!({"model": tok, "prompt": "keep talking", "max_tokens": 100000,
        "stream": true})
    .to_string();
    let (_stream, head) = tokio::task::spawn_blocking(move || common::open_stream(port, &body))
        .await
        .unwrap();
    assert!(String::from_utf8_lossy(&head).starts_with("HTTP/1.1 200"));
    assert_eq!(metric(worker_port, "vllm:num_requests_running"), Some(1));
    // The server dies mid-stream: no cancel will ever come.
    let killed = Command::new("kill")
        .args(["-KILL", &server.0.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let _ = server.0.wait();
    // The worker's own bound ends the engine request (100000 tokens would take hours).
    eventually("the engine to abort the orphaned stream", || {
        engine_aborted_one(worker_port)
    });
}
