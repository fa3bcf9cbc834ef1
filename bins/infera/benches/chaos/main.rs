//! The chaos suite (`cargo xtask chaos`): each fault of a bad day in production, injected into a
//! real fleet on loopback (etcd, nats-server, `infera worker mock` and `infera server` processes
//! of this build, `infera kvd`) under steady load, with one table row per fault: requests sent,
//! answered (byte for byte the unbroken answer), failed with a clear error, hung (no end within
//! 30 s) and wrong (a broken stream the client cannot tell from a good one, mixed or wrong
//! words, wrong bytes), and the streams the server migrated (how many from their exact token
//! ids).
//!
//! The fault strikes when a third of the fault's requests have ended (a worker fault strikes
//! the worker with the most requests in flight) and is repaired (a stopped worker continued)
//! at two thirds. The program exits non-zero when any fault leaves a request hung or wrong.
//! `CHAOS_REQUESTS` (default 240) sets the requests per fault, `CHAOS_ONLY` runs the faults
//! whose name contains it.
//! Skipped under `--test` / `--list`, where it only has to build.

#[path = "../../tests/common/mod.rs"]
mod common;
mod fleet;
mod kvd;
mod load;

use fleet::{Fleet, Shape, Transport, signal};
use load::{Request, Tally};
use std::io::Write as _;
use std::net::TcpStream;

/// Client threads of the steady load.
const CLIENTS: usize = 12;

/// A fault: its fleet, its requests, and what it does at a third and two thirds.
struct Fault {
    name: &'static str,
    shape: Shape,
    max_tokens: u32,
    /// Every `bad_every`-th request is a malformed or oversized one (0: none).
    bad_every: usize,
    strike: fn(&mut Fleet, &mut Vec<Box<dyn Send>>),
    repair: fn(&mut Fleet, &mut Vec<Box<dyn Send>>),
}

fn flags(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| (*s).to_owned()).collect()
}

fn shape(transport: Transport, workers: Vec<Vec<String>>) -> Shape {
    Shape {
        transport,
        workers,
        server: Vec::new(),
        fd_limit: None,
    }
}

fn nothing(_: &mut Fleet, _: &mut Vec<Box<dyn Send>>) {}

fn block_on<T>(future: impl std::future::Future<Output = T>) -> T {
    tokio::runtime::Handle::current().block_on(future)
}

/// Kills the worker with the most requests in flight.
fn kill_busiest(f: &mut Fleet, _: &mut Vec<Box<dyn Send>>) {
    f.struck = f.busiest();
    signal(&f.workers[f.struck], "KILL");
}

/// Stops (SIGSTOP) the worker with the most requests in flight.
fn stop_busiest(f: &mut Fleet, _: &mut Vec<Box<dyn Send>>) {
    f.struck = f.busiest();
    signal(&f.workers[f.struck], "STOP");
}

fn faults() -> Vec<Fault> {
    let slow_prefill = flags(&["--prefill-coeffs", "0,0,400"]);
    let slow_decode = flags(&["--decode-coeffs", "0,0,25"]);
    vec![
        Fault {
            name: "worker SIGKILLed before its first byte",
            shape: shape(Transport::HttpZmq, vec![slow_prefill.clone(); 3]),
            max_tokens: 8,
            bad_every: 0,
            strike: kill_busiest,
            repair: nothing,
        },
        Fault {
            name: "worker SIGKILLed mid-stream",
            shape: shape(Transport::HttpZmq, vec![slow_decode.clone(); 3]),
            max_tokens: 48,
            bad_every: 0,
            strike: kill_busiest,
            repair: nothing,
        },
        Fault {
            name: "worker hangs (SIGSTOP, SIGCONT at 2/3)",
            shape: shape(Transport::HttpZmq, vec![slow_decode.clone(); 3]),
            max_tokens: 32,
            bad_every: 0,
            strike: stop_busiest,
            repair: |f, _| signal(&f.workers[f.struck], "CONT"),
        },
        Fault {
            name: "worker answers /health, makes no progress (SIGUSR1)",
            shape: shape(Transport::HttpZmq, vec![slow_decode.clone(); 3]),
            max_tokens: 48,
            bad_every: 0,
            strike: |f, _| {
                f.struck = f.busiest();
                signal(&f.workers[f.struck], "USR1");
            },
            repair: nothing,
        },
        Fault {
            name: "worker answers 20x slower",
            shape: shape(
                Transport::HttpZmq,
                vec![flags(&["--speedup", "0.05"]), Vec::new(), Vec::new()],
            ),
            max_tokens: 16,
            bad_every: 0,
            strike: nothing,
            repair: nothing,
        },
        Fault {
            name: "worker SIGKILLed mid-stream, over NATS",
            shape: shape(Transport::Nats, vec![slow_decode.clone(); 3]),
            max_tokens: 48,
            bad_every: 0,
            strike: kill_busiest,
            repair: nothing,
        },
        Fault {
            name: "nats-server restarted",
            shape: shape(Transport::Nats, vec![slow_decode.clone(); 3]),
            max_tokens: 16,
            bad_every: 0,
            strike: |f, _| {
                let nats = f.nats.as_mut().expect("a NATS fleet");
                block_on(nats.restart()).expect("nats-server restarts");
            },
            repair: nothing,
        },
        Fault {
            name: "etcd restarted",
            shape: shape(Transport::HttpZmq, vec![slow_decode.clone(); 3]),
            max_tokens: 16,
            bad_every: 0,
            strike: |f, _| block_on(f.etcd.restart()).expect("etcd restarts"),
            repair: nothing,
        },
        Fault {
            name: "idle and slow clients at the fd limit",
            shape: Shape {
                server: flags(&[
                    "--client-header-timeout",
                    "2s",
                    "--client-idle-timeout",
                    "5s",
                ]),
                fd_limit: Some(256),
                ..shape(Transport::HttpZmq, vec![Vec::new(); 3])
            },
            max_tokens: 16,
            bad_every: 0,
            strike: |f, held| {
                // Idle connections past the limit, and clients that send headers a byte at a
                // time; all held until the repair.
                for i in 0..320 {
                    let Ok(mut s) = TcpStream::connect(("127.0.0.1", f.server_port)) else {
                        continue;
                    };
                    if i % 4 == 0 {
                        let _ = s.write_all(b"POST /v1/completions HTTP/1.1\r\nHo");
                    }
                    held.push(Box::new(s));
                }
            },
            repair: |_, held| held.clear(),
        },
        Fault {
            name: "malformed and oversized bodies (1 in 3)",
            shape: shape(Transport::HttpZmq, vec![Vec::new(); 3]),
            max_tokens: 16,
            bad_every: 3,
            strike: nothing,
            repair: nothing,
        },
    ]
}

/// The malformed requests, in turn.
fn bad(i: usize, model: &str) -> Request {
    let post = |body: &[u8]| load::post("/v1/completions", body);
    let (what, raw) = match i % 5 {
        0 => ("invalid JSON", post(b"{\"model\": \"m\", \"prompt\": ")),
        1 => ("a 40 MiB body", post(&vec![b' '; 40 << 20])),
        2 => (
            "a prompt of the wrong type",
            post(format!("{{\"model\": \"{model}\", \"prompt\": {{\"a\": 1}}}}").as_bytes()),
        ),
        3 => (
            "max_tokens below 1",
            post(
                format!("{{\"model\": \"{model}\", \"prompt\": \"x\", \"max_tokens\": -1}}")
                    .as_bytes(),
            ),
        ),
        _ => (
            "bytes that are not UTF-8",
            post(b"{\"model\": \"\xff\xfe\"}"),
        ),
    };
    Request::Bad { what, raw }
}

fn run_fault(fault: &Fault, requests: usize) -> (Tally, (u64, u64)) {
    let mut fleet = block_on(Fleet::start(&fault.shape));
    let model = fleet.model.clone();
    let (max_tokens, bad_every) = (fault.max_tokens, fault.bad_every);
    let make = move |i: usize| {
        if bad_every > 0 && i % bad_every == bad_every - 1 {
            bad(i / bad_every, &model)
        } else {
            Request::Stream {
                model: model.clone(),
                prompt: format!("Chaos request number {i}, please answer:"),
                max_tokens,
            }
        }
    };
    let port = fleet.server_port;
    let fleet_ptr = std::sync::Mutex::new((&mut fleet, Vec::new()));
    let tally = load::run(
        port,
        requests,
        CLIENTS,
        make,
        || {
            let mut guard = fleet_ptr.lock().expect("fleet");
            let (fleet, held) = &mut *guard;
            (fault.strike)(fleet, held);
        },
        || {
            let mut guard = fleet_ptr.lock().expect("fleet");
            let (fleet, held) = &mut *guard;
            (fault.repair)(fleet, held);
        },
    );
    drop(fleet_ptr);
    let migrated = fleet.migrations();
    (tally, migrated)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.iter().any(|a| a == "--test" || a == "--list") {
        return;
    }
    let requests = std::env::var("CHAOS_REQUESTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(240);
    let only = std::env::var("CHAOS_ONLY").unwrap_or_default();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    let _guard = rt.enter();

    println!("| fault | sent | answered | failed, clear error | hung | wrong | migrated |");
    println!("|---|---:|---:|---:|---:|---:|---:|");
    let mut bad_rows = Vec::new();
    for fault in faults().iter().filter(|f| f.name.contains(&only)) {
        let (tally, (migrated, exact)) = run_fault(fault, requests);
        row(fault.name, &tally, &format!("{migrated} ({exact} exact)"));
        if tally.hung + tally.wrong > 0 {
            bad_rows.push((fault.name, tally));
        }
    }
    let kvd_name = "kvd SIGKILLed under write load (writes; wrong = reads)";
    if kvd_name.contains(&only) {
        let outcome = rt.block_on(kvd::run());
        row(
            kvd_name,
            &outcome.tally,
            &format!(
                "— ({} lost within the guarantee)",
                outcome.lost_within_guarantee
            ),
        );
        if outcome.tally.hung + outcome.tally.wrong > 0 {
            bad_rows.push((kvd_name, outcome.tally));
        }
    }
    for (name, tally) in &bad_rows {
        eprintln!("{name}: {:?}", tally.examples);
    }
    std::io::stdout().flush().expect("stdout");
    if !bad_rows.is_empty() {
        std::process::exit(1);
    }
}

fn row(name: &str, t: &Tally, migrated: &str) {
    println!(
        "| {name} | {} | {} | {} | {} | {} | {migrated} |",
        t.sent, t.answered, t.failed, t.hung, t.wrong
    );
}
