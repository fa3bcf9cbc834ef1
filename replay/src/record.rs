//! The trace recorder behind `infera server --record-trace DIR`: the server's committed events in,
//! rolling Parquet segments out, in the trace format `infera replay DIR` reads.
//!
//! # What a segment holds
//! - `DIR/trace-<session>-<n>.parquet`: one row per finished client request, in the trace schema
//!   ([`crate::trace::schema`]) plus the routing decision and its outcome, in the column names of
//!   `infera replay --out` where they mean the same: `worker`, `dp_rank`, `decode_worker`,
//!   `overlap_blocks`, `policy`, `status`, `ttft_us`, `cached_tokens`, `finish_us`, `attempts`.
//!   `arrival_us` and `finish_us` are microseconds since the Unix epoch (the router's clock), so
//!   segments of successive server runs concatenate in order; `block_hashes` are the router's
//!   chained hashes of the prompt's complete blocks at the chosen worker's block size. Prompt
//!   tokens are recorded only when the server asks for them (`--record-prompts`).
//! - `DIR/events/events-<session>-<n>.parquet`: every other event of the log in the same window
//!   (worker registrations, draining, deregistrations, KV blocks stored / removed / cleared):
//!   `seq`, `ts_us`, `kind` (`Event::kind`, as the SQL event store names it), `source_worker`, `source_dp_rank`, `source_seq` and `event` (the
//!   event's JSON, as the event log stores it), for analytics; `infera replay` reads only the
//!   request segments.
//! - `session_id`, `priority` and, with `--record-prompts`, `token_ids` come from
//!   [`Recorder::note_request`] (the server's request-metadata tap), not from the events;
//!   `think_time_us` of a session's turn that arrived after its predecessor finished is the gap
//!   between the two (see [`think`]).
//!
//! `<session>` is the recorder's start time (20 zero-padded digits of Unix µs) and `<n>` counts
//! segments, so file-name order is time order across restarts.
//!
//! # Order and completeness
//! A request's row is known only when it finishes, but segments must be in arrival order. Rows
//! therefore wait until every request that arrived before them has finished: a rotation writes the
//! finished rows that arrived before the oldest request still in flight and keeps the rest for
//! the next segment. A request in flight for longer than [`RecorderOptions::max_in_flight_us`]
//! no longer holds rows back; if it finishes later its row is dropped (`late`). Requests are
//! told apart by the router's request key, never by the client's id (a client may send one id
//! with concurrent requests); the attempts of one request (its retries) become one row, with the
//! first attempt's arrival and the client's id ([`RequestId`](infera_core::ids::RequestId)).
//! Rotation happens by size ([`RecorderOptions::segment_max_bytes`], estimated) and age
//! ([`RecorderOptions::segment_max_age_us`]); each file is written complete and atomically
//! (temporary file, fsync, rename), so a crash loses at most the rows and events of the open
//! segment. Multiple server replicas must record into separate directories.
//!
//! The recorder is synchronous and owns no thread; the server feeds it from a queue that never
//! blocks requests (drops are counted there) and calls [`Recorder::tick`] periodically.

use crate::trace::{Trace, TraceError, write_atomic, write_parquet_with};
use arrow_array::builder::{StringBuilder, UInt32Builder, UInt64Builder};
use arrow_array::{ArrayRef, RecordBatch};
use arrow_schema::{DataType, Field, Schema};
use infera_core::event::{Envelope, RequestStatus};
use infera_core::service::RequestMeta;
use parquet::file::properties::WriterProperties;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Where and how often to write segments.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecorderOptions {
    pub dir: PathBuf,
    /// Rotate once the open segment holds about this many bytes (rows and events, estimated).
    pub segment_max_bytes: u64,
    /// Rotate once the open segment is this old (and holds anything).
    pub segment_max_age_us: u64,
    /// A request in flight for longer than this stops holding later rows back.
    pub max_in_flight_us: u64,
}

impl RecorderOptions {
    /// 64 MiB or 60 s per segment; requests in flight for over 10 minutes stop holding rows back.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self {
            dir: dir.into(),
            segment_max_bytes: 64 << 20,
            segment_max_age_us: 60_000_000,
            max_in_flight_us: 600_000_000,
        }
    }
}

/// What the recorder did, for `/metrics` and the shutdown log line.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RecorderStats {
    pub segments_written: u64,
    pub rows_written: u64,
    pub events_written: u64,
    /// Requests that finished after later rows had been written (in flight too long).
    pub rows_late: u64,
    /// Requests without block hashes consistent with their length (not tokenized, e.g. under
    /// round-robin, or a worker of unknown block size): not recordable as trace rows.
    pub rows_unhashed: u64,
    /// Segments (or event files) that could not be written; their content is lost.
    pub write_errors: u64,
}

/// Why the recorder cannot start.
#[derive(Debug, thiserror::Error)]
#[error("cannot record traces into {}: {source}", .dir.display())]
pub struct RecorderError {
    pub dir: PathBuf,
    #[source]
    pub source: std::io::Error,
}

/// One non-request event, ready for an event file.
#[derive(Debug)]
struct EventRow {
    seq: u64,
    ts_us: u64,
    kind: &'static str,
    source: Option<(String, u32, Option<u64>)>,
    json: String,
}

/// See the module docs.
#[derive(Debug)]
pub struct Recorder {
    opts: RecorderOptions,
    session: u64,
    next_segment: u64,
    rows: assemble::Assembler,
    events: Vec<EventRow>,
    open_since_us: Option<u64>,
    open_bytes: u64,
    stats: RecorderStats,
    errors: Vec<TraceError>,
}

fn status_str(s: RequestStatus) -> &'static str {
    match s {
        RequestStatus::Ok => "ok",
        RequestStatus::ClientError => "client_error",
        RequestStatus::Cancelled => "cancelled",
        RequestStatus::WorkerError => "worker_error",
        RequestStatus::Timeout => "timeout",
        RequestStatus::Rejected => "rejected",
    }
}

impl Recorder {
    /// A recorder writing into `opts.dir` (created if missing), its session stamped `now_us`.
    ///
    /// # Errors
    /// The directory (or its `events/` subdirectory) cannot be created.
    pub fn new(opts: RecorderOptions, now_us: u64) -> Result<Self, RecorderError> {
        let events = opts.dir.join("events");
        std::fs::create_dir_all(&events).map_err(|source| RecorderError {
            dir: opts.dir.clone(),
            source,
        })?;
        Ok(Self {
            opts,
            session: now_us,
            next_segment: 0,
            rows: assemble::Assembler::default(),
            events: Vec::new(),
            open_since_us: None,
            open_bytes: 0,
            stats: RecorderStats::default(),
            errors: Vec::new(),
        })
    }

    /// The counters so far.
    pub fn stats(&self) -> RecorderStats {
        RecorderStats {
            rows_late: self.rows.late,
            rows_unhashed: self.rows.unhashed,
            ..self.stats
        }
    }

    /// The write failures since the last call (each also counted in `write_errors`), for the
    /// caller to log.
    pub fn take_errors(&mut self) -> Vec<TraceError> {
        std::mem::take(&mut self.errors)
    }

    /// Requests routed and not finished.
    pub fn in_flight(&self) -> usize {
        self.rows.in_flight()
    }

    /// Takes what the events do not say about the request keyed `key` ([`RequestId`](infera_core::ids::RequestId)): its
    /// session and (when the server records prompts) its token ids. It may arrive before or after
    /// the request's events.
    pub fn note_request(&mut self, meta: RequestMeta, now_us: u64) {
        self.rows.note_request(meta, now_us);
    }

    /// Takes one committed event.
    pub fn feed(&mut self, env: &Envelope) {
        match self.rows.feed(env) {
            assemble::Fed::Request(Some(bytes)) => self.open(env.ts_us, bytes),
            assemble::Fed::Request(None) => {}
            assemble::Fed::Other => {
                let json = serde_json::to_string(&env.event).unwrap_or_default();
                self.open(env.ts_us, json.len() as u64 + 64);
                self.events.push(EventRow {
                    seq: env.seq,
                    ts_us: env.ts_us,
                    kind: env.event.kind(),
                    source: env
                        .source
                        .as_ref()
                        .map(|s| (s.worker.as_str().to_owned(), s.dp_rank, s.seq)),
                    json,
                });
            }
        }
    }

    fn open(&mut self, now_us: u64, bytes: u64) {
        self.open_since_us.get_or_insert(now_us);
        self.open_bytes += bytes;
    }

    /// Rotates when the open segment is big or old enough. Call after each batch of events and
    /// periodically (so an idle server still closes its segment by age).
    pub fn tick(&mut self, now_us: u64) {
        let old = self
            .open_since_us
            .is_some_and(|t| now_us.saturating_sub(t) >= self.opts.segment_max_age_us);
        if old || self.open_bytes >= self.opts.segment_max_bytes {
            self.rotate(now_us, false);
        }
    }

    /// Writes everything that can be written (at shutdown: requests still in flight are not
    /// recorded). Returns the final counters and the write failures not yet taken.
    pub fn finish(&mut self, now_us: u64) -> (RecorderStats, Vec<TraceError>) {
        self.rotate(now_us, true);
        (self.stats(), std::mem::take(&mut self.errors))
    }

    fn rotate(&mut self, now_us: u64, all: bool) {
        let rows = self
            .rows
            .take_ready(now_us, self.opts.max_in_flight_us, all);
        let events = std::mem::take(&mut self.events);
        let kept_bytes = self.rows.held_bytes();
        self.open_since_us = (kept_bytes > 0).then_some(now_us);
        self.open_bytes = kept_bytes;
        if rows.is_empty() && events.is_empty() {
            return;
        }
        let n = self.next_segment;
        self.next_segment += 1;
        let name = format!("{:020}-{n:06}", self.session);
        if !rows.is_empty() {
            let path = self.opts.dir.join(format!("trace-{name}.parquet"));
            let written = rows.len() as u64;
            match write_rows(rows, self.session, &path) {
                Ok(()) => {
                    self.stats.rows_written += written;
                    self.stats.segments_written += 1;
                }
                Err(e) => {
                    self.stats.write_errors += 1;
                    self.errors.push(e);
                }
            }
        }
        if !events.is_empty() {
            let path = self
                .opts
                .dir
                .join("events")
                .join(format!("events-{name}.parquet"));
            match write_events(&events, &path) {
                Ok(()) => self.stats.events_written += events.len() as u64,
                Err(e) => {
                    self.stats.write_errors += 1;
                    self.errors.push(e);
                }
            }
        }
    }
}

fn write_rows(rows: Vec<assemble::Row>, session: u64, path: &Path) -> Result<(), TraceError> {
    let mut worker = StringBuilder::new();
    let mut decode = StringBuilder::new();
    let mut policy = StringBuilder::new();
    let mut status = StringBuilder::new();
    let mut dp_rank = UInt32Builder::new();
    let mut overlap = UInt32Builder::new();
    let mut cached = UInt32Builder::new();
    let mut attempts = UInt32Builder::new();
    let mut ttft = UInt64Builder::new();
    let mut finish = UInt64Builder::new();
    for r in &rows {
        worker.append_value(&r.worker);
        decode.append_option(r.decode_worker.as_deref());
        policy.append_value(&r.policy);
        status.append_value(status_str(r.status));
        dp_rank.append_value(r.dp_rank);
        overlap.append_value(r.overlap_blocks);
        cached.append_option(r.cached_tokens);
        attempts.append_value(r.attempts);
        ttft.append_option(r.ttft_us);
        finish.append_value(r.finish_us);
    }
    let extra: Vec<(Field, ArrayRef)> = vec![
        (
            Field::new("worker", DataType::Utf8, false),
            Arc::new(worker.finish()),
        ),
        (
            Field::new("dp_rank", DataType::UInt32, false),
            Arc::new(dp_rank.finish()),
        ),
        (
            Field::new("decode_worker", DataType::Utf8, true),
            Arc::new(decode.finish()),
        ),
        (
            Field::new("overlap_blocks", DataType::UInt32, false),
            Arc::new(overlap.finish()),
        ),
        (
            Field::new("policy", DataType::Utf8, false),
            Arc::new(policy.finish()),
        ),
        (
            Field::new("status", DataType::Utf8, false),
            Arc::new(status.finish()),
        ),
        (
            Field::new("ttft_us", DataType::UInt64, true),
            Arc::new(ttft.finish()),
        ),
        (
            Field::new("cached_tokens", DataType::UInt32, true),
            Arc::new(cached.finish()),
        ),
        (
            Field::new("finish_us", DataType::UInt64, false),
            Arc::new(finish.finish()),
        ),
        (
            Field::new("attempts", DataType::UInt32, false),
            Arc::new(attempts.finish()),
        ),
    ];
    let trace = Trace {
        requests: rows.into_iter().map(|r| r.request).collect(),
        source: format!("infera server recording (session {session})"),
        notes: vec!["recorded by infera server: arrival_us is Unix time in µs".to_owned()],
    };
    write_parquet_with(&trace, &extra, path)
}

fn write_events(events: &[EventRow], path: &Path) -> Result<(), TraceError> {
    let schema = Arc::new(Schema::new(vec![
        Field::new("seq", DataType::UInt64, false),
        Field::new("ts_us", DataType::UInt64, false),
        Field::new("kind", DataType::Utf8, false),
        Field::new("source_worker", DataType::Utf8, true),
        Field::new("source_dp_rank", DataType::UInt32, true),
        Field::new("source_seq", DataType::UInt64, true),
        Field::new("event", DataType::Utf8, false),
    ]));
    let batches = events
        .chunks(crate::trace::parquet::ROWS_PER_GROUP)
        .map(|chunk| {
            let mut seq = UInt64Builder::new();
            let mut ts = UInt64Builder::new();
            let mut kind = StringBuilder::new();
            let mut worker = StringBuilder::new();
            let mut rank = UInt32Builder::new();
            let mut source_seq = UInt64Builder::new();
            let mut json = StringBuilder::new();
            for e in chunk {
                seq.append_value(e.seq);
                ts.append_value(e.ts_us);
                kind.append_value(e.kind);
                worker.append_option(e.source.as_ref().map(|s| s.0.as_str()));
                rank.append_option(e.source.as_ref().map(|s| s.1));
                source_seq.append_option(e.source.as_ref().and_then(|s| s.2));
                json.append_value(&e.json);
            }
            let columns: Vec<ArrayRef> = vec![
                Arc::new(seq.finish()),
                Arc::new(ts.finish()),
                Arc::new(kind.finish()),
                Arc::new(worker.finish()),
                Arc::new(rank.finish()),
                Arc::new(source_seq.finish()),
                Arc::new(json.finish()),
            ];
            RecordBatch::try_new(schema.clone(), columns)
        });
    write_atomic(
        path,
        schema.clone(),
        WriterProperties::builder(),
        Vec::new(),
        batches,
    )
}

pub(crate) mod assemble;
pub mod think;

#[cfg(test)]
pub(crate) mod tests;
