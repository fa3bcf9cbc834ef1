//! L4 against a real `redis-server` on loopback (started here, as the tests do).
//!
//! - `l4_put` / `l4_get`: 1 MiB and 4 MiB blocks through kvd's L4 (framing, checksum, the
//!   write-behind queue, LMCache's two-key layout; a put round is N puts then a flush, a get
//!   round one batched read of N blocks), next to `redis_pipelined`: the same blocks with a
//!   plain pipelined RESP client written here (what `redis-benchmark -P` does), which returns
//!   the values it read as kvd does (a reader that dropped each value at once would reuse one
//!   hot buffer, 1.6× faster on the 2-core build VM, that no caller could keep). Target: kvd
//!   ≥ 80 % of the plain client.
//! - After the criterion groups, the L2 SET latency studies with this Redis store: in process
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
#[path = "support/set_socket.rs"]
mod set_socket;
#[path = "support/set_study.rs"]
mod set_study;

use bytes::Bytes;
use criterion::{BenchmarkId, Criterion, Throughput};
use infera_core::event::Retention;
use infera_kvd::Namespace;
use infera_kvd::l4::{L4, L4Config};
use infera_kvd::long::LongStore;
use redis_server::RedisServer;
use std::sync::Arc;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

/// The allocator `infera kvd` runs with (the SET studies measure the daemon's SET path).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Blocks per round.
const N: usize = 16;

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

fn throughput(c: &mut Criterion, rt: &tokio::runtime::Runtime, port: u16) {
    let ns = Namespace::new("bench", "");
    let cfg = config(port);
    let l4 =
        rt.block_on(async { Arc::new(L4::open(cfg.store(), cfg.options(), true).await.unwrap()) });
    let mut plain = rt.block_on(Plain::connect(port));
    for size in [1usize << 20, 4 << 20] {
        let blocks: Vec<Bytes> = (0..N).map(|i| block(i, size)).collect();
        let keys = rounds::keys(&ns, "", N);
        let label = format!("{}MiB", size >> 20);
        let mut put = c.benchmark_group("l4_put");
        put.throughput(Throughput::Bytes((N * size) as u64));
        put.bench_function(BenchmarkId::new("kvd", &label), |b| {
            b.iter(|| rt.block_on(rounds::put_round(&l4, &ns, &keys, &blocks)));
        });
        put.bench_function(BenchmarkId::new("redis_pipelined", &label), |b| {
            b.iter(|| rt.block_on(plain.set_all(&blocks)));
        });
        put.finish();
        // The blocks are in the store even when a filter skipped the put group.
        rt.block_on(rounds::put_round(&l4, &ns, &keys, &blocks));
        rt.block_on(plain.set_all(&blocks));
        let mut get = c.benchmark_group("l4_get");
        get.throughput(Throughput::Bytes((N * size) as u64));
        get.bench_function(BenchmarkId::new("kvd", &label), |b| {
            b.iter(|| {
                let hits = rt.block_on(l4.get_many(&ns, &keys, 1));
                assert!(hits.iter().all(Option::is_some));
            });
        });
        let remote = cfg.store();
        let names: Vec<String> = keys
            .iter()
            .map(|(_, h)| infera_kvd::l4::name(&cfg.prefix, *h))
            .collect();
        get.bench_function(BenchmarkId::new("kvd_resp_client", &label), |b| {
            b.iter(|| rt.block_on(remote.get_batch(&names)).unwrap());
        });
        get.bench_function(BenchmarkId::new("redis_pipelined", &label), |b| {
            b.iter(|| rt.block_on(plain.get_all(N)));
        });
        get.finish();
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
    throughput(&mut c, &rt, redis.port);
    c.final_summary();
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
        ],
    );
}
