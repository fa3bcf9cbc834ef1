//! The extension's Rust core (`Core`, `Lease`, `Slot`) against an in-process daemon, without a
//! Python interpreter: batched calls, the arena's reserve/commit and lookup, reconnecting after
//! a daemon restart, and the deadline on a daemon that never answers. The Python tests
//! (`kvd/python/tests`, run by `cargo xtask test`) drive the same code through Python.

#![allow(clippy::unwrap_used)]

use bytes::Bytes;
use infera_core::event::Retention;
use infera_kvd::{KvdOptions, KvdServer, Namespace, ShutdownHandle};
use infera_kvd_py::client::{Core, Options};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// A daemon on its own thread and runtime (`Core` blocks on its own runtime, so the test
/// thread must not be inside one).
struct Server {
    stop: ShutdownHandle,
    thread: std::thread::JoinHandle<()>,
}

impl Server {
    fn start(path: &Path) -> Self {
        let mut options = KvdOptions::new(path, 64 << 20);
        options.shared_arena_bytes = 16 << 20;
        options.arena_slot_bytes = Some(64 << 10);
        let (tx, rx) = std::sync::mpsc::channel();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                let server = KvdServer::bind(options).await.unwrap();
                tx.send(server.shutdown_handle()).unwrap();
                server.serve().await.unwrap();
            });
        });
        let stop = rx.recv().unwrap();
        Self { stop, thread }
    }

    fn stop(self) {
        self.stop.shutdown();
        self.thread.join().unwrap();
    }
}

fn core(path: PathBuf, deadline: Duration) -> Core {
    Core::new(Options {
        path,
        client_id: "core-test".into(),
        deadline,
        shared_arena: true,
        pin: true,
    })
    .unwrap()
}

fn ns() -> Namespace {
    Namespace::new("m", "c")
}

fn keys(names: &[&str]) -> Vec<Bytes> {
    names
        .iter()
        .map(|n| Bytes::copy_from_slice(n.as_bytes()))
        .collect()
}

#[test]
fn batched_calls_and_the_arena_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kvd.sock");
    let server = Server::start(&path);
    let mut c = core(path, Duration::from_secs(5));
    let ack = c.hello().unwrap();
    assert!(ack.shared_arena.is_some());

    let items = vec![(keys(&["a"])[0].clone(), Bytes::from_static(b"alpha"))];
    assert_eq!(
        c.set(&ns(), items, Retention::Long, Some(60.0)).unwrap(),
        [true]
    );
    assert_eq!(c.exists(&ns(), keys(&["a", "b"])).unwrap(), [true, false]);

    let lease = c.reserve(1000).unwrap().expect("an arena lease");
    lease.write(&[7u8; 1000]).unwrap();
    assert!(
        lease.write(&vec![0u8; 1 << 20]).is_err(),
        "bigger than the lease"
    );
    assert!(
        c.reserve(1 << 20).unwrap().is_none(),
        "larger than a slot: no lease"
    );
    let key = keys(&["b"])[0].clone();
    assert!(
        c.commit(&ns(), &lease, key.clone(), 1000, Retention::Short, 0)
            .unwrap()
    );
    assert!(
        !c.commit(&ns(), &lease, key, 1000, Retention::Short, 0)
            .unwrap(),
        "once"
    );

    assert_eq!(
        c.get(&ns(), keys(&["b", "zz"])).unwrap(),
        [Some(Bytes::from(vec![7u8; 1000])), None]
    );
    let found = c.lookup(&ns(), keys(&["a", "b", "zz"])).unwrap();
    assert!(found[0].as_ref().is_some_and(|s| s.is_valid()));
    assert!(found[1].as_ref().is_some_and(|s| s.is_valid()));
    assert!(found[2].is_none());
    let (arena, backend, why, reconnects) = c.arena_info();
    assert_eq!(arena.map(|a| a.0), Some(16 << 20));
    // Without a CUDA driver the arena stays plain memory, and says why; never an error.
    assert!(backend == "cuda" || why.is_some());
    assert_eq!(reconnects, 0);
    server.stop();
}

#[test]
fn a_restarted_daemon_costs_one_failed_call_and_old_leases_die() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kvd.sock");
    let server = Server::start(&path);
    let mut c = core(path.clone(), Duration::from_secs(5));
    let lease = c.reserve(100).unwrap().unwrap();
    server.stop();
    let error = c.exists(&ns(), keys(&["a"])).unwrap_err();
    assert!(error.is_retryable(), "{error}");
    let server = Server::start(&path);
    assert_eq!(c.exists(&ns(), keys(&["a"])).unwrap(), [false]);
    let key = keys(&["late"])[0].clone();
    assert!(
        !c.commit(&ns(), &lease, key, 100, Retention::Short, 0)
            .unwrap()
    );
    assert_eq!(c.arena_info().3, 1, "one reconnect");
    server.stop();
}

#[test]
fn a_daemon_that_never_answers_fails_the_call_at_the_deadline() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("mute.sock");
    let _mute = std::os::unix::net::UnixListener::bind(&path).unwrap();
    let mut c = core(path, Duration::from_millis(200));
    let error = c.hello().unwrap_err();
    assert!(
        error.is_retryable() && error.to_string().contains("no reply within"),
        "{error}"
    );
}
