//! Event log benches.
//!
//! 1. criterion: appending one batch of 64 envelopes (the server's batch size), per backend —
//!    memory, SQLite (temp file, WAL), JetStream (a nats-server the harness starts).
//! 2. a timed run, for JetStream and SQLite: `INFERA_BENCH_EVENTS` (default 1 000 000) events of
//!    [`workload`] appended in batches of 64; a full replay into `FleetState`; compaction at 90 %
//!    with the projection's dump as snapshot; then the restart path, snapshot + tail rebuild.
//!    Printed as a table; skipped under `--test` / `--list`.
//!
//! `cargo bench -p infera-backends --bench event_log` (needs nats-server >= 2.12, as the tests).

use criterion::{Criterion, Throughput};
use infera_backends::log::{JetStreamLog, JetStreamLogConfig, SqliteLog};
use infera_backends::testing::NatsServer;
use infera_backends::testing::event_log::{append_all, workload};
use infera_core::clock::SystemClock;
use infera_core::event::{EVENT_FORMAT_VERSION, Envelope};
use infera_core::fleet::{FleetConfig, FleetState};
use infera_core::log::{EventLog, MemoryLog, NewEvent, Snapshot, rebuild};
use infera_core::projection::Projection;
use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::runtime::Runtime;

const BATCH: usize = 64;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let listing = args.iter().any(|a| a == "--test" || a == "--list");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    let nats = runtime
        .block_on(NatsServer::start())
        .unwrap_or_else(|e| panic!("the event log benches need nats-server >= 2.12: {e}"));
    let dir = tempfile::tempdir().expect("tempdir");
    let mut criterion = Criterion::default().configure_from_args();
    bench_append(&mut criterion, &runtime, &nats, dir.path());
    criterion.final_summary();
    if !listing {
        let n = std::env::var("INFERA_BENCH_EVENTS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(1_000_000);
        timed_rebuild(&runtime, &nats, dir.path(), n);
    }
}

fn bench_append(c: &mut Criterion, runtime: &Runtime, nats: &NatsServer, dir: &std::path::Path) {
    let batch: Vec<NewEvent> = workload(BATCH * 16)[BATCH * 8..][..BATCH].to_vec();
    let logs: Vec<(&str, Arc<dyn EventLog>)> = runtime.block_on(async {
        let jetstream = JetStreamLog::connect(
            &JetStreamLogConfig {
                stream: "bench_append".to_owned(),
                ..JetStreamLogConfig::new(nats.url())
            },
            Arc::new(SystemClock),
        )
        .await
        .expect("JetStream log");
        let sqlite = SqliteLog::open(&dir.join("append.db"), Arc::new(SystemClock))
            .await
            .expect("SQLite log");
        vec![
            (
                "memory",
                Arc::new(MemoryLog::new(Arc::new(SystemClock))) as Arc<dyn EventLog>,
            ),
            ("sqlite", Arc::new(sqlite)),
            ("jetstream", Arc::new(jetstream)),
        ]
    });
    let mut group = c.benchmark_group("append_batch_64");
    group.throughput(Throughput::Elements(BATCH as u64));
    for (name, log) in logs {
        group.bench_function(name, |b| {
            b.iter_custom(|iters| {
                runtime.block_on(async {
                    let start = Instant::now();
                    for _ in 0..iters {
                        black_box(log.append(batch.clone()).await.expect("append"));
                    }
                    start.elapsed()
                })
            });
        });
    }
    group.finish();
}

struct Figures {
    backend: &'static str,
    append: Duration,
    replay: Duration,
    rebuild: Duration,
}

fn timed_rebuild(runtime: &Runtime, nats: &NatsServer, dir: &std::path::Path, n: usize) {
    let events = workload(n);
    let upto = (n as u64) * 9 / 10;
    // The projection at `upto`, folded without any log: the snapshot a server would have taken.
    let start = Instant::now();
    let mut at_upto = FleetState::new(FleetConfig::default());
    let mut full = FleetState::new(FleetConfig::default());
    for (i, e) in events.iter().enumerate() {
        let env = Envelope {
            v: EVENT_FORMAT_VERSION,
            seq: i as u64 + 1,
            ts_us: 0,
            source: e.source.clone(),
            event: e.event.clone(),
        };
        if env.seq <= upto {
            at_upto.apply(&env);
        }
        full.apply(&env);
    }
    let fold = start.elapsed() / 2;
    let snapshot = Snapshot {
        upto,
        events: at_upto.dump(),
    };
    let figures = runtime.block_on(async {
        let jetstream = JetStreamLog::connect(
            &JetStreamLogConfig {
                stream: "bench_rebuild".to_owned(),
                max_age: None,
                max_bytes: None,
                ..JetStreamLogConfig::new(nats.url())
            },
            Arc::new(SystemClock),
        )
        .await
        .expect("JetStream log");
        let sqlite = SqliteLog::open(&dir.join("rebuild.db"), Arc::new(SystemClock))
            .await
            .expect("SQLite log");
        let mut out = Vec::new();
        for (backend, log) in [
            ("jetstream", Arc::new(jetstream) as Arc<dyn EventLog>),
            ("sqlite", Arc::new(sqlite)),
        ] {
            let start = Instant::now();
            append_all(log.as_ref(), &events, BATCH).await;
            let append = start.elapsed();
            let start = Instant::now();
            let mut replayed = FleetState::new(FleetConfig::default());
            rebuild(log.as_ref(), &mut replayed).await.expect("replay");
            let replay = start.elapsed();
            assert!(replayed == full, "{backend}: replay differs from the fold");
            log.compact(snapshot.clone()).await.expect("compact");
            let start = Instant::now();
            let mut rebuilt = FleetState::new(FleetConfig::default());
            rebuild(log.as_ref(), &mut rebuilt).await.expect("rebuild");
            let rebuild_time = start.elapsed();
            assert!(
                rebuilt == full,
                "{backend}: snapshot + tail differs from the fold"
            );
            out.push(Figures {
                backend,
                append,
                replay,
                rebuild: rebuild_time,
            });
        }
        out
    });
    println!(
        "\nevent log, {n} events ({} snapshot events at seq {upto}; folding {n} into FleetState \
         in memory alone: {:.2?})",
        snapshot.events.len(),
        fold
    );
    println!(
        "{:<10} {:>16} {:>16} {:>16} {:>24}",
        "backend", "append ev/s", "append total", "full replay", "snapshot + 10% tail"
    );
    for f in figures {
        println!(
            "{:<10} {:>16.0} {:>16.2?} {:>16.2?} {:>24.2?}",
            f.backend,
            n as f64 / f.append.as_secs_f64(),
            f.append,
            f.replay,
            f.rebuild
        );
    }
}
