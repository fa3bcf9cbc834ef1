//! What Pods mean for routing: the pure half of the watcher, without I/O.
//!
//! [`judge`] turns one Pod into a [`Verdict`]; [`Fleet`] folds verdicts into the workers emitted
//! as `Registered` and returns the [`DiscoveryChange`]s that keep a stream consistent.
//!
//! Invariants of [`Fleet`]:
//! - each routed Pod holds exactly one worker id, and each worker id is routed for at most one
//!   Pod (`routed` and `owners` mirror each other);
//! - a `Deregistered` is only returned for a worker that was returned as `Registered`;
//! - a `Draining` is only returned for a routed Pod that is not draining yet (`draining` is a
//!   subset of `routed`'s keys); a draining Pod's record is frozen: changes to it are ignored,
//!   since a Pod being deleted never takes new work, and it leaves with a `Deregistered` when it
//!   turns not Ready, loses its annotation or is deleted;
//! - a Pod that is already being deleted when first seen is never routed;
//! - a Pod whose record claims a worker id already routed for another Pod waits in `waiting` and
//!   is promoted when that Pod leaves;
//! - an invalid annotation is counted once per distinct value per Pod, not on every status update.

use super::{DRAINING_REASON, WORKER_INFO_ANNOTATION};
use crate::discovery::{DiscoveryChange, WatchStats, decode_record};
use infera_core::event::WorkerRecord;
use infera_core::ids::WorkerId;
use k8s_openapi::api::core::v1::Pod;
use std::collections::{HashMap, HashSet};

/// What a Pod means for routing right now.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Verdict {
    /// Running, Ready, not being deleted, with a valid record.
    Route(WorkerRecord),
    /// Running, Ready, with a valid record, but being deleted (`deletionTimestamp`).
    Drain(WorkerRecord),
    /// Not routed, for this reason.
    Hold(String),
    /// The annotation is there but unusable.
    Invalid { raw: String, reason: String },
}

/// Judges a Pod that exists (not one from a DELETED event).
pub(super) fn judge(pod: &Pod) -> Verdict {
    let metadata = &pod.metadata;
    let Some(raw) = metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(WORKER_INFO_ANNOTATION))
    else {
        return Verdict::Hold(format!("the {WORKER_INFO_ANNOTATION} annotation is absent"));
    };
    let record = match decode(raw) {
        Ok(record) => record,
        Err(reason) => {
            return Verdict::Invalid {
                raw: raw.clone(),
                reason,
            };
        }
    };
    let status = pod.status.as_ref();
    let phase = status.and_then(|s| s.phase.as_deref()).unwrap_or("Unknown");
    if phase != "Running" {
        return Verdict::Hold(format!("pod phase is {phase}, not Running"));
    }
    let ready = status
        .and_then(|s| s.conditions.as_ref())
        .and_then(|c| c.iter().find(|c| c.type_ == "Ready"))
        .is_some_and(|c| c.status == "True");
    if !ready {
        return Verdict::Hold("pod is not Ready".to_owned());
    }
    if metadata.deletion_timestamp.is_some() {
        return Verdict::Drain(record);
    }
    Verdict::Route(record)
}

/// Decodes an annotation value; the Pod is the slot, so the record's own id is its identity.
fn decode(raw: &str) -> Result<WorkerRecord, String> {
    let json: serde_json::Value =
        serde_json::from_str(raw).map_err(|e| format!("not JSON: {e}"))?;
    let worker = json
        .get("worker_id")
        .and_then(serde_json::Value::as_str)
        .filter(|w| !w.is_empty())
        .ok_or_else(|| "no worker_id string".to_owned())?;
    decode_record(worker, raw.as_bytes())
}

/// The workers one stream has emitted, by Pod.
#[derive(Debug, Default)]
pub(super) struct Fleet {
    routed: HashMap<String, WorkerRecord>,
    owners: HashMap<WorkerId, String>,
    waiting: HashMap<String, WorkerRecord>,
    invalid: HashMap<String, String>,
    /// Routed Pods announced as `Draining`.
    draining: HashSet<String>,
}

impl Fleet {
    /// Number of routed workers.
    pub(super) fn len(&self) -> usize {
        self.routed.len()
    }

    /// Applies the verdict on an existing Pod.
    pub(super) fn observe(
        &mut self,
        pod: &str,
        verdict: Verdict,
        stats: &WatchStats,
    ) -> Vec<DiscoveryChange> {
        match verdict {
            Verdict::Route(record) => self.route(pod, record, stats),
            Verdict::Drain(record) => {
                self.invalid.remove(pod);
                self.drain(pod, &record)
            }
            Verdict::Hold(reason) => {
                self.invalid.remove(pod);
                self.release(pod, reason)
            }
            Verdict::Invalid { raw, reason } => {
                if self.invalid.get(pod) != Some(&raw) {
                    WatchStats::bump(&stats.invalid_records);
                    tracing::warn!(
                        pod, reason = %reason,
                        "kubernetes discovery: skipping an invalid {WORKER_INFO_ANNOTATION} annotation"
                    );
                    self.invalid.insert(pod.to_owned(), raw);
                }
                self.release(
                    pod,
                    format!("its {WORKER_INFO_ANNOTATION} annotation became invalid: {reason}"),
                )
            }
        }
    }

    /// A Pod that is gone (deleted, or absent from a listing).
    pub(super) fn forget(&mut self, pod: &str, reason: &str) -> Vec<DiscoveryChange> {
        self.invalid.remove(pod);
        self.release(pod, reason.to_owned())
    }

    /// Replaces the state by a full listing; returns the changes that turn the old state into it.
    pub(super) fn reconcile(
        &mut self,
        mut listed: Vec<(String, Verdict)>,
        stats: &WatchStats,
    ) -> Vec<DiscoveryChange> {
        listed.sort_by(|a, b| a.0.cmp(&b.0));
        let present: HashSet<&str> = listed.iter().map(|(pod, _)| pod.as_str()).collect();
        let mut gone: Vec<String> = self
            .routed
            .keys()
            .chain(self.waiting.keys())
            .chain(self.invalid.keys())
            .filter(|pod| !present.contains(pod.as_str()))
            .cloned()
            .collect();
        gone.sort();
        gone.dedup();
        let mut changes = Vec::new();
        for pod in gone {
            changes.extend(self.forget(
                &pod,
                "absent from the Pod list when listed again (deleted, relabelled, or its \
                 annotation removed while the watch was disconnected)",
            ));
        }
        for (pod, verdict) in listed {
            changes.extend(self.observe(&pod, verdict, stats));
        }
        changes
    }

    fn route(
        &mut self,
        pod: &str,
        record: WorkerRecord,
        stats: &WatchStats,
    ) -> Vec<DiscoveryChange> {
        self.invalid.remove(pod);
        if self.routed.get(pod) == Some(&record) && !self.draining.contains(pod) {
            return Vec::new();
        }
        let mut changes = Vec::new();
        if let Some(old) = self.routed.get(pod)
            && old.worker_id != record.worker_id
        {
            let reason = format!(
                "its Pod's record now names worker {:?}",
                record.worker_id.as_str()
            );
            changes.extend(self.release(pod, reason));
        }
        if let Some(owner) = self.owners.get(&record.worker_id)
            && owner != pod
        {
            if self.waiting.get(pod) != Some(&record) {
                WatchStats::bump(&stats.invalid_records);
                tracing::warn!(
                    pod, owner = %owner, worker = %record.worker_id,
                    "kubernetes discovery: two Pods claim the same worker id; the second waits"
                );
            }
            self.waiting.insert(pod.to_owned(), record);
            return changes;
        }
        self.waiting.remove(pod);
        // A Registered cancels a drain.
        self.draining.remove(pod);
        self.owners.insert(record.worker_id.clone(), pod.to_owned());
        self.routed.insert(pod.to_owned(), record.clone());
        changes.push(DiscoveryChange::Registered(record));
        changes
    }

    /// A Pod being deleted: its routed worker drains; it routes nothing new.
    fn drain(&mut self, pod: &str, record: &WorkerRecord) -> Vec<DiscoveryChange> {
        let routed_id = self.routed.get(pod).map(|r| r.worker_id.clone());
        match routed_id {
            Some(worker) if worker == record.worker_id => {
                if self.draining.insert(pod.to_owned()) {
                    vec![DiscoveryChange::Draining {
                        worker,
                        reason: DRAINING_REASON.to_owned(),
                    }]
                } else {
                    Vec::new()
                }
            }
            Some(_) => self.release(
                pod,
                format!(
                    "its Pod is being deleted and its record now names worker {:?}",
                    record.worker_id.as_str()
                ),
            ),
            // Not routed (or waiting on a conflict): a Pod being deleted does not join.
            None => self.release(pod, DRAINING_REASON.to_owned()),
        }
    }

    fn release(&mut self, pod: &str, reason: String) -> Vec<DiscoveryChange> {
        self.waiting.remove(pod);
        self.draining.remove(pod);
        let Some(record) = self.routed.remove(pod) else {
            return Vec::new();
        };
        let worker = record.worker_id;
        self.owners.remove(&worker);
        let mut changes = vec![DiscoveryChange::Deregistered {
            worker: worker.clone(),
            reason,
        }];
        let mut heirs: Vec<&String> = self
            .waiting
            .iter()
            .filter(|(_, r)| r.worker_id == worker)
            .map(|(p, _)| p)
            .collect();
        heirs.sort();
        if let Some(heir) = heirs.first().map(|p| (*p).clone())
            && let Some(record) = self.waiting.remove(&heir)
        {
            self.owners.insert(worker, heir.clone());
            self.routed.insert(heir, record.clone());
            changes.push(DiscoveryChange::Registered(record));
        }
        changes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::sample_record;

    fn pod(annotation: Option<&str>, phase: &str, ready: bool) -> Pod {
        let mut json = serde_json::json!({
            "metadata": {"name": "w", "annotations": {}},
            "status": {
                "phase": phase,
                "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}],
            },
        });
        if let Some(value) = annotation {
            json["metadata"]["annotations"][WORKER_INFO_ANNOTATION] = value.into();
        }
        serde_json::from_value(json).unwrap()
    }

    fn record_json(worker: &str) -> String {
        serde_json::to_string(&sample_record(worker)).unwrap()
    }

    #[test]
    fn only_running_ready_annotated_pods_route() {
        let raw = record_json("a:1");
        assert_eq!(
            judge(&pod(Some(&raw), "Running", true)),
            Verdict::Route(sample_record("a:1"))
        );
        assert!(
            matches!(judge(&pod(Some(&raw), "Running", false)), Verdict::Hold(r) if r.contains("not Ready"))
        );
        assert!(
            matches!(judge(&pod(Some(&raw), "Pending", true)), Verdict::Hold(r) if r.contains("Pending"))
        );
        assert!(
            matches!(judge(&pod(None, "Running", true)), Verdict::Hold(r) if r.contains("absent"))
        );
        assert!(matches!(
            judge(&pod(Some("{"), "Running", true)),
            Verdict::Invalid { .. }
        ));
        let mut draining = pod(Some(&raw), "Running", true);
        draining.metadata.deletion_timestamp =
            Some(serde_json::from_value(serde_json::json!("2026-01-01T00:00:00Z")).unwrap());
        assert_eq!(judge(&draining), Verdict::Drain(sample_record("a:1")));
        // Being deleted and not Ready, or without its annotation: not routed at all.
        draining.status = pod(None, "Running", false).status;
        assert!(matches!(judge(&draining), Verdict::Hold(r) if r.contains("not Ready")));
        let mut stripped = pod(None, "Running", true);
        stripped.metadata.deletion_timestamp = draining.metadata.deletion_timestamp.clone();
        assert!(matches!(judge(&stripped), Verdict::Hold(r) if r.contains("absent")));
    }

    fn draining(worker: &str) -> DiscoveryChange {
        DiscoveryChange::Draining {
            worker: WorkerId::new(worker),
            reason: DRAINING_REASON.to_owned(),
        }
    }

    #[test]
    fn a_routed_pod_drains_once_and_then_leaves() {
        let stats = WatchStats::default();
        let mut fleet = Fleet::default();
        let record = sample_record("a:1");
        fleet.observe("p", Verdict::Route(record.clone()), &stats);
        assert_eq!(
            fleet.observe("p", Verdict::Drain(record.clone()), &stats),
            vec![draining("a:1")]
        );
        assert!(
            fleet
                .observe("p", Verdict::Drain(record.clone()), &stats)
                .is_empty(),
            "not repeated on status updates"
        );
        // Its record is frozen while it drains.
        let mut changed = record.clone();
        changed.model_name = "changed".to_owned();
        assert!(
            fleet
                .observe("p", Verdict::Drain(changed), &stats)
                .is_empty()
        );
        let changes = fleet.observe("p", Verdict::Hold("pod is not Ready".to_owned()), &stats);
        assert!(
            matches!(&changes[..], [DiscoveryChange::Deregistered { worker, reason }]
                if worker.as_str() == "a:1" && reason.contains("not Ready"))
        );
        assert!(fleet.forget("p", "pod deleted").is_empty(), "left once");
        assert_eq!(fleet.len(), 0);
    }

    #[test]
    fn a_pod_first_seen_while_being_deleted_never_joins() {
        let stats = WatchStats::default();
        let mut fleet = Fleet::default();
        assert!(
            fleet
                .observe("p", Verdict::Drain(sample_record("a:1")), &stats)
                .is_empty()
        );
        assert!(fleet.forget("p", "pod deleted").is_empty());
        // A waiting twin that starts being deleted gives up its claim.
        fleet.observe("p1", Verdict::Route(sample_record("b:2")), &stats);
        fleet.observe("p2", Verdict::Route(sample_record("b:2")), &stats);
        assert!(
            fleet
                .observe("p2", Verdict::Drain(sample_record("b:2")), &stats)
                .is_empty()
        );
        let changes = fleet.forget("p1", "pod deleted");
        assert_eq!(changes.len(), 1, "no heir: {changes:?}");
    }

    #[test]
    fn a_drain_is_cancelled_by_routing_again_and_a_new_id_on_a_deleted_pod_is_not_routed() {
        let stats = WatchStats::default();
        let mut fleet = Fleet::default();
        let record = sample_record("a:1");
        fleet.observe("p", Verdict::Route(record.clone()), &stats);
        fleet.observe("p", Verdict::Drain(record.clone()), &stats);
        // A Pod of the same name, recreated while the watch was away, is listed as routable.
        assert_eq!(
            fleet.observe("p", Verdict::Route(record.clone()), &stats),
            vec![DiscoveryChange::Registered(record)]
        );
        let changes = fleet.observe("p", Verdict::Drain(sample_record("b:2")), &stats);
        assert!(
            matches!(&changes[..], [DiscoveryChange::Deregistered { worker, .. }] if worker.as_str() == "a:1"),
            "{changes:?}"
        );
        assert_eq!(fleet.len(), 0);
    }

    #[test]
    fn reconcile_reports_a_drain_that_happened_while_disconnected() {
        let stats = WatchStats::default();
        let mut fleet = Fleet::default();
        let a = sample_record("a:1");
        let b = sample_record("b:2");
        fleet.reconcile(
            vec![
                ("pa".to_owned(), Verdict::Route(a.clone())),
                ("pb".to_owned(), Verdict::Route(b.clone())),
            ],
            &stats,
        );
        let changes = fleet.reconcile(
            vec![
                ("pa".to_owned(), Verdict::Drain(a.clone())),
                ("pb".to_owned(), Verdict::Route(b.clone())),
            ],
            &stats,
        );
        assert_eq!(changes, vec![draining("a:1")]);
        let changes = fleet.reconcile(vec![("pb".to_owned(), Verdict::Route(b))], &stats);
        assert!(
            matches!(&changes[..], [DiscoveryChange::Deregistered { worker, .. }] if worker.as_str() == "a:1")
        );
    }

    #[test]
    fn a_worker_id_claimed_twice_waits_and_is_promoted_when_the_owner_leaves() {
        let stats = WatchStats::default();
        let mut fleet = Fleet::default();
        let record = sample_record("a:1");
        assert_eq!(
            fleet.observe("p1", Verdict::Route(record.clone()), &stats),
            vec![DiscoveryChange::Registered(record.clone())]
        );
        assert!(
            fleet
                .observe("p2", Verdict::Route(record.clone()), &stats)
                .is_empty()
        );
        assert!(
            fleet
                .observe("p2", Verdict::Route(record.clone()), &stats)
                .is_empty()
        );
        assert_eq!(WatchStats::get(&stats.invalid_records), 1, "counted once");
        let changes = fleet.forget("p1", "pod deleted");
        assert!(
            matches!(&changes[0], DiscoveryChange::Deregistered { worker, .. } if worker.as_str() == "a:1")
        );
        assert_eq!(changes[1], DiscoveryChange::Registered(record));
        assert_eq!(fleet.len(), 1);
    }

    #[test]
    fn a_changed_worker_id_leaves_under_the_old_id_and_joins_under_the_new() {
        let stats = WatchStats::default();
        let mut fleet = Fleet::default();
        fleet.observe("p", Verdict::Route(sample_record("a:1")), &stats);
        let changes = fleet.observe("p", Verdict::Route(sample_record("b:2")), &stats);
        assert!(
            matches!(&changes[0], DiscoveryChange::Deregistered { worker, .. } if worker.as_str() == "a:1")
        );
        assert_eq!(
            changes[1],
            DiscoveryChange::Registered(sample_record("b:2"))
        );
    }

    #[test]
    fn reconcile_removes_the_vanished_and_counts_an_invalid_value_once() {
        let stats = WatchStats::default();
        let mut fleet = Fleet::default();
        let bad = || Verdict::Invalid {
            raw: "{".to_owned(),
            reason: "not JSON".to_owned(),
        };
        fleet.reconcile(
            vec![
                ("p1".to_owned(), Verdict::Route(sample_record("a:1"))),
                ("p2".to_owned(), bad()),
            ],
            &stats,
        );
        let changes = fleet.reconcile(vec![("p2".to_owned(), bad())], &stats);
        assert_eq!(changes.len(), 1);
        assert!(
            matches!(&changes[0], DiscoveryChange::Deregistered { reason, .. } if reason.contains("absent"))
        );
        assert_eq!(WatchStats::get(&stats.invalid_records), 1);
    }
}
