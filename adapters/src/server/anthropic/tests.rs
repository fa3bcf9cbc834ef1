use super::*;

#[test]
fn requests_become_chat_requests() {
    let body = json!({
        "model": "m", "max_tokens": 64, "system": [{"type": "text", "text": "Be brief."}],
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": [{"type": "text", "text": "Hello"}]},
            {"role": "user", "content": [{"type": "text", "text": "a "}, {"type": "text", "text": "b"}]}
        ],
        "stop_sequences": ["END"], "temperature": 0.5, "stream": true,
        "metadata": {"user_id": "u1"}
    });
    let chat = to_chat(&body).expect("valid");
    assert_eq!(
        chat["messages"],
        json!([
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "a b"}
        ])
    );
    assert_eq!(chat["stop"], json!(["END"]));
    assert_eq!(chat["max_tokens"], 64);
    assert_eq!(chat["user"], "u1");
    assert_eq!(chat["stream_options"], json!({"include_usage": true}));
}

#[test]
fn cache_control_becomes_a_retention_hint() {
    let with = |blocks: Value| {
        to_chat(&json!({"model": "m", "max_tokens": 1,
            "messages": [{"role": "user", "content": blocks}]}))
        .expect("valid")
        .get("prompt_cache_retention")
        .cloned()
    };
    let text = |cc: Value| json!([{"type": "text", "text": "x", "cache_control": cc}]);
    assert_eq!(
        with(text(json!({"type": "ephemeral"}))),
        Some(json!("short"))
    );
    assert_eq!(
        with(text(json!({"type": "ephemeral", "ttl": "1h"}))),
        Some(json!("long"))
    );
    assert_eq!(with(json!("plain")), None);
}

#[test]
fn unsupported_or_malformed_requests_name_the_field() {
    let cases = [
        (
            json!({"model": "m", "messages": []}),
            "`max_tokens` is required",
        ),
        (
            json!({"model": "m", "max_tokens": 0, "messages": []}),
            "max_tokens",
        ),
        (
            json!({"model": "m", "max_tokens": 5}),
            "`messages` must be an array",
        ),
        (
            json!({"model": "m", "max_tokens": 5, "messages": [{"role": "tool", "content": "x"}]}),
            "messages[0].role",
        ),
        (
            json!({"model": "m", "max_tokens": 5, "messages": [{"role": "user",
                "content": [{"type": "image", "source": {}}]}]}),
            "`messages[0].content[0].source` must be",
        ),
        (
            json!({"model": "m", "max_tokens": 5, "messages": [{"role": "user",
                "content": [{"type": "document", "source": {}}]}]}),
            "\"document\" block",
        ),
        (
            json!({"model": "m", "max_tokens": 5, "messages": [], "tools": [{}]}),
            "`tools`",
        ),
    ];
    for (body, needle) in cases {
        let err = to_chat(&body).expect_err("invalid");
        assert_eq!(err.status, StatusCode::BAD_REQUEST);
        assert!(err.message.contains(needle), "{needle}: {}", err.message);
    }
}

#[test]
fn image_blocks_become_image_url_parts_beside_the_text() {
    let body = json!({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "Compare"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}},
        {"type": "image", "source": {"type": "url", "url": "https://example.com/a.jpg"}}]}]});
    let chat = to_chat(&body).expect("translates");
    assert_eq!(
        chat["messages"][0]["content"],
        json!([
            {"type": "text", "text": "Compare"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
            {"type": "image_url", "image_url": {"url": "https://example.com/a.jpg"}},
        ])
    );
}

#[test]
fn answers_become_messages() {
    let chat = json!({
        "choices": [{"message": {"content": "Hi there"}, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 12, "completion_tokens": 2,
            "prompt_tokens_details": {"cached_tokens": 8}}
    });
    let m = message_of(&chat, "m", "msg_1");
    assert_eq!(m["content"], json!([{"type": "text", "text": "Hi there"}]));
    assert_eq!(m["stop_reason"], "max_tokens");
    assert_eq!(
        m["usage"],
        json!({"input_tokens": 12, "output_tokens": 2, "cache_read_input_tokens": 8})
    );
    let stopped = json!({"choices": [{"message": {"content": "x"}, "finish_reason": "stop",
        "stop_reason": "END"}]});
    assert_eq!(
        message_of(&stopped, "m", "i")["stop_reason"],
        "stop_sequence"
    );
    assert_eq!(message_of(&stopped, "m", "i")["stop_sequence"], "END");
}

/// The `(event, data)` pairs of a Messages stream.
fn events(text: &str) -> Vec<(String, Value)> {
    text.split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| {
            let mut lines = e.lines();
            let name = lines
                .next()
                .and_then(|l| l.strip_prefix("event: "))
                .unwrap_or("");
            let data = lines
                .next()
                .and_then(|l| l.strip_prefix("data: "))
                .unwrap_or("");
            (
                name.to_owned(),
                serde_json::from_str(data).expect("json data"),
            )
        })
        .collect()
}

#[test]
fn streams_are_translated_whatever_the_chunking() {
    let chat = "data: {\"choices\":[{\"delta\":{\"role\":\"assistant\"}}]}\n\n\
                data: {\"choices\":[{\"delta\":{\"content\":\"Hel\"}}]}\r\n\r\n\
                data: {\"choices\":[{\"delta\":{\"content\":\"lo\"},\"finish_reason\":\"stop\"}]}\n\n\
                data: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":2}}\n\n\
                data: [DONE]\n\n";
    for split in [1, 7, chat.len()] {
        let mut t = SseTranslator::new("m", "msg_x");
        let mut out = String::new();
        for piece in chat.as_bytes().chunks(split) {
            out.push_str(&t.push(piece));
        }
        let ev = events(&out);
        let names: Vec<&str> = ev.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "message_start",
                "content_block_start",
                "content_block_delta",
                "content_block_delta",
                "content_block_stop",
                "message_delta",
                "message_stop"
            ],
            "split {split}"
        );
        let text: String = ev
            .iter()
            .filter_map(|(_, d)| d.pointer("/delta/text").and_then(Value::as_str))
            .collect();
        assert_eq!(text, "Hello");
        assert_eq!(ev[5].1["delta"]["stop_reason"], "end_turn");
        assert_eq!(ev[5].1["usage"]["output_tokens"], 2);
    }
}

#[test]
fn a_failed_stream_ends_with_an_error_event() {
    let mut t = SseTranslator::new("m", "msg_x");
    let mut out = t.push(b"data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n");
    out.push_str(&t.push(
        b"data: {\"error\": {\"message\": \"worker stream failed: reset\"}}\n\ndata: [DONE]\n\n",
    ));
    let ev = events(&out);
    let last = ev.last().expect("events");
    assert_eq!(last.0, "error");
    assert_eq!(last.1["error"]["message"], "worker stream failed: reset");
    assert!(
        !ev.iter().any(|(n, _)| n == "message_stop"),
        "no clean end after a failure"
    );
    assert_eq!(t.push(b"data: garbage\n\n"), "", "nothing after the end");
}
