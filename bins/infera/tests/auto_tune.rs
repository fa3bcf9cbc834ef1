//! `infera server --auto-tune`, with the real binaries: etcd, two `infera worker mock`
//! processes and one server, driven by conversations whose turns extend their predecessors.
//!
//! What the shadow replay publishes is read from `GET /v1/admin/tuning` and `/metrics`, polled
//! under a deadline.
#![allow(clippy::unwrap_used)]

mod common;

use common::{
    Proc, eventually, free_mock_port, free_port, get_json, http, metric, mock_worker, server,
    tokenizer_dir,
};
use serde_json::{Value, json};

/// Conversations sent by `CLIENTS` threads, each turn its predecessor's prompt plus a new
/// paragraph, `TURNS` turns each; every thread keeps its conversations open at once and takes
/// their turns in rotation.
const CLIENTS: usize = 4;
const PER_CLIENT: usize = 12;
const TURNS: usize = 5;

fn converse(port: u16, tok: &str, tag: &str) {
    std::thread::scope(|scope| {
        for c in 0..CLIENTS {
            scope.spawn(move || {
                let mut prompts: Vec<String> = (0..PER_CLIENT)
                    .map(|s| format!("Conversation {tag}-{c}-{s} begins with a system prompt of its own. "))
                    .collect();
                for turn in 0..TURNS {
                    for (s, prompt) in prompts.iter_mut().enumerate() {
                        for k in 0..6 {
                            prompt.push_str(&format!(
                                "Turn {turn} of conversation {s} adds sentence {k} about topic {}. ",
                                (turn * 7 + k * 3 + s) % 11
                            ));
                        }
                        let body = json!({"model": tok, "prompt": prompt, "max_tokens": 2});
                        let (status, raw) =
                            http(port, "POST", "/v1/completions", &body.to_string()).unwrap();
                        assert_eq!(status, 200, "{raw}");
                    }
                }
            });
        }
    });
}

struct Fleet {
    port: u16,
    _etcd: infera_backends::testing::EtcdServer,
    _procs: Vec<Proc>,
}

async fn fleet(tok: &str, server_flags: &[&str]) -> Fleet {
    let etcd = infera_backends::testing::EtcdServer::start()
        .await
        .expect("etcd starts");
    let mut procs: Vec<Proc> = (0..2)
        .map(|_| mock_worker(tok, &etcd.endpoint(), free_mock_port(), &[]))
        .collect();
    let port = free_port();
    let mut flags = vec!["--auto-tune-interval", "1s"];
    flags.extend_from_slice(server_flags);
    procs.push(server(tok, &etcd.endpoint(), port, &flags));
    eventually("both workers to be discovered", || {
        get_json(port, "/health").is_some_and(|h| h["active_workers"] == 2)
    });
    Fleet {
        port,
        _etcd: etcd,
        _procs: procs,
    }
}

fn tuning(port: u16) -> Value {
    get_json(port, "/v1/admin/tuning").expect("the tuning report")
}

/// Waits for a replay after `after` windows, of a window holding at least `requests` (the
/// replay itself covers the latest of them that its CPU budget allows, at least 200).
fn replayed(port: u16, after: u64, requests: u64) -> Value {
    let mut report = Value::Null;
    eventually("a window to be replayed", || {
        report = tuning(port);
        report["windows"].as_u64() > Some(after)
            && report["window"]["requests"].as_u64() >= Some(requests)
            && report["assessment"]["requests"].as_u64() >= Some(200)
    });
    report
}

/// At the default (`advise`), the shadow replay of a live fleet of mock engines predicts the hit
/// rate the engines report, publishes its candidates and recommendation, and leaves the router
/// as it is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn advise_predicts_what_the_fleet_realises_and_changes_nothing() {
    let tok = tokenizer_dir();
    let fleet = fleet(&tok, &[]).await;
    let before = tuning(fleet.port);
    assert_eq!(before["mode"], "advise");
    assert!(
        before["status"].as_str().unwrap().starts_with("collecting"),
        "{before}"
    );
    converse(fleet.port, &tok, "a");
    let requests = (CLIENTS * PER_CLIENT * TURNS) as u64;
    let report = replayed(fleet.port, 0, requests);
    let a = &report["assessment"];
    let realised = a["realised"]["hit_rate"]
        .as_f64()
        .expect("engines report cached tokens");
    let predicted = a["candidates"][0]["hit_rate"].as_f64().unwrap();
    assert!(
        realised > 0.5,
        "turns reuse their conversation's cache: {a}"
    );
    assert!(
        (predicted - realised).abs() < 0.15,
        "predicted {predicted} against realised {realised}: {a}"
    );
    let gap = a["fidelity_gap"].as_f64().unwrap();
    assert!((gap - (predicted - realised)).abs() < 1e-9, "{a}");
    assert!(a["candidates"].as_array().unwrap().len() >= 4, "{a}");
    assert!(a["recommended"].as_u64().is_some(), "{a}");
    assert_eq!(
        report["current"],
        "--kv-overlap-weight 1 --router-resident-weight 0 --router-balance-tokens 0"
    );
    assert_eq!(report["changes"], json!([]));
    assert!(metric(fleet.port, "infera_tuning_windows_total") >= Some(1));
    assert_eq!(
        metric(fleet.port, "infera_tuning_window_requests"),
        Some(requests)
    );
}

/// With `apply`, a router started with the KV-overlap weight at 0 (routing by load alone) on
/// conversational traffic moves one grid step, committed as a `RouterRetuned` event that the
/// router takes at once; the next window, its own traffic, is judged, and whatever follows
/// (keeping it, a next step, or a rollback) is again one step and what the router runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apply_moves_the_router_one_step_and_judges_the_next_window() {
    let tok = tokenizer_dir();
    let flags = ["--auto-tune", "apply", "--kv-overlap-weight", "0"];
    let fleet = fleet(&tok, &flags).await;
    // Rounds of conversations until a replay adopts a change: each round waits for a change or
    // for the replay of its last request.
    let mut report = Value::Null;
    let changed = |report: &Value| report["changes"].as_array().is_some_and(|c| !c.is_empty());
    let per_round = (CLIENTS * PER_CLIENT * TURNS) as u64;
    for round in 1..=4 {
        converse(fleet.port, &tok, &format!("first-{round}"));
        eventually("the round to be replayed", || {
            report = tuning(fleet.port);
            let w = &report["window"];
            changed(&report)
                || (w["added"].as_u64() >= Some(round * per_round) && w["added"] == w["replayed"])
        });
        if changed(&report) {
            break;
        }
    }
    assert!(changed(&report), "no change after four rounds: {report}");
    let first = report["changes"][0]["change"].clone();
    assert_eq!(first["reason"], "adopt", "{report}");
    assert_eq!(first["from"]["overlap_weight"], 0.0, "{report}");
    let axes = ["overlap_weight", "resident_weight", "balance_tokens"];
    let moved = |c: &Value| {
        axes.iter()
            .filter(|k| c["from"][**k] != c["to"][**k])
            .count()
    };
    assert_eq!(moved(&first), 1, "one step along one axis: {first}");
    let flags = |t: &Value| {
        format!(
            "--kv-overlap-weight {} --router-resident-weight {} --router-balance-tokens {}",
            t["overlap_weight"], t["resident_weight"], t["balance_tokens"]
        )
        .replace(".0 ", " ")
    };
    assert_eq!(
        report["current"].as_str(),
        Some(flags(&first["to"]).as_str())
    );
    assert_eq!(
        metric(fleet.port, "infera_tuning_changes_total{reason=\"adopt\""),
        Some(1)
    );

    // The window started again with the change: the next one is the new tunables' own traffic.
    let windows = report["windows"].as_u64().unwrap();
    converse(fleet.port, &tok, "second");
    // (A further change during it starts the window again: the replay after it may be the
    // first change's judgement or a later one's.)
    let mut report = Value::Null;
    eventually("the next window to be replayed", || {
        report = tuning(fleet.port);
        report["windows"].as_u64() > Some(windows)
    });
    let changes = report["changes"].as_array().unwrap();
    for pair in changes.windows(2) {
        let (a, b) = (&pair[0]["change"], &pair[1]["change"]);
        assert_eq!(a["to"], b["from"], "{report}");
        assert_eq!(moved(b), 1, "{report}");
        if b["reason"] == "rollback" {
            assert_eq!(b["to"], a["from"], "a rollback returns: {report}");
        }
    }
    let last = &changes[changes.len() - 1]["change"];
    assert_eq!(
        report["current"].as_str(),
        Some(flags(&last["to"]).as_str())
    );
}
