//! `infera server --record-trace DIR`: the server's committed events and each request's session
//! (and prompt, with `--record-prompts`), through the request service's taps
//! ([`Service::tap`](infera_core::service::Service::tap),
//! [`Service::tap_request_meta`](infera_core::service::Service::tap_request_meta)), into the
//! trace recorder ([`infera_replay::record`]) on a thread of its own, so Parquet encoding and
//! disk writes never run on the request path. The recorder's
//! counters are exported on `/metrics` as `infera_trace_*`; events the tap could not queue are
//! `infera_event_tap_dropped_events_total{tap="trace"}`.

use crate::config::server::TraceRecordingConfig;
use anyhow::Context as _;
use infera_adapters::server::ServerState;
use infera_core::clock::{Clock, SystemClock};
use infera_core::service::drain_tap;
use infera_replay::record::{Recorder, RecorderOptions, RecorderStats};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
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

/// The recorder's counters on the server's `/metrics` (`infera_trace_*`), set from its stats
/// after each round (the recorder thread is their one writer).
#[derive(Debug, Default, Clone)]
struct Exported {
    segments_written: Counter,
    rows_written: Counter,
    events_written: Counter,
    rows_late: Counter,
    rows_unhashed: Counter,
    write_errors: Counter,
    in_flight: Gauge,
}

impl Exported {
    fn register(&self, r: &mut Registry) {
        let counters = [
            (
                "segments_written",
                "Trace segments written",
                &self.segments_written,
            ),
            (
                "rows_written",
                "Requests written to trace segments",
                &self.rows_written,
            ),
            (
                "events_written",
                "KV and discovery events written to the event files",
                &self.events_written,
            ),
            (
                "rows_late",
                "Requests dropped because they finished after later rows were written",
                &self.rows_late,
            ),
            (
                "rows_unhashed",
                "Requests not recordable: no block hashes consistent with their length (e.g. \
                 round-robin, which does not tokenize)",
                &self.rows_unhashed,
            ),
            (
                "write_errors",
                "Segments or event files that could not be written (their content is lost)",
                &self.write_errors,
            ),
        ];
        for (name, help, counter) in counters {
            r.register(format!("infera_trace_{name}"), help, counter.clone());
        }
        r.register(
            "infera_trace_requests_in_flight",
            "Requests the recorder is waiting on before it can write later rows",
            self.in_flight.clone(),
        );
    }

    fn publish(&self, s: &RecorderStats, in_flight: usize) {
        let set = |c: &Counter, v: u64| {
            c.inc_by(v.saturating_sub(c.get()));
        };
        set(&self.segments_written, s.segments_written);
        set(&self.rows_written, s.rows_written);
        set(&self.events_written, s.events_written);
        set(&self.rows_late, s.rows_late);
        set(&self.rows_unhashed, s.rows_unhashed);
        set(&self.write_errors, s.write_errors);
        self.in_flight
            .set(i64::try_from(in_flight).unwrap_or(i64::MAX));
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
        let exported = Exported::default();
        state.service().register_metrics(|r| exported.register(r));
        let mut rx = state.service().tap("trace", TAP_CAPACITY);
        let mut metas = state
            .service()
            .tap_request_meta(TAP_CAPACITY, config.prompts);
        let dir = config.dir.clone();
        let thread = std::thread::Builder::new()
            .name("infera-recorder".into())
            .spawn(move || {
                let publish = |rec: &mut Recorder| {
                    for e in rec.take_errors() {
                        tracing::error!(error = %e, "trace recording: a segment was lost");
                    }
                    exported.publish(&rec.stats(), rec.in_flight());
                };
                // Drained in rounds, not woken per batch: on a busy server one wake-up takes
                // hundreds of batches, which keeps the recorder's CPU off the request path.
                loop {
                    std::thread::sleep(DRAIN_EVERY);
                    let now = clock.now_us();
                    while let Ok(m) = metas.try_recv() {
                        recorder.note_request(m, now);
                    }
                    let closed = drain_tap(&mut rx, |e| recorder.feed(e));
                    while let Ok(m) = metas.try_recv() {
                        recorder.note_request(m, now);
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
                exported.publish(&stats, 0);
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
