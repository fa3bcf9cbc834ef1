//! L2 over the socket: `set` and `get` of 1 MiB values through [`KvdClient`] against a real
//! daemon on a temporary socket, beside a 1 MiB memcpy baseline. Criterion reports each as
//! throughput; the closing lines print MB/s and the ratio to memcpy from a direct measurement.

use bytes::Bytes;
use criterion::{Criterion, Throughput, criterion_group};
use infera_core::event::Retention;
use infera_kvd::{KvdClient, KvdOptions, KvdServer, Namespace, SetItem};
use std::hint::black_box;
use std::time::{Duration, Instant};

const MIB: usize = 1 << 20;

struct Bench {
    rt: tokio::runtime::Runtime,
    client: KvdClient,
    value: Bytes,
    _dir: tempfile::TempDir,
}

fn setup() -> Bench {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("kvd.sock");
    let client = rt.block_on(async {
        let server = KvdServer::bind(KvdOptions::new(&path, 256 << 20))
            .await
            .expect("bind");
        tokio::spawn(server.serve());
        KvdClient::connect(&path).await.expect("connect")
    });
    Bench {
        rt,
        client,
        value: Bytes::from(vec![0x5au8; MIB]),
        _dir: dir,
    }
}

fn ns() -> Namespace {
    Namespace::new("bench", "")
}

fn set(b: &mut Bench, i: u64) {
    let item = SetItem::new(i.to_be_bytes().to_vec(), b.value.clone()).retention(Retention::Long);
    let ack = b.rt.block_on(b.client.set(&ns(), item)).expect("set");
    assert!(ack.accepted);
}

fn get(b: &mut Bench, i: u64) -> Bytes {
    let hit = b.rt.block_on(b.client.get(&ns(), &i.to_be_bytes()));
    hit.expect("get").expect("hit").value
}

fn memcpy(src: &[u8], dst: &mut [u8]) {
    dst.copy_from_slice(black_box(src));
    black_box(dst);
}

fn benches(c: &mut Criterion) {
    let mut b = setup();
    let mut group = c.benchmark_group("l2_1mib");
    group.throughput(Throughput::Bytes(MIB as u64));
    let mut i = 0u64;
    group.bench_function("socket_set", |bench| {
        bench.iter(|| {
            i = (i + 1) % 64;
            set(&mut b, i);
        })
    });
    for k in 0..64 {
        set(&mut b, k);
    }
    group.bench_function("socket_get", |bench| {
        bench.iter(|| {
            i = (i + 1) % 64;
            black_box(get(&mut b, i));
        })
    });
    let src = vec![1u8; MIB];
    let mut dst = vec![0u8; MIB];
    group.bench_function("memcpy", |bench| bench.iter(|| memcpy(&src, &mut dst)));
    group.finish();
}

/// MB/s of `f` over about half a second.
fn rate(mut f: impl FnMut(u64)) -> f64 {
    let start = Instant::now();
    let mut n = 0u64;
    while start.elapsed() < Duration::from_millis(500) {
        f(n);
        n += 1;
    }
    (n as f64 * MIB as f64) / start.elapsed().as_secs_f64() / 1e6
}

fn summary() {
    let mut b = setup();
    let src = vec![1u8; MIB];
    let mut dst = vec![0u8; MIB];
    let copy = rate(|_| memcpy(&src, &mut dst));
    let set_rate = rate(|n| set(&mut b, n % 64));
    let get_rate = rate(|n| {
        black_box(get(&mut b, n % 64));
    });
    println!("l2 1 MiB summary: memcpy {copy:.0} MB/s");
    println!(
        "l2 1 MiB summary: socket set {set_rate:.0} MB/s ({:.3} of memcpy), get {get_rate:.0} MB/s ({:.3} of memcpy)",
        set_rate / copy,
        get_rate / copy
    );
}

criterion_group!(l2, benches);

fn main() {
    l2();
    Criterion::default().configure_from_args().final_summary();
    summary();
}
