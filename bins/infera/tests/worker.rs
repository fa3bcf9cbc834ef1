//! `infera worker {vllm,sglang,atom,mock}` end to end with the real binary and a real etcd.
//!
//! The real engines are replaced by a stand-in executable (`tests/peers/engine_standin.sh`)
//! that records its argv, environment and pid, then execs `infera mock-engine` with the same
//! arguments: the launcher's exact command line and injected settings are asserted from the
//! record, and the engine it started really serves, publishes KV events and gets stopped.
//!
//! The worker is another process; its registration is observed through an etcd watch (a
//! stream: no polling), its HTTP readiness by probing under a deadline.
#![allow(clippy::unwrap_used)]

mod common;

use common::{DEADLINE, Proc, eventually, free_port, http, sigterm, tokenizer_dir};

use infera_backends::discovery::{
    Discovery as _, DiscoveryChange, DiscoveryStream, EtcdConfig, EtcdDiscovery,
};
use infera_backends::testing::EtcdServer;
use infera_core::event::{Engine, Role, WorkerRecord};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

fn standin() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/peers/engine_standin.sh")
}

/// A fresh etcd and a watch of its worker records.
async fn etcd_and_watch() -> (EtcdServer, DiscoveryStream) {
    let etcd = EtcdServer::start().await.expect("etcd starts");
    let discovery = EtcdDiscovery::connect(EtcdConfig::new([etcd.endpoint()]))
        .await
        .unwrap();
    let stream = discovery.watch().await.unwrap();
    (etcd, stream)
}

async fn next_change(stream: &mut DiscoveryStream) -> DiscoveryChange {
    tokio::time::timeout(DEADLINE, stream.recv())
        .await
        .expect("a discovery change in time")
        .expect("the stream stays open")
}

async fn registered(stream: &mut DiscoveryStream) -> WorkerRecord {
    match next_change(stream).await {
        DiscoveryChange::Registered(record) => record,
        other => panic!("expected a registration, got {other:?}"),
    }
}

fn pid_alive(pid: &str) -> bool {
    Path::new("/proc").join(pid).exists()
        && !std::fs::read_to_string(Path::new("/proc").join(pid).join("stat"))
            .is_ok_and(|stat| stat.split(' ').nth(2) == Some("Z"))
}

/// What the stand-in recorded: argv (one per line), environment (`K=V` lines) and pid.
struct Recorded {
    argv: Vec<String>,
    env: Vec<String>,
    pid: String,
}

fn recorded(dir: &Path) -> Recorded {
    let read = |name: &str| std::fs::read_to_string(dir.join(name)).unwrap();
    Recorded {
        argv: read("argv").lines().map(str::to_owned).collect(),
        env: read("env").lines().map(str::to_owned).collect(),
        pid: read("pid").trim().to_owned(),
    }
}

struct Launched {
    worker: Proc,
    record: WorkerRecord,
    seen: Recorded,
    port: u16,
}

impl Drop for Launched {
    /// A failed assertion SIGKILLs the worker, which cannot stop its engine then (the engine
    /// runs in its own process group): stop the engine's group here so nothing is left behind.
    fn drop(&mut self) {
        if pid_alive(&self.seen.pid) {
            let _ = Command::new("kill")
                .args(["-KILL", "--", &format!("-{}", self.seen.pid)])
                .status();
        }
    }
}

/// Starts `infera worker <engine> … --engine-cmd <stand-in>` and waits for its registration.
async fn launch(
    etcd: &EtcdServer,
    stream: &mut DiscoveryStream,
    dir: &Path,
    engine: &str,
    flags: &[&str],
) -> Launched {
    let port = free_port();
    let port_flag = if engine == "atom" {
        "--server-port"
    } else {
        "--port"
    };
    let model_flag = if engine == "sglang" {
        "--model-path"
    } else {
        "--model"
    };
    let tok = tokenizer_dir();
    let worker = Proc(
        Command::new(env!("CARGO_BIN_EXE_infera"))
            .args(["worker", engine, model_flag, &tok, "--host", "127.0.0.1"])
            .args([port_flag, &port.to_string()])
            .args([
                "--discovery-backend",
                "etcd",
                "--etcd-endpoint",
                &etcd.endpoint(),
            ])
            .args(["--request-transport", "http", "--kv-event-transport", "zmq"])
            .args(["--drain-timeout", "10s"])
            .arg("--engine-cmd")
            .arg(standin())
            .args(flags)
            .env("STANDIN_DIR", dir)
            .env("INFERA_BIN", env!("CARGO_BIN_EXE_infera"))
            .env_remove("PYTHONHASHSEED")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let record = registered(stream).await;
    Launched {
        worker,
        record,
        seen: recorded(dir),
        port,
    }
}

/// SIGTERM: the record goes first, then the worker and its engine exit cleanly.
async fn stop(mut launched: Launched, stream: &mut DiscoveryStream) {
    sigterm(&launched.worker.0);
    match next_change(stream).await {
        DiscoveryChange::Deregistered { worker, .. } => {
            assert_eq!(worker, launched.record.worker_id);
        }
        other => panic!("expected the worker to leave, got {other:?}"),
    }
    let status = launched.worker.0.wait().unwrap();
    assert!(status.success(), "worker exit: {status:?}");
    assert!(
        !pid_alive(&launched.seen.pid),
        "the engine outlived its worker"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_launcher_runs_registers_serves_and_stops_its_engine() {
    let (etcd, mut stream) = etcd_and_watch().await;
    let dir = tempfile::tempdir().unwrap();
    let launched = launch(
        &etcd,
        &mut stream,
        dir.path(),
        "vllm",
        &[
            "--block-size",
            "16",
            "--served-model-name",
            "chat",
            "--enforce-eager",
        ],
    )
    .await;
    let tok = tokenizer_dir();
    let port = launched.port.to_string();
    let seen = &launched.seen;
    // The exact command line (after --engine-cmd, which replaces `vllm serve`): model, host and
    // port in vLLM's spelling, the forwarded flags in order (an unknown flag such as
    // --enforce-eager too), then the injected KV-events config.
    assert_eq!(
        &seen.argv[..8],
        &[
            "--model",
            &tok,
            "--host",
            "127.0.0.1",
            "--port",
            &port,
            "--block-size",
            "16",
        ]
    );
    assert_eq!(
        &seen.argv[8..11],
        &["--served-model-name", "chat", "--enforce-eager"]
    );
    // The Python launchers' fp8 KV-cache default, then the KV-event publisher.
    assert_eq!(&seen.argv[11..13], &["--kv-cache-dtype", "fp8_e4m3"]);
    assert_eq!(seen.argv[13], "--kv-events-config");
    let kv: Value = serde_json::from_str(&seen.argv[14]).unwrap();
    assert_eq!(kv["publisher"], "zmq");
    assert_eq!(kv["topic"], "kv-events");
    assert_eq!(kv["enable_kv_cache_events"], true);
    assert_eq!(seen.argv.len(), 15);
    assert!(seen.env.iter().any(|l| l == "PYTHONHASHSEED=0"));
    assert!(
        seen.env
            .iter()
            .any(|l| l == "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1")
    );

    // The record: identity, served model, block size resolved from the engine's metrics.
    let record = &launched.record;
    assert_eq!(record.worker_id.as_str(), format!("127.0.0.1:{port}"));
    assert_eq!(record.url, format!("http://127.0.0.1:{port}"));
    assert_eq!(record.model_name, "chat");
    assert_eq!(record.engine, Engine::Vllm);
    assert_eq!(record.disagg_mode, Role::Mixed);
    assert_eq!(record.kv_block_size, 16);
    let events_port = kv["endpoint"].as_str().unwrap().rsplit_once(':').unwrap().1;
    assert_eq!(
        record.kv_events_endpoint.as_deref(),
        Some(format!("tcp://127.0.0.1:{events_port}").as_str())
    );

    // The engine it started serves the served model name.
    let body = r#"{"model": "chat", "prompt": "hello there", "max_tokens": 2}"#;
    let (status, reply) = http(launched.port, "POST", "/v1/completions", body).unwrap();
    assert_eq!(status, 200, "{reply}");
    stop(launched, &mut stream).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_and_atom_launchers_inject_their_own_settings() {
    let (etcd, mut stream) = etcd_and_watch().await;

    let dir = tempfile::tempdir().unwrap();
    let sglang = launch(
        &etcd,
        &mut stream,
        dir.path(),
        "sglang",
        &["--page-size", "32"],
    )
    .await;
    let tok = tokenizer_dir();
    let port = sglang.port.to_string();
    assert_eq!(
        &sglang.seen.argv[..8],
        &[
            "--model-path",
            &tok,
            "--host",
            "127.0.0.1",
            "--port",
            &port,
            "--page-size",
            "32",
        ]
    );
    assert_eq!(&sglang.seen.argv[8..10], &["--kv-cache-dtype", "fp8_e4m3"]);
    let kv: Value = serde_json::from_str(&sglang.seen.argv[11]).unwrap();
    assert_eq!(kv.get("enable_kv_cache_events"), None);
    assert!(
        !sglang
            .seen
            .env
            .iter()
            .any(|l| l.starts_with("PYTHONHASHSEED="))
    );
    assert_eq!(sglang.record.engine, Engine::Sglang);
    assert_eq!(sglang.record.kv_block_size, 32);
    stop(sglang, &mut stream).await;

    let dir = tempfile::tempdir().unwrap();
    // ATOM publishes KV events only when asked, as its Python launcher.
    let atom = launch(
        &etcd,
        &mut stream,
        dir.path(),
        "atom",
        &["--enable-kv-events", "-tp", "1"],
    )
    .await;
    let port = atom.port.to_string();
    assert_eq!(
        &atom.seen.argv[..8],
        &[
            "--model",
            &tok,
            "--host",
            "127.0.0.1",
            "--server-port",
            &port,
            "-tp",
            "1",
        ]
    );
    // ATOM's own --port is its internal distributed port, chosen by the launcher.
    assert_eq!(atom.seen.argv[8], "--port");
    assert_ne!(atom.seen.argv[9], port);
    assert!(atom.seen.env.iter().any(|l| l == "ATOM_KV_EVENTS_ENABLE=1"));
    assert!(
        atom.seen
            .env
            .iter()
            .any(|l| l == "ATOM_KV_EVENTS_TOPIC=kv-events")
    );
    assert_eq!(atom.record.engine, Engine::Atom);
    assert_eq!(atom.record.kv_block_size, 16);
    stop(atom, &mut stream).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_dies_is_deregistered_and_the_worker_fails() {
    let (etcd, mut stream) = etcd_and_watch().await;
    let dir = tempfile::tempdir().unwrap();
    let mut launched = launch(&etcd, &mut stream, dir.path(), "vllm", &[]).await;
    let killed = Command::new("kill")
        .args(["-KILL", &launched.seen.pid])
        .status()
        .unwrap();
    assert!(killed.success());
    assert!(matches!(
        next_change(&mut stream).await,
        DiscoveryChange::Deregistered { .. }
    ));
    let status = launched.worker.0.wait().unwrap();
    assert_eq!(status.code(), Some(1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_whose_launcher_is_killed_stops_too() {
    let (etcd, mut stream) = etcd_and_watch().await;
    let dir = tempfile::tempdir().unwrap();
    let mut launched = launch(&etcd, &mut stream, dir.path(), "vllm", &[]).await;
    // SIGKILL: the launcher gets no chance to stop its engine, which runs in its own process
    // group, so only the parent-death signal can reach it.
    launched.worker.0.kill().unwrap();
    launched.worker.0.wait().unwrap();
    eventually("the engine of a SIGKILLed launcher to exit", || {
        !pid_alive(&launched.seen.pid)
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_never_becomes_healthy_is_stopped_and_reported() {
    let dir = tempfile::tempdir().unwrap();
    let etcd = EtcdServer::start().await.expect("etcd starts");
    let output = Command::new(env!("CARGO_BIN_EXE_infera"))
        .args(["worker", "vllm", "--model", "m", "--host", "127.0.0.1"])
        .args(["--port", &free_port().to_string()])
        .args([
            "--discovery-backend",
            "etcd",
            "--etcd-endpoint",
            &etcd.endpoint(),
        ])
        .args(["--request-transport", "http", "--kv-event-transport", "zmq"])
        .args(["--engine-ready-timeout", "1s", "--engine-cmd"])
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/peers/engine_silent.sh"))
        .env("STANDIN_DIR", dir.path())
        .env_remove("PYTHONHASHSEED")
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("did not answer GET"), "{stderr}");
    assert!(stderr.contains("--engine-ready-timeout"), "{stderr}");
    // The silent engine was stopped with its worker.
    let pid = std::fs::read_to_string(dir.path().join("pid")).unwrap();
    assert!(!pid_alive(pid.trim()), "the engine outlived its worker");

    // An engine that exits at once is reported as such.
    let output = Command::new(env!("CARGO_BIN_EXE_infera"))
        .args([
            "worker",
            "sglang",
            "--model-path",
            "m",
            "--host",
            "127.0.0.1",
        ])
        .args(["--port", &free_port().to_string()])
        .args([
            "--discovery-backend",
            "etcd",
            "--etcd-endpoint",
            &etcd.endpoint(),
        ])
        .args(["--request-transport", "http", "--kv-event-transport", "zmq"])
        .args(["--engine-cmd", "false"])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("exited before it was ready"), "{stderr}");
}

/// A kvd daemon serving on `dir/kvd.sock` in this test's runtime.
async fn kvd_in(dir: &Path) -> (PathBuf, infera_kvd::ShutdownHandle) {
    let socket = dir.join("kvd.sock");
    let server = infera_kvd::KvdServer::bind(infera_kvd::KvdOptions::new(&socket, 64 << 20))
        .await
        .expect("kvd starts");
    let stop = server.shutdown_handle();
    tokio::spawn(server.serve());
    (socket, stop)
}

async fn kvd_stats(socket: &Path) -> infera_kvd::proto::StatsReply {
    let mut client = infera_kvd::KvdClient::connect(socket).await.unwrap();
    client.stats(false).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vllm_launcher_with_kvd_wires_the_connector_and_registers_kvd_backed() {
    let (etcd, mut stream) = etcd_and_watch().await;
    let kvd_dir = tempfile::tempdir().unwrap();
    let (socket, stop_kvd) = kvd_in(kvd_dir.path()).await;
    let socket_text = socket.to_str().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let launched = launch(
        &etcd,
        &mut stream,
        dir.path(),
        "vllm",
        &["--infera-kvd-socket", socket_text],
    )
    .await;
    let seen = &launched.seen;
    assert!(!seen.argv.iter().any(|a| a.contains("infera-kvd-socket")));
    let at = seen
        .argv
        .iter()
        .position(|a| a == "--kv-transfer-config")
        .expect("a --kv-transfer-config");
    let transfer: Value = serde_json::from_str(&seen.argv[at + 1]).unwrap();
    assert_eq!(transfer["kv_connector"], "InferaKvdConnector");
    assert_eq!(
        transfer["kv_connector_module_path"],
        "infera.engine.vllm.kvd_connector"
    );
    assert_eq!(transfer["kv_connector_extra_config"]["socket"], socket_text);
    assert!(
        seen.env
            .iter()
            .any(|l| *l == format!("INFERA_KVD_SOCKET={socket_text}"))
    );
    assert_eq!(
        launched.record.extra.get("kvd_backed"),
        Some(&Value::Bool(true))
    );

    // The engine behind it (the mock, given the socket as a launcher gives it) saves there.
    let before = kvd_stats(&socket).await.sets_total;
    let mut prompt = String::from("kvd-launcher:");
    for i in 0..80 {
        prompt.push_str(&format!(" w{i}"));
    }
    let body = serde_json::json!({"model": tokenizer_dir(), "prompt": prompt, "max_tokens": 2});
    let (status, reply) =
        http(launched.port, "POST", "/v1/completions", &body.to_string()).unwrap();
    assert_eq!(status, 200, "{reply}");
    assert!(kvd_stats(&socket).await.sets_total > before);
    stop(launched, &mut stream).await;
    stop_kvd.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_launcher_whose_kvd_does_not_answer_never_starts_its_engine() {
    let dir = tempfile::tempdir().unwrap();
    let etcd = EtcdServer::start().await.expect("etcd starts");
    let socket = dir.path().join("no-kvd.sock");
    let output = Command::new(env!("CARGO_BIN_EXE_infera"))
        .args([
            "worker",
            "sglang",
            "--model-path",
            "m",
            "--host",
            "127.0.0.1",
        ])
        .args(["--port", &free_port().to_string()])
        .args([
            "--discovery-backend",
            "etcd",
            "--etcd-endpoint",
            &etcd.endpoint(),
        ])
        .args(["--request-transport", "http", "--kv-event-transport", "zmq"])
        .arg("--engine-cmd")
        .arg(standin())
        .arg("--infera-kvd-socket")
        .arg(&socket)
        .env("STANDIN_DIR", dir.path())
        .env("INFERA_BIN", env!("CARGO_BIN_EXE_infera"))
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(1), "{output:?}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains(&format!("kvd at {} did not answer hello", socket.display())),
        "{stderr}"
    );
    assert!(
        !dir.path().join("argv").exists(),
        "the engine was started without kvd"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mock_worker_with_kvd_registers_kvd_backed() {
    let (etcd, mut stream) = etcd_and_watch().await;
    let kvd_dir = tempfile::tempdir().unwrap();
    let (socket, stop_kvd) = kvd_in(kvd_dir.path()).await;
    let port = common::free_mock_port();
    let mut worker = common::mock_worker(
        &tokenizer_dir(),
        &etcd.endpoint(),
        port,
        &["--infera-kvd-socket", socket.to_str().unwrap()],
    );
    let record = registered(&mut stream).await;
    assert_eq!(record.extra.get("kvd_backed"), Some(&Value::Bool(true)));
    sigterm(&worker.0);
    assert!(worker.0.wait().unwrap().success());
    stop_kvd.shutdown();
}
