//! Workers whose engines merge their own chat template defaults (SGLang's
//! `--default-chat-template-kwargs`) before rendering: the server asks each SGLang worker at
//! registration (`GET /get_server_info`) and hashes chats for it the way it renders them, so
//! its cache is found (`--kv-per-worker-template-kwargs`, on by default); turned off, the
//! fleet's rendering never matches that worker's blocks.
//!
//! The model's template here renders a marker when `thinking` is set, right after the BOS token,
//! so the two renderings of one chat share no block.

mod common;

use common::fleet::{Front, MODEL, Mock, options, record};
use common::{get, post};
use infera_adapters::server::ServerState;
use infera_adapters::tokenize::{TemplateKwargs, Tokenizer};
use infera_core::event::Engine;
use infera_core::policy::PolicyKind;
use serde_json::{Value, json};
use std::path::Path;
use std::sync::Arc;

/// The fixture tokenizer with a chat template that reads the `thinking` kwarg.
fn thinking_tokenizer(dir: &Path) -> Arc<Tokenizer> {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/tokenizers/deepseek-v4");
    std::os::unix::fs::symlink(fixture.join("tokenizer.json"), dir.join("tokenizer.json"))
        .expect("link the tokenizer");
    let mut config: Value = serde_json::from_slice(
        &std::fs::read(fixture.join("tokenizer_config.json")).expect("fixture config"),
    )
    .expect("fixture config is JSON");
    config["chat_template"] = json!(
        "{{ bos_token }}{% if thinking %}[deliberate step by step]{% endif %}\
         {% for m in messages %}{{ '<｜' + m['role'] + '｜>' + m['content'] }}{% endfor %}\
         {% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"
    );
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).expect("write config");
    Arc::new(Tokenizer::from_path(dir).expect("tokenizer loads"))
}

fn chat() -> Value {
    let system: String = (0..400).map(|i| format!(" rule{}", i % 89)).collect();
    json!({"model": MODEL, "max_tokens": 2, "messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": "Which rule comes first?"},
    ]})
}

/// The sum of the picked workers' cached blocks over every decision so far.
async fn picked_cache_blocks(front: &Front) -> f64 {
    let (_, text) = get(front.addr, "/metrics").await;
    text.lines()
        .filter_map(|l| l.strip_prefix("infera_router_pick_cache_hits_sum"))
        .filter_map(|rest| rest.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Mock `plain` renders as the fleet does; `thinking` merges `{"thinking": true}` first and
/// already holds the chat's blocks. Returns the server's decision: the cached blocks it
/// picked, and what the routed request found cached.
async fn route_once(per_worker: bool) -> (f64, u64) {
    let dir = tempfile::tempdir().expect("temp dir");
    let tokenizer = thinking_tokenizer(dir.path());
    let plain = {
        let tokenizer = tokenizer.clone();
        Mock::start_configured(move |c| c.tokenizer = Some(tokenizer)).await
    };
    let mut thinking = {
        let tokenizer = tokenizer.clone();
        Mock::start_configured(move |c| {
            c.tokenizer = Some(tokenizer);
            c.chat_template_defaults = TemplateKwargs::from([("thinking".to_owned(), true.into())]);
        })
        .await
    };
    // The `thinking` worker computes the chat once, by itself.
    let (status, direct) = post(thinking.addr, "/v1/chat/completions", &chat()).await;
    assert_eq!(status, 200, "{direct}");

    let mut opts = options(PolicyKind::KV_AWARE, 0, false);
    opts.per_worker_template_kwargs = per_worker;
    let front = Front::serve(ServerState::new(opts, tokenizer)).await;
    for mock in [&plain, &thinking] {
        let record = infera_core::event::WorkerRecord {
            engine: Engine::Sglang,
            ..record(mock.addr)
        };
        front.state.register_worker(record.clone());
        front.state.probe_render_variant(&record).await;
    }
    assert!(thinking.feed(&front.state) > 0, "the worker's KV events");

    let (status, routed) = post(front.addr, "/v1/chat/completions", &chat()).await;
    assert_eq!(status, 200, "{routed}");
    let cached = routed["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or_else(|| panic!("cached_tokens in {routed}"));
    let picked = picked_cache_blocks(&front).await;
    front.stop().await;
    plain.stop().await;
    thinking.stop().await;
    (picked, cached)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_with_its_own_template_defaults_is_hashed_its_way_and_found() {
    let (picked, cached) = route_once(true).await;
    assert!(
        picked >= 10.0,
        "the router saw the worker's cached blocks: {picked}"
    );
    assert!(
        cached > 0,
        "the routed chat hit that worker's prefix cache: {cached}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_probe_the_fleets_rendering_finds_nothing() {
    let (picked, _) = route_once(false).await;
    assert_eq!(
        picked, 0.0,
        "hashed the fleet's way, no worker's blocks match"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mock_reports_its_defaults_as_sglang_does() {
    let plain = Mock::start().await;
    let thinking = Mock::start_configured(|c| {
        c.chat_template_defaults = TemplateKwargs::from([("thinking".to_owned(), true.into())]);
    })
    .await;
    let info = |text: String| serde_json::from_str::<Value>(&text).expect("JSON");
    let (status, text) = get(plain.addr, "/get_server_info").await;
    assert_eq!(status, 200);
    assert_eq!(info(text)["default_chat_template_kwargs"], Value::Null);
    let (_, text) = get(thinking.addr, "/get_server_info").await;
    assert_eq!(
        info(text)["default_chat_template_kwargs"],
        json!({"thinking": true})
    );
    plain.stop().await;
    thinking.stop().await;
}
