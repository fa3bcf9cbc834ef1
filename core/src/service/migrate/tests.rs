use super::*;
use crate::event::Engine;
use crate::ids::RequestId;
use crate::service::test_support::{record, state};

fn migration(
    st: &Service,
    path: &'static str,
    body: Value,
    asked_ids: bool,
) -> Option<Box<Migration>> {
    let req = RouteRequest {
        request_id: RequestId::new("r#1.2"),
        model: "m".into(),
        prompt_tokens: 1,
        hashes: Vec::new(),
        retention: None,
        per_worker: Default::default(),
        exclude: Vec::new(),
        session: None,
        kvd: Vec::new(),
    };
    let body = Bytes::from(body.to_string());
    Migration::new(st, &req, path, &body, rank("w:1"), "r", asked_ids)
}

fn rank(worker: &str) -> WorkerRank {
    WorkerRank::new(worker, 0)
}

fn pass(m: &mut Migration, data: &[u8]) -> String {
    String::from_utf8(m.pass(Bytes::copy_from_slice(data)).to_vec()).expect("utf-8")
}

fn json_of(bytes: &Bytes) -> Value {
    serde_json::from_slice(bytes).expect("json body")
}

#[test]
fn a_chat_stream_is_read_across_chunks_and_its_text_continuation_rewritten() {
    let st = state();
    let body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 5, "stream": true});
    assert!(
        migration(&st, "/v1/chat/completions", body.clone(), false).is_none(),
        "off"
    );
    st.set_migration_limit(2);
    let mut m = migration(&st, "/v1/chat/completions", body, false).expect("movable");
    let first =
        br#"data: {"id":"c-1","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}

data: {"id":"c-1","choices":[{"index":0,"delta":{"content":"Hel"#;
    assert_eq!(
        pass(&mut m, first).as_bytes(),
        first,
        "passed through as it came"
    );
    assert!(!m.partial.is_empty(), "a frame is incomplete");
    pass(&mut m, b"lo\"},\"finish_reason\":null}]}\n\n");
    assert_eq!(
        (m.text.as_str(), m.tokens, m.partial.len()),
        ("Hello", 1, 0)
    );
    // No ids were reported: the continuation carries text (no worker serves `w:2`, so none is
    // asked for ids either).
    let (path, cont, exact) = m.continuation(&rank("w:2")).expect("budget left");
    assert_eq!((path, exact), ("/v1/chat/completions", false));
    let cont = json_of(&cont);
    assert_eq!(cont["max_completion_tokens"], 4);
    assert_eq!(
        cont["messages"][1],
        json!({"role": "assistant", "content": "Hello"})
    );
    assert_eq!(cont["continue_final_message"], true);
    assert_eq!(cont["add_generation_prompt"], false);
    // The continuation's role-only opening frame is dropped, its ids replaced, its frames
    // released whole.
    m.continued = true;
    let text = pass(
        &mut m,
        b"data: {\"id\":\"c-2\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\"}}]}\n\ndata: {\"id\":\"c-2\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\" you\"}}]}\n\ndata: [DO",
    );
    assert_eq!(text.matches("data: ").count(), 1, "{text}");
    assert!(
        text.contains("\"id\":\"c-1\"") && text.contains(" you"),
        "{text}"
    );
    assert_eq!(pass(&mut m, b"NE]\n\n"), "data: [DONE]\n\n");
}

#[test]
fn only_single_choice_prompts_move_token_prompts_only_with_ids_and_a_spent_budget_does_not() {
    let st = state();
    st.set_migration_limit(1);
    let path = "/v1/completions";
    for body in [
        json!({"prompt": [1, 2, 3]}),
        json!({"prompt": ["a", "b"]}),
        json!({"prompt": "x", "n": 2}),
        json!({"prompt": "x", "best_of": 3}),
        json!("not an object"),
    ] {
        assert!(
            migration(&st, path, body.clone(), false).is_none(),
            "{body}"
        );
    }
    assert!(
        migration(&st, path, json!({"prompt": [1, 2, 3]}), true).is_some(),
        "token ids move as token ids"
    );
    let mut m = migration(&st, path, json!({"prompt": "x", "max_tokens": 1}), false).unwrap();
    pass(
        &mut m,
        b"data: {\"id\":\"a\",\"choices\":[{\"text\":\"y\",\"finish_reason\":null}]}\n\n",
    );
    assert!(
        m.continuation(&rank("w:2")).is_none(),
        "no tokens left to generate"
    );
}

#[test]
fn the_router_asks_for_ids_only_where_the_engine_reports_them_and_migration_is_on() {
    let st = state();
    let body = Bytes::from(json!({"model": "m", "prompt": "x", "stream": true}).to_string());
    st.register_worker(record("w:1"));
    let mut sglang = record("w:2");
    sglang.engine = Engine::Sglang;
    st.register_worker(sglang);
    assert!(
        asking_ids(&st, &rank("w:1"), "/v1/completions", &body).is_none(),
        "off"
    );
    st.set_migration_limit(1);
    let asked = asking_ids(&st, &rank("w:1"), "/v1/completions", &body).expect("vLLM");
    assert_eq!(json_of(&asked)["return_token_ids"], true);
    assert!(asking_ids(&st, &rank("w:1"), "/v1/chat/completions", &body).is_some());
    assert!(asking_ids(&st, &rank("w:2"), "/v1/completions", &body).is_some());
    assert!(
        asking_ids(&st, &rank("w:2"), "/v1/chat/completions", &body).is_none(),
        "SGLang refuses ids on streaming chat"
    );
    let own = Bytes::from(json!({"prompt": "x", "return_token_ids": false}).to_string());
    assert!(
        asking_ids(&st, &rank("w:1"), "/v1/completions", &own).is_none(),
        "the client's own choice stands"
    );
}

#[test]
fn a_chat_stream_with_ids_continues_exactly_as_completions_read_back_as_chat() {
    let st = state();
    st.set_migration_limit(1);
    st.register_worker(record("w:2"));
    let body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 6, "stream": true});
    let mut m = migration(&st, "/v1/chat/completions", body, true).expect("movable");
    // vLLM's shape: the prompt's ids on the first chunk, each chunk's ids on it; the client
    // gets neither, and frames only whole.
    let out = pass(
        &mut m,
        b"data: {\"id\":\"c-1\",\"object\":\"chat.completion.chunk\",\"prompt_token_ids\":[5,6,7],\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"token_ids\":[]}]}\n\ndata: {\"id\":\"c-1\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\" the\"},\"token_ids\":[11]}]}\n\ndata: {\"id\":\"c-1\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\" of\"},\"tok",
    );
    assert!(!out.contains("token_ids"), "{out}");
    assert_eq!(
        out.matches("data: ").count(),
        2,
        "the third frame is held: {out}"
    );
    pass(&mut m, b"en_ids\":[12]}]}\n\n");
    assert_eq!(m.output_ids, vec![11, 12]);
    // The stream breaks here; the continuation is a completions request of the exact ids.
    let (path, cont, exact) = m.continuation(&rank("w:2")).expect("budget left");
    assert_eq!((path, exact), ("/v1/completions", true));
    let cont = json_of(&cont);
    assert_eq!(cont["prompt"], json!([5, 6, 7, 11, 12]));
    assert_eq!(cont["max_tokens"], 4);
    assert!(cont.get("messages").is_none() && cont.get("max_completion_tokens").is_none());
    assert_eq!(
        cont["return_token_ids"], true,
        "the next worker reports ids too"
    );
    // Its completions chunks reach the chat client as chat chunks of the first stream.
    m.continued = true;
    let out = pass(
        &mut m,
        b"data: {\"id\":\"cmpl-9\",\"object\":\"text_completion\",\"prompt_token_ids\":[5,6,7,11,12],\"choices\":[{\"index\":0,\"text\":\" and\",\"token_ids\":[13],\"finish_reason\":null}]}\n\n",
    );
    let chunk: Value = serde_json::from_str(
        out.strip_prefix("data: ")
            .and_then(|s| s.strip_suffix("\n\n"))
            .expect("one frame"),
    )
    .expect("json");
    assert_eq!(chunk["id"], "c-1");
    assert_eq!(chunk["object"], "chat.completion.chunk");
    assert_eq!(chunk["choices"][0]["delta"]["content"], " and");
    assert!(chunk["choices"][0].get("text").is_none() && !out.contains("token_ids"));
    assert_eq!(m.output_ids, vec![11, 12, 13]);
}

#[test]
fn a_frame_without_its_ids_falls_back_to_text_and_tools_keep_the_chat_path() {
    let st = state();
    st.set_migration_limit(1);
    let mut m = migration(
        &st,
        "/v1/completions",
        json!({"prompt": "x", "max_tokens": 4}),
        true,
    )
    .unwrap();
    pass(
        &mut m,
        b"data: {\"id\":\"a\",\"prompt_token_ids\":[1],\"choices\":[{\"text\":\" y\",\"token_ids\":[2]}]}\n\ndata: {\"id\":\"a\",\"choices\":[{\"text\":\" z\"}]}\n\n",
    );
    let (_, cont, exact) = m.continuation(&rank("w:2")).unwrap();
    assert!(!exact);
    assert_eq!(json_of(&cont)["prompt"], "x y z");

    let tools = json!({"messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function"}], "max_tokens": 4});
    let mut m = migration(&st, "/v1/chat/completions", tools, true).unwrap();
    pass(
        &mut m,
        b"data: {\"id\":\"c\",\"prompt_token_ids\":[1],\"choices\":[{\"delta\":{\"content\":\" y\"},\"token_ids\":[2]}]}\n\n",
    );
    let (path, _, exact) = m.continuation(&rank("w:2")).unwrap();
    assert_eq!((path, exact), ("/v1/chat/completions", false));
}
