//! Steady load and how each answer is judged.
//!
//! [`run`] sends `total` requests from `clients` threads, each on its own connection
//! (`Connection: close`), each within [`DEADLINE`] from its first byte sent, and calls a fault's
//! hooks when a third and two thirds of them have ended. Every answer lands in one class
//! ([`Outcome`]): an answer a client can use, a clear failure (a status with an OpenAI error
//! body, or a stream that ends with an `error` event and `[DONE]`), a hang (no end within the
//! deadline), or a wrong answer (a stream whose words break the mock's cycle, whose frames carry
//! two ids, that ends without `[DONE]`, or an unreadable error).
//!
//! A good request is a streaming completion of a text prompt that ends with no word of the mock's
//! cycle, so an unbroken answer is exactly `filler(0, max_tokens)` and a migrated stream, which
//! the server continues with the text so far, must read the same.

use infera_adapters::mock::filler;
use serde_json::Value;
use std::io::{ErrorKind, Read as _, Write as _};
use std::net::TcpStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// How long one request may take before it counts as hung.
pub const DEADLINE: Duration = Duration::from_secs(30);

/// One request of the load.
#[derive(Debug, Clone)]
pub enum Request {
    /// A streaming completion that must come back as `filler(0, max_tokens)`.
    Stream {
        model: String,
        prompt: String,
        max_tokens: u32,
    },
    /// Bytes that are not a valid request; a 4xx with an error body is the right answer.
    Bad { what: &'static str, raw: Vec<u8> },
}

/// How one request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Answered,
    FailedClearly,
    Hung,
    Wrong,
}

/// The counts of one run.
#[derive(Debug, Default, Clone)]
pub struct Tally {
    pub sent: usize,
    pub answered: usize,
    pub failed: usize,
    pub hung: usize,
    pub wrong: usize,
    /// The first few wrong answers, for the report.
    pub examples: Vec<String>,
}

impl Tally {
    fn add(&mut self, outcome: Outcome, detail: String) {
        self.sent += 1;
        match outcome {
            Outcome::Answered => self.answered += 1,
            Outcome::FailedClearly => self.failed += 1,
            Outcome::Hung => self.hung += 1,
            Outcome::Wrong => self.wrong += 1,
        }
        if matches!(outcome, Outcome::Hung | Outcome::Wrong) && self.examples.len() < 3 {
            self.examples.push(detail);
        }
    }
}

/// Sends `total` requests (`make(i)`) to `port` from `clients` threads; `at_third` runs when a
/// third of them have ended and `at_two_thirds` at two thirds (the fault and its repair).
pub fn run(
    port: u16,
    total: usize,
    clients: usize,
    make: impl Fn(usize) -> Request + Send + Sync + 'static,
    at_third: impl FnOnce(),
    at_two_thirds: impl FnOnce(),
) -> Tally {
    let make = Arc::new(make);
    let next = Arc::new(AtomicUsize::new(0));
    let (tx, rx) = mpsc::channel();
    let threads: Vec<_> = (0..clients)
        .map(|_| {
            let (make, next, tx) = (make.clone(), next.clone(), tx.clone());
            std::thread::spawn(move || {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= total {
                        break;
                    }
                    let request = make(i);
                    let ended = send(port, &request);
                    if tx.send(ended).is_err() {
                        break;
                    }
                }
            })
        })
        .collect();
    drop(tx);
    let mut tally = Tally::default();
    let mut hooks: [Option<Box<dyn FnOnce()>>; 2] =
        [Some(Box::new(at_third)), Some(Box::new(at_two_thirds))];
    for (outcome, detail) in rx {
        tally.add(outcome, detail);
        for (k, hook) in hooks.iter_mut().enumerate() {
            if tally.sent >= total * (k + 1) / 3
                && let Some(hook) = hook.take()
            {
                hook();
            }
        }
    }
    for thread in threads {
        thread.join().expect("a load thread panicked");
    }
    for hook in hooks.iter_mut().filter_map(Option::take) {
        hook();
    }
    tally
}

/// Sends one request and judges its answer.
fn send(port: u16, request: &Request) -> (Outcome, String) {
    let started = Instant::now();
    let raw = match request {
        Request::Stream {
            model,
            prompt,
            max_tokens,
        } => {
            let body = serde_json::json!({
                "model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": true,
            })
            .to_string();
            post("/v1/completions", body.as_bytes())
        }
        Request::Bad { raw, .. } => raw.clone(),
    };
    let read = exchange(port, &raw, started);
    match (request, read) {
        (_, Exchange::Hung(got)) => (Outcome::Hung, format!("{request:?}: {}", head(&got))),
        (_, Exchange::Refused(e)) => (Outcome::Wrong, format!("cannot connect: {e}")),
        (Request::Bad { what, .. }, Exchange::Ended(got)) => judge_bad(what, &got),
        (Request::Stream { max_tokens, .. }, Exchange::Ended(got)) => {
            judge_stream(*max_tokens, &got)
        }
    }
}

/// A `POST` of `body` to `path`, closing the connection after the answer.
pub fn post(path: &str, body: &[u8]) -> Vec<u8> {
    let mut raw = format!(
        "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    raw.extend_from_slice(body);
    raw
}

enum Exchange {
    Ended(Vec<u8>),
    Hung(Vec<u8>),
    Refused(std::io::Error),
}

/// Writes `raw` and reads until the server closes, within [`DEADLINE`] of `started`.
fn exchange(port: u16, raw: &[u8], started: Instant) -> Exchange {
    let mut stream = match TcpStream::connect(("127.0.0.1", port)) {
        Ok(s) => s,
        Err(e) => return Exchange::Refused(e),
    };
    let mut got = Vec::new();
    // A server may answer (413, 400) before the whole body is written and close: read anyway.
    let _ = stream.set_write_timeout(Some(DEADLINE));
    let _ = stream.write_all(raw);
    let mut buf = [0u8; 16 * 1024];
    loop {
        let Some(left) = DEADLINE.checked_sub(started.elapsed()) else {
            return Exchange::Hung(got);
        };
        let _ = stream.set_read_timeout(Some(left.max(Duration::from_millis(1))));
        match stream.read(&mut buf) {
            Ok(0) => return Exchange::Ended(got),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return Exchange::Hung(got);
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            // A reset after what was read: judged on what arrived.
            Err(_) => return Exchange::Ended(got),
        }
    }
}

fn head(got: &[u8]) -> String {
    let text = String::from_utf8_lossy(got);
    let cut: String = text.chars().take(300).collect();
    cut.replace("\r\n", " | ").replace('\n', " ")
}

/// Status and body of a `Connection: close` answer (chunked bodies are de-chunked).
fn split(got: &[u8]) -> Option<(u16, String)> {
    let text = String::from_utf8_lossy(got);
    let (head, body) = text.split_once("\r\n\r\n")?;
    let status = head.split(' ').nth(1)?.parse().ok()?;
    let chunked = head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked");
    let body = if chunked {
        dechunk(body)?
    } else {
        body.to_owned()
    };
    Some((status, body))
}

fn dechunk(mut body: &str) -> Option<String> {
    let mut out = String::new();
    loop {
        let (size, rest) = body.split_once("\r\n")?;
        let size = usize::from_str_radix(size.trim(), 16).ok()?;
        if size == 0 {
            return Some(out);
        }
        out.push_str(rest.get(..size)?);
        body = rest.get(size + 2..)?;
    }
}

/// A clear error: an OpenAI-shaped body with a message.
fn clear_error(body: &str) -> bool {
    serde_json::from_str::<Value>(body)
        .ok()
        .and_then(|v| v["error"]["message"].as_str().map(|m| !m.is_empty()))
        .unwrap_or(false)
}

fn judge_bad(what: &str, got: &[u8]) -> (Outcome, String) {
    match split(got) {
        Some((status, body)) if (400..500).contains(&status) && clear_error(&body) => {
            (Outcome::FailedClearly, String::new())
        }
        _ => (Outcome::Wrong, format!("{what}: {}", head(got))),
    }
}

fn judge_stream(max_tokens: u32, got: &[u8]) -> (Outcome, String) {
    let wrong = |why: &str| (Outcome::Wrong, format!("{why}: {}", head(got)));
    let Some((status, body)) = split(got) else {
        return wrong("no complete HTTP answer");
    };
    if status != 200 {
        return if clear_error(&body) {
            (Outcome::FailedClearly, String::new())
        } else {
            wrong("an error status without an error body")
        };
    }
    let events: Vec<&str> = body
        .split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .collect();
    if events.last().map(|e| e.trim()) != Some("data: [DONE]") {
        return wrong("a stream that ends without [DONE]");
    }
    let mut text = String::new();
    let mut ids = Vec::new();
    let mut finish = None;
    for event in &events[..events.len() - 1] {
        let Some(value) = event
            .trim()
            .strip_prefix("data: ")
            .and_then(|d| serde_json::from_str::<Value>(d).ok())
        else {
            return wrong("a frame that is not JSON");
        };
        if value.get("error").is_some() {
            return if clear_error(&value.to_string()) {
                (Outcome::FailedClearly, String::new())
            } else {
                wrong("an error event without a message")
            };
        }
        if let Some(id) = value["id"].as_str()
            && !ids.iter().any(|seen| seen == id)
        {
            ids.push(id.to_owned());
        }
        let choice = &value["choices"][0];
        text.push_str(choice["text"].as_str().unwrap_or_default());
        if let Some(reason) = choice["finish_reason"].as_str() {
            finish = Some(reason.to_owned());
        }
    }
    if ids.len() != 1 {
        return wrong("frames of one stream with several ids");
    }
    if text != filler(0, max_tokens) || finish.as_deref() != Some("length") {
        return wrong("the words are not the unbroken answer");
    }
    (Outcome::Answered, String::new())
}
