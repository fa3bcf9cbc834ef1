//! The discovery conformance suite: what every [`Discovery`]/[`Registrar`] backend must do.
//!
//! A backend's test builds a [`DiscoveryFixture`] against a real (or faithful in-process) server
//! and calls [`discovery_conformance`], which panics with a description of the first violation.
//! The suite uses worker ids of its own (`conformance-*`) and ignores other workers, so it may run
//! against a store that holds other records.

use crate::discovery::{
    Discovery, DiscoveryChange, DiscoveryError, DiscoveryStream, Registrar, WatchStats,
};
use async_trait::async_trait;
use infera_core::event::{Engine, RequestTransport, Role, WorkerRecord};
use infera_core::ids::WorkerId;
use std::sync::Arc;
use std::time::Duration;

/// How long the suite waits for an expected change.
const CHANGE_TIMEOUT: Duration = Duration::from_secs(15);

/// A backend under test.
#[async_trait]
pub trait DiscoveryFixture: Send + Sync {
    /// A registrar (worker side) connected to the server under test.
    async fn registrar(&self) -> Arc<dyn Registrar>;
    /// A discovery client (server side) connected to the same server.
    async fn discovery(&self) -> Arc<dyn Discovery>;
    /// Stores `value` verbatim in `worker`'s slot, bypassing the registrar (to inject records
    /// that are invalid, or shaped like another implementation's).
    async fn publish_raw(&self, worker: &str, value: &[u8]);
}

/// A valid record for `worker` (`host:port`).
pub fn sample_record(worker: &str) -> WorkerRecord {
    WorkerRecord {
        worker_id: WorkerId::new(worker),
        url: format!("http://{worker}"),
        model_name: "conformance/model".to_owned(),
        engine: Engine::Vllm,
        disagg_mode: Role::Mixed,
        disagg_meta: None,
        kv_events_endpoint: Some("tcp://127.0.0.1:5557".to_owned()),
        kv_block_size: 16,
        dp_rank: 0,
        dp_size: 1,
        request_transport: RequestTransport::Http,
        kv: None,
        extra: serde_json::Map::new(),
    }
}

/// The next change about `worker` on `stream`, skipping changes about other workers.
///
/// # Panics
/// If none arrives within `timeout`, or the stream ends.
pub async fn next_change_for(
    stream: &mut DiscoveryStream,
    worker: &str,
    timeout: Duration,
) -> DiscoveryChange {
    let wait = async {
        loop {
            match stream.recv().await {
                Some(change) if change.worker().as_str() == worker => return change,
                Some(_) => continue,
                None => panic!("discovery stream ended while waiting for {worker}"),
            }
        }
    };
    match tokio::time::timeout(timeout, wait).await {
        Ok(change) => change,
        Err(_) => panic!("no change for worker {worker} within {timeout:?}"),
    }
}

/// Runs the whole suite against `fixture`.
///
/// # Panics
/// On the first behaviour that differs from the port's contract.
pub async fn discovery_conformance(fixture: &dyn DiscoveryFixture) {
    let registrar = fixture.registrar().await;
    let discovery = fixture.discovery().await;
    let a = "conformance-a:8000";
    let b = "conformance-b:8001";
    let bad = "conformance-bad:8002";

    // Register → a watcher started before sees it.
    let mut first = discovery.watch().await.expect("first watch");
    let record_a = sample_record(a);
    let registration_a = registrar.register(&record_a).await.expect("register a");
    assert_eq!(registration_a.worker().as_str(), a);
    assert_eq!(
        next_change_for(&mut first, a, CHANGE_TIMEOUT).await,
        DiscoveryChange::Registered(record_a.clone()),
        "a registered worker must appear on an open watch"
    );

    // A watcher started later lists it first.
    let mut second = discovery.watch().await.expect("second watch");
    assert_eq!(
        next_change_for(&mut second, a, CHANGE_TIMEOUT).await,
        DiscoveryChange::Registered(record_a.clone()),
        "a new watch must list the workers already registered"
    );

    // Update → Registered again, with the new fields, on both.
    let mut updated_a = record_a.clone();
    updated_a.model_name = "conformance/model-v2".to_owned();
    updated_a.disagg_mode = Role::Prefill;
    updated_a
        .extra
        .insert("engine_version".to_owned(), serde_json::json!("1.2.3"));
    registration_a.update(&updated_a).await.expect("update a");
    for (name, stream) in [("first", &mut first), ("second", &mut second)] {
        assert_eq!(
            next_change_for(stream, a, CHANGE_TIMEOUT).await,
            DiscoveryChange::Registered(updated_a.clone()),
            "the {name} watch must see the updated record as Registered"
        );
    }

    // An update naming another worker is refused, and not retryable.
    let err = registration_a
        .update(&sample_record(b))
        .await
        .expect_err("an update must not change the worker id");
    assert!(
        matches!(err, DiscoveryError::InvalidRecord { .. }) && !err.is_retryable(),
        "{err}"
    );

    // An invalid record is skipped and counted; the watch goes on.
    let invalid_before = WatchStats::get(&first.stats().invalid_records);
    fixture.publish_raw(bad, b"{\"worker_id\": \"nope").await;
    let record_b = sample_record(b);
    let registration_b = registrar.register(&record_b).await.expect("register b");
    let until_b = async {
        loop {
            match first.recv().await {
                Some(change) if change.worker().as_str() == bad => {
                    panic!("an invalid record must not reach the stream: {change:?}")
                }
                Some(change) if change.worker().as_str() == b => return change,
                Some(_) => continue,
                None => panic!("discovery stream ended while waiting for {b}"),
            }
        }
    };
    let change = tokio::time::timeout(CHANGE_TIMEOUT, until_b)
        .await
        .expect("b's registration after the invalid record");
    assert_eq!(change, DiscoveryChange::Registered(record_b.clone()));
    let invalid_after = WatchStats::get(&first.stats().invalid_records);
    assert!(
        invalid_after > invalid_before,
        "an invalid record must be counted ({invalid_before} → {invalid_after})"
    );

    // Deregister → Deregistered on both watches, and only for that worker.
    registration_a.deregister().await.expect("deregister a");
    for (name, stream) in [("first", &mut first), ("second", &mut second)] {
        match next_change_for(stream, a, CHANGE_TIMEOUT).await {
            DiscoveryChange::Deregistered { worker, reason } => {
                assert_eq!(worker.as_str(), a);
                assert!(!reason.is_empty(), "a deregistration must say why");
            }
            other => panic!("the {name} watch expected a's Deregistered, got {other:?}"),
        }
    }
    // The invalid worker never appeared; b is still there for a third watcher.
    let mut third = discovery.watch().await.expect("third watch");
    assert_eq!(
        next_change_for(&mut third, b, CHANGE_TIMEOUT).await,
        DiscoveryChange::Registered(record_b)
    );
    assert!(WatchStats::get(&third.stats().invalid_records) >= 1);
    registration_b.deregister().await.expect("deregister b");
    match next_change_for(&mut first, b, CHANGE_TIMEOUT).await {
        DiscoveryChange::Deregistered { .. } => {}
        other => panic!("expected b's Deregistered, got {other:?}"),
    }
}
