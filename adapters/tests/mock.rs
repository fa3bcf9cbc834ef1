//! The mock engine over real HTTP on 127.0.0.1: OpenAI shapes (streaming and not), prefix-cache
//! hits in `usage`, token-id prompts, vLLM KV events through the sink (and back through the
//! decoder), errors, client disconnects, graceful shutdown, and two mocks sharing prefixes through
//! a block store (the lower tier `infera up --kvd` puts kvd behind).
//!
//! Every server runs with a large `speedup`, so steps take microseconds. Nothing sleeps to
//! synchronise: KV events of a request are in the sink before its response ends (the engine
//! publishes a step's events before handing out its tokens).

mod common;

use common::fleet::{MODEL, tokenizer};

use common::{TIMEOUT, body_of, get, post, post_raw, request};
use http_body_util::BodyExt;
use infera_adapters::mock::{MockConfig, MockError, MockKvStore, MockServer, block_value, filler};
use infera_adapters::tokenize::{ChatExtras, ChatMessage};
use infera_core::engine::EngineConfig;
use infera_core::event::{Retention, Tier};
use infera_core::hashing::hash_blocks;
use infera_core::ids::{BlockHash, EngineHash};
use infera_core::kv_events::{EngineBatch, EngineEvent, decode_batch, encode_batch_vllm};
use infera_core::ports::kv_store::{
    BlockNamespace, BlockStoreError, KvBlockStore, StoredBlock, block_keys,
};
use serde_json::{Value, json};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

const SALT: u64 = 0x5eed_0000_dead_beef;

fn engine(gpu_blocks: usize, block_size: u32, speedup: f64) -> EngineConfig {
    EngineConfig {
        gpu_blocks,
        block_size,
        speedup,
        ..EngineConfig::default()
    }
}

fn config(engine: EngineConfig, with_tokenizer: bool) -> MockConfig {
    let mut c = MockConfig::new(MODEL, engine);
    c.tokenizer = with_tokenizer.then(tokenizer);
    c.salt = Some(SALT);
    c.max_body_bytes = 64 << 10;
    c.drain_timeout = Duration::from_secs(5);
    c
}

/// A running mock with its KV-event sink and a way to stop it.
struct Mock {
    addr: SocketAddr,
    events: mpsc::Receiver<EngineBatch>,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<Result<(), MockError>>,
}

async fn start(config: MockConfig) -> Mock {
    let (sink, events) = mpsc::channel(1024);
    let server = MockServer::bind("127.0.0.1:0", config, Some(sink))
        .await
        .expect("mock binds");
    assert_eq!(server.salt(), SALT);
    let addr = server.local_addr();
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(server.serve(async move {
        let _ = stopped.await;
    }));
    Mock {
        addr,
        events,
        stop: Some(stop),
        task,
    }
}

impl Mock {
    /// Shuts down gracefully and checks the server ended cleanly.
    async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let result = tokio::time::timeout(TIMEOUT, &mut self.task)
            .await
            .expect("mock stops in time")
            .expect("serve task did not panic");
        result.expect("serve ended without error");
    }

    /// Every batch the sink holds now.
    fn drain_events(&mut self) -> Vec<EngineEvent> {
        let mut out = Vec::new();
        while let Ok(batch) = self.events.try_recv() {
            assert_eq!(batch.dp_rank, Some(0));
            assert!(!batch.events.is_empty(), "a batch is sent only for changes");
            out.extend(batch.events);
        }
        out
    }
}

/// The `data:` payloads of an SSE answer, in order.
async fn post_stream(addr: SocketAddr, path: &str, body: &Value) -> Vec<String> {
    let ex = request(addr, "POST", path, body.to_string().into_bytes()).await;
    assert_eq!(ex.response.status(), 200);
    assert_eq!(
        ex.response.headers()["content-type"],
        "text/event-stream",
        "SSE content type"
    );
    let (_, text) = body_of(ex).await;
    text.split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| {
            e.strip_prefix("data: ")
                .unwrap_or_else(|| panic!("SSE event without data: {e:?}"))
                .to_owned()
        })
        .collect()
}

fn assert_usage(usage: &Value, prompt: u64, completion: u64, cached: u64) {
    assert_eq!(usage["prompt_tokens"], prompt, "{usage}");
    assert_eq!(usage["completion_tokens"], completion, "{usage}");
    assert_eq!(usage["total_tokens"], prompt + completion, "{usage}");
    assert_eq!(
        usage["prompt_tokens_details"]["cached_tokens"], cached,
        "{usage}"
    );
}

/// What the engine model reports for a prompt whose complete blocks are all cached:
/// `min(blocks · block_size, prompt − 1)` (the last prompt token is always recomputed).
fn all_cached(prompt_tokens: u64, block_size: u64) -> u64 {
    (prompt_tokens / block_size * block_size).min(prompt_tokens - 1)
}

fn long_prompt(seed: &str, words: usize) -> String {
    let mut s = format!("{seed}:");
    for i in 0..words {
        s.push_str(&format!(" word{}", i % 97));
    }
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_non_streaming_and_streaming() {
    let mock = start(config(engine(4096, 16, 1000.0), true)).await;
    let prompt = "The quick brown fox jumps over the lazy dog.";
    let prompt_tokens = tokenizer().encode(prompt).expect("encode").len() as u64;

    let (status, body) = post(
        mock.addr,
        "/v1/completions",
        &json!({"model": MODEL, "prompt": prompt, "max_tokens": 5}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["object"], "text_completion");
    assert_eq!(body["model"], MODEL);
    assert_eq!(body["choices"][0]["text"], filler(0, 5));
    assert_eq!(body["choices"][0]["finish_reason"], "length");
    assert_usage(&body["usage"], prompt_tokens, 5, 0);
    // The filler's token count is the reported completion count.
    let text = body["choices"][0]["text"].as_str().expect("text");
    assert_eq!(tokenizer().encode(text).expect("encode").len(), 5);

    // Default max_tokens is 16.
    let (status, body) = post(mock.addr, "/v1/completions", &json!({"prompt": "hi"})).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["usage"]["completion_tokens"], 16);

    let events = post_stream(
        mock.addr,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 7, "stream": true,
                "stream_options": {"include_usage": true}}),
    )
    .await;
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).expect("chunk json"))
        .collect();
    let (usage_chunk, token_chunks) = chunks.split_last().expect("chunks");
    assert_eq!(token_chunks.len(), 7, "one chunk per token");
    let text: String = token_chunks
        .iter()
        .map(|c| c["choices"][0]["text"].as_str().expect("text").to_owned())
        .collect();
    assert_eq!(text, filler(0, 7));
    for (i, c) in token_chunks.iter().enumerate() {
        assert_eq!(c["object"], "text_completion");
        let want = if i == 6 { json!("length") } else { Value::Null };
        assert_eq!(c["choices"][0]["finish_reason"], want);
    }
    assert_eq!(usage_chunk["choices"], json!([]));
    // The same prompt again: its complete blocks were cached by the first request.
    let cached = all_cached(prompt_tokens, 16);
    assert_usage(&usage_chunk["usage"], prompt_tokens, 7, cached);

    // Without include_usage there is no usage chunk.
    let events = post_stream(
        mock.addr,
        "/v1/completions",
        &json!({"prompt": "x y z", "max_tokens": 2, "stream": true}),
    )
    .await;
    assert_eq!(events.len(), 3, "{events:?}");
    mock.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_non_streaming_and_streaming() {
    let mock = start(config(engine(4096, 16, 1000.0), true)).await;
    let messages = vec![
        ChatMessage::text("system", "You are terse."),
        ChatMessage::text("user", "Name three colours."),
    ];
    let prompt_tokens = tokenizer()
        .encode_chat(&messages, &ChatExtras::default(), None)
        .expect("template renders")
        .len() as u64;
    let body = json!({"model": MODEL, "messages": messages, "max_tokens": 4});
    let (status, resp) = post(mock.addr, "/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{resp}");
    assert_eq!(resp["object"], "chat.completion");
    assert_eq!(resp["choices"][0]["message"]["role"], "assistant");
    assert_eq!(resp["choices"][0]["message"]["content"], filler(0, 4));
    assert_eq!(resp["choices"][0]["finish_reason"], "length");
    assert_usage(&resp["usage"], prompt_tokens, 4, 0);

    // max_completion_tokens wins over max_tokens.
    let events = post_stream(
        mock.addr,
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": 9, "max_completion_tokens": 3,
                "stream": true, "stream_options": {"include_usage": true}}),
    )
    .await;
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).expect("chunk json"))
        .collect();
    assert_eq!(
        chunks.len(),
        4,
        "3 token chunks and a usage chunk: {chunks:?}"
    );
    assert_eq!(chunks[0]["object"], "chat.completion.chunk");
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = chunks[..3]
        .iter()
        .map(|c| {
            c["choices"][0]["delta"]["content"]
                .as_str()
                .expect("content")
                .to_owned()
        })
        .collect();
    assert_eq!(text, filler(0, 3));
    assert_eq!(chunks[2]["choices"][0]["finish_reason"], "length");
    let cached = all_cached(prompt_tokens, 16);
    assert_usage(&chunks[3]["usage"], prompt_tokens, 3, cached);
    mock.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeated_prompts_hit_the_prefix_cache() {
    let mock = start(config(engine(4096, 16, 1000.0), true)).await;
    // A prompt whose length is not a multiple of the block size (see `all_cached`).
    let mut words = 120;
    let (prompt, n) = loop {
        let prompt = long_prompt("first", words);
        let n = tokenizer().encode(&prompt).expect("encode").len() as u64;
        if !n.is_multiple_of(16) {
            break (prompt, n);
        }
        words += 1;
    };
    assert!(n > 100, "prompt of {n} tokens");
    let req = json!({"prompt": prompt, "max_tokens": 2});
    let (_, first) = post(mock.addr, "/v1/completions", &req).await;
    assert_usage(&first["usage"], n, 2, 0);
    let (_, second) = post(mock.addr, "/v1/completions", &req).await;
    let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .expect("cached_tokens");
    assert!(
        cached > 0 && cached.is_multiple_of(16) && cached < n,
        "cached {cached} of {n}"
    );
    assert_eq!(cached, all_cached(n, 16), "every complete block is a hit");

    let other = long_prompt("second", 120);
    let (_, third) = post(
        mock.addr,
        "/v1/completions",
        &json!({"prompt": other, "max_tokens": 2}),
    )
    .await;
    assert_eq!(third["usage"]["prompt_tokens_details"]["cached_tokens"], 0);

    let (status, metrics) = get(mock.addr, "/metrics").await;
    assert_eq!(status, 200);
    assert!(
        metrics.contains("vllm:cache_config_info{block_size=\"16\""),
        "{metrics}"
    );
    assert!(metrics.contains(&format!(
        "infera_mock_requests_total{{model_name=\"{MODEL}\"}} 3"
    )));
    assert!(metrics.contains(&format!(
        "vllm:prefix_cache_hits_total{{model_name=\"{MODEL}\"}} {cached}"
    )));
    assert!(metrics.contains("vllm:num_requests_running"));
    assert!(metrics.contains("vllm:kv_cache_usage_perc"));
    mock.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_id_prompts_and_their_kv_events() {
    let mut mock = start(config(engine(4096, 16, 1000.0), false)).await;
    let prompt: Vec<u32> = (1000..1040).collect();
    let (status, body) = post(
        mock.addr,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 3}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_usage(&body["usage"], 40, 3, 0);
    // A one-element batch holding the ids is accepted too, and hits the cache.
    let (_, again) = post(
        mock.addr,
        "/v1/completions",
        &json!({"prompt": [prompt], "max_tokens": 1}),
    )
    .await;
    assert_usage(&again["usage"], 40, 1, 32);

    // The two complete blocks were stored once, with their tokens and chained parents.
    let events = mock.drain_events();
    let router = hash_blocks(&prompt, 16, None);
    let engine: Vec<EngineHash> = router
        .iter()
        .map(|h| EngineHash::from_u64(h.0 ^ SALT))
        .collect();
    let mut stored: Vec<(EngineHash, Option<EngineHash>, Vec<u32>)> = Vec::new();
    for ev in &events {
        if let EngineEvent::BlockStored {
            block_hashes,
            parent,
            token_ids,
            block_size,
            tier,
            lora_id,
            lora_name,
            extra_keys,
            cache_salt: _,
            indexable,
        } = ev
        {
            assert_eq!(
                (*block_size, *tier, *lora_id, *indexable),
                (16, Tier::Gpu, None, true)
            );
            // A plain-text request: no adapter, and no keys on any block (vLLM's `nil`s).
            assert_eq!((lora_name, extra_keys), (&None, &None));
            assert_eq!(token_ids.len(), block_hashes.len() * 16);
            let mut parent = *parent;
            for (i, h) in block_hashes.iter().enumerate() {
                stored.push((*h, parent, token_ids[i * 16..(i + 1) * 16].to_vec()));
                parent = Some(*h);
            }
        }
    }
    assert_eq!(
        stored,
        vec![
            (engine[0], None, prompt[..16].to_vec()),
            (engine[1], Some(engine[0]), prompt[16..32].to_vec()),
        ]
    );
    // What the sink got encodes as vLLM does and decodes back to the same events.
    let batch = EngineBatch {
        ts: 1.5,
        dp_rank: Some(0),
        events,
        ..EngineBatch::default()
    };
    let decoded = decode_batch(&encode_batch_vllm(&batch)).expect("decodes");
    assert_eq!(decoded.events, batch.events);
    assert!(decoded.malformed.is_empty());
    mock.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tiny_cache_evicts_and_publishes_removals() {
    // 8 blocks of 4 tokens: the second prompt needs 6 blocks, so 2 of the first's 4 go.
    let mut mock = start(config(engine(8, 4, 1000.0), false)).await;
    let a: Vec<u32> = (1..=16).collect();
    let b: Vec<u32> = (101..=124).collect();
    let (s, _) = post(
        mock.addr,
        "/v1/completions",
        &json!({"prompt": a, "max_tokens": 1}),
    )
    .await;
    assert_eq!(s, 200);
    let (s, _) = post(
        mock.addr,
        "/v1/completions",
        &json!({"prompt": b, "max_tokens": 1}),
    )
    .await;
    assert_eq!(s, 200);
    let salted = |hs: Vec<BlockHash>| -> Vec<EngineHash> {
        hs.into_iter()
            .map(|h| EngineHash::from_u64(h.0 ^ SALT))
            .collect()
    };
    let a_hashes = salted(hash_blocks(&a, 4, None));
    let events = mock.drain_events();
    let removed: Vec<EngineHash> = events
        .iter()
        .filter_map(|e| match e {
            EngineEvent::BlockRemoved {
                block_hashes, tier, ..
            } => {
                assert_eq!(*tier, Tier::Gpu);
                Some(block_hashes.clone())
            }
            _ => None,
        })
        .flatten()
        .collect();
    // Leaves first: the first prompt's last two blocks.
    assert_eq!(removed, vec![a_hashes[3], a_hashes[2]], "{events:?}");
    let stored_b = events.iter().any(
        |e| matches!(e, EngineEvent::BlockStored { token_ids, .. } if token_ids[..4] == b[..4]),
    );
    assert!(stored_b, "{events:?}");

    // A request that can never fit is a 400, not a hang.
    let huge: Vec<u32> = (0..64).collect();
    let (s, body) = post(mock.addr, "/v1/completions", &json!({"prompt": huge})).await;
    assert_eq!(s, 400, "{body}");
    mock.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_openai_errors() {
    let mock = start(config(engine(4096, 16, 1000.0), false)).await;
    let check = |status: u16, body: &Value, want: u16| {
        assert_eq!(status, want, "{body}");
        assert_eq!(body["error"]["code"], want, "{body}");
        assert!(
            body["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "{body}"
        );
        assert!(body["error"]["type"].is_string(), "{body}");
    };
    let (s, b) = post_raw(mock.addr, "/v1/completions", b"{\"prompt\": ".to_vec()).await;
    check(s, &b, 400);
    let (s, b) = post(
        mock.addr,
        "/v1/completions",
        &json!({"prompt": "hi", "max_tokens": "many"}),
    )
    .await;
    check(s, &b, 400);
    let (s, b) = post(
        mock.addr,
        "/v1/completions",
        &json!({"prompt": {"text": "hi"}}),
    )
    .await;
    check(s, &b, 400);
    let (s, b) = post(
        mock.addr,
        "/v1/completions",
        &json!({"prompt": "hi", "max_tokens": 0}),
    )
    .await;
    check(s, &b, 400);
    let (s, b) = post(
        mock.addr,
        "/v1/completions",
        &json!({"prompt": "hi", "stream": "yes"}),
    )
    .await;
    check(s, &b, 400);
    let (s, b) = post(mock.addr, "/v1/completions", &json!({"max_tokens": 3})).await;
    check(s, &b, 400);
    let (s, b) = post(
        mock.addr,
        "/v1/chat/completions",
        &json!({"messages": "hello"}),
    )
    .await;
    check(s, &b, 400);
    let (s, b) = post(
        mock.addr,
        "/v1/chat/completions",
        &json!({"messages": [{"content": "no role"}]}),
    )
    .await;
    check(s, &b, 400);
    let (s, b) = post(
        mock.addr,
        "/v1/completions",
        &json!({"model": "other", "prompt": "hi"}),
    )
    .await;
    check(s, &b, 404);
    let huge = json!({"prompt": "x".repeat(200 << 10)});
    let (s, b) = post(mock.addr, "/v1/completions", &huge).await;
    check(s, &b, 413);

    // The server is still fine, and says so.
    let (s, health) = get(mock.addr, "/health").await;
    assert_eq!(
        (s, serde_json::from_str::<Value>(&health).expect("json")),
        (200, json!({"status": "ok"}))
    );
    let (s, models) = get(mock.addr, "/v1/models").await;
    assert_eq!(s, 200);
    let models: Value = serde_json::from_str(&models).expect("json");
    assert_eq!(models["data"][0]["id"], MODEL);
    let (s, metrics) = get(mock.addr, "/metrics").await;
    assert_eq!(s, 200);
    assert!(
        metrics.contains(&format!(
            "infera_mock_http_errors_total{{model_name=\"{MODEL}\"}} 10"
        )),
        "{metrics}"
    );
    mock.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_disconnects_mid_stream_does_not_wedge_the_server() {
    // Slow enough (about 1 ms per decode step) that the stream is still running when dropped.
    let mock = start(config(engine(4096, 16, 5.0), false)).await;
    let mut ex = request(
        mock.addr,
        "POST",
        "/v1/completions",
        json!({"prompt": "a long story", "max_tokens": 2000, "stream": true})
            .to_string()
            .into_bytes(),
    )
    .await;
    assert_eq!(ex.response.status(), 200);
    let first = tokio::time::timeout(TIMEOUT, ex.response.body_mut().frame())
        .await
        .expect("first chunk in time")
        .expect("a frame")
        .expect("frame ok");
    let first = first.into_data().expect("data frame");
    assert!(first.starts_with(b"data: {"), "{first:?}");
    drop(ex);

    let (status, body) = post(
        mock.addr,
        "/v1/completions",
        &json!({"prompt": "next", "max_tokens": 3}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["usage"]["completion_tokens"], 3);
    // The abandoned request was aborted in the engine (not left decoding 2000 tokens).
    let (_, metrics) = get(mock.addr, "/metrics").await;
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("infera_mock_requests_detached_total{") && l.ends_with(" 1")),
        "{metrics}"
    );
    mock.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registration_names_the_mock_and_its_capacity() {
    let server = MockServer::bind("127.0.0.1:0", config(engine(64, 16, 1.0), false), None)
        .await
        .expect("binds");
    let extra = server.registration_extra();
    assert_eq!(extra["mock"], true);
    assert_eq!(extra["kv_capacity_blocks"], 64);
    // Its prefill speed at its step budget, from its timing model (the router weighs loading a
    // block from kvd against it).
    let speed = extra["prefill_tokens_per_s"].as_f64().expect("a speed");
    let timing = infera_core::engine::TimingModel::default();
    let budget = u64::from(engine(64, 16, 1.0).max_batched_tokens);
    let expected = budget as f64 * 1000.0 / timing.prefill_ms(budget);
    assert!(
        (speed - expected).abs() < 1e-6 * expected,
        "{speed} vs {expected}"
    );
    // The record's own fields are not repeated in its extra map.
    assert!(!extra.contains_key("engine") && !extra.contains_key("kv_block_size"));
    // Shutting down with nothing in flight returns at once.
    server.serve(async {}).await.expect("stops cleanly");

    let bad = MockConfig::new(MODEL, engine(0, 16, 1.0));
    let err = MockServer::bind("127.0.0.1:0", bad, None)
        .await
        .expect_err("invalid config");
    assert!(err.to_string().contains("gpu_blocks"), "{err}");
}

/// Stored blocks by key: their bytes and retention.
type Blocks = std::collections::HashMap<Vec<u8>, (Vec<u8>, Retention)>;

/// An in-memory block store; with `fail` set every call fails, as a daemon that went away.
#[derive(Debug, Default)]
struct MemStore {
    blocks: std::sync::Mutex<Blocks>,
    fail: std::sync::atomic::AtomicBool,
}

impl MemStore {
    fn check(&self, ns: &BlockNamespace) -> Result<(), BlockStoreError> {
        assert_eq!((ns.model.as_str(), ns.compat_key.as_str()), (MODEL, ""));
        if self.fail.load(std::sync::atomic::Ordering::Relaxed) {
            return Err(BlockStoreError::Unavailable("the daemon went away".into()));
        }
        Ok(())
    }
}

#[async_trait::async_trait]
impl KvBlockStore for MemStore {
    async fn exists(
        &self,
        ns: &BlockNamespace,
        keys: &[Vec<u8>],
    ) -> Result<Vec<bool>, BlockStoreError> {
        self.check(ns)?;
        let blocks = self.blocks.lock().expect("store lock");
        Ok(keys.iter().map(|k| blocks.contains_key(k)).collect())
    }

    async fn get(
        &self,
        ns: &BlockNamespace,
        keys: &[Vec<u8>],
    ) -> Result<Vec<Option<Vec<u8>>>, BlockStoreError> {
        self.check(ns)?;
        let blocks = self.blocks.lock().expect("store lock");
        Ok(keys
            .iter()
            .map(|k| blocks.get(k).map(|(v, _)| v.clone()))
            .collect())
    }

    async fn set(
        &self,
        ns: &BlockNamespace,
        stored: Vec<StoredBlock>,
        retention: Retention,
    ) -> Result<usize, BlockStoreError> {
        self.check(ns)?;
        let n = stored.len();
        let mut blocks = self.blocks.lock().expect("store lock");
        for b in stored {
            blocks.insert(b.key, (b.value, retention));
        }
        Ok(n)
    }
}

fn metric_of(metrics: &str, name: &str) -> u64 {
    let series = format!("{name}{{model_name=\"{MODEL}\"}} ");
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(&series)?.parse().ok())
        .unwrap_or_else(|| panic!("{series} in {metrics}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mocks_share_prefixes_through_a_block_store_and_its_failures_cost_only_the_hit() {
    let store = Arc::new(MemStore::default());
    let with_store = || {
        let mut c = config(engine(4096, 16, 1000.0), true);
        c.kv_store = Some(MockKvStore {
            store: Arc::clone(&store) as Arc<dyn KvBlockStore>,
            compat_key: String::new(),
        });
        c
    };
    let (a, b) = (start(with_store()).await, start(with_store()).await);

    // A streamed request on A saves its complete blocks (keys: the connectors' SHA-256 chain)
    // before its stream ends.
    let prompt = long_prompt("shared", 130);
    let tokens = tokenizer().encode(&prompt).expect("encode");
    let n = tokens.len() as u64;
    let body = json!({"prompt": prompt, "max_tokens": 2, "stream": true});
    post_stream(a.addr, "/v1/completions", &body).await;
    let keys = block_keys(&tokens, 16);
    {
        let blocks = store.blocks.lock().unwrap();
        assert_eq!(blocks.len(), keys.len());
        for (i, key) in keys.iter().enumerate() {
            let (value, retention) = &blocks[key];
            assert_eq!(value, &block_value(&tokens[i * 16..(i + 1) * 16]));
            assert_eq!(*retention, Retention::Long);
        }
    }

    // B has none of it on its GPU: every complete block comes from the store.
    let req = json!({"prompt": prompt, "max_tokens": 2});
    let (_, on_b) = post(b.addr, "/v1/completions", &req).await;
    assert_usage(&on_b["usage"], n, 2, all_cached(n, 16));
    let (_, metrics) = get(b.addr, "/metrics").await;
    assert_eq!(
        metric_of(&metrics, "infera_mock_kvd_hit_tokens_total"),
        all_cached(n, 16)
    );

    // Wrong bytes under a key are a miss, never a hit; the retention asked for is kept.
    let other = long_prompt("corrupt", 130);
    let mut short = json!({"prompt": other, "max_tokens": 2});
    short["kv_transfer_params"] = json!({"infera_retention": "short"});
    post(a.addr, "/v1/completions", &short).await;
    let first = block_keys(&tokenizer().encode(&other).unwrap(), 16).remove(0);
    {
        let mut blocks = store.blocks.lock().unwrap();
        let entry = blocks.get_mut(&first).unwrap();
        assert_eq!(entry.1, Retention::Short);
        entry.0[0] ^= 1;
    }
    let (_, corrupt) = post(
        b.addr,
        "/v1/completions",
        &json!({"prompt": other, "max_tokens": 2}),
    )
    .await;
    assert_eq!(
        corrupt["usage"]["prompt_tokens_details"]["cached_tokens"],
        0
    );

    // A store that fails: the request is served without it, and the failure is counted.
    store.fail.store(true, std::sync::atomic::Ordering::Relaxed);
    let third = long_prompt("down", 130);
    let (status, down) = post(
        b.addr,
        "/v1/completions",
        &json!({"prompt": third, "max_tokens": 2}),
    )
    .await;
    assert_eq!(status, 200, "{down}");
    assert_eq!(down["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let (_, metrics) = get(b.addr, "/metrics").await;
    assert!(metric_of(&metrics, "infera_mock_kvd_errors_total") >= 1);
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_ids_are_reported_on_request_and_a_prompt_of_them_is_continued() {
    let mock = start(config(engine(4096, 16, 1e6), true)).await;
    let prompt = "Tell me something:";
    let prompt_ids = tokenizer().encode(prompt).expect("encode");
    let events = post_stream(
        mock.addr,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 4, "stream": true, "return_token_ids": true}),
    )
    .await;
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).expect("chunk json"))
        .collect();
    assert_eq!(chunks.len(), 4);
    assert_eq!(chunks[0]["prompt_token_ids"], json!(prompt_ids));
    assert!(
        chunks[1].get("prompt_token_ids").is_none(),
        "first chunk only"
    );
    let mut generated = Vec::new();
    for c in &chunks {
        let text = c["choices"][0]["text"].as_str().expect("text");
        let ids: Vec<u32> =
            serde_json::from_value(c["choices"][0]["token_ids"].clone()).expect("each chunk's ids");
        assert_eq!(tokenizer().encode(text).expect("encode"), ids, "{text}");
        generated.extend(ids);
    }
    // The prompt's ids and the ids generated so far, as a token prompt: the answer goes on
    // where it stopped, as a migrated stream's continuation does.
    let mut carried = prompt_ids;
    carried.extend(&generated);
    let (status, body) = post(
        mock.addr,
        "/v1/completions",
        &json!({"prompt": carried, "max_tokens": 3, "return_token_ids": true}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["choices"][0]["text"], filler(4, 7));
    assert_eq!(body["prompt_token_ids"], json!(carried));
    // Without the field, none of it.
    let (_, plain) = post(
        mock.addr,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 2}),
    )
    .await;
    assert!(
        plain.get("prompt_token_ids").is_none() && plain["choices"][0].get("token_ids").is_none()
    );
}
