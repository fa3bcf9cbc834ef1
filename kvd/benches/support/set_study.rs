//! The L2 SET latency study shared by the L4 benches: p50/p99 of SETs of 64 KiB `long` blocks
//! into the tiered store with no L4, and with an L4 that is healthy, slow (50 ms per remote
//! operation) or down, the cases interleaved SET by SET (see [`set_round`]), so that whatever
//! the machine does at a moment touches every case alike and each case's p99 is compared with
//! the baseline's under the same conditions. A second store with no L4 runs among them (the
//! A/A row): its ratio to the baseline is the study's own noise. Two loads: back to back (the
//! writer always has work) and paced, one SET per 200 µs (320 MB/s: the writer keeps up and
//! goes idle between SETs, as in a daemon that is not saturated). Each load runs twice: with
//! the SETs on a worker of the runtime the L4 writer runs on, as in the daemon, and with the
//! SETs on a CPU of their own (`support/own_core.rs`), as on a host with cores to spare, which
//! leaves the SET's own L4 work. Target: p99 within 10 % of no L4 (a SET never waits on L4).
//!
//! The L2s are on the heap, each SET's value kept as it came (`--shared-arena-bytes 0`), and
//! fresh per round: the SET path at its shortest. Two loads more run the L2s as `infera kvd`
//! does by default, in a shared arena as large as the budget, into whose slots each SET
//! copies its value (the L4 then pins the slot until the block is written): one store per
//! case for the whole load, warm-up rounds filling its arena first, so that the counted
//! rounds evict on memory already touched; a round's keys come back once L2 has evicted
//! them (the L4's store overwrites its copies).

use bytes::Bytes;
use infera_core::event::Retention;
use infera_core::rng::Rng;
use infera_kvd::arena::Arena;
use infera_kvd::l4::frame::Framed;
use infera_kvd::l4::{L4, L4Options, RemoteError, RemoteStore};
use infera_kvd::long::LongStore;
use infera_kvd::store::Store;
use infera_kvd::{Namespace, SetItem};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::own_core::OwnCore;

/// SETs per case and round, back to back and paced.
const SETS: usize = 8000;
const PACED_SETS: usize = 2000;
/// The paced load's interval between SET starts.
const PACE: Duration = Duration::from_micros(200);
/// Rounds counted per load (each with fresh L2s on the heap; the arena loads keep theirs);
/// each case's figure is the median over them.
const ROUNDS: usize = 7;
/// Every L2's budget in the SET studies (here and over the socket), and an arena's size.
pub const BUDGET: u64 = 1 << 30;
/// The bytes of each SET's value.
pub const VALUE: usize = 64 << 10;

/// The rounds of `sets` SETs that fill an L2 of [`BUDGET`]: an arena study's warm-up, after
/// which a round's keys may come back (L2 holds none of them then).
pub const fn rounds_to_fill(sets: usize) -> usize {
    (BUDGET as usize).div_ceil(sets * VALUE)
}
/// How long an L4 may take to write what a round queued (the slow store sends a batch per
/// 50 ms).
const DRAIN: Duration = Duration::from_secs(120);

/// Runs the study: `healthy` makes a store of a running cluster (once for the healthy case,
/// once under the slow wrapper), `down` is one nothing answers; prints a table per load.
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
        // The baseline's twin, interleaved like the others: its ratio is the study's own
        // noise, against which the L4 cases' are read.
        ("no L4 (A/A)", None),
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
    let loads = [
        ("back to back", SETS, Duration::ZERO, false, false),
        ("one per 200 µs", PACED_SETS, PACE, false, false),
        (
            "back to back, SETs on a CPU of their own",
            SETS,
            Duration::ZERO,
            true,
            false,
        ),
        (
            "one per 200 µs, SETs on a CPU of their own",
            PACED_SETS,
            PACE,
            true,
            false,
        ),
        (
            "back to back, L2 in the shared arena",
            SETS,
            Duration::ZERO,
            false,
            true,
        ),
        (
            "one per 200 µs, L2 in the shared arena",
            PACED_SETS,
            PACE,
            false,
            true,
        ),
    ];
    for (load, sets, pace, own, arena) in loads {
        // Held over the load's rounds.
        let core = if own {
            let Some(core) = OwnCore::reserve() else {
                println!("\n{load}: not run, this machine gives the bench one CPU");
                continue;
            };
            Some(core)
        } else {
            None
        };
        // The arena loads' stores, kept over the load and filled first.
        let (kept, warm_up) = if arena {
            let stores: Vec<Arc<Store>> = longs
                .iter()
                .map(|(_, long)| {
                    let arena = Arena::new(BUDGET, None).unwrap();
                    Arc::new(Store::new(BUDGET, Some(Arc::new(arena)), long.clone()))
                })
                .collect();
            (Some(stores), rounds_to_fill(sets))
        } else {
            (None, 0)
        };
        let mut samples = vec![(Vec::new(), Vec::new()); longs.len()];
        for round in 0..warm_up + ROUNDS {
            let stores = match &kept {
                Some(stores) => stores.clone(),
                None => longs
                    .iter()
                    .map(|(_, long)| Arc::new(Store::new(BUDGET, None, long.clone())))
                    .collect(),
            };
            // An arena load's keys come back once the L2 holds none of them (it holds
            // `warm_up` rounds' at most); its warm-up rounds run back to back.
            let keys = if arena { round % (warm_up + 1) } else { round };
            let pace = if round < warm_up {
                Duration::ZERO
            } else {
                pace
            };
            let run = set_round(stores, round, keys, sets, pace);
            let figures = match &core {
                // On a runtime worker thread, as the daemon serves a connection's SETs.
                None => rt.block_on(rt.spawn(run)).unwrap(),
                // On the reserved CPU (a SET never awaits the L4 writer, which stays on the
                // runtime, off that CPU).
                Some(core) => std::thread::scope(|s| {
                    s.spawn(move || {
                        core.enter();
                        tokio::runtime::Builder::new_current_thread()
                            .enable_all()
                            .build()
                            .unwrap()
                            .block_on(run)
                    })
                    .join()
                    .unwrap()
                }),
            };
            if round >= warm_up {
                for ((p50s, p99s), (p50, p99)) in samples.iter_mut().zip(figures) {
                    p50s.push(p50);
                    p99s.push(p99);
                }
            }
            // The next round starts with every L4's queue written (one that is down keeps its
            // removals queued and answers at once).
            for long in longs.iter().filter_map(|(_, long)| long.as_ref()) {
                let flushed =
                    rt.block_on(async { tokio::time::timeout(DRAIN, long.flush()).await });
                assert!(
                    flushed.is_ok(),
                    "the L4 queue did not drain within {DRAIN:?}"
                );
            }
        }
        let rows = longs
            .iter()
            .zip(samples)
            .map(|((name, _), (p50s, p99s))| (*name, p50s, p99s))
            .collect();
        report(
            &format!(
                "L2 SET of 64 KiB long blocks, {load} ({sets} per case and round; medians of \
                 {ROUNDS} rounds)"
            ),
            rows,
        );
    }
    rt.block_on(async {
        for (_, long) in &longs {
            if let Some(long) = long {
                let _ = long.close().await;
            }
        }
    });
}

/// The p50 and p99 of `times` (sorted here).
pub fn percentiles(times: &mut [Duration]) -> (Duration, Duration) {
    times.sort();
    (times[times.len() / 2], times[times.len() * 99 / 100])
}

/// Prints `title` and, per case (the first is the baseline, no L4), the medians over rounds of
/// its p50s and p99s, and its p99 against the baseline's of the same round: the median of
/// those ratios and their range (a round's conditions touch every case of it alike).
pub fn report(title: &str, rows: Vec<(&str, Vec<Duration>, Vec<Duration>)>) {
    // The median, the lowest and the highest.
    let spread = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        (v[v.len() / 2], v[0], v[v.len() - 1])
    };
    let micros = |v: &[Duration]| v.iter().map(|d| d.as_secs_f64() * 1e6).collect::<Vec<_>>();
    println!("\n{title}:");
    let mut base: Option<Vec<f64>> = None;
    for (name, p50s, p99s) in rows {
        let p99s = micros(&p99s);
        let base = base.get_or_insert_with(|| p99s.clone());
        let ratios = p99s
            .iter()
            .zip(base.iter())
            .map(|(p, b)| (p / b - 1.0) * 100.0);
        let (ratio, low, high) = spread(ratios.collect());
        println!(
            "  {name:<18} p50 {:>8.1} µs   p99 {:>8.1} µs   p99 vs no L4 {ratio:>+6.1} % \
             (rounds {low:+.1}..{high:+.1} %)",
            spread(micros(&p50s)).0,
            spread(p99s).0,
        );
    }
}

/// Round `round`: `sets` SETs of 64 KiB `long` blocks into each of `stores` (one per case),
/// under the keys of key set `keys`, interleaved SET by SET in an order shuffled per cycle (no
/// case always right after the same other one), one SET starting every `pace` at most
/// (spinning between them: a sleep's wake-up would be measured with the next SET). The p50
/// and p99 of each case.
async fn set_round(
    stores: Vec<Arc<Store>>,
    round: usize,
    keys: usize,
    sets: usize,
    pace: Duration,
) -> Vec<(Duration, Duration)> {
    let mut times = vec![Vec::with_capacity(sets); stores.len()];
    let mut cycles = Cycles::new(stores.len(), round);
    for i in 0..sets {
        for &at in cycles.next() {
            // Each SET's namespace and block of its own, the block a slice of its buffer: as
            // the daemon's decoder hands them over, a namespace parsed per frame and a value
            // sliced from its frame. With one namespace or buffer behind every SET, the SETs
            // taking them and the L4 writer dropping each block it wrote would contend on
            // their reference counts, which no daemon does.
            let ns = Namespace::new("bench", "");
            let value = Bytes::from(vec![7u8; VALUE]).slice(..);
            let item = SetItem::new(format!("s{keys}-{i}"), value).retention(Retention::Long);
            let t = Instant::now();
            assert!(stores[at].set(&ns, &item, 1).await.accepted);
            times[at].push(t.elapsed());
            while t.elapsed() < pace {
                std::hint::spin_loop();
            }
        }
    }
    times.iter_mut().map(|t| percentiles(t)).collect()
}

/// The cases' order in each cycle of an interleaved round: shuffled anew per cycle
/// (Fisher-Yates over the project's seeded [`Rng`], seeded by the round), so that no case
/// always runs right after the same other one.
pub struct Cycles {
    order: Vec<usize>,
    rng: Rng,
}

impl Cycles {
    pub fn new(cases: usize, round: usize) -> Self {
        Self {
            order: (0..cases).collect(),
            rng: Rng::new(round as u64),
        }
    }

    /// The next cycle's order.
    pub fn next(&mut self) -> &[usize] {
        for j in (1..self.order.len()).rev() {
            let k = self.rng.below(j as u64 + 1) as usize;
            self.order.swap(j, k);
        }
        &self.order
    }
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
    async fn put_batch(&self, items: &[(String, Framed)]) -> Result<Vec<usize>, RemoteError> {
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
