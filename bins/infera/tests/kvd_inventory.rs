//! `infera kvd --kv-events-endpoint`: the daemon publishes what its tiers hold as KV events in
//! vLLM's layout, as a router subscribing to it sees them. A real daemon on a free port, told
//! over the Unix-socket protocol to store blocks; a ZeroMQ SUB socket reads the frames
//! `[topic, seq, payload]`, `infera_core::kv_events::decode_batch` decodes them, and the
//! blocks the events say L2 holds are the blocks the daemon holds. The replay socket serves
//! the daemon's first batch, `AllBlocksCleared`.

#![cfg(feature = "zmq")]
#![allow(clippy::unwrap_used)]

mod common;

use bytes::Bytes;
use common::{DEADLINE, Proc};
use infera_backends::zmq::replay_from;
use infera_core::event::{Retention, Tier};
use infera_core::kv_events::kvd::inventory_hash;
use infera_core::kv_events::{EngineBatch, EngineEvent, decode_batch};
use infera_kvd::{KvdClient, Namespace, SetItem};
use std::collections::BTreeSet;
use std::process::{Command, Stdio};
use std::time::Duration;
use zeromq::{Socket, SocketRecv, SubSocket};

const MODEL: &str = "llama-3-8b";
const COMPAT: &str = "fp8";
/// Values of this size, under a 64 KiB L2: the 16th block evicts the first.
const VALUE: usize = 4096;

/// Starts the daemon and returns it once it listens.
fn kvd(socket: &std::path::Path) -> Proc {
    let mut child = Command::new(env!("CARGO_BIN_EXE_infera"))
        .args(["kvd", "--socket"])
        .arg(socket)
        .args(["--max-bytes", "64KiB", "--shared-arena-bytes", "0"])
        .args(["--kv-events-endpoint", "tcp://127.0.0.1:0"])
        .env_remove("RUST_LOG")
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    common::until_kvd_listens(&mut child);
    Proc(child)
}

/// The next batch on `sub`: its frames checked (topic, 8-byte seq) and its payload decoded.
async fn next_batch(sub: &mut SubSocket) -> (u64, EngineBatch) {
    let msg = tokio::time::timeout(DEADLINE, sub.recv())
        .await
        .expect("a batch within the deadline")
        .unwrap();
    let frames = msg.into_vec();
    assert_eq!(frames.len(), 3, "[topic, seq, payload]");
    assert_eq!(&frames[0][..], b"kv-events");
    let seq = u64::from_be_bytes(frames[1][..].try_into().unwrap());
    let batch = decode_batch(&frames[2]).unwrap();
    assert!(batch.malformed.is_empty(), "{:?}", batch.malformed);
    (seq, batch)
}

fn key(i: u32) -> Bytes {
    Bytes::from(format!("block-{i:04}"))
}

fn name(i: u32) -> u64 {
    inventory_hash(MODEL, COMPAT, &key(i)).0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_daemon_publishes_the_blocks_its_tiers_hold() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("kvd.sock");
    let mut daemon = kvd(&socket);

    let mut client = KvdClient::connect(&socket).await.unwrap();
    assert_eq!(client.kv_events_endpoint(), None, "known only after hello");
    let ack = client.hello("inventory-test").await.unwrap();
    let endpoint = ack
        .kv_events_endpoint
        .clone()
        .expect("hello_ack names the endpoint");
    let replay = ack
        .kv_events_replay_endpoint
        .clone()
        .expect("and its replay");
    assert_eq!(client.kv_events_endpoint(), Some(endpoint.as_str()));
    assert_eq!(client.kv_events_replay_endpoint(), Some(replay.as_str()));
    for bound in [&endpoint, &replay] {
        assert!(bound.starts_with("tcp://127.0.0.1:"), "{bound}");
        assert!(
            !bound.ends_with(":0"),
            "the bound port is advertised: {bound}"
        );
    }

    let mut sub = SubSocket::new();
    sub.connect(&endpoint).await.unwrap();
    sub.subscribe("").await.unwrap();
    // A SUB socket sees nothing published before its subscription reached the publisher: write
    // probe blocks (another namespace) until their batch arrives.
    let probe = Namespace::new("probe", "");
    let mut first_live = None;
    for i in 0..100u32 {
        let item = SetItem::new(key(i), Bytes::from_static(b"p")).retention(Retention::Ephemeral);
        client.set(&probe, item).await.unwrap();
        let wait = Duration::from_millis(200);
        if let Ok((seq, batch)) = tokio::time::timeout(wait, next_batch(&mut sub)).await {
            if seq == 0 {
                assert_eq!(batch.events[0], EngineEvent::AllBlocksCleared);
            }
            first_live = Some(seq);
            break;
        }
    }
    let first_live = first_live.expect("the subscription reached the publisher");

    // 20 blocks of 4 KiB into a 64 KiB L2: the oldest are evicted.
    let ns = Namespace::new(MODEL, COMPAT);
    let blocks = 20u32;
    for i in 0..blocks {
        let item = SetItem::new(key(i), Bytes::from(vec![i as u8; VALUE]));
        assert!(client.set(&ns, item).await.unwrap().accepted);
    }
    let held: BTreeSet<u64> = {
        let keys: Vec<Bytes> = (0..blocks).map(key).collect();
        let present = client.exists(&ns, keys).await.unwrap();
        (0..blocks)
            .filter(|i| present[*i as usize])
            .map(name)
            .collect()
    };
    assert!(held.len() < blocks as usize, "the budget evicts");
    assert!(held.contains(&name(blocks - 1)));

    // Fold the events, as the router's index does, until it holds what the daemon holds.
    let ours: BTreeSet<u64> = (0..blocks).map(name).collect();
    let mut seen = BTreeSet::new();
    let mut view = BTreeSet::new();
    let mut last_seq = first_live;
    while view != held || !ours.iter().all(|h| seen.contains(h)) {
        let (seq, batch) = next_batch(&mut sub).await;
        assert_eq!(seq, last_seq + 1, "no gap");
        last_seq = seq;
        assert_eq!(batch.dp_rank, None);
        for event in batch.events {
            match event {
                EngineEvent::BlockStored {
                    block_hashes,
                    tier,
                    token_ids,
                    block_size,
                    parent,
                    ..
                } => {
                    assert_eq!(tier, Tier::Host);
                    assert!(token_ids.is_empty() && block_size == 0 && parent.is_none());
                    for h in block_hashes {
                        if ours.contains(&h.0) {
                            seen.insert(h.0);
                            view.insert(h.0);
                        }
                    }
                }
                EngineEvent::BlockRemoved {
                    block_hashes, tier, ..
                } => {
                    assert_eq!(tier, Tier::Host);
                    for h in block_hashes {
                        view.remove(&h.0);
                    }
                }
                other => panic!("unexpected {other:?}"),
            }
        }
    }
    assert_eq!(
        seen, ours,
        "every block stored was named by its inventory hash"
    );

    // The replay socket serves the history, the start's clear first.
    let history = replay_from(&replay, 0, DEADLINE).await.unwrap();
    let (seq, payload) = &history[0];
    assert_eq!(*seq, 0);
    let first = decode_batch(payload).unwrap();
    assert_eq!(first.events.first(), Some(&EngineEvent::AllBlocksCleared));
    assert_eq!(history.last().map(|(s, _)| *s), Some(last_seq));

    // A `clear` op is published as one clear.
    client.clear(&Namespace::new("", "")).await.unwrap();
    let (_, batch) = next_batch(&mut sub).await;
    assert_eq!(batch.events, vec![EngineEvent::AllBlocksCleared]);

    assert_eq!(daemon.terminate().code(), Some(0));
}
