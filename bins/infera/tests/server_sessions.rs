//! Session affinity across server replicas, with the real binaries: etcd, two `infera worker
//! mock` processes, and two `infera server` replicas sharing a JetStream event log.
//!
//! The servers are separate processes: convergence is observed through their status pages,
//! polled under a deadline.
#![allow(clippy::unwrap_used)]

mod common;

use common::{eventually, get_json, http_with_headers, metric, picks, replicas, tokenizer_dir};
use serde_json::json;

/// A conversation named by `x-session-id` keeps to its worker whichever replica routes it, at
/// the defaults: its prompts are shorter than a block, so no cache tells the workers apart and
/// only the session's pin, shared through the log, breaks the tie.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_keeps_to_its_worker_across_replicas() {
    let tok = tokenizer_dir();
    let tok = tok.as_str();
    let fleet = replicas(tok, "SESSIONS", 2, &["--speedup", "1000"], &[]).await;
    let (workers, replicas) = (&fleet.workers, fleet.ports);
    // Requests in flight, over the workers, as the replica at `port` counts them.
    let inflight = |port: u16| -> u64 {
        get_json(port, "/v1/workers").map_or(u64::MAX, |w| {
            w["data"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|d| d["load"][0]["inflight"].as_u64().unwrap_or(0))
                .sum()
        })
    };
    let send = |port: u16, session: &str, text: &str| {
        let body = json!({"model": tok, "prompt": text, "max_tokens": 1});
        let (status, raw) = http_with_headers(
            port,
            "POST",
            "/v1/completions",
            &[("x-session-id", session)],
            &body.to_string(),
        )
        .expect("an answer");
        assert_eq!(status, 200, "{raw}");
    };
    let [a, b] = replicas;
    // Each conversation's first turn goes to replica a, its second to replica b once b has
    // read the first from the log: routed (b pins one more session) and finished (nothing in
    // flight), as a client that waited for its answer sees it.
    // The replicas draw their ties from the same seeded source: one more draw on b puts them out
    // of step, as two replicas' different traffic would.
    send(b, "", "no session");
    eventually("it to finish", || inflight(b) == 0);
    const SESSIONS: u64 = 8;
    for s in 0..SESSIONS {
        let session = format!("conversation-{s}");
        send(a, &session, "first turn");
        eventually("replica b to read the first turn", || {
            metric(b, "infera_router_sessions") == Some(s + 1) && inflight(b) == 0
        });
        send(b, &session, "second turn");
    }
    // Replica a made one pick per conversation, b one more; b's went where a's did.
    let by_worker = |port: u16| -> Vec<u64> { workers.iter().map(|w| picks(port, *w)).collect() };
    let (on_a, on_b) = (by_worker(a), by_worker(b));
    assert_eq!(on_a.iter().sum::<u64>(), SESSIONS);
    let extra: Vec<i64> = on_b
        .iter()
        .zip(&on_a)
        .map(|(b, a)| *b as i64 - *a as i64)
        .collect();
    assert!(
        extra == [1, 0] || extra == [0, 1],
        "a: {on_a:?}, b: {on_b:?}"
    );
    let outcome = |port: u16, o: &str| -> u64 {
        let name = format!("infera_router_session_requests_total{{outcome=\"{o}\"");
        metric(port, &name).unwrap_or(0)
    };
    assert_eq!(outcome(a, "new"), SESSIONS);
    assert_eq!((outcome(b, "kept"), outcome(b, "moved")), (SESSIONS, 0));
}
