//! The L2 SET latency study shared by the L4 benches: p50/p99 of SETs of 64 KiB `long` blocks
//! into the tiered store with no L4, and with an L4 that is healthy, slow (50 ms per remote
//! operation) or down, the cases alternating over rounds. Target: p99 within 10 % of no L4 (a
//! SET never waits on L4).

use bytes::Bytes;
use infera_core::event::Retention;
use infera_kvd::l4::frame::Framed;
use infera_kvd::l4::{L4, L4Options, RemoteError, RemoteStore};
use infera_kvd::long::LongStore;
use infera_kvd::store::Store;
use infera_kvd::{Namespace, SetItem};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// SETs per case and round.
const SETS: usize = 8000;
/// Rounds: the cases alternate within each round, so a drift of the machine's load touches all
/// of them alike; each case's figure is the median over rounds.
const ROUNDS: usize = 5;

/// Runs the study: `healthy` makes a store of a running cluster (once for the healthy case,
/// once under the slow wrapper), `down` is one nothing answers; prints a table.
pub fn run(
    rt: &tokio::runtime::Runtime,
    options: &L4Options,
    healthy: &dyn Fn() -> Arc<dyn RemoteStore>,
    down: Arc<dyn RemoteStore>,
) {
    let cases: Vec<(&str, Option<Arc<dyn RemoteStore>>)> = vec![
        ("no L4", None),
        ("L4 healthy", Some(healthy())),
        (
            "L4 slow (50 ms)",
            Some(Arc::new(Slow(healthy())) as Arc<dyn RemoteStore>),
        ),
        ("L4 down", Some(down)),
    ];
    let longs: Vec<(&str, Option<Arc<dyn LongStore>>)> = rt.block_on(async {
        let mut out = Vec::new();
        for (name, remote) in cases {
            let long = match remote {
                Some(remote) => {
                    let l4 = L4::open(remote, options.clone(), false).await.unwrap();
                    Some(Arc::new(l4) as Arc<dyn LongStore>)
                }
                None => None,
            };
            out.push((name, long));
        }
        out
    });
    let mut samples = vec![(Vec::new(), Vec::new()); longs.len()];
    for round in 0..ROUNDS {
        for ((_, long), (p50s, p99s)) in longs.iter().zip(&mut samples) {
            // On a runtime worker thread, as the daemon serves a connection's SETs.
            let task = rt.spawn(set_latency(long.clone(), round));
            let (p50, p99) = rt.block_on(task).unwrap();
            p50s.push(p50);
            p99s.push(p99);
        }
    }
    rt.block_on(async {
        for (_, long) in &longs {
            if let Some(long) = long {
                let _ = long.close().await;
            }
        }
    });
    let rows = longs
        .iter()
        .zip(samples)
        .map(|((name, _), (p50s, p99s))| (*name, p50s, p99s))
        .collect();
    report(
        &format!(
            "L2 SET of 64 KiB long blocks ({SETS} per case and round; medians of {ROUNDS} rounds)"
        ),
        rows,
    );
}

/// The p50 and p99 of `times` (sorted here).
pub fn percentiles(times: &mut [Duration]) -> (Duration, Duration) {
    times.sort();
    (times[times.len() / 2], times[times.len() * 99 / 100])
}

/// Prints `title` and, per case (the first is the baseline, no L4), the medians over rounds of
/// its p50s and p99s, and its p99 against the baseline's.
pub fn report(title: &str, rows: Vec<(&str, Vec<Duration>, Vec<Duration>)>) {
    let median = |mut v: Vec<Duration>| {
        v.sort();
        v[v.len() / 2].as_secs_f64() * 1e6
    };
    println!("\n{title}:");
    let mut base = None;
    for (name, p50s, p99s) in rows {
        let (p50, p99) = (median(p50s), median(p99s));
        let base = *base.get_or_insert(p99);
        println!(
            "  {name:<18} p50 {p50:>8.1} µs   p99 {p99:>8.1} µs   p99 vs no L4 {:>+6.1} %",
            (p99 / base - 1.0) * 100.0
        );
    }
}

/// p50 and p99 of SETs of 64 KiB `long` blocks into a fresh 1 GiB L2 with `long` behind it.
async fn set_latency(long: Option<Arc<dyn LongStore>>, round: usize) -> (Duration, Duration) {
    let store = Store::new(1 << 30, None, long);
    let ns = Namespace::new("bench", "");
    let value = Bytes::from(vec![7u8; 64 << 10]);
    let mut times = Vec::with_capacity(SETS);
    for i in 0..SETS {
        let item = SetItem::new(format!("s{round}-{i}"), value.clone()).retention(Retention::Long);
        let t = Instant::now();
        assert!(store.set(&ns, &item, 1).await.accepted);
        times.push(t.elapsed());
    }
    percentiles(&mut times)
}

/// A store that answers like `inner`, 50 ms late.
#[derive(Debug)]
struct Slow(Arc<dyn RemoteStore>);

#[async_trait::async_trait]
impl RemoteStore for Slow {
    fn describe(&self) -> String {
        "slow".into()
    }
    fn backend(&self) -> &'static str {
        self.0.backend()
    }
    fn streams(&self) -> usize {
        self.0.streams()
    }
    fn write_streams(&self) -> usize {
        self.0.write_streams()
    }
    fn twin(&self) -> Option<Arc<dyn RemoteStore>> {
        let twin: Arc<dyn RemoteStore> = Arc::new(Slow(self.0.twin()?));
        Some(twin)
    }
    async fn health(&self) -> Result<(), RemoteError> {
        tokio::time::sleep(Duration::from_millis(50)).await;
        self.0.health().await
    }
    async fn put_batch(&self, items: &[(String, Framed)]) -> Result<(), RemoteError> {
        tokio::time::sleep(Duration::from_millis(50)).await;
        self.0.put_batch(items).await
    }
    async fn get_batch(&self, names: &[String]) -> Result<Vec<Option<Bytes>>, RemoteError> {
        tokio::time::sleep(Duration::from_millis(50)).await;
        self.0.get_batch(names).await
    }
    async fn exists_batch(&self, names: &[String]) -> Result<Vec<bool>, RemoteError> {
        tokio::time::sleep(Duration::from_millis(50)).await;
        self.0.exists_batch(names).await
    }
    async fn remove_batch(&self, names: &[String]) -> Result<(), RemoteError> {
        tokio::time::sleep(Duration::from_millis(50)).await;
        self.0.remove_batch(names).await
    }
}
