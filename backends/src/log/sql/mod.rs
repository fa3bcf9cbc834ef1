//! The SQL event store: the same [`infera_core::log::EventLog`] on SQLite (embedded, one server)
//! or PostgreSQL (shared, queryable by analytics), through sqlx.
//!
//! # Tables (migrations in `backends/migrations/{sqlite,postgres}`, embedded, run on open)
//! | table | row | written |
//! |---|---|---|
//! | `events` | one envelope: `seq` (primary key), `ts_us`, `kind`, `worker`, `dp_rank`, `model`, `request_id`, `envelope` (golden JSON; `jsonb` on Postgres) | on append; rows `seq <= upto` deleted by compaction |
//! | `log_state` | the single row `id = 1`: `last_seq`, `compacted_upto` | on append / compaction |
//! | `snapshots` | `upto`, `created_us`, `snapshot` (`{"v":1,"upto":N,"events":[…]}`) | by compaction; only the latest is kept |
//! | `requests` | one routed request: model, worker, dp rank, role, UTC `hour`, policy, prompt tokens, request/overlap blocks; then status, TTFT, tokens in/out, cached tokens once finished | `RequestRouted` inserts, `RequestFinished` completes; **kept by compaction**, so analytics outlive the log's retention |
//!
//! `worker` is the worker id (for a request: its first leg, the prefill leg in PD mode), `model` the
//! model name of a registration or a request, `hour` the routing time truncated to the hour,
//! `YYYY-MM-DD HH:00` UTC (computed on append, so the same query works on both databases).
//!
//! # Hit rate by model, worker and hour
//! [`HIT_RATE_QUERY`], the same text on SQLite and PostgreSQL:
//! ```sql
#![doc = include_str!("hit_rate.sql")]
//! ```
//! `hit_rate` is the engines' own measure (cached prompt tokens over prompt tokens, over the
//! requests that reported cached tokens); `predicted_hit_rate` is the router's (overlap blocks
//! over request blocks at routing time). A big difference between the two means the KV index is
//! stale.
//!
//! # Sequence numbers and concurrency
//! An append is one transaction: read-and-bump `log_state.last_seq`, insert the batch's rows with
//! the next numbers, update `requests`, commit. Holding the `log_state` row lock (Postgres) or the
//! write lock (SQLite `BEGIN IMMEDIATE`) until commit serializes appenders, so batches get disjoint
//! contiguous ranges and commit in sequence order: a reader never sees seq n+1 before n.
//! Compaction is one transaction too (snapshot upsert, `DELETE … WHERE seq <= upto`), so there is
//! no window in which a snapshot and the envelopes it covers disagree.
//!
//! # Subscriptions
//! Tail by polling reads, woken by appends through any handle of this process (SQLite: handles on
//! the same file share a tip), Postgres `NOTIFY infera_event_log` (every replica), and a poll
//! interval for anything else (another process writing the same SQLite file).

mod postgres;
mod sqlite;

pub use postgres::PostgresLog;
pub use sqlite::SqliteLog;

use infera_core::event::{Envelope, Event, Role, Seq};
use infera_core::log::LogError;
use std::time::Duration;

/// Hit rate by model, worker and hour; valid SQL for both SQLite and PostgreSQL. Columns:
/// `model`, `worker`, `hour`, `requests`, `prompt_tokens`, `cached_tokens`, `hit_rate`,
/// `predicted_hit_rate` (the rates are NULL where nothing was measured).
pub const HIT_RATE_QUERY: &str = include_str!("hit_rate.sql");

/// One row of [`HIT_RATE_QUERY`].
#[derive(Debug, Clone, PartialEq)]
pub struct HitRateRow {
    pub model: String,
    pub worker: String,
    /// `YYYY-MM-DD HH:00`, UTC.
    pub hour: String,
    /// Finished requests.
    pub requests: i64,
    pub prompt_tokens: Option<i64>,
    pub cached_tokens: Option<i64>,
    /// Cached prompt tokens over prompt tokens, as the engines reported them.
    pub hit_rate: Option<f64>,
    /// Overlap blocks over request blocks, as the router predicted them.
    pub predicted_hit_rate: Option<f64>,
}

/// [`HIT_RATE_QUERY`]'s columns as sqlx decodes them.
type HitRateTuple = (
    String,
    String,
    String,
    i64,
    Option<i64>,
    Option<i64>,
    Option<f64>,
    Option<f64>,
);

impl From<HitRateTuple> for HitRateRow {
    fn from(t: HitRateTuple) -> Self {
        Self {
            model: t.0,
            worker: t.1,
            hour: t.2,
            requests: t.3,
            prompt_tokens: t.4,
            cached_tokens: t.5,
            hit_rate: t.6,
            predicted_hit_rate: t.7,
        }
    }
}

/// Rows per multi-row `INSERT` (well inside SQLite's and Postgres' bind parameter limits).
const ROWS_PER_INSERT: usize = 512;

/// How often a caught-up subscription re-reads without a wake-up.
const SQLITE_POLL: Duration = Duration::from_millis(500);
const POSTGRES_POLL: Duration = Duration::from_secs(2);

/// The `NOTIFY` channel Postgres appends signal on.
const NOTIFY_CHANNEL: &str = "infera_event_log";

/// An `events` row.
#[derive(Debug)]
struct EventRow {
    seq: i64,
    ts_us: i64,
    kind: &'static str,
    worker: Option<String>,
    dp_rank: Option<i64>,
    model: Option<String>,
    request_id: Option<String>,
    envelope: String,
}

/// A change to the `requests` table.
#[derive(Debug)]
enum RequestChange {
    Routed {
        request_id: String,
        model: String,
        worker: String,
        dp_rank: i64,
        role: &'static str,
        hour: String,
        seq: i64,
        ts_us: i64,
        policy: String,
        prompt_tokens: i64,
        request_blocks: i64,
        overlap_blocks: i64,
    },
    Finished {
        request_id: String,
        seq: i64,
        ts_us: i64,
        status: String,
        ttft_us: Option<i64>,
        tokens_in: i64,
        tokens_out: i64,
        cached_tokens: Option<i64>,
    },
}

/// Writes one request change to the `requests` table, in SQL both SQLite and PostgreSQL take
/// (`$n` placeholders, `ON CONFLICT … DO UPDATE`). A routed request starts (or restarts) its row;
/// a finished one fills in its outcome.
async fn apply_change<DB>(
    conn: &mut DB::Connection,
    change: RequestChange,
) -> Result<(), sqlx::Error>
where
    DB: sqlx::Database,
    DB::Arguments: sqlx::IntoArguments<DB>,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'t> String: sqlx::Encode<'t, DB> + sqlx::Type<DB>,
    for<'t> &'static str: sqlx::Encode<'t, DB> + sqlx::Type<DB>,
    for<'t> i64: sqlx::Encode<'t, DB> + sqlx::Type<DB>,
    for<'t> Option<i64>: sqlx::Encode<'t, DB> + sqlx::Type<DB>,
{
    match change {
        RequestChange::Routed {
            request_id,
            model,
            worker,
            dp_rank,
            role,
            hour,
            seq,
            ts_us,
            policy,
            prompt_tokens,
            request_blocks,
            overlap_blocks,
        } => {
            sqlx::query::<DB>(
                "INSERT INTO requests (request_id, model, worker, dp_rank, role, hour, routed_seq, \
                 routed_us, policy, prompt_tokens, request_blocks, overlap_blocks) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12) \
                 ON CONFLICT (request_id) DO UPDATE SET model = excluded.model, \
                 worker = excluded.worker, dp_rank = excluded.dp_rank, role = excluded.role, \
                 hour = excluded.hour, routed_seq = excluded.routed_seq, \
                 routed_us = excluded.routed_us, policy = excluded.policy, \
                 prompt_tokens = excluded.prompt_tokens, request_blocks = excluded.request_blocks, \
                 overlap_blocks = excluded.overlap_blocks, finished_seq = NULL, \
                 finished_us = NULL, status = NULL, ttft_us = NULL, tokens_in = NULL, \
                 tokens_out = NULL, cached_tokens = NULL",
            )
            .bind(request_id)
            .bind(model)
            .bind(worker)
            .bind(dp_rank)
            .bind(role)
            .bind(hour)
            .bind(seq)
            .bind(ts_us)
            .bind(policy)
            .bind(prompt_tokens)
            .bind(request_blocks)
            .bind(overlap_blocks)
            .execute(conn)
            .await?;
        }
        RequestChange::Finished {
            request_id,
            seq,
            ts_us,
            status,
            ttft_us,
            tokens_in,
            tokens_out,
            cached_tokens,
        } => {
            sqlx::query::<DB>(
                "UPDATE requests SET finished_seq = $1, finished_us = $2, status = $3, \
                 ttft_us = $4, tokens_in = $5, tokens_out = $6, cached_tokens = $7 \
                 WHERE request_id = $8",
            )
            .bind(seq)
            .bind(ts_us)
            .bind(status)
            .bind(ttft_us)
            .bind(tokens_in)
            .bind(tokens_out)
            .bind(cached_tokens)
            .bind(request_id)
            .execute(conn)
            .await?;
        }
    }
    Ok(())
}

fn to_i64(v: u64, what: &str) -> Result<i64, LogError> {
    i64::try_from(v).map_err(|_| LogError::Backend(format!("{what} {v} does not fit a SQL BIGINT")))
}

/// The rows an envelope becomes.
fn rows(env: &Envelope) -> Result<(EventRow, Option<RequestChange>), LogError> {
    let seq = to_i64(env.seq, "seq")?;
    let ts_us = to_i64(env.ts_us, "timestamp")?;
    let source_worker = env.source.as_ref().map(|s| (s.worker.0.clone(), s.dp_rank));
    let (worker, model, request_id, change) = match &env.event {
        Event::WorkerRegistered(r) => (
            Some((r.record.worker_id.0.clone(), r.record.dp_rank)),
            Some(r.record.model_name.clone()),
            None,
            None,
        ),
        Event::WorkerDeregistered(d) => (Some((d.worker.0.clone(), 0)), None, None, None),
        Event::WorkerDraining(d) => (Some((d.worker.0.clone(), 0)), None, None, None),
        Event::KvBlocksStored(e) => (
            Some((e.worker.worker.0.clone(), e.worker.dp_rank)),
            None,
            None,
            None,
        ),
        Event::KvBlocksRemoved(e) => (
            Some((e.worker.worker.0.clone(), e.worker.dp_rank)),
            None,
            None,
            None,
        ),
        Event::KvCacheCleared(e) => (
            Some((e.worker.worker.0.clone(), e.worker.dp_rank)),
            None,
            None,
            None,
        ),
        Event::RequestRouted(r) => {
            let leg = r.legs.first();
            let worker = leg.map(|l| (l.worker.worker.0.clone(), l.worker.dp_rank));
            let change = RequestChange::Routed {
                request_id: r.request_id.0.clone(),
                model: r.model.clone(),
                worker: worker.as_ref().map(|w| w.0.clone()).unwrap_or_default(),
                dp_rank: i64::from(worker.as_ref().map_or(0, |w| w.1)),
                role: leg.map_or(Role::Mixed, |l| l.role).as_str(),
                hour: utc_hour(env.ts_us),
                seq,
                ts_us,
                policy: r.policy.clone(),
                prompt_tokens: i64::from(r.prompt_tokens),
                request_blocks: r.blocks.len() as i64,
                overlap_blocks: i64::from(leg.map_or(0, |l| l.overlap_blocks)),
            };
            (
                worker,
                Some(r.model.clone()),
                Some(r.request_id.0.clone()),
                Some(change),
            )
        }
        Event::RequestPrefilled(p) => (None, None, Some(p.request_id.0.clone()), None),
        // A snapshot's window: no worker, model or request of its own.
        Event::RecentLoad(_) | Event::RouterRetuned(_) => (None, None, None, None),
        Event::TierLoadMeasured(t) => (
            Some((t.source.worker.0.clone(), t.source.dp_rank)),
            None,
            None,
            None,
        ),
        Event::RequestFinished(f) => {
            let status = serde_json::to_value(f.status)
                .ok()
                .and_then(|v| v.as_str().map(str::to_owned))
                .unwrap_or_default();
            let change = RequestChange::Finished {
                request_id: f.request_id.0.clone(),
                seq,
                ts_us,
                status,
                ttft_us: f.ttft_us.map(|t| to_i64(t, "ttft")).transpose()?,
                tokens_in: i64::from(f.tokens_in),
                tokens_out: i64::from(f.tokens_out),
                cached_tokens: f.cached_tokens.map(i64::from),
            };
            (None, None, Some(f.request_id.0.clone()), Some(change))
        }
    };
    let worker = worker.or(source_worker);
    let row = EventRow {
        seq,
        ts_us,
        kind: env.event.kind(),
        dp_rank: worker.as_ref().map(|w| i64::from(w.1)),
        worker: worker.map(|w| w.0),
        model,
        request_id,
        envelope: super::codec::encode_envelope(env)?,
    };
    Ok((row, change))
}

/// `YYYY-MM-DD HH:00` (UTC) of a time in microseconds since the Unix epoch.
fn utc_hour(ts_us: u64) -> String {
    let secs = ts_us / 1_000_000;
    let days = (secs / 86_400) as i64;
    let hour = (secs % 86_400) / 3600;
    let (year, month, day) = infera_core::clock::civil_from_days(days);
    format!("{year:04}-{month:02}-{day:02} {hour:02}:00")
}

/// Checks that rows read from `from` are the contiguous run the contract promises (the caller
/// has already ruled out compaction, so a hole is a gap: rows deleted behind the log's back).
/// What a read whose rows did not start at `from` does next, given the log state read after its
/// select (`last`, `upto`) and whether it already selected twice.
enum ReadMiss {
    /// Select again: an append may have committed between the select and the state read.
    Retry,
    /// Nothing at `from` yet.
    Empty,
    Fail(LogError),
}

fn read_miss(
    store: &str,
    from: Seq,
    first_found: Option<i64>,
    (last, upto): (Seq, Seq),
    raced: bool,
) -> ReadMiss {
    if from <= upto {
        return ReadMiss::Fail(LogError::Compacted { upto });
    }
    match first_found {
        // The state read sees every commit up to `last`, so a second select does too: only an
        // empty second select is a real gap.
        None if from <= last && !raced => ReadMiss::Retry,
        None if from <= last => ReadMiss::Fail(super::codec::missing(store, from, last + 1, upto)),
        None => ReadMiss::Empty,
        Some(first) => ReadMiss::Fail(super::codec::missing(store, from, first as Seq, upto)),
    }
}

fn check_contiguous(store: &str, from: Seq, envelopes: &[Envelope]) -> Result<(), LogError> {
    match (from..)
        .zip(envelopes)
        .find(|(expected, env)| env.seq != *expected)
    {
        Some((expected, env)) => Err(super::codec::missing(store, expected, env.seq, 0)),
        None => Ok(()),
    }
}

/// Decodes an `events` row, checking the envelope agrees with its key.
fn decode_row(store: &str, seq: i64, envelope: &str) -> Result<Envelope, LogError> {
    let seq = Seq::try_from(seq)
        .map_err(|_| LogError::Backend(format!("negative seq {seq} in {store}")))?;
    let env = super::codec::decode_envelope(envelope.as_bytes(), seq, store)?;
    if env.seq != seq {
        return Err(LogError::Backend(format!(
            "malformed event in {store}: row seq {seq} holds an envelope with seq {}",
            env.seq
        )));
    }
    Ok(env)
}

fn sql_error(store: &str, what: &str, e: sqlx::Error) -> LogError {
    LogError::Backend(format!("{what} in {store}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hours_are_utc_calendar_hours() {
        assert_eq!(utc_hour(0), "1970-01-01 00:00");
        // 2025-11-29 15:26:40 UTC
        assert_eq!(utc_hour(1_764_430_000_000_000), "2025-11-29 15:00");
        // 2024-02-29 23:59:59 UTC (leap day)
        assert_eq!(utc_hour(1_709_251_199_000_000), "2024-02-29 23:00");
        // 2000-03-01 00:00:00 UTC
        assert_eq!(utc_hour(951_868_800_000_000), "2000-03-01 00:00");
    }

    #[test]
    fn golden_events_map_to_rows() {
        let text = include_str!("../../../../fixtures/events/v1.jsonl");
        let mut routed = 0;
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            let env: Envelope = serde_json::from_str(line).expect("golden");
            let (row, change) = rows(&env).expect("rows");
            assert_eq!(row.seq as u64, env.seq);
            assert_eq!(row.kind, env.event.kind());
            match (&env.event, change) {
                (
                    Event::RequestRouted(_),
                    Some(RequestChange::Routed {
                        model,
                        worker,
                        hour,
                        ..
                    }),
                ) => {
                    routed += 1;
                    assert_eq!(model, "deepseek-v4");
                    assert_eq!(worker, "10.0.0.5:30000");
                    assert_eq!(hour, "2025-11-29 15:00");
                    assert_eq!(row.request_id.as_deref(), Some("req-1"));
                }
                (
                    Event::RequestFinished(_),
                    Some(RequestChange::Finished {
                        status,
                        cached_tokens,
                        ..
                    }),
                ) => {
                    assert_eq!(status, "ok");
                    assert_eq!(cached_tokens, Some(16));
                }
                (Event::RequestRouted(_) | Event::RequestFinished(_), other) => {
                    panic!("unexpected change {other:?}")
                }
                (_, change) => assert!(change.is_none()),
            }
            if matches!(env.event, Event::KvBlocksStored(_)) {
                assert_eq!(row.worker.as_deref(), Some("10.0.0.5:30000"));
                assert_eq!(row.dp_rank, Some(1));
            }
        }
        assert_eq!(routed, 1);
    }
}
