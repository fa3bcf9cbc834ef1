//! `infera server` end to end with the real binaries: a real etcd (the backends harness), an
//! `infera worker mock` process that registers itself in etcd and publishes ZeroMQ KV events,
//! and the server discovering it, subscribing to its events, routing to it, and leaving it when
//! the worker shuts down.
//!
//! The server is a separate process, so readiness and convergence are observed through its own
//! status pages, polled under a deadline (there is no in-process handle to wait on).
#![allow(clippy::unwrap_used)]

mod common;

use common::{
    DEADLINE, Proc, eventually, free_mock_port, free_port, get_json, http, http_with_headers,
    metric, mock_worker, open_stream, register_in_etcd, replicas, server, stored, tokenizer_dir,
};

use infera_backends::testing::{EtcdServer, sample_record};
use infera_backends::zmq::{KvEventPublisher, PublisherConfig};
use serde_json::{Value, json};
use std::io::Read as _;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_discovers_a_worker_in_etcd_and_indexes_its_zmq_kv_events() {
    let etcd = EtcdServer::start().await.expect("etcd starts");
    let tok = tokenizer_dir();
    let tok = tok.as_str();

    let worker_port = free_mock_port();
    let mut worker = mock_worker(tok, &etcd.endpoint(), worker_port, &["--speedup", "1000"]);
    let server_port = free_port();
    let mut server = server(tok, &etcd.endpoint(), server_port, &[]);
    eventually("the mock to serve", || {
        get_json(worker_port, "/v1/models").is_some()
    });
    eventually("the server to serve", || {
        get_json(server_port, "/health").is_some()
    });

    // The mock registers itself; the model name it serves is its --model-path.
    eventually("the worker to be discovered", || {
        get_json(server_port, "/health").is_some_and(|h| h["active_workers"] == 1)
    });

    let mut prompt = String::from("e2e:");
    for i in 0..300 {
        prompt.push_str(&format!(" word{}", i % 89));
    }
    let req = json!({"model": tok, "prompt": prompt, "max_tokens": 2}).to_string();
    let blocks = || load_of(server_port).and_then(|l| l["cached_blocks"].as_u64());
    // ZeroMQ subscribers miss what an engine publishes before they have joined: warm up until
    // the subscription delivers.
    send_until(server_port, tok, "the subscription to deliver", || {
        blocks() > Some(0)
    });
    let indexed = blocks().unwrap_or(0);
    let picks = metric(server_port, "infera_router_picks_total").unwrap();
    let (status, body) = http(server_port, "POST", "/v1/completions", &req).unwrap();
    assert_eq!(status, 200, "{body}");
    // The mock's KV events reach the server's index over ZeroMQ.
    eventually("the worker's blocks in the server's index", || {
        blocks() > Some(indexed + 10)
    });
    let (status, body) = http(server_port, "POST", "/v1/completions", &req).unwrap();
    assert_eq!(status, 200, "{body}");
    let again: Value = serde_json::from_str(&body).unwrap();
    assert!(
        again["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64() > Some(0),
        "{again}"
    );
    assert_eq!(
        metric(server_port, "infera_router_picks_total"),
        Some(picks + 2)
    );

    // A worker that shuts down deregisters first, so it leaves routing at once.
    let pid = worker.0.id().to_string();
    let killed = Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    assert!(killed.success());
    let status = worker.0.wait().unwrap();
    assert!(status.success(), "worker exit: {status:?}");
    eventually("the worker to leave", || {
        get_json(server_port, "/health").is_some_and(|h| h["active_workers"] == 0)
    });
    let (status, _) = http(server_port, "POST", "/v1/completions", &req).unwrap();
    assert_eq!(status, 404);

    // SIGTERM stops the server cleanly.
    let pid = server.0.id().to_string();
    let killed = Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    assert!(killed.success());
    let status = server.0.wait().unwrap();
    assert!(status.success(), "server exit: {status:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_worker_ends_its_stream_with_an_error_fails_over_and_leaves_within_its_lease() {
    let etcd = EtcdServer::start().await.expect("etcd starts");
    let tok = tokenizer_dir();
    let tok = tok.as_str();
    let ports = [free_mock_port(), free_mock_port()];
    let mut workers: Vec<Proc> = ports
        .iter()
        .map(|p| mock_worker(tok, &etcd.endpoint(), *p, &["--etcd-lease-ttl", "2s"]))
        .collect();
    let server_port = free_port();
    let _server = server(
        tok,
        &etcd.endpoint(),
        server_port,
        &["--request-max-retries", "1"],
    );
    eventually("both workers to be routed to", || {
        get_json(server_port, "/health").is_some_and(|h| h["active_workers"] == 2)
    });

    // A long stream (the mock runs at real speed: ~6 ms per decode step).
    let body = json!({"model": tok, "prompt": "tell me a long story", "max_tokens": 2000,
        "stream": true})
    .to_string();
    let (mut stream, mut seen) = open_stream(server_port, &body);
    // Kill the worker that serves it.
    let workers_json = get_json(server_port, "/v1/workers").unwrap();
    let serving = workers_json["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["load"][0]["inflight"] == 1)
        .expect("one worker has the stream in flight")["record"]["worker_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let victim = ports
        .iter()
        .position(|p| serving.ends_with(&format!(":{p}")))
        .unwrap();
    workers[victim].0.kill().unwrap();
    workers[victim].0.wait().unwrap();
    let killed_at = Instant::now();

    // The stream ends, with an error event and [DONE], instead of hanging.
    stream.read_to_end(&mut seen).unwrap();
    let text = String::from_utf8_lossy(&seen);
    let events: Vec<&str> = text.split("\n\n").filter(|e| e.contains("data:")).collect();
    assert!(
        events.iter().any(|e| e.contains("\"error\"")),
        "no error event in {text}"
    );
    // (The body is chunked; the last chunk holds the error event and [DONE].)
    let error_at = text.find("data: {\"error\"").unwrap();
    let done_at = text.find("data: [DONE]").expect("[DONE] ends the stream");
    assert!(error_at < done_at, "{text}");

    // Until its lease expires the dead worker is still a candidate: requests routed to it fail
    // to connect and are retried on the survivor, so every one succeeds.
    for i in 0..6 {
        let req = json!({"model": tok, "prompt": format!("after the kill {i}"), "max_tokens": 2})
            .to_string();
        let (status, body) = http(server_port, "POST", "/v1/completions", &req).unwrap();
        assert_eq!(status, 200, "{body}");
    }
    eventually("the killed worker to leave routing", || {
        get_json(server_port, "/health").is_some_and(|h| h["active_workers"] == 1)
    });
    // Lease TTL 2 s; etcd expires leases with up to a second of slack.
    let left_after = killed_at.elapsed();
    assert!(
        left_after < Duration::from_secs(4),
        "left after {left_after:?}"
    );
}

/// Every `(request_id, column)` string value of the recorded segments in `dir`.
fn recorded_strings(dir: &std::path::Path, column: &str) -> Vec<(String, String)> {
    use arrow_array::{Array as _, ArrowPrimitiveType as _, StringArray, cast::AsArray as _};
    let mut out = Vec::new();
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "parquet"))
        .collect();
    files.sort();
    for file in files {
        let reader = parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(
            std::fs::File::open(file).unwrap(),
        )
        .unwrap()
        .build()
        .unwrap();
        for batch in reader {
            let batch = batch.unwrap();
            let ids: &StringArray = batch.column_by_name("request_id").unwrap().as_string();
            let values = batch.column_by_name(column).unwrap();
            let value = |i: usize| match *values.data_type() {
                arrow_array::types::UInt32Type::DATA_TYPE => values
                    .as_primitive::<arrow_array::types::UInt32Type>()
                    .value(i)
                    .to_string(),
                _ => values.as_string::<i32>().value(i).to_owned(),
            };
            for i in 0..ids.len() {
                out.push((ids.value(i).to_owned(), value(i)));
            }
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_records_a_trace_that_replay_reads() {
    let etcd = EtcdServer::start().await.expect("etcd starts");
    let tok = tokenizer_dir();
    let tok = tok.as_str();
    let rec = tempfile::tempdir().unwrap();
    let dir = rec.path().join("trace");
    let ports = [free_mock_port(), free_mock_port()];
    let _workers: Vec<Proc> = ports
        .iter()
        .map(|p| mock_worker(tok, &etcd.endpoint(), *p, &["--speedup", "1000"]))
        .collect();
    let server_port = free_port();
    let mut server = server(
        tok,
        &etcd.endpoint(),
        server_port,
        &[
            "--record-trace",
            dir.to_str().unwrap(),
            "--record-segment-age",
            "1s",
            "--record-prompts",
        ],
    );
    eventually("both workers to be discovered", || {
        get_json(server_port, "/health").is_some_and(|h| h["active_workers"] == 2)
    });

    // Three conversations, each sent twice: the repeat is a prefix hit on the same worker. All
    // six carry one client request id: the recorder tells requests apart by its own keys.
    let prompt = |topic: usize| {
        let mut p = format!("topic {topic}:");
        for i in 0..120 {
            p.push_str(&format!(" w{}", (i * (topic + 3)) % 97));
        }
        p
    };
    // Topic 1 asks for a priority in its body (vLLM's field), topic 2 in the header.
    for round in 0..2 {
        for topic in 0..3 {
            let mut req = json!({"model": tok, "prompt": prompt(topic), "max_tokens": 3,
                "session_id": format!("conversation-{topic}")});
            if topic == 1 {
                req["priority"] = json!(-2);
            }
            let req = req.to_string();
            let mut shared = vec![("x-infera-request-id", "one-client-id")];
            if topic == 2 {
                shared.push(("x-infera-priority", "3"));
            }
            let (status, body) =
                http_with_headers(server_port, "POST", "/v1/completions", &shared, &req).unwrap();
            assert_eq!(status, 200, "round {round}: {body}");
        }
        if round == 0 {
            eventually("the first round's blocks in the index", || {
                get_json(server_port, "/v1/workers").is_some_and(|w| {
                    let blocks = |i: usize| w["data"][i]["load"][0]["cached_blocks"].as_u64();
                    blocks(0).unwrap_or(0) + blocks(1).unwrap_or(0) >= 3 * 7
                })
            });
        }
    }
    let (_, metrics) = http(server_port, "GET", "/metrics", "").unwrap();
    assert!(
        metrics.contains("infera_event_tap_dropped_events_total{tap=\"trace\"} 0"),
        "{metrics}"
    );
    server.terminate();

    // The recording is a trace: six requests, in arrival order, hashed at the workers' block size.
    let trace = infera_replay::trace::load(&dir, &Default::default()).expect("a readable trace");
    assert_eq!(trace.requests.len(), 6, "{:?}", trace.notes);
    assert!(trace.requests.iter().all(|r| r.block_size == 16
        && r.block_hashes.len() == (r.input_length / 16) as usize
        && r.output_length == 3
        && r.token_ids.as_ref().map(Vec::len) == Some(r.input_length as usize)));
    let sessions: Vec<Option<&str>> = trace
        .requests
        .iter()
        .map(|r| r.session_id.as_deref())
        .collect();
    let conversation = |t: usize| Some(format!("conversation-{t}"));
    let want: Vec<Option<String>> = (0..6).map(|i| conversation(i % 3)).collect();
    assert_eq!(
        sessions,
        want.iter().map(Option::as_deref).collect::<Vec<_>>(),
        "each request's session lands on its own row"
    );
    assert!(
        trace
            .requests
            .iter()
            .all(|r| r.request_id == "one-client-id")
    );
    let priorities: Vec<Option<i32>> = trace.requests.iter().map(|r| r.priority).collect();
    assert_eq!(priorities, [None, Some(-2), Some(3)].repeat(2));
    for topic in 0..3 {
        assert_eq!(
            trace.requests[topic].block_hashes,
            trace.requests[topic + 3].block_hashes,
            "a repeated prompt has the same block hashes"
        );
    }
    // The decision and outcome sit beside each row: a repeat went to the same worker, hit.
    let workers = recorded_strings(&dir, "worker");
    let cached = recorded_strings(&dir, "cached_tokens");
    for topic in 0..3 {
        assert_eq!(workers[topic].1, workers[topic + 3].1, "{workers:?}");
        let hit: u64 = cached[topic + 3].1.parse().unwrap();
        assert!(hit > 0, "{cached:?}");
    }
    let events = std::fs::read_dir(dir.join("events")).unwrap().count();
    assert!(events >= 1, "the KV and discovery events are kept too");

    // `infera trace inspect` and `infera replay` read the directory.
    let inspect = Command::new(env!("CARGO_BIN_EXE_infera"))
        .args(["trace", "inspect", dir.to_str().unwrap()])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&inspect.stdout);
    assert!(
        inspect.status.success() && text.contains("requests        6"),
        "{text}"
    );
    let replay = Command::new(env!("CARGO_BIN_EXE_infera"))
        .args(["replay", dir.to_str().unwrap(), "--workers", "2"])
        .output()
        .unwrap();
    assert!(
        replay.status.success(),
        "{}",
        String::from_utf8_lossy(&replay.stderr)
    );
}

/// The worker's `/v1/workers` load entry on the server at `port`, if listed.
fn load_of(port: u16) -> Option<Value> {
    get_json(port, "/v1/workers").map(|w| w["data"][0]["load"][0].clone())
}

/// Sends distinct completions to `port` until `done` holds: ZeroMQ subscribers miss what an
/// engine publishes before they have joined, so the first request's events may never arrive.
fn send_until(port: u16, tok: &str, what: &str, mut done: impl FnMut() -> bool) {
    let mut n = 0;
    eventually(what, || {
        if n % 10 == 0 {
            let mut prompt = format!("{what} {n}:");
            for i in 0..200 {
                prompt.push_str(&format!(" {n}x{}", i % 53));
            }
            let req = json!({"model": tok, "prompt": prompt, "max_tokens": 2}).to_string();
            let (status, body) = http(port, "POST", "/v1/completions", &req).unwrap();
            assert_eq!(status, 200, "{body}");
        }
        n += 1;
        done()
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_server_gets_the_kv_index_back_from_its_sqlite_event_log() {
    let etcd = EtcdServer::start().await.expect("etcd starts");
    let tok = tokenizer_dir();
    let tok = tok.as_str();
    let db = tempfile::tempdir().unwrap();
    let log = format!("sqlite:{}", db.path().join("events.db").display());
    let worker_port = free_mock_port();
    let _worker = mock_worker(tok, &etcd.endpoint(), worker_port, &["--speedup", "1000"]);
    let start = |port: u16| server(tok, &etcd.endpoint(), port, &["--event-log", &log]);
    let blocks = |port: u16| load_of(port).and_then(|l| l["cached_blocks"].as_u64());

    let port = free_port();
    let mut first = start(port);
    eventually("the worker to be discovered", || {
        get_json(port, "/health").is_some_and(|h| h["active_workers"] == 1)
    });
    send_until(port, tok, "alpha", || blocks(port) > Some(10));
    let indexed = blocks(port).unwrap();
    first.terminate();

    // Restarted on the same log: the worker comes back with its index, before any event.
    let port = free_port();
    let mut second = start(port);
    eventually("the worker to be rediscovered", || {
        get_json(port, "/health").is_some_and(|h| h["active_workers"] == 1)
    });
    assert_eq!(blocks(port), Some(indexed), "{:?}", load_of(port));
    assert_eq!(
        metric(port, "infera_event_log_restored_workers_total"),
        Some(1)
    );
    second.terminate();

    // Events the server missed while it was down (a request sent straight to the engine) make
    // the restored index stale: it is cleared at the engine's next batch, not trusted.
    let prompt: String = (0..100).map(|i| format!(" direct{i}")).collect();
    let req = json!({"model": tok, "prompt": prompt, "max_tokens": 2});
    let (status, _) = http(worker_port, "POST", "/v1/completions", &req.to_string()).unwrap();
    assert_eq!(status, 200);
    let port = free_port();
    let _third = start(port);
    eventually("the worker to be rediscovered", || {
        get_json(port, "/health").is_some_and(|h| h["active_workers"] == 1)
    });
    assert_eq!(blocks(port), Some(indexed), "restored before any new event");
    send_until(port, tok, "delta", || {
        metric(port, "infera_event_log_restored_ranks_cleared_total") == Some(1)
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_sharing_a_jetstream_event_log_see_each_others_requests() {
    let tok = tokenizer_dir();
    let tok = tok.as_str();
    // Real-time decoding: a long completion stays in flight while the test looks.
    let fleet = replicas(tok, "REPLICAS", 2, &["--speedup", "1"], &[]).await;
    let [a, b] = fleet.ports;
    // In-flight requests per worker, as the server at `port` counts them.
    let inflight = |port: u16| -> Vec<u64> {
        let mut v: Vec<u64> = get_json(port, "/v1/workers")
            .map(|w| {
                w["data"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|d| d["load"][0]["inflight"].as_u64().unwrap_or(0))
                    .collect()
            })
            .unwrap_or_default();
        v.sort_unstable();
        v
    };
    assert_eq!(inflight(b), [0, 0]);
    // Long prompts: a decoding request's blocks stay active load on its worker (a prompt shorter
    // than a block would weigh only while its pick is recent).
    let long_stream = |port: u16, topic: &str| {
        let prompt: String = (0..300).map(|i| format!(" {topic}{}", i % 41)).collect();
        let body = json!({"model": tok, "prompt": prompt, "max_tokens": 100000, "stream": true});
        let (stream, head) = open_stream(port, &body.to_string());
        assert!(String::from_utf8_lossy(&head).starts_with("HTTP/1.1 200"));
        stream
    };

    // A streaming request through replica A is load on replica B too...
    let one = long_stream(a, "share");
    eventually("B to count A's request", || inflight(b) == [0, 1]);
    // ...so B sends the next request to the other worker, as one server would, and A counts it.
    let two = long_stream(b, "different");
    eventually("A to count B's request on the other worker", || {
        inflight(a) == [1, 1]
    });
    assert_eq!(inflight(b), [1, 1]);
    // Both leave every replica's accounting when their clients go away.
    drop(one);
    drop(two);
    for port in [a, b] {
        eventually("the requests to finish everywhere", || {
            inflight(port) == [0, 0]
        });
    }
    assert!(metric(b, "infera_event_log_peer_events_total") >= Some(2));
    assert!(metric(a, "infera_event_log_peer_events_total") >= Some(2));
}

/// A tenant's limit holds for the fleet, not per replica: two replicas sharing a JetStream event
/// log charge each other's requests, so requests sent to both in turn pass at the limit's rate
/// once, not twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_sharing_an_event_log_hold_a_tenants_limit_together() {
    let tok = tokenizer_dir();
    let tok = tok.as_str();
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys.json");
    const LIMIT: u64 = 60;
    let file = json!({"tenants": [{"name": "team", "keys": ["sk-team-0123456789abcdef"],
        "limits": {"requests_per_minute": LIMIT}}]});
    std::fs::write(&keys, file.to_string()).unwrap();
    let keys = keys.to_str().unwrap();
    let fleet = replicas(
        tok,
        "LIMITS",
        1,
        &["--speedup", "1000"],
        &["--api-keys", keys],
    )
    .await;
    let [a, b] = fleet.ports;
    let started = std::time::Instant::now();
    let mut passed = 0u64;
    for i in 0..2 * LIMIT {
        let port = if i % 2 == 0 { a } else { b };
        let body = json!({"model": tok, "prompt": format!("hello {i}"), "max_tokens": 1});
        let (status, raw) = http_with_headers(
            port,
            "POST",
            "/v1/completions",
            &[("authorization", "Bearer sk-team-0123456789abcdef")],
            &body.to_string(),
        )
        .expect("an answer");
        match status {
            200 => passed += 1,
            429 => assert!(raw.contains("retry-after"), "{raw}"),
            other => panic!("{other}: {raw}"),
        }
    }
    // The bucket refills while the test runs: the limit is a minute's allowance plus that.
    let allowed = LIMIT as f64 * (1.0 + started.elapsed().as_secs_f64() / 60.0);
    eprintln!(
        "two replicas: {passed} of {} passed, {allowed:.1} allowed",
        2 * LIMIT
    );
    assert!(
        (passed as f64) <= allowed * 1.05,
        "{passed} passed through two replicas, allowed {allowed:.1}"
    );
    assert!(
        passed as f64 >= allowed * 0.95 - 1.0,
        "{passed} of {allowed:.1}"
    );
    for port in [a, b] {
        assert!(metric(port, "infera_tenant_rate_limited_total").is_some_and(|n| n > 0));
        assert_eq!(metric(port, "infera_tenant_limit_share"), Some(1));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prewarm_hints_reach_the_kv_cache_daemon() {
    let etcd = EtcdServer::start().await.expect("etcd starts");
    let tok = tokenizer_dir();
    let tok = tok.as_str();
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("kvd.sock");
    let mut kvd = Proc(
        Command::new(env!("CARGO_BIN_EXE_infera"))
            .args(["kvd", "--socket", socket.to_str().unwrap()])
            .args(["--max-bytes", "16MiB", "--kv-events-endpoint", "off"])
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let worker_port = free_mock_port();
    let _worker = mock_worker(tok, &etcd.endpoint(), worker_port, &["--speedup", "1000"]);
    let port = free_port();
    let _server = server(
        tok,
        &etcd.endpoint(),
        port,
        &["--kvd-socket-path", socket.to_str().unwrap()],
    );
    eventually("the worker to be discovered", || {
        get_json(port, "/health").is_some_and(|h| h["active_workers"] == 1)
    });
    eventually("the daemon's socket", || socket.exists());
    let prewarm = |body: Value| http(port, "POST", "/v1/cache/prewarm", &body.to_string()).unwrap();
    let hints = || async {
        let mut c = infera_kvd::KvdClient::connect(&socket).await.unwrap();
        c.stats(true)
            .await
            .unwrap()
            .extended
            .unwrap()
            .prefetch_hints_total
    };

    let (status, body) = prewarm(json!({"model": tok, "compat_key": "",
        "block_hashes": ["00ff", "0x0102030405060708"], "deadline_ms": 500}));
    assert_eq!(
        (status, body.as_str()),
        (202, r#"{"accepted":true,"n_keys":2}"#)
    );
    // Ours: the keys of a prompt, derived at the model's block size (16): 100 words → 6 blocks+.
    let prompt: String = (0..100).map(|i| format!(" warm{i}")).collect();
    let (status, body) = prewarm(json!({"model": tok, "prompt": prompt}));
    assert_eq!(status, 202, "{body}");
    let n: Value = serde_json::from_str(&body).unwrap();
    assert!(n["n_keys"].as_u64() >= Some(6), "{body}");
    // The hint is fire-and-forget; the daemon's counter shows both arrived.
    let start = Instant::now();
    while hints().await < 2 {
        assert!(start.elapsed() < DEADLINE, "the daemon never saw the hints");
        tokio::task::yield_now().await;
    }

    for (bad, needle) in [
        (json!({"block_hashes": ["00"]}), "`model`"),
        (json!({"model": tok, "block_hashes": ["0g"]}), "not hex"),
        (json!({"model": tok}), "block_hashes"),
        (
            json!({"model": "nope", "prompt": prompt}),
            "no worker serves",
        ),
    ] {
        let (status, body) = prewarm(bad);
        assert!(status == 400 || status == 404, "{status} {body}");
        assert!(body.contains(needle), "{needle}: {body}");
    }
    // The daemon gone: 503, not a hang.
    kvd.terminate();
    let (status, body) = prewarm(json!({"model": tok, "block_hashes": ["00"]}));
    assert_eq!(status, 503, "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_zmq_kv_batch_is_replayed_from_the_engine_or_the_rank_rebuilt() {
    let etcd = EtcdServer::start().await.expect("etcd starts");
    let tok = tokenizer_dir();
    // The engine's sockets: `live` is the PUB socket the server subscribes to; `kept` holds the
    // replay ring. Both publish every batch with the same seqs, so skipping one on `live` only
    // is a batch lost in transit that the engine can still replay.
    let publisher = async |replay: Option<&str>| {
        KvEventPublisher::bind(PublisherConfig::new(
            "tcp://127.0.0.1:0",
            replay.map(str::to_owned),
        ))
        .await
        .unwrap()
    };
    let mut live = publisher(None).await;
    let mut kept = publisher(Some("tcp://127.0.0.1:0")).await;
    let id = format!("127.0.0.1:{}", free_port());
    let mut record = sample_record(&id);
    record.model_name = tok.clone();
    record.kv_events_endpoint = Some(live.endpoint().to_owned());
    record.set_kv_events_replay_endpoint(kept.replay_endpoint().map(str::to_owned));
    let _registration = register_in_etcd(&etcd.endpoint(), &record).await;
    let port = free_port();
    let _server = server(&tok, &etcd.endpoint(), port, &[]);
    let blocks = || load_of(port).and_then(|l| l["cached_blocks"].as_u64());
    // ZeroMQ subscribers miss what is published before they join: repeat a one-block batch
    // until the server has it.
    let deadline = Instant::now() + DEADLINE;
    while blocks() != Some(1) {
        assert!(
            Instant::now() < deadline,
            "the subscription never delivered"
        );
        for p in [&mut live, &mut kept] {
            p.publish_batch(&stored(1000, 1)).await.unwrap();
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let gaps = || metric(port, "infera_kv_event_gaps_total");
    let replayed = || metric(port, "infera_kv_event_gaps_replayed_total");
    assert_eq!((gaps(), replayed()), (Some(0), Some(0)));

    // Batch 2 is lost in transit: batch 3 reveals the gap, the engine replays 2, and the index
    // holds every block (clearing would have left only batch 3's).
    for p in [&mut live, &mut kept] {
        p.publish_batch(&stored(2000, 2)).await.unwrap();
    }
    kept.publish_batch(&stored(3000, 3)).await.unwrap();
    live.set_next_seq(kept.next_seq());
    for p in [&mut live, &mut kept] {
        p.publish_batch(&stored(4000, 4)).await.unwrap();
    }
    eventually("the lost batch replayed", || {
        blocks() == Some(1 + 2 + 3 + 4)
    });
    assert_eq!((gaps(), replayed()), (Some(1), Some(1)));

    // A batch the engine no longer holds: the rank is cleared and rebuilt from what follows.
    for p in [&mut live, &mut kept] {
        let next = p.next_seq() + 1;
        p.set_next_seq(next);
        p.publish_batch(&stored(5000, 5)).await.unwrap();
    }
    eventually("the rank rebuilt from the batch after the gap", || {
        blocks() == Some(5)
    });
    assert_eq!((gaps(), replayed()), (Some(2), Some(1)));
    live.shutdown().await;
    kept.shutdown().await;
}
