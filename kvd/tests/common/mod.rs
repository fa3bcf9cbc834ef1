//! A daemon on a temporary socket for the integration tests, stopped through its handle, and
//! raw-frame helpers for tests that speak the wire protocol by hand.

#![allow(dead_code, clippy::unwrap_used)]

use infera_kvd::{KvdClient, KvdOptions, KvdServer, ShutdownHandle};
use std::path::PathBuf;
use tokio::io::AsyncReadExt;
use tokio::net::UnixStream;
use tokio::sync::watch;
use tokio::task::JoinHandle;

pub struct Daemon {
    pub dir: tempfile::TempDir,
    pub path: PathBuf,
    pub stop: ShutdownHandle,
    pub task: JoinHandle<Result<(), infera_kvd::KvdError>>,
    pub sweeps: watch::Receiver<u64>,
    pub prefetches: watch::Receiver<u64>,
}

impl Daemon {
    /// Starts a daemon with 1 MiB of L2, configured further by `configure` (which also gets
    /// the temporary directory, for L3 paths).
    pub async fn start(configure: impl FnOnce(&mut KvdOptions, &std::path::Path)) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kvd.sock");
        let mut options = KvdOptions::new(&path, 1 << 20);
        options.server_id = Some("kvd-test".into());
        configure(&mut options, dir.path());
        let server = KvdServer::bind(options).await.unwrap();
        let stop = server.shutdown_handle();
        let sweeps = server.sweeps();
        let prefetches = server.prefetches();
        let task = tokio::spawn(server.serve());
        Self {
            dir,
            path,
            stop,
            task,
            sweeps,
            prefetches,
        }
    }

    pub async fn client(&self) -> KvdClient {
        KvdClient::connect(&self.path).await.unwrap()
    }

    pub async fn shared_client(&self) -> KvdClient {
        let (client, ack) = KvdClient::connect_shared(&self.path, "test").await.unwrap();
        assert!(ack.shared_arena.is_some(), "the daemon offers its arena");
        client
    }

    pub async fn stop(self) -> tempfile::TempDir {
        self.stop.shutdown();
        self.task.await.unwrap().unwrap();
        assert!(!self.path.exists(), "shutdown removes the socket");
        self.dir
    }
}

/// Requires python3 with msgpack (installed by `cargo xtask test`); returns the interpreter.
pub fn python() -> String {
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    let probe = std::process::Command::new(&python)
        .args(["-c", "import msgpack"])
        .output()
        .unwrap_or_else(|e| panic!("{python} is required for this test ({e}); install python3"));
    assert!(
        probe.status.success(),
        "the python peer needs msgpack: run `pip install msgpack` ({})",
        String::from_utf8_lossy(&probe.stderr)
    );
    python
}

/// Runs a python peer script from `tests/peers` against the socket; asserts it printed `ok`.
pub async fn run_peer(script: &str, socket: &std::path::Path) -> String {
    let peer = format!("{}/tests/peers/{script}", env!("CARGO_MANIFEST_DIR"));
    let out = tokio::process::Command::new(python())
        .arg(&peer)
        .arg(socket)
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "python peer {script} failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("python peer: ok"), "{stdout}");
    stdout
}

/// Reads one reply frame; `None` when the stream ends first.
pub async fn raw_reply(stream: &mut UnixStream) -> Option<rmpv::Value> {
    let mut header = [0u8; 4];
    stream.read_exact(&mut header).await.ok()?;
    let mut body = vec![0u8; u32::from_be_bytes(header) as usize];
    stream.read_exact(&mut body).await.ok()?;
    Some(rmpv::decode::read_value(&mut &body[..]).unwrap())
}

/// A field of a decoded reply map.
pub fn field<'a>(v: &'a rmpv::Value, name: &str) -> &'a rmpv::Value {
    v.as_map()
        .unwrap()
        .iter()
        .find(|(k, _)| k.as_str() == Some(name))
        .map(|(_, v)| v)
        .unwrap_or_else(|| panic!("no field {name} in {v}"))
}

/// Asserts the server closed the stream (after its reply, if any).
pub async fn assert_closed(stream: &mut UnixStream) {
    let mut rest = Vec::new();
    stream.read_to_end(&mut rest).await.unwrap();
    assert!(rest.is_empty(), "the server closed after its error reply");
}
