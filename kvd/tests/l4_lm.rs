//! LMCache's `lm://` server protocol: kvd's request headers against golden frames packed by
//! hand from LMCache's `protocol.py` (`struct.pack("iiiiiiiii150s", ...)`), and the L4 against
//! a small reference server written from LMCache's `v1/server/__main__.py` (LMCache's own
//! server needs torch): blocks land, read back byte-exact through a fresh L4, `EXIST` answers
//! prefetches, and a removal (an empty `PUT`) reads as a miss. And the stacked tiers
//! (L2 → L3 → L4): a node with an empty L3 reads another node's blocks from L4 and promotes
//! them into its L3.

#![allow(clippy::unwrap_used)]

use bytes::Bytes;
use infera_core::event::Retention;
use infera_kvd::l4::lm::{self, LmStore};
use infera_kvd::l4::{L4, L4Options, RemoteStore};
use infera_kvd::long::LongStore;
use infera_kvd::long::Stacked;
use infera_kvd::store::{Store, key_hash};
use infera_kvd::{IoMode, Namespace, SetItem, TablespaceConfig};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// `struct.pack("<9i", *ints)`.
fn ints(values: [i32; 9]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

#[test]
fn request_headers_match_lmcache_golden_frames() {
    // ClientMetaMessage(CLIENT_PUT, key, 5, MemoryFormat.BINARY, torch.uint8, [5, 0, 0, 0])
    let mut golden = ints([1, 5, 4, 6, 0, 5, 0, 0, 0]);
    golden.extend_from_slice(b"infera@kvd@0a");
    golden.resize(186, b' ');
    assert_eq!(
        lm::request(lm::PUT, "infera@kvd@0a", 5).unwrap().to_vec(),
        golden
    );

    // A GET and a HEALTH carry no length; the key field is all padding for HEALTH.
    let mut golden = ints([2, 0, 4, 6, 0, 0, 0, 0, 0]);
    golden.extend_from_slice(b"k");
    golden.resize(186, b' ');
    assert_eq!(lm::request(lm::GET, "k", 0).unwrap().to_vec(), golden);
    let mut golden = ints([5, 0, 4, 6, 0, 0, 0, 0, 0]);
    golden.resize(186, b' ');
    assert_eq!(lm::request(lm::HEALTH, "", 0).unwrap().to_vec(), golden);

    assert!(
        lm::request(lm::GET, &"x".repeat(151), 0).is_err(),
        "150-byte keys at most"
    );
}

#[test]
fn reply_headers_of_lmcache_servers_parse() {
    // ServerMetaMessage(SERVER_FAIL, 0, MemoryFormat(1), torch.float16, [0, 0, 0, 0]).serialize()
    let fail: [u8; 36] = ints([400, 0, 1, 2, 0, 0, 0, 0, 0]).try_into().unwrap();
    assert_eq!(lm::reply(&fail), (lm::FAIL, 0));
    // A GET hit of 4096 bytes, KV_2TD bfloat16 [2, 16, 64, 0], LocalCPUBackend.
    let hit: [u8; 36] = ints([200, 4096, 3, 3, 2, 16, 64, 0, 1]).try_into().unwrap();
    assert_eq!(lm::reply(&hit), (lm::SUCCESS, 4096));
}

/// The reference server: one task per connection, requests answered in order.
async fn reference_server() -> (u16, Arc<Mutex<HashMap<String, Vec<u8>>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let data: Arc<Mutex<HashMap<String, Vec<u8>>>> = Arc::default();
    let store = data.clone();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let store = store.clone();
            tokio::spawn(async move {
                let mut header = [0u8; 186];
                while socket.read_exact(&mut header).await.is_ok() {
                    let int =
                        |i: usize| i32::from_le_bytes(header[i * 4..i * 4 + 4].try_into().unwrap());
                    let (command, length) = (int(0), int(1));
                    let key = String::from_utf8(header[36..].to_vec())
                        .unwrap()
                        .trim()
                        .to_owned();
                    let answer = |code: i32, len: i32| ints([code, len, 1, 2, 0, 0, 0, 0, 0]);
                    match command {
                        1 => {
                            let mut value = vec![0u8; length as usize];
                            socket.read_exact(&mut value).await.unwrap();
                            store.lock().unwrap().insert(key, value);
                        }
                        2 => {
                            let value = store.lock().unwrap().get(&key).cloned();
                            match value {
                                Some(v) => {
                                    socket
                                        .write_all(&answer(200, v.len() as i32))
                                        .await
                                        .unwrap();
                                    socket.write_all(&v).await.unwrap();
                                }
                                None => socket.write_all(&answer(400, 0)).await.unwrap(),
                            }
                        }
                        3 => {
                            let code = if store.lock().unwrap().contains_key(&key) {
                                200
                            } else {
                                400
                            };
                            socket.write_all(&answer(code, 0)).await.unwrap();
                        }
                        5 => socket.write_all(&answer(200, 0)).await.unwrap(),
                        other => panic!("unknown command {other}"),
                    }
                }
            });
        }
    });
    (port, data)
}

fn block(i: u8, len: usize) -> Bytes {
    Bytes::from((0..len).map(|j| (j as u8) ^ i).collect::<Vec<u8>>())
}

async fn l4(port: u16) -> Arc<L4> {
    let store: Arc<dyn RemoteStore> = Arc::new(LmStore::new("127.0.0.1".into(), port, 64 << 20));
    Arc::new(L4::open(store, L4Options::default(), true).await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_round_trip_through_an_lm_server() {
    let (port, data) = reference_server().await;
    let ns = Namespace::new("m", "bf16");
    let first = l4(port).await;
    let long: Arc<dyn LongStore> = first.clone();
    let store = Store::new(4 << 20, None, Some(long));
    for i in 0..8u8 {
        let item = SetItem::new(vec![i], block(i, 100_000 + i as usize)).retention(Retention::Long);
        assert!(store.set(&ns, &item, 1).await.accepted);
    }
    // A removal (what a lower-class write of the key does) is an empty PUT.
    first.flush().await.unwrap();
    first.remove(key_hash(&ns, &[3]));
    first.flush().await.unwrap();
    assert_eq!(data.lock().unwrap().len(), 8);
    assert!(
        data.lock()
            .unwrap()
            .keys()
            .all(|k| k.starts_with("infera@kvd@"))
    );

    // A fresh daemon's tiers: L2 empty, the L4 over the same server.
    let fresh = l4(port).await;
    let long: Arc<dyn LongStore> = fresh.clone();
    let store = Store::new(1 << 20, None, Some(long));
    let keys: Vec<Bytes> = (0..8u8).map(|i| Bytes::from(vec![i])).collect();
    assert_eq!(
        store.prefetch(&ns, &keys, 1).await,
        7,
        "EXIST finds them; the removed one (an empty value) reads as a miss"
    );
    for i in 0..8u8 {
        let got = fresh.get(&ns, &[i], key_hash(&ns, &[i]), 1).await;
        if i == 3 {
            assert!(got.is_none(), "a removed block reads as a miss");
        } else {
            assert_eq!(got.unwrap().value, block(i, 100_000 + i as usize));
        }
    }
    assert!(fresh.l4_stats().hits_total >= 7);
    fresh.close().await.unwrap();
}

async fn stacked(dir: &std::path::Path, port: u16) -> (Store, Arc<dyn LongStore>) {
    let mut ts = TablespaceConfig::new(vec![dir.to_path_buf()], 8 << 20);
    ts.io_mode = IoMode::Buffered;
    ts.container_bytes = 1 << 20;
    let l3 = infera_kvd::long::open(&infera_kvd::LongBackendConfig::Tablespace(ts))
        .await
        .unwrap();
    let long: Arc<dyn LongStore> = Arc::new(Stacked::new(l3, l4(port).await));
    (Store::new(256 << 10, None, Some(long.clone())), long)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_with_an_empty_l3_reads_l4_and_promotes_into_l3() {
    let (port, _data) = reference_server().await;
    let ns = Namespace::new("m", "");
    let (one, two) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (store, long) = stacked(one.path(), port).await;
    for i in 0..6u8 {
        let item = SetItem::new(vec![i], block(i, 200_000)).retention(Retention::Long);
        assert!(store.set(&ns, &item, 1).await.accepted);
    }
    long.close().await.unwrap();
    assert_eq!(long.stats().entries, 6, "L3 holds them too");

    let (store, long) = stacked(two.path(), port).await;
    assert_eq!(long.stats().entries, 0);
    for i in 0..6u8 {
        let got = store.get(&ns, &Bytes::from(vec![i]), 1, false).await;
        let Some(infera_kvd::store::Got::Bytes(v, class)) = got else {
            panic!("block {i} not found in L4");
        };
        assert_eq!((v, class), (block(i, 200_000), Retention::Long));
    }
    let stats = long.stats();
    assert_eq!(stats.entries, 6, "promoted into L3: {stats:?}");
    assert!(stats.l4.hits_total >= 6, "{stats:?}");
    long.close().await.unwrap();
}
