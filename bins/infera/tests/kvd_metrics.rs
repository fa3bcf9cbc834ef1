//! `infera kvd --metrics-bind`: the daemon's counters at `GET /metrics` while it serves, moving
//! with the traffic it takes; a port already taken stops it at once, naming the flag.

#![allow(clippy::unwrap_used)]

mod common;

use bytes::Bytes;
use common::{Proc, free_port, http, metric};
use infera_core::event::Retention;
use infera_kvd::{KvdClient, Namespace, SetItem};
use std::process::{Command, Stdio};

fn kvd(socket: &std::path::Path, port: u16) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_infera"));
    command
        .args(["kvd", "--socket"])
        .arg(socket)
        .args(["--max-bytes", "64MiB", "--shared-arena-bytes", "0"])
        .args(["--metrics-bind", &format!("127.0.0.1:{port}")])
        .args(["--kv-events-endpoint", "tcp://127.0.0.1:0"])
        .env_remove("RUST_LOG")
        .stderr(Stdio::piped());
    command
}

#[tokio::test]
async fn the_daemon_serves_its_counters_while_it_serves() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("kvd.sock");
    let port = free_port();
    let mut child = Proc(kvd(&socket, port).spawn().unwrap());
    common::until_kvd_listens(&mut child.0);
    // The exporter's listener was bound before the daemon started serving.
    let (status, text) = http(port, "GET", "/metrics", "").expect("an answer");
    assert_eq!(status, 200, "{text}");
    assert!(
        text.contains("# TYPE infera_kvd_sets_total counter"),
        "{text}"
    );
    assert_eq!(metric(port, "infera_kvd_sets_total"), Some(0));
    for family in [
        "# TYPE infera_kvd_inventory_events_total counter",
        "# TYPE infera_kvd_inventory_dropped_total counter",
        "infera_kvd_tier_load_bytes_per_second{tier=\"external\"} 0",
    ] {
        assert!(text.contains(family), "{family}: {text}");
    }

    let ns = Namespace::new("e2e", "");
    let mut client = KvdClient::connect(&socket).await.unwrap();
    let items: Vec<SetItem> = (0..3u8)
        .map(|i| SetItem {
            retention: Retention::Long,
            ..SetItem::new(Bytes::from(vec![i]), Bytes::from_static(b"value"))
        })
        .collect();
    client.batch_set(&ns, items).await.unwrap();
    assert!(client.get(&ns, &[1]).await.unwrap().is_some());
    assert_eq!(metric(port, "infera_kvd_sets_total"), Some(3));
    assert_eq!(metric(port, "infera_kvd_hits_total"), Some(1));
    // The first get is timed once its reply is written, before the daemon reads the next
    // request on the connection: answered, the second get shows the first's speed.
    assert!(client.get(&ns, &[2]).await.unwrap().is_some());
    let host = metric(port, "infera_kvd_tier_load_bytes_per_second{tier=\"host\"");
    assert!(host.is_some_and(|rate| rate > 0), "{host:?}");

    // A second daemon on the same metrics port stops before it serves.
    let other = dir.path().join("other.sock");
    let refused = kvd(&other, port).output().unwrap();
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("--metrics-bind 127.0.0.1:"), "{stderr}");
    assert!(!other.exists());

    assert_eq!(child.terminate().code(), Some(0));
}
