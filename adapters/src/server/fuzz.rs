//! Property tests of every parser that takes a client's bytes: the OpenAI bodies (completions
//! and chat, [`super::body::parse`]), the Anthropic Messages translation
//! ([`super::anthropic::to_chat`]) and its stream translator, and the prewarm keys
//! ([`super::prewarm::hex_key`]). Whatever arrives — random bytes,
//! random JSON, a valid body with a field replaced by a random value — the answer is a value or
//! a client error (4xx) naming the problem; never a panic, never a 5xx.

use super::anthropic::{SseTranslator, to_chat};
use super::body::{Shape, parse};
use super::prewarm::hex_key;
use axum::body::Bytes;
use infera_core::event::Retention;
use proptest::prelude::*;
use serde_json::{Map, Value, json};

/// Any JSON value, a few levels deep.
fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(Value::from),
        ".{0,12}".prop_map(Value::from),
    ];
    leaf.prop_recursive(3, 24, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::btree_map("[a-z_]{1,8}", inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect::<Map<_, _>>())),
        ]
    })
}

/// A valid body of each shape, with one of its fields (or a new one) set to `value`.
fn mutated(shape: Shape, key: usize, value: Value) -> Bytes {
    let mut body = match shape {
        Shape::Prompt => json!({"model": "m", "prompt": [1, 2, 3], "max_tokens": 4}),
        Shape::Messages => json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
    };
    let keys = [
        "model",
        "prompt",
        "messages",
        "stream",
        "kv_transfer_params",
        "prompt_cache_retention",
        "session_id",
        "max_tokens",
    ];
    body[keys[key % keys.len()]] = value;
    Bytes::from(body.to_string())
}

fn assert_client_error(status: axum::http::StatusCode, message: &str) {
    assert!(status.is_client_error(), "{status}: {message}");
    assert!(!message.is_empty());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn random_bytes_are_parsed_or_refused_as_a_client_error(
        bytes in prop::collection::vec(any::<u8>(), 0..256),
        chat in any::<bool>(),
    ) {
        let shape = if chat { Shape::Messages } else { Shape::Prompt };
        if let Err(e) = parse(Bytes::from(bytes), shape, Retention::Long) {
            assert_client_error(e.status, &e.message);
        }
    }

    #[test]
    fn a_field_of_any_value_is_parsed_or_refused_as_a_client_error(
        key in 0usize..8,
        value in json_value(),
        chat in any::<bool>(),
    ) {
        let shape = if chat { Shape::Messages } else { Shape::Prompt };
        match parse(mutated(shape, key, value), shape, Retention::Short) {
            // What is forwarded is still one JSON object.
            Ok(parsed) => {
                let forwarded: Value = serde_json::from_slice(&parsed.forward).unwrap();
                prop_assert!(forwarded.is_object());
            }
            Err(e) => assert_client_error(e.status, &e.message),
        }
    }

    #[test]
    fn any_messages_body_is_translated_or_refused_as_a_client_error(body in json_value()) {
        if let Err(e) = to_chat(&body) {
            assert_client_error(e.status, &e.message);
        }
    }

    #[test]
    fn any_engine_stream_translates_without_panicking(
        chunks in prop::collection::vec(prop::collection::vec(any::<u8>(), 0..64), 0..8),
    ) {
        let mut t = SseTranslator::new("m", "msg_1");
        for chunk in &chunks {
            let _ = t.push(chunk);
        }
        let _ = t.fail("the worker went away");
    }

    #[test]
    fn any_prewarm_key_decodes_to_its_bytes_or_is_refused(key in json_value(), hex in "(0x)?[0-9a-fA-F]{0,130}") {
        if let Err(e) = hex_key(0, &key) {
            assert_client_error(e.status, &e.message);
        }
        let digits = hex.trim_start_matches("0x");
        match hex_key(0, &Value::from(hex.clone())) {
            Ok(bytes) => prop_assert_eq!(bytes.len() * 2, digits.len()),
            Err(e) => {
                assert_client_error(e.status, &e.message);
                prop_assert!(digits.is_empty() || digits.len() % 2 == 1 || digits.len() > 128);
            }
        }
    }
}
