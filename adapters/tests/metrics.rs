//! The server's `/metrics` read by the reference Prometheus text parser (PyPI
//! `prometheus-client`, through `tests/peers/prometheus_families.py`), after real traffic
//! through the router: every family the Python Infera's server exports is there with its name,
//! type, label names and buckets, so dashboards and alerts written for it keep working, and the
//! values say what the traffic did. The mock engine's `/metrics` is read the same way: its
//! vLLM-named families and its own. `cargo xtask test` installs the parser.

mod common;

use common::fleet::{BLOCK, Front, MODEL, Mock, record};
use common::{body_of, post, request};
use infera_core::policy::PolicyKind;
use serde_json::{Value, json};
use std::io::Write as _;
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Stdio};

/// The Python Infera's families (its `infera/server/metrics.py`): name, type, label names.
const PYTHON_FAMILIES: [(&str, &str, &[&str]); 16] = [
    ("infera_router_picks", "counter", &["role", "worker_id"]),
    ("infera_router_pick_cache_hits", "histogram", &["role"]),
    ("infera_router_pick_request_blocks", "histogram", &["role"]),
    (
        "infera_request_duration_seconds",
        "histogram",
        &["router", "outcome"],
    ),
    ("infera_request_inflight", "gauge", &["router"]),
    (
        "infera_pd_dispatch_duration_seconds",
        "histogram",
        &["leg", "worker_id"],
    ),
    ("infera_migrations", "counter", &["reason"]),
    ("infera_migrations_failed", "counter", &["reason"]),
    ("infera_pd_bootstrap_failures", "counter", &["reason"]),
    ("infera_active_workers", "gauge", &["disagg_mode"]),
    (
        "infera_router_worker_breaker_state",
        "gauge",
        &["worker_id"],
    ),
    (
        "infera_router_worker_breaker_trips",
        "counter",
        &["worker_id"],
    ),
    ("infera_policy_active_blocks", "gauge", &["worker_id"]),
    ("infera_policy_cache_view_size", "gauge", &["worker_id"]),
    ("infera_cache_control_seen", "counter", &["retention"]),
    ("infera_cache_locality_skipped", "counter", &["reason"]),
];

/// Families this test's traffic (mixed workers, no failures) does not touch.
const QUIET: [&str; 5] = [
    "infera_pd_dispatch_duration_seconds",
    "infera_migrations",
    "infera_migrations_failed",
    "infera_pd_bootstrap_failures",
    "infera_router_worker_breaker_trips",
];

/// The Python Infera's histogram buckets (`+Inf` last).
const BLOCK_BUCKETS: &[f64] = &[
    0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0,
];
const REQUEST_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// `/metrics` of the server or mock engine at `addr`, parsed by the reference parser.
async fn families(addr: SocketAddr) -> Value {
    let (status, text) = common::exchange(addr, "GET", "/metrics", Vec::new()).await;
    assert_eq!(status, 200, "{text}");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/peers/prometheus_families.py");
    let mut child = Command::new("python3")
        .arg(script)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python3 runs the parser");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(text.as_bytes())
        .expect("exposition written to the parser");
    let out = child.wait_with_output().expect("the parser ends");
    assert!(
        out.status.success(),
        "the reference parser refused the exposition (install it with `python3 -m pip install \
         prometheus-client`; cargo xtask test does): {}\n{text}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("the parser's JSON")
}

/// The samples of `family` named `sample` whose labels include `with`.
fn samples<'a>(
    families: &'a Value,
    family: &str,
    sample: &str,
    with: &[(&str, &str)],
) -> Vec<&'a Value> {
    families[family]["samples"]
        .as_array()
        .unwrap_or_else(|| panic!("family {family} in {families}"))
        .iter()
        .filter(|s| s[0] == sample && with.iter().all(|(k, v)| s[1][*k] == *v))
        .collect()
}

/// The sum of the values of [`samples`].
fn value(families: &Value, family: &str, sample: &str, with: &[(&str, &str)]) -> f64 {
    samples(families, family, sample, with)
        .iter()
        .map(|s| s[2].as_f64().expect("a number"))
        .sum()
}

/// The bucket bounds of one histogram series, as written (`le`), in order.
fn buckets(families: &Value, family: &str, with: &[(&str, &str)]) -> Vec<String> {
    let mut bounds: Vec<String> = samples(families, family, &format!("{family}_bucket"), with)
        .iter()
        .map(|s| s[1]["le"].as_str().expect("le").to_owned())
        .collect();
    let bound = |le: &str| le.parse::<f64>().unwrap_or(f64::INFINITY);
    bounds.sort_by(|a, b| bound(a).total_cmp(&bound(b)));
    bounds
}

/// Bounds as the Python client writes them (its `floatToGoString`): Python's `repr` (`1.0`,
/// `0.005`), switching to Go's exponent form past six integer digits (`1.048576e+06`), `+Inf`
/// last.
fn python_bounds(bounds: &[f64]) -> Vec<String> {
    let go = |b: f64| {
        let s = format!("{b:?}");
        match s.find('.') {
            Some(dot) if b > 0.0 && dot > 6 => {
                let digits = format!("{}.{}{}", &s[..1], &s[1..dot], &s[dot + 1..]);
                format!("{}e+0{}", digits.trim_end_matches(['0', '.']), dot - 1)
            }
            _ => s,
        }
    };
    let mut le: Vec<String> = bounds.iter().map(|&b| go(b)).collect();
    le.push("+Inf".into());
    le
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_infera_families_are_exported_with_their_names_types_labels_and_buckets() {
    let mut mocks = [Mock::start().await, Mock::start().await];
    let front = Front::start(PolicyKind::KV_AWARE, 1).await;
    for mock in &mocks {
        front.state.register_worker(record(mock.addr));
    }

    // Long enough to fill KV blocks, which the mocks then announce.
    let prompt = format!("the metrics of a plain prompt:{}", " and more".repeat(100));
    let requests = [
        json!({"model": MODEL, "prompt": prompt, "max_tokens": 2,
            "prompt_cache_retention": "24h"}),
        json!({"model": MODEL, "max_tokens": 2,
            "messages": [{"role": "user", "content": "and those of a chat"}]}),
        // An image: routed by load, its locality skipped (the router cannot hash the image).
        json!({"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "what is in this picture?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}),
    ];
    for (i, body) in requests.iter().enumerate() {
        let path = if i == 0 {
            "/v1/completions"
        } else {
            "/v1/chat/completions"
        };
        let (status, answer) = post(front.addr, path, body).await;
        assert_eq!(status, 200, "request {i}: {answer}");
    }
    for mock in &mut mocks {
        mock.feed(&front.state);
    }
    let got = families(front.addr).await;

    for (name, kind, labels) in PYTHON_FAMILIES {
        // A family with no series yet is not exposed (nor is it by the Python client's
        // parser's view of a labelled family): only PD, migration and breaker-trip families
        // see no traffic here. The library's own unit test sees every family.
        if got[name].is_null() && QUIET.contains(&name) {
            continue;
        }
        assert_eq!(got[name]["type"], kind, "{name}: {}", got[name]);
        for sample in got[name]["samples"].as_array().expect("samples") {
            let mut have: Vec<&str> = sample[1]
                .as_object()
                .expect("labels")
                .keys()
                .map(String::as_str)
                .filter(|k| *k != "le")
                .collect();
            have.sort_unstable();
            let mut want = labels.to_vec();
            want.sort_unstable();
            assert_eq!(have, want, "{name}'s labels: {sample}");
        }
    }
    let mixed = [("role", "mixed")];
    for family in [
        "infera_router_pick_cache_hits",
        "infera_router_pick_request_blocks",
    ] {
        assert_eq!(
            buckets(&got, family, &mixed),
            python_bounds(BLOCK_BUCKETS),
            "{family}"
        );
    }
    let ok = [("router", "mixed"), ("outcome", "ok")];
    assert_eq!(
        buckets(&got, "infera_request_duration_seconds", &ok),
        python_bounds(REQUEST_BUCKETS)
    );

    // What the traffic did.
    let picks = "infera_router_picks";
    assert_eq!(value(&got, picks, "infera_router_picks_total", &mixed), 3.0);
    let blocks = "infera_router_pick_request_blocks";
    assert_eq!(value(&got, blocks, &format!("{blocks}_count"), &mixed), 3.0);
    let duration = "infera_request_duration_seconds";
    assert_eq!(
        value(&got, duration, &format!("{duration}_count"), &ok),
        3.0
    );
    let inflight = "infera_request_inflight";
    assert_eq!(value(&got, inflight, inflight, &[("router", "mixed")]), 0.0);
    let active = "infera_active_workers";
    assert_eq!(
        value(&got, active, active, &[("disagg_mode", "mixed")]),
        2.0
    );
    let breaker = "infera_router_worker_breaker_state";
    assert_eq!(samples(&got, breaker, breaker, &[]).len(), 2);
    assert_eq!(
        value(&got, breaker, breaker, &[]),
        0.0,
        "every breaker closed"
    );
    let view = "infera_policy_cache_view_size";
    assert_eq!(samples(&got, view, view, &[]).len(), 2, "one per worker");
    assert!(
        value(&got, view, view, &[]) > 0.0,
        "the mocks' KV events were fed"
    );
    let seen = "infera_cache_control_seen";
    let total = format!("{seen}_total");
    assert_eq!(value(&got, seen, &total, &[("retention", "long")]), 1.0);
    assert_eq!(value(&got, seen, &total, &[("retention", "none")]), 2.0);
    let skipped = "infera_cache_locality_skipped";
    let total = format!("{skipped}_total");
    assert_eq!(
        value(&got, skipped, &total, &[("reason", "multimodal")]),
        1.0
    );
    // Ours, beside them.
    let decisions = "infera_router_decisions";
    let total = format!("{decisions}_total");
    assert_eq!(
        value(&got, decisions, &total, &[("outcome", "routed")]),
        3.0
    );
    assert_eq!(
        value(
            &got,
            "infera_requests",
            "infera_requests_total",
            &[("status", "ok")]
        ),
        3.0
    );

    front.stop().await;
    for mock in mocks {
        mock.stop().await;
    }
}

/// The SLA planner's histograms (`--enable-sla-metrics`), as the Python Infera defines them.
const SLA_FAMILIES: [(&str, &[f64]); 4] = [
    (
        "infera_time_to_first_token_seconds",
        &[0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0],
    ),
    (
        "infera_inter_token_latency_seconds",
        &[
            0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 1.0,
        ],
    ),
    (
        "infera_input_sequence_tokens",
        &[
            64.0, 256.0, 1024.0, 4096.0, 16384.0, 65536.0, 262144.0, 1048576.0,
        ],
    ),
    (
        "infera_output_sequence_tokens",
        &[4.0, 16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0, 65536.0],
    ),
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sla_metrics_record_streams_and_whole_answers_only_when_enabled() {
    let mock = Mock::start().await;
    let front = Front::start(PolicyKind::KV_AWARE, 1).await;
    front.state.register_worker(record(mock.addr));
    let chat = |stream: bool| {
        json!({"model": MODEL, "max_tokens": 4, "stream": stream,
            "messages": [{"role": "user", "content": "count the tokens of this answer"}]})
    };
    // Off by default: nothing is recorded.
    let (status, _) = post(front.addr, "/v1/chat/completions", &chat(false)).await;
    assert_eq!(status, 200);
    let got = families(front.addr).await;
    for (name, _) in SLA_FAMILIES {
        assert!(
            got[name].is_null(),
            "{name} recorded while off: {}",
            got[name]
        );
    }

    front.state.service().set_sla_metrics(true);
    let (status, answer) = post(front.addr, "/v1/chat/completions", &chat(false)).await;
    assert_eq!(status, 200, "{answer}");
    let prompt_tokens = answer["usage"]["prompt_tokens"].as_f64().expect("usage");
    let streamed = request(
        front.addr,
        "POST",
        "/v1/chat/completions",
        chat(true).to_string().into_bytes(),
    )
    .await;
    let (status, text) = body_of(streamed).await;
    assert_eq!(status, 200, "{text}");
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");

    let got = families(front.addr).await;
    let labels = [("router", "mixed"), ("model", MODEL)];
    for (name, bounds) in SLA_FAMILIES {
        assert_eq!(got[name]["type"], "histogram", "{name}");
        assert_eq!(
            buckets(&got, name, &labels),
            python_bounds(bounds),
            "{name}"
        );
    }
    let count = |name: &str| value(&got, name, &format!("{name}_count"), &labels);
    let sum = |name: &str| value(&got, name, &format!("{name}_sum"), &labels);
    // Both answers have lengths; only the stream has a first token and gaps between tokens.
    assert_eq!(count("infera_input_sequence_tokens"), 2.0);
    assert_eq!(sum("infera_input_sequence_tokens"), 2.0 * prompt_tokens);
    assert_eq!(count("infera_output_sequence_tokens"), 2.0);
    assert_eq!(sum("infera_output_sequence_tokens"), 8.0, "4 tokens each");
    assert_eq!(count("infera_time_to_first_token_seconds"), 1.0);
    assert_eq!(count("infera_inter_token_latency_seconds"), 1.0);

    front.stop().await;
    mock.stop().await;
}

/// Every family of a mock engine's `/metrics` (as the parser names them: counters without
/// `_total`) and its type: vLLM's names, which dashboards and the launcher's block-size probe
/// read, and the mock's own.
const MOCK_FAMILIES: [(&str, &str); 25] = [
    ("vllm:num_requests_running", "gauge"),
    ("vllm:num_requests_waiting", "gauge"),
    ("vllm:kv_cache_usage_perc", "gauge"),
    ("vllm:gpu_cache_usage_perc", "gauge"),
    ("vllm:prefix_cache_queries", "counter"),
    ("vllm:prefix_cache_hits", "counter"),
    ("vllm:prompt_tokens", "counter"),
    ("vllm:generation_tokens", "counter"),
    ("vllm:request_success", "counter"),
    ("vllm:time_to_first_token_seconds", "histogram"),
    ("vllm:cache_config_info", "gauge"),
    ("infera_mock_requests", "counter"),
    ("infera_mock_requests_detached", "counter"),
    ("infera_mock_http_errors", "counter"),
    ("infera_mock_resident_blocks", "gauge"),
    ("infera_mock_kv_event_batches", "counter"),
    ("infera_mock_kv_events", "counter"),
    ("infera_mock_kv_events_missing_tokens", "counter"),
    ("infera_mock_kv_sink_closed", "gauge"),
    ("infera_mock_kvd_hit_tokens", "counter"),
    ("infera_mock_kvd_loaded_blocks", "counter"),
    ("infera_mock_kvd_saved_blocks", "counter"),
    ("infera_mock_kvd_errors", "counter"),
    ("infera_mock_tokenizer_loaded", "gauge"),
    ("infera_mock_step_lateness_seconds", "histogram"),
];

/// vLLM's buckets of `vllm:time_to_first_token_seconds`.
const VLLM_TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mock_engines_families_parse_with_their_names_types_labels_and_buckets() {
    let mock = Mock::start().await;
    let prompt = format!("a prompt for the mock's metrics:{}", " and more".repeat(40));
    let (status, answer) = post(
        mock.addr,
        "/v1/completions",
        &json!({"model": MODEL, "prompt": prompt, "max_tokens": 3}),
    )
    .await;
    assert_eq!(status, 200, "{answer}");
    let prompt_tokens = answer["usage"]["prompt_tokens"].as_f64().expect("usage");
    let streamed = request(
        mock.addr,
        "POST",
        "/v1/chat/completions",
        json!({"model": MODEL, "max_tokens": 3, "stream": true,
            "messages": [{"role": "user", "content": "and a streamed chat"}]})
        .to_string()
        .into_bytes(),
    )
    .await;
    let (status, text) = body_of(streamed).await;
    assert_eq!(status, 200, "{text}");
    let (status, _) = post(mock.addr, "/v1/completions", &json!({"model": MODEL})).await;
    assert_eq!(status, 400, "no prompt");

    let got = families(mock.addr).await;
    let mut exposed: Vec<&str> = got
        .as_object()
        .expect("families")
        .keys()
        .map(String::as_str)
        .collect();
    exposed.sort_unstable();
    let mut want: Vec<&str> = MOCK_FAMILIES.iter().map(|(name, _)| *name).collect();
    want.sort_unstable();
    assert_eq!(exposed, want, "the mock's families");
    for (name, kind) in MOCK_FAMILIES {
        assert_eq!(got[name]["type"], kind, "{name}: {}", got[name]);
        if name == "vllm:cache_config_info" {
            continue;
        }
        for sample in got[name]["samples"].as_array().expect("samples") {
            let labels = sample[1].as_object().expect("labels");
            assert_eq!(labels["model_name"], MODEL, "{name}: {sample}");
            assert!(
                labels.keys().all(|k| k == "model_name" || k == "le"),
                "{name}: {sample}"
            );
        }
    }
    // The launcher's block-size probe reads this series' labels.
    let config = samples(
        &got,
        "vllm:cache_config_info",
        "vllm:cache_config_info",
        &[],
    );
    assert_eq!(config.len(), 1);
    assert_eq!(config[0][1]["block_size"], BLOCK.to_string());
    assert_eq!(config[0][1]["enable_prefix_caching"], "True");
    assert_eq!(config[0][1]["num_gpu_blocks"], "4096");
    assert_eq!(config[0][2], 1.0);
    let ttft = "vllm:time_to_first_token_seconds";
    assert_eq!(buckets(&got, ttft, &[]), python_bounds(VLLM_TTFT_BUCKETS));
    let late = "infera_mock_step_lateness_seconds";
    assert_eq!(buckets(&got, late, &[]), ["+Inf"], "sum and count only");

    // What the traffic did: two generations, one request refused before the engine.
    let counter = |name: &str| value(&got, name, &format!("{name}_total"), &[]);
    assert_eq!(counter("infera_mock_requests"), 2.0);
    assert_eq!(counter("vllm:request_success"), 2.0);
    assert_eq!(counter("infera_mock_http_errors"), 1.0);
    assert_eq!(counter("vllm:generation_tokens"), 6.0);
    assert!(counter("vllm:prompt_tokens") > prompt_tokens);
    assert_eq!(value(&got, ttft, &format!("{ttft}_count"), &[]), 2.0);
    assert!(value(&got, late, &format!("{late}_count"), &[]) >= 1.0);
    assert!(
        counter("infera_mock_kv_events") >= 1.0,
        "the prompt filled blocks"
    );
    let gauge = |name: &str| value(&got, name, name, &[]);
    assert_eq!(gauge("vllm:num_requests_running"), 0.0);
    assert!((0.0..=1.0).contains(&gauge("vllm:kv_cache_usage_perc")));
    assert!(
        gauge("infera_mock_resident_blocks") >= 1.0,
        "the prompt's blocks stay cached"
    );
    assert_eq!(
        gauge("vllm:kv_cache_usage_perc"),
        gauge("vllm:gpu_cache_usage_perc")
    );
    assert_eq!(gauge("infera_mock_tokenizer_loaded"), 1.0);
    assert_eq!(gauge("infera_mock_kv_sink_closed"), 0.0);

    mock.stop().await;
}
