//! Benchmarks of the KV index's hot paths: event ingest and the overlap query, plus its memory.
//!
//! Scenario, "chat fleet at 1 M entries":
//! - 64 worker ranks, block size 16 tokens, one tier (GPU).
//! - 24 applications, each with a system prompt of 32..128 blocks; popularity is Zipf-like (app `k`
//!   is picked with weight `1 / (k + 1)`).
//! - A conversation picks an app and grows a private tail: its chain (system prompt + tail) is
//!   96..512 blocks. It is cached on 1..3 workers (the router's pick plus spill-over); each keeps a
//!   prefix of 60..100 % of the tail (eviction trims tails first). 16 extra conversations of exactly
//!   512 blocks are fully cached on one worker each (the worst case for a query).
//! - Router hashes are real chained XXH3 hashes of synthetic tokens (`infera_core::hashing`); engine
//!   hashes mix the router hash with a per-worker salt, as vLLM's per-process hash seed does.
//! - Events are `KvBlocksStored` batches of 16..64 blocks (one prefill chunk) with the engine parent
//!   set; a worker emits a system prompt's blocks only the first time it caches them.
//! - Conversations are added until the index holds 1 M (block, worker rank) entries.
//! - Requests are next turns of 512 blocks, scored against all 64 ranks: 80 % continue a cached
//!   conversation (its chain, then new blocks), 20 % start a new conversation of an app.
//!
//! With `INDEX_FLEET=1` the same scenario runs at fleet scale: 1,000 worker ranks and 50 M
//! entries, the report only (issue #45's "one router at fleet scale").
//!
//! Benches: `ingest/build_1M` (all events into an empty index), `ingest/churn_on_1M` (store then
//! evict 32 blocks on the full index), `overlap/512x64@1M/{mixed,full_hit}`. Before them, `report`
//! prints the memory per entry measured by a counting global allocator (and `heap_bytes()`), the
//! median of 5 builds, and overlap percentiles timed one call at a time, with warm caches and
//! "cold" (a 64 MiB sweep before each call, as the router's other work between two decisions).

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use infera_core::event::{KvBlocksRemoved, KvBlocksStored, Tier};
use infera_core::hashing::{hash_block, synthetic_block_tokens};
use infera_core::ids::{BlockHash, EngineHash, WorkerId, WorkerRank};
use infera_core::index::{KvIndex, WorkerSlot};
use infera_core::rng::{Rng, splitmix64};
use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// The system allocator, counting live bytes.
struct Counting;

static LIVE_BYTES: AtomicUsize = AtomicUsize::new(0);

#[allow(unsafe_code)]
// SAFETY: every method forwards to `System` with the caller's arguments unchanged, so `System`'s
// guarantees carry over; the only addition is a relaxed counter update.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: same contract as the caller's.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            LIVE_BYTES.fetch_add(layout.size(), Ordering::Relaxed);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: same contract as the caller's.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            LIVE_BYTES.fetch_add(layout.size(), Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was allocated by this allocator (hence `System`) with `layout`.
        unsafe { System.dealloc(ptr, layout) };
        LIVE_BYTES.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: `ptr` was allocated by this allocator (hence `System`) with `layout`.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            LIVE_BYTES.fetch_add(new_size, Ordering::Relaxed);
            LIVE_BYTES.fetch_sub(layout.size(), Ordering::Relaxed);
        }
        p
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// The scenario's size: 64 ranks and 1 M entries; with `INDEX_FLEET=1`, one router at fleet
/// scale, 1,000 ranks and 50 M entries, for which only the report runs (no criterion benches).
#[derive(Debug, Clone, Copy)]
struct Scale {
    workers: usize,
    entries: usize,
}

impl Scale {
    fn from_env() -> Self {
        if std::env::var_os("INDEX_FLEET").is_some_and(|v| v == "1") {
            Self {
                workers: 1_000,
                entries: 50_000_000,
            }
        } else {
            Self {
                workers: 64,
                entries: 1_000_000,
            }
        }
    }

    fn fleet(self) -> bool {
        self.workers > 64
    }
}
const BLOCK_SIZE: usize = 16;
const APPS: usize = 24;
const REQUEST_BLOCKS: usize = 512;
const REQUESTS: usize = 1024;

/// Everything the benches replay.
struct Workload {
    workers: Vec<WorkerRank>,
    events: Vec<KvBlocksStored>,
    blocks: usize,
    /// Mixed next-turn requests.
    requests: Vec<Vec<BlockHash>>,
    /// Requests fully cached (512 blocks) on one worker.
    full_hits: Vec<Vec<BlockHash>>,
    /// Store/evict pairs for the churn bench (fresh blocks, 32 each).
    churn: Vec<(KvBlocksStored, KvBlocksRemoved)>,
}

/// Extends `chain` to `len` blocks of synthetic tokens named by `(id, position)`.
fn grow(chain: &mut Vec<BlockHash>, id: u64, len: usize, tokens: &mut Vec<u32>) {
    while chain.len() < len {
        tokens.clear();
        synthetic_block_tokens(
            id.wrapping_mul(1 << 20) + chain.len() as u64,
            BLOCK_SIZE,
            tokens,
        );
        let h = hash_block(tokens, chain.last().copied());
        chain.push(h);
    }
}

fn engine_hash(worker: usize, router: BlockHash) -> EngineHash {
    let mut s = router.0 ^ (worker as u64).wrapping_mul(0xA24B_AED4_963E_E407);
    EngineHash(splitmix64(&mut s))
}

/// Stored events for `worker` caching `chain[from..]`, in prefill chunks of 16..64 blocks.
fn store_events(
    rng: &mut Rng,
    worker: usize,
    rank: &WorkerRank,
    chain: &[BlockHash],
    from: usize,
    out: &mut Vec<KvBlocksStored>,
) {
    let mut at = from;
    while at < chain.len() {
        let end = (at + 16 + rng.below(49) as usize).min(chain.len());
        let parent = at.checked_sub(1).map(|p| engine_hash(worker, chain[p]));
        out.push(KvBlocksStored {
            worker: rank.clone(),
            tier: Tier::Gpu,
            block_size: BLOCK_SIZE as u32,
            engine_hashes: chain[at..end]
                .iter()
                .map(|&h| engine_hash(worker, h))
                .collect(),
            router_hashes: chain[at..end].to_vec(),
            parent,
        });
        at = end;
    }
}

fn zipf_app(rng: &mut Rng) -> usize {
    let total: f64 = (0..APPS).map(|k| 1.0 / (k + 1) as f64).sum();
    let mut x = rng.next_f64() * total;
    for k in 0..APPS {
        x -= 1.0 / (k + 1) as f64;
        if x <= 0.0 {
            return k;
        }
    }
    APPS - 1
}

fn workload(scale: Scale) -> Workload {
    let mut rng = Rng::new(0x1DE5);
    let mut tokens = Vec::with_capacity(BLOCK_SIZE);
    let workers: Vec<WorkerRank> = (0..scale.workers)
        .map(|i| WorkerRank::new(WorkerId::new(format!("10.0.{}.{}:8000", i / 8, i % 8)), 0))
        .collect();
    let apps: Vec<Vec<BlockHash>> = (0..APPS)
        .map(|a| {
            let mut c = Vec::new();
            grow(
                &mut c,
                1 + a as u64,
                32 + rng.below(97) as usize,
                &mut tokens,
            );
            c
        })
        .collect();
    let mut has_app = vec![[false; APPS]; scale.workers];
    let mut events = Vec::new();
    let mut blocks = 0usize;
    let mut conversations: Vec<Vec<BlockHash>> = Vec::new();
    let mut full_hits = Vec::new();
    let mut id = 1000u64;
    let mut add =
        |rng: &mut Rng, chain: &[BlockHash], app: usize, replicas: usize, keep_all: bool| {
            let prefix = apps[app].len();
            let mut picked = Vec::new();
            while picked.len() < replicas {
                let w = rng.below(scale.workers as u64) as usize;
                if !picked.contains(&w) {
                    picked.push(w);
                }
            }
            let mut added = 0;
            for w in picked {
                let tail = chain.len() - prefix;
                let keep = if keep_all {
                    tail
                } else {
                    tail * (60 + rng.below(41) as usize) / 100
                };
                let from = if has_app[w][app] { prefix } else { 0 };
                has_app[w][app] = true;
                store_events(
                    rng,
                    w,
                    &workers[w],
                    &chain[..prefix + keep],
                    from,
                    &mut events,
                );
                added += prefix + keep - from;
            }
            added
        };
    for _ in 0..16 {
        let app = zipf_app(&mut rng);
        let mut chain = apps[app].clone();
        id += 1;
        grow(&mut chain, id, REQUEST_BLOCKS, &mut tokens);
        blocks += add(&mut rng, &chain, app, 1, true);
        full_hits.push(chain);
    }
    while blocks < scale.entries {
        let app = zipf_app(&mut rng);
        let mut chain = apps[app].clone();
        let len = 96.max(chain.len() + 32) + rng.below(512 - 96) as usize;
        id += 1;
        grow(&mut chain, id, len.min(REQUEST_BLOCKS), &mut tokens);
        let replicas = 1 + rng.below(3) as usize;
        blocks += add(&mut rng, &chain, app, replicas, false);
        conversations.push(chain);
    }
    let requests = (0..REQUESTS)
        .map(|_| {
            let mut chain = if rng.below(10) < 8 {
                conversations[rng.below(conversations.len() as u64) as usize].clone()
            } else {
                apps[zipf_app(&mut rng)].clone()
            };
            id += 1;
            grow(&mut chain, id, REQUEST_BLOCKS, &mut tokens);
            chain
        })
        .collect();
    let churn = (0..REQUESTS)
        .map(|_| {
            let w = rng.below(scale.workers as u64) as usize;
            let mut chain = Vec::new();
            id += 1;
            grow(&mut chain, id, 32, &mut tokens);
            let stored = KvBlocksStored {
                worker: workers[w].clone(),
                tier: Tier::Gpu,
                block_size: BLOCK_SIZE as u32,
                engine_hashes: chain.iter().map(|&h| engine_hash(w, h)).collect(),
                router_hashes: chain.clone(),
                parent: None,
            };
            let removed = KvBlocksRemoved {
                worker: workers[w].clone(),
                tier: Tier::Gpu,
                engine_hashes: stored.engine_hashes.clone(),
                router_hashes: chain,
            };
            (stored, removed)
        })
        .collect();
    Workload {
        workers,
        events,
        blocks,
        requests,
        full_hits,
        churn,
    }
}

fn build(w: &Workload) -> KvIndex {
    let mut ix = KvIndex::new();
    for ev in &w.events {
        ix.apply_stored(ev);
    }
    ix
}

fn slots(ix: &KvIndex, w: &Workload) -> Vec<WorkerSlot> {
    w.workers.iter().filter_map(|r| ix.slot(r)).collect()
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// Prints memory per entry, build throughput and per-call overlap latency percentiles. Timing one
/// call at a time keeps the percentiles meaningful on a machine shared with other work.
fn report(w: &Workload) {
    let before = LIVE_BYTES.load(Ordering::Relaxed);
    let ix = build(w);
    let live = LIVE_BYTES.load(Ordering::Relaxed) - before;
    let mut builds: Vec<Duration> = (0..5)
        .map(|_| {
            let t = Instant::now();
            let ix = build(w);
            let took = t.elapsed();
            drop(ix);
            took
        })
        .collect();
    builds.sort_unstable();
    let rate = |d: Duration| w.blocks as f64 / d.as_secs_f64() / 1e6;
    println!(
        "ingest: 5 builds of {} blocks: median {:.2} M blocks/s, best {:.2} M blocks/s",
        w.blocks,
        rate(builds[2]),
        rate(builds[0])
    );
    let entries = ix.entries();
    let distinct = ix.distinct_blocks(Tier::Gpu);
    println!(
        "index: {} events, {} blocks stored, {entries} entries, {distinct} distinct blocks \
         ({:.2} workers per block)",
        w.events.len(),
        w.blocks,
        entries as f64 / distinct as f64
    );
    println!(
        "memory: allocator {live} B = {:.1} B/entry; heap_bytes() {} B = {:.1} B/entry",
        live as f64 / entries as f64,
        ix.heap_bytes(),
        ix.heap_bytes() as f64 / entries as f64
    );
    let cands = slots(&ix, w);
    let mut out = Vec::with_capacity(cands.len());
    // "cold": a 64 MiB sweep before each call evicts the index from the CPU caches, as the
    // router's other work (tokenizing, HTTP) does between two routing decisions.
    let mut sweep = vec![0u64; 8 << 20];
    let runs = [
        ("mixed", &w.requests, false, 20),
        ("full_hit", &w.full_hits, false, 200),
        ("mixed cold", &w.requests, true, 1),
        ("full_hit cold", &w.full_hits, true, 16),
    ];
    for (name, reqs, cold, rounds) in runs {
        let mut times = Vec::new();
        let mut walked = 0u64;
        for _ in 0..rounds {
            for r in reqs.iter() {
                if cold {
                    sweep.iter_mut().step_by(8).for_each(|x| *x += 1);
                }
                let t = Instant::now();
                ix.overlap(Tier::Gpu, r, &cands, &mut out);
                times.push(t.elapsed());
                walked += u64::from(out.iter().copied().max().unwrap_or(0));
            }
        }
        black_box(&sweep);
        times.sort_unstable();
        println!(
            "overlap {name} 512x{}: p50 {:?} p90 {:?} p99 {:?} over {} calls \
             (mean deepest overlap {:.0} blocks)",
            cands.len(),
            percentile(&times, 0.5),
            percentile(&times, 0.9),
            percentile(&times, 0.99),
            times.len(),
            walked as f64 / times.len() as f64
        );
    }
}

fn benches(c: &mut Criterion) {
    let scale = Scale::from_env();
    let w = workload(scale);
    report(&w);
    if scale.fleet() {
        return;
    }
    let full = build(&w);

    let mut g = c.benchmark_group("ingest");
    g.sample_size(10).measurement_time(Duration::from_secs(8));
    g.throughput(Throughput::Elements(w.blocks as u64));
    g.bench_function("build_1M", |b| {
        b.iter_batched(
            KvIndex::new,
            |mut ix| {
                for ev in &w.events {
                    ix.apply_stored(ev);
                }
                ix
            },
            BatchSize::PerIteration,
        )
    });
    g.sample_size(50).measurement_time(Duration::from_secs(4));
    g.throughput(Throughput::Elements(64));
    let mut ix = full.clone();
    let mut k = 0;
    g.bench_function("churn_on_1M", |b| {
        b.iter(|| {
            let (s, r) = &w.churn[k % w.churn.len()];
            k += 1;
            ix.apply_stored(s);
            ix.apply_removed(r);
        })
    });
    g.finish();

    let mut g = c.benchmark_group("overlap");
    g.sample_size(50).measurement_time(Duration::from_secs(4));
    let cands = slots(&full, &w);
    let mut out = Vec::with_capacity(cands.len());
    for (name, reqs) in [
        ("512x64@1M/mixed", &w.requests),
        ("512x64@1M/full_hit", &w.full_hits),
    ] {
        let mut k = 0;
        g.bench_function(name, |b| {
            b.iter(|| {
                let r = &reqs[k % reqs.len()];
                k += 1;
                full.overlap(Tier::Gpu, black_box(r), &cands, &mut out);
                black_box(&out);
            })
        });
    }
    g.finish();
}

criterion_group!(index, benches);
criterion_main!(index);
