//! Tenants end to end on loopback: API keys (either header, 401 otherwise, reloaded from the
//! file), limits (429 with `Retry-After`, the OpenAI and Anthropic error shapes, the
//! `x-ratelimit-*` headers), and the router's queue under a flood from one tenant against mock
//! engines with a bounded step budget: nothing is lost, the quiet tenant's time to first byte
//! and the engines' queues stay bounded, equal weights get equal service.

mod common;

use common::fleet::{Front, MODEL, Mock, options, record, tokenizer};
use common::{body_of, request_with};
use infera_adapters::server::{ClientOptions, KeyStore, ServerState};
use infera_core::policy::PolicyKind;
use infera_core::service::QueueConfig;
use serde_json::{Value, json};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

const NOISY_KEY: &str = "sk-noisy-0123456789abcdef";
const QUIET_KEY: &str = "sk-quiet-0123456789abcdef";
/// The mock engines' step budget, registered as their prefill budget.
const BUDGET: u32 = 1024;

fn key_file(dir: &tempfile::TempDir, text: &str) -> std::path::PathBuf {
    let path = dir.path().join("keys.json");
    std::fs::write(&path, text).expect("write the key file");
    path
}

fn tenants_json(quiet_rpm: Option<u64>) -> String {
    let limits = quiet_rpm.map_or(json!({}), |rpm| json!({"requests_per_minute": rpm}));
    json!({"tenants": [
        {"name": "noisy", "keys": [NOISY_KEY]},
        {"name": "quiet", "keys": [QUIET_KEY], "limits": limits},
    ]})
    .to_string()
}

async fn front_with(keys: KeyStore, queue: QueueConfig) -> Front {
    let mut opts = options(PolicyKind::KV_AWARE, 0, false);
    opts.client = ClientOptions {
        api_keys: Some(keys),
        ..ClientOptions::default()
    };
    let state = ServerState::new(opts, tokenizer());
    state.service().set_queue(queue);
    Front::serve(state).await
}

/// A completion of `tokens` distinct prompt tokens (no two requests share a prefix).
fn prompt(seed: u64, tokens: usize, max_tokens: u32) -> Vec<u8> {
    let ids: Vec<u64> = (0..tokens as u64)
        .map(|i| 1_000 + (seed.wrapping_mul(7_919) + i * 13) % 60_000)
        .collect();
    json!({"model": MODEL, "prompt": ids, "max_tokens": max_tokens, "stream": true})
        .to_string()
        .into_bytes()
}

/// Sends one streamed completion; returns the status, the time to the response head (the
/// first token: the server answers its head with the first chunk) and the body.
async fn complete(front: &Front, key: &str, body: Vec<u8>) -> (u16, Duration, String) {
    let auth = format!("Bearer {key}");
    let started = Instant::now();
    let ex = request_with(
        front.addr,
        "POST",
        "/v1/completions",
        &[("authorization", &auth)],
        body,
    )
    .await;
    let head = started.elapsed();
    let (status, text) = body_of(ex).await;
    (status, head, text)
}

/// Sends one Anthropic Messages request with `key` as the Anthropic SDK sends it (`x-api-key`);
/// returns the status and the body.
async fn messages(front: &Front, key: &str) -> (u16, String) {
    let body = json!({"model": MODEL, "max_tokens": 1,
        "messages": [{"role": "user", "content": "hi"}]});
    let ex = request_with(
        front.addr,
        "POST",
        "/v1/messages",
        &[("x-api-key", key)],
        body.to_string().into_bytes(),
    )
    .await;
    body_of(ex).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_are_asked_for_checked_and_reloaded_and_limits_answer_429() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = key_file(&dir, &tenants_json(Some(2)));
    let keys = KeyStore::load(&path).expect("the key file loads");
    let front = front_with(keys.clone(), QueueConfig::default()).await;
    let mock = Mock::start().await;
    front.state.register_worker(record(mock.addr));
    let body = || prompt(1, 8, 1);

    let ex = request_with(front.addr, "POST", "/v1/completions", &[], body()).await;
    let challenge = ex.response.headers().get("www-authenticate").cloned();
    let (status, text) = body_of(ex).await;
    assert_eq!(status, 401, "{text}");
    assert_eq!(
        challenge.as_ref().map(|v| v.as_bytes()),
        Some(&b"Bearer"[..])
    );
    assert!(text.contains("API key"), "{text}");
    let (status, _, _) = complete(&front, "sk-wrong-0123456789abcdef", body()).await;
    assert_eq!(status, 401);

    // The Anthropic clients send x-api-key.
    let (status, text) = messages(&front, NOISY_KEY).await;
    assert_eq!(status, 200, "{text}");

    // The quiet tenant may send two a minute: the third is refused, with the headers.
    for _ in 0..2 {
        let (status, _, text) = complete(&front, QUIET_KEY, body()).await;
        assert_eq!(status, 200, "{text}");
    }
    let auth = format!("Bearer {QUIET_KEY}");
    let ex = request_with(
        front.addr,
        "POST",
        "/v1/completions",
        &[("authorization", &auth)],
        body(),
    )
    .await;
    let headers = ex.response.headers().clone();
    let (status, text) = body_of(ex).await;
    assert_eq!(status, 429, "{text}");
    let error: Value = serde_json::from_str(&text).expect("json error");
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("requests limit"),
        "{text}"
    );
    let header = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    assert_eq!(
        header("retry-after").as_deref(),
        Some("30"),
        "half a minute to one more"
    );
    assert_eq!(header("x-ratelimit-limit-requests").as_deref(), Some("2"));
    assert_eq!(
        header("x-ratelimit-remaining-requests").as_deref(),
        Some("0")
    );
    assert_eq!(
        header("x-ratelimit-reset-requests").as_deref(),
        Some("1m0s")
    );
    // The Anthropic endpoint answers in its own shape.
    let (status, text) = messages(&front, QUIET_KEY).await;
    assert_eq!(status, 429);
    assert!(text.contains("rate_limit_error"), "{text}");
    let metrics = common::get(front.addr, "/metrics").await.1;
    assert!(
        metrics.contains(r#"infera_tenant_rate_limited_total{tenant="quiet",limit="requests"} 2"#),
        "{metrics}"
    );

    // A new key file takes effect without a restart; the spent minute is not forgiven.
    let rotated = tenants_json(Some(2)).replace(NOISY_KEY, "sk-noisy-rotated-0123456789");
    std::fs::write(&path, rotated).expect("rewrite the key file");
    let watch = keys.watch();
    let deadline = Instant::now() + common::TIMEOUT;
    loop {
        let (status, _, _) = complete(&front, NOISY_KEY, body()).await;
        if status == 401 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the changed key file was not reloaded"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (status, _, _) = complete(&front, "sk-noisy-rotated-0123456789", body()).await;
    assert_eq!(status, 200);
    let (status, _, _) = complete(&front, QUIET_KEY, body()).await;
    assert_eq!(status, 429, "a reload keeps what the tenant used");
    watch.abort();
    front.stop().await;
    mock.stop().await;
}

/// What one tenant's closed-loop clients got during a flood.
#[derive(Default)]
struct Tally {
    ok: AtomicU64,
    refused: AtomicU64,
    failed: AtomicU64,
    tokens: AtomicU64,
}

/// `clients` closed-loop clients of `key`, each sending `tokens`-token prompts until `stop`.
fn flood(
    front: &Arc<Front>,
    key: &'static str,
    clients: u64,
    tokens: usize,
    stop: &Arc<AtomicBool>,
    tally: &Arc<Tally>,
) -> Vec<tokio::task::JoinHandle<()>> {
    (0..clients)
        .map(|c| {
            let (front, stop, tally) = (Arc::clone(front), Arc::clone(stop), Arc::clone(tally));
            tokio::spawn(async move {
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    n += 1;
                    let seed = (c << 32) | n | (u64::from(key.len() as u32) << 48);
                    let (status, _, text) = complete(&front, key, prompt(seed, tokens, 4)).await;
                    match status {
                        200 if text.contains("[DONE]") && !text.contains("\"error\"") => {
                            tally.ok.fetch_add(1, Ordering::Relaxed);
                            tally.tokens.fetch_add(tokens as u64, Ordering::Relaxed);
                        }
                        429 | 503 => {
                            tally.refused.fetch_add(1, Ordering::Relaxed);
                        }
                        _ => {
                            tally.failed.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            })
        })
        .collect()
}

/// Stops the clients [`flood`] started and waits for them to end.
async fn stop_flood(stop: &AtomicBool, clients: Vec<tokio::task::JoinHandle<()>>) {
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        tokio::time::timeout(common::TIMEOUT, c)
            .await
            .expect("clients end")
            .expect("no panic");
    }
}

async fn fleet(queue: QueueConfig) -> (Arc<Front>, Vec<Mock>) {
    let dir = tempfile::tempdir().expect("tempdir");
    let keys = KeyStore::load(&key_file(&dir, &tenants_json(None))).expect("keys load");
    let front = Arc::new(front_with(keys, queue).await);
    let mut mocks = Vec::new();
    for _ in 0..2 {
        let mock = Mock::start_configured(|c| {
            c.engine.max_batched_tokens = BUDGET;
            c.engine.speedup = 4.0;
            c.engine.gpu_blocks = 16_384;
        })
        .await;
        let mut r = record(mock.addr);
        r.set_prefill_budget(BUDGET);
        front.state.register_worker(r);
        mocks.push(mock);
    }
    (front, mocks)
}

/// The engines' waiting queues, summed, as their `/metrics` report them.
async fn engines_waiting(mocks: &[Mock]) -> u64 {
    let mut sum = 0;
    for m in mocks {
        let text = common::get(m.addr, "/metrics").await.1;
        sum += text
            .lines()
            .find(|l| l.starts_with("vllm:num_requests_waiting"))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
            .map_or(0, |v| v as u64);
    }
    sum
}

fn percentile(mut v: Vec<Duration>, p: usize) -> Duration {
    v.sort();
    v[(v.len() * p / 100).min(v.len() - 1)]
}

/// The quiet tenant's TTFTs for `n` requests spaced `gap` apart, and the most engine waiters
/// seen meanwhile.
async fn quiet_probe(front: &Front, mocks: &[Mock], n: u64, gap: Duration) -> (Vec<Duration>, u64) {
    let mut ttfts = Vec::new();
    let mut most_waiting = 0;
    for i in 0..n {
        let (status, head, text) = complete(front, QUIET_KEY, prompt(1 << 40 | i, 32, 1)).await;
        assert_eq!(status, 200, "the quiet tenant is always served: {text}");
        ttfts.push(head);
        most_waiting = most_waiting.max(engines_waiting(mocks).await);
        tokio::time::sleep(gap).await;
    }
    (ttfts, most_waiting)
}

struct Run {
    quiet_p90: Duration,
    quiet_p99: Duration,
    most_waiting: u64,
    noisy: Arc<Tally>,
    /// The noisy tenant's completions per second while the quiet one was measured.
    noisy_rate: f64,
}

async fn flooded(queue: QueueConfig) -> Run {
    let (front, mocks) = fleet(queue).await;
    let stop = Arc::new(AtomicBool::new(false));
    let noisy = Arc::new(Tally::default());
    let clients = flood(&front, NOISY_KEY, 48, 512, &stop, &noisy);
    // Let the flood build up its backlog before the quiet tenant arrives.
    while engines_waiting(&mocks).await + (front.state.service().queued() as u64) < 16 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (before, started) = (noisy.ok.load(Ordering::Relaxed), Instant::now());
    let (ttfts, most_waiting) = quiet_probe(&front, &mocks, 40, Duration::from_millis(20)).await;
    let noisy_rate =
        (noisy.ok.load(Ordering::Relaxed) - before) as f64 / started.elapsed().as_secs_f64();
    stop_flood(&stop, clients).await;
    if let Ok(front) = Arc::try_unwrap(front) {
        front.stop().await;
    }
    for m in mocks {
        m.stop().await;
    }
    Run {
        quiet_p90: percentile(ttfts.clone(), 90),
        quiet_p99: percentile(ttfts, 99),
        most_waiting,
        noisy,
        noisy_rate,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_from_one_tenant_waits_in_the_router_not_in_the_engines() {
    let idle = {
        let (front, mocks) = fleet(QueueConfig::default()).await;
        let (ttfts, _) = quiet_probe(&front, &mocks, 20, Duration::from_millis(5)).await;
        for m in mocks {
            m.stop().await;
        }
        percentile(ttfts, 99)
    };
    let off = flooded(QueueConfig {
        threshold: None,
        ..QueueConfig::default()
    })
    .await;
    let on = flooded(QueueConfig::default()).await;
    eprintln!(
        "quiet TTFT p90/p99: idle p99 {idle:?}; flood without the queue {:?}/{:?}, with it \
         {:?}/{:?}; engine waiters at most: without {}, with {}; noisy completions/s: \
         without {:.0}, with {:.0}",
        off.quiet_p90,
        off.quiet_p99,
        on.quiet_p90,
        on.quiet_p99,
        off.most_waiting,
        on.most_waiting,
        off.noisy_rate,
        on.noisy_rate,
    );
    for run in [&off, &on] {
        assert_eq!(
            run.noisy.failed.load(Ordering::Relaxed),
            0,
            "nothing is lost"
        );
        assert!(run.noisy.ok.load(Ordering::Relaxed) > 0);
    }
    // Four budgets of 1,024 tokens per engine and 512-token prompts: at most 8 routed and
    // unprefilled per engine, some of them running.
    assert!(
        on.most_waiting <= 16,
        "engines' queues bounded: {}",
        on.most_waiting
    );
    assert!(off.most_waiting > on.most_waiting);
    assert!(
        on.quiet_p90 * 4 <= off.quiet_p90 * 3,
        "the queue cuts the quiet tenant's wait by a quarter at least: {:?} against {:?}",
        on.quiet_p90,
        off.quiet_p90
    );
    assert!(
        on.noisy_rate >= 0.8 * off.noisy_rate,
        "the queue keeps the engines busy: {:.0}/s against {:.0}/s",
        on.noisy_rate,
        off.noisy_rate
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn equal_weights_get_equal_service_whatever_their_concurrency() {
    let (front, mocks) = fleet(QueueConfig::default()).await;
    let stop = Arc::new(AtomicBool::new(false));
    let (a, b) = (Arc::new(Tally::default()), Arc::new(Tally::default()));
    let mut clients = flood(&front, NOISY_KEY, 48, 512, &stop, &a);
    clients.extend(flood(&front, QUIET_KEY, 24, 512, &stop, &b));
    // Measure once both are backlogged: served tokens over a window of 300 requests.
    while a.ok.load(Ordering::Relaxed) + b.ok.load(Ordering::Relaxed) < 50 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let start = [
        a.tokens.load(Ordering::Relaxed),
        b.tokens.load(Ordering::Relaxed),
    ];
    while a.ok.load(Ordering::Relaxed) + b.ok.load(Ordering::Relaxed) < 350 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let served = [
        (a.tokens.load(Ordering::Relaxed) - start[0]) as f64,
        (b.tokens.load(Ordering::Relaxed) - start[1]) as f64,
    ];
    stop_flood(&stop, clients).await;
    let jain = (served[0] + served[1]).powi(2) / (2.0 * (served[0].powi(2) + served[1].powi(2)));
    eprintln!("served tokens {served:?}: Jain's index {jain:.3}");
    assert!(
        jain >= 0.95,
        "48 clients against 24, equal weights: {served:?}, {jain:.3}"
    );
    assert_eq!(
        a.failed.load(Ordering::Relaxed) + b.failed.load(Ordering::Relaxed),
        0
    );
    if let Ok(front) = Arc::try_unwrap(front) {
        front.stop().await;
    }
    for m in mocks {
        m.stop().await;
    }
}
