//! The etcd discovery backend against a real `etcd` started by the harness on free ports.
//!
//! Disconnects are real: the watcher talks to etcd through a [`TcpProxy`] the test cuts and
//! restores, or etcd itself is killed and restarted on the same data. Every wait is on the watch
//! stream with a timeout; nothing sleeps to synchronise.

use async_trait::async_trait;
use infera_backends::discovery::etcd::client::{ClientOptions, EtcdClient};
use infera_backends::discovery::etcd::endpoint::EtcdEndpoint;
use infera_backends::discovery::{
    Discovery, DiscoveryChange, DiscoveryStream, EtcdConfig, EtcdDiscovery, Registrar,
    Registration, WatchStats,
};
use infera_backends::testing::{
    DiscoveryFixture, EtcdServer, TcpProxy, discovery_conformance, free_port, next_change_for,
    sample_record,
};
use infera_core::event::{Engine, Role, WorkerRecord};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::{Instant, timeout};

const WAIT: Duration = Duration::from_secs(15);
const PREFIX: &str = "/infera/workers/";

async fn etcd() -> EtcdServer {
    EtcdServer::start()
        .await
        .unwrap_or_else(|e| panic!("these tests need a real etcd: {e}"))
}

/// Fast reconnects, so that tests spend their time on behaviour rather than backoff.
fn config(endpoint: String) -> EtcdConfig {
    EtcdConfig {
        backoff_initial: Duration::from_millis(20),
        backoff_max: Duration::from_millis(300),
        ..EtcdConfig::new([endpoint])
    }
}

async fn connect(config: EtcdConfig) -> EtcdDiscovery {
    EtcdDiscovery::connect(config).await.expect("etcd client")
}

async fn register(registrar: &dyn Registrar, record: &WorkerRecord) -> Registration {
    // Right after etcd restarts, the first request on the old channel may fail; retry as a worker
    // does, while the error says so.
    let deadline = Instant::now() + WAIT;
    loop {
        match registrar.register(record).await {
            Ok(registration) => return registration,
            Err(e) if e.is_retryable() && Instant::now() < deadline => {
                tokio::task::yield_now().await;
            }
            Err(e) => panic!("register {}: {e}", record.worker_id),
        }
    }
}

async fn next(stream: &mut DiscoveryStream) -> DiscoveryChange {
    timeout(WAIT, stream.recv())
        .await
        .expect("a change within the timeout")
        .expect("stream open")
}

fn deregistered(change: &DiscoveryChange, worker: &str) -> bool {
    matches!(change, DiscoveryChange::Deregistered { worker: w, .. } if w.as_str() == worker)
}

struct EtcdFixture {
    server: EtcdServer,
    backend: Arc<EtcdDiscovery>,
}

#[async_trait]
impl DiscoveryFixture for EtcdFixture {
    async fn registrar(&self) -> Arc<dyn Registrar> {
        self.backend.clone()
    }

    async fn discovery(&self) -> Arc<dyn Discovery> {
        self.backend.clone()
    }

    async fn publish_raw(&self, worker: &str, value: &[u8]) {
        let client = self.server.client().expect("raw client");
        client
            .put(format!("{PREFIX}{worker}").as_bytes(), value, 0)
            .await
            .expect("raw put");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_passes_the_discovery_conformance_suite() {
    let server = etcd().await;
    let backend = Arc::new(connect(config(server.endpoint())).await);
    let fixture = EtcdFixture { server, backend };
    discovery_conformance(&fixture).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_stops_renewing_expires_within_its_ttl_while_a_live_one_stays() {
    let server = etcd().await;
    let ttl = Duration::from_secs(2);
    let backend = connect(EtcdConfig {
        lease_ttl: ttl,
        ..config(server.endpoint())
    })
    .await;
    let mut stream = backend.watch().await.expect("watch");
    let alive = register(&backend, &sample_record("alive:1")).await;
    let alive_since = Instant::now();
    next_change_for(&mut stream, "alive:1", WAIT).await;

    // Until the live worker has outlived its TTL twice, workers are registered and dropped
    // without deregistering (a crash): each must vanish, and the live one must not.
    let mut round = 0;
    while alive_since.elapsed() < ttl * 2 {
        round += 1;
        let worker = format!("crashed:{round}");
        let crashed = register(&backend, &sample_record(&worker)).await;
        assert!(
            matches!(next(&mut stream).await, DiscoveryChange::Registered(r) if r.worker_id.as_str() == worker)
        );
        let dropped_at = Instant::now();
        drop(crashed);
        let change = next(&mut stream).await;
        assert!(
            deregistered(&change, &worker),
            "expected {worker} to expire, got {change:?}"
        );
        let after = dropped_at.elapsed();
        assert!(
            after <= ttl + Duration::from_secs(2),
            "expiry took {after:?} for a {ttl:?} lease"
        );
        assert!(
            after >= ttl / 3,
            "{worker} vanished after {after:?}: that is a revoke, not an expiry"
        );
    }
    let client = server.client().expect("client");
    let listed = client
        .range(format!("{PREFIX}alive:1").as_bytes(), b"")
        .await
        .expect("get");
    assert_eq!(
        listed.kvs.len(),
        1,
        "the renewing worker must still be registered"
    );
    alive.deregister().await.expect("deregister");
    assert!(deregistered(&next(&mut stream).await, "alive:1"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_watch_resumes_from_its_revision_without_missing_changes() {
    let server = etcd().await;
    let proxy = TcpProxy::start(server.client_addr()).await.expect("proxy");
    let watcher = connect(config(proxy.http_url())).await;
    let direct = connect(config(server.endpoint())).await;
    let mut stream = watcher.watch().await.expect("watch");

    let a = register(&direct, &sample_record("a:1")).await;
    assert_eq!(
        next(&mut stream).await,
        DiscoveryChange::Registered(sample_record("a:1"))
    );

    proxy.cut();
    let b = register(&direct, &sample_record("b:2")).await;
    a.deregister().await.expect("deregister a");
    proxy.restore();

    assert_eq!(
        next(&mut stream).await,
        DiscoveryChange::Registered(sample_record("b:2"))
    );
    assert!(deregistered(&next(&mut stream).await, "a:1"));
    let stats = stream.stats();
    assert!(
        WatchStats::get(&stats.reconnects) >= 1,
        "the stream was broken"
    );
    assert_eq!(
        WatchStats::get(&stats.relists),
        0,
        "a resumable watch must resume, not list again"
    );
    drop(b);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_whose_revision_was_compacted_lists_again_and_converges() {
    let server = etcd().await;
    let proxy = TcpProxy::start(server.client_addr()).await.expect("proxy");
    let watcher = connect(config(proxy.http_url())).await;
    let direct = connect(config(server.endpoint())).await;
    let mut stream = watcher.watch().await.expect("watch");

    let a = register(&direct, &sample_record("a:1")).await;
    let b = register(&direct, &sample_record("b:2")).await;
    let mut fleet: HashMap<String, WorkerRecord> = HashMap::new();
    while fleet.len() < 2 {
        apply(&mut fleet, next(&mut stream).await);
    }

    proxy.cut();
    a.deregister().await.expect("deregister a");
    let c = register(&direct, &sample_record("c:3")).await;
    let mut b_v2 = sample_record("b:2");
    b_v2.model_name = "changed-while-disconnected".to_owned();
    b.update(&b_v2).await.expect("update b");
    let client = server.client().expect("client");
    let revision = client
        .range(b"/any", b"")
        .await
        .expect("get")
        .header
        .expect("header")
        .revision;
    client.compact(revision).await.expect("compact");
    proxy.restore();

    let expected: HashMap<String, WorkerRecord> = [
        ("b:2".to_owned(), b_v2.clone()),
        ("c:3".to_owned(), sample_record("c:3")),
    ]
    .into();
    let mut saw_a_leave = false;
    let deadline = Instant::now() + WAIT;
    while fleet != expected {
        assert!(
            Instant::now() < deadline,
            "no convergence: {fleet:?} != {expected:?}"
        );
        let change = next(&mut stream).await;
        saw_a_leave |= deregistered(&change, "a:1");
        apply(&mut fleet, change);
    }
    assert!(saw_a_leave, "the vanished worker must be deregistered");
    assert!(
        WatchStats::get(&stream.stats().relists) >= 1,
        "a compacted watch lists again"
    );
    drop(c);
}

fn apply(fleet: &mut HashMap<String, WorkerRecord>, change: DiscoveryChange) {
    match change {
        DiscoveryChange::Registered(record) => {
            fleet.insert(record.worker_id.to_string(), record);
        }
        DiscoveryChange::Deregistered { worker, .. } => {
            fleet.remove(worker.as_str());
        }
        DiscoveryChange::Draining { worker, .. } => {
            panic!("etcd discovery never drains a worker, got Draining for {worker}")
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_watch_and_the_keepalive_survive_an_etcd_restart() {
    let mut server = etcd().await;
    let backend = connect(EtcdConfig {
        lease_ttl: Duration::from_secs(5),
        ..config(server.endpoint())
    })
    .await;
    let mut stream = backend.watch().await.expect("watch");
    let a = register(&backend, &sample_record("a:1")).await;
    assert_eq!(
        next(&mut stream).await,
        DiscoveryChange::Registered(sample_record("a:1"))
    );

    server.restart().await.expect("restart etcd");
    let b = register(&backend, &sample_record("b:2")).await;
    assert_eq!(
        next(&mut stream).await,
        DiscoveryChange::Registered(sample_record("b:2")),
        "the watch resumes after a restart, and a's lease survived it"
    );
    a.deregister().await.expect("deregister a");
    assert!(deregistered(&next(&mut stream).await, "a:1"));
    b.deregister().await.expect("deregister b");
    assert!(deregistered(&next(&mut stream).await, "b:2"));
    assert!(WatchStats::get(&stream.stats().reconnects) >= 1);
}

fn python_record(worker: &str, disagg_mode: serde_json::Value) -> serde_json::Value {
    serde_json::json!({
        "worker_id": worker,
        "url": format!("http://{worker}"),
        "model_name": "deepseek-ai/DeepSeek-V4",
        "engine": "sglang",
        "status": "active",
        "disagg_mode": disagg_mode,
        "disagg_meta": {"protocol": "sglang-bootstrap", "params": {"bootstrap_port": 8998}},
        "kv_events_endpoint": format!("tcp://{worker}7"),
        "kv_block_size": 64,
        "dp_rank": null,
        "dp_size": null,
        "request_transport": "nats",
        "kv": {"tokenizer_canary": "abc123", "capacity_blocks": 1000},
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_records_parse_and_garbage_is_skipped_and_counted() {
    let server = etcd().await;
    let client = server.client().expect("client");
    let put = |key: &str, value: Vec<u8>| {
        let client = client.clone();
        let key = format!("{PREFIX}{key}");
        async move { client.put(key.as_bytes(), &value, 0).await.expect("put") }
    };
    let json = |value: serde_json::Value| serde_json::to_vec(&value).expect("json");

    // Before the watch: one Python record and one garbage value.
    put(
        "10.0.0.5:8000",
        json(python_record("10.0.0.5:8000", serde_json::Value::Null)),
    )
    .await;
    put("junk:1", b"not json at all".to_vec()).await;
    let backend = connect(config(server.endpoint())).await;
    let mut stream = backend.watch().await.expect("watch");
    let DiscoveryChange::Registered(record) = next(&mut stream).await else {
        panic!("expected the Python worker")
    };
    assert_eq!(record.worker_id.as_str(), "10.0.0.5:8000");
    assert_eq!(record.engine, Engine::Sglang);
    assert_eq!(
        record.disagg_mode,
        Role::Mixed,
        "null disagg_mode means mixed"
    );
    assert_eq!((record.dp_rank, record.dp_size), (0, 1));
    assert_eq!(
        record.extra.get("status"),
        Some(&serde_json::json!("active"))
    );
    assert!(record.kv.is_some());
    assert_eq!(WatchStats::get(&stream.stats().invalid_records), 1);

    // While watching: an unknown engine and a worker id that is not its key are skipped.
    let mut unknown_engine = python_record("10.0.0.6:8000", serde_json::Value::Null);
    unknown_engine["engine"] = serde_json::json!("tensorrt-llm");
    put("10.0.0.6:8000", json(unknown_engine)).await;
    put(
        "10.0.0.7:8000",
        json(python_record("10.0.0.8:8000", serde_json::Value::Null)),
    )
    .await;
    put(
        "10.0.0.9:8000",
        json(python_record("10.0.0.9:8000", "decode".into())),
    )
    .await;
    let DiscoveryChange::Registered(decode) = next(&mut stream).await else {
        panic!("expected the decode worker")
    };
    assert_eq!(decode.worker_id.as_str(), "10.0.0.9:8000");
    assert_eq!(decode.disagg_mode, Role::Decode);
    assert_eq!(WatchStats::get(&stream.stats().invalid_records), 3);

    // A registered worker whose record turns to garbage leaves routing.
    put("10.0.0.5:8000", b"{\"truncated\":".to_vec()).await;
    match next(&mut stream).await {
        DiscoveryChange::Deregistered { worker, reason } => {
            assert_eq!(worker.as_str(), "10.0.0.5:8000");
            assert!(reason.contains("invalid"), "{reason}");
        }
        other => panic!("expected a deregistration, got {other:?}"),
    }
    assert_eq!(WatchStats::get(&stream.stats().invalid_records), 4);

    // What we register is what the Python server reads: the same keys, the wire values.
    let ours = register(&backend, &sample_record("10.0.0.10:8000")).await;
    let stored = client
        .range(format!("{PREFIX}10.0.0.10:8000").as_bytes(), b"")
        .await
        .expect("get");
    let value: serde_json::Value =
        serde_json::from_slice(&stored.kvs[0].value).expect("stored JSON");
    for field in [
        "worker_id",
        "url",
        "model_name",
        "engine",
        "disagg_mode",
        "disagg_meta",
        "kv_events_endpoint",
        "kv_block_size",
        "dp_rank",
        "dp_size",
        "request_transport",
    ] {
        assert!(value.get(field).is_some(), "missing {field} in {value}");
    }
    assert_eq!(value["engine"], "vllm");
    assert_eq!(value["disagg_mode"], "mixed");
    assert_ne!(stored.kvs[0].lease, 0, "the record must be on a lease");
    ours.deregister().await.expect("deregister");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registration_whose_lease_is_lost_registers_again() {
    let server = etcd().await;
    let backend = connect(EtcdConfig {
        lease_ttl: Duration::from_secs(2),
        ..config(server.endpoint())
    })
    .await;
    let mut stream = backend.watch().await.expect("watch");
    let record = sample_record("a:1");
    let registration = register(&backend, &record).await;
    assert_eq!(
        next(&mut stream).await,
        DiscoveryChange::Registered(record.clone())
    );

    // The lease disappears behind the worker's back (as after an outage longer than the TTL).
    let client = server.client().expect("client");
    let key = format!("{PREFIX}a:1");
    let lease = client.range(key.as_bytes(), b"").await.expect("get").kvs[0].lease;
    client.lease_revoke(lease).await.expect("revoke");
    assert!(deregistered(&next(&mut stream).await, "a:1"));

    // The keepalive notices at its next renewal and puts the record on a fresh lease.
    assert_eq!(next(&mut stream).await, DiscoveryChange::Registered(record));
    let relisted = client.range(key.as_bytes(), b"").await.expect("get");
    assert_ne!(relisted.kvs[0].lease, lease, "a new lease");
    registration.deregister().await.expect("deregister");
    assert!(deregistered(&next(&mut stream).await, "a:1"));
}

/// Deregistering right after the lease was lost (whether or not the keepalive has put the
/// record on a fresh lease yet) succeeds and leaves no record behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registration_deregistered_after_its_lease_was_lost_leaves_no_record() {
    let server = etcd().await;
    let backend = connect(EtcdConfig {
        lease_ttl: Duration::from_secs(2),
        ..config(server.endpoint())
    })
    .await;
    let client = server.client().expect("client");
    let key = format!("{PREFIX}b:1");
    for round in 0..3 {
        let registration = register(&backend, &sample_record("b:1")).await;
        let lease = client.range(key.as_bytes(), b"").await.expect("get").kvs[0].lease;
        client.lease_revoke(lease).await.expect("revoke");
        // The keepalive may or may not have registered again by now (its next renewal is a
        // third of the TTL away); a later round gives it time to.
        if round == 2 {
            while client
                .range(key.as_bytes(), b"")
                .await
                .expect("get")
                .kvs
                .is_empty()
            {
                tokio::task::yield_now().await;
            }
        }
        registration.deregister().await.expect("deregister");
        assert!(
            client
                .range(key.as_bytes(), b"")
                .await
                .expect("get")
                .kvs
                .is_empty(),
            "round {round}: the record outlived its deregistration"
        );
    }
}

/// An address nothing listens on (connections to it are refused at once).
fn dead_endpoint() -> String {
    format!("127.0.0.1:{}", free_port().expect("a free port"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_first_endpoint_is_skipped_for_the_next_member() {
    let server = etcd().await;
    let dead = dead_endpoint();
    let live = EtcdEndpoint::parse(&server.endpoint()).expect("live endpoint");
    let options = ClientOptions {
        request_timeout: Duration::from_secs(5),
        http2_keepalive: Duration::from_secs(10),
    };
    let members = [
        EtcdEndpoint::parse(&dead).expect("dead endpoint"),
        live.clone(),
    ];
    let client = EtcdClient::new(&members, &options).expect("client");
    client
        .range(b"/probe", b"")
        .await
        .expect("range via the second member");
    assert_eq!(
        client.preferred_endpoint(),
        &live,
        "the member that answered is kept"
    );

    // The backend, given the list in the flag's forms, registers and watches through it.
    let backend = connect(EtcdConfig {
        endpoints: vec![dead, server.endpoint()],
        ..config(String::new())
    })
    .await;
    let mut stream = backend.watch().await.expect("watch");
    let a = register(&backend, &sample_record("a:1")).await;
    assert_eq!(
        next(&mut stream).await,
        DiscoveryChange::Registered(sample_record("a:1"))
    );
    a.deregister().await.expect("deregister");
    assert!(deregistered(&next(&mut stream).await, "a:1"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn when_the_member_in_use_goes_away_the_watch_and_the_lease_move_to_the_next() {
    let server = etcd().await;
    let ttl = Duration::from_secs(3);
    let first = TcpProxy::start(server.client_addr()).await.expect("proxy");
    let second = TcpProxy::start(server.client_addr()).await.expect("proxy");
    let backend = connect(EtcdConfig {
        endpoints: vec![first.http_url(), second.http_url()],
        lease_ttl: ttl,
        ..config(String::new())
    })
    .await;
    let direct = connect(EtcdConfig {
        lease_ttl: ttl,
        ..config(server.endpoint())
    })
    .await;
    let mut stream = backend.watch().await.expect("watch");
    let a = register(&backend, &sample_record("a:1")).await;
    assert_eq!(
        next(&mut stream).await,
        DiscoveryChange::Registered(sample_record("a:1"))
    );

    // The first member becomes unreachable for good: the watch resumes on the second without
    // listing again, and new calls go there.
    first.cut();
    let cut_at = Instant::now();
    let b = register(&direct, &sample_record("b:2")).await;
    assert_eq!(
        next(&mut stream).await,
        DiscoveryChange::Registered(sample_record("b:2"))
    );
    let c = register(&backend, &sample_record("c:3")).await;
    assert_eq!(
        next(&mut stream).await,
        DiscoveryChange::Registered(sample_record("c:3"))
    );
    let stats = stream.stats();
    assert!(WatchStats::get(&stats.reconnects) >= 1, "the watch broke");
    assert_eq!(WatchStats::get(&stats.relists), 0, "and resumed");

    // a's keepalive renews through the second member: while workers that stop renewing expire
    // (the clock of this test), a outlives its TTL twice over.
    drop(b);
    assert!(deregistered(&next(&mut stream).await, "b:2"));
    let mut round = 0;
    while cut_at.elapsed() < ttl * 2 {
        round += 1;
        let worker = format!("crashed:{round}");
        let crashed = register(&direct, &sample_record(&worker)).await;
        assert!(
            matches!(next(&mut stream).await, DiscoveryChange::Registered(r) if r.worker_id.as_str() == worker)
        );
        drop(crashed);
        let change = next(&mut stream).await;
        assert!(
            deregistered(&change, &worker),
            "only {worker} may leave, got {change:?}"
        );
    }
    a.deregister()
        .await
        .expect("deregister a through the second member");
    assert!(deregistered(&next(&mut stream).await, "a:1"));
    c.deregister().await.expect("deregister c");
    assert!(deregistered(&next(&mut stream).await, "c:3"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn when_no_member_answers_the_error_is_retryable_and_names_the_last_one() {
    let (one, two) = (dead_endpoint(), dead_endpoint());
    let backend = connect(EtcdConfig {
        endpoints: vec![one, two.clone()],
        ..config(String::new())
    })
    .await;
    let error = backend.watch().await.expect_err("nothing listens");
    assert!(error.is_retryable(), "{error}");
    assert!(error.to_string().contains(&two), "{error}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_endpoint_speaks_tls_and_refuses_a_certificate_no_system_root_trusts() {
    let server = EtcdServer::start_with_tls()
        .await
        .unwrap_or_else(|e| panic!("this test needs a real etcd and openssl: {e}"));
    let https = server.https_endpoint().expect("a TLS listener");
    let error = connect(config(https.clone()))
        .await
        .watch()
        .await
        .expect_err("a self-signed certificate is not trusted");
    let message = error.to_string();
    assert!(message.contains(&https), "{message}");
    assert!(
        message.contains("certificate") || message.contains("UnknownIssuer"),
        "the TLS handshake must fail on verification: {message}"
    );
    // The same server answers on its plain-text listener.
    connect(config(server.endpoint()))
        .await
        .watch()
        .await
        .expect("plain-text watch");
}
