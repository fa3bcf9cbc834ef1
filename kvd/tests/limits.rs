//! Every connection is bounded: idle connections and half-sent frames are closed on (paused)
//! time, connections past `max_connections` are refused with a clear error, batches past
//! `max_batch_keys` are refused without closing the connection, and `prefetch_hint`s are
//! bounded in bytes as well as in count.

#![allow(clippy::unwrap_used)]

mod common;

use bytes::Bytes;
use common::{Daemon, assert_closed, field, raw_reply};
use infera_kvd::proto::{Request, Response};
use infera_kvd::{KvdClient, Namespace};
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use tokio::net::UnixStream;

fn ns() -> Namespace {
    Namespace::new("m", "")
}

#[tokio::test(start_paused = true)]
async fn an_idle_connection_is_closed_after_the_idle_timeout() {
    let daemon = Daemon::start(|o, _| o.idle_timeout = Some(Duration::from_secs(30))).await;
    let mut busy = daemon.client().await;
    let mut idle = UnixStream::connect(&daemon.path).await.unwrap();
    // Requests reset the clock: 20 s, a request, 20 s more is still open.
    tokio::time::advance(Duration::from_secs(20)).await;
    busy.stats(false).await.unwrap();
    tokio::time::advance(Duration::from_secs(20)).await;
    busy.stats(false).await.unwrap();
    // The silent one is closed without a reply once 30 s passed (paused time auto-advances).
    assert_closed(&mut idle).await;
    daemon.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_half_sent_frame_times_out_with_an_error() {
    let daemon = Daemon::start(|o, _| o.frame_timeout = Duration::from_secs(5)).await;
    let mut s = UnixStream::connect(&daemon.path).await.unwrap();
    s.write_all(&100u32.to_be_bytes()).await.unwrap();
    s.write_all(&[0x80; 10]).await.unwrap();
    // The writer stays open and silent: the frame deadline, not EOF, ends it.
    let reply = raw_reply(&mut s).await.unwrap();
    assert_eq!(field(&reply, "code").as_str(), Some("frame_timeout"));
    let message = field(&reply, "message").as_str().unwrap().to_owned();
    assert!(message.contains("got 10 of 100 bytes"), "{message}");
    assert_closed(&mut s).await;
    // A header cut short is the same.
    let mut s = UnixStream::connect(&daemon.path).await.unwrap();
    s.write_all(&[0, 0]).await.unwrap();
    let reply = raw_reply(&mut s).await.unwrap();
    assert_eq!(field(&reply, "code").as_str(), Some("frame_timeout"));
    assert_closed(&mut s).await;
    daemon.stop().await;
}

#[tokio::test]
async fn connections_past_the_cap_are_refused_with_a_clear_error() {
    let daemon = Daemon::start(|o, _| o.max_connections = 2).await;
    let mut a = daemon.client().await;
    let mut b = daemon.client().await;
    a.stats(false).await.unwrap();
    b.stats(false).await.unwrap();
    let mut third = UnixStream::connect(&daemon.path).await.unwrap();
    let reply = raw_reply(&mut third).await.unwrap();
    assert_eq!(field(&reply, "code").as_str(), Some("too_many_connections"));
    assert!(
        field(&reply, "message")
            .as_str()
            .unwrap()
            .contains("--max-connections")
    );
    assert_closed(&mut third).await;
    // Closing one frees its place (once the daemon has seen the close).
    drop(b);
    let mut c = loop {
        let mut c = KvdClient::connect(&daemon.path).await.unwrap();
        if c.stats(false).await.is_ok() {
            break c;
        }
        tokio::task::yield_now().await;
    };
    c.stats(false).await.unwrap();
    a.stats(false).await.unwrap();
    daemon.stop().await;
}

#[tokio::test]
async fn a_batch_past_the_key_limit_is_refused_and_the_connection_stays() {
    let daemon = Daemon::start(|o, _| o.max_batch_keys = 1000).await;
    let mut c = daemon.client().await;
    let keys: Vec<Bytes> = (0..1001u32)
        .map(|i| Bytes::copy_from_slice(&i.to_be_bytes()))
        .collect();
    for request in [
        Request::BatchGet {
            ns: ns(),
            keys: keys.clone(),
        },
        Request::Exists {
            ns: ns(),
            keys: keys.clone(),
        },
    ] {
        c.send(&request, None).await.unwrap();
        match c.recv().await.unwrap().response {
            Response::Error { code, message } => {
                assert_eq!(code, "too_many_keys");
                assert!(message.contains("1001 entries; at most 1000"), "{message}");
            }
            other => panic!("{other:?}"),
        }
    }
    let got = c.batch_get(&ns(), keys[..1000].to_vec()).await.unwrap();
    assert_eq!(got.len(), 1000, "the connection still serves");
    daemon.stop().await;
}

#[tokio::test]
async fn prefetch_hints_are_bounded_in_bytes() {
    let daemon = Daemon::start(|o, _| o.prefetch_queue_bytes = 4096).await;
    let mut c = daemon.client().await;
    let big: Vec<Bytes> = (0..100u32).map(|_| Bytes::from(vec![1u8; 64])).collect();
    c.prefetch_hint(&ns(), big, 10_000).await.unwrap();
    let small = vec![Bytes::from_static(b"k")];
    c.prefetch_hint(&ns(), small, 10_000).await.unwrap();
    let ext = c.stats(true).await.unwrap().extended.unwrap();
    assert_eq!(ext.prefetch_hints_total, 2);
    assert_eq!(
        ext.prefetch_dropped_total, 1,
        "the 9.6 KB hint does not fit a 4 KiB queue; the small one does"
    );
    daemon.stop().await;
}
