//! KV-aware routing under the two live patterns its load accounting exists for, end to end: a
//! real etcd (and nats-server), three `infera worker mock` processes and `infera server`, over
//! HTTP + ZeroMQ and over NATS alike.
//!
//! - One user sending turns one after another with a long shared system prompt, on an otherwise
//!   idle fleet: every turn after the first is a prefix-cache hit (the fleet charges no worker for
//!   requests that have finished; with `--router-resident-weight`, only for what the other
//!   conversations hold beyond the shared prompt; with `--router-balance-tokens`, less for its
//!   recent picks than the prompt is worth).
//! - A burst of identical prompts: it spreads, no worker takes more than half of it (each request
//!   in flight loads its worker).
//! - Concurrent requests that share one client `x-infera-request-id` each count in flight.
#![allow(clippy::unwrap_used)]

mod common;

use common::{
    DEADLINE, Proc, eventually, free_mock_port, free_port, get_json, http, mock_worker_command,
    tokenizer_dir,
};
use infera_backends::testing::{EtcdServer, NatsServer};
use serde_json::{Value, json};
use std::io::{Read as _, Write as _};
use std::net::TcpStream;
use std::process::{Command, Stdio};

/// How requests and KV events travel between the server and its workers.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Transport {
    HttpZmq,
    Nats,
}

/// etcd (and nats-server), three mock workers and the server, with every worker discovered.
/// This file's fleets run one at a time: each picks its ports by probing for free ones, and
/// fleets started at once raced for them (a worker that lost never registered).
static ONE_FLEET: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

struct Fleet {
    server_port: u16,
    worker_ports: Vec<u16>,
    _procs: Vec<Proc>,
    _etcd: EtcdServer,
    _nats: Option<NatsServer>,
    /// Held until everything above is stopped.
    _one: tokio::sync::MutexGuard<'static, ()>,
}

impl Fleet {
    /// Starts the fleet; `mock` flags go to every worker, `server` flags to the server.
    async fn start(transport: Transport, workers: usize, mock: &[&str], server: &[&str]) -> Fleet {
        let one = ONE_FLEET.lock().await;
        let etcd = EtcdServer::start().await.expect("etcd starts");
        let nats = match transport {
            Transport::HttpZmq => None,
            Transport::Nats => Some(NatsServer::start().await.expect("nats-server starts")),
        };
        let wires: Vec<String> = match &nats {
            None => ["--request-transport", "http", "--kv-event-transport", "zmq"]
                .map(str::to_owned)
                .to_vec(),
            Some(n) => vec!["--nats-server".to_owned(), n.url()],
        };
        let tok = tokenizer_dir();
        let worker_ports: Vec<u16> = (0..workers).map(|_| free_mock_port()).collect();
        let mut procs: Vec<Proc> = worker_ports
            .iter()
            .map(|port| {
                let mut cmd = mock_worker_command(&tok, &etcd.endpoint(), *port);
                cmd.args(&wires).args(mock);
                spawn(cmd)
            })
            .collect();
        let server_port = free_port();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_infera"));
        cmd.args([
            "server",
            "--router-tokenizer-path",
            &tok,
            "--host",
            "127.0.0.1",
        ])
        .args(["--port", &server_port.to_string()])
        .args(["--discovery-backend", "etcd", "--etcd-endpoint"])
        .arg(etcd.endpoint())
        .args(&wires)
        .args(server);
        procs.push(spawn(cmd));
        eventually("every worker to be discovered", || {
            get_json(server_port, "/health").is_some_and(|h| h["active_workers"] == workers)
        });
        Fleet {
            server_port,
            worker_ports,
            _procs: procs,
            _etcd: etcd,
            _nats: nats,
            _one: one,
        }
    }

    /// Requests each worker accepted so far (from its own `/metrics`), in `worker_ports` order.
    fn accepted(&self) -> Vec<u64> {
        self.worker_ports
            .iter()
            .map(|p| {
                let (_, text) = http(*p, "GET", "/metrics", "").unwrap();
                text.lines()
                    .find(|l| l.starts_with("infera_mock_requests_total{"))
                    .and_then(|l| l.rsplit(' ').next()?.parse().ok())
                    .unwrap()
            })
            .collect()
    }

    /// In-flight requests per worker rank, as the server counts them (`/v1/workers`).
    fn inflight(&self) -> Vec<u64> {
        let workers = get_json(self.server_port, "/v1/workers").unwrap();
        workers["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|w| w["load"][0]["inflight"].as_u64().unwrap())
            .collect()
    }
}

fn spawn(mut cmd: Command) -> Proc {
    Proc(
        cmd.stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    )
}

/// A system prompt of about 4,800 tokens with the fixture tokenizer.
fn system_prompt() -> String {
    let mut p = String::from("You are the support assistant of a large store. Policies:");
    for i in 0..1_700 {
        p.push_str(&format!(" rule{} applies", i % 97));
    }
    p
}

/// `POST /v1/chat/completions` of `body`; the answer's JSON.
fn chat(port: u16, body: &Value) -> Value {
    let (status, text) = http(port, "POST", "/v1/chat/completions", &body.to_string()).unwrap();
    assert_eq!(status, 200, "{text}");
    serde_json::from_str(&text).unwrap()
}

fn turn(system: &str, i: usize) -> Value {
    json!({
        "model": tokenizer_dir(),
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": format!("Question number {i}: where is my order?")},
        ],
        "max_tokens": 8,
    })
}

/// Six sequential turns sharing the system prompt, each sent once the previous one has been
/// answered: every turn after the first finds the prompt cached.
async fn sequential_turns_hit_the_cache(transport: Transport, server: &[&str]) {
    let fleet = Fleet::start(transport, 3, &[], server).await;
    let system = system_prompt();
    let port = fleet.server_port;
    let answers = tokio::task::spawn_blocking(move || {
        (0..6)
            .map(|i| chat(port, &turn(&system, i)))
            .collect::<Vec<_>>()
    })
    .await
    .unwrap();
    let usage = |a: &Value, key: &str| -> u64 {
        match key {
            "cached" => a["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap_or(0),
            _ => a["usage"]["prompt_tokens"].as_u64().unwrap(),
        }
    };
    let prompt = usage(&answers[0], "prompt");
    assert!(prompt > 4_000, "the shared prompt is {prompt} tokens");
    let cached: Vec<u64> = answers.iter().map(|a| usage(a, "cached")).collect();
    // Only the turn's own question (and the block it starts in) is new.
    let hits = cached[1..].iter().filter(|c| **c + 48 >= prompt).count();
    assert_eq!(hits, 5, "cached tokens per turn {cached:?} of {prompt}");
    // One worker served them all.
    let accepted = fleet.accepted();
    assert!(accepted.contains(&6), "{accepted:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sequential_shared_prefix_turns_hit_the_cache_over_http_and_zmq() {
    sequential_turns_hit_the_cache(Transport::HttpZmq, &[]).await;
}

/// With resident conversations counted, the earlier turns are other conversations on the
/// worker, but beyond the shared prompt they hold only a question: the turns still stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sequential_shared_prefix_turns_hit_the_cache_with_resident_load_counted() {
    sequential_turns_hit_the_cache(Transport::HttpZmq, &["--router-resident-weight", "1"]).await;
}

/// With recent picks charged 512 tokens each above the mean, the sixth turn finds its worker
/// 3⅓ picks above the mean of three: about 1,700 tokens, less than the ~5,000-token prompt it
/// holds. The turns stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sequential_shared_prefix_turns_hit_the_cache_with_recent_picks_balanced() {
    sequential_turns_hit_the_cache(Transport::HttpZmq, &["--router-balance-tokens", "512"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sequential_shared_prefix_turns_hit_the_cache_over_nats() {
    sequential_turns_hit_the_cache(Transport::Nats, &[]).await;
}

/// 32 identical prompts sent at once: no worker takes more than half of them.
async fn a_burst_spreads(transport: Transport) {
    let fleet = Fleet::start(transport, 3, &[], &[]).await;
    let system = system_prompt();
    let port = fleet.server_port;
    let sent: Vec<_> = (0..32)
        .map(|_| {
            let body = turn(&system, 0);
            tokio::task::spawn_blocking(move || chat(port, &body))
        })
        .collect();
    for s in sent {
        s.await.unwrap();
    }
    let accepted = fleet.accepted();
    assert_eq!(accepted.iter().sum::<u64>(), 32, "{accepted:?}");
    assert!(accepted.iter().all(|n| *n <= 16), "{accepted:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_identical_prompts_spreads_over_http_and_zmq() {
    a_burst_spreads(Transport::HttpZmq).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_identical_prompts_spreads_over_nats() {
    a_burst_spreads(Transport::Nats).await;
}

/// Opens a streaming chat request with the client id `id` and reads until its first event; the
/// stream stays open while the returned socket lives.
fn open_stream_with_id(port: u16, id: &str, body: &Value) -> TcpStream {
    let body = body.to_string();
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(DEADLINE)).unwrap();
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\
         Content-Type: application/json\r\nx-infera-request-id: {id}\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains("data: {") {
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0, "the stream closed before its first event");
        seen.extend_from_slice(&buf[..n]);
    }
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_sharing_a_client_id_each_count_in_flight() {
    // Real-time engines: 4,000 tokens keep every stream open for the whole check.
    let fleet = Fleet::start(Transport::HttpZmq, 2, &["--speedup", "1"], &[]).await;
    let port = fleet.server_port;
    let streams = tokio::task::spawn_blocking(move || {
        (0..10)
            .map(|i| {
                // Distinct prompts of several blocks each: each stream loads the worker it is on.
                let words: Vec<String> = (0..80).map(|k| format!("s{i}w{k}")).collect();
                let body = json!({
                    "model": tokenizer_dir(),
                    "messages": [{"role": "user", "content": words.join(" ")}],
                    "max_tokens": 4_000,
                    "stream": true,
                });
                open_stream_with_id(port, "same-id", &body)
            })
            .collect::<Vec<_>>()
    })
    .await
    .unwrap();
    let inflight = fleet.inflight();
    assert_eq!(inflight.iter().sum::<u64>(), 10, "{inflight:?}");
    assert!(inflight.iter().all(|n| *n >= 3), "{inflight:?}");
    drop(streams);
    eventually("the cancelled streams to leave the fleet's load", || {
        fleet.inflight().iter().sum::<u64>() == 0
    });
}
