//! `infera server --record-trace DIR`: the server's committed events and each request's session
//! (and prompt, with `--record-prompts`), through taps ([`ServerState::tap`],
//! [`ServerState::tap_request_meta`]), into the trace recorder ([`infera_replay::record`]) on a thread of its
//! own, so Parquet encoding and disk writes never run on the request path. The recorder's
//! counters are exported on `/metrics` as `infera_trace_*`; events the tap could not queue are
//! `infera_event_tap_dropped_events_total{tap="trace"}`.

use crate::config::server::TraceRecordingConfig;
use anyhow::Context as _;
use infera_adapters::server::{ServerState, write_family};
use infera_core::clock::{Clock, SystemClock};
use infera_core::ports::metrics::MetricsSource;
use infera_replay::record::{Recorder, RecorderOptions, RecorderStats};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

/// Batches of events the tap holds while the recorder is busy writing a segment.
const TAP_CAPACITY: usize = 1 << 16;
/// How often the recorder takes what its taps queued (and checks its segment's age).
const DRAIN_EVERY: Duration = Duration::from_millis(50);

/// The running recorder.
#[derive(Debug)]
pub struct Recording {
    thread: std::thread::JoinHandle<RecorderStats>,
}

#[derive(Debug, Default)]
struct Exported(Mutex<RecorderStats>, AtomicU64);

impl MetricsSource for Exported {
    fn render(&self, out: &mut String) {
        let s = *self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let families: [(&str, &str, u64); 6] = [
            (
                "segments_written",
                "Trace segments written.",
                s.segments_written,
            ),
            (
                "rows_written",
                "Requests written to trace segments.",
                s.rows_written,
            ),
            (
                "events_written",
                "KV and discovery events written to the event files.",
                s.events_written,
            ),
            (
                "rows_late",
                "Requests dropped because they finished after later rows were written.",
                s.rows_late,
            ),
            (
                "rows_unhashed",
                "Requests not recordable: no block hashes consistent with their length (e.g. round-robin, which does not tokenize).",
                s.rows_unhashed,
            ),
            (
                "write_errors",
                "Segments or event files that could not be written (their content is lost).",
                s.write_errors,
            ),
        ];
        for (name, help, v) in families {
            write_family(
                out,
                &format!("infera_trace_{name}_total"),
                "counter",
                help,
                &[("", v)],
            );
        }
        write_family(
            out,
            "infera_trace_requests_in_flight",
            "gauge",
            "Requests the recorder is waiting on before it can write later rows.",
            &[("", self.1.load(Ordering::Relaxed))],
        );
    }
}

impl Recording {
    /// Starts recording what `state` commits from now on.
    ///
    /// # Errors
    /// The directory cannot be created, or the thread cannot be spawned.
    pub fn start(state: &ServerState, config: &TraceRecordingConfig) -> anyhow::Result<Self> {
        let clock = SystemClock;
        let mut opts = RecorderOptions::new(&config.dir);
        opts.segment_max_bytes = config.segment_bytes.bytes();
        opts.segment_max_age_us =
            u64::try_from(config.segment_age.0.as_micros()).unwrap_or(u64::MAX);
        let mut recorder = Recorder::new(opts, clock.now_us())?;
        let exported = Arc::new(Exported::default());
        state.add_metrics(exported.clone());
        let mut rx = state.tap("trace", TAP_CAPACITY);
        let mut metas = state.tap_request_meta(TAP_CAPACITY, config.prompts);
        let dir = config.dir.clone();
        let thread = std::thread::Builder::new()
            .name("infera-recorder".into())
            .spawn(move || {
                let publish = |rec: &mut Recorder| {
                    for e in rec.take_errors() {
                        tracing::error!(error = %e, "trace recording: a segment was lost");
                    }
                    *exported.0.lock().unwrap_or_else(PoisonError::into_inner) = rec.stats();
                    exported.1.store(rec.in_flight() as u64, Ordering::Relaxed);
                };
                use tokio::sync::mpsc::error::TryRecvError;
                // Drained in rounds, not woken per batch: on a busy server one wake-up takes
                // hundreds of batches, which keeps the recorder's CPU off the request path.
                loop {
                    std::thread::sleep(DRAIN_EVERY);
                    let now = clock.now_us();
                    while let Ok(m) = metas.try_recv() {
                        recorder.note_request(m.request_id, m.session_id, m.token_ids, now);
                    }
                    let closed = loop {
                        match rx.try_recv() {
                            Ok(batch) => batch.iter().for_each(|e| recorder.feed(e)),
                            Err(TryRecvError::Empty) => break false,
                            Err(TryRecvError::Disconnected) => break true,
                        }
                    };
                    while let Ok(m) = metas.try_recv() {
                        recorder.note_request(m.request_id, m.session_id, m.token_ids, now);
                    }
                    recorder.tick(clock.now_us());
                    publish(&mut recorder);
                    if closed {
                        break;
                    }
                }
                let (stats, errors) = recorder.finish(clock.now_us());
                for e in errors {
                    tracing::error!(error = %e, "trace recording: a segment was lost");
                }
                *exported.0.lock().unwrap_or_else(PoisonError::into_inner) = stats;
                stats
            })
            .context("cannot start the trace recorder thread")?;
        tracing::info!(dir = %dir.display(), "recording the trace");
        Ok(Self { thread })
    }

    /// Waits for the recorder to write what it holds, once `state.close_taps()` ended its
    /// stream; logs what it recorded.
    pub fn finish(self) {
        match self.thread.join() {
            Ok(s) => tracing::info!(
                segments = s.segments_written,
                rows = s.rows_written,
                events = s.events_written,
                late = s.rows_late,
                unhashed = s.rows_unhashed,
                write_errors = s.write_errors,
                "trace recording closed"
            ),
            Err(_) => tracing::error!("the trace recorder thread panicked"),
        }
    }
}
