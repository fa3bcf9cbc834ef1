//! The PostgreSQL event store: shared by every server replica and open to analytics.
//!
//! An append bumps `log_state.last_seq` with `UPDATE … RETURNING` first: the row lock it takes
//! is held to commit, so concurrent appenders (any replica) queue there, get disjoint contiguous
//! ranges and commit in sequence order. The same transaction sends `NOTIFY infera_event_log`
//! with the new last seq; subscribers `LISTEN` and re-read (delivered on commit, so never early).

use super::{
    EventRow, HIT_RATE_QUERY, HitRateRow, HitRateTuple, NOTIFY_CHANNEL, POSTGRES_POLL,
    ROWS_PER_INSERT, ReadMiss, apply_change, check_contiguous, decode_row, read_miss, rows,
    sql_error,
};
use crate::log::codec;
use crate::log::config::redact;
use crate::log::tail::{Wakeup, tail};
use async_trait::async_trait;
use futures::stream::BoxStream;
use infera_core::clock::Clock;
use infera_core::event::{Envelope, Seq};
use infera_core::log::{EventLog, LogError, NewEvent, SeqRange, Snapshot};
use sqlx::postgres::{PgListener, PgPool, PgPoolOptions};
use sqlx::{PgConnection, Postgres, QueryBuilder};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations/postgres");

/// How long to wait for a pooled connection.
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(10);
/// The most rows one `read` returns.
const MAX_READ: usize = 65_536;

/// An [`EventLog`] in a PostgreSQL database. Cheap to clone.
#[derive(Clone)]
pub struct PostgresLog {
    inner: Arc<Inner>,
    /// How often a caught-up subscription re-reads without a wake-up.
    poll: Duration,
}

struct Inner {
    pool: PgPool,
    store: String,
    clock: Arc<dyn Clock>,
    /// The last seq appended through this handle (wakes its own subscribers without a round trip).
    tip: watch::Sender<Seq>,
}

impl std::fmt::Debug for PostgresLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresLog")
            .field("store", &self.inner.store)
            .finish_non_exhaustive()
    }
}

impl PostgresLog {
    /// Connects to `url` and applies pending migrations (under sqlx's advisory lock, so replicas
    /// starting together migrate once).
    ///
    /// # Errors
    /// [`LogError::Backend`] naming the database (password removed) if it cannot be reached or
    /// migrated.
    pub async fn connect(url: &str, clock: Arc<dyn Clock>) -> Result<Self, LogError> {
        let store = format!("PostgreSQL event log {}", redact(url));
        let pool = PgPoolOptions::new()
            .max_connections(8)
            .acquire_timeout(ACQUIRE_TIMEOUT)
            .connect(url)
            .await
            .map_err(|e| sql_error(&store, "connecting", e))?;
        MIGRATOR.run(&pool).await.map_err(|e| {
            LogError::Backend(format!(
                "migrating {store}: {e}; is it an infera event log?"
            ))
        })?;
        Ok(Self {
            poll: POSTGRES_POLL,
            inner: Arc::new(Inner {
                pool,
                store,
                clock,
                tip: watch::Sender::new(0),
            }),
        })
    }

    /// Sets how often a caught-up subscription re-reads without a wake-up (default
    /// 2 s); `NOTIFY` wakes subscribers at once, so this is a backstop for a lost listener.
    pub fn with_poll_interval(mut self, poll: Duration) -> Self {
        self.poll = poll;
        self
    }

    /// The connection pool, for analytics queries such as [`HIT_RATE_QUERY`].
    pub fn pool(&self) -> &PgPool {
        &self.inner.pool
    }

    /// Runs [`HIT_RATE_QUERY`].
    ///
    /// # Errors
    /// [`LogError::Backend`] if the query fails.
    pub async fn hit_rate_by_model_worker_hour(&self) -> Result<Vec<HitRateRow>, LogError> {
        let rows: Vec<HitRateTuple> = sqlx::query_as(HIT_RATE_QUERY)
            .fetch_all(&self.inner.pool)
            .await
            .map_err(|e| self.err("querying hit rates", e))?;
        Ok(rows.into_iter().map(HitRateRow::from).collect())
    }

    fn err(&self, what: &str, e: sqlx::Error) -> LogError {
        sql_error(&self.inner.store, what, e)
    }

    /// `(last_seq, compacted_upto)`; with `lock`, the row stays locked to the end of the
    /// transaction.
    async fn state(&self, conn: &mut PgConnection, lock: bool) -> Result<(Seq, Seq), LogError> {
        let sql = if lock {
            "SELECT last_seq, compacted_upto FROM log_state WHERE id = 1 FOR UPDATE"
        } else {
            "SELECT last_seq, compacted_upto FROM log_state WHERE id = 1"
        };
        let (last, upto): (i64, i64) = sqlx::query_as(sql)
            .fetch_one(conn)
            .await
            .map_err(|e| self.err("reading the log state", e))?;
        Ok((last.max(0) as Seq, upto.max(0) as Seq))
    }
}

async fn insert_events(conn: &mut PgConnection, rows: &[EventRow]) -> Result<(), sqlx::Error> {
    for chunk in rows.chunks(ROWS_PER_INSERT) {
        let mut query: QueryBuilder<Postgres> = QueryBuilder::new(
            "INSERT INTO events (seq, ts_us, kind, worker, dp_rank, model, request_id, envelope) ",
        );
        query.push_values(chunk, |mut row, r| {
            row.push_bind(r.seq)
                .push_bind(r.ts_us)
                .push_bind(r.kind)
                .push_bind(r.worker.clone())
                .push_bind(r.dp_rank)
                .push_bind(r.model.clone())
                .push_bind(r.request_id.clone())
                .push("CAST(")
                .push_bind_unseparated(r.envelope.clone())
                .push_unseparated(" AS JSONB)");
        });
        query.build().execute(&mut *conn).await?;
    }
    Ok(())
}

#[async_trait]
impl EventLog for PostgresLog {
    async fn append(&self, batch: Vec<NewEvent>) -> Result<SeqRange, LogError> {
        if batch.is_empty() {
            let last = self.last_seq().await?;
            return Ok(SeqRange {
                first: last + 1,
                last,
            });
        }
        let n = batch.len() as Seq;
        let what = "appending";
        let mut tx = self
            .inner
            .pool
            .begin()
            .await
            .map_err(|e| self.err(what, e))?;
        let last: i64 = sqlx::query_scalar(
            "UPDATE log_state SET last_seq = last_seq + $1 WHERE id = 1 RETURNING last_seq",
        )
        .bind(super::to_i64(n, "batch size")?)
        .fetch_one(&mut *tx)
        .await
        .map_err(|e| self.err(what, e))?;
        let last = last.max(0) as Seq;
        let first = last + 1 - n;
        let envelopes = codec::stamp(batch, first, self.inner.clock.now_us());
        let mut event_rows = Vec::with_capacity(envelopes.len());
        let mut changes = Vec::new();
        for env in &envelopes {
            let (row, change) = rows(env)?;
            event_rows.push(row);
            changes.extend(change);
        }
        insert_events(&mut tx, &event_rows)
            .await
            .map_err(|e| self.err(what, e))?;
        for change in changes {
            apply_change::<Postgres>(&mut tx, change)
                .await
                .map_err(|e| self.err(what, e))?;
        }
        sqlx::query("SELECT pg_notify($1, $2)")
            .bind(NOTIFY_CHANNEL)
            .bind(last.to_string())
            .execute(&mut *tx)
            .await
            .map_err(|e| self.err(what, e))?;
        tx.commit().await.map_err(|e| self.err(what, e))?;
        self.inner.tip.send_if_modified(|tip| {
            let grew = last > *tip;
            *tip = (*tip).max(last);
            grew
        });
        Ok(SeqRange { first, last })
    }

    async fn read(&self, from: Seq, max: usize) -> Result<Vec<Envelope>, LogError> {
        let from = from.max(1);
        if max == 0 {
            return Ok(Vec::new());
        }
        let mut conn = self
            .inner
            .pool
            .acquire()
            .await
            .map_err(|e| self.err("reading", e))?;
        let from_i64 = super::to_i64(from, "seq")?;
        let store = &self.inner.store;
        let mut raced = false;
        let found = loop {
            let found: Vec<(i64, String)> = sqlx::query_as(
                "SELECT seq, envelope::text FROM events WHERE seq >= $1 ORDER BY seq LIMIT $2",
            )
            .bind(from_i64)
            .bind(max.min(MAX_READ) as i64)
            .fetch_all(&mut *conn)
            .await
            .map_err(|e| self.err("reading", e))?;
            let first_found = found.first().map(|r| r.0);
            if first_found == Some(from as i64) {
                break found;
            }
            match read_miss(
                store,
                from,
                first_found,
                self.state(&mut conn, false).await?,
                raced,
            ) {
                ReadMiss::Retry => raced = true,
                ReadMiss::Empty => return Ok(Vec::new()),
                ReadMiss::Fail(e) => return Err(e),
            }
        };
        let envelopes = found
            .iter()
            .map(|(seq, text)| decode_row(store, *seq, text))
            .collect::<Result<Vec<_>, _>>()?;
        check_contiguous(store, from, &envelopes)?;
        Ok(envelopes)
    }

    async fn last_seq(&self) -> Result<Seq, LogError> {
        let last: i64 = sqlx::query_scalar("SELECT last_seq FROM log_state WHERE id = 1")
            .fetch_one(&self.inner.pool)
            .await
            .map_err(|e| self.err("reading the last seq", e))?;
        Ok(last.max(0) as Seq)
    }

    async fn snapshot(&self) -> Result<Option<Snapshot>, LogError> {
        let text: Option<String> =
            sqlx::query_scalar("SELECT snapshot FROM snapshots ORDER BY upto DESC LIMIT 1")
                .fetch_optional(&self.inner.pool)
                .await
                .map_err(|e| self.err("reading the snapshot", e))?;
        text.map(|t| codec::decode_snapshot(t.as_bytes(), &self.inner.store))
            .transpose()
    }

    async fn compact(&self, snapshot: Snapshot) -> Result<(), LogError> {
        let what = "compacting";
        let body = codec::encode_snapshot(&snapshot)?;
        let upto = super::to_i64(snapshot.upto, "seq")?;
        let mut tx = self
            .inner
            .pool
            .begin()
            .await
            .map_err(|e| self.err(what, e))?;
        let (last, current) = self.state(&mut tx, true).await?;
        if snapshot.upto > last {
            return Err(LogError::SnapshotAhead {
                upto: snapshot.upto,
                last,
            });
        }
        if snapshot.upto < current {
            return Err(LogError::Backend(format!(
                "compacting {}: the snapshot at seq {} is older than the stored one at seq {current}",
                self.inner.store, snapshot.upto
            )));
        }
        let now = super::to_i64(self.inner.clock.now_us(), "timestamp")?;
        sqlx::query(
            "INSERT INTO snapshots (upto, created_us, snapshot) VALUES ($1, $2, $3) \
             ON CONFLICT (upto) DO UPDATE SET created_us = excluded.created_us, \
             snapshot = excluded.snapshot",
        )
        .bind(upto)
        .bind(now)
        .bind(body.as_str())
        .execute(&mut *tx)
        .await
        .map_err(|e| self.err(what, e))?;
        for sql in [
            "DELETE FROM snapshots WHERE upto < $1",
            "DELETE FROM events WHERE seq <= $1",
            "UPDATE log_state SET compacted_upto = $1 WHERE id = 1",
        ] {
            sqlx::query(sql)
                .bind(upto)
                .execute(&mut *tx)
                .await
                .map_err(|e| self.err(what, e))?;
        }
        tx.commit().await.map_err(|e| self.err(what, e))?;
        tracing::info!(
            store = %self.inner.store,
            upto = snapshot.upto,
            snapshot_events = snapshot.events.len(),
            "event log compacted"
        );
        Ok(())
    }

    fn subscribe(&self, from: Seq) -> BoxStream<'static, Result<Envelope, LogError>> {
        let wake = PgWake {
            pool: self.inner.pool.clone(),
            store: self.inner.store.clone(),
            listener: None,
            tip: self.inner.tip.subscribe(),
            poll: self.poll,
        };
        tail(self.clone(), from, Box::new(wake))
    }
}

/// Wakes on `NOTIFY infera_event_log` (any replica's append), this handle's appends, or every
/// poll interval (the backstop while the listener is down).
struct PgWake {
    pool: PgPool,
    store: String,
    listener: Option<PgListener>,
    tip: watch::Receiver<Seq>,
    poll: Duration,
}

#[async_trait]
impl Wakeup for PgWake {
    async fn wait(&mut self) -> Result<(), LogError> {
        if self.listener.is_none() {
            match listen(&self.pool).await {
                Ok(listener) => {
                    self.listener = Some(listener);
                    // Appends committed before LISTEN took effect sent no signal we can see: re-read.
                    return Ok(());
                }
                Err(e) => tracing::warn!(
                    store = %self.store,
                    error = %e,
                    poll = ?self.poll,
                    "cannot LISTEN for event log appends; polling"
                ),
            }
        }
        let notified = async {
            match self.listener.as_mut() {
                Some(listener) => listener.recv().await.map(drop),
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            result = notified => {
                if let Err(e) = result {
                    tracing::warn!(store = %self.store, error = %e, "event log LISTEN connection lost");
                    self.listener = None;
                }
                Ok(())
            }
            changed = self.tip.changed() => changed.map_err(|_| LogError::Closed),
            () = tokio::time::sleep(self.poll) => Ok(()),
        }
    }
}

async fn listen(pool: &PgPool) -> Result<PgListener, sqlx::Error> {
    let mut listener = PgListener::connect_with(pool).await?;
    listener.listen(NOTIFY_CHANNEL).await?;
    Ok(listener)
}
