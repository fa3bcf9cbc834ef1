//! One fleet, several adapters and tenants, end to end with the real binaries: a real etcd, two
//! `infera worker mock` processes serving a LoRA adapter (`--lora-modules`, listed in their
//! `/v1/models` and registered by the launcher) and publishing vLLM's KV events with the
//! adapter's and the salt's `extra_keys`, and `infera server` routing among them.
//!
//! What a user relies on: the server lists and serves the adapter; an adapter's conversation
//! stays on the worker that holds its prefix; the same tokens under the base model, or under
//! another cache salt, are never predicted to hit the adapter's or the other salt's blocks; an
//! adapter loaded at run time is routed once the launcher sees it; an unknown name is a 404 that
//! says what is served.
#![allow(clippy::unwrap_used)]

mod common;

use common::{
    cached_blocks, eventually, free_mock_port, free_port, get_json, http, metric, mock_worker,
    predicted_hits, server, tokenizer_dir,
};
use infera_backends::testing::EtcdServer;
use serde_json::{Value, json};

/// A completion of `prompt` for `model` (with `extra` body fields): the prompt tokens the
/// engine served from its cache.
fn complete(port: u16, model: &str, prompt: &str, extra: Value) -> u64 {
    let mut body = json!({"model": model, "prompt": prompt, "max_tokens": 2});
    if let (Some(body), Some(extra)) = (body.as_object_mut(), extra.as_object()) {
        body.extend(extra.clone());
    }
    let (status, text) = http(port, "POST", "/v1/completions", &body.to_string()).unwrap();
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(
        v["model"], model,
        "the engine answers under the requested name"
    );
    v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0)
}

/// A prompt of `words` words named after `tag`.
fn text(tag: &str, words: usize) -> String {
    (0..words).map(|i| format!(" {tag}{}", i % 61)).collect()
}

/// Completes, then waits until the index holds more blocks than before (the KV events of that
/// request arrived), so the next decision sees them.
fn complete_indexed(port: u16, model: &str, prompt: &str, extra: Value) -> u64 {
    let before: u64 = cached_blocks(port).iter().sum();
    let cached = complete(port, model, prompt, extra);
    eventually("the request's KV events in the index", || {
        cached_blocks(port).iter().sum::<u64>() > before
    });
    cached
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adapters_and_salts_are_routed_on_their_own_cache_only() {
    let etcd = EtcdServer::start().await.expect("etcd starts");
    let tok = tokenizer_dir();
    let tok = tok.as_str();
    let flags = ["--speedup", "1000", "--lora-modules", "sql=/adapters/sql"];
    let ports = [free_mock_port(), free_mock_port()];
    let _workers: Vec<_> = ports
        .iter()
        .map(|&p| mock_worker(tok, &etcd.endpoint(), p, &flags))
        .collect();
    let port = free_port();
    let _server = server(tok, &etcd.endpoint(), port, &[]);

    // The launchers read the adapter from their engines' /v1/models and register it.
    eventually("the server to list the adapter of both workers", || {
        get_json(port, "/health").is_some_and(|h| h["active_workers"] == 2)
            && get_json(port, "/v1/models").is_some_and(|m| {
                m["data"]
                    .as_array()
                    .is_some_and(|d| d.iter().any(|e| e["id"] == "sql" && e["parent"] == tok))
            })
    });
    let (status, body) = http(
        port,
        "POST",
        "/v1/completions",
        &json!({"model": "nope", "prompt": "x", "max_tokens": 1}).to_string(),
    )
    .unwrap();
    assert_eq!(status, 404, "{body}");
    assert!(body.contains("sql") && body.contains(tok), "{body}");

    // ZeroMQ subscribers miss what an engine publishes before they joined: distinct prompts
    // until both workers' events reach the index.
    let mut n = 0;
    eventually("both workers' KV events to reach the index", || {
        n += 1;
        complete(port, tok, &text(&format!("warm{n}x"), 120), json!({}));
        let blocks = cached_blocks(port);
        blocks.len() == 2 && blocks.iter().all(|&b| b > 0)
    });

    // An adapter's conversation: each turn extends the last; the engine serves the history
    // from its cache when the router sent the turn where the history is.
    let mut history = text("sqlconv", 100);
    let mut hits = 0;
    for turn in 0..6 {
        history.push_str(&text(&format!("t{turn}q"), 40));
        if complete_indexed(port, "sql", &history, json!({})) > 0 {
            hits += 1;
        }
    }
    assert!(hits >= 5, "{hits} of 6 adapter turns hit their cache");
    // Each model's traffic and cache hits are its own in the per-model families.
    let of = |family: &str, model: &str| metric(port, &format!("{family}{{model=\"{model}\""));
    assert_eq!(of("infera_model_requests_total", "sql"), Some(6));
    let sql_blocks = of("infera_model_prompt_blocks_total", "sql").unwrap();
    let sql_hits = of("infera_model_predicted_cached_blocks_total", "sql").unwrap();
    assert!(
        sql_hits > 0 && sql_hits < sql_blocks,
        "{sql_hits} of {sql_blocks}"
    );
    assert!(of("infera_model_time_to_first_byte_seconds_count", "sql") == Some(6));
    assert!(
        of("infera_model_requests_total", tok).unwrap() > 0,
        "the base model's own"
    );

    // The same tokens under the base model: the adapter's blocks are not the base model's, in
    // the engine (nothing cached) and in the router (nothing predicted).
    let predicted = predicted_hits(port);
    assert_eq!(complete(port, tok, &history, json!({})), 0);
    assert_eq!(
        predicted_hits(port),
        predicted,
        "no hit predicted across adapters"
    );

    // Two tenants' salts: one tenant's second request hits, the other's same prompt does not.
    let shared = text("salted", 150);
    complete_indexed(port, tok, &shared, json!({"cache_salt": "tenant-a"}));
    let predicted = predicted_hits(port);
    assert!(complete(port, tok, &shared, json!({"cache_salt": "tenant-a"})) > 0);
    assert!(
        predicted_hits(port) > predicted,
        "the same salt predicts its hit"
    );
    let predicted = predicted_hits(port);
    assert_eq!(
        complete(port, tok, &shared, json!({"cache_salt": "tenant-b"})),
        0
    );
    assert_eq!(
        predicted_hits(port),
        predicted,
        "no hit predicted across salts"
    );

    // An adapter loaded at run time on one engine is routed there once its launcher re-reads
    // the engine's models (every 10 s).
    let (status, body) = http(
        ports[1],
        "POST",
        "/v1/load_lora_adapter",
        &json!({"lora_name": "chat", "lora_path": "/adapters/chat"}).to_string(),
    )
    .unwrap();
    assert_eq!(status, 200, "{body}");
    let chat = json!({"model": "chat", "prompt": "hello", "max_tokens": 1}).to_string();
    eventually("the loaded adapter to be routed", || {
        let (status, body) = http(port, "POST", "/v1/completions", &chat).unwrap();
        assert!(status == 200 || status == 404, "{status}: {body}");
        status == 200
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adapter_nobody_serves_is_loaded_on_demand_with_the_flag() {
    let etcd = EtcdServer::start().await.expect("etcd starts");
    let tok = tokenizer_dir();
    let tok = tok.as_str();
    let ports = [free_mock_port(), free_mock_port()];
    let _workers: Vec<_> = ports
        .iter()
        .map(|&p| mock_worker(tok, &etcd.endpoint(), p, &["--speedup", "1000"]))
        .collect();
    let port = free_port();
    let flags = ["--lora-load-path", "/adapters/{name}"];
    let _server = server(tok, &etcd.endpoint(), port, &flags);
    eventually("both workers to be routed", || {
        get_json(port, "/health").is_some_and(|h| h["active_workers"] == 2)
    });
    // A name that could leave the path template is never loaded: the usual 404.
    let escape = json!({"model": "../etc", "prompt": "x", "max_tokens": 1}).to_string();
    let (status, body) = http(port, "POST", "/v1/completions", &escape).unwrap();
    assert_eq!(status, 404, "{body}");

    // The first request loads the adapter on one worker, and is served under it.
    assert_eq!(complete(port, "fresh", &text("fresh", 80), json!({})), 0);
    let holders: Vec<u16> = ports
        .iter()
        .copied()
        .filter(|&p| {
            get_json(p, "/v1/models").is_some_and(|m| {
                m["data"]
                    .as_array()
                    .is_some_and(|d| d.iter().any(|e| e["id"] == "fresh"))
            })
        })
        .collect();
    assert_eq!(holders.len(), 1, "loaded on exactly one worker");
    let listed = get_json(port, "/v1/models").unwrap();
    assert!(
        listed["data"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["id"] == "fresh" && e["parent"] == tok),
        "{listed}"
    );
    // Later requests for it go to that worker: the only one that serves it.
    for turn in 0..3 {
        complete(port, "fresh", &text(&format!("again{turn}"), 40), json!({}));
    }
    let requests = |p: u16| metric(p, "infera_mock_requests_total").unwrap_or(0);
    let other = ports.iter().copied().find(|&p| p != holders[0]).unwrap();
    assert_eq!((requests(holders[0]), requests(other)), (4, 0));
}
