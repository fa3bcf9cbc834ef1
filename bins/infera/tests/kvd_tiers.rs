//! The router sees kvd, with the real binaries: etcd, one `infera kvd` per "node" publishing its
//! inventory on ZeroMQ (sharing a Redis L4 in the second test), one `infera worker mock` per
//! node saving to and loading from its node's kvd, and `infera server` at its defaults.
//!
//! What is observed is what a user sees: where the router sends a turn (its pick counters), how
//! much of the prompt the engine found cached (the mock's kvd hit counter), and what the router
//! knows of each node's kvd (`/v1/workers`).
#![allow(clippy::unwrap_used)]

mod common;
#[path = "../../../kvd/tests/support/redis.rs"]
mod redis;

use common::{Proc, eventually, free_port, get_json, http, metric, mock_worker, picks, server};
use infera_backends::testing::EtcdServer;
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// GPU blocks of each mock (4,096 tokens): a few prompts evict a conversation from it.
const GPU_BLOCKS: &str = "256";

/// `infera kvd` on `socket`, publishing its inventory on `tcp://127.0.0.1:events` (replays on
/// `replay`), with `l4`'s flags and environment (a shared Redis L4).
fn kvd(socket: &Path, events: u16, replay: u16, l4: &L4) -> Proc {
    let mut child = Command::new(env!("CARGO_BIN_EXE_infera"))
        .args(["kvd", "--socket", socket.to_str().unwrap()])
        .args(&l4.args)
        .envs(l4.env.iter().map(|(k, v)| (k, v)))
        .args(["--kv-events-endpoint", &format!("tcp://127.0.0.1:{events}")])
        .args([
            "--kv-events-replay-endpoint",
            &format!("tcp://127.0.0.1:{replay}"),
        ])
        .env_remove("RUST_LOG")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    common::until_kvd_listens(&mut child);
    Proc(child)
}

/// What a kvd adds for a shared L4 (nothing: none).
#[derive(Default)]
struct L4 {
    args: Vec<String>,
    env: Vec<(String, String)>,
}

impl L4 {
    /// LMCache's Redis layout on the server at `port` as the kvd's long-term store, behind an
    /// L2 of `l2_bytes`.
    fn redis(port: u16, l2_bytes: u64) -> Self {
        Self {
            args: [
                "--long-backend",
                "lmcache",
                "--max-bytes",
                &l2_bytes.to_string(),
            ]
            .map(str::to_owned)
            .to_vec(),
            env: vec![(
                "INFERA_L4_REMOTE_URL".to_owned(),
                format!("redis://127.0.0.1:{port}"),
            )],
        }
    }
}

/// One node: its kvd and its mock worker, named by the worker's port.
struct Node {
    port: u16,
    socket: PathBuf,
    events: u16,
    replay: u16,
    kvd: Proc,
    _worker: Proc,
}

fn node(dir: &Path, tok: &str, etcd: &str, name: &str, l4: &L4) -> Node {
    let socket = dir.join(format!("{name}.sock"));
    let (events, replay, port) = (free_port(), free_port(), common::free_mock_port());
    let kvd = kvd(&socket, events, replay, l4);
    let worker = mock_worker(
        tok,
        etcd,
        port,
        &[
            "--gpu-blocks",
            GPU_BLOCKS,
            "--speedup",
            "100",
            "--infera-kvd-socket",
            socket.to_str().unwrap(),
        ],
    );
    Node {
        port,
        socket,
        events,
        replay,
        kvd,
        _worker: worker,
    }
}

/// `n` distinct words starting with `tag`: about four tokens each.
fn words(tag: &str, n: usize) -> String {
    (0..n)
        .map(|i| format!("{tag}{i}"))
        .collect::<Vec<_>>()
        .join(" ")
}

fn complete(port: u16, model: &str, prompt: &str) {
    let body = json!({"model": model, "prompt": prompt, "max_tokens": 1});
    let (status, raw) = http(port, "POST", "/v1/completions", &body.to_string()).unwrap();
    assert_eq!(status, 200, "{raw}");
}

/// The `/v1/workers` entry of the mock on `worker`, from the server on `port`.
fn worker_entry(port: u16, worker: u16) -> Option<Value> {
    let id = format!("127.0.0.1:{worker}");
    let workers = get_json(port, "/v1/workers")?;
    workers["data"]
        .as_array()?
        .iter()
        .find(|d| d["record"]["worker_id"] == id.as_str())
        .cloned()
}

/// What the server on `port` knows of worker `worker`'s node kvd, tier `tier`: its blocks.
fn kvd_blocks(port: u16, worker: u16, tier: &str) -> u64 {
    worker_entry(port, worker)
        .and_then(|d| d["kvd"]["tiers"][tier]["blocks"].as_u64())
        .unwrap_or(0)
}

/// GPU blocks the server on `port` indexes for worker `worker`.
fn gpu_blocks(port: u16, worker: u16) -> u64 {
    worker_entry(port, worker)
        .and_then(|d| d["load"][0]["cached_blocks"].as_u64())
        .unwrap_or(0)
}

/// Prompt tokens a mock found in its kvd, from its own metrics.
fn kvd_hit_tokens(worker: u16) -> u64 {
    metric(worker, "infera_mock_kvd_hit_tokens_total").unwrap_or(0)
}

/// A conversation evicted from its worker's GPU but held in its node's kvd (L2) draws its next
/// turn back to that worker, over another worker whose GPU holds the conversation's system
/// prompt: the GPU-only cost sends it there. A kvd restart then clears what the router knows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_evicted_to_kvd_host_ram_returns_to_its_node() {
    let tok = common::tokenizer_dir();
    let tok = tok.as_str();
    let etcd = EtcdServer::start().await.unwrap();
    let endpoint = etcd.endpoint();
    let dir = tempfile::tempdir().unwrap();
    let a = node(dir.path(), tok, &endpoint, "a", &L4::default());
    let b = node(dir.path(), tok, &endpoint, "b", &L4::default());
    let port = free_port();
    let _server = server(tok, &endpoint, port, &[]);
    eventually("both workers and their kvds to be known", || {
        get_json(port, "/v1/workers").is_some_and(|w| {
            let data = w["data"].as_array().cloned().unwrap_or_default();
            data.len() == 2 && data.iter().all(|d| d["kvd"]["endpoint"].is_string())
        })
    });

    // Turn 1 on a (sent to it directly: the test picks the node), saved to a's kvd.
    let system = words("system", 120);
    let turn1 = format!("{system} {}", words("history", 200));
    complete(a.port, tok, &turn1);
    eventually("a's kvd to publish turn 1", || {
        kvd_blocks(port, a.port, "host") >= 30
    });
    // Other conversations push turn 1 out of a's GPU (256 blocks); they go to a's kvd too.
    for i in 0..6 {
        complete(a.port, tok, &words(&format!("other{i}x"), 250));
    }
    eventually("a's kvd to hold every prompt", || {
        kvd_blocks(port, a.port, "host") >= 350
    });
    eventually("the router to see a's GPU full of the others", || {
        gpu_blocks(port, a.port) > 0
    });
    // b's GPU holds the system prompt: by GPU cache alone, b is where turn 2 belongs.
    complete(b.port, tok, &system);
    eventually("the router to see b's cached system prompt", || {
        gpu_blocks(port, b.port) >= 10
    });

    let hits_before = kvd_hit_tokens(a.port);
    let turn2 = format!("{turn1} {}", words("question", 20));
    complete(port, tok, &turn2);
    assert_eq!(
        (picks(port, a.port), picks(port, b.port)),
        (1, 0),
        "turn 2 goes where its prefix is, in a's kvd"
    );
    let loaded = kvd_hit_tokens(a.port) - hits_before;
    assert!(
        loaded >= 300,
        "a loaded turn 1 from its kvd: {loaded} tokens"
    );

    // A restarted kvd starts empty and says so: the router forgets its blocks.
    let mut old = a.kvd;
    old.terminate();
    std::fs::remove_file(&a.socket).ok();
    let _restarted = kvd(&a.socket, a.events, a.replay, &L4::default());
    eventually("the router to forget a's kvd", || {
        kvd_blocks(port, a.port, "host") == 0
    });
    drop(b);
}

/// A prefix only the shared L4 holds (written through by node a's kvd, gone from a's small L2
/// and from a's GPU) is credited on every kvd-backed node alike, and on no other worker: node
/// b, whose GPU holds two blocks of it, wins over a (the L4 credit alone) and over worker c (no
/// kvd) whose GPU holds a few more of it than b's, which the GPU-only cost would pick.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_in_the_shared_l4_is_credited_on_every_kvd_node() {
    let tok = common::tokenizer_dir();
    let tok = tok.as_str();
    let redis = redis::RedisServer::start();
    let etcd = EtcdServer::start().await.unwrap();
    let endpoint = etcd.endpoint();
    let dir = tempfile::tempdir().unwrap();
    // About 70 of the mock's blocks: the others push turn 1 out of a's L2.
    let l4 = L4::redis(redis.port, 16 << 10);
    let a = node(dir.path(), tok, &endpoint, "a", &l4);
    let b = node(dir.path(), tok, &endpoint, "b", &l4);
    let c = common::free_mock_port();
    let _c = mock_worker(
        tok,
        &endpoint,
        c,
        &["--gpu-blocks", GPU_BLOCKS, "--speedup", "100"],
    );
    let port = free_port();
    let _server = server(tok, &endpoint, port, &[]);
    eventually("three workers, two with kvds", || {
        get_json(port, "/v1/workers").is_some_and(|w| {
            let data = w["data"].as_array().cloned().unwrap_or_default();
            data.len() == 3 && data.iter().filter(|d| d["kvd"].is_object()).count() == 2
        })
    });

    let turn1 = words("shared", 320);
    complete(a.port, tok, &turn1);
    for i in 0..6 {
        complete(a.port, tok, &words(&format!("pushed{i}x"), 250));
    }
    eventually("a's kvd to publish the prompts written to L4", || {
        kvd_blocks(port, a.port, "external") >= 350
    });
    eventually("a's L2 and GPU to have let turn 1 go", || {
        kvd_blocks(port, a.port, "host") < 80 && gpu_blocks(port, a.port) > 0
    });
    // b's GPU holds 2 blocks of the prefix, c's a few more: without L4 credit, c wins.
    complete(b.port, tok, &words("shared", 8));
    complete(c, tok, &words("shared", 20));
    eventually("the router to see b's and c's prefixes", || {
        let (pb, pc) = (gpu_blocks(port, b.port), gpu_blocks(port, c));
        pb >= 1 && pc > pb
    });
    let (pb, pc) = (gpu_blocks(port, b.port), gpu_blocks(port, c));
    assert!(
        pc < 8,
        "c's prefix ({pc} blocks) must stay below turn 1's L4 credit"
    );

    complete(port, tok, &format!("{turn1} {}", words("next", 10)));
    assert_eq!(
        [picks(port, a.port), picks(port, b.port), picks(port, c)],
        [0, 1, 0],
        "b: its {pb} GPU blocks plus the L4 credit; c holds {pc} blocks, a only the L4 credit"
    );
}
