//! L3 tablespace throughput beside `dd` on the same file system, and restart time:
//! - criterion: `put` (queue) + `flush` of one 1 MiB block, and `get` of a 1 MiB block from
//!   disk, O_DIRECT through io_uring;
//! - summary: sequential write (puts, then a flush that waits for every write and syncs) and
//!   read (gets in key order, sixteen in flight) of 256 MiB in 64 KiB, 1 MiB and 4 MiB blocks,
//!   O_DIRECT, beside `dd oflag=direct` / `dd iflag=direct` with the same block size;
//! - summary: reopening a tablespace of 1 M entries, from its checkpoint and (as after a crash)
//!   from its journal alone;
//! - summary: how long puts and gets of that tablespace wait while a checkpoint of its 1 M
//!   entries runs beside them (p50, p99 and max of each, beside the same loop without one).
//!
//! `KVD_BENCH_DIR` picks the file system (default: the system temp directory);
//! `KVD_BENCH_ONLY=restart` runs only the restart and checkpoint measurements of the summary,
//! `KVD_BENCH_ONLY=throughput` only the sequential ones; `KVD_BENCH_WORKERS=N` sets the I/O
//! workers per shard (`--long-workers-per-shard`, default 8).

use bytes::Bytes;
use criterion::{Criterion, Throughput, criterion_group};
use infera_core::event::Retention;
use infera_kvd::long::{self, LongBlock, LongStore};
use infera_kvd::store::key_hash;
use infera_kvd::{IoMode, LongBackendConfig, Namespace, TablespaceConfig};
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

const NOW: u64 = 1;

fn bench_dir() -> tempfile::TempDir {
    match std::env::var_os("KVD_BENCH_DIR") {
        Some(dir) => tempfile::tempdir_in(dir).expect("tempdir"),
        None => tempfile::tempdir().expect("tempdir"),
    }
}

fn config(dir: &Path, bytes: u64, mode: IoMode) -> TablespaceConfig {
    let mut c = TablespaceConfig::new(vec![dir.join("l3")], bytes);
    c.io_mode = mode;
    if let Some(w) = std::env::var("KVD_BENCH_WORKERS")
        .ok()
        .and_then(|w| w.parse().ok())
    {
        c.workers_per_shard = w;
    }
    c
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

async fn open(c: &TablespaceConfig) -> Arc<dyn LongStore> {
    long::open(&LongBackendConfig::Tablespace(c.clone()))
        .await
        .expect("open")
}

fn ns() -> Namespace {
    Namespace::new("bench", "")
}

fn block(i: u64, value: &Bytes) -> LongBlock {
    let key = i.to_be_bytes();
    LongBlock {
        hash: key_hash(&ns(), &key),
        ns: ns(),
        key: Bytes::copy_from_slice(&key),
        value: value.clone(),
        metadata: None,
        class: Retention::Long,
        expires_at: None,
    }
}

async fn put(ts: &Arc<dyn LongStore>, i: u64, value: &Bytes) {
    let permit = ts
        .write_permits(&[value.len() as u64])
        .await
        .pop()
        .expect("a permit");
    ts.put(block(i, value), permit, NOW, false).expect("put");
}

async fn read(ts: &Arc<dyn LongStore>, i: u64) -> usize {
    let key = i.to_be_bytes();
    ts.get(&ns(), &key, key_hash(&ns(), &key), NOW)
        .await
        .expect("hit")
        .value
        .len()
}

fn benches(c: &mut Criterion) {
    let rt = rt();
    let dir = bench_dir();
    let ts = rt.block_on(open(&config(dir.path(), 1 << 30, IoMode::Direct)));
    let value = Bytes::from(vec![0xa5u8; 1 << 20]);
    let mut group = c.benchmark_group("l3_1mib");
    group.throughput(Throughput::Bytes(1 << 20));
    let mut i = 0u64;
    group.bench_function("put_and_flush", |b| {
        b.iter(|| {
            i = (i + 1) % 256;
            rt.block_on(async {
                put(&ts, i, &value).await;
                ts.flush().await.expect("flush");
            })
        })
    });
    group.bench_function("get_from_disk", |b| {
        b.iter(|| {
            i = (i + 1) % 256;
            rt.block_on(read(&ts, i))
        })
    });
    group.finish();
    rt.block_on(ts.close()).expect("close");
}

/// MB/s of `dd` with O_DIRECT writing then reading `count` blocks of `bs` bytes.
fn dd(dir: &Path, bs: usize, count: usize) -> (f64, f64) {
    let file = dir.join("dd.bin");
    let run = |args: &[String]| {
        let t = Instant::now();
        let ok = Command::new("dd")
            .args(args)
            .output()
            .expect("dd")
            .status
            .success();
        assert!(ok, "dd {args:?} failed");
        (bs * count) as f64 / t.elapsed().as_secs_f64() / 1e6
    };
    let of = format!("of={}", file.display());
    let inf = format!("if={}", file.display());
    let bs_arg = format!("bs={bs}");
    let count_arg = format!("count={count}");
    let w = run(&[
        "if=/dev/zero".into(),
        of,
        bs_arg.clone(),
        count_arg.clone(),
        "oflag=direct".into(),
        "conv=fsync".into(),
    ]);
    let r = run(&[
        inf,
        "of=/dev/null".into(),
        bs_arg,
        count_arg,
        "iflag=direct".into(),
    ]);
    let _ = std::fs::remove_file(file);
    (w, r)
}

fn throughput(rt: &tokio::runtime::Runtime, bs: usize, total: usize, mode: IoMode) -> (f64, f64) {
    let dir = bench_dir();
    let n = (total / bs) as u64;
    let ts = rt.block_on(open(&config(dir.path(), (total as u64) * 2, mode)));
    let value = Bytes::from(vec![0x3cu8; bs]);
    let t = Instant::now();
    rt.block_on(async {
        for i in 0..n {
            put(&ts, i, &value).await;
        }
        ts.flush().await.expect("flush");
    });
    let w = total as f64 / t.elapsed().as_secs_f64() / 1e6;
    let t = Instant::now();
    let got: usize = rt.block_on(async {
        let mut sum = 0;
        for chunk in (0..n).collect::<Vec<u64>>().chunks(16) {
            let reads = chunk.iter().map(|i| read(&ts, *i));
            sum += futures::future::join_all(reads).await.iter().sum::<usize>();
        }
        sum
    });
    assert_eq!(got, total);
    let r = total as f64 / t.elapsed().as_secs_f64() / 1e6;
    rt.block_on(ts.close()).expect("close");
    (w, r)
}

/// Latencies of a put (overwriting a key with its value) then a get of another key, in a loop
/// until `done` (at least `min` rounds).
fn data_path(
    rt: &tokio::runtime::Runtime,
    ts: &Arc<dyn LongStore>,
    entries: u64,
    min: usize,
    done: &AtomicBool,
) -> (Vec<Duration>, Vec<Duration>) {
    let value = Bytes::from_static(b"sixteen bytes!!!");
    let (mut puts, mut gets) = (Vec::new(), Vec::new());
    let mut i = 0u64;
    while puts.len() < min || !done.load(Ordering::Acquire) {
        i = (i + 7919) % entries;
        let t = Instant::now();
        rt.block_on(put(ts, i, &value));
        puts.push(t.elapsed());
        let t = Instant::now();
        assert_eq!(rt.block_on(read(ts, (i + 1) % entries)), value.len());
        gets.push(t.elapsed());
    }
    (puts, gets)
}

fn quantiles(mut v: Vec<Duration>) -> String {
    v.sort();
    let q = |f: f64| v[((v.len() as f64 * f) as usize).min(v.len() - 1)].as_secs_f64() * 1e6;
    format!(
        "p50 {:.0} us, p99 {:.0} us, max {:.0} us ({} ops)",
        q(0.5),
        q(0.99),
        q(1.0),
        v.len()
    )
}

/// Puts and gets beside a checkpoint of `ts` (holding `entries`), and the same loop alone.
fn checkpoint_stall(rt: &tokio::runtime::Runtime, ts: &Arc<dyn LongStore>, entries: u64) {
    let (puts, gets) = data_path(rt, ts, entries, 2000, &AtomicBool::new(true));
    println!(
        "l3 summary: without a checkpoint: put {}; get {}",
        quantiles(puts),
        quantiles(gets)
    );
    let done = AtomicBool::new(false);
    let (took, (puts, gets)) = std::thread::scope(|s| {
        let checkpoint = s.spawn(|| {
            let t = Instant::now();
            rt.block_on(ts.checkpoint()).expect("checkpoint");
            done.store(true, Ordering::Release);
            t.elapsed()
        });
        let ops = data_path(rt, ts, entries, 1, &done);
        (checkpoint.join().expect("checkpoint thread"), ops)
    });
    println!(
        "l3 summary: during a checkpoint of {entries} entries ({:.2} s): put {}; get {}",
        took.as_secs_f64(),
        quantiles(puts),
        quantiles(gets)
    );
}

fn restart(rt: &tokio::runtime::Runtime, entries: u64) -> (Duration, Duration) {
    let dir = bench_dir();
    let mut c = config(dir.path(), entries * 4096 + (64 << 20), IoMode::Buffered);
    c.journal_sync = Duration::from_secs(10);
    let value = Bytes::from_static(b"sixteen bytes!!!");
    let ts = rt.block_on(open(&c));
    rt.block_on(async {
        for i in 0..entries {
            put(&ts, i, &value).await;
        }
        ts.flush().await.expect("flush");
    });
    // As after a crash: no checkpoint, the journal alone.
    drop(ts);
    let t = Instant::now();
    let ts = rt.block_on(open(&c));
    let from_journal = t.elapsed();
    assert_eq!(ts.stats().entries, entries);
    rt.block_on(ts.flush()).expect("flush");
    checkpoint_stall(rt, &ts, entries);
    assert_eq!(ts.stats().entries, entries);
    rt.block_on(ts.close()).expect("close");
    drop(ts);
    let t = Instant::now();
    let ts = rt.block_on(open(&c));
    let from_checkpoint = t.elapsed();
    assert_eq!(ts.stats().entries, entries);
    rt.block_on(ts.close()).expect("close");
    (from_checkpoint, from_journal)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn summary() {
    let rt = rt();
    let only = std::env::var("KVD_BENCH_ONLY").unwrap_or_default();
    let dir = bench_dir();
    let total = 256 << 20;
    for bs in [64 << 10, 1 << 20, 4 << 20] {
        if only == "restart" {
            break;
        }
        // dd and the tablespace alternate, three times each; medians (the disk is shared).
        let (mut dd_w, mut dd_r, mut w, mut r) = (vec![], vec![], vec![], vec![]);
        for _ in 0..3 {
            let (a, b) = dd(dir.path(), bs, total / bs);
            dd_w.push(a);
            dd_r.push(b);
            let (a, b) = throughput(&rt, bs, total, IoMode::Direct);
            w.push(a);
            r.push(b);
        }
        let (dd_w, dd_r, w, r) = (median(dd_w), median(dd_r), median(w), median(r));
        let (bw, br) = throughput(&rt, bs, total, IoMode::Buffered);
        println!(
            "l3 summary: {} KiB blocks: O_DIRECT write {w:.0} MB/s ({:.2} of dd {dd_w:.0}), \
             read {r:.0} MB/s ({:.2} of dd {dd_r:.0}); buffered write {bw:.0} MB/s, read {br:.0} MB/s",
            bs >> 10,
            w / dd_w,
            r / dd_r
        );
    }
    drop(dir);
    if only == "throughput" {
        return;
    }
    let entries = 1_000_000;
    let (cp, journal) = restart(&rt, entries);
    println!(
        "l3 summary: restart with {entries} entries: {:.2} s from the checkpoint, {:.2} s from \
         the journal alone",
        cp.as_secs_f64(),
        journal.as_secs_f64()
    );
}

criterion_group!(l3, benches);

fn main() {
    l3();
    Criterion::default().configure_from_args().final_summary();
    summary();
}
