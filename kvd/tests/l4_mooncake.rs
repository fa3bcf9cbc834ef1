//! The L4 against a real Mooncake Store (master and memory holder started by the test on free
//! loopback ports; kvd's sidecar runs the store's own Python client): blocks written through
//! one daemon read back byte-exact through another and by prefetch hints; batches larger than
//! the staging area are split both ways; a foreign or torn value under a block's name is a
//! counted miss; a full holder refuses puts without tripping the breaker, and a refused
//! block's older value does not answer for it; and a cluster killed mid-run costs no client
//! error, shows in the counters, and once restarted the breaker closes and writes land again.

#![allow(clippy::unwrap_used)]

mod common;
#[path = "support/l4_full.rs"]
mod l4_full;
#[path = "support/l4_outage.rs"]
mod l4_outage;
#[path = "support/mooncake.rs"]
mod mooncake;

use bytes::Bytes;
use common::Daemon;
use infera_core::event::Retention;
use infera_kvd::l4::frame::Framed;
use infera_kvd::l4::{L4, RemoteStore, name};
use infera_kvd::long::LongStore;
use infera_kvd::store::{Store, key_hash};
use infera_kvd::{LongBackendConfig, Namespace, SetItem};
use l4_outage::{Outage, block, key};
use mooncake::{Cluster, free_port};
use std::sync::Arc;
use std::time::Duration;

const WITHIN: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_written_through_one_daemon_read_back_byte_exact_through_another() {
    let cluster = Cluster::start();
    let ns = Namespace::new("llama", "fp8");
    let values: Vec<Bytes> = (0..6).map(|i| block(i, 1_000_000 + i * 4099)).collect();

    let writer = cluster.config("team-a", free_port());
    let daemon = Daemon::start(|o, _| o.long = Some(LongBackendConfig::L4(writer.clone()))).await;
    let mut client = daemon.client().await;
    for (i, v) in values.iter().enumerate() {
        let item = SetItem::new(key(i), v.clone()).retention(Retention::Long);
        assert!(client.set(&ns, item).await.unwrap().accepted);
    }
    // Shutdown drains the write-behind queue; the writer gave the store no memory, so its
    // blocks outlive it.
    daemon.stop().await;
    let names: Vec<String> = (0..6)
        .map(|i| name(&writer.prefix, key_hash(&ns, &key(i))))
        .collect();
    // Each client of the cluster has a name of its own (a restarted one gets its name back only
    // once the master has forgotten the old one).
    let outside = cluster.config("team-a", free_port()).store();
    let present = outside.exists_batch(&names).await.unwrap();
    assert_eq!(present, vec![true; 6], "every block is in the store");

    let reader = cluster.config("team-a", free_port());
    let mut fresh =
        Daemon::start(|o, _| o.long = Some(LongBackendConfig::L4(reader.clone()))).await;
    let mut client = fresh.client().await;
    // A prefetch hint (what the server's /v1/cache/prewarm sends) reaches L4 blocks.
    let seen = *fresh.prefetches.borrow_and_update();
    let hinted: Vec<Bytes> = (0..3).map(|i| Bytes::from(key(i))).collect();
    client.prefetch_hint(&ns, hinted, 5000).await.unwrap();
    fresh.prefetches.wait_for(|n| *n > seen).await.unwrap();
    let stats = client.stats(true).await.unwrap().extended.unwrap();
    assert_eq!(stats.prefetch_promoted_total, 3, "{stats:?}");
    for (i, v) in values.iter().enumerate() {
        let hit = client.get(&ns, &key(i)).await.unwrap().expect("an L4 hit");
        assert_eq!(&hit.value, v, "byte-exact");
        assert_eq!(hit.retention, Some(Retention::Long));
    }
    assert!(
        client
            .get(&Namespace::new("llama", ""), &key(0))
            .await
            .unwrap()
            .is_none()
    );
    // Another cluster_id is another tenant: none of team-a's blocks.
    let other = cluster.config("team-b", free_port());
    let names_b: Vec<String> = (0..6)
        .map(|i| name(&other.prefix, key_hash(&ns, &key(i))))
        .collect();
    assert_eq!(
        other.store().exists_batch(&names_b).await.unwrap(),
        vec![false; 6]
    );
    let stats = client.stats(true).await.unwrap().extended.unwrap();
    assert!(stats.l4.hits_total >= values.len() as u64, "{stats:?}");
    assert_eq!(stats.l4.up, 1);
    fresh.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_larger_than_the_staging_area_are_split_both_ways() {
    let cluster = Cluster::start();
    let config = cluster.config("split", free_port());
    let store = config.store();
    // Ten values of 7 MiB: 70 MiB against a 64 MiB staging area.
    let items: Vec<(String, Framed)> = (0..10)
        .map(|i| {
            let body = block(i, 7 << 20);
            (
                format!("split@raw@{i}"),
                Framed {
                    head: Bytes::from_static(b"h"),
                    body,
                    tail: Bytes::new(),
                    seal: false,
                },
            )
        })
        .collect();
    store.put_batch(&items).await.unwrap();
    let names: Vec<String> = items.iter().map(|(n, _)| n.clone()).collect();
    let mut asked = names.clone();
    asked.insert(2, "split@raw@missing".into());
    let got = store.get_batch(&asked).await.unwrap();
    assert!(got[2].is_none(), "a missing name is a miss");
    let found = got
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != 2)
        .map(|(_, g)| g);
    for ((name, framed), got) in items.iter().zip(found) {
        let got = got.as_ref().expect("a value");
        assert_eq!(got.len(), framed.len(), "{name}");
        assert!(got[..1] == *b"h" && got[1..] == framed.body[..], "{name}");
    }
    store.remove_batch(&names).await.unwrap();
    assert_eq!(store.exists_batch(&names).await.unwrap(), vec![false; 10]);
    store.remove_batch(&names).await.unwrap(); // removing what is gone is done, not an error
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_foreign_or_torn_value_under_a_blocks_name_is_a_counted_miss() {
    let cluster = Cluster::start();
    let config = cluster.config("tenant", free_port());
    let l4 = L4::open(config.store(), config.options(), true)
        .await
        .unwrap();
    let ns = Namespace::new("m", "");
    let raw = cluster.config("tenant", free_port()).store();
    let foreign = name(&config.prefix, key_hash(&ns, &key(0)));
    raw.put_batch(&[(
        foreign,
        Framed {
            head: Bytes::new(),
            body: block(0, 4096),
            tail: Bytes::new(),
            seal: false,
        },
    )])
    .await
    .unwrap();
    // A real block, then its stored frame cut short (a torn write).
    let long: Arc<dyn LongStore> = Arc::new(l4);
    let store = Store::new(1 << 20, None, Some(long.clone()));
    assert!(
        store
            .set(
                &ns,
                &SetItem::new(key(1), block(1, 65536)).retention(Retention::Long),
                1
            )
            .await
            .accepted
    );
    long.flush().await.unwrap();
    let torn = name(&config.prefix, key_hash(&ns, &key(1)));
    let whole = raw.get_batch(std::slice::from_ref(&torn)).await.unwrap()[0]
        .clone()
        .unwrap();
    raw.put_batch(&[(
        torn,
        Framed {
            head: Bytes::new(),
            body: whole.slice(..whole.len() - 100),
            tail: Bytes::new(),
            seal: false,
        },
    )])
    .await
    .unwrap();

    let reader = cluster.config("tenant", free_port());
    let reader = L4::open(reader.store(), reader.options(), true)
        .await
        .unwrap();
    for i in [0, 1] {
        assert!(
            reader
                .get(&ns, &key(i), key_hash(&ns, &key(i)), 1)
                .await
                .is_none(),
            "block {i}"
        );
    }
    let s = reader.l4_stats();
    assert_eq!(s.rejected_total, 2, "{s:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_cluster_costs_no_client_error_and_the_breaker_closes_when_it_is_back() {
    let mut cluster = Cluster::start();
    let mut options = cluster.config("chaos", free_port()).options();
    options.retry_interval = Duration::from_millis(200);
    options.op_timeout = Duration::from_secs(5);
    l4_outage::a_killed_store_costs_no_client_error(&mut cluster, options, WITHIN).await;
}

impl Outage for Cluster {
    /// A client named by a port of its own: a name just killed is refused for a while.
    fn client(&self) -> Arc<dyn RemoteStore> {
        self.config("chaos", free_port()).store()
    }
    fn kill(&mut self) {
        Cluster::kill(self);
    }
    fn restart(&mut self) {
        Cluster::restart(self);
    }
}

/// The cluster's holder filled by another client's values, to less than a block's room.
struct Filled {
    store: Arc<dyn RemoteStore>,
    names: Vec<String>,
}

#[async_trait::async_trait]
impl l4_full::Full for Filled {
    async fn fill(&mut self) {
        // Rounds of values until one is refused, 7 MiB ones then 1 MiB ones, each round's
        // read once (so leased: the master evicts none of them), until a round of 1 MiB ones
        // adds none (room an eviction made meanwhile is taken by the next round).
        let mut size = 7 << 20;
        loop {
            let before = self.names.len();
            loop {
                assert!(self.names.len() < 512, "the holder never filled");
                let name = format!("fill@raw@{}", self.names.len());
                let framed = Framed {
                    head: Bytes::from_static(b"f"),
                    body: Bytes::from(vec![0u8; size]),
                    tail: Bytes::new(),
                    seal: false,
                };
                if !self
                    .store
                    .put_batch(&[(name.clone(), framed)])
                    .await
                    .unwrap()
                    .is_empty()
                {
                    break;
                }
                self.names.push(name);
            }
            self.store.get_batch(&self.names[before..]).await.unwrap();
            if size == 1 << 20 && self.names.len() == before {
                return;
            }
            size = 1 << 20;
        }
    }
    async fn empty(&mut self) {
        self.store.remove_batch(&self.names).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_holder_refuses_puts_without_tripping_the_breaker() {
    // A master that evicts next to nothing, and nothing read in the last ten minutes (a
    // lease): full stays full. (One that evicts makes room for a single value, refusing only
    // what does not fit meanwhile.)
    let cluster = Cluster::start_with(&["--eviction_ratio=0", "--default_kv_lease_ttl=600000"]);
    let cfg = cluster.config("full", free_port());
    let l4 = L4::open(cfg.store(), cfg.options(), true).await.unwrap();
    let mut filled = Filled {
        store: cluster.config("filler", free_port()).store(),
        names: Vec::new(),
    };
    l4_full::a_full_store_refuses_without_tripping_the_breaker(&l4, &mut filled).await;
}
