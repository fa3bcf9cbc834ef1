//! The one KV-event pipeline (`infera_core::kv_events::pipeline::consume`) over each real
//! transport, in process: ZeroMQ (our vLLM-shaped publisher, the engine's replay socket) and
//! NATS (a real nats-server, the worker relay's headers). Each test checks what the fleet is
//! told: batches in order, gaps replayed or cleared, restarts cleared, and a hybrid model's
//! `BlockRemoved` decoded with its group's kind learnt from an earlier batch.
//!
//! PUB/SUB and NATS drop messages until the subscription is in place, so each test first
//! publishes probe batches (`ts < 0`) until one is ingested: no sleeps.

use async_trait::async_trait;
use bytes::Bytes;
use infera_backends::nats::kv::{KvEventPublisher, NatsKvSource};
use infera_backends::testing::{NatsServer, sample_record};
use infera_backends::zmq::{KvEventPublisher as ZmqPublisher, PublisherConfig, ZmqKvSource};
use infera_core::event::{Tier, WorkerRecord};
use infera_core::ids::{EngineHash, WorkerId, WorkerRank};
use infera_core::kv_events::pipeline::{self, KvSink};
use infera_core::kv_events::{EngineBatch, EngineEvent, encode_batch_vllm};
use infera_core::ports::kv_events::{KvEventSource, KvReplay, KvSourceError, KvSubscription};
use std::ops::RangeInclusive;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::timeout;
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_secs(10);
const WORKER: &str = "127.0.0.1:9";

/// What the pipeline told the fleet.
#[derive(Debug, Clone, PartialEq)]
enum Told {
    Ingest {
        seq: Option<u64>,
        batch: EngineBatch,
    },
    Clear {
        seq: Option<u64>,
    },
    Gap {
        missing: RangeInclusive<u64>,
        replayed: bool,
    },
    Malformed,
}

#[derive(Debug)]
struct Recorder(mpsc::Sender<Told>);

impl Recorder {
    fn tell(&self, told: Told) {
        self.0
            .try_send(told)
            .expect("the test reads what it is told");
    }
}

impl KvSink for Recorder {
    fn ingest(&self, _rank: &WorkerRank, seq: Option<u64>, batch: &EngineBatch) -> bool {
        self.tell(Told::Ingest {
            seq,
            batch: batch.clone(),
        });
        true
    }
    fn clear(&self, _rank: &WorkerRank, seq: Option<u64>) {
        self.tell(Told::Clear { seq });
    }
    fn gap(&self, _rank: &WorkerRank, missing: &RangeInclusive<u64>, replayed: bool) {
        self.tell(Told::Gap {
            missing: missing.clone(),
            replayed,
        });
    }
    fn malformed(&self, _worker: &WorkerId, _reason: &str) {
        self.tell(Told::Malformed);
    }
}

/// The pipeline running `record`'s subscription from `source`, and what it tells.
struct Running {
    told: mpsc::Receiver<Told>,
    stop: CancellationToken,
    task: JoinHandle<()>,
}

async fn run(source: &dyn KvEventSource, record: &WorkerRecord) -> Running {
    let subscription = source.subscribe(record).await.expect("subscribe");
    let (tx, told) = mpsc::channel(4096);
    let stop = CancellationToken::new();
    let task = tokio::spawn({
        let (stop, worker) = (stop.clone(), record.worker_id.clone());
        async move {
            let sink = Recorder(tx);
            pipeline::consume(worker, subscription, &sink, stop.cancelled()).await;
        }
    });
    Running { told, stop, task }
}

impl Running {
    async fn next(&mut self) -> Told {
        timeout(WAIT, self.told.recv())
            .await
            .expect("told in time")
            .expect("pipeline running")
    }

    /// Skips probes until the probe numbered `seq` (the last one sent) was ingested.
    async fn ingested_probe(&mut self, seq: u64) -> bool {
        while let Ok(Some(told)) = timeout(Duration::from_millis(25), self.told.recv()).await {
            match told {
                Told::Ingest {
                    seq: Some(s),
                    batch,
                } if batch.ts < 0.0 => {
                    if s == seq {
                        return true;
                    }
                }
                other => panic!("unexpected while syncing: {other:?}"),
            }
        }
        false
    }

    async fn stop(self) {
        self.stop.cancel();
        self.task.await.expect("pipeline task");
    }
}

fn probe() -> EngineBatch {
    EngineBatch {
        ts: -1.0,
        dp_rank: Some(0),
        ..EngineBatch::default()
    }
}

/// A sliding-window block stored (group 1 on the wire), or removed.
fn sliding(stored: bool, hash: u64) -> EngineBatch {
    let event = if stored {
        EngineEvent::BlockStored {
            block_hashes: vec![EngineHash(hash)],
            parent: None,
            token_ids: (0..16).collect(),
            block_size: 16,
            tier: Tier::Gpu,
            lora_id: None,
            lora_name: None,
            extra_keys: None,
            cache_salt: None,
            indexable: false,
        }
    } else {
        EngineEvent::BlockRemoved {
            block_hashes: vec![EngineHash(hash)],
            tier: Tier::Gpu,
            indexable: false,
        }
    };
    EngineBatch {
        ts: 1.0,
        dp_rank: Some(0),
        events: vec![event],
        ..EngineBatch::default()
    }
}

fn removal_is_indexable(told: &Told) -> bool {
    match told {
        Told::Ingest { batch, .. } => match batch.events.as_slice() {
            [EngineEvent::BlockRemoved { indexable, .. }] => *indexable,
            other => panic!("expected one removal, got {other:?}"),
        },
        other => panic!("expected a batch, got {other:?}"),
    }
}

// ---------------------------------------------------------------------------------- ZeroMQ

async fn zmq_publisher(replay: bool) -> ZmqPublisher {
    let cfg = PublisherConfig::new(
        "tcp://127.0.0.1:0",
        replay.then(|| "tcp://127.0.0.1:0".to_owned()),
    );
    ZmqPublisher::bind(cfg).await.expect("bind publisher")
}

fn zmq_record(live: &ZmqPublisher, replay: Option<&str>) -> WorkerRecord {
    let mut record = sample_record(WORKER);
    record.kv_events_endpoint = Some(live.endpoint().to_owned());
    record.set_kv_events_replay_endpoint(replay.map(str::to_owned));
    record
}

async fn zmq_sync(p: &mut ZmqPublisher, running: &mut Running) {
    for _ in 0..400 {
        let seq = p.publish_batch(&probe()).await.expect("probe");
        if running.ingested_probe(seq).await {
            return;
        }
    }
    panic!("the pipeline never ingested a probe");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zmq_hybrid_removal_in_a_later_batch_keeps_its_group_kind() {
    let mut p = zmq_publisher(false).await;
    let mut running = run(&ZmqKvSource::default(), &zmq_record(&p, None)).await;
    zmq_sync(&mut p, &mut running).await;
    p.publish_batch(&sliding(true, 7)).await.expect("publish");
    p.publish_batch(&sliding(false, 7)).await.expect("publish");
    assert!(matches!(running.next().await, Told::Ingest { .. }));
    assert!(!removal_is_indexable(&running.next().await));
    running.stop().await;
    p.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zmq_gap_is_filled_from_the_replay_socket_with_the_streams_group_kinds() {
    // The engine's replay socket holds the batches the live stream lost: the sliding-window
    // block stored in the first of them is removed in the batch that reveals the gap.
    let mut live = zmq_publisher(false).await;
    let mut engine = zmq_publisher(true).await;
    let replay = engine.replay_endpoint().map(str::to_owned);
    let mut running = run(
        &ZmqKvSource::default(),
        &zmq_record(&live, replay.as_deref()),
    )
    .await;
    zmq_sync(&mut live, &mut running).await;
    let lost = live.next_seq();
    engine.set_next_seq(lost);
    engine.publish_batch(&sliding(true, 9)).await.expect("held");
    engine.publish_batch(&probe()).await.expect("held");
    live.set_next_seq(lost + 2);
    live.publish_batch(&sliding(false, 9))
        .await
        .expect("publish");

    let want_stored = Told::Ingest {
        seq: Some(lost),
        batch: sliding(true, 9),
    };
    assert_eq!(running.next().await, want_stored);
    assert!(matches!(running.next().await, Told::Ingest { seq: Some(s), .. } if s == lost + 1));
    assert_eq!(
        running.next().await,
        Told::Gap {
            missing: lost..=lost + 1,
            replayed: true
        }
    );
    let revealing = running.next().await;
    assert!(matches!(revealing, Told::Ingest { seq: Some(s), .. } if s == lost + 2));
    assert!(!removal_is_indexable(&revealing));
    running.stop().await;
    live.shutdown().await;
    engine.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zmq_gap_the_engine_cannot_replay_clears_and_a_restart_clears() {
    let mut p = zmq_publisher(true).await;
    let replay = p.replay_endpoint().map(str::to_owned);
    let mut running = run(&ZmqKvSource::default(), &zmq_record(&p, replay.as_deref())).await;
    zmq_sync(&mut p, &mut running).await;
    // Skipped numbers the engine never held: the replay cannot fill them.
    let next = p.next_seq();
    p.set_next_seq(next + 2);
    p.publish_batch(&sliding(true, 1)).await.expect("publish");
    assert_eq!(running.next().await, Told::Clear { seq: None });
    assert_eq!(
        running.next().await,
        Told::Gap {
            missing: next..=next + 1,
            replayed: false
        }
    );
    assert!(matches!(running.next().await, Told::Ingest { seq: Some(s), .. } if s == next + 2));
    // A new engine process numbers from 0 again, and its groups are learnt anew.
    p.set_next_seq(0);
    p.publish_batch(&sliding(false, 1)).await.expect("publish");
    assert_eq!(running.next().await, Told::Clear { seq: Some(0) });
    assert!(
        removal_is_indexable(&running.next().await),
        "a restarted engine's groups are unknown until it stores again"
    );
    running.stop().await;
    p.shutdown().await;
}

/// An engine's replay socket that holds every batch asked for: the first missing one stores a
/// sliding-window block, the others are probes. (NATS workers advertise none: this checks
/// that a gap with one is filled the same way whatever the live transport.)
#[derive(Debug)]
struct Holds;

#[async_trait]
impl KvReplay for Holds {
    async fn replay(
        &self,
        _dp_rank: u32,
        missing: RangeInclusive<u64>,
    ) -> Result<Vec<(u64, Bytes)>, KvSourceError> {
        let first = *missing.start();
        Ok(missing
            .map(|seq| {
                let batch = if seq == first {
                    sliding(true, 3)
                } else {
                    probe()
                };
                (seq, Bytes::from(encode_batch_vllm(&batch)))
            })
            .collect())
    }
}

// ------------------------------------------------------------------------------------ NATS

struct Nats {
    _broker: NatsServer,
    client: async_nats::Client,
}

async fn nats() -> Nats {
    let broker = NatsServer::start().await.expect("nats-server");
    let client = infera_backends::nats::connect(&broker.url(), "test")
        .await
        .expect("connect");
    Nats {
        _broker: broker,
        client,
    }
}

async fn nats_sync(p: &mut KvEventPublisher, running: &mut Running) -> u64 {
    for _ in 0..400 {
        let seq = p
            .publish(0, Bytes::from(encode_batch_vllm(&probe())))
            .await
            .expect("probe");
        p.flush().await.expect("flush");
        if running.ingested_probe(seq).await {
            return seq;
        }
    }
    panic!("the pipeline never ingested a probe");
}

async fn nats_send(p: &mut KvEventPublisher, seq: u64, batch: &EngineBatch) {
    p.publish_with_seq(0, Some(seq), Bytes::from(encode_batch_vllm(batch)))
        .await
        .expect("publish");
    p.flush().await.expect("flush");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_hybrid_removal_gap_and_restart() {
    let n = nats().await;
    let source = NatsKvSource::new(n.client.clone());
    let mut running = run(&source, &sample_record(WORKER)).await;
    let mut p = KvEventPublisher::new(n.client.clone(), WORKER, 1);
    let last = nats_sync(&mut p, &mut running).await;

    // Stored in batch N, removed in batch N + 1.
    nats_send(&mut p, last + 1, &sliding(true, 5)).await;
    nats_send(&mut p, last + 2, &sliding(false, 5)).await;
    assert!(matches!(running.next().await, Told::Ingest { .. }));
    assert!(!removal_is_indexable(&running.next().await));

    // A lost batch (no replay socket over NATS): the rank is cleared, then rebuilt.
    nats_send(&mut p, last + 4, &sliding(false, 5)).await;
    assert_eq!(running.next().await, Told::Clear { seq: None });
    assert_eq!(
        running.next().await,
        Told::Gap {
            missing: last + 3..=last + 3,
            replayed: false
        }
    );
    assert!(
        !removal_is_indexable(&running.next().await),
        "a gap keeps the stream's group kinds"
    );

    // The worker restarted: a new epoch, whatever the seq says.
    let mut restarted = KvEventPublisher::new(n.client.clone(), WORKER, 2);
    nats_send(&mut restarted, last + 5, &sliding(false, 5)).await;
    assert_eq!(
        running.next().await,
        Told::Clear {
            seq: Some(last + 5)
        }
    );
    assert!(removal_is_indexable(&running.next().await));
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gap_with_a_replay_socket_is_filled_whatever_the_live_transport() {
    // The NATS live stream with an engine replay socket beside it: the pipeline, not the
    // transport, repairs the gap, decoding the replayed batches with the stream's kinds.
    let n = nats().await;
    let live = NatsKvSource::new(n.client.clone())
        .subscribe(&sample_record(WORKER))
        .await
        .expect("subscribe");
    let subscription = KvSubscription {
        events: live.events,
        replay: Some(Arc::new(Holds)),
    };
    let (tx, told) = mpsc::channel(4096);
    let stop = CancellationToken::new();
    let task = tokio::spawn({
        let stop = stop.clone();
        async move {
            let sink = Recorder(tx);
            pipeline::consume(WorkerId::new(WORKER), subscription, &sink, stop.cancelled()).await;
        }
    });
    let mut running = Running { told, stop, task };
    let mut p = KvEventPublisher::new(n.client.clone(), WORKER, 1);
    let last = nats_sync(&mut p, &mut running).await;
    nats_send(&mut p, last + 3, &sliding(false, 3)).await;
    assert_eq!(
        running.next().await,
        Told::Ingest {
            seq: Some(last + 1),
            batch: sliding(true, 3)
        }
    );
    assert!(matches!(running.next().await, Told::Ingest { seq: Some(s), .. } if s == last + 2));
    assert_eq!(
        running.next().await,
        Told::Gap {
            missing: last + 1..=last + 2,
            replayed: true
        }
    );
    assert!(!removal_is_indexable(&running.next().await));
    running.stop().await;
}
