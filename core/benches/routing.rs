//! A whole routing decision without tokenization, the router's per-request hot path.
//!
//! Scenario: 64 mixed workers (block size 16) registered through the event log; their KV caches hold
//! about 1 M (block, worker) entries — 32 applications' 256-block system prompts, each cached on 8
//! workers, plus private 256-block conversation tails (30 per worker); 4 requests in flight per
//! worker. A request is an 8,192-token prompt (512 blocks): an application's system prompt followed
//! by a conversation tail, so candidates overlap it by 0, 256 or 512 blocks.
//!
//! `decision/hash+route_8k_tokens_64_workers` measures hashing the prompt (chained XXH3 over 512
//! blocks) plus `Router::decide` (overlap over 64 candidates, load, cost, choice);
//! `…_resident` the same with `--router-resident-weight 1` after 2,048 finished conversations
//! left their tips (32 per worker, the most kept); `…_balance` the same with
//! `--router-balance-tokens 512`, counting the 2,304 picks the fleet remembers.
//! `decision/hash_only_8k_tokens_adapter` hashes the same prompt for a LoRA adapter's request
//! (every block keyed by the adapter's name). `decision/route_only_…_session` routes a request
//! whose session is pinned (one of the 2,048 finished conversations'), against `route_only`.
//! `decision/stream_16_chunks_guarded_with_progress` relays a 16-chunk stream through the health
//! guard that counts its worker's progress, against `…_unguarded`.
//! `decision/kvd_hashes_8k_tokens` names the prompt's blocks as kvd does (the connectors' SHA-256
//! key chain, then the inventory hash), what a request pays when its workers name kvds;
//! `decision/route_only_512_blocks_64_workers_kvd_tiers` routes on the same fleet where every 8
//! workers share a node kvd whose host RAM holds its workers' conversation tails, against
//! `route_only`.

use criterion::{Criterion, criterion_group, criterion_main};
use infera_core::event::{
    Engine, Envelope, Event, KvBlocksStored, RequestFinished, RequestStatus, RequestTransport,
    Role, Tier, WorkerRecord, WorkerRegistered,
};
use infera_core::fleet::{FleetConfig, FleetState};
use infera_core::hashing::{KvIdentity, hash_blocks, hash_prompt_blocks, synthetic_block_tokens};
use infera_core::ids::{BlockHash, EngineHash, RequestId, SessionKey, WorkerId, WorkerRank};
use infera_core::kv_events::kvd;
use infera_core::policy::{KvdHashes, RouteRequest, Router, RouterConfig};
use infera_core::projection::Projection;
use infera_core::service::health::{Health, guard_body};
use infera_core::service::outlier::Outliers;
use infera_core::service::{FirstByte, Prefill};
use std::hint::black_box;
use std::time::Duration;

const WORKERS: usize = 64;
const BS: usize = 16;
const APPS: u64 = 32;
const PREFIX_BLOCKS: usize = 256;
const TAIL_BLOCKS: usize = 256;
const TAILS_PER_WORKER: u64 = 30;

fn tokens(ids: impl Iterator<Item = u64>) -> Vec<u32> {
    let mut out = Vec::new();
    for id in ids {
        synthetic_block_tokens(id, BS, &mut out);
    }
    out
}

fn prompt(app: u64, tail: u64) -> Vec<u32> {
    let prefix = (0..PREFIX_BLOCKS as u64).map(|b| app * 1_000 + b);
    let tail = (0..TAIL_BLOCKS as u64).map(|b| 1_000_000 + tail * 1_000 + b);
    tokens(prefix.chain(tail))
}

/// The request for prompt `toks`, hashed at the fleet's block size.
fn request(id: String, toks: &[u32]) -> RouteRequest {
    RouteRequest {
        request_id: RequestId::new(id),
        model: "m".into(),
        prompt_tokens: toks.len() as u32,
        hashes: vec![(BS as u32, hash_blocks(toks, BS, None))],
        retention: None,
        per_worker: Default::default(),
        exclude: vec![],
        session: None,
        kvd: Vec::new(),
    }
}

struct Setup {
    fleet: FleetState,
    seq: u64,
}

impl Setup {
    fn apply(&mut self, event: Event) {
        self.seq += 1;
        self.fleet.apply(&Envelope {
            v: 1,
            seq: self.seq,
            ts_us: 0,
            source: None,
            event,
        });
    }
}

/// The kvd endpoint of worker `w`'s node (8 workers per node).
fn node_kvd(w: usize) -> String {
    format!("tcp://node{}:5590", w / 8)
}

fn setup() -> Setup {
    setup_with(false)
}

/// [`setup`], with every worker naming its node's kvd (`tiered`), whose host RAM holds the
/// node's workers' conversation tails.
fn setup_with(tiered: bool) -> Setup {
    let mut s = Setup {
        fleet: FleetState::new(FleetConfig::default()),
        seq: 0,
    };
    for w in 0..WORKERS {
        let id = format!("10.0.{}.{}:8000", w / 256, w % 256);
        let mut record = WorkerRecord {
            worker_id: WorkerId::new(id.clone()),
            url: format!("http://{id}"),
            model_name: "m".into(),
            engine: Engine::Vllm,
            disagg_mode: Role::Mixed,
            disagg_meta: None,
            kv_events_endpoint: None,
            kv_block_size: BS as u32,
            dp_rank: 0,
            dp_size: 1,
            request_transport: RequestTransport::Http,
            kv: None,
            extra: Default::default(),
        };
        if tiered {
            record
                .extra
                .insert(kvd::KVD_EVENTS_ENDPOINT.into(), node_kvd(w).into());
        }
        s.apply(Event::WorkerRegistered(WorkerRegistered { record }));
    }
    let store = |s: &mut Setup, w: usize, hashes: Vec<BlockHash>| {
        let worker = WorkerRank::new(format!("10.0.{}.{}:8000", w / 256, w % 256), 0);
        let engine_hashes = hashes
            .iter()
            .map(|h| EngineHash(h.0 ^ ((w as u64 + 1) * 0x9E37)))
            .collect();
        s.apply(Event::KvBlocksStored(KvBlocksStored {
            worker,
            tier: Tier::Gpu,
            block_size: BS as u32,
            engine_hashes,
            router_hashes: hashes,
            parent: None,
        }));
    };
    for app in 0..APPS {
        let h = hash_blocks(&prompt(app, 0)[..PREFIX_BLOCKS * BS], BS, None);
        for k in 0..8 {
            store(&mut s, ((app as usize) * 2 + k * 8) % WORKERS, h.clone());
        }
    }
    for w in 0..WORKERS {
        for t in 0..TAILS_PER_WORKER {
            let tail = w as u64 * 100 + t;
            let toks = prompt(tail % APPS, tail);
            store(&mut s, w, hash_blocks(&toks, BS, None));
            if tiered {
                let names = kvd::request_hashes("m", "", &toks, BS, &KvIdentity::default());
                s.apply(Event::KvBlocksStored(KvBlocksStored {
                    worker: kvd::source_rank(&node_kvd(w)),
                    tier: Tier::Host,
                    block_size: 0,
                    engine_hashes: names.iter().map(|h| EngineHash(h.0)).collect(),
                    router_hashes: names,
                    parent: None,
                }));
            }
        }
    }
    let mut router = Router::new(RouterConfig::default());
    // Finished conversations, each leaving a tip on its worker and its session's pin.
    for i in 0..(WORKERS * 32) as u64 {
        let req = RouteRequest {
            session: Some(SessionKey(i)),
            ..request(format!("done{i}"), &prompt(i % APPS, 8_000_000 + i))
        };
        if let Ok(d) = router.decide(&s.fleet, &req, 0) {
            s.apply(Event::RequestRouted(d));
            s.apply(Event::RequestFinished(RequestFinished {
                request_id: req.request_id,
                status: RequestStatus::Ok,
                ttft_us: None,
                tokens_in: 0,
                tokens_out: 0,
                cached_tokens: None,
            }));
        }
    }
    for i in 0..(WORKERS * 4) as u64 {
        let req = request(format!("busy{i}"), &prompt(i % APPS, 9_000_000 + i));
        if let Ok(d) = router.decide(&s.fleet, &req, i * 1000) {
            s.apply(Event::RequestRouted(d));
        }
    }
    s
}

fn benches(c: &mut Criterion) {
    let s = setup();
    println!("index entries: {}", s.fleet.index().entries());
    let requests: Vec<Vec<u32>> = (0..64u64)
        .map(|i| prompt(i % APPS, 100 * (i % WORKERS as u64) + i % 30))
        .collect();
    for (name, resident_weight, balance_tokens) in [
        ("decision/hash+route_8k_tokens_64_workers", 0.0, 0),
        ("decision/hash+route_8k_tokens_64_workers_resident", 1.0, 0),
        ("decision/hash+route_8k_tokens_64_workers_balance", 0.0, 512),
    ] {
        let mut router = Router::new(RouterConfig {
            resident_weight,
            balance_tokens,
            ..RouterConfig::default()
        });
        let mut i = 0usize;
        c.bench_function(name, |b| {
            b.iter(|| {
                let req = request("r".into(), &requests[i % requests.len()]);
                i += 1;
                black_box(router.decide(&s.fleet, &req, 1_000_000).is_ok())
            })
        });
    }
}

fn parts(c: &mut Criterion) {
    let s = setup();
    let toks = prompt(3, 300);
    c.bench_function("decision/hash_only_8k_tokens", |b| {
        b.iter(|| black_box(hash_blocks(black_box(&toks), BS, None)))
    });
    // An adapter's request: every block keyed by the adapter's name as well.
    let adapter = KvIdentity {
        lora: Some("sql-adapter".into()),
        ..KvIdentity::default()
    };
    c.bench_function("decision/hash_only_8k_tokens_adapter", |b| {
        b.iter(|| black_box(hash_prompt_blocks(black_box(&toks), BS, &adapter)))
    });
    let req = request("r".into(), &toks);
    let mut router = Router::new(RouterConfig::default());
    c.bench_function("decision/route_only_512_blocks_64_workers", |b| {
        b.iter(|| black_box(router.decide(&s.fleet, &req, 1_000_000).is_ok()))
    });
    let req = RouteRequest {
        session: Some(SessionKey(7)),
        ..req
    };
    c.bench_function("decision/route_only_512_blocks_64_workers_session", |b| {
        b.iter(|| black_box(router.decide(&s.fleet, &req, 1_000_000).is_ok()))
    });
}

/// The kvd side of a decision: naming the prompt's blocks, and routing with tier credits.
fn tiers(c: &mut Criterion) {
    let toks = prompt(3, 300);
    let plain = KvIdentity::default();
    c.bench_function("decision/kvd_hashes_8k_tokens", |b| {
        b.iter(|| black_box(kvd::request_hashes("m", "", black_box(&toks), BS, &plain)))
    });
    let s = setup_with(true);
    let req = RouteRequest {
        kvd: vec![KvdHashes {
            block_size: BS as u32,
            compat_key: "".into(),
            hashes: kvd::request_hashes("m", "", &toks, BS, &plain),
        }],
        ..request("r".into(), &toks)
    };
    let mut router = Router::new(RouterConfig::default());
    c.bench_function("decision/route_only_512_blocks_64_workers_kvd_tiers", |b| {
        b.iter(|| black_box(router.decide(&s.fleet, &req, 1_000_000).is_ok()))
    });
}

/// What the first-byte deadline adds to a request: its derivation at dispatch and the rate
/// sample at the first byte, on a fleet of 64 measured workers.
fn first_byte(c: &mut Criterion) {
    let fb = FirstByte::default();
    let workers: Vec<WorkerId> = (0..WORKERS)
        .map(|w| WorkerId::new(format!("w{w}:1")))
        .collect();
    for w in &workers {
        fb.observe(w, 4_096, Duration::from_millis(300));
    }
    let work = Prefill {
        uncached_tokens: 2_048,
        queued_tokens: 8_192,
    };
    let mut i = 0usize;
    c.bench_function("decision/first_byte_deadline_and_sample", |b| {
        b.iter(|| {
            let w = &workers[i % workers.len()];
            i += 1;
            let d = fb.deadline(black_box(w), work);
            fb.observe(w, 2_048, Duration::from_millis(150));
            black_box(d)
        })
    });
}

/// What outlier detection adds to a request: its outcome and its time to first byte kept on
/// its worker, on a fleet of 64 workers whose rings are full; and the check every decision
/// makes when no worker is ejected.
fn outliers(c: &mut Criterion) {
    let o = Outliers::default();
    let workers: Vec<WorkerId> = (0..WORKERS)
        .map(|w| WorkerId::new(format!("w{w}:1")))
        .collect();
    for (t, w) in workers.iter().enumerate() {
        for _ in 0..20 {
            o.outcome(w, false, t as u64);
            o.first_byte(w, 4_096, Duration::from_millis(300), t as u64);
        }
    }
    let mut i = 0usize;
    c.bench_function("decision/outlier_samples_and_check", |b| {
        b.iter(|| {
            let w = &workers[i % workers.len()];
            i += 1;
            let out = o.ejected();
            o.outcome(black_box(w), false, i as u64);
            o.first_byte(w, 2_048, Duration::from_millis(150), i as u64);
            black_box(out)
        })
    });
}

/// What the health guard costs a stream: its worker watched for leaving routing and its
/// progress looked up, once per attempt (64 workers), and every chunk counted as the guard
/// passes it on; a 16-chunk stream through the guard, against the same stream unguarded.
fn stream_progress(c: &mut Criterion) {
    use futures::StreamExt as _;
    let health = Health::default();
    let workers: Vec<WorkerId> = (0..WORKERS)
        .map(|w| WorkerId::new(format!("w{w}:1")))
        .collect();
    let chunks = || {
        futures::stream::iter((0..16).map(|_| Ok(bytes::Bytes::from_static(b"data: {}\n\n"))))
            .boxed()
    };
    let mut i = 0usize;
    c.bench_function("decision/stream_16_chunks_guarded_with_progress", |b| {
        b.iter(|| {
            let w = &workers[i % workers.len()];
            i += 1;
            let (left, progress) = health.watch(black_box(w));
            let worker = w.clone();
            let left = async move {
                left.await;
                worker
            };
            let body = guard_body(chunks(), left, progress);
            black_box(futures::executor::block_on(body.count()))
        })
    });
    c.bench_function("decision/stream_16_chunks_unguarded", |b| {
        b.iter(|| black_box(futures::executor::block_on(chunks().count())))
    });
}

criterion_group!(
    routing,
    benches,
    parts,
    first_byte,
    outliers,
    stream_progress,
    tiers
);
criterion_main!(routing);
