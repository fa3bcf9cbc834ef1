//! The library side of `infera bench`: what a trace looks like on the wire, how the answers are
//! read, and the statistics reported. The HTTP driver lives in the binary (`bins/infera/src/bench`);
//! everything here is pure and synchronous.
//!
//! # Prompts from block hashes
//! A trace row carries chained block hashes, not text. [`prompt_tokens`] turns block `i` of a
//! request into `block_size` token ids drawn from a generator seeded by `block_hashes[i]` alone,
//! so two requests that share block `i` (and, the hashes being chained, every block before it)
//! send the same token prefix, and an engine with prefix caching at the trace's block size sees
//! the trace's prefix sharing exactly. A trailing partial block takes the first tokens of its
//! hash's sequence; prompt tokens past the last hash (traces that hash complete blocks only) are
//! seeded by the request's index, so they are shared with nobody. Rows that recorded their
//! `token_ids` are sent as recorded. Ids lie in `TOKEN_BASE..TOKEN_BASE + TOKEN_RANGE`, inside
//! every common vocabulary and clear of the low special-token ids.
//!
//! For the chat API, [`prompt_text`] maps every synthetic token to one word of [`WORDS`] (common
//! English words with a leading space, one token each in common BPE vocabularies): shared token
//! prefixes become shared text prefixes; the server's tokenizer and chat template decide the exact
//! token count.
//!
//! # Reading answers
//! [`SseParser`] splits a `text/event-stream` body into `data:` payloads, across arbitrary chunk
//! boundaries; [`parse_chunk`] reads one OpenAI streaming chunk (completions or chat): whether it
//! carries generated text, its `usage` (with `prompt_tokens_details.cached_tokens`), an error.
//!
//! # Statistics
//! [`RequestRecord`] is one request as measured; [`BenchSummary::of`] computes percentiles (TTFT,
//! inter-token latency, end-to-end), throughput, error and 429 counts, how late requests left
//! against their schedule (a load generator that cannot keep up shows it here), and the
//! server-reported hit rate `Σ cached_tokens / Σ prompt_tokens`. [`to_sim_result`] expresses the
//! records as [`SimResult`] rows so that `--out` writes the columns of `infera replay --out`.

use crate::report::percentile;
use crate::sim::{RequestOutcome, SimResult};
use crate::trace::TraceRequest;
use infera_core::rng::splitmix64;
use serde::{Deserialize, Serialize};
use std::fmt::Write as _;

/// The smallest synthetic token id.
pub const TOKEN_BASE: u32 = 100;
/// Synthetic token ids are `TOKEN_BASE..TOKEN_BASE + TOKEN_RANGE` (below 32,000: valid in every
/// common vocabulary).
pub const TOKEN_RANGE: u32 = 30_000;

/// The words chat prompts are made of, each with its leading space.
pub const WORDS: [&str; 32] = [
    " the", " of", " and", " to", " in", " is", " that", " for", " it", " with", " as", " was",
    " on", " be", " at", " by", " this", " had", " not", " are", " but", " from", " or", " have",
    " an", " they", " which", " one", " you", " were", " all", " we",
];

/// One SplitMix64 step from `z`: a fast, well-mixed 64-bit function.
fn mix(z: u64) -> u64 {
    let mut state = z;
    splitmix64(&mut state)
}

/// Salts that keep hash-seeded and index-seeded sequences apart.
const HASH_SALT: u64 = 0x51A7_B10C_0000_0001;
const INDEX_SALT: u64 = 0x0DD5_EED0_0000_0002;

/// Appends `n` raw 64-bit draws of the sequence seeded by `seed`.
fn draws(seed: u64, n: usize, mut each: impl FnMut(u64)) {
    let mut s = mix(seed);
    for _ in 0..n {
        s = mix(s);
        each(s);
    }
}

/// Calls `each` with one raw draw per prompt token of `req` (see the module docs).
fn prompt_draws(req: &TraceRequest, index: usize, mut each: impl FnMut(u64)) {
    let bs = req.block_size.max(1) as usize;
    let n = req.input_length as usize;
    let mut done = 0usize;
    for hash in &req.block_hashes {
        if done >= n {
            break;
        }
        let take = bs.min(n - done);
        draws(*hash ^ HASH_SALT, take, &mut each);
        done += take;
    }
    if done < n {
        draws(mix(index as u64) ^ INDEX_SALT, n - done, &mut each);
    }
}

/// The prompt of `req` as token ids: its recorded `token_ids`, or `input_length` ids synthesised
/// from its block hashes (`index` is its position in the trace).
pub fn prompt_tokens(req: &TraceRequest, index: usize) -> Vec<u32> {
    if let Some(tokens) = &req.token_ids {
        return tokens.clone();
    }
    let mut out = Vec::with_capacity(req.input_length as usize);
    prompt_draws(req, index, |d| {
        out.push(TOKEN_BASE + (d % u64::from(TOKEN_RANGE)) as u32)
    });
    out
}

/// The prompt of `req` as text for the chat API: one word of [`WORDS`] per synthetic token.
pub fn prompt_text(req: &TraceRequest, index: usize) -> String {
    let mut out = String::with_capacity(req.input_length as usize * 5);
    match &req.token_ids {
        Some(tokens) => {
            for t in tokens {
                out.push_str(WORDS[*t as usize % WORDS.len()]);
            }
        }
        None => prompt_draws(req, index, |d| {
            out.push_str(WORDS[(d % WORDS.len() as u64) as usize])
        }),
    }
    out
}

/// Splits an SSE body into the payloads of its `data:` fields, one per event.
#[derive(Debug, Default)]
pub struct SseParser {
    buf: Vec<u8>,
    data: Vec<u8>,
    has_data: bool,
}

impl SseParser {
    /// Feeds the next bytes of the body; calls `event` with each completed event's data (lines
    /// joined by `\n`, invalid UTF-8 replaced).
    pub fn feed(&mut self, bytes: &[u8], mut event: impl FnMut(&str)) {
        self.buf.extend_from_slice(bytes);
        let mut start = 0;
        while let Some(pos) = self.buf[start..].iter().position(|&b| b == b'\n') {
            let end = start + pos;
            let line = &self.buf[start..end];
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            if line.is_empty() {
                if self.has_data {
                    event(&String::from_utf8_lossy(&self.data));
                }
                self.data.clear();
                self.has_data = false;
            } else if let Some(value) = line.strip_prefix(b"data:") {
                let value = value.strip_prefix(b" ").unwrap_or(value);
                if self.has_data {
                    self.data.push(b'\n');
                }
                self.data.extend_from_slice(value);
                self.has_data = true;
            }
            start = end + 1;
        }
        self.buf.drain(..start);
    }
}

/// Token counts of a `usage` object.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    /// `prompt_tokens_details.cached_tokens`, when the server reports it.
    pub cached_tokens: Option<u32>,
}

/// What one streamed payload says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Chunk {
    /// `[DONE]`.
    Done,
    /// An `{"error": …}` event, with its message.
    Error(String),
    /// A data chunk: whether it carries generated text, and its usage if any.
    Data { text: bool, usage: Option<Usage> },
    /// Not JSON, or not a chunk.
    Invalid,
}

#[derive(Deserialize)]
struct WireChunk<'a> {
    #[serde(default, borrow)]
    choices: Vec<WireChoice<'a>>,
    #[serde(default)]
    usage: Option<WireUsage>,
    #[serde(default)]
    error: Option<serde_json::Value>,
}

#[derive(Deserialize)]
struct WireChoice<'a> {
    #[serde(default, borrow)]
    text: Option<std::borrow::Cow<'a, str>>,
    #[serde(default, borrow)]
    delta: Option<WireDelta<'a>>,
}

#[derive(Deserialize)]
struct WireDelta<'a> {
    #[serde(default, borrow)]
    content: Option<std::borrow::Cow<'a, str>>,
    #[serde(default, borrow)]
    reasoning_content: Option<std::borrow::Cow<'a, str>>,
}

#[derive(Deserialize)]
struct WireUsage {
    #[serde(default)]
    prompt_tokens: u32,
    #[serde(default)]
    completion_tokens: u32,
    #[serde(default)]
    prompt_tokens_details: Option<WireDetails>,
}

#[derive(Deserialize)]
struct WireDetails {
    #[serde(default)]
    cached_tokens: Option<u32>,
}

/// Reads one `data:` payload of an OpenAI stream (completions or chat).
pub fn parse_chunk(payload: &str) -> Chunk {
    let payload = payload.trim();
    if payload == "[DONE]" {
        return Chunk::Done;
    }
    let Ok(chunk) = serde_json::from_str::<WireChunk<'_>>(payload) else {
        return Chunk::Invalid;
    };
    if let Some(error) = chunk.error {
        let message = error
            .get("message")
            .and_then(|m| m.as_str())
            .map(str::to_owned)
            .unwrap_or_else(|| error.to_string());
        return Chunk::Error(message);
    }
    let nonempty =
        |s: &Option<std::borrow::Cow<'_, str>>| s.as_deref().is_some_and(|s| !s.is_empty());
    let text = chunk.choices.iter().any(|c| {
        nonempty(&c.text)
            || c.delta
                .as_ref()
                .is_some_and(|d| nonempty(&d.content) || nonempty(&d.reasoning_content))
    });
    Chunk::Data {
        text,
        usage: chunk.usage.map(|u| Usage {
            prompt_tokens: u.prompt_tokens,
            completion_tokens: u.completion_tokens,
            cached_tokens: u.prompt_tokens_details.and_then(|d| d.cached_tokens),
        }),
    }
}

/// How a request ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "kind", content = "detail")]
pub enum Status {
    /// The stream ended with `[DONE]` and no error.
    Ok,
    /// The server answered with this HTTP status (not 2xx).
    Http(u16),
    /// The stream carried an error event, or ended early.
    Stream(String),
    /// No answer: connection failure or the per-request timeout.
    Transport(String),
}

/// One request as measured. Times are microseconds; `scheduled_us` and `sent_us` count from the
/// start of the run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RequestRecord {
    /// Position in the trace.
    pub index: usize,
    pub request_id: String,
    /// When the trace says it should leave (after `--speedup`).
    pub scheduled_us: u64,
    /// When it left (after waiting for a `--max-concurrency` slot, if it had to).
    pub sent_us: u64,
    /// Time spent waiting for a concurrency slot.
    pub wait_us: u64,
    pub status: Status,
    /// Send to the first generated text.
    pub ttft_us: Option<u64>,
    /// Gaps between successive chunks with generated text.
    pub itl_us: Vec<u32>,
    /// Send to the end of the answer.
    pub e2e_us: u64,
    /// The trace's prompt length and prompt blocks.
    pub input_length: u32,
    pub blocks: u32,
    pub block_size: u32,
    /// What the server's `usage` said, when it said it.
    pub usage: Option<Usage>,
    /// Chunks with generated text (the output length when `usage` is missing).
    pub text_chunks: u32,
}

impl RequestRecord {
    /// Prompt tokens as the server counted them, else the trace's.
    pub fn prompt_tokens(&self) -> u32 {
        self.usage
            .map_or(self.input_length, |u| u.prompt_tokens.max(1))
    }

    /// Generated tokens as the server counted them, else the chunks seen.
    pub fn output_tokens(&self) -> u32 {
        self.usage.map_or(self.text_chunks, |u| u.completion_tokens)
    }
}

/// Percentiles of one latency, in milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Percentiles {
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
}

impl Percentiles {
    fn of(mut ms: Vec<f64>) -> Self {
        ms.sort_by(f64::total_cmp);
        let mean = if ms.is_empty() {
            0.0
        } else {
            ms.iter().sum::<f64>() / ms.len() as f64
        };
        Self {
            mean,
            p50: percentile(&ms, 0.5),
            p90: percentile(&ms, 0.9),
            p99: percentile(&ms, 0.99),
            max: ms.last().copied().unwrap_or(0.0),
        }
    }
}

/// The headline numbers of one run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BenchSummary {
    pub requests: u64,
    pub ok: u64,
    /// Every request that did not end `ok`.
    pub errors: u64,
    /// Answered 429 Too Many Requests.
    pub http_429: u64,
    /// Answered with another non-2xx status.
    pub http_other: u64,
    /// Errors inside a stream (or streams that ended without `[DONE]`).
    pub stream_errors: u64,
    /// Connection failures and timeouts.
    pub transport_errors: u64,
    /// Requests that waited for a `--max-concurrency` slot.
    pub waited: u64,
    /// First scheduled send to the last answer.
    pub duration_s: f64,
    /// Completed (ok) requests per second of `duration_s`.
    pub requests_per_s: f64,
    pub prompt_tokens_per_s: f64,
    pub output_tokens_per_s: f64,
    pub ttft_ms: Percentiles,
    pub itl_ms: Percentiles,
    pub e2e_ms: Percentiles,
    /// How late requests left against their schedule (wait for a slot included).
    pub send_lag_ms: Percentiles,
    /// Σ cached_tokens / Σ prompt_tokens over ok requests whose usage reported cached tokens.
    pub hit_rate: Option<f64>,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub output_tokens: u64,
}

impl BenchSummary {
    /// Summarises the records of one run.
    pub fn of(records: &[RequestRecord]) -> Self {
        let ok: Vec<&RequestRecord> = records.iter().filter(|r| r.status == Status::Ok).collect();
        let count =
            |f: &dyn Fn(&Status) -> bool| records.iter().filter(|r| f(&r.status)).count() as u64;
        let start = records.iter().map(|r| r.scheduled_us).min().unwrap_or(0);
        let end = records
            .iter()
            .map(|r| r.sent_us + r.e2e_us)
            .max()
            .unwrap_or(0);
        let duration_s = end.saturating_sub(start) as f64 / 1e6;
        let per_s = |x: u64| {
            if duration_s > 0.0 {
                x as f64 / duration_s
            } else {
                0.0
            }
        };
        let prompt: u64 = ok.iter().map(|r| u64::from(r.prompt_tokens())).sum();
        let output: u64 = ok.iter().map(|r| u64::from(r.output_tokens())).sum();
        let reported: Vec<&&RequestRecord> = ok
            .iter()
            .filter(|r| r.usage.is_some_and(|u| u.cached_tokens.is_some()))
            .collect();
        let cached: u64 = reported
            .iter()
            .filter_map(|r| r.usage.and_then(|u| u.cached_tokens))
            .map(u64::from)
            .sum();
        let reported_prompt: u64 = reported.iter().map(|r| u64::from(r.prompt_tokens())).sum();
        let ms = |us: u64| us as f64 / 1000.0;
        Self {
            requests: records.len() as u64,
            ok: ok.len() as u64,
            errors: (records.len() - ok.len()) as u64,
            http_429: count(&|s| *s == Status::Http(429)),
            http_other: count(&|s| matches!(s, Status::Http(c) if *c != 429)),
            stream_errors: count(&|s| matches!(s, Status::Stream(_))),
            transport_errors: count(&|s| matches!(s, Status::Transport(_))),
            waited: records.iter().filter(|r| r.wait_us > 0).count() as u64,
            duration_s,
            requests_per_s: per_s(ok.len() as u64),
            prompt_tokens_per_s: per_s(prompt),
            output_tokens_per_s: per_s(output),
            ttft_ms: Percentiles::of(ok.iter().filter_map(|r| r.ttft_us).map(ms).collect()),
            itl_ms: Percentiles::of(
                ok.iter()
                    .flat_map(|r| r.itl_us.iter().map(|&g| ms(u64::from(g))))
                    .collect(),
            ),
            e2e_ms: Percentiles::of(ok.iter().map(|r| ms(r.e2e_us)).collect()),
            send_lag_ms: Percentiles::of(
                records
                    .iter()
                    .map(|r| ms(r.sent_us.saturating_sub(r.scheduled_us)))
                    .collect(),
            ),
            hit_rate: (reported_prompt > 0).then(|| cached as f64 / reported_prompt as f64),
            prompt_tokens: prompt,
            cached_tokens: cached,
            output_tokens: output,
        }
    }

    /// The report `infera bench` prints.
    pub fn render(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "requests        {} sent, {} ok, {} errors ({} × 429, {} other HTTP, {} in stream, {} transport)",
            self.requests,
            self.ok,
            self.errors,
            self.http_429,
            self.http_other,
            self.stream_errors,
            self.transport_errors
        );
        let _ = writeln!(
            s,
            "throughput      {:.2} req/s, {:.0} prompt tok/s, {:.0} output tok/s over {:.2} s",
            self.requests_per_s,
            self.prompt_tokens_per_s,
            self.output_tokens_per_s,
            self.duration_s
        );
        let hit = self
            .hit_rate
            .map_or("not reported".to_owned(), |h| format!("{:.1} %", h * 100.0));
        let _ = writeln!(
            s,
            "hit rate        {hit} (server-reported cached / prompt tokens: {} / {})",
            self.cached_tokens, self.prompt_tokens
        );
        let _ = writeln!(
            s,
            "latency (ms)    mean      p50      p90      p99      max"
        );
        for (name, p) in [
            ("ttft", &self.ttft_ms),
            ("itl", &self.itl_ms),
            ("e2e", &self.e2e_ms),
            ("send lag", &self.send_lag_ms),
        ] {
            let _ = writeln!(
                s,
                "  {name:<12} {:>8.1} {:>8.1} {:>8.1} {:>8.1} {:>8.1}",
                p.mean, p.p50, p.p90, p.p99, p.max
            );
        }
        if self.waited > 0 {
            let _ = writeln!(
                s,
                "concurrency     {} requests waited for a --max-concurrency slot",
                self.waited
            );
        }
        s
    }
}

/// The records as simulator rows, so that `--out` writes the columns of `infera replay --out`:
/// `arrival_us` is the scheduled send, `worker` is empty (the client does not see it),
/// `gpu_hit_blocks` is `cached_tokens / block_size`, `queue_us` the wait for a concurrency slot,
/// `finish_us` the end of the answer (all from the start of the run), `tpot_us` the mean gap
/// between text chunks, and `rejected` marks every request that did not end `ok`.
pub fn to_sim_result(records: &[RequestRecord]) -> SimResult {
    let requests: Vec<RequestOutcome> = records
        .iter()
        .map(|r| {
            let cached = r.usage.and_then(|u| u.cached_tokens).unwrap_or(0);
            let tpot_us = if r.itl_us.is_empty() {
                0.0
            } else {
                r.itl_us.iter().map(|&g| f64::from(g)).sum::<f64>() / r.itl_us.len() as f64
            };
            RequestOutcome {
                index: r.index,
                request_id: r.request_id.clone(),
                arrival_us: r.scheduled_us,
                worker: String::new(),
                decode_worker: None,
                overlap_blocks: 0,
                blocks: r.blocks,
                gpu_hit_blocks: (cached / r.block_size.max(1)).min(r.blocks),
                host_hit_blocks: 0,
                disk_hit_blocks: 0,
                cached_tokens: cached,
                input_tokens: r.prompt_tokens(),
                output_tokens: r.output_tokens(),
                queue_us: r.wait_us,
                ttft_us: r.ttft_us.unwrap_or(0),
                finish_us: r.sent_us + r.e2e_us,
                tpot_us,
                retention: None,
                rejected: r.status != Status::Ok,
                limited: None,
                tenant: None,
                router_queue_us: 0,
            }
        })
        .collect();
    SimResult {
        makespan_us: requests.iter().map(|r| r.finish_us).max().unwrap_or(0),
        block_size: records.first().map_or(0, |r| r.block_size),
        requests,
        workers: Vec::new(),
        block_ledger: Vec::new(),
        events: 0,
        steps: 0,
    }
}

#[cfg(test)]
mod tests;
