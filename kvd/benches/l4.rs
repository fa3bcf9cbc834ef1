//! L4 against a real `redis-server` on loopback (started here, as the tests do).
//!
//! - `l4_frame` (criterion): framing and checking a 4 MiB block.
//! - Put and get throughput: 1 MiB and 4 MiB blocks through kvd's L4 (framing, checksum, the
//!   write-behind queue, LMCache's two-key layout; a put round is 64 MiB of puts then a
//!   flush, a get round one batched read of them: rounds long enough to measure throughput,
//!   not the hand-over to kvd's writer and back, 0.1 to 0.5 ms a round), beside a plain
//!   pipelined RESP client written here (what `redis-benchmark -P` does), which returns the
//!   values it read as kvd does (a reader that dropped each value at once would reuse one hot
//!   buffer, 1.6× faster on the 2-core build VM, that no caller could keep). Their rounds
//!   alternate; medians of 15 rounds. kvd plays two rounds in a row, the first with its
//!   writer idle since its last round (shown too). Target: kvd ≥ 80 % of the plain client.
//!   The table runs twice: with every process sharing the machine's CPUs, then with
//!   `redis-server` on a CPU of its own and the clients on the others
//!   (`support/server_core.rs`), as on a host whose store runs elsewhere.
//! - Then the L2 SET latency studies with this Redis store: in process
//!   (`support/set_study.rs`: the SET path's own cost) and over kvd's socket
//!   (`support/set_socket.rs`: what a client waits for).
//!
//! Run: `cargo bench -p infera-kvd --bench l4 -- --warm-up-time 1 --measurement-time 3`.

#![allow(clippy::unwrap_used)]

#[path = "support/own_core.rs"]
mod own_core;
#[path = "../tests/support/redis.rs"]
mod redis_server;
#[path = "support/rounds.rs"]
mod rounds;
#[path = "support/server_core.rs"]
mod server_core;
#[path = "support/set_socket.rs"]
mod set_socket;
#[path = "support/set_study.rs"]
mod set_study;
#[path = "support/timed.rs"]
mod timed;

use bytes::Bytes;
use criterion::{Criterion, Throughput};
use infera_core::event::Retention;
use infera_kvd::Namespace;
use infera_kvd::l4::{L4, L4Config};
use infera_kvd::long::LongStore;
use redis_server::RedisServer;
use timed::Times;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

/// The allocator `infera kvd` runs with (the SET studies measure the daemon's SET path).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Bytes per round (64 blocks of 1 MiB, 16 of 4 MiB).
const ROUND_BYTES: usize = 64 << 20;

fn config(port: u16) -> L4Config {
    let url = format!("redis://127.0.0.1:{port}");
    let env = move |k: &str| (k == "INFERA_L4_REMOTE_URL").then(|| url.clone());
    L4Config::from_lmcache(None, &env).unwrap()
}

fn block(i: usize, len: usize) -> Bytes {
    Bytes::from(vec![i as u8; len])
}

/// The plain client: one connection, commands written back to back, replies read after.
struct Plain {
    reader: BufReader<tokio::net::tcp::OwnedReadHalf>,
    writer: tokio::net::tcp::OwnedWriteHalf,
}

impl Plain {
    async fn connect(port: u16) -> Self {
        let stream = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
        stream.set_nodelay(true).unwrap();
        let (r, w) = stream.into_split();
        Self {
            reader: BufReader::with_capacity(256 << 10, r),
            writer: w,
        }
    }

    async fn command(&mut self, parts: &[&[u8]]) {
        let mut head = format!("*{}\r\n", parts.len()).into_bytes();
        for p in parts {
            head.extend_from_slice(format!("${}\r\n", p.len()).as_bytes());
            if p.len() > 4096 {
                self.writer.write_all(&head).await.unwrap();
                self.writer.write_all(p).await.unwrap();
                head = b"\r\n".to_vec();
            } else {
                head.extend_from_slice(p);
                head.extend_from_slice(b"\r\n");
            }
        }
        self.writer.write_all(&head).await.unwrap();
    }

    async fn reply(&mut self) -> Option<Vec<u8>> {
        let mut line = String::new();
        self.reader.read_line(&mut line).await.unwrap();
        match line.as_bytes()[0] {
            b'+' => None,
            b'$' => {
                let len: i64 = line[1..].trim().parse().unwrap();
                let mut buf = vec![0u8; len as usize + 2];
                self.reader.read_exact(&mut buf).await.unwrap();
                buf.truncate(len as usize);
                Some(buf)
            }
            _ => panic!("unexpected reply {line:?}"),
        }
    }

    async fn set_all(&mut self, blocks: &[Bytes]) {
        for (i, b) in blocks.iter().enumerate() {
            self.command(&[b"SET", format!("plain-{i}").as_bytes(), b])
                .await;
        }
        for _ in blocks {
            self.reply().await;
        }
    }

    /// Reads `n` blocks and returns them, as a client's batched read does (a reader that
    /// dropped each value at once would reuse one hot buffer no caller could use).
    async fn get_all(&mut self, n: usize) -> Vec<Vec<u8>> {
        for i in 0..n {
            self.command(&[b"GET", format!("plain-{i}").as_bytes()])
                .await;
        }
        let mut values = Vec::with_capacity(n);
        for _ in 0..n {
            values.push(self.reply().await.unwrap());
        }
        values
    }
}

/// Rounds per block size, each client's alternating.
const ROUNDS: usize = 15;

/// kvd's L4 beside the plain client, round by round (the plain client's put and get, two of
/// kvd's put rounds and gets, kvd's RESP client alone reading what kvd wrote), so whatever the
/// machine does at a moment touches both alike; prints the medians and kvd against the plain
/// client. kvd's first round of each starts with its writer idle (parked since the last
/// round); the target is read on the second, as under a steady load.
fn throughput(rt: &tokio::runtime::Runtime, port: u16, cpus: &str) {
    let ns = Namespace::new("bench", "");
    let cfg = config(port);
    let l4 = rt.block_on(async { L4::open(cfg.store(), cfg.options(), true).await.unwrap() });
    let remote = cfg.store();
    let mut plain = rt.block_on(Plain::connect(port));
    println!("\nL4 throughput, {cpus}:\n");
    println!("| block | way | put MB/s | get MB/s |");
    println!("|---|---|---:|---:|");
    for size in [1usize << 20, 4 << 20] {
        let n = ROUND_BYTES / size;
        let blocks: Vec<Bytes> = (0..n).map(|i| block(i, size)).collect();
        let keys = rounds::keys(&ns, &format!("{size}-"), n);
        let names: Vec<String> = keys
            .iter()
            .map(|(_, h)| infera_kvd::l4::name(&cfg.prefix, *h))
            .collect();
        let mut times = Times::default();
        for _ in 0..ROUNDS {
            times.time("plain put", || rt.block_on(plain.set_all(&blocks)));
            let got = times.time("plain get", || rt.block_on(plain.get_all(n)));
            assert!(got.iter().all(|v| v.len() == size));
            // After the plain client's rounds kvd's writer has been idle (it looks at its
            // inbox every 8 ms at most); the next round finds it busy, as under a steady load.
            timed::round(rt, &l4, &ns, &keys, &blocks, &mut times, "idle");
            timed::round(rt, &l4, &ns, &keys, &blocks, &mut times, "kvd");
            let got = times.time("resp get", || {
                rt.block_on(remote.get_batch(&names)).unwrap()
            });
            assert!(got.iter().all(Option::is_some));
        }
        let mb = |way: &str| times.rate(way, ROUND_BYTES as f64) / 1e6;
        let label = format!("{} MiB", size >> 20);
        let (kvd_put, kvd_get) = (mb("kvd put"), mb("kvd get"));
        let (plain_put, plain_get) = (mb("plain put"), mb("plain get"));
        let (idle_put, idle_get) = (mb("idle put"), mb("idle get"));
        println!("| {label} | kvd L4 | {kvd_put:.0} | {kvd_get:.0} |");
        println!(
            "| {label} | kvd L4, its writer idle before the round | {idle_put:.0} | {idle_get:.0} |"
        );
        println!(
            "| {label} | kvd's RESP client alone | — | {:.0} |",
            mb("resp get")
        );
        println!("| {label} | plain pipelined client | {plain_put:.0} | {plain_get:.0} |");
        println!(
            "| {label} | kvd / the plain client | {:.0} % | {:.0} % |",
            100.0 * kvd_put / plain_put,
            100.0 * kvd_get / plain_get
        );
        println!(
            "| {label} | kvd, its writer idle before, / the plain client | {:.0} % | {:.0} % |",
            100.0 * idle_put / plain_put,
            100.0 * idle_get / plain_get
        );
    }
    rt.block_on(l4.close()).unwrap();
}

/// Framing alone: encode (checksum) and decode (checksum, key check) of a 4 MiB block.
fn framing(c: &mut Criterion) {
    let ns = Namespace::new("bench", "");
    let value = block(3, 4 << 20);
    let info = infera_kvd::l4::frame::FrameInfo {
        class: Retention::Long,
        expires_at: None,
        writer: 1,
        seq: 1,
        written_at: 1,
    };
    let stored = infera_kvd::l4::frame::joined(
        &infera_kvd::l4::frame::encode(&ns, b"k", &value, info).unwrap(),
    );
    let mut g = c.benchmark_group("l4_frame");
    g.throughput(Throughput::Bytes(value.len() as u64));
    g.bench_function("encode/4MiB", |b| {
        b.iter(|| infera_kvd::l4::frame::encode(&ns, b"k", &value, info).unwrap())
    });
    g.bench_function("decode/4MiB", |b| {
        b.iter(|| infera_kvd::l4::frame::decode(&stored, &ns, b"k").unwrap())
    });
    g.finish();
}

fn main() {
    let redis = RedisServer::start();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let mut c = Criterion::default().configure_from_args();
    framing(&mut c);
    c.final_summary();
    throughput(
        &rt,
        redis.port,
        "the clients and redis-server sharing every CPU",
    );
    match server_core::ServerCore::reserve() {
        Some(_split) => throughput(
            &rt,
            redis.port,
            "redis-server on the last CPU, the clients (kvd's writer too) on the others",
        ),
        None => println!("\nL4 throughput, redis-server on a CPU of its own: not run (one CPU)"),
    }
    let cfg = config(redis.port);
    let down = config(redis_server::free_port()).store();
    set_study::run(&rt, &cfg.options(), &|| cfg.store(), down);
    let slow = set_socket::delayed(&rt, redis.port, std::time::Duration::from_millis(50));
    set_socket::run(
        &rt,
        vec![
            ("no L4", None),
            ("L4 healthy", Some(config(redis.port))),
            ("L4 slow (50 ms)", Some(config(slow))),
            ("L4 down", Some(config(redis_server::free_port()))),
            // The baseline's twin: its ratio is the study's own noise.
            ("no L4 (A/A)", None),
        ],
    );
}
