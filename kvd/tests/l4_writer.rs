//! The L4's writer against a real `redis-server`: a thread of its own (`kvd-l4-writer`) at a
//! lower OS priority than the daemon's, so that checksumming and sending blocks never holds a
//! core the daemon's SETs need; its writes land and read back through the daemon's own
//! connections, and the thread ends with its L4. (Its own test binary: the test counts the
//! process's writer threads.)

#![allow(clippy::unwrap_used)]

#[path = "support/redis.rs"]
mod redis_server;

use bytes::Bytes;
use infera_core::event::Retention;
use infera_kvd::Namespace;
use infera_kvd::l4::L4;
use infera_kvd::long::{LongBlock, LongStore, WritePermit};
use infera_kvd::store::key_hash;
use redis_server::{RedisServer, l4_config};
use std::time::{Duration, Instant};

/// The nice value of each of this process's `kvd-l4-writer` threads.
fn writer_threads() -> Vec<i32> {
    let tasks = std::fs::read_dir("/proc/self/task").unwrap();
    tasks
        .filter_map(|task| {
            let dir = task.ok()?.path();
            let comm = std::fs::read_to_string(dir.join("comm")).ok()?;
            if comm.trim() != "kvd-l4-writer" {
                return None;
            }
            // `stat`: pid (comm) state ...; the nice value is its 19th field.
            let stat = std::fs::read_to_string(dir.join("stat")).ok()?;
            let after_comm = &stat[stat.rfind(')')? + 2..];
            after_comm.split_whitespace().nth(16)?.parse().ok()
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_writer_is_a_thread_of_lower_priority_that_ends_with_its_l4() {
    let redis = RedisServer::start();
    let cfg = l4_config(redis.port);
    assert!(writer_threads().is_empty());
    let l4 = L4::open(cfg.store(), cfg.options(), true).await.unwrap();
    let own_nice = std::fs::read_to_string("/proc/thread-self/stat").unwrap();
    let own_nice: i32 = own_nice[own_nice.rfind(')').unwrap() + 2..]
        .split_whitespace()
        .nth(16)
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(writer_threads(), vec![own_nice + 10]);

    // A block written behind lands (through the writer's connections) and reads back from the
    // store (through the daemon's).
    let ns = Namespace::new("m", "");
    let key = Bytes::from_static(b"block-0");
    let hash = key_hash(&ns, &key);
    let value = Bytes::from(vec![5u8; 256 << 10]);
    let block = LongBlock {
        hash,
        ns: ns.clone(),
        key: key.clone(),
        value: value.clone(),
        metadata: None,
        class: Retention::Long,
        expires_at: None,
    };
    l4.put(block, WritePermit::unbounded(), 1, false).unwrap();
    l4.flush().await.unwrap();
    let hit = l4
        .get(&ns, &key, hash, 2)
        .await
        .expect("read back from the store");
    assert_eq!(hit.value, value);

    drop(l4);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !writer_threads().is_empty() {
        assert!(
            Instant::now() < deadline,
            "the writer thread outlived its L4"
        );
        tokio::task::yield_now().await;
    }
}
