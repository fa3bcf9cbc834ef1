//! The cost of `--durable-long-writes`: `long` SETs of 16 KiB over the socket to a daemon with
//! an L3 region in a temporary directory (`--io-mode auto`), acknowledged once recorded (the
//! default) or once durable (block written, journal fdatasync'd, group commit).
//!
//! - criterion `durable/set_16k/{recorded,durable}`: one writer, one SET at a time (latency);
//! - the closing lines: 1 and 16 concurrent writers (one connection each) for a fixed number
//!   of SETs per mode, printing SETs/s, MB/s and the per-SET latency p50/p99, and how many
//!   journal syncs the durable mode shared among its writers.

use bytes::Bytes;
use criterion::{Criterion, Throughput, criterion_group};
use infera_core::event::Retention;
use infera_kvd::{
    IoMode, KvdClient, KvdOptions, KvdServer, LongBackendConfig, Namespace, SetItem,
    TablespaceConfig,
};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

const VALUE: usize = 16 << 10;
const KEYS: u64 = 4096;

struct Daemon {
    rt: tokio::runtime::Runtime,
    path: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

fn start(durable: bool) -> Daemon {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("kvd.sock");
    rt.block_on(async {
        let mut options = KvdOptions::new(&path, 256 << 20);
        let mut ts = TablespaceConfig::new(vec![dir.path().join("l3")], 1 << 30);
        ts.io_mode = IoMode::Auto;
        ts.container_bytes = 256 << 20;
        ts.durable_writes = durable;
        options.long = Some(LongBackendConfig::Tablespace(ts));
        let server = KvdServer::bind(options).await.expect("bind");
        tokio::spawn(server.serve());
    });
    Daemon {
        rt,
        path,
        _dir: dir,
    }
}

fn ns() -> Namespace {
    Namespace::new("bench", "")
}

fn item(i: u64, value: &Bytes) -> SetItem {
    SetItem::new(i.to_be_bytes().to_vec(), value.clone()).retention(Retention::Long)
}

fn benches(c: &mut Criterion) {
    let value = Bytes::from(vec![0x5au8; VALUE]);
    let mut group = c.benchmark_group("durable");
    group.throughput(Throughput::Bytes(VALUE as u64));
    group.sample_size(20);
    group.measurement_time(Duration::from_secs(5));
    for (name, durable) in [("recorded", false), ("durable", true)] {
        let d = start(durable);
        let client_rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let mut client = client_rt
            .block_on(KvdClient::connect(&d.path))
            .expect("connect");
        let mut i = 0u64;
        group.bench_function(format!("set_16k/{name}"), |b| {
            b.iter(|| {
                i = (i + 1) % KEYS;
                let ack = client_rt
                    .block_on(client.set(&ns(), item(i, &value)))
                    .expect("set");
                assert!(ack.accepted);
            });
        });
        drop(d.rt);
    }
    group.finish();
}

criterion_group!(durable, benches);

/// `writers` connections each send `per_writer` SETs one at a time; latencies in µs.
fn run(d: &Daemon, writers: u64, per_writer: u64) -> (Duration, Vec<u64>) {
    let value = Bytes::from(vec![0xa5u8; VALUE]);
    let path = d.path.clone();
    let next = std::sync::Arc::new(AtomicU64::new(0));
    d.rt.block_on(async move {
        let started = Instant::now();
        let tasks: Vec<_> = (0..writers)
            .map(|_| {
                let (path, value, next) = (path.clone(), value.clone(), next.clone());
                tokio::spawn(async move {
                    let mut c = KvdClient::connect(&path).await.expect("connect");
                    let mut lat = Vec::with_capacity(per_writer as usize);
                    for _ in 0..per_writer {
                        let i = next.fetch_add(1, Ordering::Relaxed) % KEYS;
                        let t = Instant::now();
                        let ack = c.set(&ns(), item(i, &value)).await.expect("set");
                        assert!(ack.accepted, "{ack:?}");
                        lat.push(t.elapsed().as_micros() as u64);
                    }
                    lat
                })
            })
            .collect();
        let mut all = Vec::new();
        for t in tasks {
            all.extend(t.await.expect("writer"));
        }
        (started.elapsed(), all)
    })
}

fn summary() {
    println!(
        "\nlong SETs of 16 KiB, L3 in {}:",
        std::env::temp_dir().display()
    );
    println!("mode      writers   SETs/s     MB/s   p50 us   p99 us");
    for (name, durable) in [("recorded", false), ("durable", true)] {
        let d = start(durable);
        for writers in [1u64, 16] {
            let per_writer = 4000 / writers;
            let (took, mut lat) = run(&d, writers, per_writer);
            lat.sort_unstable();
            let n = lat.len() as f64;
            let secs = took.as_secs_f64();
            println!(
                "{name:<9} {writers:>7} {:>8.0} {:>8.1} {:>8} {:>8}",
                n / secs,
                n * VALUE as f64 / secs / 1e6,
                lat[lat.len() / 2],
                lat[lat.len() * 99 / 100],
            );
        }
    }
}

fn main() {
    durable();
    Criterion::default().configure_from_args().final_summary();
    summary();
}
