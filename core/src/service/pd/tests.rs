//! Unit tests of the PD dispatch: body shapes per protocol, DP-rank alignment, the legs' order.

use super::shape::*;
use super::*;
use crate::service::test_support::record;
use serde_json::json;

fn leg(id: &str, role: Role, meta: Value) -> Leg {
    let mut record = record(id);
    record.disagg_mode = role;
    record.disagg_meta = Some(meta);
    Leg {
        rank: WorkerRank::new(id, 0),
        url: format!("http://{id}"),
        record,
    }
}

fn pair(protocol: &str, prefill_params: Value, decode_params: Value) -> Pair {
    Pair {
        prefill: leg(
            "10.0.0.1:8000",
            Role::Prefill,
            json!({"protocol": protocol, "params": prefill_params}),
        ),
        decode: leg(
            "10.0.0.2:8000",
            Role::Decode,
            json!({"protocol": protocol, "params": decode_params}),
        ),
    }
}

fn base(extra: Value) -> Map<String, Value> {
    let mut b = object(json!({
        "model": "m",
        "prompt": "hi",
        "max_tokens": 64,
        "stream": true,
        "stream_options": {"include_usage": true},
        "min_tokens": 4,
        "kv_transfer_params": {"infera_retention": "short"},
    }));
    b.extend(object(extra));
    b
}

fn shape(protocol: PdProtocol, pair: &Pair, chat: bool) -> Shape<'_> {
    Shape {
        protocol,
        pair,
        room: 0xabc,
        chat,
    }
}

#[test]
fn sglang_legs_carry_the_prefill_bootstrap_and_one_room() {
    let pair = pair(
        "sglang-bootstrap",
        json!({"bootstrap_host": "node1", "bootstrap_port": 9000}),
        json!({}),
    );
    let s = shape(PdProtocol::SglangBootstrap, &pair, false);
    let b = base(json!({}));
    let p = s.prefill_body(&b).unwrap();
    let d = s.decode_body(&b, None).unwrap();
    assert_eq!(p, d, "SGLang's legs get the same body");
    assert_eq!(p["bootstrap_host"], "node1");
    assert_eq!(p["bootstrap_port"], 9000);
    assert_eq!(p["bootstrap_room"], 0xabc);
    // Everything else is the client's, stream and max_tokens included.
    assert_eq!(p["max_tokens"], 64);
    assert_eq!(p["stream"], true);
    assert_eq!(
        p["kv_transfer_params"],
        json!({"infera_retention": "short"})
    );
    assert_eq!(s.engine_request_id().unwrap(), None);
}

#[test]
fn sglang_reads_the_python_workers_bootstrap_addr() {
    let pair = pair(
        "sglang-bootstrap",
        json!({"bootstrap_addr": "10.1.2.3:8998"}),
        json!({}),
    );
    let p = shape(PdProtocol::SglangBootstrap, &pair, false)
        .prefill_body(&base(json!({})))
        .unwrap();
    assert_eq!(p["bootstrap_host"], "10.1.2.3");
    assert_eq!(p["bootstrap_port"], 8998);
}

#[test]
fn sglang_without_a_bootstrap_is_a_meta_error_naming_the_prefill() {
    let pair = pair("sglang-bootstrap", json!({}), json!({}));
    let e = shape(PdProtocol::SglangBootstrap, &pair, false)
        .prefill_body(&base(json!({})))
        .unwrap_err();
    assert!(
        e.to_string().contains("prefill worker 10.0.0.1:8000"),
        "{e}"
    );
    assert_eq!(
        e.code().http_status(),
        http::StatusCode::INTERNAL_SERVER_ERROR
    );
}

#[test]
fn nixl_prefill_runs_one_token_and_decode_takes_the_answered_params() {
    let pair = pair("vllm-nixl", json!({"engine_id": "p"}), json!({}));
    let s = shape(PdProtocol::VllmNixl, &pair, true);
    let b = base(json!({"max_completion_tokens": 50}));
    let p = s.prefill_body(&b).unwrap();
    assert_eq!(p["max_tokens"], 1);
    assert_eq!(p["max_completion_tokens"], 1);
    assert_eq!(p["stream"], false);
    assert!(p.get("stream_options").is_none() && p.get("min_tokens").is_none());
    assert_eq!(
        p["kv_transfer_params"],
        json!({"do_remote_decode": true, "do_remote_prefill": false,
            "remote_engine_id": null, "remote_block_ids": null,
            "remote_host": null, "remote_port": null, "infera_retention": "short"})
    );
    let answer = json!({"id": "x", "kv_transfer_params": {
        "do_remote_prefill": true, "do_remote_decode": false,
        "remote_engine_id": "p", "remote_block_ids": [1, 2],
        "remote_host": "10.0.0.1", "remote_port": 5600}});
    let handoff = s.handoff(answer.to_string().as_bytes()).unwrap();
    let d = s.decode_body(&b, handoff).unwrap();
    assert_eq!(
        d["max_tokens"], 64,
        "the decode leg keeps the client's budget"
    );
    assert_eq!(d["max_completion_tokens"], 50);
    assert_eq!(d["stream"], true);
    assert_eq!(d["stream_options"], json!({"include_usage": true}));
    assert_eq!(d["min_tokens"], 4);
    let mut expected = answer["kv_transfer_params"].clone();
    expected["infera_retention"] = "short".into();
    assert_eq!(d["kv_transfer_params"], expected);
}

#[test]
fn a_chat_prefill_caps_max_completion_tokens_too() {
    let pair = pair("vllm-nixl", json!({}), json!({}));
    let chat = shape(PdProtocol::VllmNixl, &pair, true)
        .prefill_body(&base(json!({})))
        .unwrap();
    assert_eq!(chat["max_completion_tokens"], 1);
    let completion = shape(PdProtocol::VllmNixl, &pair, false)
        .prefill_body(&base(json!({})))
        .unwrap();
    assert!(completion.get("max_completion_tokens").is_none());
}

#[test]
fn nixl_decode_without_an_answered_handoff_is_a_502() {
    let pair = pair("vllm-nixl", json!({}), json!({}));
    let s = shape(PdProtocol::VllmNixl, &pair, false);
    let handoff = s.handoff(br#"{"id": "x"}"#).unwrap();
    let e = s.decode_body(&base(json!({})), handoff).unwrap_err();
    assert_eq!(e.code().http_status(), http::StatusCode::BAD_GATEWAY);
    assert!(s.handoff(b"not json").is_err());
    assert!(s.handoff(br#"{"kv_transfer_params": 3}"#).is_err());
}

#[test]
fn mooncake_decode_addresses_the_prefill_bootstrap_with_a_shared_transfer_id() {
    let pair = pair(
        "vllm-mooncake",
        json!({"engine_id": "eng-p", "bootstrap_addr": "http://10.0.0.1:8998"}),
        json!({"engine_id": "eng-d"}),
    );
    let s = shape(PdProtocol::VllmMooncake, &pair, false);
    let b = base(json!({}));
    let p = s.prefill_body(&b).unwrap();
    let xfer = format!("xfer-{:032x}", 0xabc);
    assert_eq!(
        p["kv_transfer_params"],
        json!({"do_remote_decode": true, "do_remote_prefill": false,
            "transfer_id": xfer, "infera_retention": "short"})
    );
    // A connector that answers nothing: the registration says where to pull from.
    let d = s.decode_body(&b, None).unwrap();
    assert_eq!(
        d["kv_transfer_params"],
        json!({"do_remote_decode": false, "do_remote_prefill": true,
            "remote_bootstrap_addr": "http://10.0.0.1:8998", "remote_engine_id": "eng-p",
            "transfer_id": xfer, "infera_retention": "short"})
    );
    // One that answers: its values win.
    let answered = object(json!({"remote_engine_id": "eng-p_dp1"}));
    let d = s.decode_body(&b, Some(answered)).unwrap();
    assert_eq!(d["kv_transfer_params"]["remote_engine_id"], "eng-p_dp1");
    // Without the prefill's bootstrap address the pair cannot run.
    let bad = self::pair("vllm-mooncake", json!({"engine_id": "e"}), json!({}));
    let e = shape(PdProtocol::VllmMooncake, &bad, false)
        .decode_body(&b, None)
        .unwrap_err();
    assert!(e.to_string().contains("bootstrap_addr"), "{e}");
}

#[test]
fn mori_forges_the_peer_addressed_request_id_and_read_pulls_the_answer() {
    let extra = |h: u16, n: u16| json!({"kv_connector_extra_config": {"handshake_port": h, "notify_port": n, "tp_size": 2}});
    let pair = pair("vllm-mori-read", extra(6301, 6401), extra(7301, 7401));
    let s = shape(PdProtocol::VllmMoriRead, &pair, false);
    assert_eq!(
        s.engine_request_id().unwrap().unwrap(),
        format!(
            "___prefill_addr_host:10.0.0.1,handshake:6301,notify:6401___decode_addr_host:10.0.0.2,handshake:7301,notify:7401_{:032x}",
            0xabc
        )
    );
    let b = base(json!({}));
    let p = s.prefill_body(&b).unwrap();
    assert_eq!(p["kv_transfer_params"]["do_remote_decode"], true);
    assert_eq!(p["kv_transfer_params"]["remote_tp_size"], 2);
    let answer = br#"{"kv_transfer_params": {"transfer_id": "tx-1", "remote_engine_id": "e", "remote_block_ids": [3]}}"#;
    let d = s.decode_body(&b, s.handoff(answer).unwrap()).unwrap();
    assert_eq!(
        d["kv_transfer_params"],
        json!({"do_remote_decode": false, "do_remote_prefill": true, "transfer_id": "tx-1",
            "remote_engine_id": "e", "remote_block_ids": [3], "remote_dp_size": 1,
            "tp_size": 2, "remote_tp_size": 2, "infera_retention": "short"})
    );
    let missing = br#"{"kv_transfer_params": {"transfer_id": "tx-1"}}"#;
    assert!(s.decode_body(&b, s.handoff(missing).unwrap()).is_err());
    // Without the side-channel ports MoRI cannot address its peers.
    let bare = self::pair("vllm-mori-write", json!({}), json!({}));
    assert!(
        shape(PdProtocol::VllmMoriWrite, &bare, false)
            .engine_request_id()
            .is_err()
    );
}

#[test]
fn mori_write_decode_needs_no_answer() {
    let pair = pair("vllm-mori-write", json!({}), json!({}));
    let d = shape(PdProtocol::VllmMoriWrite, &pair, false)
        .decode_body(&base(json!({})), None)
        .unwrap();
    assert_eq!(d["kv_transfer_params"]["do_remote_prefill"], true);
    assert_eq!(
        d["kv_transfer_params"]["transfer_id"],
        format!("tx-{:032x}", 0xabc)
    );
}

#[test]
fn atom_prefill_names_the_decode_peer_and_decode_reuses_the_answer() {
    let atom = |host: &str, port: u16| json!({"host": host, "http_port": port, "handshake_port": 6301, "tp_size": 8, "dp_size": 1});
    let pair = pair(
        "atom-mooncake",
        atom("10.0.0.1", 8000),
        atom("10.0.0.2", 8001),
    );
    let s = shape(PdProtocol::AtomMooncake, &pair, false);
    let b = base(json!({}));
    let p = s.prefill_body(&b).unwrap();
    assert_eq!(p["kv_transfer_params"]["remote_host"], "10.0.0.2");
    assert_eq!(p["kv_transfer_params"]["remote_port"], 8001);
    assert_eq!(p["kv_transfer_params"]["remote_handshake_port"], 6301);
    assert_eq!(p["kv_transfer_params"]["remote_tp_size"], 8);
    let answer = br#"{"kv_transfer_params": {"transfer_id": 7, "first_token_id": 11, "dp_rank": 0, "do_remote_prefill": true}}"#;
    let d = s.decode_body(&b, s.handoff(answer).unwrap()).unwrap();
    assert_eq!(
        d["kv_transfer_params"],
        json!({"transfer_id": 7, "first_token_id": 11, "dp_rank": 0,
            "do_remote_prefill": true, "remote_dp_size": 1, "remote_tp_size": 8,
            "tp_size": 8, "remote_dp_rank": 0, "infera_retention": "short"})
    );
    assert_eq!(d["max_tokens"], 64);
    let no_transfer = br#"{"kv_transfer_params": {"dp_rank": 0}}"#;
    assert!(s.decode_body(&b, s.handoff(no_transfer).unwrap()).is_err());
}

#[test]
fn mismatched_or_unknown_protocols_name_both_workers() {
    let mut p = pair("sglang-bootstrap", json!({}), json!({}));
    p.decode.record.disagg_meta = Some(json!({"protocol": "vllm-nixl"}));
    let e = resolve(&p.prefill.record, &p.decode.record).unwrap_err();
    let text = e.to_string();
    assert!(
        text.contains("10.0.0.1:8000 registers sglang-bootstrap")
            && text.contains("10.0.0.2:8000 registers vllm-nixl"),
        "{text}"
    );
    p.decode.record.disagg_meta = None;
    let e = resolve(&p.prefill.record, &p.decode.record).unwrap_err();
    assert!(e.to_string().contains("no protocol"), "{e}");
    let odd = pair("carrier-pigeon", json!({}), json!({}));
    let e = resolve(&odd.prefill.record, &odd.decode.record).unwrap_err();
    assert!(e.to_string().contains("carrier-pigeon"), "{e}");
    let ok = pair("vllm-mooncake", json!({}), json!({}));
    assert_eq!(
        resolve(&ok.prefill.record, &ok.decode.record).unwrap(),
        PdProtocol::VllmMooncake
    );
}

#[test]
fn rooms_are_u63_and_fresh() {
    let rooms: std::collections::HashSet<u64> = (0..1000).map(|_| new_room(42)).collect();
    assert_eq!(rooms.len(), 1000);
    assert!(rooms.iter().all(|r| *r < 1 << 63));
}

/// `pair` with the prefill fronting `p_size` ranks from `p_first`, steered to `p_rank`, and
/// the decode fronting `d_size` ranks, steered to `d_rank`.
fn dp(
    mut pair: Pair,
    (p_first, p_size, p_rank): (u32, u32, u32),
    (d_size, d_rank): (u32, u32),
) -> Pair {
    pair.prefill.record.dp_rank = p_first;
    pair.prefill.record.dp_size = p_size;
    pair.prefill.rank.dp_rank = p_rank;
    pair.decode.record.dp_size = d_size;
    pair.decode.rank.dp_rank = d_rank;
    pair
}

#[test]
fn an_sglang_dp_prefill_gets_a_room_of_its_rank_and_the_decode_names_it() {
    let pair = dp(
        pair(
            "sglang-bootstrap",
            json!({"bootstrap_host": "node1", "bootstrap_port": 9000}),
            json!({}),
        ),
        (0, 4, 2),
        (2, 1),
    );
    for drawn in [0, 1, 2, 3, 0xabc, (1 << 63) - 1] {
        let s = Shape::new(PdProtocol::SglangBootstrap, &pair, drawn, false);
        assert_eq!(s.room % 4, 2, "room {drawn}");
        assert!(s.room < 1 << 63, "room {drawn} stays a u63");
        let b = base(json!({}));
        let p = s.prefill_body(&b).unwrap();
        let d = s.decode_body(&b, None).unwrap();
        assert_eq!(p["bootstrap_room"], s.room);
        assert_eq!(d["bootstrap_room"], s.room);
        assert_eq!(p["rid"], sglang_rid(s.room));
        assert_eq!(d["rid"], p["rid"], "one rid for both legs");
        assert_eq!(d["disagg_prefill_dp_rank"], 2);
        assert!(p.get("disagg_prefill_dp_rank").is_none());
    }
    assert_eq!(pair.prefill.engine_dp_rank(), Some(2));
    assert_eq!(pair.decode.engine_dp_rank(), Some(1));
    // A prefill of one rank: the room as drawn, no rank named.
    let one = self::pair(
        "sglang-bootstrap",
        json!({"bootstrap_addr": "h:1"}),
        json!({}),
    );
    let s = Shape::new(PdProtocol::SglangBootstrap, &one, 0xabc, false);
    assert_eq!(s.room, 0xabc);
    let d = s.decode_body(&base(json!({})), None).unwrap();
    assert!(d.get("disagg_prefill_dp_rank").is_none());
    assert_eq!(one.prefill.engine_dp_rank(), None);
}

#[test]
fn sglang_rids_have_one_length_so_none_prefixes_another() {
    assert_eq!(sglang_rid(0xab), "infera-00000000000000ab");
    assert_eq!(sglang_rid((1 << 63) - 1).len(), sglang_rid(1).len());
}

#[test]
fn mooncake_decode_names_the_chosen_prefill_ranks_engine_id() {
    let meta = json!({"engine_id": "eng-p", "bootstrap_addr": "http://10.0.0.1:8998"});
    // The worker registered ranks 4..6 and the router chose rank 5: vLLM's local rank 1.
    let pair = dp(
        pair("vllm-mooncake", meta.clone(), json!({})),
        (4, 2, 5),
        (1, 0),
    );
    let s = Shape::new(PdProtocol::VllmMooncake, &pair, 0xabc, false);
    let d = s.decode_body(&base(json!({})), None).unwrap();
    assert_eq!(d["kv_transfer_params"]["remote_engine_id"], "eng-p_dp1");
    // One rank: the registered id as is.
    let one = self::pair("vllm-mooncake", meta, json!({}));
    let d = Shape::new(PdProtocol::VllmMooncake, &one, 0xabc, false)
        .decode_body(&base(json!({})), None)
        .unwrap();
    assert_eq!(d["kv_transfer_params"]["remote_engine_id"], "eng-p");
    // An engine id that is not a string cannot be suffixed: a registration error.
    let bad = dp(
        self::pair(
            "vllm-mooncake",
            json!({"engine_id": 7, "bootstrap_addr": "http://h:1"}),
            json!({}),
        ),
        (0, 2, 1),
        (1, 0),
    );
    let e = Shape::new(PdProtocol::VllmMooncake, &bad, 1, false)
        .decode_body(&base(json!({})), None)
        .unwrap_err();
    assert!(e.to_string().contains("engine_id"), "{e}");
}

/// Records every request; answers each leg with its status and a nixl-shaped hand-off,
/// and an abort with 200 (reported on `aborts`).
#[derive(Debug)]
struct Fake {
    sent: std::sync::Mutex<Vec<Outbound>>,
    prefill_status: http::StatusCode,
    decode_status: http::StatusCode,
    aborts: tokio::sync::mpsc::Sender<Outbound>,
    events: Arc<std::sync::Mutex<Vec<String>>>,
}

#[async_trait::async_trait]
impl RequestTransport for Fake {
    fn name(&self) -> &'static str {
        "fake"
    }

    async fn send(&self, req: Outbound) -> Result<Inbound, TransportError> {
        let worker = req.worker.as_str().to_owned();
        let is_abort = req.path == super::abort::ABORT_PATH;
        self.events
            .lock()
            .unwrap()
            .push(format!("{worker} {}", req.path));
        self.sent.lock().unwrap().push(req.clone());
        if is_abort {
            let _ = self.aborts.send(req).await;
        }
        let status = match (worker.as_str(), is_abort) {
            (_, true) => http::StatusCode::OK,
            ("10.0.0.1:8000", false) => self.prefill_status,
            _ => self.decode_status,
        };
        let body = br#"{"kv_transfer_params": {"do_remote_prefill": true}}"#;
        Ok(Inbound {
            status,
            content_type: None,
            body: futures::stream::iter([Ok(Bytes::from_static(body))]).boxed(),
        })
    }
}

/// A [`Fake`] whose prefill (`10.0.0.1:8000`) answers `prefill_status` and whose decode
/// answers `decode_status`.
fn fake(
    prefill_status: http::StatusCode,
    decode_status: http::StatusCode,
) -> (Arc<Fake>, tokio::sync::mpsc::Receiver<Outbound>) {
    let (tx, rx) = tokio::sync::mpsc::channel(8);
    let f = Fake {
        sent: std::sync::Mutex::new(Vec::new()),
        prefill_status,
        decode_status,
        aborts: tx,
        events: Arc::default(),
    };
    (Arc::new(f), rx)
}

async fn drive(
    f: &Arc<Fake>,
    shape: Shape<'_>,
    prefilled: tokio::sync::oneshot::Sender<()>,
) -> Result<Inbound, LegError> {
    let transport: Arc<dyn RequestTransport> = f.clone();
    let events = f.events.clone();
    send(
        &transport,
        shape,
        "/v1/completions",
        &base(json!({})),
        true,
        "req-1",
        1 << 16,
        &http::HeaderMap::new(),
        move || {
            events.lock().unwrap().push("prefilled".into());
            let _ = prefilled.send(());
        },
    )
    .await
}

#[tokio::test]
async fn each_leg_is_pinned_to_its_dp_rank_and_a_serial_prefill_completes_before_decode() {
    let pair = dp(pair("vllm-nixl", json!({}), json!({})), (0, 4, 3), (2, 1));
    let (f, _aborts) = fake(http::StatusCode::OK, http::StatusCode::OK);
    let (tx, rx) = tokio::sync::oneshot::channel();
    let shape = Shape::new(PdProtocol::VllmNixl, &pair, 7, false);
    let decode = drive(&f, shape, tx).await.unwrap();
    assert_eq!(decode.status, http::StatusCode::OK);
    rx.await.unwrap();
    let ranks: Vec<Option<u32>> = f.sent.lock().unwrap().iter().map(|o| o.dp_rank()).collect();
    assert_eq!(ranks, [Some(3), Some(1)], "prefill, then decode");
    assert_eq!(
        *f.events.lock().unwrap(),
        [
            "10.0.0.1:8000 /v1/completions",
            "prefilled",
            "10.0.0.2:8000 /v1/completions"
        ],
        "the prefill leg completed before the decode leg was sent"
    );
    // Workers of one rank are not steered.
    let plain = pair_one();
    let (f, _aborts) = fake(http::StatusCode::OK, http::StatusCode::OK);
    let (tx, _rx) = tokio::sync::oneshot::channel();
    drive(&f, Shape::new(PdProtocol::VllmNixl, &plain, 7, false), tx)
        .await
        .unwrap();
    assert!(f.sent.lock().unwrap().iter().all(|o| o.dp_rank().is_none()));
}

fn pair_one() -> Pair {
    pair("vllm-nixl", json!({}), json!({}))
}

#[tokio::test]
async fn a_concurrent_prefill_is_prefilled_when_its_answer_ends() {
    let pair = pair(
        "sglang-bootstrap",
        json!({"bootstrap_addr": "h:1"}),
        json!({}),
    );
    let (f, aborts) = fake(http::StatusCode::OK, http::StatusCode::OK);
    let (tx, rx) = tokio::sync::oneshot::channel();
    let shape = Shape::new(PdProtocol::SglangBootstrap, &pair, 7, false);
    let decode = drive(&f, shape, tx).await.unwrap();
    // The prefill's answer is drained in the background; then it counts as prefilled.
    rx.await.unwrap();
    // Reading the decode leg to its end aborts nothing: once the pair is gone, no abort
    // task holds the transport (whose `aborts` sender then closes).
    let (mut body, mut aborts) = (decode.body, aborts);
    while body.next().await.is_some() {}
    drop((body, f));
    assert!(aborts.recv().await.is_none());
}

#[tokio::test]
async fn an_sglang_prefill_that_fails_aborts_the_decode_leg_it_left_running() {
    let pair = pair(
        "sglang-bootstrap",
        json!({"bootstrap_addr": "h:1"}),
        json!({}),
    );
    let (f, mut aborts) = fake(http::StatusCode::SERVICE_UNAVAILABLE, http::StatusCode::OK);
    let (tx, rx) = tokio::sync::oneshot::channel();
    let shape = Shape::new(PdProtocol::SglangBootstrap, &pair, 7, false);
    let rid = sglang_rid(shape.room);
    let e = drive(&f, shape, tx).await.unwrap_err();
    assert!(matches!(e, LegError::Status { .. }), "{e:?}");
    assert!(rx.await.is_err(), "a failed prefill is never prefilled");
    // Every abort, once the last abort task let go of the transport.
    drop(f);
    let mut aborted = Vec::new();
    while let Some(abort) = aborts.recv().await {
        assert_eq!(
            serde_json::from_slice::<Value>(&abort.body).unwrap(),
            json!({"rid": rid})
        );
        aborted.push(abort.worker.as_str().to_owned());
    }
    assert_eq!(
        aborted,
        ["10.0.0.2:8000"],
        "the decode leg, not the failed prefill"
    );
}

#[tokio::test]
async fn an_sglang_decode_that_refuses_aborts_the_prefill_leg_still_running() {
    let pair = pair(
        "sglang-bootstrap",
        json!({"bootstrap_addr": "h:1"}),
        json!({}),
    );
    let (f, mut aborts) = fake(http::StatusCode::OK, http::StatusCode::BAD_REQUEST);
    let (tx, _rx) = tokio::sync::oneshot::channel();
    let shape = Shape::new(PdProtocol::SglangBootstrap, &pair, 7, false);
    let decode = drive(&f, shape, tx).await.unwrap();
    assert_eq!(decode.status, http::StatusCode::BAD_REQUEST);
    drop((decode, f));
    let mut aborted = Vec::new();
    while let Some(abort) = aborts.recv().await {
        aborted.push(abort.worker.as_str().to_owned());
    }
    assert_eq!(
        aborted,
        ["10.0.0.1:8000"],
        "the prefill leg, not the decode"
    );
}

#[test]
fn url_hosts() {
    assert_eq!(url_host("http://10.0.0.1:8000"), "10.0.0.1");
    assert_eq!(url_host("http://[::1]:8000/x"), "::1");
    assert_eq!(url_host("node"), "node");
}
