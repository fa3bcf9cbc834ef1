//! The stored forms every durable log shares, and the errors they map to.
//!
//! - An event is one JSON object in core's golden envelope format (`fixtures/events/v1.jsonl`):
//!   `{"v":1,"seq":N,"ts_us":T,"source":{…}|null,"event":{"type":"…",…}}`.
//! - A snapshot is `{"v":1,"upto":N,"events":[<Event>, …]}`: the projection dump standing in for
//!   every envelope with `seq <= upto` (see `infera_core::log::Snapshot`).
//!
//! Decoding never panics: malformed bytes, an unknown event type or a record written by a newer
//! format version become a [`LogError`] that names the position of the bad record.

use infera_core::event::{EVENT_FORMAT_VERSION, Envelope, Event, Seq};
use infera_core::log::{LogError, NewEvent, Snapshot};
use serde::{Deserialize, Serialize};

/// Version of the snapshot record.
const SNAPSHOT_FORMAT_VERSION: u16 = 1;

#[derive(Serialize)]
struct SnapshotOut<'a> {
    v: u16,
    upto: Seq,
    events: &'a [Event],
}

#[derive(Deserialize)]
struct SnapshotIn {
    v: u16,
    upto: Seq,
    events: Vec<Event>,
}

/// Stamps a batch with consecutive sequence numbers from `first` and the append time `ts_us`.
pub(crate) fn stamp(batch: Vec<NewEvent>, first: Seq, ts_us: u64) -> Vec<Envelope> {
    batch
        .into_iter()
        .zip(first..)
        .map(|(e, seq)| Envelope {
            v: EVENT_FORMAT_VERSION,
            seq,
            ts_us,
            source: e.source,
            event: e.event,
        })
        .collect()
}

/// The JSON text of one envelope.
pub(crate) fn encode_envelope(env: &Envelope) -> Result<String, LogError> {
    serde_json::to_string(env)
        .map_err(|e| LogError::Backend(format!("encoding event seq {}: {e}", env.seq)))
}

/// Parses the envelope stored at `seq` in `store` (for the error message).
pub(crate) fn decode_envelope(bytes: &[u8], seq: Seq, store: &str) -> Result<Envelope, LogError> {
    let env: Envelope = serde_json::from_slice(bytes).map_err(|e| {
        LogError::Backend(format!(
            "malformed event at seq {seq} in {store}: {e}; the record is not an event envelope \
             (v{EVENT_FORMAT_VERSION}); repair or remove it, or restore the log from a backup"
        ))
    })?;
    if env.v > EVENT_FORMAT_VERSION {
        return Err(LogError::Backend(format!(
            "event at seq {seq} in {store} has format version {}, newer than the {} this build \
             reads; upgrade infera",
            env.v, EVENT_FORMAT_VERSION
        )));
    }
    Ok(env)
}

/// The JSON text of a snapshot.
pub(crate) fn encode_snapshot(snapshot: &Snapshot) -> Result<String, LogError> {
    serde_json::to_string(&SnapshotOut {
        v: SNAPSHOT_FORMAT_VERSION,
        upto: snapshot.upto,
        events: &snapshot.events,
    })
    .map_err(|e| LogError::Backend(format!("encoding snapshot at seq {}: {e}", snapshot.upto)))
}

/// Parses a snapshot read from `store`.
pub(crate) fn decode_snapshot(bytes: &[u8], store: &str) -> Result<Snapshot, LogError> {
    let snap: SnapshotIn = serde_json::from_slice(bytes).map_err(|e| {
        LogError::Backend(format!(
            "malformed snapshot in {store}: {e}; delete it only together with the log it covers"
        ))
    })?;
    if snap.v > SNAPSHOT_FORMAT_VERSION {
        return Err(LogError::Backend(format!(
            "snapshot in {store} has format version {}, newer than the {SNAPSHOT_FORMAT_VERSION} \
             this build reads; upgrade infera",
            snap.v
        )));
    }
    Ok(Snapshot {
        upto: snap.upto,
        events: snap.events,
    })
}

/// The error for a read at `from` when the oldest envelope still stored is `first_available`
/// and the latest snapshot covers `snapshot_upto` (0 without one).
///
/// Below the snapshot this is ordinary compaction. Above it, envelopes were lost without a
/// snapshot standing in for them (a stream limit discarded them, or rows were deleted by hand):
/// a gap. `LogError` has no variant of its own for that, so a gap is reported as
/// [`LogError::Compacted`] through `first_available - 1` — never retryable, never a silent skip —
/// and logged as an error naming the missing range.
pub(crate) fn missing(
    store: &str,
    from: Seq,
    first_available: Seq,
    snapshot_upto: Seq,
) -> LogError {
    if from <= snapshot_upto {
        return LogError::Compacted {
            upto: snapshot_upto,
        };
    }
    let upto = first_available.saturating_sub(1).max(from);
    tracing::error!(
        store,
        from,
        first_available,
        snapshot_upto,
        "event log gap: envelopes {from}..={upto} are gone and no snapshot covers them; state \
         rebuilt from this log would be wrong. Compact more often than the store's retention limits"
    );
    LogError::Compacted { upto }
}

#[cfg(test)]
mod tests {
    use super::*;
    use infera_core::event::{RequestPrefilled, WorkerDeregistered};
    use infera_core::ids::{RequestId, WorkerId};

    #[test]
    fn the_golden_file_decodes_and_reencodes_to_the_same_values() {
        let text = include_str!("../../../fixtures/events/v1.jsonl");
        for (i, line) in text.lines().filter(|l| !l.trim().is_empty()).enumerate() {
            let env = decode_envelope(line.as_bytes(), i as Seq + 1, "golden").expect("decode");
            let again = encode_envelope(&env).expect("encode");
            let back = decode_envelope(again.as_bytes(), env.seq, "golden").expect("decode");
            assert_eq!(back, env);
        }
    }

    #[test]
    fn malformed_and_future_records_are_errors_naming_the_seq() {
        let err = decode_envelope(b"{not json", 7, "test").expect_err("malformed");
        assert!(err.to_string().contains("seq 7"), "{err}");
        assert!(!err.is_retryable() || matches!(err, LogError::Backend(_)));
        let unknown = br#"{"v":1,"seq":1,"ts_us":0,"event":{"type":"Nope"}}"#;
        assert!(decode_envelope(unknown, 1, "test").is_err());
        let future =
            br#"{"v":99,"seq":1,"ts_us":0,"event":{"type":"RequestPrefilled","request_id":"r"}}"#;
        let err = decode_envelope(future, 1, "test").expect_err("future");
        assert!(err.to_string().contains("upgrade"), "{err}");
    }

    #[test]
    fn snapshots_round_trip() {
        let snap = Snapshot {
            upto: 42,
            events: vec![
                Event::WorkerDeregistered(WorkerDeregistered {
                    worker: WorkerId::new("a:1"),
                    reason: "gone".to_owned(),
                }),
                Event::RequestPrefilled(RequestPrefilled {
                    request_id: RequestId::new("r1"),
                }),
            ],
        };
        let text = encode_snapshot(&snap).expect("encode");
        assert!(text.starts_with(r#"{"v":1,"upto":42,"#), "{text}");
        assert_eq!(
            decode_snapshot(text.as_bytes(), "test").expect("decode"),
            snap
        );
        assert!(decode_snapshot(b"[]", "test").is_err());
    }

    #[test]
    fn stamping_numbers_a_batch_from_first() {
        let batch = vec![
            NewEvent::new(Event::RequestPrefilled(RequestPrefilled {
                request_id: RequestId::new("a"),
            })),
            NewEvent::new(Event::RequestPrefilled(RequestPrefilled {
                request_id: RequestId::new("b"),
            })),
        ];
        let envs = stamp(batch, 5, 9);
        assert_eq!(envs.iter().map(|e| e.seq).collect::<Vec<_>>(), vec![5, 6]);
        assert!(
            envs.iter()
                .all(|e| e.ts_us == 9 && e.v == EVENT_FORMAT_VERSION)
        );
    }

    #[test]
    fn missing_envelopes_are_compaction_below_the_snapshot_and_a_gap_above() {
        assert!(matches!(
            missing("t", 3, 11, 10),
            LogError::Compacted { upto: 10 }
        ));
        assert!(matches!(
            missing("t", 12, 20, 10),
            LogError::Compacted { upto: 19 }
        ));
        assert!(matches!(
            missing("t", 1, 5, 0),
            LogError::Compacted { upto: 4 }
        ));
    }
}
