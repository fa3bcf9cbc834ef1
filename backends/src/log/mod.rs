//! Durable event logs: the same `infera_core::log::EventLog` contract as core's `MemoryLog`,
//! kept where a restarted server (or another replica) can read it back.
//!
//! | backend | for | sequence numbers | snapshot | subscribe |
//! |---|---|---|---|---|
//! | [`JetStreamLog`] | replicas sharing one log; restart in seconds | JetStream stream sequence; batches are ADR-50 atomic batches | object store bucket | ordered push consumer |
//! | [`SqliteLog`] | one server that wants durability, no service to run | `log_state.last_seq` under `BEGIN IMMEDIATE` | `snapshots` table | poll, woken by local appends |
//! | [`PostgresLog`] | a shared store analytics can query | `log_state.last_seq` row lock | `snapshots` table | `LISTEN`/`NOTIFY` |
//!
//! Every backend passes one conformance suite (`testing::event_log::event_log_conformance`, run
//! by `tests/event_log.rs`): contiguous, atomic, ordered batches; reads from any position;
//! subscriptions that see history then every handle's appends; compaction that turns reads below
//! the snapshot into `LogError::Compacted`; data that survives reopening; malformed stored records
//! that are errors, never panics. Where a store lost envelopes no snapshot covers (a JetStream
//! retention bound was hit), reads report it as an error instead of skipping (see [`jetstream`]).
//!
//! [`open_event_log`] turns the server's `--event-log` value into a log (formats in [`config`]).

pub mod config;
#[cfg(feature = "nats")]
pub mod jetstream;
#[cfg(feature = "sql")]
pub mod sql;

#[cfg(any(feature = "nats", feature = "sql"))]
mod codec;
#[cfg(feature = "sql")]
mod tail;

pub use config::{
    EventLogConfig, InvalidEventLogSpec, JetStreamLogConfig, PostgresLogConfig, SqliteLogConfig,
};
#[cfg(feature = "nats")]
pub use jetstream::{JetStreamLog, MAX_ATOMIC_BATCH};
#[cfg(feature = "sql")]
pub use sql::{HIT_RATE_QUERY, HitRateRow, PostgresLog, SqliteLog};

use infera_core::clock::{Clock, SystemClock};
use infera_core::log::{EventLog, LogError, MemoryLog};
use std::sync::Arc;

/// Why an event log could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum OpenEventLogError {
    /// The `--event-log` value is malformed; fix the flag.
    #[error(transparent)]
    InvalidSpec(#[from] InvalidEventLogSpec),
    /// The store's backend was compiled out of this build.
    #[error(transparent)]
    NotBuilt(#[from] crate::NotBuilt),
    /// The store was unreachable or refused to open; [`OpenEventLogError::is_retryable`] says
    /// whether trying again later may help.
    #[error("opening the {backend} event log: {source}")]
    Open {
        backend: &'static str,
        #[source]
        source: LogError,
    },
}

impl OpenEventLogError {
    /// Whether retrying later may succeed (a store that is down, not a bad flag).
    pub fn is_retryable(&self) -> bool {
        match self {
            OpenEventLogError::InvalidSpec(_) | OpenEventLogError::NotBuilt(_) => false,
            OpenEventLogError::Open { source, .. } => source.is_retryable(),
        }
    }
}

/// Opens the log a `--event-log` value names, stamping envelopes with the system clock:
/// `memory`, `nats://HOST:PORT[?stream=NAME]`, `sqlite:PATH` or `postgres://…`.
///
/// # Errors
/// [`OpenEventLogError::InvalidSpec`] for a malformed value (with the accepted forms),
/// [`OpenEventLogError::Open`] if the store cannot be reached or prepared.
pub async fn open_event_log(spec: &str) -> Result<Arc<dyn EventLog>, OpenEventLogError> {
    let config: EventLogConfig = spec.parse()?;
    open_event_log_with(&config, Arc::new(SystemClock)).await
}

/// Opens the log `config` describes, stamping envelopes with `clock`.
///
/// # Errors
/// [`OpenEventLogError::Open`] if the store cannot be reached or prepared.
pub async fn open_event_log_with(
    config: &EventLogConfig,
    clock: Arc<dyn Clock>,
) -> Result<Arc<dyn EventLog>, OpenEventLogError> {
    #[cfg(any(feature = "nats", feature = "sql"))]
    let open = |backend| move |source| OpenEventLogError::Open { backend, source };
    #[cfg(not(all(feature = "nats", feature = "sql")))]
    let not_built =
        |backend, feature| OpenEventLogError::NotBuilt(crate::NotBuilt { backend, feature });
    Ok(match config {
        EventLogConfig::Memory => Arc::new(MemoryLog::new(clock)),
        #[cfg(feature = "nats")]
        EventLogConfig::Jetstream(c) => Arc::new(
            JetStreamLog::connect(c, clock)
                .await
                .map_err(open("JetStream"))?,
        ),
        #[cfg(not(feature = "nats"))]
        EventLogConfig::Jetstream(_) => return Err(not_built("JetStream", "nats")),
        #[cfg(feature = "sql")]
        EventLogConfig::Sqlite(c) => Arc::new(
            SqliteLog::open(&c.path, clock)
                .await
                .map_err(open("SQLite"))?,
        ),
        #[cfg(feature = "sql")]
        EventLogConfig::Postgres(c) => Arc::new(
            PostgresLog::connect(&c.url, clock)
                .await
                .map_err(open("PostgreSQL"))?,
        ),
        #[cfg(not(feature = "sql"))]
        EventLogConfig::Sqlite(_) => return Err(not_built("SQLite", "sql")),
        #[cfg(not(feature = "sql"))]
        EventLogConfig::Postgres(_) => return Err(not_built("PostgreSQL", "sql")),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn opens_memory_and_explains_bad_specs() {
        let log = open_event_log("memory").await.expect("memory");
        assert_eq!(log.last_seq().await.expect("last"), 0);
        let err = open_event_log("redis://x").await.expect_err("unknown");
        assert!(!err.is_retryable());
        assert!(err.to_string().contains("sqlite:PATH"), "{err}");
    }

    #[tokio::test]
    async fn a_store_that_cannot_be_opened_is_an_error_naming_the_backend() {
        let dir = tempfile::tempdir().expect("tempdir");
        let missing = dir.path().join("no/such/dir/events.db");
        let err = open_event_log(&format!("sqlite:{}", missing.display()))
            .await
            .expect_err("missing directory");
        assert!(err.to_string().contains("SQLite"), "{err}");
    }
}
