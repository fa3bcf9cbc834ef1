//! `infera server` end to end toward a worker that hangs: a real etcd, an `infera worker mock`
//! process, and a registered "worker" that accepts connections and never answers. With
//! `--http-req-first-byte-timeout` every request still succeeds on the mock (failover), and
//! after `--breaker-failure-threshold` failures the hung worker gets no more connections (its
//! breaker is open for `--breaker-cooldown-s`, here far longer than the test).
#![allow(clippy::unwrap_used)]

mod common;

use common::{
    eventually, free_mock_port, free_port, get_json, http, metric, mock_worker, register_standin,
    server, tokenizer_dir,
};
use infera_backends::testing::EtcdServer;
use serde_json::json;
use std::net::TcpListener;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// A worker that accepts every connection, holds it open and never answers. Returns its port
/// and the number of connections accepted so far.
fn hung_worker() -> (u16, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let accepted = Arc::new(AtomicUsize::new(0));
    let count = accepted.clone();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for conn in listener.incoming() {
            let Ok(conn) = conn else { return };
            count.fetch_add(1, Ordering::SeqCst);
            held.push(conn);
        }
    });
    (port, accepted)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_worker_is_failed_over_then_taken_out_of_routing_by_its_breaker() {
    let etcd = EtcdServer::start().await.expect("etcd starts");
    let tok = tokenizer_dir();
    let (hung_port, accepted) = hung_worker();
    let id = format!("127.0.0.1:{hung_port}");
    let _registration = register_standin(&etcd.endpoint(), &id, &tok).await;

    let worker_port = free_mock_port();
    let _worker = mock_worker(&tok, &etcd.endpoint(), worker_port, &["--speedup", "1000"]);
    let port = free_port();
    let _server = server(
        &tok,
        &etcd.endpoint(),
        port,
        &[
            "--router-policy",
            "round-robin",
            "--http-req-first-byte-timeout",
            "300ms",
            "--breaker-failure-threshold",
            "2",
            "--breaker-cooldown-s",
            "3600",
            "--breaker-max-cooldown-s",
            "3600",
            // The breaker alone: no health probe may connect to the hung worker.
            "--health-check-unhealthy-threshold",
            "0",
        ],
    );
    eventually("both workers to be discovered", || {
        get_json(port, "/health").is_some_and(|h| h["active_workers"] == 2)
    });

    let complete = |i: usize| {
        let req = json!({"model": tok, "prompt": format!("edge {i}"), "max_tokens": 2});
        let (status, body) = http(port, "POST", "/v1/completions", &req.to_string()).unwrap();
        assert_eq!(status, 200, "request {i}: {body}");
    };
    // Round robin sends every other request to the hung worker first; each fails over.
    let mut i = 0;
    while metric(port, "infera_breaker_trips_total") != Some(1) {
        assert!(i < 8, "the breaker never opened");
        complete(i);
        i += 1;
    }
    assert_eq!(accepted.load(Ordering::SeqCst), 2);
    assert_eq!(metric(port, "infera_breaker_open_workers"), Some(1));
    assert_eq!(metric(port, "infera_transport_timeouts_total"), Some(2));
    for j in 0..6 {
        complete(100 + j);
    }
    assert_eq!(
        accepted.load(Ordering::SeqCst),
        2,
        "no connection to a worker whose breaker is open"
    );
}
