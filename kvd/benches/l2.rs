//! L2 over the socket, beside this machine's memcpy:
//! - `socket_set` / `socket_get`: 1 MiB values inline (bytes in the frames), no arena;
//! - `arena_put` / `arena_get`: 1 MiB values through the shared arena — `set_reserve`, one copy
//!   into the mapping, `set_commit`; `get_shared`, one copy out of the mapping (so both do the
//!   one memcpy a user of the value needs);
//! - `arena_get_5mb`: `get_shared` of a 5 MB block and its zero-copy validation (the reader
//!   checks the slot's seqlock around its use), the latency target;
//! - `memcpy`: 1 MiB `copy_from_slice`.
//!
//! Criterion cycles over 4 keys (4 MiB: hot in the caches, like its memcpy of one buffer). The
//! closing lines print MB/s and ratios to memcpy for that hot working set and for a cold one (64
//! keys, beside a memcpy that cycles over 64 buffers), and the 5 MB get's p50/p99.
//!
//! Beside them, the machine's own limits for the socket: a bare Unix socket pair between two
//! threads moving 1 MiB one way per 1-byte reply (what any inline value must cross: one copy
//! into the kernel, one out), and a 16-byte ping-pong (the wake-up round trip every request
//! pays, which bounds the arena get's latency from below).
//!
//! `l2_store_set`: the SET path in process, without the socket, where the inventory's hooks
//! show: the tiered store's `set_many` of 32 new 4 KiB `short` blocks into a full L2, each
//! evicting one, with the inventory off (`batch32_off`) and recording (`batch32_on`: an
//! inventory hash per block before the lock, a stored and a removed change appended under it,
//! drained by a thread as the publisher drains them: every 50 ms, or at 4,096 waiting).

use bytes::Bytes;
use criterion::{Criterion, Throughput, criterion_group};
use infera_core::event::Retention;
use infera_kvd::client::SharedGet;
use infera_kvd::inventory::{Inventory, Recorder};
use infera_kvd::store::Store;
use infera_kvd::{KvdClient, KvdOptions, KvdServer, Namespace, SetItem};
use std::hint::black_box;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

const MIB: usize = 1 << 20;
const BLOCK_5MB: usize = 5_000_000;
/// Keys cycled through: a working set that stays in the caches, and one that does not.
const HOT: u64 = 4;
const COLD: u64 = 64;

struct Bench {
    /// The daemon's runtime (two workers, like a small deployment).
    _server: tokio::runtime::Runtime,
    /// The client's own runtime, as in an engine process.
    rt: tokio::runtime::Runtime,
    client: KvdClient,
    value: Bytes,
    out: Vec<u8>,
    _dir: tempfile::TempDir,
}

fn setup(arena: bool) -> Bench {
    let server_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("kvd.sock");
    server_rt.block_on(async {
        let mut options = KvdOptions::new(&path, 512 << 20);
        if arena {
            options.shared_arena_bytes = 512 << 20;
            options.arena_slot_bytes = Some(5 << 20);
        }
        let server = KvdServer::bind(options).await.expect("bind");
        tokio::spawn(server.serve());
    });
    let client = rt.block_on(async {
        if arena {
            KvdClient::connect_shared(&path, "bench")
                .await
                .expect("connect")
                .0
        } else {
            KvdClient::connect(&path).await.expect("connect")
        }
    });
    Bench {
        _server: server_rt,
        rt,
        client,
        value: Bytes::from(vec![0x5au8; MIB]),
        out: vec![0u8; BLOCK_5MB],
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

fn arena_put(b: &mut Bench, i: u64, len: usize) {
    let value = &b.value[..len.min(MIB)];
    let ack =
        b.rt.block_on(b.client.put(
            &ns(),
            Bytes::copy_from_slice(&i.to_be_bytes()),
            value,
            Retention::Long,
            None,
        ))
        .expect("put");
    assert!(ack.accepted, "{ack:?}");
}

fn arena_get(b: &mut Bench, i: u64, copy: bool) -> usize {
    let got =
        b.rt.block_on(b.client.get_shared(&ns(), &i.to_be_bytes()))
            .expect("get")
            .expect("hit");
    let SharedGet::Slot(slot) = got else {
        panic!("not arena-resident");
    };
    let out = &mut b.out;
    let arena = b.client.arena().expect("arena");
    let n = arena.read(&slot, |bytes| {
        if copy {
            out[..bytes.len()].copy_from_slice(bytes);
        }
        bytes.len()
    });
    n.expect("stable slot")
}

fn put_5mb(b: &mut Bench, key: u64) {
    let value = vec![0x33u8; BLOCK_5MB];
    let ack =
        b.rt.block_on(b.client.put(
            &ns(),
            Bytes::copy_from_slice(&key.to_be_bytes()),
            &value,
            Retention::Long,
            None,
        ))
        .expect("put");
    assert!(ack.accepted, "{ack:?}");
}

fn memcpy(src: &[u8], dst: &mut [u8]) {
    dst.copy_from_slice(black_box(src));
    black_box(dst);
}

fn benches(c: &mut Criterion) {
    let mut inline = setup(false);
    let mut group = c.benchmark_group("l2_1mib");
    group.throughput(Throughput::Bytes(MIB as u64));
    let mut i = 0u64;
    group.bench_function("socket_set", |bench| {
        bench.iter(|| {
            i = (i + 1) % HOT;
            set(&mut inline, i);
        })
    });
    for k in 0..HOT {
        set(&mut inline, k);
    }
    group.bench_function("socket_get", |bench| {
        bench.iter(|| {
            i = (i + 1) % HOT;
            black_box(get(&mut inline, i));
        })
    });
    let mut shared = setup(true);
    group.bench_function("arena_put", |bench| {
        bench.iter(|| {
            i = (i + 1) % HOT;
            arena_put(&mut shared, i, MIB);
        })
    });
    for k in 0..HOT {
        arena_put(&mut shared, k, MIB);
    }
    group.bench_function("arena_get", |bench| {
        bench.iter(|| {
            i = (i + 1) % HOT;
            black_box(arena_get(&mut shared, i, true));
        })
    });
    let src = vec![1u8; MIB];
    let mut dst = vec![0u8; MIB];
    group.bench_function("memcpy", |bench| bench.iter(|| memcpy(&src, &mut dst)));
    group.finish();

    put_5mb(&mut shared, 1_000_000);
    let mut group = c.benchmark_group("l2_5mb");
    group.bench_function("arena_get_5mb", |bench| {
        bench.iter(|| black_box(arena_get(&mut shared, 1_000_000, false)))
    });
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

/// A thread that answers each `len`-byte message on `b` with one byte, until `a` closes.
fn echo(len: usize) -> (std::os::unix::net::UnixStream, std::thread::JoinHandle<()>) {
    use std::io::{Read, Write};
    let (a, mut b) = std::os::unix::net::UnixStream::pair().expect("socketpair");
    for s in [&a, &b] {
        let _ = rustix::net::sockopt::set_socket_send_buffer_size(s, 4 << 20);
        let _ = rustix::net::sockopt::set_socket_recv_buffer_size(s, 4 << 20);
    }
    let peer = std::thread::spawn(move || {
        let mut buf = vec![0u8; len];
        while b.read_exact(&mut buf).is_ok() {
            if b.write_all(&[1]).is_err() {
                break;
            }
        }
    });
    (a, peer)
}

/// One message of `msg` bytes and its 1-byte reply over `a`.
fn exchange(a: &mut std::os::unix::net::UnixStream, msg: &[u8]) {
    use std::io::{Read, Write};
    a.write_all(msg).expect("send");
    let mut ack = [0u8; 1];
    a.read_exact(&mut ack).expect("reply");
}

/// The bare socket: MB/s of 1 MiB messages, and the p50 of a 16-byte round trip.
fn socket_limits() -> (f64, Duration) {
    let (mut a, peer) = echo(MIB);
    let msg = vec![7u8; MIB];
    let mb = rate(|_| exchange(&mut a, &msg));
    drop(a);
    let _ = peer.join();
    let (mut a, peer) = echo(16);
    let mut lat: Vec<Duration> = (0..20_000)
        .map(|_| {
            let t = Instant::now();
            exchange(&mut a, &[3u8; 16]);
            t.elapsed()
        })
        .collect();
    drop(a);
    let _ = peer.join();
    lat.sort();
    (mb, lat[lat.len() / 2])
}

fn summary() {
    let (socket_mb, round_trip) = socket_limits();
    println!(
        "l2 summary: bare Unix socket: 1 MiB messages {socket_mb:.0} MB/s, 16-byte round trip \
         p50 {:.1} us",
        round_trip.as_secs_f64() * 1e6
    );
    let mut inline = setup(false);
    let mut shared = setup(true);
    for keys in [HOT, COLD] {
        let srcs: Vec<Vec<u8>> = (0..keys).map(|k| vec![k as u8; MIB]).collect();
        let mut dst = vec![0u8; MIB];
        let copy = rate(|n| memcpy(&srcs[(n % keys) as usize], &mut dst));
        let set_rate = rate(|n| set(&mut inline, n % keys));
        let get_rate = rate(|n| {
            black_box(get(&mut inline, n % keys));
        });
        let put_rate = rate(|n| arena_put(&mut shared, n % keys, MIB));
        let aget_rate = rate(|n| {
            black_box(arena_get(&mut shared, n % keys, true));
        });
        let view_rate = rate(|n| {
            black_box(arena_get(&mut shared, n % keys, false));
        });
        println!("l2 summary ({keys} keys of 1 MiB): memcpy {copy:.0} MB/s");
        println!(
            "l2 summary ({keys} keys): inline set {set_rate:.0} MB/s ({:.2} of memcpy, {:.2} of \
             the bare socket), get {get_rate:.0} MB/s ({:.2}, {:.2})",
            set_rate / copy,
            set_rate / socket_mb,
            get_rate / copy,
            get_rate / socket_mb
        );
        println!(
            "l2 summary ({keys} keys): arena put {put_rate:.0} MB/s ({:.2} of memcpy), get with \
             copy-out {aget_rate:.0} MB/s ({:.2}), zero-copy get {view_rate:.0} MB/s ({:.2})",
            put_rate / copy,
            aget_rate / copy,
            view_rate / copy
        );
    }
    put_5mb(&mut shared, 1_000_000);
    let mut lat: Vec<Duration> = (0..20_000)
        .map(|_| {
            let t = Instant::now();
            black_box(arena_get(&mut shared, 1_000_000, false));
            t.elapsed()
        })
        .collect();
    lat.sort();
    let p = |q: f64| lat[((lat.len() as f64 * q) as usize).min(lat.len() - 1)];
    // Where the time goes: the same request for a key that is not there (the protocol and
    // both runtimes, without the store's hit and the slot's validation).
    let mut miss: Vec<Duration> = (0..20_000)
        .map(|_| {
            let t = Instant::now();
            let got = shared
                .rt
                .block_on(shared.client.get_shared(&ns(), b"absent"));
            assert!(got.expect("get").is_none());
            t.elapsed()
        })
        .collect();
    miss.sort();
    println!(
        "l2 summary: arena get of a 5 MB block: p50 {:.1} us, p99 {:.1} us (a miss: p50 {:.1} \
         us; the bare socket's round trip: p50 {:.1} us)",
        p(0.5).as_secs_f64() * 1e6,
        p(0.99).as_secs_f64() * 1e6,
        miss[miss.len() / 2].as_secs_f64() * 1e6,
        round_trip.as_secs_f64() * 1e6
    );
}

/// Blocks a `set_many` writes.
const BATCH: usize = 32;
/// Distinct keys cycled through: far more than L2 holds, so every block is new.
const KEYS: usize = 8192;
/// L2 holds this many blocks.
const HELD: u64 = 1024;

/// The tiered store's SET path in process (see the module docs).
fn store_set(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("runtime");
    let ns = Namespace::new("bench-model", "fp8");
    let value = Bytes::from(vec![0x5au8; 4096]);
    let items: Vec<SetItem> = (0..KEYS as u64)
        .map(|k| SetItem::new(k.to_be_bytes().to_vec(), value.clone()).retention(Retention::Short))
        .collect();
    let budget = HELD * infera_kvd::store::L2Store::charge_of(&ns, &items[0]);
    let mut group = c.benchmark_group("l2_store_set");
    group.throughput(Throughput::Elements(BATCH as u64));
    for recording in [false, true] {
        let recorder = Arc::new(Recorder::default());
        let inventory = if recording {
            Inventory::recording(recorder.clone())
        } else {
            Inventory::off()
        };
        let store = Store::new(budget, None, None).with_inventory(inventory);
        let stop = Arc::new(AtomicBool::new(false));
        // As the publisher: every 50 ms, or as soon as 4,096 changes wait.
        let drainer = recording.then(|| {
            let (recorder, stop) = (recorder.clone(), stop.clone());
            std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_time()
                    .build()
                    .expect("runtime");
                let mut drained = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    rt.block_on(async {
                        let tick = tokio::time::sleep(Duration::from_millis(50));
                        tokio::select! {
                            () = tick => {}
                            () = recorder.woken() => {}
                        }
                    });
                    recorder.drain(&mut drained);
                    drained.clear();
                }
            })
        });
        let mut at = 0;
        let mut set_batch = || {
            let acks = rt.block_on(store.set_many(&ns, &items[at..at + BATCH], 1));
            at = (at + BATCH) % KEYS;
            black_box(acks);
        };
        for _ in 0..KEYS / BATCH {
            set_batch();
        }
        let name = if recording {
            "batch32_on"
        } else {
            "batch32_off"
        };
        group.bench_function(name, |bench| bench.iter(&mut set_batch));
        stop.store(true, Ordering::Relaxed);
        if let Some(drainer) = drainer {
            let _ = drainer.join();
        }
    }
    group.finish();
}

criterion_group!(l2, benches, store_set);

fn main() {
    l2();
    Criterion::default().configure_from_args().final_summary();
    summary();
}
