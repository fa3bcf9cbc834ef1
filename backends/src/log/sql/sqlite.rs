//! The SQLite event store: one file, WAL mode, one write transaction per appended batch.
//!
//! Durability: `journal_mode=WAL`, `synchronous=NORMAL`: a committed append survives a crash of
//! the process; an OS crash or power loss may lose the transactions since the last WAL sync. The
//! write lock is taken up front (`BEGIN IMMEDIATE`), so appenders — handles in this process or
//! other processes on the same file — queue on it (`busy_timeout`) instead of failing on upgrade.

use super::{
    EventRow, HIT_RATE_QUERY, HitRateRow, HitRateTuple, ROWS_PER_INSERT, ReadMiss, SQLITE_POLL,
    apply_change, check_contiguous, decode_row, read_miss, rows, sql_error,
};
use crate::log::codec;
use crate::log::tail::{TipOrPoll, tail};
use async_trait::async_trait;
use futures::stream::BoxStream;
use infera_core::clock::Clock;
use infera_core::event::{Envelope, Seq};
use infera_core::log::{EventLog, LogError, NewEvent, SeqRange, Snapshot};
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};
use sqlx::{QueryBuilder, Sqlite, SqliteConnection};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;
use tokio::sync::watch;

static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations/sqlite");

/// How long an appender waits for another's write lock before failing.
const BUSY_TIMEOUT: Duration = Duration::from_secs(30);
/// The most rows one `read` returns.
const MAX_READ: usize = 65_536;

/// An [`EventLog`] in an SQLite file. Cheap to clone.
#[derive(Clone)]
pub struct SqliteLog {
    inner: Arc<Inner>,
    /// How often a caught-up subscription re-reads without a wake-up.
    poll: Duration,
}

struct Inner {
    pool: SqlitePool,
    store: String,
    clock: Arc<dyn Clock>,
    /// The last seq appended through any handle of this process on this file.
    tip: Arc<watch::Sender<Seq>>,
}

impl std::fmt::Debug for SqliteLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteLog")
            .field("store", &self.inner.store)
            .finish_non_exhaustive()
    }
}

/// The tip shared by every handle of this process on the file at `path`.
fn shared_tip(path: &Path, last: Seq) -> Arc<watch::Sender<Seq>> {
    type Tips = Mutex<HashMap<PathBuf, Weak<watch::Sender<Seq>>>>;
    static TIPS: OnceLock<Tips> = OnceLock::new();
    let mut tips = TIPS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    tips.retain(|_, tip| tip.strong_count() > 0);
    if let Some(tip) = tips.get(path).and_then(Weak::upgrade) {
        return tip;
    }
    let tip = Arc::new(watch::Sender::new(last));
    tips.insert(path.to_owned(), Arc::downgrade(&tip));
    tip
}

impl SqliteLog {
    /// Opens (creating if missing) the database at `path` and applies pending migrations.
    ///
    /// # Errors
    /// [`LogError::Backend`] naming the file if it cannot be opened or migrated (not a database,
    /// a directory that does not exist, migrations from a newer build).
    pub async fn open(path: &Path, clock: Arc<dyn Clock>) -> Result<Self, LogError> {
        let store = format!("SQLite event log {}", path.display());
        let options = SqliteConnectOptions::new()
            .filename(path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Normal)
            .busy_timeout(BUSY_TIMEOUT);
        let pool = SqlitePoolOptions::new()
            .max_connections(4)
            .connect_with(options)
            .await
            .map_err(|e| sql_error(&store, "opening the database", e))?;
        MIGRATOR.run(&pool).await.map_err(|e| {
            LogError::Backend(format!(
                "migrating {store}: {e}; is it an infera event log?"
            ))
        })?;
        let canonical = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_owned());
        let last = last_seq(&pool, &store).await?;
        Ok(Self {
            poll: SQLITE_POLL,
            inner: Arc::new(Inner {
                pool,
                store,
                clock,
                tip: shared_tip(&canonical, last),
            }),
        })
    }

    /// Sets how often a caught-up subscription re-reads without a wake-up (default
    /// 500 ms); wake-ups from appends in this process make it a backstop for other processes.
    pub fn with_poll_interval(mut self, poll: Duration) -> Self {
        self.poll = poll;
        self
    }

    /// The connection pool, for analytics queries such as [`HIT_RATE_QUERY`].
    pub fn pool(&self) -> &SqlitePool {
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
            .map_err(|e| sql_error(&self.inner.store, "querying hit rates", e))?;
        Ok(rows.into_iter().map(HitRateRow::from).collect())
    }

    fn err(&self, what: &str, e: sqlx::Error) -> LogError {
        sql_error(&self.inner.store, what, e)
    }

    /// `(last_seq, compacted_upto)`.
    async fn state(&self, conn: &mut SqliteConnection) -> Result<(Seq, Seq), LogError> {
        let (last, upto): (i64, i64) =
            sqlx::query_as("SELECT last_seq, compacted_upto FROM log_state WHERE id = 1")
                .fetch_one(conn)
                .await
                .map_err(|e| self.err("reading the log state", e))?;
        Ok((last.max(0) as Seq, upto.max(0) as Seq))
    }
}

async fn last_seq(pool: &SqlitePool, store: &str) -> Result<Seq, LogError> {
    let last: i64 = sqlx::query_scalar("SELECT last_seq FROM log_state WHERE id = 1")
        .fetch_one(pool)
        .await
        .map_err(|e| sql_error(store, "reading the last seq", e))?;
    Ok(last.max(0) as Seq)
}

async fn insert_events(conn: &mut SqliteConnection, rows: &[EventRow]) -> Result<(), sqlx::Error> {
    for chunk in rows.chunks(ROWS_PER_INSERT) {
        let mut query: QueryBuilder<Sqlite> = QueryBuilder::new(
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
                .push_bind(r.envelope.clone());
        });
        query.build().execute(&mut *conn).await?;
    }
    Ok(())
}

#[async_trait]
impl EventLog for SqliteLog {
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
            .begin_with("BEGIN IMMEDIATE")
            .await
            .map_err(|e| self.err(what, e))?;
        let (last, _) = self.state(&mut tx).await?;
        let first = last + 1;
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
            apply_change::<Sqlite>(&mut tx, change)
                .await
                .map_err(|e| self.err(what, e))?;
        }
        let new_last = last + n;
        sqlx::query("UPDATE log_state SET last_seq = ? WHERE id = 1")
            .bind(super::to_i64(new_last, "seq")?)
            .execute(&mut *tx)
            .await
            .map_err(|e| self.err(what, e))?;
        tx.commit().await.map_err(|e| self.err(what, e))?;
        self.inner.tip.send_if_modified(|tip| {
            let grew = new_last > *tip;
            *tip = (*tip).max(new_last);
            grew
        });
        Ok(SeqRange {
            first,
            last: new_last,
        })
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
                "SELECT seq, envelope FROM events WHERE seq >= ? ORDER BY seq LIMIT ?",
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
                self.state(&mut conn).await?,
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
        last_seq(&self.inner.pool, &self.inner.store).await
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
            .begin_with("BEGIN IMMEDIATE")
            .await
            .map_err(|e| self.err(what, e))?;
        let (last, current) = self.state(&mut tx).await?;
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
        for (sql, with_body) in [
            (
                "INSERT INTO snapshots (upto, created_us, snapshot) VALUES (?, ?, ?) \
                 ON CONFLICT (upto) DO UPDATE SET created_us = excluded.created_us, \
                 snapshot = excluded.snapshot",
                true,
            ),
            ("DELETE FROM snapshots WHERE upto < ?", false),
            ("DELETE FROM events WHERE seq <= ?", false),
            (
                "UPDATE log_state SET compacted_upto = ? WHERE id = 1",
                false,
            ),
        ] {
            let mut query = sqlx::query(sql).bind(upto);
            if with_body {
                query = query.bind(now).bind(body.as_str());
            }
            query
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
        let wake = TipOrPoll {
            tip: self.inner.tip.subscribe(),
            poll: self.poll,
        };
        tail(self.clone(), from, Box::new(wake))
    }
}
