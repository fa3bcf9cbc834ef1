//! Every event log against the one conformance suite, plus what only some backends promise:
//! JetStream's restart-and-rebuild, bounded retention detected as a gap, atomic batch limits;
//! the SQL stores' analytics tables and hit-rate query; `open_event_log` on every kind.
//!
//! Real services only: a nats-server 2.15 the harness starts on a free port, SQLite files in
//! temp dirs, PostgreSQL databases created fresh per test (the machine's server, or a private
//! cluster when it runs none).

use async_trait::async_trait;
use infera_backends::log::{
    EventLogConfig, HitRateRow, JetStreamLog, JetStreamLogConfig, MAX_ATOMIC_BATCH, PostgresLog,
    SqliteLog, open_event_log, open_event_log_with,
};
use infera_backends::testing::NatsServer;
use infera_backends::testing::event_log::{
    self as suite, EventLogFixture, append_all, finished, read_all, routed, workload,
};
use infera_backends::testing::postgres::PostgresServer;
use infera_core::clock::{Clock, VirtualClock};
use infera_core::event::Seq;
use infera_core::fleet::{FleetConfig, FleetState};
use infera_core::log::{EventLog, LogError, MemoryLog, Snapshot, rebuild};
use infera_core::projection::Projection;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// 2025-11-29 15:26:40 UTC.
const T0: u64 = 1_764_430_000_000_000;
const HOUR_US: u64 = 3_600_000_000;

fn clock() -> Arc<VirtualClock> {
    Arc::new(VirtualClock::new(T0))
}

// ---------------------------------------------------------------------------------------------
// Fixtures

struct MemoryFixture {
    clock: Arc<VirtualClock>,
    logs: Mutex<HashMap<String, MemoryLog>>,
}

impl MemoryFixture {
    async fn new() -> Self {
        Self {
            clock: clock(),
            logs: Mutex::new(HashMap::new()),
        }
    }
}

#[async_trait]
impl EventLogFixture for MemoryFixture {
    async fn open(&self, log: &str) -> Arc<dyn EventLog> {
        let mut logs = self.logs.lock().expect("lock");
        let clock = self.clock.clone();
        Arc::new(
            logs.entry(log.to_owned())
                .or_insert_with(|| MemoryLog::new(clock))
                .clone(),
        )
    }
    fn clock(&self) -> Arc<VirtualClock> {
        self.clock.clone()
    }
    fn durable(&self) -> bool {
        false
    }
    async fn inject_malformed(&self, _log: &str) -> Option<Seq> {
        None
    }
}

struct JetStreamFixture {
    server: NatsServer,
    clock: Arc<VirtualClock>,
}

impl JetStreamFixture {
    async fn new() -> Self {
        Self {
            server: nats().await,
            clock: clock(),
        }
    }

    fn config(&self, log: &str) -> JetStreamLogConfig {
        JetStreamLogConfig {
            stream: format!("conformance_{log}"),
            ..test_stream(self.server.url())
        }
    }
}

/// A stream configuration for tests: bounded to 64 MiB, so that many test streams fit in the
/// JetStream storage a small disk leaves (the production default reserves 8 GiB each).
fn test_stream(url: String) -> JetStreamLogConfig {
    JetStreamLogConfig {
        max_bytes: Some(64 << 20),
        ..JetStreamLogConfig::new(url)
    }
}

#[async_trait]
impl EventLogFixture for JetStreamFixture {
    async fn open(&self, log: &str) -> Arc<dyn EventLog> {
        Arc::new(
            JetStreamLog::connect(&self.config(log), self.clock.clone())
                .await
                .expect("open JetStream log"),
        )
    }
    fn clock(&self) -> Arc<VirtualClock> {
        self.clock.clone()
    }
    fn durable(&self) -> bool {
        true
    }
    async fn inject_malformed(&self, log: &str) -> Option<Seq> {
        let client = async_nats::connect(self.server.url())
            .await
            .expect("connect");
        let ack = client
            .request(self.config(log).subject(), "{not an envelope".into())
            .await
            .expect("publish garbage");
        let ack: serde_json::Value = serde_json::from_slice(&ack.payload).expect("ack");
        ack["seq"].as_u64()
    }
}

struct SqliteFixture {
    dir: tempfile::TempDir,
    clock: Arc<VirtualClock>,
}

impl SqliteFixture {
    async fn new() -> Self {
        Self {
            dir: tempfile::tempdir().expect("tempdir"),
            clock: clock(),
        }
    }

    fn path(&self, log: &str) -> PathBuf {
        self.dir.path().join(format!("{log}.db"))
    }
}

#[async_trait]
impl EventLogFixture for SqliteFixture {
    async fn open(&self, log: &str) -> Arc<dyn EventLog> {
        Arc::new(
            SqliteLog::open(&self.path(log), self.clock.clone())
                .await
                .expect("open SQLite log"),
        )
    }
    fn clock(&self) -> Arc<VirtualClock> {
        self.clock.clone()
    }
    fn durable(&self) -> bool {
        true
    }
    async fn inject_malformed(&self, log: &str) -> Option<Seq> {
        let opened = SqliteLog::open(&self.path(log), self.clock.clone())
            .await
            .expect("open");
        let pool = opened.pool();
        let seq = opened.last_seq().await.expect("last") as i64 + 1;
        sqlx::query("INSERT INTO events (seq, ts_us, kind, envelope) VALUES (?, 0, 'bogus', ?)")
            .bind(seq)
            .bind("{not an envelope")
            .execute(pool)
            .await
            .expect("insert garbage");
        sqlx::query("UPDATE log_state SET last_seq = ? WHERE id = 1")
            .bind(seq)
            .execute(pool)
            .await
            .expect("bump last_seq");
        Some(seq as Seq)
    }
}

struct PostgresFixture {
    server: PostgresServer,
    clock: Arc<VirtualClock>,
    urls: tokio::sync::Mutex<HashMap<String, String>>,
}

impl PostgresFixture {
    async fn new() -> Self {
        Self {
            server: postgres().await,
            clock: clock(),
            urls: tokio::sync::Mutex::new(HashMap::new()),
        }
    }

    async fn url(&self, log: &str) -> String {
        let mut urls = self.urls.lock().await;
        if let Some(url) = urls.get(log) {
            return url.clone();
        }
        let url = self
            .server
            .create_database(log)
            .await
            .expect("create database");
        urls.insert(log.to_owned(), url.clone());
        url
    }
}

#[async_trait]
impl EventLogFixture for PostgresFixture {
    async fn open(&self, log: &str) -> Arc<dyn EventLog> {
        Arc::new(
            PostgresLog::connect(&self.url(log).await, self.clock.clone())
                .await
                .expect("open PostgreSQL log"),
        )
    }
    fn clock(&self) -> Arc<VirtualClock> {
        self.clock.clone()
    }
    fn durable(&self) -> bool {
        true
    }
    async fn inject_malformed(&self, log: &str) -> Option<Seq> {
        let opened = PostgresLog::connect(&self.url(log).await, self.clock.clone())
            .await
            .expect("open");
        let seq = opened.last_seq().await.expect("last") as i64 + 1;
        // Valid JSON (the column is jsonb) that is not an envelope.
        sqlx::query(
            "INSERT INTO events (seq, ts_us, kind, envelope) \
             VALUES ($1, 0, 'bogus', '{\"type\":\"NotAnEvent\"}'::jsonb)",
        )
        .bind(seq)
        .execute(opened.pool())
        .await
        .expect("insert garbage");
        sqlx::query("UPDATE log_state SET last_seq = $1 WHERE id = 1")
            .bind(seq)
            .execute(opened.pool())
            .await
            .expect("bump last_seq");
        Some(seq as Seq)
    }
}

async fn nats() -> NatsServer {
    NatsServer::start()
        .await
        .unwrap_or_else(|e| panic!("these tests need nats-server >= 2.12: {e}"))
}

async fn postgres() -> PostgresServer {
    PostgresServer::start()
        .await
        .unwrap_or_else(|e| panic!("these tests need PostgreSQL: {e}"))
}

/// One test per (backend, case), so a failure names both.
macro_rules! conformance {
    ($backend:ident, $fixture:ty) => {
        mod $backend {
            use super::*;

            async fn fixture() -> $fixture {
                <$fixture>::new().await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn append_and_read() {
                suite::append_and_read(&fixture().await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn read_windows() {
                suite::read_windows(&fixture().await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn subscribe_history_then_live() {
                suite::subscribe_history_then_live(&fixture().await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn tail_while_appending() {
                suite::tail_while_appending(&fixture().await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn concurrent_appenders() {
                suite::concurrent_appenders(&fixture().await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn replicas_share_load() {
                suite::replicas_share_load(&fixture().await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn compact_and_rebuild() {
                suite::compact_and_rebuild(&fixture().await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn reopen_keeps_everything() {
                suite::reopen_keeps_everything(&fixture().await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn malformed_records_are_errors() {
                suite::malformed_records_are_errors(&fixture().await).await;
            }
        }
    };
}

conformance!(memory, MemoryFixture);
conformance!(jetstream, JetStreamFixture);
conformance!(sqlite, SqliteFixture);
conformance!(postgres, PostgresFixture);

// ---------------------------------------------------------------------------------------------
// JetStream

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_restarted_server_rebuilds_from_snapshot_and_tail() {
    let mut server = nats().await;
    let config = test_stream(server.url());
    let events = workload(2_000);
    let live = {
        let log = JetStreamLog::connect(&config, clock()).await.expect("open");
        append_all(&log, &events[..1_500], 64).await;
        let mut state = FleetState::new(FleetConfig::default());
        for env in read_all(&log, 1, 512).await {
            state.apply(&env);
        }
        log.compact(Snapshot {
            upto: 1_500,
            events: state.dump(),
        })
        .await
        .expect("compact");
        append_all(&log, &events[1_500..], 64).await;
        for env in read_all(&log, 1_501, 512).await {
            state.apply(&env);
        }
        state
    };
    server
        .restart()
        .await
        .expect("restart nats-server on the same store");
    let log = JetStreamLog::connect(&config, clock())
        .await
        .expect("reopen");
    let mut rebuilt = FleetState::new(FleetConfig::default());
    assert_eq!(rebuild(&log, &mut rebuilt).await.expect("rebuild"), 2_000);
    assert!(rebuilt == live, "state after restart = state before");
    assert!(matches!(
        log.read(1, 1).await,
        Err(LogError::Compacted { upto: 1_500 })
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_retention_loss_without_a_snapshot_is_a_gap_error() {
    let server = nats().await;
    let config = JetStreamLogConfig {
        stream: "bounded".to_owned(),
        max_bytes: Some(16 << 10),
        ..test_stream(server.url())
    };
    let log = JetStreamLog::connect(&config, clock()).await.expect("open");
    append_all(&log, &workload(400), 50).await;
    let first = log
        .read(1, 1)
        .await
        .expect_err("the oldest envelopes were discarded");
    let LogError::Compacted { upto } = first else {
        panic!("a gap must be an error, got {first:?}");
    };
    assert!(
        upto > 1 && upto < 400,
        "the gap ends before the surviving tail: {upto}"
    );
    let tail = log
        .read(upto + 1, 1_000)
        .await
        .expect("the surviving tail reads");
    assert_eq!(tail.last().map(|e| e.seq), Some(400));
    let mut sub = log.subscribe(1);
    assert!(
        suite::next_item(&mut sub).await.is_err(),
        "subscribing into the gap fails"
    );
    assert!(
        rebuild(&log, &mut FleetState::new(FleetConfig::default()))
            .await
            .is_err()
    );
    // With a snapshot covering the lost range, the same log rebuilds again.
    let last = log.last_seq().await.expect("last");
    log.compact(Snapshot {
        upto: last,
        events: vec![],
    })
    .await
    .expect("compact");
    assert_eq!(
        rebuild(&log, &mut FleetState::new(FleetConfig::default()))
            .await
            .expect("rebuild"),
        last
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_batches_past_the_atomic_limit_are_refused_whole() {
    let server = nats().await;
    let log = JetStreamLog::connect(&test_stream(server.url()), clock())
        .await
        .expect("open");
    let events = workload(MAX_ATOMIC_BATCH + 1);
    let err = log.append(events.clone()).await.expect_err("too big");
    assert!(err.to_string().contains("smaller batches"), "{err}");
    assert_eq!(log.last_seq().await.expect("last"), 0, "nothing was stored");
    let range = log
        .append(events[..MAX_ATOMIC_BATCH].to_vec())
        .await
        .expect("the limit itself is fine");
    assert_eq!((range.first, range.last), (1, MAX_ATOMIC_BATCH as Seq));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_refuses_a_stream_that_holds_other_subjects() {
    let server = nats().await;
    let client = async_nats::connect(server.url()).await.expect("connect");
    async_nats::jetstream::new(client.clone())
        .create_stream(async_nats::jetstream::stream::Config {
            name: "SHARED".to_owned(),
            subjects: vec!["orders.>".to_owned()],
            ..Default::default()
        })
        .await
        .expect("foreign stream");
    let config = JetStreamLogConfig {
        stream: "SHARED".to_owned(),
        ..test_stream(server.url())
    };
    let err = JetStreamLog::open(client, &config, clock())
        .await
        .expect_err("foreign stream");
    assert!(err.to_string().contains("stream of its own"), "{err}");
}

// ---------------------------------------------------------------------------------------------
// SQL analytics

/// Requests with known outcomes across two hours, models and workers; returns the expected
/// hit-rate rows.
async fn known_requests(log: &dyn EventLog, clock: &VirtualClock) -> Vec<HitRateRow> {
    log.append(workload(4)).await.expect("register");
    // Hour 15:00: worker 0 (model-a) two requests, 16/64 and 48/64 cached, overlap 1 and 3 of 4.
    clock.set(T0);
    log.append(vec![routed("h1-a", 0, 1, 0), routed("h1-b", 0, 3, 0)])
        .await
        .expect("route");
    log.append(vec![
        finished("h1-a", 64, Some(16)),
        finished("h1-b", 64, Some(48)),
    ])
    .await
    .expect("finish");
    // Worker 1 (model-b): one finished without a cached-token report, one still in flight.
    log.append(vec![routed("h1-c", 1, 2, 0), routed("h1-d", 1, 0, 0)])
        .await
        .expect("route");
    log.append(vec![finished("h1-c", 64, None)])
        .await
        .expect("finish");
    // Hour 16:00: worker 0 again, routed and finished in one batch, nothing cached.
    clock.set(T0 + HOUR_US);
    log.append(vec![routed("h2-a", 0, 0, 0), finished("h2-a", 64, Some(0))])
        .await
        .expect("route+finish");
    vec![
        HitRateRow {
            model: "model-a".into(),
            worker: "10.0.0.1:8000".into(),
            hour: "2025-11-29 15:00".into(),
            requests: 2,
            prompt_tokens: Some(128),
            cached_tokens: Some(64),
            hit_rate: Some(0.5),
            predicted_hit_rate: Some(0.5),
        },
        HitRateRow {
            model: "model-a".into(),
            worker: "10.0.0.1:8000".into(),
            hour: "2025-11-29 16:00".into(),
            requests: 1,
            prompt_tokens: Some(64),
            cached_tokens: Some(0),
            hit_rate: Some(0.0),
            predicted_hit_rate: Some(0.0),
        },
        HitRateRow {
            model: "model-b".into(),
            worker: "10.0.0.2:8000".into(),
            hour: "2025-11-29 15:00".into(),
            requests: 1,
            prompt_tokens: Some(64),
            cached_tokens: None,
            hit_rate: None,
            predicted_hit_rate: Some(0.5),
        },
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_hit_rate_by_model_worker_and_hour_is_one_query() {
    let dir = tempfile::tempdir().expect("tempdir");
    let clock = clock();
    let log = SqliteLog::open(&dir.path().join("analytics.db"), clock.clone())
        .await
        .expect("open");
    let expected = known_requests(&log, &clock).await;
    assert_eq!(
        log.hit_rate_by_model_worker_hour().await.expect("query"),
        expected
    );
    // Analytics outlive compaction of the log.
    let last = log.last_seq().await.expect("last");
    log.compact(Snapshot {
        upto: last,
        events: vec![],
    })
    .await
    .expect("compact");
    assert_eq!(
        log.hit_rate_by_model_worker_hour().await.expect("query"),
        expected
    );
    let mode: String = sqlx::query_scalar("PRAGMA journal_mode")
        .fetch_one(log.pool())
        .await
        .expect("pragma");
    assert_eq!(mode, "wal");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_hit_rate_by_model_worker_and_hour_is_one_query() {
    let server = postgres().await;
    let url = server.create_database("analytics").await.expect("database");
    let clock = clock();
    let log = PostgresLog::connect(&url, clock.clone())
        .await
        .expect("open");
    let expected = known_requests(&log, &clock).await;
    assert_eq!(
        log.hit_rate_by_model_worker_hour().await.expect("query"),
        expected
    );
    // The events table is queryable by typed columns and by the envelope's JSON.
    let (kind, worker, model, request): (String, Option<String>, Option<String>, Option<String>) =
        sqlx::query_as(
            "SELECT kind, worker, model, request_id FROM events \
             WHERE envelope->'event'->>'request_id' = 'h1-b' AND kind = 'request_routed'",
        )
        .fetch_one(log.pool())
        .await
        .expect("events row");
    assert_eq!(
        (
            kind.as_str(),
            worker.as_deref(),
            model.as_deref(),
            request.as_deref()
        ),
        (
            "request_routed",
            Some("10.0.0.1:8000"),
            Some("model-a"),
            Some("h1-b")
        )
    );
    server.drop_databases().await.expect("drop");
}

/// Follows `log` from seq 2 after seeing seq 1, while `other` appends seq 2: with polling
/// switched off (an hour), only a wake-up can deliver it within [`suite::WAIT`].
async fn woken_by_another_handle(log: Arc<dyn EventLog>, other: Arc<dyn EventLog>) {
    let events = workload(2);
    log.append(events[..1].to_vec()).await.expect("append");
    let mut sub = log.subscribe(1);
    assert_eq!(suite::next_item(&mut sub).await.expect("history").seq, 1);
    let waiter = tokio::spawn(async move { suite::next_item(&mut sub).await });
    other.append(events[1..].to_vec()).await.expect("append");
    let env = waiter
        .await
        .expect("join")
        .expect("woken by the other handle's append");
    assert_eq!(env.seq, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_handles_on_one_file_wake_each_others_subscriptions() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("shared.db");
    let open = |path: PathBuf| async move {
        let log = SqliteLog::open(&path, clock()).await.expect("open");
        Arc::new(log.with_poll_interval(Duration::from_secs(3600))) as Arc<dyn EventLog>
    };
    woken_by_another_handle(open(path.clone()).await, open(path).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_replicas_wake_each_others_subscriptions_by_notify() {
    let server = postgres().await;
    let url = server.create_database("notify").await.expect("database");
    let open = |url: String| async move {
        let log = PostgresLog::connect(&url, clock()).await.expect("open");
        Arc::new(log.with_poll_interval(Duration::from_secs(3600))) as Arc<dyn EventLog>
    };
    woken_by_another_handle(open(url.clone()).await, open(url).await).await;
    server.drop_databases().await.expect("drop");
}

// ---------------------------------------------------------------------------------------------
// open_event_log

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_event_log_opens_every_kind() {
    let server = nats().await;
    let pg = postgres().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let specs = [
        "memory".to_owned(),
        format!("{}?stream=opened&max_age=1h&max_bytes=64MiB", server.url()),
        format!("sqlite:{}", dir.path().join("opened.db").display()),
        pg.create_database("opened").await.expect("database"),
    ];
    for spec in &specs {
        let log = open_event_log(spec)
            .await
            .unwrap_or_else(|e| panic!("{spec}: {e}"));
        let range = log
            .append(vec![finished("x", 1, None)])
            .await
            .expect("append");
        assert_eq!(range.first, 1, "{spec}");
        assert_eq!(log.read(1, 10).await.expect("read").len(), 1, "{spec}");
    }
    let stream = async_nats::jetstream::new(async_nats::connect(server.url()).await.expect("nats"))
        .get_stream("opened")
        .await
        .expect("stream")
        .get_info()
        .await
        .expect("info");
    assert_eq!(stream.config.max_age, Duration::from_secs(3600));
    assert_eq!(stream.config.max_bytes, 64 << 20);
    assert!(stream.config.allow_atomic_publish && stream.config.allow_direct);
    // A server that is not there is a retryable open error, not a panic.
    let nowhere = infera_backends::testing::free_port().expect("port");
    let err = open_event_log(&format!("nats://127.0.0.1:{nowhere}"))
        .await
        .expect_err("no server");
    assert!(err.is_retryable(), "{err}");
    let config: EventLogConfig = "memory".parse().expect("parse");
    let clock = clock();
    let log = open_event_log_with(&config, clock.clone())
        .await
        .expect("open");
    log.append(workload(1)).await.expect("append");
    assert_eq!(log.read(1, 1).await.expect("read")[0].ts_us, clock.now_us());
    pg.drop_databases().await.expect("drop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_open_finishes_a_compaction_that_stored_its_snapshot_but_did_not_purge() {
    let server = nats().await;
    let config = JetStreamLogConfig {
        stream: "interrupted".to_owned(),
        ..test_stream(server.url())
    };
    let log = JetStreamLog::connect(&config, clock()).await.expect("open");
    append_all(&log, &workload(10), 4).await;
    // What `compact` leaves behind when it dies between its two steps: the snapshot object.
    let client = async_nats::connect(server.url()).await.expect("connect");
    let bucket = async_nats::jetstream::new(client)
        .get_object_store(config.snapshot_bucket())
        .await
        .expect("bucket");
    let meta = async_nats::jetstream::object_store::ObjectMetadata {
        name: "snapshot".to_owned(),
        metadata: [("upto".to_owned(), "6".to_owned())].into(),
        ..Default::default()
    };
    bucket
        .put(meta, &mut &br#"{"v":1,"upto":6,"events":[]}"#[..])
        .await
        .expect("put snapshot");
    let reopened = JetStreamLog::connect(&config, clock())
        .await
        .expect("reopen");
    assert!(matches!(
        reopened.read(1, 10).await,
        Err(LogError::Compacted { upto: 6 })
    ));
    assert_eq!(reopened.read(7, 10).await.expect("tail").len(), 4);
    assert_eq!(
        reopened.snapshot().await.expect("snapshot").map(|s| s.upto),
        Some(6)
    );
}
