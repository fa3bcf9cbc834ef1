//! Prefill/decode two-leg dispatch end to end: a real etcd (the backends harness), `infera
//! worker mock` processes playing the prefill and the decode leg of each PD protocol
//! (`--disaggregation-mode`, `--disaggregation-protocol`), and `infera server` in front of them.
//!
//! A PD-role mock answers 400 to a leg that lacks its protocol's fields, so a wrong dispatch
//! fails the request; each mock also lists the legs it accepted (`GET /mock/pd-legs`), which is
//! how these tests see which worker did which leg with which parameters.
#![allow(clippy::unwrap_used)]

mod common;

use common::{
    Proc, eventually, free_mock_port, free_port, get_json, http, metric, mock_worker, open_stream,
    server, tokenizer_dir,
};

use infera_backends::testing::EtcdServer;
use serde_json::{Value, json};

/// Starts `infera worker mock` in the PD `role` of `protocol` on `port`, with `extra` flags.
fn pd_mock(tok: &str, etcd: &str, port: u16, role: &str, protocol: &str, extra: &[&str]) -> Proc {
    let pd = [
        "--disaggregation-mode",
        role,
        "--disaggregation-protocol",
        protocol,
        "--disaggregation-bootstrap-port",
        "18998",
    ];
    let flags: Vec<&str> = pd.iter().chain(extra).copied().collect();
    mock_worker(tok, etcd, port, &flags)
}

fn legs(port: u16) -> Vec<Value> {
    get_json(port, "/mock/pd-legs")
        .and_then(|v| v["legs"].as_array().cloned())
        .unwrap_or_default()
}

/// The SGLang aborts `port` received (`GET /mock/pd-aborts`): each `{"rid", "found"}`.
fn aborts(port: u16) -> Vec<Value> {
    get_json(port, "/mock/pd-aborts")
        .and_then(|v| v["aborts"].as_array().cloned())
        .unwrap_or_default()
}

fn aborted_rids(port: u16) -> Vec<String> {
    aborts(port)
        .iter()
        .filter_map(|a| a["rid"].as_str().map(str::to_owned))
        .collect()
}

/// A running pair behind a server.
struct Fleet {
    _etcd: EtcdServer,
    tok: String,
    prefill_port: u16,
    decode_port: u16,
    server_port: u16,
    prefill: Proc,
    _decode: Proc,
    _server: Proc,
}

/// One prefill and one decode mock (each with `role_extra`) and a server (`server_extra`),
/// once the server routes to both.
async fn fleet(
    prefill_protocol: &str,
    decode_protocol: &str,
    mock_extra: &[&str],
    server_extra: &[&str],
) -> Fleet {
    let etcd = EtcdServer::start().await.expect("etcd starts");
    let tok = tokenizer_dir();
    let prefill_port = free_mock_port();
    let decode_port = free_mock_port();
    let prefill = pd_mock(
        &tok,
        &etcd.endpoint(),
        prefill_port,
        "prefill",
        prefill_protocol,
        mock_extra,
    );
    let decode = pd_mock(
        &tok,
        &etcd.endpoint(),
        decode_port,
        "decode",
        decode_protocol,
        mock_extra,
    );
    let server_port = free_port();
    let server = server(&tok, &etcd.endpoint(), server_port, server_extra);
    eventually("the server to see both legs", || {
        get_json(server_port, "/health").is_some_and(|h| h["active_workers"] == 2)
    });
    Fleet {
        _etcd: etcd,
        tok,
        prefill_port,
        decode_port,
        server_port,
        prefill,
        _decode: decode,
        _server: server,
    }
}

const MAX_TOKENS: u64 = 8;

/// Unary and streamed completions and a unary chat through the pair: every answer is the
/// decode leg's (all `MAX_TOKENS` tokens; a prefill leg makes one), and each mock saw its leg.
fn serve_through_the_pair(f: &Fleet) -> (Vec<Value>, Vec<Value>) {
    let prompt = "The prefill worker computes this prompt's KV cache and hands it over.";
    let unary = json!({"model": f.tok, "prompt": prompt, "max_tokens": MAX_TOKENS}).to_string();
    let (status, body) = http(f.server_port, "POST", "/v1/completions", &unary).unwrap();
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["usage"]["completion_tokens"], MAX_TOKENS, "{v}");
    assert!(
        v.get("kv_transfer_params").is_none_or(Value::is_null),
        "{v}"
    );

    let streamed =
        json!({"model": f.tok, "prompt": prompt, "max_tokens": MAX_TOKENS, "stream": true})
            .to_string();
    let (status, body) = http(f.server_port, "POST", "/v1/completions", &streamed).unwrap();
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("data: [DONE]"), "{body}");
    assert!(!body.contains("\"error\""), "{body}");
    assert!(
        body.matches("data: {").count() as u64 >= MAX_TOKENS,
        "{body}"
    );

    let chat = json!({"model": f.tok, "max_tokens": MAX_TOKENS,
        "messages": [{"role": "user", "content": prompt}]})
    .to_string();
    let (status, body) = http(f.server_port, "POST", "/v1/chat/completions", &chat).unwrap();
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["usage"]["completion_tokens"], MAX_TOKENS, "{v}");

    let prefill = legs(f.prefill_port);
    let decode = legs(f.decode_port);
    assert_eq!(prefill.len(), 3, "{prefill:?}");
    assert_eq!(decode.len(), 3, "{decode:?}");
    assert!(
        prefill.iter().all(|l| l["role"] == "prefill"),
        "{prefill:?}"
    );
    assert!(decode.iter().all(|l| l["role"] == "decode"), "{decode:?}");
    (prefill, decode)
}

/// A serial (vLLM-style) pair: the prefill ran one unstreamed token, the decode leg the
/// client's budget and streaming, and both kept the retention stamp.
async fn serial_pair(protocol: &str) -> (Vec<Value>, Vec<Value>) {
    let f = fleet(protocol, protocol, &["--speedup", "1000"], &[]).await;
    let (prefill, decode) = serve_through_the_pair(&f);
    for l in &prefill {
        assert_eq!(l["max_tokens"], 1, "{l}");
        assert_eq!(l["stream"], false, "{l}");
        assert_eq!(l["kv_transfer_params"]["do_remote_decode"], true, "{l}");
        assert_eq!(l["kv_transfer_params"]["infera_retention"], "long", "{l}");
    }
    for l in &decode {
        assert_eq!(l["max_tokens"], MAX_TOKENS, "{l}");
        assert_eq!(l["kv_transfer_params"]["do_remote_prefill"], true, "{l}");
        assert_eq!(l["kv_transfer_params"]["infera_retention"], "long", "{l}");
    }
    let streamed: Vec<bool> = decode.iter().map(|l| l["stream"] == true).collect();
    assert_eq!(streamed, [false, true, false]);
    assert_eq!(metric(f.server_port, "infera_pd_requests_total"), Some(3));
    // The Python Infera's families: both legs of each pair timed, each request as `disagg`.
    let legs_timed = metric(f.server_port, "infera_pd_dispatch_duration_seconds_count");
    assert_eq!(legs_timed, Some(6));
    let timed = metric(
        f.server_port,
        "infera_request_duration_seconds_count{router=\"disagg\"",
    );
    assert_eq!(timed, Some(3));
    (prefill, decode)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_bootstrap_sends_both_legs_with_the_prefill_bootstrap_and_one_room() {
    let f = fleet(
        "sglang-bootstrap",
        "sglang-bootstrap",
        &["--speedup", "1000"],
        &[],
    )
    .await;
    let (prefill, decode) = serve_through_the_pair(&f);
    for l in prefill.iter().chain(&decode) {
        assert_eq!(l["bootstrap_host"], "127.0.0.1", "{l}");
        assert_eq!(l["bootstrap_port"], 18998, "{l}");
    }
    let rooms = |legs: &[Value]| -> Vec<u64> {
        let mut r: Vec<u64> = legs
            .iter()
            .map(|l| l["bootstrap_room"].as_u64().unwrap())
            .collect();
        r.sort_unstable();
        r
    };
    assert_eq!(
        rooms(&prefill),
        rooms(&decode),
        "each request's legs share its room"
    );
    let mut distinct = rooms(&prefill);
    distinct.dedup();
    assert_eq!(distinct.len(), 3, "every request gets a fresh room");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_nixl_decodes_with_the_params_the_prefill_answered() {
    let (_, decode) = serial_pair("vllm-nixl").await;
    for l in &decode {
        let kv = &l["kv_transfer_params"];
        assert!(
            kv["remote_engine_id"]
                .as_str()
                .unwrap()
                .starts_with("infera-127.0.0.1-"),
            "{l}"
        );
        assert_eq!(kv["remote_host"], "127.0.0.1", "{l}");
        assert_eq!(kv["remote_block_ids"], json!([0]), "{l}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_mooncake_decodes_from_the_prefill_bootstrap_with_its_transfer_id() {
    let (prefill, decode) = serial_pair("vllm-mooncake").await;
    for (p, d) in prefill.iter().zip(&decode) {
        let transfer = &p["kv_transfer_params"]["transfer_id"];
        assert!(transfer.as_str().unwrap().starts_with("xfer-"), "{p}");
        assert_eq!(&d["kv_transfer_params"]["transfer_id"], transfer, "{d}");
        assert_eq!(
            d["kv_transfer_params"]["remote_bootstrap_addr"], "http://127.0.0.1:18998",
            "{d}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_mori_read_pulls_the_transfer_the_prefill_answered() {
    let (prefill, decode) = serial_pair("vllm-mori-read").await;
    for (p, d) in prefill.iter().zip(&decode) {
        assert_eq!(
            d["kv_transfer_params"]["transfer_id"],
            p["kv_transfer_params"]["transfer_id"]
        );
        assert_eq!(d["kv_transfer_params"]["remote_block_ids"], json!([0]));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn atom_mooncake_prefill_names_the_decode_peer_and_decode_reuses_its_answer() {
    let (prefill, decode) = serial_pair("atom-mooncake").await;
    for l in &prefill {
        assert_eq!(l["kv_transfer_params"]["remote_host"], "127.0.0.1", "{l}");
        assert_eq!(
            l["kv_transfer_params"]["remote_handshake_port"], 18998,
            "{l}"
        );
    }
    for l in &decode {
        assert_eq!(l["kv_transfer_params"]["first_token_id"], 0, "{l}");
        assert_eq!(l["kv_transfer_params"]["remote_dp_rank"], 0, "{l}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_mori_write_sends_both_legs_with_one_transfer_id() {
    let f = fleet(
        "vllm-mori-write",
        "vllm-mori-write",
        &["--speedup", "1000"],
        &[],
    )
    .await;
    let (prefill, decode) = serve_through_the_pair(&f);
    let ids = |legs: &[Value]| -> Vec<String> {
        let mut ids: Vec<String> = legs
            .iter()
            .map(|l| {
                l["kv_transfer_params"]["transfer_id"]
                    .as_str()
                    .unwrap()
                    .to_owned()
            })
            .collect();
        ids.sort();
        ids
    };
    assert_eq!(ids(&prefill), ids(&decode));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pair_whose_protocols_differ_is_a_500_naming_both() {
    let f = fleet("sglang-bootstrap", "vllm-nixl", &["--speedup", "1000"], &[]).await;
    let req = json!({"model": f.tok, "prompt": "mismatched", "max_tokens": 2}).to_string();
    let (status, body) = http(f.server_port, "POST", "/v1/completions", &req).unwrap();
    assert_eq!(status, 500, "{body}");
    let message = serde_json::from_str::<Value>(&body).unwrap()["error"]["message"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        message.contains(&format!(
            "127.0.0.1:{} registers sglang-bootstrap",
            f.prefill_port
        )) && message.contains(&format!("127.0.0.1:{} registers vllm-nixl", f.decode_port)),
        "{message}"
    );
    assert!(legs(f.prefill_port).is_empty() && legs(f.decode_port).is_empty());
    assert_eq!(
        metric(f.server_port, "infera_pd_pair_errors_total"),
        Some(1)
    );
    let reason = r#"infera_pd_bootstrap_failures_total{reason="protocol_unresolved""#;
    assert_eq!(metric(f.server_port, reason), Some(1));
}

/// Kills the prefill mock without letting it deregister: its record stays in etcd until its
/// lease expires, so the server still routes to a worker that refuses connections.
fn kill_prefill(f: &mut Fleet) {
    f.prefill.0.kill().unwrap();
    f.prefill.0.wait().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_serial_prefill_errors_before_the_first_byte_and_never_reaches_decode() {
    let mut f = fleet("vllm-nixl", "vllm-nixl", &["--speedup", "1000"], &[]).await;
    kill_prefill(&mut f);
    let req = json!({"model": f.tok, "prompt": "no prefill", "max_tokens": 4, "stream": true})
        .to_string();
    let (status, body) = http(f.server_port, "POST", "/v1/completions", &req).unwrap();
    assert_eq!(status, 502, "{body}");
    assert!(body.contains("prefill"), "{body}");
    assert!(
        !body.contains("data:"),
        "an error before the first byte, not a stream: {body}"
    );
    assert!(legs(f.decode_port).is_empty());
    assert_eq!(metric(f.decode_port, "infera_mock_requests_total"), Some(0));
    assert!(metric(f.server_port, "infera_pd_prefill_failures_total") >= Some(1));
    let reason = r#"infera_pd_bootstrap_failures_total{reason="prefill_unreachable""#;
    assert!(metric(f.server_port, reason) >= Some(1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_concurrent_prefill_errors_before_the_first_byte_and_drops_the_decode_leg() {
    // The decode leg runs at real speed: thousands of tokens that it must not finish.
    let mut f = fleet("sglang-bootstrap", "sglang-bootstrap", &[], &[]).await;
    kill_prefill(&mut f);
    let req = json!({"model": f.tok, "prompt": "no prefill", "max_tokens": 2000, "stream": true})
        .to_string();
    let (status, body) = http(f.server_port, "POST", "/v1/completions", &req).unwrap();
    assert_eq!(status, 502, "{body}");
    assert!(
        !body.contains("data:"),
        "an error before the first byte, not a stream: {body}"
    );
    // Whatever of the decode leg reached the engine was aborted, none of it runs on.
    eventually("the decode leg to be dropped", || {
        let running = metric(f.decode_port, "vllm:num_requests_running");
        let accepted = metric(f.decode_port, "infera_mock_requests_total");
        let detached = metric(f.decode_port, "infera_mock_requests_detached_total");
        running == Some(0) && accepted.is_some() && accepted == detached
    });
    // And SGLang was told so: every decode leg it accepted got /abort_request by its rid.
    let rids: Vec<String> = legs(f.decode_port)
        .iter()
        .map(|l| l["rid"].as_str().unwrap().to_owned())
        .collect();
    eventually("an abort for every decode leg", || {
        let aborted = aborted_rids(f.decode_port);
        rids.iter().all(|r| aborted.contains(r))
    });
    assert!(
        rids.iter()
            .all(|r| r.starts_with("infera-") && r.len() == 23),
        "{rids:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_sglang_client_that_goes_away_gets_its_running_legs_aborted() {
    // Real speed: the decode leg streams thousands of tokens that it must not finish.
    let f = fleet("sglang-bootstrap", "sglang-bootstrap", &[], &[]).await;
    let req = json!({"model": f.tok, "prompt": "the client leaves", "max_tokens": 2000,
        "stream": true})
    .to_string();
    let (stream, head) = open_stream(f.server_port, &req);
    assert!(
        String::from_utf8_lossy(&head).starts_with("HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&head)
    );
    drop(stream);
    let decode = legs(f.decode_port);
    let prefill = legs(f.prefill_port);
    assert_eq!(decode.len(), 1, "{decode:?}");
    assert_eq!(prefill.len(), 1, "{prefill:?}");
    let rid = decode[0]["rid"].as_str().unwrap().to_owned();
    assert_eq!(prefill[0]["rid"], rid.as_str(), "both legs carry one rid");
    eventually("the decode leg to be aborted by its rid", || {
        aborted_rids(f.decode_port).contains(&rid)
    });
    eventually("the decode leg to leave the engine", || {
        metric(f.decode_port, "vllm:num_requests_running") == Some(0)
    });
    // The prefill leg made its one token: it is aborted only if it had not answered yet.
    assert!(
        aborted_rids(f.prefill_port).iter().all(|r| *r == rid),
        "{:?}",
        aborts(f.prefill_port)
    );
    assert!(metric(f.decode_port, "infera_mock_requests_total") == Some(1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn atom_mooncake_serves_a_streamed_chat_through_the_hand_off() {
    let f = fleet(
        "atom-mooncake",
        "atom-mooncake",
        &["--speedup", "1000"],
        &[],
    )
    .await;
    let chat = json!({"model": f.tok, "max_completion_tokens": MAX_TOKENS, "stream": true,
        "stream_options": {"include_usage": true},
        "messages": [{"role": "user", "content": "Hand this chat over to the decode worker."}]})
    .to_string();
    let (status, body) = http(f.server_port, "POST", "/v1/chat/completions", &chat).unwrap();
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("chat.completion.chunk"), "{body}");
    assert!(
        body.contains("data: [DONE]") && !body.contains("\"error\""),
        "{body}"
    );
    assert!(
        body.contains(&format!("\"completion_tokens\":{MAX_TOKENS}")),
        "the decode leg's whole budget: {body}"
    );
    let (prefill, decode) = (legs(f.prefill_port), legs(f.decode_port));
    assert_eq!(
        (prefill.len(), decode.len()),
        (1, 1),
        "{prefill:?} {decode:?}"
    );
    let (p, d) = (&prefill[0], &decode[0]);
    // One unstreamed token on the prefill (the mock logs max_completion_tokens for chat).
    assert_eq!(p["max_tokens"], 1, "{p}");
    assert_eq!(p["stream"], false, "{p}");
    assert_eq!(p["kv_transfer_params"]["remote_port"], f.decode_port, "{p}");
    // The decode leg streams the client's budget with the prefill's hand-off.
    assert_eq!(d["max_tokens"], MAX_TOKENS, "{d}");
    assert_eq!(d["stream"], true, "{d}");
    let kv = &d["kv_transfer_params"];
    assert_eq!(kv["transfer_id"], 1, "{d}");
    assert_eq!(kv["first_token_id"], 0, "{d}");
    assert_eq!(kv["remote_dp_rank"], 0, "{d}");
    assert_eq!(kv["remote_port"], f.prefill_port, "{d}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_prefill_is_retried_on_another_pair() {
    let mut f = fleet(
        "vllm-nixl",
        "vllm-nixl",
        &["--speedup", "1000"],
        &[
            "--router-policy",
            "round-robin",
            "--request-max-retries",
            "2",
        ],
    )
    .await;
    let etcd = f._etcd.endpoint();
    let second_port = free_mock_port();
    let _second = pd_mock(
        &f.tok,
        &etcd,
        second_port,
        "prefill",
        "vllm-nixl",
        &["--speedup", "1000"],
    );
    eventually("the server to see the second prefill", || {
        get_json(f.server_port, "/health").is_some_and(|h| h["active_workers"] == 3)
    });
    kill_prefill(&mut f);
    for i in 0..4 {
        let req =
            json!({"model": f.tok, "prompt": format!("retry {i}"), "max_tokens": 3}).to_string();
        let (status, body) = http(f.server_port, "POST", "/v1/completions", &req).unwrap();
        assert_eq!(status, 200, "{body}");
    }
    assert_eq!(
        legs(second_port).len(),
        4,
        "the live prefill took every request"
    );
    assert_eq!(legs(f.decode_port).len(), 4);
    assert!(metric(f.server_port, "infera_router_retries_total") >= Some(1));
}
