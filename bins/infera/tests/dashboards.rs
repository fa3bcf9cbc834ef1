//! The Grafana dashboards of `bins/deploy/grafana/`, checked against the binaries: every PromQL
//! query in them (panel targets and template variables) may name only series that the binaries
//! really export, read from their expositions, never from a list kept here:
//!
//! - a real `infera server` (its durable event log on SQLite, the trace recorder and the SLA
//!   histograms on) after traffic that touches every family a plain fleet can feed: a prompt
//!   with a retention hint, a streamed chat, an image (its cache locality skipped);
//! - a real `infera worker mock` (the vLLM-named families and its own);
//! - kvd's exposition, [`infera_kvd::metrics_text`] (kvd logs it; it serves no `/metrics`).
//!
//! A family with no series yet is not exposed at all, so families only failures feed (per-worker
//! breaker trips, migrations by reason, PD legs) cannot be checked here, and the dashboards leave
//! them out. The dashboards' form is checked too: unique uids, titles, the `${datasource}`
//! variable, panels with a description and at least one query.
//!
//! The server and the mock are separate processes: readiness and the end of the traffic's
//! bookkeeping are observed through their own pages, polled under a deadline.

mod common;

use common::{
    eventually, free_mock_port, free_port, get_json, http, metric, mock_worker, server,
    tokenizer_dir,
};
use infera_backends::testing::EtcdServer;
use serde_json::{Value, json};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// PromQL's aggregation operators: never metric names, followed by `(` or by `by`/`without`.
const AGGREGATIONS: [&str; 14] = [
    "sum",
    "min",
    "max",
    "avg",
    "group",
    "stddev",
    "stdvar",
    "count",
    "count_values",
    "bottomk",
    "topk",
    "quantile",
    "limitk",
    "limit_ratio",
];
/// PromQL's keywords and operators written as words.
const KEYWORDS: [&str; 8] = [
    "bool", "and", "or", "unless", "offset", "atan2", "inf", "nan",
];
/// Words followed by a parenthesised list of label names.
const LABEL_LISTS: [&str; 6] = [
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
];

/// The metric names a PromQL expression selects: every identifier outside string literals,
/// label matchers (`{…}`), range and subquery brackets (`[…]`) and label lists (`by (…)`,
/// `on (…)`, …) that is neither a function (followed by `(`), an aggregation, a keyword, nor a
/// number or duration. Grafana's variables (`$job`, `${datasource}`, `$__rate_interval`) are
/// skipped. Every other identifier counts, so a misspelt prefix is caught too.
fn metric_names(expr: &str) -> Vec<String> {
    let b = expr.as_bytes();
    let ident = |c: u8| c.is_ascii_alphanumeric() || c == b'_' || c == b':';
    let mut names = Vec::new();
    let (mut braces, mut brackets) = (0usize, 0usize);
    // `label_list`: the next `(` opens a list of label names; `in_list`: inside one.
    let (mut label_list, mut in_list) = (false, false);
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            quote @ (b'"' | b'\'' | b'`') => {
                i += 1;
                while i < b.len() && b[i] != quote {
                    i += if b[i] == b'\\' && quote != b'`' { 2 } else { 1 };
                }
            }
            b'{' => braces += 1,
            b'}' => braces = braces.saturating_sub(1),
            b'[' => brackets += 1,
            b']' => brackets = brackets.saturating_sub(1),
            b'(' if label_list => (label_list, in_list) = (false, true),
            b')' if in_list => in_list = false,
            b'$' => {
                i += 1;
                if b.get(i) == Some(&b'{') {
                    while i < b.len() && b[i] != b'}' {
                        i += 1;
                    }
                } else {
                    while i < b.len() && ident(b[i]) {
                        i += 1;
                    }
                    continue;
                }
            }
            c if c.is_ascii_digit() || c == b'.' => {
                while i < b.len() && (ident(b[i]) || b[i] == b'.') {
                    i += 1;
                }
                continue;
            }
            c if c.is_ascii_alphabetic() || c == b'_' || c == b':' => {
                let start = i;
                while i < b.len() && ident(b[i]) {
                    i += 1;
                }
                let word = &expr[start..i];
                let next = expr[i..].trim_start();
                if braces > 0 || brackets > 0 || in_list {
                    continue;
                }
                if LABEL_LISTS.contains(&word) {
                    label_list = next.starts_with('(');
                    continue;
                }
                let lower = word.to_ascii_lowercase();
                let keyword = AGGREGATIONS.contains(&word) || KEYWORDS.contains(&lower.as_str());
                if !keyword && !next.starts_with('(') {
                    names.push(word.to_owned());
                }
                continue;
            }
            _ => {}
        }
        i += 1;
    }
    names
}

/// The series names an exposition makes available to a query: every sample's name, and from
/// each `# TYPE` line the names its type implies (a counter's `…_total`, a histogram's
/// `_bucket`, `_sum` and `_count`, any other type's own name). A histogram's or counter's bare
/// family name is no series, and is not added.
fn exposed(text: &str, into: &mut BTreeSet<String>) {
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut parts = rest.split_whitespace();
            let (Some(name), Some(kind)) = (parts.next(), parts.next()) else {
                continue;
            };
            match kind {
                "counter" => {
                    let base = name.strip_suffix("_total").unwrap_or(name);
                    into.insert(format!("{base}_total"));
                }
                "histogram" => {
                    for suffix in ["_bucket", "_sum", "_count"] {
                        into.insert(format!("{name}{suffix}"));
                    }
                }
                _ => {
                    into.insert(name.to_owned());
                }
            }
        } else if !line.is_empty() && !line.starts_with('#') {
            let name = line.split(['{', ' ']).next().unwrap_or_default();
            into.insert(name.to_owned());
        }
    }
}

fn grafana_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/grafana")
}

/// Every dashboard of `bins/deploy/grafana/`, by file name, parsed.
fn dashboards() -> BTreeMap<String, Value> {
    let dir = grafana_dir();
    let mut out = BTreeMap::new();
    for entry in std::fs::read_dir(&dir).expect("bins/deploy/grafana is readable") {
        let path = entry.expect("a directory entry").path();
        if path.extension().is_none_or(|e| e != "json") {
            continue;
        }
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .expect("a UTF-8 file name")
            .to_owned();
        let text = std::fs::read_to_string(&path).expect("the dashboard is readable");
        let board: Value =
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("{name} is not JSON: {e}"));
        out.insert(name, board);
    }
    out
}

/// The panels of `panels` and of the rows among them (a collapsed row holds its own), rows left
/// out.
fn panels_of<'a>(panels: &'a Value, out: &mut Vec<&'a Value>) {
    for panel in panels.as_array().into_iter().flatten() {
        if panel["type"] == "row" {
            panels_of(&panel["panels"], out);
        } else {
            out.push(panel);
        }
    }
}

/// Every query of `board` with where it is: each panel target's `expr`, and the selector of each
/// template variable's `label_values(…)` or `query_result(…)`.
fn queries(board: &Value) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut panels = Vec::new();
    panels_of(&board["panels"], &mut panels);
    for panel in panels {
        let title = panel["title"].as_str().unwrap_or("?");
        for target in panel["targets"].as_array().into_iter().flatten() {
            if let Some(expr) = target["expr"].as_str() {
                out.push((format!("panel {title:?}"), expr.to_owned()));
            }
        }
    }
    for var in board["templating"]["list"].as_array().into_iter().flatten() {
        if var["type"] != "query" {
            continue;
        }
        let name = var["name"].as_str().unwrap_or("?");
        let query = var["query"]["query"].as_str().or(var["query"].as_str());
        for query in [query, var["definition"].as_str()].into_iter().flatten() {
            let query = query.trim();
            let selector = if let Some(args) = query.strip_prefix("label_values(") {
                // `label_values(selector, label)`; `label_values(label)` selects no metric.
                args.strip_suffix(')')
                    .and_then(|a| a.rsplit_once(','))
                    .map(|(selector, _)| selector)
            } else if let Some(expr) = query.strip_prefix("query_result(") {
                expr.strip_suffix(')')
            } else {
                None
            };
            if let Some(selector) = selector {
                out.push((format!("variable ${name}"), selector.to_owned()));
            }
        }
    }
    out
}

#[test]
fn the_extractor_finds_metric_names_and_skips_labels_functions_and_variables() {
    let cases: [(&str, &[&str]); 8] = [
        (
            r#"histogram_quantile(0.99, sum by (le) (rate(infera_x_bucket{model="m"}[5m])))"#,
            &["infera_x_bucket"],
        ),
        (
            r#"sum without (instance) (rate(vllm:prompt_tokens_total{job=~"$job"}[$__interval]))
               / on (job) group_left sum(infera_y)"#,
            &["vllm:prompt_tokens_total", "infera_y"],
        ),
        (
            r#"label_replace(infera_a, "dst", "infera_not_a_metric", "src", "(.*)")"#,
            &["infera_a"],
        ),
        (
            "infera_b > bool 0 and infera_c == 1 unless infera_d offset 5m",
            &["infera_b", "infera_c", "infera_d"],
        ),
        (
            r#"sum(rate(infera_e_total{a!="x",b!~'y'}[5m:30s])) by (worker_id, le) * 1e3"#,
            &["infera_e_total"],
        ),
        (
            "max by (worker_id) (infera_g) * on(worker_id) group_left infera_h",
            &["infera_g", "infera_h"],
        ),
        (
            r#"sum(increase(infra_typo_total{job=~"${job}"}[$__range])) / scalar(sum(x))"#,
            &["infra_typo_total", "x"],
        ),
        (
            "topk(5, count_values(\"v\", sglang:num_queue_reqs))",
            &["sglang:num_queue_reqs"],
        ),
    ];
    for (expr, want) in cases {
        assert_eq!(metric_names(expr), want, "{expr}");
    }
    let mut names = BTreeSet::new();
    exposed(
        "# TYPE a_total counter\na_total 1\n# TYPE h histogram\n# TYPE g gauge\n\
         c:x_info{k=\"v\"} 1\n",
        &mut names,
    );
    let want = ["a_total", "c:x_info", "g", "h_bucket", "h_count", "h_sum"];
    assert_eq!(names, want.map(str::to_owned).into());
}

#[test]
fn every_dashboard_is_well_formed() {
    let boards = dashboards();
    let want: BTreeSet<&str> = ["engines.json", "kvd.json", "routing.json", "server.json"].into();
    assert!(
        want.iter().all(|w| boards.contains_key(*w)),
        "missing dashboards: {:?}",
        boards.keys().collect::<Vec<_>>()
    );
    let mut uids = BTreeSet::new();
    for (name, board) in &boards {
        let uid = board["uid"].as_str().filter(|u| !u.is_empty());
        let uid = uid.unwrap_or_else(|| panic!("{name}: no uid"));
        assert!(uids.insert(uid.to_owned()), "{name}: uid {uid} twice");
        assert!(
            board["title"].as_str().is_some_and(|t| !t.is_empty()),
            "{name}: no title"
        );
        assert!(
            board["schemaVersion"].as_u64() >= Some(39),
            "{name}: schemaVersion {}",
            board["schemaVersion"]
        );
        let vars = board["templating"]["list"].as_array();
        let datasource = vars
            .into_iter()
            .flatten()
            .find(|v| v["name"] == "datasource");
        assert!(
            datasource.is_some_and(|v| v["type"] == "datasource" && v["query"] == "prometheus"),
            "{name}: no Prometheus datasource variable"
        );
        let uses_variable = json!({"type": "prometheus", "uid": "${datasource}"});
        let mut panels = Vec::new();
        panels_of(&board["panels"], &mut panels);
        assert!(panels.len() >= 4, "{name}: {} panels", panels.len());
        let mut ids = BTreeSet::new();
        for panel in panels {
            let title = panel["title"].as_str().unwrap_or_default();
            assert!(!title.is_empty(), "{name}: a panel without a title");
            let id = panel["id"].as_u64();
            assert!(
                id.is_some_and(|id| ids.insert(id)),
                "{name}: {title:?} has no id, or another panel's"
            );
            assert!(
                ["timeseries", "stat"].contains(&panel["type"].as_str().unwrap_or_default()),
                "{name}: {title:?} is a {} panel",
                panel["type"]
            );
            assert!(
                panel["description"].as_str().is_some_and(|d| !d.is_empty()),
                "{name}: {title:?} has no description"
            );
            assert_eq!(panel["datasource"], uses_variable, "{name}: {title:?}");
            let targets = panel["targets"].as_array().map_or(&[][..], Vec::as_slice);
            assert!(!targets.is_empty(), "{name}: {title:?} has no target");
            for target in targets {
                let expr = target["expr"].as_str().unwrap_or_default();
                assert!(
                    !metric_names(expr).is_empty(),
                    "{name}: {title:?}: {expr:?} names no metric"
                );
                assert_eq!(target["datasource"], uses_variable, "{name}: {title:?}");
            }
        }
    }
}

/// Every series name the server, the mock engine and kvd expose, read from their expositions.
async fn exported_series() -> BTreeSet<String> {
    let etcd = EtcdServer::start().await.expect("etcd starts");
    let tok = tokenizer_dir();
    let dir = tempfile::tempdir().expect("a temp dir");
    let log = format!("sqlite:{}", dir.path().join("events.db").display());
    let trace = dir.path().join("trace");
    let trace = trace.to_str().expect("a UTF-8 path");
    let worker_port = free_mock_port();
    let _worker = mock_worker(&tok, &etcd.endpoint(), worker_port, &["--speedup", "1000"]);
    let port = free_port();
    let flags = [
        "--enable-sla-metrics",
        "--event-log",
        log.as_str(),
        "--record-trace",
        trace,
    ];
    let _server = server(&tok, &etcd.endpoint(), port, &flags);
    eventually("the worker to be discovered", || {
        get_json(port, "/health").is_some_and(|h| h["active_workers"] == 1)
    });

    let prompt = format!("a dashboard's prompt:{}", " and more".repeat(100));
    let requests = [
        (
            "/v1/completions",
            json!({"model": tok, "prompt": prompt, "max_tokens": 2,
                "prompt_cache_retention": "24h"}),
        ),
        (
            "/v1/chat/completions",
            json!({"model": tok, "max_tokens": 4, "stream": true,
                "messages": [{"role": "user", "content": "count the tokens of this answer"}]}),
        ),
        // An image: routed by load, its cache locality skipped.
        (
            "/v1/chat/completions",
            json!({"model": tok, "max_tokens": 2, "messages": [{"role": "user", "content": [
                {"type": "text", "text": "what is in this picture?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}),
        ),
    ];
    for (path, body) in &requests {
        let (status, answer) = http(port, "POST", path, &body.to_string()).expect("an answer");
        assert_eq!(status, 200, "{path}: {answer}");
    }
    // The SLA histograms are the last a finished request records.
    eventually("the SLA histograms to count every request", || {
        metric(port, "infera_output_sequence_tokens_count") == Some(requests.len() as u64)
    });

    let mut names = BTreeSet::new();
    let scrape = |port: u16| {
        let (status, text) = http(port, "GET", "/metrics", "").expect("a /metrics page");
        assert_eq!(status, 200, "{text}");
        text
    };
    let (server_text, mock_text) = (scrape(port), scrape(worker_port));
    let kvd_text = infera_kvd::metrics_text(&infera_kvd::Stats::default());
    for (who, text) in [
        ("server", &server_text),
        ("mock", &mock_text),
        ("kvd", &kvd_text),
    ] {
        let before = names.len();
        exposed(text, &mut names);
        assert!(names.len() > before + 10, "{who} exposes little:\n{text}");
    }
    names
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dashboard_query_names_a_series_the_binaries_export() {
    let exported = exported_series().await;
    let mut unknown = BTreeSet::new();
    let mut used = BTreeSet::new();
    for (file, board) in dashboards() {
        for (place, expr) in queries(&board) {
            for name in metric_names(&expr) {
                if !exported.contains(&name) {
                    unknown.insert(format!("{file}: {place}: {name}"));
                }
                used.insert(name);
            }
        }
    }
    assert!(
        unknown.is_empty(),
        "dashboard queries name series no binary exports:\n{}\n\nexported:\n{}",
        unknown.into_iter().collect::<Vec<_>>().join("\n"),
        exported.iter().cloned().collect::<Vec<_>>().join("\n")
    );
    assert!(used.len() > 50, "the dashboards name only {used:?}");
}
