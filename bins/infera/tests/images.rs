//! Chats with images, end to end with the real binaries: a real etcd, two `infera worker mock`
//! processes serving a Qwen2-VL-shaped model (`fixtures/models/tiny-vl`: its config,
//! preprocessor config and a template that renders `<|image_pad|>` per image) and publishing vLLM's KV events with the images'
//! `[mm_hash, offset]` extra keys, and `infera server` routing among them.
//!
//! What a user relies on: a chat that repeats an image reaches the worker that holds the image's
//! KV; another image of the same size in the same place is never predicted to hit it.
#![allow(clippy::unwrap_used)]

mod common;

use base64::Engine as _;
use common::{
    cached_blocks, eventually, free_mock_port, free_port, get_json, http, metric, mock_worker,
    predicted_hits, server,
};
use infera_backends::testing::EtcdServer;
use serde_json::{Value, json};
use std::path::Path;

/// The tiny Qwen2-VL-shaped model of `fixtures/models/tiny-vl` (see its README).
fn vision_model() -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures/models/tiny-vl")
        .to_str()
        .unwrap()
        .to_owned()
}

/// A PNG data URL of a `width × height` image whose bytes differ by `seed` (its header and a
/// chunk of filler, which is all the router reads).
fn png(width: u32, height: u32, seed: u8) -> String {
    let mut bytes = b"\x89PNG\r\n\x1a\n\0\0\0\x0dIHDR".to_vec();
    bytes.extend(width.to_be_bytes());
    bytes.extend(height.to_be_bytes());
    bytes.extend([8, 2, 0, 0, 0, 0, 0, 0, 0]);
    bytes.extend(std::iter::repeat_n(seed, 4096));
    format!(
        "data:image/png;base64,{}",
        base64::engine::general_purpose::STANDARD.encode(bytes)
    )
}

/// A chat with `image` and `question`: the prompt tokens the engine served from its cache.
fn ask(port: u16, model: &str, image: &str, question: &str) -> u64 {
    let body = json!({"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": image}},
        {"type": "text", "text": question},
    ]}]});
    let (status, text) = http(port, "POST", "/v1/chat/completions", &body.to_string()).unwrap();
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0)
}

/// The KV blocks the server's index holds, summed over workers.
fn indexed(port: u16) -> u64 {
    cached_blocks(port).iter().sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_image_reaches_its_holder_and_another_image_never_looks_cached() {
    let etcd = EtcdServer::start().await.expect("etcd starts");
    let model = vision_model();
    let model = model.as_str();
    let ports = [free_mock_port(), free_mock_port()];
    let _workers: Vec<_> = ports
        .iter()
        .map(|&p| mock_worker(model, &etcd.endpoint(), p, &["--speedup", "1000"]))
        .collect();
    let port = free_port();
    let _server = server(model, &etcd.endpoint(), port, &[]);
    eventually("both workers to be routed", || {
        get_json(port, "/health").is_some_and(|h| h["active_workers"] == 2)
    });
    // ZeroMQ subscribers miss what an engine publishes before they joined: distinct images
    // until both workers' events reach the index.
    let mut n = 0u8;
    eventually("both workers' KV events to reach the index", || {
        n = n.wrapping_add(1);
        ask(port, model, &png(448, 448, n), "warm up");
        get_json(port, "/v1/workers").is_some_and(|w| {
            w["data"].as_array().is_some_and(|d| {
                d.len() == 2
                    && d.iter()
                        .all(|w| w["load"][0]["cached_blocks"].as_u64() > Some(0))
            })
        })
    });

    // A 1000 × 700 photo: 36 × 25 patches of 28 pixels, 900 tokens after the template's few
    // (a hit serves at least the whole blocks before the question).
    let photo = png(1000, 700, 200);
    let before = indexed(port);
    assert_eq!(ask(port, model, &photo, "What is in the picture?"), 0);
    eventually("the photo's KV events in the index", || {
        indexed(port) > before
    });
    // New chats about the same photo: the router predicts the image's blocks (55 of 16
    // tokens) on the worker that holds them, and the engine there serves them from its cache.
    let mut hits = 0;
    for q in 0..6 {
        let before = predicted_hits(port);
        let cached = ask(
            port,
            model,
            &photo,
            &format!("Question {q}: how many birds?"),
        );
        if cached >= 880 && predicted_hits(port) - before >= 55 {
            hits += 1;
        }
    }
    assert!(
        hits >= 5,
        "{hits} of 6 chats repeating the image hit its cache"
    );

    // Another photo of the same size in the same place: the same placeholder tokens, but
    // another image's blocks, in the engine (nothing cached) and in the router (nothing
    // predicted past the text before it).
    let before = predicted_hits(port);
    assert_eq!(
        ask(port, model, &png(1000, 700, 201), "What is in the picture?"),
        0
    );
    assert_eq!(
        predicted_hits(port),
        before,
        "no hit predicted across images"
    );

    // An image the router cannot see (a remote URL) is routed by load, and says so.
    let skipped = "infera_cache_locality_skipped_total{reason=\"multimodal\"";
    let skipped_before = metric(port, skipped).unwrap_or(0);
    let body = json!({"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
    ]}]});
    let (status, _) = http(port, "POST", "/v1/chat/completions", &body.to_string()).unwrap();
    assert_eq!(status, 200);
    assert_eq!(metric(port, skipped), Some(skipped_before + 1));
}
