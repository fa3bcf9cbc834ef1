//! Helpers shared by the end-to-end tests that run the `infera` binary as separate processes
//! (server, workers, engines): free ports, child processes that die with the test, one-shot
//! HTTP/1.1 exchanges and bounded polling of another process's status pages.
#![allow(dead_code, clippy::unwrap_used)] // each test binary uses its own subset

use infera_backends::discovery::{EtcdConfig, EtcdDiscovery, Registrar as _, Registration};
use infera_core::event::{Tier, WorkerRecord};
use infera_core::ids::EngineHash;
use infera_core::kv_events::{EngineBatch, EngineEvent};
use serde_json::Value;
use std::io::{BufRead as _, Read as _, Write as _};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// Upper bound of every wait: a guard against a hung test, never a synchronisation.
pub const DEADLINE: Duration = Duration::from_secs(60);

/// A loopback port nothing listens on, not handed out before in this test process (see
/// `infera_backends::testing::free_port`).
pub fn free_port() -> u16 {
    infera_backends::testing::free_port().unwrap()
}

/// A port for `infera worker mock`, whose KV-event sockets take the port + 10000 and + 20000:
/// all three free, and none handed out before in this test process.
pub fn free_mock_port() -> u16 {
    infera_backends::testing::free_port_triple().unwrap()
}

/// The fixture tokenizer directory.
pub fn tokenizer_dir() -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures/tokenizers/deepseek-v4")
        .to_str()
        .unwrap()
        .to_owned()
}

/// A child process killed (by its own pid) when dropped, so a failed assertion leaves nothing
/// behind.
pub struct Proc(pub Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Proc {
    /// Sends SIGTERM (as a supervisor does) and waits for the exit.
    pub fn terminate(&mut self) -> ExitStatus {
        sigterm(&self.0);
        self.0.wait().unwrap()
    }
}

/// A Python peer of `tests/peers/` (an independent implementation of a protocol), running
/// until dropped: its stdin, and its stdout's lines as they come.
pub struct Peer {
    pub stdin: std::process::ChildStdin,
    pub lines: std::sync::mpsc::Receiver<String>,
    _proc: Proc,
}

/// Starts `tests/peers/<script>` with python3; `needs` names what it needs installed.
pub fn python_peer(script: &str, needs: &str) -> Peer {
    use std::io::BufRead as _;
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/peers")
        .join(script);
    let mut child = Command::new("python3")
        .arg(path)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{script} needs {needs}: {e}"));
    let stdin = child.stdin.take().unwrap();
    let stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    let (tx, lines) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in stdout.lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    Peer {
        stdin,
        lines,
        _proc: Proc(child),
    }
}

/// Sends SIGTERM to `child`.
pub fn sigterm(child: &Child) {
    signal(child, "TERM");
}

/// Sends the signal `name` (`TERM`, `KILL`, `STOP`, `USR1`…) to `child`.
pub fn signal(child: &Child, name: &str) {
    let pid = child.id().to_string();
    let sent = Command::new("kill")
        .args([&format!("-{name}"), &pid])
        .status()
        .unwrap();
    assert!(sent.success(), "kill -{name} {pid}");
}

/// One HTTP/1.1 exchange with `Connection: close`; `None` while nothing listens.
pub fn http(port: u16, method: &str, path: &str, body: &str) -> Option<(u16, String)> {
    let (status, raw) = http_with_headers(port, method, path, &[], body)?;
    let (_, body) = raw.split_once("\r\n\r\n")?;
    Some((status, body.to_owned()))
}

/// As [`http`], sending the request `headers` too, with the response head (status line and
/// headers) before the body.
pub fn http_with_headers(
    port: u16,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Option<(u16, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(DEADLINE)).ok()?;
    let extra: String = headers
        .iter()
        .map(|(k, v)| format!("{k}: {v}\r\n"))
        .collect();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\
         Content-Type: application/json\r\n{extra}Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).ok()?;
    let mut raw = String::new();
    s.read_to_string(&mut raw).ok()?;
    let status = raw.split(' ').nth(1)?.parse().ok()?;
    Some((status, raw))
}

/// `GET path` as JSON when it answers 200.
pub fn get_json(port: u16, path: &str) -> Option<Value> {
    let (status, body) = http(port, "GET", path, "")?;
    (status == 200).then(|| serde_json::from_str(&body).ok())?
}

/// Polls `probe` until it holds (the observed state is another process's).
pub fn eventually(what: &str, mut probe: impl FnMut() -> bool) {
    let start = Instant::now();
    while !probe() {
        assert!(start.elapsed() < DEADLINE, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Sends a streaming `POST /v1/completions` of `body` to `port` and reads until its first SSE
/// event. Returns the socket (read timeout [`DEADLINE`], `Connection: close`, so reading to the
/// end ends with the stream) and what was read so far, status line included.
pub fn open_stream(port: u16, body: &str) -> (TcpStream, Vec<u8>) {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
    stream.set_read_timeout(Some(DEADLINE)).unwrap();
    write!(
        stream,
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains("data: {") {
        let n = stream.read(&mut buf).unwrap();
        assert!(n > 0, "the stream closed before its first event");
        seen.extend_from_slice(&buf[..n]);
    }
    (stream, seen)
}

/// `infera worker mock` on `port` (16-token blocks), registering itself in the etcd at `etcd`:
/// the command every fleet of these tests starts its workers from, transports to be added.
pub fn mock_worker_command(tok: &str, etcd: &str, port: u16) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_infera"));
    cmd.args(["worker", "mock", "--model-path", tok, "--host", "127.0.0.1"])
        .args(["--port", &port.to_string(), "--block-size", "16"])
        .args(["--discovery-backend", "etcd", "--etcd-endpoint", etcd]);
    cmd
}

/// Starts `infera worker mock` on `port`, registering itself in etcd, serving requests over
/// HTTP and publishing KV events on ZeroMQ, with `extra` flags.
pub fn mock_worker(tok: &str, etcd: &str, port: u16, extra: &[&str]) -> Proc {
    Proc(
        mock_worker_command(tok, etcd, port)
            .args(["--request-transport", "http", "--kv-event-transport", "zmq"])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    )
}

/// `infera server` on `port`, discovering workers in etcd, requests over HTTP and KV events
/// over ZeroMQ, with `extra` flags, its output discarded.
pub fn server_command(tok: &str, etcd: &str, port: u16, extra: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_infera"));
    cmd.args([
        "server",
        "--router-tokenizer-path",
        tok,
        "--host",
        "127.0.0.1",
    ])
    .args(["--port", &port.to_string()])
    .args(["--discovery-backend", "etcd", "--etcd-endpoint", etcd])
    .args(["--request-transport", "http", "--kv-event-transport", "zmq"])
    .args(extra)
    .stdout(Stdio::null())
    .stderr(Stdio::null());
    cmd
}

/// Starts [`server_command`].
pub fn server(tok: &str, etcd: &str, port: u16, extra: &[&str]) -> Proc {
    Proc(server_command(tok, etcd, port, extra).spawn().unwrap())
}

/// Two `infera server` replicas sharing a JetStream event log, in front of mock workers, all
/// discovered through one etcd; everything stops when this is dropped.
pub struct Replicas {
    pub etcd: infera_backends::testing::EtcdServer,
    pub nats: infera_backends::testing::NatsServer,
    /// The mock workers' ports.
    pub workers: Vec<u16>,
    /// The servers' ports.
    pub ports: [u16; 2],
    _procs: Vec<Proc>,
}

/// Starts etcd, nats-server, `workers` mock workers with `worker_flags`, and two servers whose
/// event log is JetStream stream `stream`, with `server_flags`; returns once both servers see
/// every worker.
pub async fn replicas(
    tok: &str,
    stream: &str,
    workers: usize,
    worker_flags: &[&str],
    server_flags: &[&str],
) -> Replicas {
    let etcd = infera_backends::testing::EtcdServer::start()
        .await
        .expect("etcd starts");
    let nats = infera_backends::testing::NatsServer::start()
        .await
        .expect("nats-server starts");
    let log = format!("{}?stream={stream}&max_bytes=64MiB", nats.url());
    let worker_ports: Vec<u16> = (0..workers).map(|_| free_mock_port()).collect();
    let mut procs: Vec<Proc> = worker_ports
        .iter()
        .map(|p| mock_worker(tok, &etcd.endpoint(), *p, worker_flags))
        .collect();
    let ports = [free_port(), free_port()];
    let mut flags = vec!["--event-log", log.as_str()];
    flags.extend_from_slice(server_flags);
    procs.extend(
        ports
            .iter()
            .map(|p| server(tok, &etcd.endpoint(), *p, &flags)),
    );
    for port in ports {
        eventually("every worker to be discovered", || {
            get_json(port, "/health").is_some_and(|h| h["active_workers"] == workers)
        });
    }
    Replicas {
        etcd,
        nats,
        workers: worker_ports,
        ports,
        _procs: procs,
    }
}

/// A vLLM-shaped batch storing `blocks` blocks with engine hashes `first..first + blocks`.
pub fn stored(first: u64, blocks: u64) -> EngineBatch {
    EngineBatch {
        ts: 1.0,
        events: vec![EngineEvent::BlockStored {
            block_hashes: (first..first + blocks).map(EngineHash).collect(),
            parent: None,
            token_ids: (16 * first as u32..16 * (first + blocks) as u32).collect(),
            block_size: 16,
            tier: Tier::Gpu,
            lora_id: None,
            lora_name: None,
            extra_keys: None,
            cache_salt: None,
            indexable: true,
        }],
        ..EngineBatch::default()
    }
}

/// The sum of every sample of `name`, whatever its other labels, in a Prometheus text
/// exposition; `None` when it has none. `name` may end with its first labels, unclosed
/// (`family{router="disagg"`).
pub fn metric_in(text: &str, name: &str) -> Option<u64> {
    let follows: &[char] = if name.contains('{') {
        &[',', '}']
    } else {
        &[' ', '{']
    };
    let mut sum = None;
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        if !rest.starts_with(follows) {
            continue;
        }
        if let Some(v) = rest.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) {
            *sum.get_or_insert(0) += v as u64;
        }
    }
    sum
}

/// [`metric_in`] of the `/metrics` page at `port`; `None` while nothing answers there.
pub fn metric(port: u16, name: &str) -> Option<u64> {
    let (_, text) = http(port, "GET", "/metrics", "")?;
    metric_in(&text, name)
}

/// The router's picks of the mixed worker on loopback port `worker`, from the server on `port`.
pub fn picks(port: u16, worker: u16) -> u64 {
    let name =
        format!("infera_router_picks_total{{role=\"mixed\",worker_id=\"127.0.0.1:{worker}\"");
    metric(port, &name).unwrap_or(0)
}

/// Registers `record` in the etcd at `endpoint`, as a worker launcher does; the registration
/// lasts as long as the returned handle.
pub async fn register_in_etcd(endpoint: &str, record: &WorkerRecord) -> Registration {
    let discovery = EtcdDiscovery::connect(EtcdConfig::new([endpoint]))
        .await
        .unwrap();
    discovery.register(record).await.unwrap()
}

/// Registers in the etcd at `endpoint` a worker `id` (`host:port`) serving `model` over HTTP
/// with no KV events: an engine the test plays itself. Lasts as long as the returned handle.
pub async fn register_standin(endpoint: &str, id: &str, model: &str) -> Registration {
    let mut record = infera_backends::testing::sample_record(id);
    record.model_name = model.to_owned();
    record.kv_events_endpoint = None;
    register_in_etcd(endpoint, &record).await
}

/// The KV blocks the server on `port` indexes, per worker.
pub fn cached_blocks(port: u16) -> Vec<u64> {
    get_json(port, "/v1/workers").map_or_else(Vec::new, |w| {
        w["data"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|w| w["load"][0]["cached_blocks"].as_u64().unwrap_or(0))
            .collect()
    })
}

/// The cache hits the router on `port` predicted so far (blocks, summed over picks).
pub fn predicted_hits(port: u16) -> u64 {
    metric(port, "infera_router_pick_cache_hits_sum").unwrap_or(0)
}

/// Reads the stderr of `kvd` (an `infera kvd` spawned with it piped) until the daemon says it
/// listens; fails the test if it exits first.
pub fn until_kvd_listens(kvd: &mut Child) {
    let mut log = std::io::BufReader::new(kvd.stderr.take().unwrap());
    let mut line = String::new();
    while !line.contains("kvd listening") {
        line.clear();
        assert!(
            log.read_line(&mut line).unwrap() > 0,
            "kvd exited before listening"
        );
    }
}
