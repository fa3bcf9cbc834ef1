//! L4 against a real Mooncake Store on loopback (master and memory holder started here, as
//! the tests do), side by side with the store's own client.
//!
//! - kvd: 16 blocks of 1 MiB and of 4 MiB per round through kvd's L4 (framing, checksum, the
//!   write-behind queue, the sidecar and its staging area): a put round is 16 puts then a
//!   flush, a get round one batched read of the 16.
//! - The store's own client, the Python binding, the same blocks in one process on the same
//!   cluster, each way it offers: `upsert_batch`/`get_batch` (bytes objects) and
//!   `batch_upsert_from`/`batch_get_into` (zero-copy from and into a registered buffer), the
//!   latter also as a client that owns its values uses it: each value copied into the buffer
//!   before the put, and out of it after the get (kvd takes and hands out owned values; a
//!   bare zero-copy round moves the same bytes of one hot buffer every time, which no caller
//!   could keep).
//! - kvd's store client alone (its own sidecar) reading the same values and writing their
//!   frames: the L4's get less its framing checks and bookkeeping, its put less the
//!   write-behind queue and the framing of headers.
//! - Then the L2 SET latency studies with a Mooncake L4 healthy, slow and down (a cluster
//!   killed): in process (`support/set_study.rs`: the SET path's own cost, the slow store a
//!   wrapper answering 50 ms late) and over kvd's socket (`support/set_socket.rs`: what a
//!   client waits for, the slow store's master behind a proxy holding every byte 50 ms each
//!   way, so that every put and get waits on its calls to the master).
//! - The rounds alternate (`support/side.rs`): the binding's, two of kvd's, kvd's client
//!   alone (its get, then its put). A put that follows another process's calls is slower
//!   than one that follows its own (kvd's client alone: 996–1014 MB/s right after the
//!   binding's round, 1230 right after its own get, at 1 MiB), and every way of the binding
//!   but its first follows its own calls; so kvd's first round (its writer idle since the
//!   last) is printed apart and the target read on its second, as under a steady load (as
//!   in the Redis bench). Printed: median throughput of 15 rounds each, and kvd against the
//!   binding's fastest way for owned values (bytes objects, or zero-copy with the copies).
//!   Target: kvd ≥ 80 %.
//!
//! Run: `cargo bench -p infera-kvd --bench l4_mooncake` (needs the `mooncake` package for
//! `python3`, as the tests do).

#![allow(clippy::unwrap_used)]

#[path = "../tests/support/mooncake.rs"]
mod mooncake;
#[path = "support/own_core.rs"]
mod own_core;
#[path = "support/rounds.rs"]
mod rounds;
#[path = "support/set_socket.rs"]
mod set_socket;
#[path = "support/set_study.rs"]
mod set_study;
#[path = "support/side.rs"]
mod side;
#[path = "support/timed.rs"]
mod timed;

use bytes::Bytes;
use infera_core::event::Retention;
use infera_kvd::Namespace;
use infera_kvd::l4::frame::{self, FrameInfo, Framed};
use infera_kvd::l4::{L4, name};
use infera_kvd::long::LongStore;
use mooncake::{Cluster, free_port};
use side::Side;
use timed::Times;

/// The allocator `infera kvd` runs with: a get's values land in memory it hands out.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Blocks per round, and rounds.
const N: usize = 16;
const ROUNDS: usize = 15;

/// The binding's side (`support/side.rs`): `play(size)` times one round of each way.
const BINDING: &str = r#"
import ctypes, json, mmap, sys, time
from mooncake.store import MooncakeDistributedStore
cfg = json.loads(sys.argv[1])
s = MooncakeDistributedStore()
assert s.setup(cfg["local"], cfg["metadata"], 0, 64 << 20, "tcp", "", cfg["master"]) == 0
n, sets = cfg["n"], {}

def prepare(size):
    keys = [f"binding-{size}-{i}" for i in range(n)]
    values = [bytes([i]) * size for i in range(n)]
    buf = mmap.mmap(-1, n * size)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    assert s.register_buffer(base, n * size) == 0
    return keys, values, buf, [base + i * size for i in range(n)], [size] * n

def play(size):
    if size not in sets:
        sets[size] = prepare(size)
    keys, values, buf, ptrs, sizes = sets[size]
    view, times = memoryview(buf), {}
    t = time.perf_counter(); assert s.upsert_batch(keys, values) == 0; times["upsert_batch"] = time.perf_counter() - t
    t = time.perf_counter(); got = s.get_batch(keys); times["get_batch"] = time.perf_counter() - t
    assert all(len(g) == size for g in got)
    t = time.perf_counter(); assert all(r == 0 for r in s.batch_upsert_from(keys, ptrs, sizes)); times["batch_upsert_from"] = time.perf_counter() - t
    t = time.perf_counter(); assert all(r == size for r in s.batch_get_into(keys, ptrs, sizes)); times["batch_get_into"] = time.perf_counter() - t
    t = time.perf_counter()
    for i, v in enumerate(values): view[i * size:(i + 1) * size] = v
    assert all(r == 0 for r in s.batch_upsert_from(keys, ptrs, sizes)); times["copy_upsert_from"] = time.perf_counter() - t
    t = time.perf_counter(); assert all(r == size for r in s.batch_get_into(keys, ptrs, sizes))
    got = [bytes(view[i * size:(i + 1) * size]) for i in range(n)]; times["get_into_copy"] = time.perf_counter() - t
    return times
"#;

fn main() {
    let cluster = Cluster::start();
    let sizes = [1usize << 20, 4 << 20];
    let mut binding = Side::start(
        BINDING,
        &serde_json::json!({
            "local": format!("127.0.0.1:{}", free_port()),
            "metadata": cluster.metadata_url(),
            "master": format!("127.0.0.1:{}", cluster.rpc_port),
            "n": N,
        }),
    );

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let cfg = cluster.config("bench", free_port());
    let prefix = cfg.options().prefix;
    let l4 = rt.block_on(async { L4::open(cfg.store(), cfg.options(), true).await.unwrap() });
    // kvd's store client alone (its own sidecar), reading what the L4 wrote: the L4's reads
    // less their framing checks and bookkeeping.
    let client = cluster.config("bench", free_port()).store();
    let ns = Namespace::new("bench", "");
    println!("| block | way | put MB/s | get MB/s |");
    println!("|---|---|---:|---:|");
    for size in sizes {
        let keys = rounds::keys(&ns, &format!("{size}-"), N);
        let blocks: Vec<Bytes> = (0..N).map(|i| Bytes::from(vec![i as u8; size])).collect();
        let names: Vec<String> = keys.iter().map(|(_, h)| name(&prefix, *h)).collect();
        // The frames kvd's writer hands the store (the store seals them as it stages them).
        let info = FrameInfo {
            class: Retention::Long,
            expires_at: None,
            writer: 1,
            seq: 1,
            written_at: 1,
        };
        let frames: Vec<(String, Framed)> = keys
            .iter()
            .zip(&blocks)
            .zip(&names)
            .map(|(((k, _), v), n)| (n.clone(), frame::encode_unsealed(&ns, k, v, info).unwrap()))
            .collect();
        // Round by round: the binding's, two of kvd's, then kvd's store client alone reading
        // what kvd wrote and writing the same frames.
        let mut times = Times::default();
        for _ in 0..ROUNDS {
            binding.round(size, &mut times);
            // After the binding's round kvd's writer has been idle; the next round finds it
            // busy, as under a steady load (and as the binding's ways but its first follow
            // its own calls).
            timed::round(&rt, &l4, &ns, &keys, &blocks, &mut times, "idle");
            timed::round(&rt, &l4, &ns, &keys, &blocks, &mut times, "kvd");
            let got = times.time("client get", || {
                rt.block_on(client.get_batch(&names)).unwrap()
            });
            assert!(got.iter().all(Option::is_some), "every value reads back");
            let refused = times.time("client put", || {
                rt.block_on(client.put_batch(&frames)).unwrap()
            });
            assert!(refused.is_empty(), "the store kept every value");
        }
        let bytes = (N * size) as f64;
        let mb = |bps: f64| bps / 1e6;
        let way = |name: &str| times.rate(name, bytes);
        let (kvd_put, kvd_get) = (way("kvd put"), way("kvd get"));
        let label = format!("{} MiB", size >> 20);
        for (name, put, get) in [
            ("kvd L4", Some(kvd_put), kvd_get),
            (
                "kvd L4, its writer idle before the round",
                Some(way("idle put")),
                way("idle get"),
            ),
            (
                "kvd's store client alone",
                Some(way("client put")),
                way("client get"),
            ),
            (
                "binding, bytes",
                Some(way("upsert_batch")),
                way("get_batch"),
            ),
            (
                "binding, zero-copy with the copies in and out",
                Some(way("copy_upsert_from")),
                way("get_into_copy"),
            ),
            (
                "binding, zero-copy, one hot buffer (no copies)",
                Some(way("batch_upsert_from")),
                way("batch_get_into"),
            ),
        ] {
            let put = put.map_or("—".to_owned(), |p| format!("{:.0}", mb(p)));
            println!("| {label} | {name} | {put} | {:.0} |", mb(get));
        }
        let best_put = way("upsert_batch").max(way("copy_upsert_from"));
        let best_get = way("get_batch").max(way("get_into_copy"));
        println!(
            "| {label} | kvd / the binding's fastest way for owned values | {:.0} % | {:.0} % |",
            100.0 * kvd_put / best_put,
            100.0 * kvd_get / best_get
        );
        println!(
            "| {label} | kvd / one hot buffer | {:.0} % | {:.0} % |",
            100.0 * kvd_put / way("batch_upsert_from"),
            100.0 * kvd_get / way("batch_get_into")
        );
    }
    rt.block_on(l4.close()).unwrap();

    // A cluster that is gone: its master and holder killed.
    let mut gone = Cluster::start();
    let down = gone.config("down", free_port()).store();
    gone.kill();
    let options = cfg.options();
    set_study::run(
        &rt,
        &options,
        &|| cluster.config("study", free_port()).store(),
        down,
    );
    let slow = set_socket::delayed(&rt, cluster.rpc_port, std::time::Duration::from_millis(50));
    set_socket::run(
        &rt,
        vec![
            ("no L4", None),
            ("L4 healthy", Some(cluster.config("socket", free_port()))),
            (
                "L4 slow (50 ms)",
                Some(cluster.config_through("socket-slow", free_port(), slow)),
            ),
            ("L4 down", Some(gone.config("socket-down", free_port()))),
            // The baseline's twin: its ratio is the study's own noise.
            ("no L4 (A/A)", None),
        ],
    );
}
