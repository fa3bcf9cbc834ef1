//! `infera up` against the real binary over real sockets on 127.0.0.1: the fleet starts on
//! system-chosen ports (`--port 0`), announces itself on stdout, serves completions through the
//! KV-aware router with the mocks' KV events fed in process (a repeated prompt hits the cache),
//! reports its workers on `/health`, and exits 0 on SIGTERM. With `--kvd`, a prompt served by one
//! mock is loaded from the in-process kvd by another (never with retention `none`), and the
//! router knows what kvd holds.
//!
//! Startup is synchronised by reading stdout until the `server:` line, never by sleeping.
#![allow(clippy::unwrap_used)]

mod common;

use common::metric_in;

use serde_json::{Value, json};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// A guard against a hung test, never a synchronisation.
const TIMEOUT: Duration = Duration::from_secs(30);

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Kills the child if the test fails before it exits.
struct ChildGuard(Option<Child>);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Some(mut child) = self.0.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The `infera up` process, announced and serving.
struct Fleet {
    child: ChildGuard,
    addr: SocketAddr,
    ready_line: String,
    /// The mocks' addresses, from the `worker i:` lines.
    workers: Vec<SocketAddr>,
    /// The in-process kvd's socket, from the `kvd:` line (`--kvd`).
    kvd: Option<PathBuf>,
    /// Kept open so that the process never writes to a closed pipe.
    _stdout: BufReader<ChildStdout>,
}

impl Fleet {
    fn start(workers: u16, extra: &[&str]) -> Self {
        let tokenizer = repo_root().join("fixtures/tokenizers/deepseek-v4");
        let mut child = Command::new(env!("CARGO_BIN_EXE_infera"))
            .args(["up", "--workers", &workers.to_string(), "--port", "0"])
            .args(["--speedup", "1000", "--model-name", "mock"])
            .arg("--router-tokenizer-path")
            .arg(&tokenizer)
            .args(extra)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let child = ChildGuard(Some(child));
        // Read the announcement to its last line (the process exiting first ends the loop: EOF).
        let (mut line, mut ready, mut urls, mut kvd) = (String::new(), None, Vec::new(), None);
        loop {
            line.clear();
            let n = stdout.read_line(&mut line).unwrap();
            assert!(n > 0, "infera up exited before announcing the fleet");
            if line.starts_with("server: ") {
                ready = Some(line.clone());
            } else if let Some(rest) = line.strip_prefix("worker ") {
                let url = rest.split_whitespace().nth(1).unwrap();
                urls.push(url.strip_prefix("http://").unwrap().parse().unwrap());
            } else if let Some(rest) = line.strip_prefix("kvd: ") {
                kvd = Some(PathBuf::from(rest.split_whitespace().next().unwrap()));
            } else if line.starts_with("stop with Ctrl-C") {
                break;
            }
        }
        let line = ready.expect("a server: line");
        let authority = line
            .strip_prefix("server: http://")
            .and_then(|rest| rest.split_once("/v1"))
            .map(|(authority, _)| authority)
            .unwrap_or_else(|| panic!("ready line: {line}"));
        Self {
            child,
            addr: authority.parse().unwrap(),
            ready_line: line.trim_end().to_owned(),
            workers: urls,
            kvd,
            _stdout: stdout,
        }
    }

    /// Sends SIGTERM and returns the exit status.
    fn terminate(mut self) -> ExitStatus {
        let mut child = self.child.0.take().unwrap();
        let pid = child.id().to_string();
        let status = Command::new("kill").args(["-TERM", &pid]).status().unwrap();
        assert!(status.success(), "kill -TERM failed");
        let (tx, rx) = mpsc::channel();
        let waiter = std::thread::spawn(move || {
            let _ = tx.send(child.wait());
        });
        match rx.recv_timeout(TIMEOUT) {
            Ok(status) => {
                waiter.join().unwrap();
                status.unwrap()
            }
            Err(_) => {
                let _ = Command::new("kill").args(["-KILL", &pid]).status();
                panic!("infera up did not exit within {TIMEOUT:?} of SIGTERM");
            }
        }
    }
}

/// One HTTP/1.1 exchange on a fresh connection (`connection: close`); returns status and body.
fn exchange(addr: SocketAddr, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut stream = TcpStream::connect_timeout(&addr, TIMEOUT).unwrap();
    stream.set_read_timeout(Some(TIMEOUT)).unwrap();
    stream.set_write_timeout(Some(TIMEOUT)).unwrap();
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    stream.flush().unwrap();
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).unwrap();
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("response head");
    let head = String::from_utf8_lossy(&raw[..split]).to_ascii_lowercase();
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("status line: {head}"));
    let mut payload = raw[split + 4..].to_vec();
    if head.contains("transfer-encoding: chunked") {
        payload = dechunk(&payload);
    }
    (status, String::from_utf8(payload).unwrap())
}

fn dechunk(mut data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let eol = data
            .windows(2)
            .position(|w| w == b"\r\n")
            .expect("chunk size");
        let size_text = String::from_utf8_lossy(&data[..eol]);
        let size = usize::from_str_radix(size_text.split(';').next().unwrap().trim(), 16).unwrap();
        data = &data[eol + 2..];
        if size == 0 {
            return out;
        }
        out.extend_from_slice(&data[..size]);
        data = &data[size + 2..];
    }
}

fn get_json(addr: SocketAddr, path: &str) -> Value {
    let (status, text) = exchange(addr, "GET", path, "");
    assert_eq!(status, 200, "{path}: {text}");
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path} json ({e}): {text}"))
}

fn post_json(addr: SocketAddr, path: &str, body: &Value) -> Value {
    let (status, text) = exchange(addr, "POST", path, &body.to_string());
    assert_eq!(status, 200, "{path}: {text}");
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path} json ({e}): {text}"))
}

fn cached(v: &Value) -> u64 {
    v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or_else(|| panic!("cached_tokens in {v}"))
}

#[test]
fn up_serves_a_kv_aware_fleet_and_stops_on_sigterm() {
    let fleet = Fleet::start(2, &[]);
    assert!(
        fleet
            .ready_line
            .contains("(2 mock workers: http://127.0.0.1:"),
        "{}",
        fleet.ready_line
    );
    let addr = fleet.addr;

    let health = get_json(addr, "/health");
    assert_eq!(health, json!({"status": "ok", "active_workers": 2}));

    let mut prompt = String::from("up-test:");
    for i in 0..400 {
        prompt.push_str(&format!(" word{}", i % 97));
    }
    let req = json!({"model": "mock", "prompt": prompt, "max_tokens": 2});
    let first = post_json(addr, "/v1/completions", &req);
    assert_eq!(first["usage"]["completion_tokens"], 2, "{first}");

    // The mock queued the prompt's KV events before answering; wait (bounded) until the
    // in-process forwarder has applied them to the router's index.
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let (status, text) = exchange(addr, "GET", "/metrics", "");
        assert_eq!(status, 200, "{text}");
        if metric_in(&text, "infera_kv_stored_blocks_total").unwrap_or(0) > 0 {
            break;
        }
        assert!(Instant::now() < deadline, "no kv events reached the router");
        std::thread::yield_now();
    }

    let second = post_json(addr, "/v1/completions", &req);
    assert!(cached(&second) > 0, "{second}");

    let status = fleet.terminate();
    assert_eq!(status.code(), Some(0), "{status:?}");
}

#[test]
fn up_without_a_tokenizer_fails_with_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_infera"))
        .args(["up", "--port", "0"])
        .current_dir(dir.path())
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2), "{output:?}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("infera up: error:") && stderr.contains("--router-tokenizer-path"),
        "{stderr}"
    );
}

/// A mock's counter (its series carry `model_name="mock"`).
fn mock_metric(worker: SocketAddr, name: &str) -> u64 {
    let (status, text) = exchange(worker, "GET", "/metrics", "");
    assert_eq!(status, 200, "{text}");
    metric_in(&text, name).unwrap_or(0)
}

fn long_prompt(tag: &str) -> String {
    let mut prompt = format!("{tag}:");
    for i in 0..300 {
        prompt.push_str(&format!(" word{}", i % 89));
    }
    prompt
}

#[test]
fn up_with_kvd_serves_a_prompt_from_kvd_on_another_worker() {
    let fleet = Fleet::start(2, &["--kvd"]);
    let socket = fleet.kvd.clone().expect("a kvd: line");
    assert!(socket.exists(), "{}", socket.display());
    let [a, b] = fleet.workers[..] else {
        panic!("two workers: {:?}", fleet.workers);
    };
    let (hits, saved) = (
        "infera_mock_kvd_hit_tokens_total",
        "infera_mock_kvd_saved_blocks_total",
    );

    // Worker A computes the prompt and saves its blocks before it answers.
    let req = json!({"model": "mock", "prompt": long_prompt("kvd"), "max_tokens": 2});
    let first = post_json(a, "/v1/completions", &req);
    assert_eq!(cached(&first), 0, "{first}");
    let saved_by_a = mock_metric(a, saved);
    assert!(saved_by_a > 0, "worker A saved nothing to kvd");
    // The router learns what kvd holds, in process: every worker names it.
    common::eventually("the router to see kvd's blocks", || {
        let workers = get_json(fleet.addr, "/v1/workers");
        workers["data"].as_array().is_some_and(|w| {
            w.len() == 2
                && w.iter()
                    .all(|w| w["kvd"]["tiers"]["host"]["blocks"].as_u64() >= Some(saved_by_a))
        })
    });

    // The same prompt forced to worker B: its GPU cache is empty, its prefix comes from kvd.
    let second = post_json(b, "/v1/completions", &req);
    assert!(cached(&second) > 0, "{second}");
    assert_eq!(mock_metric(b, hits), cached(&second));
    // Again on B: a GPU prefix-cache hit now, not a kvd one.
    let third = post_json(b, "/v1/completions", &req);
    assert_eq!(cached(&third), cached(&second), "{third}");
    assert_eq!(mock_metric(b, hits), cached(&second));

    // Retention none is never stored: B finds nothing of A's prompt in kvd.
    let mut none = json!({"model": "mock", "prompt": long_prompt("none"), "max_tokens": 2});
    none["kv_transfer_params"] = json!({"infera_retention": "none"});
    post_json(a, "/v1/completions", &none);
    assert_eq!(mock_metric(a, saved), saved_by_a);
    none.as_object_mut().unwrap().remove("kv_transfer_params");
    let on_b = post_json(b, "/v1/completions", &none);
    assert_eq!(cached(&on_b), 0, "{on_b}");

    // The server's prewarm reaches the same daemon.
    let prewarm = json!({"model": "mock", "prompt": long_prompt("kvd")});
    let (status, text) = exchange(
        fleet.addr,
        "POST",
        "/v1/cache/prewarm",
        &prewarm.to_string(),
    );
    assert_eq!(status, 202, "{text}");

    let status = fleet.terminate();
    assert_eq!(status.code(), Some(0), "{status:?}");
    assert!(
        !socket.exists(),
        "kvd's temporary socket outlived infera up"
    );
}
