//! L4 against an S3-compatible server on loopback (moto's standalone server, started here as
//! the tests do), side by side with the standard S3 client, boto3.
//!
//! - kvd: 16 blocks of 1 MiB and of 4 MiB per round through kvd's L4 (framing, checksum, the
//!   write-behind queue, SigV4-signed PUTs on kept-alive connections): a put round is 16 puts
//!   then a flush, a get round one batched read of the 16.
//! - boto3, in one Python process against the same bucket: the same 16 objects put and read
//!   concurrently (16 threads, boto3's pool of as many connections), each value a `bytes`.
//! - The rounds alternate (`support/side.rs`): boto3's, then kvd's. Printed: median
//!   throughput of 15 rounds each, and kvd against boto3. Both share the
//!   server, a Python process whose own cost bounds either client, so the ratio says whether
//!   kvd's client adds a cost of its own, not what S3 itself would give.
//!
//! Run: `cargo bench -p infera-kvd --bench l4_s3` (needs `moto[server]` for `python3`, as the
//! tests do).

#![allow(clippy::unwrap_used)]

#[path = "support/rounds.rs"]
mod rounds;
#[path = "../tests/support/s3.rs"]
mod s3_server;
#[path = "support/side.rs"]
mod side;
#[path = "support/timed.rs"]
mod timed;

use bytes::Bytes;
use infera_kvd::Namespace;
use infera_kvd::l4::L4;
use infera_kvd::long::LongStore;
use s3_server::{BUCKET, S3Server, l4_config};
use side::Side;
use timed::Times;

/// The allocator `infera kvd` runs with.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Blocks per round, and rounds.
const N: usize = 16;
const ROUNDS: usize = 15;

/// boto3's side (`support/side.rs`): `play(size)` times one round of puts and one of gets.
const BOTO3: &str = r#"
import json, sys, time
from concurrent.futures import ThreadPoolExecutor
import boto3, botocore.config
cfg = json.loads(sys.argv[1])
n = cfg["n"]
s3 = boto3.client("s3", endpoint_url=cfg["endpoint"], region_name="us-east-1",
    aws_access_key_id="testing", aws_secret_access_key="testing",
    config=botocore.config.Config(max_pool_connections=n))
pool = ThreadPoolExecutor(n)

def play(size):
    keys = [f"boto3-{size}-{i}" for i in range(n)]
    values = [bytes([i]) * size for i in range(n)]
    t = time.perf_counter()
    list(pool.map(lambda kv: s3.put_object(Bucket=cfg["bucket"], Key=kv[0], Body=kv[1]), zip(keys, values)))
    put = time.perf_counter() - t
    t = time.perf_counter()
    got = list(pool.map(lambda k: s3.get_object(Bucket=cfg["bucket"], Key=k)["Body"].read(), keys))
    get = time.perf_counter() - t
    assert all(len(g) == size for g in got)
    return {"put": put, "get": get}
"#;

fn main() {
    let server = S3Server::start();
    let sizes = [1usize << 20, 4 << 20];
    let mut boto3 = Side::start(
        BOTO3,
        &serde_json::json!({
            "endpoint": format!("http://127.0.0.1:{}", server.port),
            "bucket": BUCKET, "n": N,
        }),
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let cfg = l4_config(server.port, BUCKET);
    let l4 = rt.block_on(async { L4::open(cfg.store(), cfg.options(), true).await.unwrap() });
    let ns = Namespace::new("bench", "");
    println!("| block | client | put MB/s | get MB/s |");
    println!("|---|---|---:|---:|");
    for size in sizes {
        let keys = rounds::keys(&ns, &format!("{size}-"), N);
        let blocks: Vec<Bytes> = (0..N).map(|i| Bytes::from(vec![i as u8; size])).collect();
        // Round by round: boto3's, then kvd's.
        let mut times = Times::default();
        for _ in 0..ROUNDS {
            boto3.round(size, &mut times);
            timed::round(&rt, &l4, &ns, &keys, &blocks, &mut times, "kvd");
        }
        let bytes = (N * size) as f64;
        let way = |name: &str| times.rate(name, bytes);
        let (put, get) = (way("kvd put"), way("kvd get"));
        let label = format!("{} MiB", size >> 20);
        println!("| {label} | kvd L4 | {:.0} | {:.0} |", put / 1e6, get / 1e6);
        println!(
            "| {label} | boto3, 16 threads | {:.0} | {:.0} |",
            way("put") / 1e6,
            way("get") / 1e6
        );
        println!(
            "| {label} | kvd / boto3 | {:.0} % | {:.0} % |",
            100.0 * put / way("put"),
            100.0 * get / way("get")
        );
    }
    rt.block_on(l4.close()).unwrap();
}
