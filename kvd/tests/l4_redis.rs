//! The L4 against a real `redis-server` started by the test on a free loopback port: blocks
//! written in LMCache's layout (value key + metadata key) read back byte-exact through a fresh
//! daemon, by prefetch hints and by gets; a store killed mid-run costs no client error, shows
//! in the counters, and once restarted the breaker closes and writes land again; a store at
//! `maxmemory` refuses puts without tripping the breaker, and a refused block's older value
//! does not answer for it; an idle writer finds a put with no wake (a SET does not make one).

#![allow(clippy::unwrap_used)]

mod common;
#[path = "support/l4_daemon.rs"]
mod l4_daemon;
#[path = "support/l4_full.rs"]
mod l4_full;
#[path = "support/l4_outage.rs"]
mod l4_outage;
#[path = "support/redis.rs"]
mod redis_server;

use bytes::Bytes;
use infera_core::event::Retention;
use infera_kvd::Namespace;
use infera_kvd::l4::frame;
use infera_kvd::l4::resp::{Arg, Conn, Endpoint, Pool, Reply};
use infera_kvd::l4::{L4, RemoteStore, name};
use infera_kvd::long::{LongBlock, LongStore, WritePermit};
use infera_kvd::store::key_hash;
use l4_outage::{Outage, block, key};
use redis_server::{RedisServer, l4_config};
use std::sync::Arc;
use std::time::{Duration, Instant};

const WITHIN: Duration = Duration::from_secs(30);

/// A connection of the test's own to the server at `port`, replies of up to 64 MiB.
async fn conn(port: u16) -> Conn {
    let endpoint = Endpoint {
        host: "127.0.0.1".into(),
        port,
        password: None,
        username: None,
        db: None,
    };
    Pool::new(endpoint, 64 << 20).take().await.unwrap()
}

/// `GET`s of the two LMCache keys of a block, straight from Redis.
async fn raw(port: u16, stored: &str) -> (Option<Bytes>, Option<Bytes>) {
    let mut conn = conn(port).await;
    let meta = format!("{stored}metadata");
    let value = format!("{stored}kv_bytes");
    conn.send(&[Arg::Plain(b"GET"), Arg::Plain(meta.as_bytes())])
        .await
        .unwrap();
    conn.send(&[Arg::Plain(b"GET"), Arg::Plain(value.as_bytes())])
        .await
        .unwrap();
    conn.flush().await.unwrap();
    let (Reply::Bulk(meta), Reply::Bulk(value)) =
        (conn.read().await.unwrap(), conn.read().await.unwrap())
    else {
        panic!("GET answered something else than a value");
    };
    (meta, value)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_written_in_the_lmcache_layout_read_back_byte_exact_through_a_fresh_daemon() {
    let redis = RedisServer::start();
    let l4 = l4_config(redis.port);
    let ns = Namespace::new("llama", "fp8");
    let values: Vec<Bytes> = (0..6).map(|i| block(i, 200_000 + i * 4099)).collect();

    l4_daemon::write_through_a_daemon(&l4, &ns, &values).await;

    for (i, v) in values.iter().enumerate() {
        let stored = name(&l4.prefix, key_hash(&ns, &key(i)));
        let (meta, value) = raw(redis.port, &stored).await;
        let (meta, value) = (meta.expect("the commit marker"), value.expect("the value"));
        assert_eq!(meta.len(), 28, "LMCache's RemoteMetadata is seven i32");
        let int = |at: usize| i32::from_le_bytes(meta[at..at + 4].try_into().unwrap());
        assert_eq!(
            int(0) as usize,
            value.len(),
            "metadata length = stored length"
        );
        assert_eq!((int(4), int(8)), (4, 6), "BINARY format, uint8 dtype");
        let (back, _) = frame::decode(&value, &ns, &key(i)).expect("kvd's frame of the block");
        assert_eq!(&back, v, "framed block");
    }

    let (fresh, mut client) = l4_daemon::a_fresh_daemon_prefetching_three(&l4, &ns).await;
    for (i, v) in values.iter().enumerate() {
        let hit = client.get(&ns, &key(i)).await.unwrap().expect("an L4 hit");
        assert_eq!(&hit.value, v, "byte-exact");
        assert_eq!(hit.retention, Some(Retention::Long));
    }
    let other = Namespace::new("llama", "");
    assert!(client.get(&other, &key(0)).await.unwrap().is_none());
    let stats = client.stats(true).await.unwrap().extended.unwrap();
    assert!(stats.l4.hits_total >= values.len() as u64, "{stats:?}");
    assert_eq!(stats.l4.up, 1);
    fresh.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_store_costs_no_client_error_and_the_breaker_closes_when_it_is_back() {
    let mut redis = RedisServer::start();
    let cfg = l4_config(redis.port);
    let mut options = cfg.options();
    options.retry_interval = Duration::from_millis(50);
    let down = l4_outage::a_killed_store_costs_no_client_error(&mut redis, options, WITHIN).await;
    assert!(down.dropped_total >= 1, "{down:?}");
    let ns = l4_outage::namespace();
    let (meta, _) = raw(redis.port, &name(&cfg.prefix, key_hash(&ns, &key(41)))).await;
    assert!(meta.is_some(), "the write after the restart landed");
}

impl Outage for RedisServer {
    fn client(&self) -> Arc<dyn RemoteStore> {
        l4_config(self.port).store()
    }
    fn kill(&mut self) {
        RedisServer::kill(self);
    }
    fn restart(&mut self) {
        *self = RedisServer::start_on(self.port);
    }
}

/// `CONFIG SET name value` on the server at `port`.
async fn config_set(port: u16, name: &str, value: &str) {
    let mut conn = conn(port).await;
    let args = [
        b"CONFIG".as_slice(),
        b"SET",
        name.as_bytes(),
        value.as_bytes(),
    ];
    conn.send(&args.map(Arg::Plain)).await.unwrap();
    conn.flush().await.unwrap();
    assert!(matches!(conn.read().await.unwrap(), Reply::Status(_)));
}

struct Capped(u16);

#[async_trait::async_trait]
impl l4_full::Full for Capped {
    async fn fill(&mut self) {
        // `noeviction` is the default policy: past `maxmemory` every write is refused (`OOM`).
        config_set(self.0, "maxmemory", "1").await;
    }
    async fn empty(&mut self) {
        config_set(self.0, "maxmemory", "0").await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_at_maxmemory_refuses_puts_without_tripping_the_breaker() {
    let redis = RedisServer::start();
    let cfg = l4_config(redis.port);
    let l4 = L4::open(cfg.store(), cfg.options(), true).await.unwrap();
    l4_full::a_full_store_refuses_without_tripping_the_breaker(&l4, &mut Capped(redis.port)).await;
}

/// A SET does not wake the writer (a wake is a system call on the SET's path): an idle writer
/// finds a put at its next tick, with no flush to prompt it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_writer_finds_a_put_without_being_woken() {
    let redis = RedisServer::start();
    let cfg = l4_config(redis.port);
    let l4 = L4::open(cfg.store(), cfg.options(), true).await.unwrap();
    let ns = Namespace::new("m", "");
    for (i, tag) in ["first", "second"].into_iter().enumerate() {
        let key = Bytes::from(format!("idle-{tag}"));
        let block = LongBlock {
            hash: key_hash(&ns, &key),
            ns: ns.clone(),
            key,
            value: Bytes::from(vec![i as u8; 4096]),
            metadata: None,
            class: Retention::Long,
            expires_at: None,
        };
        // The queue is empty (the first time the writer never had work, the second time its
        // one put landed and left), so the writer is idle when the put arrives.
        l4.put(block, WritePermit::unbounded(), 1, false).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let stats = l4.l4_stats();
            if stats.puts_total == i as u64 + 1 && stats.queued_ops == 0 {
                break;
            }
            assert!(Instant::now() < deadline, "the {tag} put never landed");
            tokio::task::yield_now().await;
        }
    }
}
