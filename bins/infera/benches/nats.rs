//! The NATS targets of the NATS issue, measured through real `infera server` and
//! `infera worker mock` processes (this build's binary) on loopback, with etcd discovery and a
//! nats-server (JetStream on) started by the backends harness on free ports.
//!
//! 1. **Transport overhead** (target: NATS adds ≤ 1 ms p50 over HTTP). Two fleets side by side,
//!    each one server and one mock worker at (practically) infinite speed: one on
//!    `--request-transport http`, one on `nats`. A ~1k-token non-streaming `/v1/completions`
//!    (`max_tokens: 1`, prompts cycled from a pool, so both routers see the same mix) is sent to
//!    each in turn, one at a time, and every latency is kept: the table prints p50 / p90 / p99
//!    of each and the p50 difference. Then criterion's `nats/1k-unary/{http,nats}` time the same.
//! 2. **KV ingest** (target: ≥ 200k blocks/s). A fake worker registered in etcd; its KV batches,
//!    shaped as the worker's relay sends them (`infera.kv.events.<token>.0`, `infera-kv-seq`,
//!    `infera-kv-epoch`, vLLM msgpack of 4 `BlockStored` × 16 blocks of 16 tokens), are published
//!    to the NATS fleet's server with at most [`WINDOW`] blocks not yet applied; the clock stops
//!    when the server's `infera_kv_stored_blocks_total` has them all.
//! 3. **Restart** (target: rebuild from 1 M logged blocks ≤ 5 s), per durable log (SQLite file,
//!    JetStream): a server with `--event-log` ingests `INFERA_BENCH_BLOCKS` blocks from a fake
//!    worker (the fill rate with write-behind is printed too), is stopped once its log holds every
//!    event, and a new server on the same log is started; the clock runs from its spawn until its
//!    `/v1/workers` shows the worker with every block back (ready to route by affinity), with the
//!    time to its first `/health` answer (the log read) alongside. A fresh log each run.
//!
//! Each timed part runs `INFERA_BENCH_RUNS` (default 3) times; the tables print every run and the
//! median. Skipped under `--test` / `--list` (criterion's own part runs there as a smoke test).
//!
//! `cargo bench -p infera --bench nats` (needs etcd and nats-server ≥ 2.12, as the tests).

use bytes::Bytes;
use criterion::Criterion;
use http_body_util::{BodyExt as _, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use infera_adapters::tokenize::Tokenizer;
use infera_backends::discovery::{EtcdConfig, EtcdDiscovery, Registrar as _, Registration};
use infera_backends::nats::kv::{HDR_KV_EPOCH, HDR_KV_SEQ, kv_subject};
use infera_backends::nats::{self, HeaderMap};
use infera_backends::testing::{EtcdServer, NatsServer, sample_record};
use infera_core::event::{RequestTransport, Tier};
use infera_core::ids::EngineHash;
use infera_core::kv_events::{EngineBatch, EngineEvent, encode_batch_vllm};
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tokio::runtime::Runtime;

/// Blocks published but not yet applied, at most (flow control, as an engine's pace would be).
const WINDOW: u64 = 128 * 1024;
/// Blocks per KV message: 4 `BlockStored` events of 16 blocks.
const EVENTS_PER_BATCH: u64 = 4;
const BLOCKS_PER_EVENT: u64 = 16;
const BLOCK_SIZE: u32 = 16;
/// Requests per fleet and run in the side-by-side latency table.
const LATENCY_REQUESTS: usize = 1000;
/// Bound of every wait for another process.
const DEADLINE: Duration = Duration::from_secs(300);

type HttpClient = Client<HttpConnector, Full<Bytes>>;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let listing = args.iter().any(|a| a == "--test" || a == "--list");
    let env_or = |name: &str, default: usize| {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let runs = env_or("INFERA_BENCH_RUNS", 3).max(1);
    // Whole messages only.
    let per_batch = EVENTS_PER_BATCH * BLOCKS_PER_EVENT;
    let blocks = (env_or("INFERA_BENCH_BLOCKS", 1_000_000) as u64).div_ceil(per_batch) * per_batch;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    let etcd = rt.block_on(EtcdServer::start()).expect("etcd starts");
    let broker = rt
        .block_on(NatsServer::start())
        .unwrap_or_else(|e| panic!("the NATS benches need nats-server >= 2.12: {e}"));
    let tok = tokenizer_dir();
    let client = http_client();

    let fleets = [
        Fleet::start(&rt, &client, &etcd, &broker, &tok, "http"),
        Fleet::start(&rt, &client, &etcd, &broker, &tok, "nats"),
    ];
    let tokenizer = Tokenizer::from_path(Path::new(&tok)).expect("fixture tokenizer");
    let bodies: Vec<Bytes> = (0..64)
        .map(|i| body(&tok, &prompt(&tokenizer, &format!("p{i}"), 1_000)))
        .collect();
    // Warm both: connections, the routers' prefix caches, the engines.
    for fleet in &fleets {
        for b in &bodies {
            rt.block_on(complete(&client, fleet.port, b.clone()));
        }
    }
    if !listing {
        latency_table(&rt, &client, &fleets, &bodies, runs);
    }
    let mut criterion = Criterion::default().configure_from_args();
    {
        let mut group = criterion.benchmark_group("nats/1k-unary");
        group
            .sample_size(30)
            .measurement_time(Duration::from_secs(5));
        for fleet in &fleets {
            let mut n = 0usize;
            group.bench_function(fleet.transport, |b| {
                b.iter(|| {
                    n += 1;
                    rt.block_on(complete(
                        &client,
                        fleet.port,
                        bodies[n % bodies.len()].clone(),
                    ));
                });
            });
        }
        group.finish();
    }
    criterion.final_summary();
    if listing {
        return;
    }
    ingest_table(&rt, &client, &etcd, &broker, &fleets[1], blocks, runs);
    drop(fleets);
    restore_table(&rt, &client, &etcd, &tok, blocks, runs);
}

// ---------------------------------------------------------------------------------------------
// Processes
// ---------------------------------------------------------------------------------------------

/// A child process killed (by its own pid) when dropped.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Proc {
    fn spawn(args: &[String]) -> Self {
        Self(
            Command::new(env!("CARGO_BIN_EXE_infera"))
                .args(args)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("infera starts"),
        )
    }

    /// SIGTERM, then waits for the exit (a server writes its last events to its log).
    fn terminate(mut self) {
        let pid = self.0.id().to_string();
        let sent = Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .expect("kill");
        assert!(sent.success(), "kill -TERM {pid}");
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    infera_backends::testing::free_port().expect("a free port")
}

fn tokenizer_dir() -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures/tokenizers/deepseek-v4")
        .to_string_lossy()
        .into_owned()
}

fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| (*s).to_owned()).collect()
}

/// `infera server` on `port` under etcd `prefix`, with `extra` flags.
fn server(tok: &str, etcd: &str, prefix: &str, nats: &str, port: u16, extra: &[&str]) -> Proc {
    let mut args = strings(&[
        "server",
        "--router-tokenizer-path",
        tok,
        "--host",
        "127.0.0.1",
    ]);
    args.extend(strings(&["--port", &port.to_string()]));
    args.extend(strings(&[
        "--discovery-backend",
        "etcd",
        "--etcd-endpoint",
        etcd,
    ]));
    args.extend(strings(&["--etcd-prefix", prefix, "--nats-server", nats]));
    args.extend(strings(extra));
    Proc::spawn(&args)
}

/// One server and one mock worker (at practically infinite speed) on `transport`.
struct Fleet {
    transport: &'static str,
    port: u16,
    _worker: Proc,
    _server: Proc,
}

impl Fleet {
    fn start(
        rt: &Runtime,
        client: &HttpClient,
        etcd: &EtcdServer,
        broker: &NatsServer,
        tok: &str,
        transport: &'static str,
    ) -> Self {
        let prefix = format!("/bench-{transport}/");
        let worker_port = free_port();
        let mut args = strings(&["worker", "mock", "--model-path", tok, "--host", "127.0.0.1"]);
        args.extend(strings(&["--port", &worker_port.to_string()]));
        args.extend(strings(&["--block-size", "16", "--speedup", "1e9"]));
        args.extend(strings(&[
            "--gpu-blocks",
            "1048576",
            "--max-batched-tokens",
            "1048576",
        ]));
        args.extend(strings(&["--discovery-backend", "etcd"]));
        args.extend(strings(&[
            "--etcd-endpoint",
            &etcd.endpoint(),
            "--etcd-prefix",
            &prefix,
        ]));
        args.extend(strings(&["--nats-server", &broker.url()]));
        args.extend(strings(&["--request-transport", transport]));
        let worker = Proc::spawn(&args);
        let port = free_port();
        let server = server(
            tok,
            &etcd.endpoint(),
            &prefix,
            &broker.url(),
            port,
            &["--request-transport", transport],
        );
        rt.block_on(until(&format!("the {transport} fleet"), || async {
            get_json(client, port, "/health")
                .await
                .is_some_and(|h| h["active_workers"] == 1)
        }));
        Self {
            transport,
            port,
            _worker: worker,
            _server: server,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// HTTP
// ---------------------------------------------------------------------------------------------

fn http_client() -> HttpClient {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    Client::builder(TokioExecutor::new()).build(connector)
}

async fn get(client: &HttpClient, port: u16, path: &str) -> Option<(u16, Bytes)> {
    let req = hyper::Request::get(format!("http://127.0.0.1:{port}{path}"))
        .body(Full::new(Bytes::new()))
        .ok()?;
    let resp = client.request(req).await.ok()?;
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.ok()?.to_bytes();
    Some((status, body))
}

async fn get_json(client: &HttpClient, port: u16, path: &str) -> Option<Value> {
    let (status, body) = get(client, port, path).await?;
    (status == 200).then(|| serde_json::from_slice(&body).ok())?
}

/// An unlabelled counter of the server's `/metrics`; `None` while it does not answer.
async fn metric(client: &HttpClient, port: u16, name: &str) -> Option<u64> {
    let (_, body) = get(client, port, "/metrics").await?;
    let text = String::from_utf8_lossy(&body);
    Some(
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
            .unwrap_or(0),
    )
}

/// Cached blocks of `worker` in the server's `/v1/workers`.
async fn cached_blocks(client: &HttpClient, port: u16, worker: &str) -> Option<u64> {
    let workers = get_json(client, port, "/v1/workers").await?;
    workers["data"]
        .as_array()?
        .iter()
        .find(|w| w["record"]["worker_id"] == worker)?["load"][0]["cached_blocks"]
        .as_u64()
}

/// Polls `probe` until it holds (the state observed is another process's).
async fn until<F: std::future::Future<Output = bool>>(what: &str, mut probe: impl FnMut() -> F) {
    let start = Instant::now();
    while !probe().await {
        assert!(start.elapsed() < DEADLINE, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

async fn complete(client: &HttpClient, port: u16, body: Bytes) {
    let req = hyper::Request::post(format!("http://127.0.0.1:{port}/v1/completions"))
        .header("content-type", "application/json")
        .body(Full::new(body))
        .expect("request");
    let resp = client.request(req).await.expect("response");
    let status = resp.status();
    let body = resp.into_body().collect().await.expect("body").to_bytes();
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
}

fn body(model: &str, text: &str) -> Bytes {
    Bytes::from(json!({"model": model, "prompt": text, "max_tokens": 1}).to_string())
}

/// About `tokens` tokens of text tagged with `tag`.
fn prompt(tok: &Tokenizer, tag: &str, tokens: usize) -> String {
    let mut text = String::new();
    let mut i = 0;
    loop {
        text.push_str(&format!(
            "{tag} note {i}: the router hashes every block of the prompt, then picks the \
             worker whose cache holds the longest prefix of it.\n"
        ));
        i += 1;
        if i % 16 == 0 && tok.encode_plain(&text).map_or(0, |t| t.len()) >= tokens {
            return text;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// 1. Transport overhead
// ---------------------------------------------------------------------------------------------

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

fn latency_table(
    rt: &Runtime,
    client: &HttpClient,
    fleets: &[Fleet; 2],
    bodies: &[Bytes],
    runs: usize,
) {
    println!(
        "\ntransport overhead: ~1k-token unary /v1/completions, max_tokens 1, one at a time, \
         the two fleets interleaved ({LATENCY_REQUESTS} requests each per run)"
    );
    println!(
        "{:<5} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>12}",
        "run", "http p50", "http p90", "http p99", "nats p50", "nats p90", "nats p99", "added p50"
    );
    let mut added = Vec::new();
    for run in 0..runs {
        let mut times: [Vec<Duration>; 2] = [Vec::new(), Vec::new()];
        rt.block_on(async {
            for i in 0..LATENCY_REQUESTS {
                for (f, fleet) in fleets.iter().enumerate() {
                    let body = bodies[i % bodies.len()].clone();
                    let start = Instant::now();
                    complete(client, fleet.port, body).await;
                    times[f].push(start.elapsed());
                }
            }
        });
        for t in &mut times {
            t.sort();
        }
        let p = |f: usize, q: f64| percentile(&times[f], q).as_secs_f64() * 1e3;
        let delta = p(1, 0.5) - p(0, 0.5);
        added.push(delta);
        println!(
            "{:<5} {:>8.3}ms {:>8.3}ms {:>8.3}ms {:>8.3}ms {:>8.3}ms {:>8.3}ms {:>10.3}ms",
            run + 1,
            p(0, 0.5),
            p(0, 0.9),
            p(0, 0.99),
            p(1, 0.5),
            p(1, 0.9),
            p(1, 0.99),
            delta
        );
    }
    println!(
        "median added p50 over {runs} runs: {:.3} ms (target <= 1 ms)",
        median(added)
    );
}

// ---------------------------------------------------------------------------------------------
// 2. KV ingest
// ---------------------------------------------------------------------------------------------

/// A worker record in etcd under `prefix`, as a real worker registers it (its KV events on NATS).
async fn fake_worker(etcd: &EtcdServer, prefix: &str) -> Registration {
    let id = format!("127.0.0.1:{}", free_port());
    let mut record = sample_record(&id);
    record.kv_events_endpoint = None;
    record.request_transport = RequestTransport::Nats;
    record.kv_block_size = BLOCK_SIZE;
    let discovery = EtcdDiscovery::connect(EtcdConfig {
        prefix: prefix.to_owned(),
        ..EtcdConfig::new([etcd.endpoint()])
    })
    .await
    .expect("etcd client");
    discovery.register(&record).await.expect("registers")
}

/// `blocks` blocks as relay messages (payload, engine seq), hashes from `first_hash` on.
fn kv_messages(first_hash: u64, blocks: u64) -> Vec<Bytes> {
    let per_batch = EVENTS_PER_BATCH * BLOCKS_PER_EVENT;
    (0..blocks.div_ceil(per_batch))
        .map(|b| {
            let events = (0..EVENTS_PER_BATCH)
                .map(|e| {
                    let first = first_hash + b * per_batch + e * BLOCKS_PER_EVENT;
                    let tokens = u32::try_from(first % (1 << 20)).unwrap_or(0) * BLOCK_SIZE;
                    EngineEvent::BlockStored {
                        block_hashes: (first..first + BLOCKS_PER_EVENT).map(EngineHash).collect(),
                        parent: None,
                        token_ids: (tokens..tokens + BLOCK_SIZE * BLOCKS_PER_EVENT as u32)
                            .collect(),
                        block_size: BLOCK_SIZE,
                        tier: Tier::Gpu,
                        lora_id: None,
                        lora_name: None,
                        extra_keys: None,
                        cache_salt: None,
                        indexable: true,
                    }
                })
                .collect();
            let batch = EngineBatch {
                ts: 1.0,
                events,
                ..EngineBatch::default()
            };
            Bytes::from(encode_batch_vllm(&batch))
        })
        .collect()
}

/// Publishes `messages` for `worker` (rank 0, seq from 0) to the server on `port`, keeping at
/// most [`WINDOW`] blocks not yet applied, and waits until the server has them all. Returns the
/// time from the first publish to the last block applied.
async fn ingest(
    client: &HttpClient,
    nats: &nats::Client,
    port: u16,
    worker: &str,
    messages: Vec<Bytes>,
) -> Duration {
    let per_batch = EVENTS_PER_BATCH * BLOCKS_PER_EVENT;
    let subject = kv_subject(worker, 0);
    let base = metric(client, port, "infera_kv_stored_blocks_total")
        .await
        .expect("server metrics");
    let total = messages.len() as u64 * per_batch;
    let start = Instant::now();
    let mut applied = 0;
    for (seq, payload) in messages.into_iter().enumerate() {
        let published = seq as u64 * per_batch;
        while published - applied >= WINDOW {
            tokio::time::sleep(Duration::from_millis(1)).await;
            applied = metric(client, port, "infera_kv_stored_blocks_total")
                .await
                .expect("server metrics")
                - base;
            assert!(
                start.elapsed() < DEADLINE,
                "ingest stalled at {applied} blocks"
            );
        }
        let mut headers = HeaderMap::new();
        headers.insert(HDR_KV_SEQ, seq.to_string().as_str());
        headers.insert(HDR_KV_EPOCH, "1");
        nats.publish_with_headers(subject.clone(), headers, payload)
            .await
            .expect("publish");
    }
    nats.flush().await.expect("flush");
    until("every block applied", || async {
        metric(client, port, "infera_kv_stored_blocks_total")
            .await
            .is_some_and(|n| n - base >= total)
    })
    .await;
    let took = start.elapsed();
    assert_eq!(
        metric(client, port, "infera_kv_event_gaps_total").await,
        Some(0),
        "KV batches were lost on the way"
    );
    took
}

fn ingest_table(
    rt: &Runtime,
    client: &HttpClient,
    etcd: &EtcdServer,
    broker: &NatsServer,
    fleet: &Fleet,
    blocks: u64,
    runs: usize,
) {
    println!(
        "\nKV ingest over NATS: {blocks} blocks per run in messages of {EVENTS_PER_BATCH} x \
         {BLOCKS_PER_EVENT} blocks, at most {WINDOW} blocks not yet applied"
    );
    let nats = rt
        .block_on(nats::connect(&broker.url(), "bench-kv"))
        .expect("nats");
    let mut rates = Vec::new();
    // Kept registered (their blocks stay indexed) until the end.
    let mut registrations = Vec::new();
    for run in 0..runs {
        // A fresh worker each run: the index grows by `blocks` from empty for it.
        let registration = rt.block_on(fake_worker(etcd, "/bench-nats/"));
        let worker = registration.worker().as_str().to_owned();
        rt.block_on(until("the fake worker", || async {
            get_json(client, fleet.port, "/health")
                .await
                .is_some_and(|h| h["active_workers"] == 2 + run as u64)
        }));
        let messages = kv_messages(1 << 32, blocks);
        let took = rt.block_on(ingest(client, &nats, fleet.port, &worker, messages));
        let rate = blocks as f64 / took.as_secs_f64();
        rates.push(rate);
        println!("run {}: {:.2?} = {:.0} blocks/s", run + 1, took, rate);
        registrations.push(registration);
    }
    println!(
        "median over {runs} runs: {:.0} blocks/s (target >= 200000)",
        median(rates)
    );
}

// ---------------------------------------------------------------------------------------------
// 3. Restart from a durable log
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Copy)]
enum Backend {
    Sqlite,
    JetStream,
}

fn restore_table(
    rt: &Runtime,
    client: &HttpClient,
    etcd: &EtcdServer,
    tok: &str,
    blocks: u64,
    runs: usize,
) {
    println!(
        "\nrestart from a durable event log holding {blocks} blocks of KV events (filled through \
         a server, {BLOCKS_PER_EVENT} blocks per event)"
    );
    println!(
        "{:<10} {:<5} {:>16} {:>14} {:>16}",
        "log", "run", "fill blocks/s", "log read", "ready to route"
    );
    let dir = tempfile::tempdir().expect("tempdir");
    for (name, backend) in [
        ("sqlite", Backend::Sqlite),
        ("jetstream", Backend::JetStream),
    ] {
        let mut ready = Vec::new();
        for run in 0..runs {
            let (fill, read, routed) = rt.block_on(restore_once(
                client,
                etcd,
                tok,
                backend,
                dir.path(),
                run,
                blocks,
            ));
            ready.push(routed.as_secs_f64());
            println!(
                "{:<10} {:<5} {:>16.0} {:>14.2?} {:>16.2?}",
                name,
                run + 1,
                fill,
                read,
                routed
            );
        }
        println!(
            "{name}: median ready to route over {runs} runs: {:.2} s (target <= 5 s)",
            median(ready)
        );
    }
}

/// One fill + restart on a fresh log: (fill rate in blocks/s, time to the first `/health`,
/// time until the worker's blocks are all back).
async fn restore_once(
    client: &HttpClient,
    etcd: &EtcdServer,
    tok: &str,
    backend: Backend,
    dir: &Path,
    run: usize,
    blocks: u64,
) -> (f64, Duration, Duration) {
    // A fresh broker (so a fresh JetStream stream) and a fresh etcd prefix each run.
    let broker = NatsServer::start().await.expect("nats-server starts");
    let prefix = format!("/bench-log-{run}-{}/", matches!(backend, Backend::Sqlite));
    let path: PathBuf = dir.join(format!("events-{run}.db"));
    let log = match backend {
        Backend::Sqlite => format!("sqlite:{}", path.display()),
        Backend::JetStream => "nats".to_owned(),
    };
    let flags = ["--event-log", log.as_str()];
    let port = free_port();
    let filler = server(tok, &etcd.endpoint(), &prefix, &broker.url(), port, &flags);
    let registration = fake_worker(etcd, &prefix).await;
    let worker = registration.worker().as_str().to_owned();
    until("the filling server", || async {
        get_json(client, port, "/health")
            .await
            .is_some_and(|h| h["active_workers"] == 1)
    })
    .await;
    let nats = nats::connect(&broker.url(), "bench-fill")
        .await
        .expect("nats");
    let took = ingest(client, &nats, port, &worker, kv_messages(1 << 40, blocks)).await;
    let fill = blocks as f64 / took.as_secs_f64();
    // Everything committed is in the durable log before the server stops.
    until("the durable log to take every event", || async {
        let applied = metric(client, port, "infera_events_applied_total").await;
        let appended = metric(client, port, "infera_event_log_appended_events_total").await;
        applied.is_some_and(|applied| appended.is_some_and(|appended| appended >= applied))
    })
    .await;
    filler.terminate();

    let port = free_port();
    let start = Instant::now();
    let _restored = server(tok, &etcd.endpoint(), &prefix, &broker.url(), port, &flags);
    until("the restarted server to answer", || async {
        get(client, port, "/health").await.is_some()
    })
    .await;
    let read = start.elapsed();
    until("the restarted server to have every block back", || async {
        cached_blocks(client, port, &worker).await == Some(blocks)
    })
    .await;
    let routed = start.elapsed();
    drop(registration);
    (fill, read, routed)
}
