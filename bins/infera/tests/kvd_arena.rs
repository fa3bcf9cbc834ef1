//! `infera kvd` end to end with its shared arena (on by default: `--shared-arena-bytes auto`
//! is `--max-bytes`): a client maps the daemon's memfd, writes through `set_reserve` /
//! `set_commit` and reads zero-copy, while an inline client sees the same bytes.

#![allow(clippy::unwrap_used)]

mod common;

use bytes::Bytes;
use infera_core::event::Retention;
use infera_kvd::client::SharedGet;
use infera_kvd::{KvdClient, Namespace};
use std::process::{Command, Stdio};

#[tokio::test]
async fn the_binary_serves_its_arena_to_clients() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("kvd.sock");
    let mut child = Command::new(env!("CARGO_BIN_EXE_infera"))
        .args(["kvd", "--socket"])
        .arg(&socket)
        .args(["--max-bytes", "64MiB", "--kv-events-endpoint", "off"])
        .env_remove("RUST_LOG")
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    common::until_kvd_listens(&mut child);
    let ns = Namespace::new("e2e", "");
    let (mut shared, ack) = KvdClient::connect_shared(&socket, "e2e").await.unwrap();
    let [size, _, pid] = ack.shared_arena.unwrap();
    assert_eq!((size, pid), (64 << 20, u64::from(child.id())));
    let value: Vec<u8> = (0..1 << 20).map(|i| (i % 251) as u8).collect();
    let put = shared
        .put(&ns, Bytes::from_static(b"k"), &value, Retention::Long, None)
        .await
        .unwrap();
    assert!(put.accepted, "{put:?}");
    let Some(SharedGet::Slot(slot)) = shared.get_shared(&ns, b"k").await.unwrap() else {
        panic!("an arena-resident value comes back as an offset");
    };
    let same = shared
        .arena()
        .unwrap()
        .read(&slot, |b| b == value.as_slice());
    assert_eq!(same, Some(true));
    let mut inline = KvdClient::connect(&socket).await.unwrap();
    assert_eq!(inline.get(&ns, b"k").await.unwrap().unwrap().value, value);

    let kill = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    assert_eq!(child.wait().unwrap().code(), Some(0));
    assert!(!socket.exists());
}
