//! The ZeroMQ KV-event transport over real sockets on 127.0.0.1: our publisher and subscriber
//! (which frames messages and decodes nothing: payloads are decoded here to check them), the
//! replay socket, and an independent Python (pyzmq + msgpack) publisher. Sequence, gap and
//! restart handling belong to the KV pipeline (`tests/kv_pipeline.rs`).
//!
//! PUB/SUB drops messages until the subscription has reached the publisher, so every test first
//! publishes probe batches (`ts < 0`) until the subscriber yields one: no sleeps.

use bytes::Bytes;
use infera_backends::zmq::{
    KvEventPublisher, KvEventSubscriber, PublisherConfig, REPLAY_END_SEQ, SubscriberConfig,
    SubscriberItem, SubscriberStats, ZmqTransportError, replay_from,
};
use infera_core::event::Tier;
use infera_core::ids::EngineHash;
use infera_core::kv_events::{EngineBatch, EngineEvent, decode_batch, encode_batch_vllm};
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::time::timeout;

const WAIT: Duration = Duration::from_secs(10);

fn probe() -> EngineBatch {
    EngineBatch {
        ts: -1.0,
        dp_rank: Some(0),
        ..Default::default()
    }
}

fn stored(i: u64) -> EngineBatch {
    EngineBatch {
        ts: 1_700_000_000.0 + i as f64,
        dp_rank: Some(0),
        events: vec![EngineEvent::BlockStored {
            block_hashes: vec![EngineHash(100 + i)],
            parent: (i > 0).then(|| EngineHash(99 + i)),
            token_ids: (0..16).map(|t| t + 16 * i as u32).collect(),
            block_size: 16,
            tier: Tier::Gpu,
            lora_id: None,
            lora_name: None,
            extra_keys: None,
            cache_salt: None,
            indexable: true,
        }],
        ..Default::default()
    }
}

async fn publisher(replay: bool) -> KvEventPublisher {
    let cfg = PublisherConfig::new(
        "tcp://127.0.0.1:0",
        replay.then(|| "tcp://127.0.0.1:0".to_owned()),
    );
    KvEventPublisher::bind(cfg).await.expect("bind publisher")
}

async fn next_item(sub: &mut KvEventSubscriber) -> SubscriberItem {
    timeout(WAIT, sub.recv())
        .await
        .expect("subscriber item in time")
        .expect("subscriber still running")
}

/// A framed message's seq, topic and decoded batch (panics on anything else).
fn decoded(item: SubscriberItem) -> (Option<u64>, Option<Bytes>, EngineBatch) {
    match item {
        SubscriberItem::Frames(f) => {
            let batch = decode_batch(&f.payload).expect("a decodable payload");
            (f.seq, f.topic, batch)
        }
        other => panic!("expected frames, got {other:?}"),
    }
}

/// Publishes probes until the subscriber yields one, then drains every probe still in flight.
async fn sync(publisher: &mut KvEventPublisher, sub: &mut KvEventSubscriber) {
    for _ in 0..400 {
        let last = publisher.publish_batch(&probe()).await.expect("probe");
        if let Ok(Some(item)) = timeout(Duration::from_millis(25), sub.recv()).await {
            let mut item = item;
            loop {
                let (seq, _, batch) = decoded(item);
                assert!(batch.ts < 0.0, "unexpected batch while syncing: {batch:?}");
                if seq == Some(last) {
                    return;
                }
                item = next_item(sub).await;
            }
        }
    }
    panic!(
        "subscriber never received a probe from {}",
        publisher.endpoint()
    );
}

async fn connected_pair(replay: bool) -> (KvEventPublisher, KvEventSubscriber) {
    let mut p = publisher(replay).await;
    let mut s = KvEventSubscriber::spawn(SubscriberConfig::new(p.endpoint()));
    sync(&mut p, &mut s).await;
    (p, s)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publisher_to_subscriber_round_trip_with_seq() {
    let (mut p, mut s) = connected_pair(false).await;
    let first = p.next_seq();
    for i in 0..5 {
        let seq = p.publish_batch(&stored(i)).await.expect("publish");
        assert_eq!(seq, first + i);
    }
    for i in 0..5 {
        let (seq, topic, batch) = decoded(next_item(&mut s).await);
        assert_eq!(seq, Some(first + i));
        assert_eq!(topic.as_deref(), Some(&b"kv-events"[..]));
        assert_eq!(batch, stored(i));
    }
    let stats = s.stats();
    assert_eq!(SubscriberStats::get(&stats.garbage), 0);
    s.shutdown().await;
    p.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_is_counted_and_later_batches_still_arrive() {
    let (mut p, mut s) = connected_pair(false).await;
    let topic = Bytes::from_static(b"kv-events");
    let good = Bytes::from(encode_batch_vllm(&stored(7)));
    // 4 frames; a 3-byte seq frame (garbage); a well-framed message whose payload is not
    // msgpack (framed: the pipeline finds it undecodable).
    p.publish_raw(vec![
        topic.clone(),
        topic.clone(),
        topic.clone(),
        topic.clone(),
    ])
    .await
    .expect("raw");
    p.publish_raw(vec![
        topic.clone(),
        Bytes::from_static(b"abc"),
        good.clone(),
    ])
    .await
    .expect("raw");
    p.publish_raw(vec![
        topic.clone(),
        Bytes::copy_from_slice(&p.next_seq().to_be_bytes()),
        Bytes::from_static(&[0x93, 0xcb, 0x41]),
    ])
    .await
    .expect("raw");
    p.set_next_seq(p.next_seq() + 1);
    // ATOM layouts: [payload] and [topic, payload], no seq.
    p.publish_raw(vec![good.clone()]).await.expect("raw");
    p.publish_raw(vec![topic.clone(), good.clone()])
        .await
        .expect("raw");
    p.publish_batch(&stored(8)).await.expect("publish");

    for want in ["expected 1 to 3 frames", "seq frame must be 8 bytes"] {
        match next_item(&mut s).await {
            SubscriberItem::Malformed { reason } => assert!(reason.contains(want), "{reason}"),
            other => panic!("{other:?}"),
        }
    }
    match next_item(&mut s).await {
        SubscriberItem::Frames(f) => {
            let err = decode_batch(&f.payload).expect_err("not msgpack");
            assert!(err.to_string().contains("msgpack"), "{err}");
        }
        other => panic!("{other:?}"),
    }
    for want_topic in [None, Some(&b"kv-events"[..])] {
        let (seq, topic, batch) = decoded(next_item(&mut s).await);
        assert_eq!(seq, None);
        assert_eq!(topic.as_deref(), want_topic);
        assert_eq!(batch, stored(7));
    }
    assert_eq!(decoded(next_item(&mut s).await).2, stored(8));
    let stats = s.stats();
    assert_eq!(SubscriberStats::get(&stats.garbage), 2);
    s.shutdown().await;
    p.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_returns_from_the_start_seq_and_ends_with_the_terminator() {
    let mut p = publisher(true).await;
    let mut payloads = Vec::new();
    for i in 0..6 {
        let payload = Bytes::from(encode_batch_vllm(&stored(i)));
        assert_eq!(p.publish(payload.clone()).await.expect("publish"), i);
        payloads.push(payload);
    }
    let ep = p.replay_endpoint().expect("replay endpoint").to_owned();
    let got = replay_from(&ep, 2, WAIT).await.expect("replay");
    let want: Vec<(u64, Bytes)> = (2..6).map(|i| (i, payloads[i as usize].clone())).collect();
    assert_eq!(got, want);
    assert!(got.iter().all(|(s, _)| *s != REPLAY_END_SEQ));
    // From the start, and from past the end (only the terminator comes back).
    assert_eq!(replay_from(&ep, 0, WAIT).await.expect("replay").len(), 6);
    assert!(
        replay_from(&ep, 100, WAIT)
            .await
            .expect("replay")
            .is_empty()
    );
    p.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_from_a_dead_endpoint_times_out() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("free port")
        .local_addr()
        .expect("addr")
        .port();
    let err = replay_from(
        &format!("tcp://127.0.0.1:{port}"),
        0,
        Duration::from_millis(200),
    )
    .await
    .expect_err("nothing listens");
    assert!(
        matches!(err, ZmqTransportError::ReplayTimeout { .. }),
        "{err}"
    );
    assert!(err.is_retryable());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_subscriber_handle_stops_it() {
    let (mut p, s) = connected_pair(false).await;
    let token = s.cancel_token();
    drop(s);
    assert!(token.is_cancelled());
    // Publishing after the subscriber is gone is harmless.
    p.publish_batch(&stored(1)).await.expect("publish");
    p.shutdown().await;
}

// ---------------------------------------------------------------- independent Python peer

/// The batch `vllm_publisher.py` sends as number `i` of `count` (keep in sync with it).
fn expected_python_batch(i: u64, count: u64) -> EngineBatch {
    let base = 1u64 << 63;
    let (h0, h1) = (base + 2 * i, base + 2 * i + 1);
    let mut events = vec![EngineEvent::BlockStored {
        block_hashes: vec![EngineHash(h0), EngineHash(h1)],
        parent: (i > 0).then(|| EngineHash(base + 2 * i - 1)),
        token_ids: (32 * i as u32..32 * i as u32 + 32).collect(),
        block_size: 16,
        tier: Tier::Gpu,
        lora_id: None,
        lora_name: None,
        extra_keys: None,
        cache_salt: None,
        indexable: true,
    }];
    if i % 2 == 1 {
        events.push(EngineEvent::BlockRemoved {
            block_hashes: vec![EngineHash(h0)],
            tier: Tier::Gpu,
            indexable: true,
        });
    }
    if i % 3 == 2 {
        events.push(EngineEvent::BlockStored {
            block_hashes: vec![EngineHash(i)],
            parent: None,
            token_ids: (0..16).collect(),
            block_size: 16,
            tier: Tier::Host,
            lora_id: None,
            lora_name: None,
            extra_keys: None,
            cache_salt: None,
            indexable: true,
        });
    }
    if i == count - 1 {
        events.push(EngineEvent::AllBlocksCleared);
    }
    EngineBatch {
        ts: 1_700_000_000.0 + i as f64,
        dp_rank: Some(0),
        events,
        skipped_unknown: u32::from(i == 0),
        malformed: Vec::new(),
    }
}

const PYTHON_HELP: &str = "the independent ZeroMQ peer needs python3 with pyzmq and msgpack: \
     run `pip install pyzmq msgpack` (cargo xtask test installs them)";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_vllm_publisher_batches_all_decode() {
    const COUNT: u64 = 8;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/peers/vllm_publisher.py");
    let mut child = tokio::process::Command::new("python3")
        .arg(script)
        .arg(COUNT.to_string())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start python3 ({e}); {PYTHON_HELP}"));
    let mut stdin = child.stdin.take().expect("stdin");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let first = timeout(WAIT, lines.next_line())
        .await
        .expect("python peer answers in time")
        .expect("read python stdout")
        .unwrap_or_default();
    let port: u16 = match first.strip_prefix("READY ") {
        Some(p) => p.trim().parse().expect("port"),
        None => panic!("python peer did not start: {first:?}; {PYTHON_HELP}"),
    };

    let mut s = KvEventSubscriber::spawn(SubscriberConfig::new(format!("tcp://127.0.0.1:{port}")));
    // The peer probes until it hears GO: the first item is a probe.
    let mut last_probe = match decoded(next_item(&mut s).await) {
        (Some(q), _, batch) if batch.ts < 0.0 => q,
        other => panic!("unexpected item before GO: {other:?}"),
    };
    stdin.write_all(b"GO\n").await.expect("write GO");
    stdin.flush().await.expect("flush");

    let mut got = Vec::new();
    while got.len() < COUNT as usize {
        match decoded(next_item(&mut s).await) {
            (Some(q), _, batch) if batch.ts < 0.0 => {
                assert_eq!(q, last_probe + 1);
                last_probe = q;
            }
            (Some(q), _, batch) => {
                assert_eq!(q, last_probe + 1 + got.len() as u64, "consecutive seqs");
                got.push(batch);
            }
            other => panic!("unexpected item from the python peer: {other:?}"),
        }
    }
    for (i, batch) in got.iter().enumerate() {
        assert_eq!(batch, &expected_python_batch(i as u64, COUNT), "batch {i}");
    }
    assert!(got.iter().all(|b| b.malformed.is_empty()));
    assert_eq!(got.iter().map(|b| b.skipped_unknown).sum::<u32>(), 1);
    assert_eq!(SubscriberStats::get(&s.stats().garbage), 0);

    let done = timeout(WAIT, lines.next_line())
        .await
        .expect("DONE in time");
    assert_eq!(done.expect("read").as_deref(), Some("DONE"));
    drop(stdin);
    let status = timeout(WAIT, child.wait())
        .await
        .expect("exit in time")
        .expect("wait");
    assert!(status.success(), "python peer exited with {status}");
    s.shutdown().await;
}
