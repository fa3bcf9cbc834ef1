//! The daemon over a real Unix socket: every op through the Rust client, pipelining, broken
//! frames, socket ownership and shutdown, TTL sweeping on paused time, and an independent
//! Python peer (`peers/kvd_client.py`).

#![allow(clippy::unwrap_used)] // test helpers outside #[test] fns

mod common;

use bytes::Bytes;
use common::{assert_closed, field, raw_reply};
use infera_core::event::Retention;
use infera_kvd::proto::{Request, Response};
use infera_kvd::{KvdClient, KvdOptions, KvdServer, Namespace, SetItem, ShutdownHandle};
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use tokio::net::UnixStream;
use tokio::task::JoinHandle;

struct Daemon {
    _dir: tempfile::TempDir,
    path: PathBuf,
    stop: ShutdownHandle,
    task: JoinHandle<Result<(), infera_kvd::KvdError>>,
    sweeps: tokio::sync::watch::Receiver<u64>,
}

impl Daemon {
    async fn start(configure: impl FnOnce(&mut KvdOptions)) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kvd.sock");
        let mut options = KvdOptions::new(&path, 1 << 20);
        options.server_id = Some("kvd-test".into());
        configure(&mut options);
        let server = KvdServer::bind(options).await.unwrap();
        let stop = server.shutdown_handle();
        let sweeps = server.sweeps();
        let task = tokio::spawn(server.serve());
        Self {
            _dir: dir,
            path,
            stop,
            task,
            sweeps,
        }
    }

    async fn client(&self) -> KvdClient {
        KvdClient::connect(&self.path).await.unwrap()
    }

    async fn stop(self) {
        self.stop.shutdown();
        self.task.await.unwrap().unwrap();
        assert!(!self.path.exists(), "shutdown removes the socket");
    }
}

fn ns() -> Namespace {
    Namespace::new("llama", "fp8")
}

fn key(s: &str) -> Bytes {
    Bytes::copy_from_slice(s.as_bytes())
}

#[tokio::test]
async fn every_op_through_the_rust_client() {
    let daemon = Daemon::start(|_| {}).await;
    let mut c = daemon.client().await;
    let hello = c.hello("test").await.unwrap();
    assert_eq!(hello.server_id, "kvd-test");
    assert_eq!(hello.protocol_version, 1);
    assert_eq!(hello.shared_arena, None);

    assert_eq!(c.get(&ns(), b"a").await.unwrap(), None);
    let ack = c
        .set(
            &ns(),
            SetItem::new(key("a"), vec![1u8; 1000]).retention(Retention::Long),
        )
        .await
        .unwrap();
    assert!(ack.accepted && ack.reason.is_none());
    let hit = c.get(&ns(), b"a").await.unwrap().unwrap();
    assert_eq!(hit.value, vec![1u8; 1000]);
    assert_eq!(hit.retention, Some(Retention::Long));
    // Another namespace does not see it.
    assert_eq!(c.get(&Namespace::default(), b"a").await.unwrap(), None);

    let acks = c
        .batch_set(
            &ns(),
            vec![
                SetItem::new(key("b"), &b"bee"[..]),
                SetItem::new(key("a"), &b"lower"[..]).retention(Retention::Ephemeral),
                SetItem::new(key("c"), &b"sea"[..]).ttl_seconds(60.0),
            ],
        )
        .await
        .unwrap();
    let accepted: Vec<bool> = acks.iter().map(|a| a.accepted).collect();
    assert_eq!(accepted, [true, false, true]);
    assert_eq!(
        acks[1].reason.as_deref(),
        Some("retention_downgrade_not_allowed")
    );

    let got = c
        .batch_get(&ns(), vec![key("b"), key("zz"), key("c")])
        .await
        .unwrap();
    assert_eq!(got[0].as_ref().unwrap().value, &b"bee"[..]);
    assert_eq!(got[0].as_ref().unwrap().retention, Some(Retention::Short));
    assert!(got[1].is_none());
    assert_eq!(got[2].as_ref().unwrap().value, &b"sea"[..]);
    assert_eq!(
        c.exists(&ns(), vec![key("a"), key("q"), key("c")])
            .await
            .unwrap(),
        [true, false, true]
    );

    c.prefetch_hint(&ns(), vec![key("a")], 100).await.unwrap();
    let reservation = c.set_reserve(4096).await.unwrap();
    assert_eq!(
        (reservation.lease_token, reservation.reason.as_str()),
        (0, "no_arena")
    );
    let commit = c
        .set_commit(&ns(), 1, key("a"), 3, Retention::Short, 0)
        .await
        .unwrap();
    assert_eq!(commit, (false, "no_arena".to_owned()));
    c.set_cancel(1).await.unwrap();

    let stats = c.stats(false).await.unwrap();
    assert_eq!(stats.entries, 3);
    assert_eq!(stats.host_bytes, 1000 + 3 + 3);
    assert_eq!(stats.sets_total, 4);
    assert_eq!(
        (stats.gets_total, stats.hits_total, stats.misses_total),
        (6, 3, 3)
    );
    assert_eq!(stats.extended, None);
    let ext = c.stats(true).await.unwrap().extended.unwrap();
    assert_eq!(ext.rejected_total, 1);
    assert_eq!(
        ext.prefetch_hints_total, 1,
        "the one-way hint arrived before stats"
    );
    assert_eq!(ext.class_entries, [0, 0, 2, 1]);
    assert_eq!(ext.max_bytes, 1 << 20);

    assert_eq!(c.clear(&Namespace::new("other", "")).await.unwrap(), 0);
    assert_eq!(c.clear(&ns()).await.unwrap(), 3);
    assert_eq!(c.stats(false).await.unwrap().entries, 0);
    daemon.stop().await;
}

#[tokio::test]
async fn a_short_write_cannot_evict_long_over_the_wire() {
    let daemon = Daemon::start(|o| o.max_bytes = 2 * (1000 + 1 + 5 + 128)).await;
    let mut c = daemon.client().await;
    for k in ["a", "b"] {
        let item = SetItem::new(key(k), vec![0u8; 1000]).retention(Retention::Long);
        assert!(
            c.set(&Namespace::new("m", ""), item)
                .await
                .unwrap()
                .accepted
        );
    }
    let ack = c
        .set(
            &Namespace::new("m", ""),
            SetItem::new(key("c"), vec![0u8; 1000]),
        )
        .await
        .unwrap();
    assert!(!ack.accepted);
    assert_eq!(
        ack.reason.as_deref(),
        Some("would_displace_higher_priority")
    );
    daemon.stop().await;
}

#[tokio::test]
async fn pipelined_requests_are_answered_in_order_with_their_ids() {
    let daemon = Daemon::start(|_| {}).await;
    let mut c = daemon.client().await;
    let requests: Vec<Request> = (0..20u64)
        .map(|i| {
            if i % 2 == 0 {
                Request::Set {
                    ns: ns(),
                    item: SetItem::new(i.to_be_bytes().to_vec(), vec![i as u8; 10]),
                }
            } else {
                Request::Get {
                    ns: ns(),
                    key: Bytes::copy_from_slice(&(i - 1).to_be_bytes()),
                }
            }
        })
        .collect();
    for (i, r) in requests.iter().enumerate() {
        c.send(r, Some(&rmpv::Value::from(i as u64 * 7)))
            .await
            .unwrap();
    }
    for i in 0..20u64 {
        let reply = c.recv().await.unwrap();
        assert_eq!(reply.id, Some(rmpv::Value::from(i * 7)));
        match reply.response {
            Response::SetAck(ack) => assert!(ack.accepted && i % 2 == 0),
            Response::Get { value, .. } => assert_eq!(value.unwrap(), vec![(i - 1) as u8; 10]),
            other => panic!("unexpected {other:?}"),
        }
    }
    daemon.stop().await;
}

#[tokio::test]
async fn broken_frames_get_an_error_and_a_close_while_others_keep_working() {
    let daemon = Daemon::start(|o| o.max_frame_bytes = 1 << 16).await;
    let mut good = daemon.client().await;
    good.set(&ns(), SetItem::new(key("k"), &b"v"[..]))
        .await
        .unwrap();

    // Oversized: the length alone is refused.
    let mut s = UnixStream::connect(&daemon.path).await.unwrap();
    s.write_all(&(1u32 << 20).to_be_bytes()).await.unwrap();
    let reply = raw_reply(&mut s).await.unwrap();
    assert_eq!(field(&reply, "op").as_str(), Some("error"));
    assert_eq!(field(&reply, "code").as_str(), Some("frame_too_large"));
    assert_closed(&mut s).await;

    // Garbage: a well-delimited body that is not a msgpack map.
    for body in [&[0x93u8, 1, 2, 3][..], &[0xc1][..], &[][..]] {
        let mut s = UnixStream::connect(&daemon.path).await.unwrap();
        s.write_all(&(body.len() as u32).to_be_bytes())
            .await
            .unwrap();
        s.write_all(body).await.unwrap();
        let reply = raw_reply(&mut s).await.unwrap();
        assert_eq!(field(&reply, "code").as_str(), Some("bad_frame"));
        assert_closed(&mut s).await;
    }

    // Truncated: the writer half-closes inside a frame; the reply still arrives.
    let mut s = UnixStream::connect(&daemon.path).await.unwrap();
    s.write_all(&100u32.to_be_bytes()).await.unwrap();
    s.write_all(&[0x80; 10]).await.unwrap();
    s.shutdown().await.unwrap();
    let reply = raw_reply(&mut s).await.unwrap();
    assert_eq!(field(&reply, "code").as_str(), Some("truncated_frame"));
    assert_closed(&mut s).await;

    // A well-formed map with a bad op or field: error, and the connection stays.
    let mut s = UnixStream::connect(&daemon.path).await.unwrap();
    for (map, code) in [
        (vec![("op", rmpv::Value::from("frobnicate"))], "unknown_op"),
        (
            vec![
                ("op", rmpv::Value::from("get")),
                ("key", rmpv::Value::from(5)),
            ],
            "bad_request",
        ),
        (
            vec![
                ("op", rmpv::Value::from("set")),
                ("key", rmpv::Value::from(&b"k"[..])),
                ("value", rmpv::Value::from(&b"v"[..])),
                ("retention", rmpv::Value::from("forever")),
            ],
            "bad_request",
        ),
    ] {
        let map = rmpv::Value::Map(
            map.into_iter()
                .map(|(k, v)| (rmpv::Value::from(k), v))
                .collect(),
        );
        let mut body = Vec::new();
        rmpv::encode::write_value(&mut body, &map).unwrap();
        s.write_all(&(body.len() as u32).to_be_bytes())
            .await
            .unwrap();
        s.write_all(&body).await.unwrap();
        let reply = raw_reply(&mut s).await.unwrap();
        assert_eq!(field(&reply, "code").as_str(), Some(code), "{reply}");
        assert!(field(&reply, "message").as_str().unwrap().len() > 10);
    }
    let mut body = Vec::new();
    let stats = rmpv::Value::Map(vec![(rmpv::Value::from("op"), rmpv::Value::from("stats"))]);
    rmpv::encode::write_value(&mut body, &stats).unwrap();
    s.write_all(&(body.len() as u32).to_be_bytes())
        .await
        .unwrap();
    s.write_all(&body).await.unwrap();
    let reply = raw_reply(&mut s).await.unwrap();
    assert_eq!(field(&reply, "op").as_str(), Some("stats_response"));
    let keys: Vec<&str> = reply
        .as_map()
        .unwrap()
        .iter()
        .filter_map(|(k, _)| k.as_str())
        .collect();
    assert_eq!(keys.len(), 10, "upstream's fields only: {keys:?}");

    // The first client never noticed.
    let hit = good.get(&ns(), b"k").await.unwrap().unwrap();
    assert_eq!(hit.value, &b"v"[..]);
    daemon.stop().await;
}

#[tokio::test]
async fn the_socket_is_0700_exclusive_and_replaces_a_stale_one() {
    let daemon = Daemon::start(|_| {}).await;
    let mode = std::fs::metadata(&daemon.path)
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o700);
    let second = KvdServer::bind(KvdOptions::new(&daemon.path, 1 << 20)).await;
    assert!(
        matches!(second, Err(infera_kvd::KvdError::AlreadyRunning(_))),
        "{second:?}"
    );
    let path = daemon.path.clone();
    let dir = tempfile::tempdir().unwrap();

    // A stale socket (bound, nobody accepting) is replaced.
    let stale = dir.path().join("stale.sock");
    drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
    let server = KvdServer::bind(KvdOptions::new(&stale, 1 << 20))
        .await
        .unwrap();
    drop(server);
    // A regular file is never touched.
    let file = dir.path().join("file");
    std::fs::write(&file, b"x").unwrap();
    let refused = KvdServer::bind(KvdOptions::new(&file, 1 << 20)).await;
    assert!(matches!(refused, Err(infera_kvd::KvdError::NotASocket(_))));
    assert_eq!(std::fs::read(&file).unwrap(), b"x");

    // Shutdown with a client connected still completes and removes the socket.
    let _idle = daemon.client().await;
    daemon.stop().await;
    assert!(!path.exists());
}

#[tokio::test(start_paused = true)]
async fn ttl_expiry_is_swept_on_paused_time() {
    // The client idles through the TTL: no idle timeout here (it has its own test).
    let mut daemon = Daemon::start(|o| {
        o.sweep_interval = Duration::from_secs(1);
        o.idle_timeout = None;
    })
    .await;
    let mut c = daemon.client().await;
    let item = SetItem::new(key("t"), vec![0u8; 100]).ttl_seconds(600.0);
    assert!(c.set(&ns(), item).await.unwrap().accepted);
    let before = c.stats(true).await.unwrap();
    assert_eq!(before.entries, 1);
    assert!(before.extended.unwrap().accounted_bytes > 100);

    tokio::time::advance(Duration::from_secs(601)).await;
    let seen = *daemon.sweeps.borrow_and_update();
    daemon.sweeps.wait_for(|n| *n > seen).await.unwrap();
    let after = c.stats(true).await.unwrap();
    assert_eq!(after.entries, 0, "the sweeper reclaimed it without a get");
    let ext = after.extended.unwrap();
    assert_eq!((ext.expired_total, ext.accounted_bytes), (1, 0));
    daemon.stop().await;
}

#[tokio::test]
async fn the_python_peer_speaks_the_same_protocol() {
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
    let daemon = Daemon::start(|_| {}).await;
    let peer = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/peers/kvd_client.py");
    let out = tokio::process::Command::new(&python)
        .arg(peer)
        .arg(&daemon.path)
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "python peer failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("python peer: ok"));
    // What Python wrote, Rust reads.
    let mut c = daemon.client().await;
    let hit = c
        .get(&Namespace::new("py-model", ""), b"py-key-1")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(hit.value, &b"value-1"[..]);
    assert_eq!(hit.retention, Some(Retention::Long));
    daemon.stop().await;
}
