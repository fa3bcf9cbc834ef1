//! A wedged engine at the default flags, end to end: a real etcd, one `infera worker mock`, one
//! registered worker whose engine answers its health checks until it wedges (it then accepts
//! connections and never answers, as a hung GPU or a deadlocked scheduler does), and
//! `infera server` with no timeout flag (its first-byte deadline is 900 s).
//!
//! What a user relies on: the wedged worker leaves routing within 10 s of the fault, every
//! request it held is answered by the other worker, and none ends later than 15 s after the
//! fault.
#![allow(clippy::unwrap_used)]

mod common;

use common::{
    eventually, free_mock_port, free_port, get_json, http, metric, mock_worker, open_stream, picks,
    register_standin, server, signal, tokenizer_dir,
};
use infera_backends::testing::EtcdServer;
use serde_json::json;
use std::io::{Read as _, Write as _};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// An engine that answers `GET /health` with 200 until `wedged` is set, and from then on reads
/// what it is sent and never answers anything.
fn engine(listener: TcpListener, wedged: Arc<AtomicBool>) {
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(conn) = conn else { continue };
            let wedged = Arc::clone(&wedged);
            std::thread::spawn(move || serve(conn, &wedged));
        }
    });
}

fn serve(mut conn: TcpStream, wedged: &AtomicBool) {
    let mut buf = [0u8; 4096];
    loop {
        let Ok(n) = conn.read(&mut buf) else { return };
        if n == 0 {
            return;
        }
        if wedged.load(Ordering::SeqCst) {
            continue;
        }
        let answer = if buf[..n].starts_with(b"GET /health") {
            "HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"
        } else {
            "HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n"
        };
        if conn.write_all(answer.as_bytes()).is_err() {
            return;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wedged_engine_leaves_routing_and_its_requests_fail_over_at_the_defaults() {
    let etcd = EtcdServer::start().await.expect("etcd starts");
    let tok = tokenizer_dir();
    let _good = mock_worker(
        &tok,
        &etcd.endpoint(),
        free_mock_port(),
        &["--speedup", "1000"],
    );
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let id = listener.local_addr().unwrap().to_string();
    let wedged = Arc::new(AtomicBool::new(false));
    engine(listener, Arc::clone(&wedged));
    let _registration = register_standin(&etcd.endpoint(), &id, &tok).await;
    let port = free_port();
    let _server = server(&tok, &etcd.endpoint(), port, &[]);
    eventually("both workers to be routed", || {
        get_json(port, "/health").is_some_and(|h| h["active_workers"] == 2)
    });

    // The fault, then six requests at once: about half are routed to the wedged engine.
    wedged.store(true, Ordering::SeqCst);
    let fault = Instant::now();
    let clients: Vec<_> = (0..6)
        .map(|i| {
            let body = json!({"model": tok, "prompt": format!("request {i} of six"),
                "max_tokens": 2})
            .to_string();
            std::thread::spawn(move || {
                let (status, text) = http(port, "POST", "/v1/completions", &body).unwrap();
                (status, text, fault.elapsed())
            })
        })
        .collect();
    let ejections = "infera_health_ejections_total";
    eventually("the wedged worker to leave routing", || {
        metric(port, ejections) == Some(1)
    });
    let out_after = fault.elapsed();
    for client in clients {
        let (status, text, ended) = client.join().unwrap();
        assert_eq!(status, 200, "{text}");
        assert!(
            ended < Duration::from_secs(15),
            "a request ended {ended:?} after the fault"
        );
    }
    assert!(
        out_after < Duration::from_secs(10),
        "out of routing {out_after:?} after the fault"
    );
    assert!(
        metric(port, "infera_router_retries_total").unwrap_or(0) > 0,
        "the wedged worker's requests were failed over"
    );
    // Out of routing: the next request goes to the other worker at once.
    let started = Instant::now();
    let body = json!({"model": tok, "prompt": "after", "max_tokens": 2}).to_string();
    let (status, _) = http(port, "POST", "/v1/completions", &body).unwrap();
    assert_eq!(status, 200);
    assert!(started.elapsed() < Duration::from_secs(5));
    eprintln!("out of routing {out_after:?} after the fault");
}

/// A worker that answers its health checks but serves at a hundredth of its peers' speed is
/// ejected at the defaults, its peers are not, and no request is lost on the way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_far_slower_than_its_peers_is_ejected_at_the_defaults() {
    let etcd = EtcdServer::start().await.expect("etcd starts");
    let tok = tokenizer_dir();
    let (fast, slow) = ([free_mock_port(), free_mock_port()], free_mock_port());
    let _workers: Vec<_> = fast
        .iter()
        .map(|p| (*p, "10"))
        .chain([(slow, "0.1")])
        .map(|(p, speedup)| mock_worker(&tok, &etcd.endpoint(), p, &["--speedup", speedup]))
        .collect();
    let port = free_port();
    let _server = server(&tok, &etcd.endpoint(), port, &[]);
    eventually("three workers to be routed", || {
        get_json(port, "/health").is_some_and(|h| h["active_workers"] == 3)
    });

    // Four closed-loop clients until the slow worker is ejected.
    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let clients: Vec<_> = (0..4)
        .map(|c| {
            let (tok, stop) = (tok.clone(), Arc::clone(&stop));
            std::thread::spawn(move || {
                let mut statuses = Vec::new();
                for i in 0.. {
                    if stop.load(Ordering::SeqCst) {
                        break;
                    }
                    let body = json!({"model": tok, "prompt": format!("client {c} asks {i}"),
                        "max_tokens": 2})
                    .to_string();
                    statuses.push(http(port, "POST", "/v1/completions", &body).map(|r| r.0));
                }
                statuses
            })
        })
        .collect();
    eventually("the slow worker to be ejected", || {
        metric(port, "infera_outlier_ejections_total{reason=\"ttft\"").is_some_and(|n| n > 0)
    });
    let ejected_after = started.elapsed();
    stop.store(true, Ordering::SeqCst);
    for client in clients {
        let statuses = client.join().unwrap();
        assert!(
            statuses.iter().all(|s| *s == Some(200)),
            "every request answered: {statuses:?}"
        );
    }
    let workers = get_json(port, "/v1/workers").unwrap();
    let ejected: Vec<&str> = workers["data"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|w| w["outlier_ejected"] == true)
        .map(|w| w["record"]["url"].as_str().unwrap())
        .collect();
    assert_eq!(ejected.len(), 1, "{workers}");
    assert!(ejected[0].ends_with(&format!(":{slow}")), "{ejected:?}");
    assert_eq!(metric(port, "infera_outlier_ejected_workers"), Some(1));
    // The first evaluation that has the samples ejects it: within two intervals of 10 s.
    assert!(
        ejected_after < Duration::from_secs(25),
        "ejected {ejected_after:?} after the traffic started"
    );

    // Out of routing: every next request goes to a fast worker.
    let before = picks(port, slow);
    for i in 0..20 {
        let body = json!({"model": tok, "prompt": format!("after {i}"), "max_tokens": 2});
        let (status, _) = http(port, "POST", "/v1/completions", &body.to_string()).unwrap();
        assert_eq!(status, 200);
    }
    assert_eq!(picks(port, slow), before);
    assert!(fast.iter().map(|p| picks(port, *p)).sum::<u64>() >= 20);
    eprintln!("slow worker ejected {ejected_after:?} after the traffic started");
}

/// A worker whose engine still answers `/health` but whose scheduler stops (the mock's
/// SIGUSR1: no step runs, the HTTP server answers) leaves routing at the defaults once its
/// streams make no progress; each stream it held ends at once instead of waiting for the 900 s
/// idle deadline, the other worker's streams finish, and it returns once it runs again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_answers_health_but_makes_no_progress_leaves_routing_at_the_defaults() {
    let etcd = EtcdServer::start().await.expect("etcd starts");
    let tok = tokenizer_dir();
    // A decode step of 40 ms: a 400-token stream lasts about 16 s.
    let ports = [free_mock_port(), free_mock_port()];
    let workers: Vec<_> = ports
        .iter()
        .map(|p| mock_worker(&tok, &etcd.endpoint(), *p, &["--decode-coeffs", "0,0,40"]))
        .collect();
    let port = free_port();
    let _server = server(&tok, &etcd.endpoint(), port, &[]);
    eventually("both workers to be routed", || {
        get_json(port, "/health").is_some_and(|h| h["active_workers"] == 2)
    });

    // Four long streams, on both workers.
    let streams: Vec<_> = (0..4)
        .map(|i| {
            let body = json!({"model": tok, "prompt": format!("stream {i} of four, long"),
                "max_tokens": 400, "stream": true})
            .to_string();
            open_stream(port, &body)
        })
        .collect();
    let struck = if picks(port, ports[0]) >= picks(port, ports[1]) {
        0
    } else {
        1
    };
    assert!(picks(port, ports[struck]) > 0 && picks(port, ports[1 - struck]) > 0);
    signal(&workers[struck].0, "USR1");
    let fault = Instant::now();
    let readers: Vec<_> = streams
        .into_iter()
        .map(|(mut s, mut seen)| {
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                loop {
                    match s.read(&mut buf) {
                        Ok(0) => break,
                        Ok(n) => seen.extend_from_slice(&buf[..n]),
                        Err(e) => {
                            panic!("a stream hung {:?} after the fault: {e}", fault.elapsed())
                        }
                    }
                }
                (String::from_utf8_lossy(&seen).into_owned(), fault.elapsed())
            })
        })
        .collect();
    eventually("the stalled worker to leave routing", || {
        metric(port, "infera_health_ejections_total") == Some(1)
    });
    let out_after = fault.elapsed();
    assert!(metric(port, "infera_health_check_stalls_total").unwrap_or(0) > 0);
    let (mut done, mut cut) = (0, 0);
    for reader in readers {
        let (text, ended) = reader.join().unwrap();
        if text.contains("\"error\"") {
            cut += 1;
            assert!(text.contains("left routing"), "{text}");
            assert!(
                ended < Duration::from_secs(20),
                "cut {ended:?} after the fault"
            );
        } else {
            assert!(text.contains("data: [DONE]"), "a stream ends whole: {text}");
            done += 1;
        }
    }
    assert!(cut > 0 && done > 0, "{cut} cut, {done} finished");
    // 6 s without a chunk, then three failed rounds of 2 s.
    assert!(
        out_after < Duration::from_secs(20),
        "out of routing {out_after:?} after the fault"
    );
    // Running again, it passes its checks and returns.
    signal(&workers[struck].0, "USR1");
    eventually("the worker to return", || {
        get_json(port, "/v1/workers").is_some_and(|w| {
            w["data"]
                .as_array()
                .unwrap()
                .iter()
                .all(|w| w["health_out"] == false)
        })
    });
    eprintln!("out of routing {out_after:?} after the fault; {cut} streams cut, {done} finished");
}
