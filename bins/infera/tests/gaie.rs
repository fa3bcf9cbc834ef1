//! `infera gaie`, the Gateway API Inference Extension endpoint picker, end to end: a real etcd
//! (the backends harness), `infera worker mock` processes publishing their KV events over
//! ZeroMQ, the picker, and an independent gRPC client built from Envoy's ext_proc protos and
//! gRPC's health protos (`tests/peers/gaie_client.py`: PyPI `xds-protos`, `grpcio`,
//! `grpcio-health-checking`) driving whole Process streams as an Envoy gateway does.
#![allow(clippy::unwrap_used)]

mod common;

use base64::Engine as _;
use common::{
    DEADLINE, Peer, Proc, eventually, free_mock_port, free_port, get_json, http, mock_worker,
    mock_worker_command, python_peer, tokenizer_dir,
};
use infera_backends::testing::{EtcdServer, NatsServer};
use serde_json::{Value, json};
use std::io::Write as _;
use std::process::{Command, Stdio};

/// This file's tests run one at a time: each picks its ports by probing for free ones, and tests
/// started at once raced for them (a worker that lost never registered, and the picker never
/// routed).
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The port the picker names in `x-gateway-destination-endpoint` (not a worker's own port).
const DEST_PORT: u16 = 18_000;

/// The Python client, kept running for a test: one JSON line in, one JSON line out.
struct Client(Peer);

impl Client {
    fn start() -> Client {
        let mut client = Client(python_peer(
            "gaie_client.py",
            "python3 (the independent gRPC client)",
        ));
        let ready = client.line().unwrap_or_else(|| {
            panic!(
                "the gRPC client did not start: install its modules with \
                 `python3 -m pip install xds-protos grpcio grpcio-health-checking` \
                 (cargo xtask test does); its error is above"
            )
        });
        assert_eq!(ready, json!({"ready": true}));
        client
    }

    fn line(&mut self) -> Option<Value> {
        let line = self.0.lines.recv_timeout(DEADLINE).ok()?;
        Some(serde_json::from_str(&line).unwrap())
    }

    fn call(&mut self, request: &Value) -> Value {
        writeln!(self.0.stdin, "{request}").unwrap();
        self.0.stdin.flush().unwrap();
        self.line().expect("the gRPC client answers")
    }

    /// One whole Process stream of `messages` to the picker on `port`.
    fn process(&mut self, port: u16, tls: bool, messages: &[Value]) -> Value {
        self.call(&json!({
            "op": "process", "target": format!("127.0.0.1:{port}"), "tls": tls,
            "messages": messages,
        }))
    }

    fn health(&mut self, port: u16, tls: bool, service: &str) -> Value {
        self.call(&json!({
            "op": "health", "target": format!("127.0.0.1:{port}"), "tls": tls,
            "service": service,
        }))
    }
}

/// The picker, discovering workers in `etcd`, with `extra` flags (e.g. `--no-secure-serving`);
/// KV events over ZeroMQ unless they name `--kv-event-transport`.
struct Picker {
    port: u16,
    health_port: u16,
    tls: bool,
    _proc: Proc,
}

fn picker(etcd: &str, extra: &[&str]) -> Picker {
    let (port, health_port) = (free_port(), free_port());
    let zmq: &[&str] = if extra.contains(&"--kv-event-transport") {
        &[]
    } else {
        &["--kv-event-transport", "zmq"]
    };
    let child = Command::new(env!("CARGO_BIN_EXE_infera"))
        .args(["gaie", "--router-tokenizer-path", &tokenizer_dir()])
        .args(["--host", "127.0.0.1", "--grpc-port", &port.to_string()])
        .args(["--grpc-health-port", &health_port.to_string()])
        .args(["--destination-port", &DEST_PORT.to_string()])
        .args(["--discovery-backend", "etcd", "--etcd-endpoint", etcd])
        .args(zmq)
        .args(extra)
        // Its warnings and errors reach the test's output; routine lines do not.
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    Picker {
        port,
        health_port,
        tls: !extra.contains(&"--no-secure-serving"),
        _proc: Proc(child),
    }
}

/// A stream as a gateway sends it: request headers, the body in three chunks, then the
/// worker's response headers and a body in two chunks.
fn whole_stream(body: &str) -> Vec<Value> {
    let cut = [body.len() / 3, 2 * body.len() / 3];
    let chunk = |a: usize, b: usize, end: bool| json!({"request_body": {"body_text": &body[a..b], "end_of_stream": end}});
    vec![
        json!({"request_headers": {"headers": {"headers": [
            {"key": ":path", "raw_value": b64("/v1/chat/completions")},
            {"key": ":method", "raw_value": b64("POST")},
        ]}, "end_of_stream": false}}),
        chunk(0, cut[0], false),
        chunk(cut[0], cut[1], false),
        chunk(cut[1], body.len(), true),
        json!({"response_headers": {"headers": {"headers": [
            {"key": ":status", "raw_value": b64("200")},
        ]}, "end_of_stream": false}}),
        json!({"response_body": {"body_text": "data: {\"a\":1}\n\n", "end_of_stream": false}}),
        json!({"response_body": {"body_text": "data: [DONE]\n\n", "end_of_stream": true}}),
    ]
}

/// A stream that only carries the request (what the picker decides on).
fn request_stream(body: &str) -> Vec<Value> {
    vec![json!({"request_body": {"body_text": body, "end_of_stream": true}})]
}

fn b64(text: &str) -> String {
    base64::engine::general_purpose::STANDARD.encode(text)
}

fn unb64(value: &Value) -> String {
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(value.as_str().unwrap_or(""))
        .unwrap();
    String::from_utf8(bytes).unwrap()
}

/// The headers a `CommonResponse` sets, by name.
fn set_headers(common: &Value) -> serde_json::Map<String, Value> {
    common["header_mutation"]["set_headers"]
        .as_array()
        .map(|all| {
            all.iter()
                .map(|h| {
                    assert_eq!(h["append_action"], "OVERWRITE_IF_EXISTS_OR_ADD");
                    (
                        h["header"]["key"].as_str().unwrap().to_owned(),
                        Value::String(unb64(&h["header"]["raw_value"])),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

/// The routing headers of a decided request stream (its one request-body response).
fn routed(answer: &Value) -> serde_json::Map<String, Value> {
    let responses = answer["responses"]
        .as_array()
        .unwrap_or_else(|| panic!("{answer}"));
    let decision = responses
        .iter()
        .find_map(|r| r.get("request_body"))
        .unwrap_or_else(|| panic!("no request-body response: {answer}"));
    set_headers(&decision["response"])
}

fn chat_body(content: &str) -> String {
    json!({
        "model": tokenizer_dir(),
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 4,
    })
    .to_string()
}

/// Polls until the picker routes (its worker is registered).
fn until_routed(client: &mut Client, picker: &Picker) {
    let body = chat_body("readiness probe");
    eventually("the picker to route", || {
        routed_worker(&client.process(picker.port, picker.tls, &request_stream(&body))).is_some()
    });
}

fn routed_worker(answer: &Value) -> Option<String> {
    let responses = answer["responses"].as_array()?;
    let decision = responses.iter().find_map(|r| r.get("request_body"))?;
    set_headers(&decision["response"])
        .get("x-worker-instance-id")
        .and_then(|v| v.as_str().map(str::to_owned))
}

#[tokio::test]
async fn a_whole_stream_is_answered_phase_by_phase_with_the_picked_workers_endpoint() {
    let _one = ONE_AT_A_TIME.lock().await;
    let etcd = EtcdServer::start().await.expect("etcd starts");
    let tok = tokenizer_dir();
    let ports = [free_mock_port(), free_mock_port()];
    let _workers: Vec<Proc> = ports
        .iter()
        .map(|p| mock_worker(&tok, &etcd.endpoint(), *p, &[]))
        .collect();
    let picker = picker(&etcd.endpoint(), &["--no-secure-serving"]);
    let mut client = Client::start();
    eventually("the picker to serve its health check", || {
        client.health(picker.health_port, false, "inference-extension")["status"] == "SERVING"
    });
    let body = chat_body("Where is my order? It was due on Monday.");
    eventually("the picker to know the model", || {
        routed_worker(&client.process(picker.port, false, &request_stream(&body))).is_some()
    });

    let answer = client.process(picker.port, false, &whole_stream(&body));
    let responses = answer["responses"]
        .as_array()
        .unwrap_or_else(|| panic!("{answer}"));
    // One answer per phase Envoy waits on: headers, the body's end, response headers, and each
    // response chunk; none for the body's first two chunks.
    let phases: Vec<&str> = responses
        .iter()
        .map(|r| r.as_object().unwrap().keys().next().unwrap().as_str())
        .collect();
    assert_eq!(
        phases,
        [
            "request_headers",
            "request_body",
            "response_headers",
            "response_body",
            "response_body"
        ]
    );
    assert!(set_headers(&responses[0]["request_headers"]["response"]).is_empty());
    let decision = &responses[1]["request_body"]["response"];
    let headers = set_headers(decision);
    let worker = headers["x-worker-instance-id"].as_str().unwrap();
    assert!(
        ports.iter().any(|p| worker == format!("127.0.0.1:{p}")),
        "{worker} is one of the workers"
    );
    assert_eq!(
        headers["x-gateway-destination-endpoint"],
        format!("127.0.0.1:{DEST_PORT}")
    );
    assert!(!headers.contains_key("x-prefill-instance-id"));
    assert_eq!(decision["clear_route_cache"], true);
    let echoed = &decision["body_mutation"]["streamed_response"];
    assert_eq!(
        unb64(&echoed["body"]),
        body,
        "the whole body is streamed back"
    );
    assert_eq!(echoed["end_of_stream"], true);
    let chunk =
        |i: usize| &responses[i]["response_body"]["response"]["body_mutation"]["streamed_response"];
    assert_eq!(unb64(&chunk(3)["body"]), "data: {\"a\":1}\n\n");
    assert_eq!(chunk(3).get("end_of_stream"), None, "false is not written");
    assert_eq!(unb64(&chunk(4)["body"]), "data: [DONE]\n\n");
    assert_eq!(chunk(4)["end_of_stream"], true);

    // A request without a body is continued undecided, answered once.
    let answer = client.process(
        picker.port,
        false,
        &[json!({"request_headers": {"end_of_stream": true}})],
    );
    assert_eq!(
        answer["responses"].as_array().map(Vec::len),
        Some(1),
        "{answer}"
    );
    assert!(set_headers(&answer["responses"][0]["request_headers"]["response"]).is_empty());
}

/// Three workers publishing KV events over `nats` (a broker URL) or ZeroMQ, and a picker
/// reading them the same way: a prompt warmed on one worker is picked there.
async fn cached_prompt_is_picked_where_it_is(nats: Option<&NatsServer>) {
    let etcd = EtcdServer::start().await.expect("etcd starts");
    let tok = tokenizer_dir();
    let kv: Vec<String> = match nats {
        None => vec!["--kv-event-transport".into(), "zmq".into()],
        Some(n) => vec![
            "--kv-event-transport".into(),
            "nats".into(),
            "--nats-server".into(),
            n.url(),
        ],
    };
    let ports: Vec<u16> = (0..3).map(|_| free_mock_port()).collect();
    let _workers: Vec<Proc> = ports
        .iter()
        .map(|port| {
            let child = mock_worker_command(&tok, &etcd.endpoint(), *port)
                .args(["--request-transport", "http"])
                .args(&kv)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap();
            Proc(child)
        })
        .collect();
    for p in &ports {
        eventually("every worker to serve", || {
            get_json(*p, "/health").is_some()
        });
    }
    let mut flags: Vec<&str> = vec!["--no-secure-serving"];
    flags.extend(kv.iter().map(String::as_str));
    let picker = picker(&etcd.endpoint(), &flags);
    let mut client = Client::start();
    let mut prompt = String::from("You are the support assistant of a large store. Policies:");
    for i in 0..300 {
        prompt.push_str(&format!(" rule{} applies", i % 97));
    }
    let body = chat_body(&prompt);
    let pick = |client: &mut Client| {
        routed_worker(&client.process(picker.port, false, &request_stream(&body)))
    };
    let mut first = None;
    eventually("the picker to route", || {
        first = pick(&mut client);
        first.is_some()
    });
    // Warm the prompt on a worker the uncached prompt did not go to, through its own API.
    let first = first.unwrap();
    let warm = *ports
        .iter()
        .find(|p| first != format!("127.0.0.1:{p}"))
        .unwrap();
    let (status, text) = http(warm, "POST", "/v1/chat/completions", &body).unwrap();
    assert_eq!(status, 200, "{text}");
    let warm_id = format!("127.0.0.1:{warm}");
    eventually("the picker to see the cached prompt", || {
        pick(&mut client).as_deref() == Some(&warm_id)
    });
    // Each stream has ended before the next: no load tips the balance, the cache decides.
    for _ in 0..5 {
        assert_eq!(pick(&mut client).as_deref(), Some(warm_id.as_str()));
    }
}

#[tokio::test]
async fn a_prompt_cached_on_one_worker_is_picked_there_over_zmq() {
    let _one = ONE_AT_A_TIME.lock().await;
    cached_prompt_is_picked_where_it_is(None).await;
}

#[tokio::test]
async fn a_prompt_cached_on_one_worker_is_picked_there_over_nats() {
    let _one = ONE_AT_A_TIME.lock().await;
    let nats = NatsServer::start().await.expect("nats-server starts");
    cached_prompt_is_picked_where_it_is(Some(&nats)).await;
}

#[tokio::test]
async fn a_prefill_decode_pair_is_answered_with_both_workers() {
    let _one = ONE_AT_A_TIME.lock().await;
    let etcd = EtcdServer::start().await.expect("etcd starts");
    let tok = tokenizer_dir();
    let prefill_port = free_mock_port();
    let decode_port = free_mock_port();
    let pd = |role: &'static str| {
        [
            "--disaggregation-mode",
            role,
            "--disaggregation-protocol",
            "sglang-bootstrap",
            "--disaggregation-bootstrap-port",
            "18998",
        ]
    };
    let _prefill = mock_worker(&tok, &etcd.endpoint(), prefill_port, &pd("prefill"));
    let _decode = mock_worker(&tok, &etcd.endpoint(), decode_port, &pd("decode"));
    let picker = picker(&etcd.endpoint(), &["--no-secure-serving"]);
    let mut client = Client::start();
    let body =
        json!({"model": tok, "prompt": "Hand the KV cache over.", "max_tokens": 4}).to_string();
    let mut headers = serde_json::Map::new();
    eventually("the picker to route to the pair", || {
        let answer = client.process(picker.port, false, &request_stream(&body));
        headers = match answer["responses"][0].get("request_body") {
            Some(_) => routed(&answer),
            None => serde_json::Map::new(),
        };
        headers.contains_key("x-prefill-instance-id")
    });
    assert_eq!(
        headers["x-worker-instance-id"],
        format!("127.0.0.1:{decode_port}")
    );
    assert_eq!(
        headers["x-prefill-instance-id"],
        format!("127.0.0.1:{prefill_port}")
    );
    assert_eq!(
        headers["x-gateway-destination-endpoint"],
        format!("127.0.0.1:{DEST_PORT}")
    );
}

#[tokio::test]
async fn a_request_the_router_cannot_read_is_answered_at_once_with_the_reason() {
    let _one = ONE_AT_A_TIME.lock().await;
    let etcd = EtcdServer::start().await.expect("etcd starts");
    let tok = tokenizer_dir();
    let port = free_mock_port();
    let _worker = mock_worker(&tok, &etcd.endpoint(), port, &[]);
    let picker = picker(&etcd.endpoint(), &["--no-secure-serving"]);
    let mut client = Client::start();
    until_routed(&mut client, &picker);

    let immediate = |client: &mut Client, body: &str| {
        let answer = client.process(picker.port, false, &request_stream(body));
        let responses = answer["responses"]
            .as_array()
            .unwrap_or_else(|| panic!("{answer}"));
        assert_eq!(responses.len(), 1, "{answer}");
        let immediate = responses[0]["immediate_response"].clone();
        let error: Value = serde_json::from_str(&unb64(&immediate["body"])).unwrap();
        (
            immediate["status"]["code"].as_str().unwrap().to_owned(),
            error,
        )
    };
    let (status, error) = immediate(&mut client, "{\"model\": ");
    assert_eq!(status, "BadRequest");
    let message = error["error"]["message"].as_str().unwrap();
    assert!(message.contains("not valid JSON"), "{message}");
    let (status, error) = immediate(&mut client, &json!({"model": tok}).to_string());
    assert_eq!(status, "BadRequest");
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("`prompt` is required"),
        "{error}"
    );
    let (status, error) = immediate(
        &mut client,
        &json!({"model": "no-such-model", "prompt": "hi"}).to_string(),
    );
    assert_eq!(status, "NotFound");
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("no-such-model"),
        "{error}"
    );

    // A message with no phase is not a request at all: the stream fails with the reason.
    let answer = client.process(picker.port, false, &[json!({})]);
    assert_eq!(answer["error"]["code"], "INVALID_ARGUMENT", "{answer}");
    assert!(
        answer["error"]["details"]
            .as_str()
            .unwrap()
            .contains("without a phase")
    );
}

#[tokio::test]
async fn health_is_serving_over_tls_and_plaintext_and_tls_streams_are_routed() {
    let _one = ONE_AT_A_TIME.lock().await;
    let etcd = EtcdServer::start().await.expect("etcd starts");
    let tok = tokenizer_dir();
    let port = free_mock_port();
    let _worker = mock_worker(&tok, &etcd.endpoint(), port, &[]);
    // --secure-serving is the default.
    let picker = picker(&etcd.endpoint(), &[]);
    assert!(picker.tls);
    let mut client = Client::start();
    eventually("the picker's health port to answer", || {
        client.health(picker.health_port, false, "inference-extension")["status"] == "SERVING"
    });
    assert_eq!(
        client.health(picker.health_port, false, "")["status"],
        "SERVING"
    );
    // The ext_proc port answers health checks too, over TLS (the gateway's check).
    assert_eq!(
        client.health(picker.port, true, "inference-extension")["status"],
        "SERVING"
    );
    let unknown = client.health(picker.health_port, false, "something-else");
    assert_eq!(unknown["error"]["code"], "NOT_FOUND", "{unknown}");
    // Plaintext is refused on the TLS port.
    let plain = client.health(picker.port, false, "inference-extension");
    assert_eq!(plain["error"]["code"], "UNAVAILABLE", "{plain}");

    until_routed(&mut client, &picker);
    let answer = client.process(picker.port, true, &whole_stream(&chat_body("over TLS")));
    assert_eq!(
        routed(&answer)["x-worker-instance-id"],
        format!("127.0.0.1:{port}")
    );
}
