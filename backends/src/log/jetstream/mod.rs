//! The shared, durable event log on a NATS JetStream stream.
//!
//! # Layout
//! - **Stream** `<stream>` (file storage) with the single subject `infera.log.<stream>`. One
//!   message per envelope; the message's **stream sequence is the log sequence**. The payload is
//!   the envelope in core's golden JSON format with `"seq":0` — the number is only known once the
//!   server stores the message, so readers take it from the stream and ignore the field.
//! - **Snapshot**: object `snapshot` in the object store bucket `<stream>_snapshots`, JSON
//!   `{"v":1,"upto":N,"events":[…]}`, with `upto` also in the object's metadata so a read can
//!   check it without downloading the dump.
//!
//! # Appends are atomic batches (ADR-50, nats-server ≥ 2.12)
//! The stream has `allow_atomic`. A batch of n ≥ 2 envelopes is published as n messages carrying
//! `Nats-Batch-Id` / `Nats-Batch-Sequence`, the last with `Nats-Batch-Commit: 1`; the server
//! stores all of them at commit, under its stream lock, or none. So a batch always occupies
//! consecutive sequence numbers, concurrent appenders (other replicas) can never interleave
//! inside it, and nobody needs to know the last sequence beforehand: no optimistic-concurrency
//! retries, whatever the contention. The commit's ack carries the last sequence; the first is
//! `last - n + 1`. A single envelope is a plain JetStream publish. The server caps a batch at
//! [`MAX_ATOMIC_BATCH`] messages; larger batches are refused rather than split (splitting would
//! break atomicity). One round trip per batch: the messages before the commit are streamed without
//! acks (ADR-50 lets the first one be a request; a refused or lost message makes the commit fail
//! instead, and the commit ack's count is checked).
//!
//! Durability is the stream's: file storage, fsynced on nats-server's `sync_interval` (2 min by
//! default; `sync: always` in the server config for every write). A killed server loses nothing
//! acknowledged; a machine crash may lose what was not yet synced. With `replicas` ≥ 3 on a
//! cluster, an ack means a quorum stored the batch.
//!
//! # Reads, subscriptions, replicas
//! `read` is one batched direct get (`$JS.API.DIRECT.GET`, `allow_direct`). `subscribe` is an
//! ordered push consumer from the requested sequence: it sees every handle's appends, which is how
//! router replicas share `RequestRouted` / `RequestFinished` load accounting. Both check that the
//! sequence numbers they hand out are contiguous.
//!
//! # Compaction and bounds
//! `compact(snapshot)` stores the snapshot, then purges the stream below `upto + 1`. A crash in
//! between leaves envelopes the snapshot already covers; rebuilds start after `upto` anyway, and
//! the next `open` finishes the purge. The stream is bounded by `max_age` and `max_bytes`
//! (discard old). **What a bound loses:** when it is hit, the server drops the oldest envelopes
//! whether or not a snapshot covers them. If the snapshot is older than the oldest surviving
//! envelope, the events in between are gone: a restarted server can no longer rebuild exact
//! state. That is detected, never silent: reading or subscribing from a sequence below the first
//! one available and above the snapshot is an error (`LogError::Compacted` through the last lost
//! sequence, logged as a gap). Compact (take a snapshot) well within `max_age` and before
//! `max_bytes` fills, and the bounds only ever drop envelopes a snapshot already stands in for.

mod read;

use super::codec;
use super::config::{JetStreamLogConfig, validate_name};
use async_nats::jetstream::{self, object_store, stream};
use async_nats::{HeaderMap, header};
use async_trait::async_trait;
use bytes::Bytes;
use futures::stream::BoxStream;
use infera_core::clock::Clock;
use infera_core::event::{Envelope, Seq};
use infera_core::log::{EventLog, LogError, NewEvent, SeqRange, Snapshot};
use serde::Deserialize;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use tokio::io::AsyncReadExt;

/// The most envelopes one atomic batch may hold (nats-server's limit per batch).
pub const MAX_ATOMIC_BATCH: usize = 1000;

/// Name of the snapshot object.
const SNAPSHOT_OBJECT: &str = "snapshot";
/// Object metadata key holding the snapshot's `upto`.
const UPTO_KEY: &str = "upto";

/// An [`EventLog`] on a JetStream stream. Cheap to clone; clones share one connection.
#[derive(Clone)]
pub struct JetStreamLog {
    inner: Arc<Inner>,
}

struct Inner {
    client: async_nats::Client,
    stream: stream::Stream,
    snapshots: object_store::ObjectStore,
    name: String,
    subject: String,
    clock: Arc<dyn Clock>,
    /// Unique per handle; with `batches` it makes every batch id unique.
    batch_prefix: String,
    batches: AtomicU64,
}

impl std::fmt::Debug for JetStreamLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JetStreamLog")
            .field("stream", &self.inner.name)
            .field("subject", &self.inner.subject)
            .finish_non_exhaustive()
    }
}

/// A JetStream API reply: an ack or an error.
#[derive(Debug, Deserialize)]
struct ApiReply {
    #[serde(default)]
    seq: Option<u64>,
    #[serde(default)]
    count: Option<u64>,
    #[serde(default)]
    error: Option<ApiError>,
}

#[derive(Debug, Deserialize)]
struct ApiError {
    #[serde(default)]
    code: u16,
    #[serde(default)]
    err_code: u32,
    #[serde(default)]
    description: String,
}

/// nats-server's error code for "atomic batch publish not enabled on this stream".
const ERR_BATCH_DISABLED: u32 = 10174;

impl JetStreamLog {
    /// Connects to `config.url` and opens the log (see [`JetStreamLog::open`]).
    ///
    /// # Errors
    /// [`LogError::Backend`] if the server cannot be reached, or as [`JetStreamLog::open`].
    pub async fn connect(
        config: &JetStreamLogConfig,
        clock: Arc<dyn Clock>,
    ) -> Result<Self, LogError> {
        let client = async_nats::connect(&config.url).await.map_err(|e| {
            LogError::Backend(format!(
                "connecting to NATS at {} for the event log: {e}",
                config.url
            ))
        })?;
        Self::open(client, config, clock).await
    }

    /// Creates or updates the stream and the snapshot bucket, then checks they agree.
    ///
    /// The configured bounds win over those already on the stream. A stream of that name that
    /// holds other subjects is refused (the log needs a stream of its own).
    ///
    /// # Errors
    /// [`LogError::Backend`] naming what failed: JetStream disabled or too old (atomic batches need
    /// nats-server 2.12), a foreign stream of that name, or a snapshot newer than the stream
    /// (the stream was deleted and recreated under a snapshot).
    pub async fn open(
        client: async_nats::Client,
        config: &JetStreamLogConfig,
        clock: Arc<dyn Clock>,
    ) -> Result<Self, LogError> {
        validate_name(&config.stream).map_err(LogError::Backend)?;
        let js = jetstream::new(client.clone());
        let subject = config.subject();
        let name = config.stream.clone();
        let backend = |what: &str, e: &dyn std::fmt::Display| {
            LogError::Backend(format!("{what} for event log stream {name}: {e}"))
        };
        if let Ok(mut existing) = js.get_stream(&name).await {
            let info = existing
                .info()
                .await
                .map_err(|e| backend("reading stream info", &e))?;
            if info.config.subjects != [subject.clone()] {
                return Err(LogError::Backend(format!(
                    "stream {name} exists with subjects {:?}, not [{subject:?}]; the event log \
                     needs a stream of its own: choose another ?stream=",
                    info.config.subjects
                )));
            }
        }
        let stream_config = stream::Config {
            name: name.clone(),
            description: Some("infera event log: one envelope per message".to_owned()),
            subjects: vec![subject.clone()],
            storage: stream::StorageType::File,
            num_replicas: config.replicas,
            max_age: config.max_age.unwrap_or_default(),
            max_bytes: config
                .max_bytes
                .and_then(|b| i64::try_from(b).ok())
                .unwrap_or(-1),
            discard: stream::DiscardPolicy::Old,
            allow_direct: true,
            allow_atomic_publish: true,
            ..Default::default()
        };
        let created = js
            .create_or_update_stream(stream_config)
            .await
            .map_err(|e| {
                backend(
                    "creating the stream (JetStream enabled? nats-server >= 2.12?)",
                    &e,
                )
            })?;
        // A server older than 2.12 ignores `allow_atomic` and would store batches message by
        // message: refuse it rather than lose atomicity silently.
        if !created.config.allow_atomic_publish || !created.config.allow_direct {
            return Err(LogError::Backend(format!(
                "stream {name} does not support atomic batch publish and direct get; the event \
                 log needs nats-server >= 2.12"
            )));
        }
        let stream = js
            .get_stream(&name)
            .await
            .map_err(|e| backend("opening the stream", &e))?;
        let bucket = config.snapshot_bucket();
        let snapshots = match js.get_object_store(&bucket).await {
            Ok(store) => store,
            Err(_) => js
                .create_object_store(object_store::Config {
                    bucket: bucket.clone(),
                    description: Some(format!("infera event log snapshots of stream {name}")),
                    storage: stream::StorageType::File,
                    num_replicas: config.replicas,
                    ..Default::default()
                })
                .await
                .map_err(|e| backend(&format!("creating snapshot bucket {bucket}"), &e))?,
        };
        let batch_prefix = client
            .new_inbox()
            .rsplit('.')
            .next()
            .unwrap_or("log")
            .to_owned();
        let log = Self {
            inner: Arc::new(Inner {
                client,
                stream,
                snapshots,
                name,
                subject,
                clock,
                batch_prefix,
                batches: AtomicU64::new(0),
            }),
        };
        let snap_upto = log.snapshot_upto().await?;
        let (first, last) = log.bounds().await?;
        if snap_upto > last {
            return Err(LogError::Backend(format!(
                "stream {} ends at seq {last} but its snapshot covers up to {snap_upto}: the stream \
                 was deleted or reset under its snapshot; delete bucket {} too, or restore the stream",
                log.inner.name,
                config.snapshot_bucket()
            )));
        }
        if snap_upto > 0 && first <= snap_upto {
            // A compaction stored its snapshot but did not get to purge: finish it.
            log.purge_through(snap_upto).await?;
            tracing::info!(stream = %log.inner.name, upto = snap_upto, "finished an interrupted compaction");
        }
        Ok(log)
    }

    /// The stream name.
    pub fn stream_name(&self) -> &str {
        &self.inner.name
    }

    /// The subject envelopes are published on.
    pub fn subject(&self) -> &str {
        &self.inner.subject
    }

    fn backend(&self, what: &str, e: impl std::fmt::Display) -> LogError {
        LogError::Backend(format!(
            "{what} on event log stream {}: {e}",
            self.inner.name
        ))
    }

    /// `(first, last)` sequence numbers the stream holds now (`first = last + 1` when empty).
    async fn bounds(&self) -> Result<(Seq, Seq), LogError> {
        let info = self
            .inner
            .stream
            .get_info()
            .await
            .map_err(|e| self.backend("reading stream info", e))?;
        Ok((info.state.first_sequence, info.state.last_sequence))
    }

    /// The `upto` of the stored snapshot (0 without one), from its metadata.
    async fn snapshot_upto(&self) -> Result<Seq, LogError> {
        match self.inner.snapshots.info(SNAPSHOT_OBJECT).await {
            Ok(info) => info
                .metadata
                .get(UPTO_KEY)
                .and_then(|v| v.parse().ok())
                .ok_or_else(|| self.backend("snapshot object has no valid `upto` metadata", "")),
            Err(e) if e.kind() == object_store::InfoErrorKind::NotFound => Ok(0),
            Err(e) => Err(self.backend("reading snapshot info", e)),
        }
    }

    /// Removes every envelope with `seq <= upto`.
    async fn purge_through(&self, upto: Seq) -> Result<(), LogError> {
        self.inner
            .stream
            .purge()
            .sequence(upto + 1)
            .await
            .map(drop)
            .map_err(|e| self.backend("purging compacted envelopes", e))
    }

    /// Parses a JetStream reply; an API error becomes a [`LogError::Backend`].
    fn api_reply(&self, what: &str, payload: &[u8]) -> Result<ApiReply, LogError> {
        let reply: ApiReply = serde_json::from_slice(payload).map_err(|e| {
            self.backend(
                what,
                format!(
                    "unreadable reply {:?}: {e}",
                    String::from_utf8_lossy(payload)
                ),
            )
        })?;
        match reply.error {
            Some(err) if err.err_code == ERR_BATCH_DISABLED => Err(self.backend(
                what,
                "atomic batch publish is not enabled on the stream (needs nats-server >= 2.12)",
            )),
            Some(err) => Err(self.backend(
                what,
                format!(
                    "{} (code {}, err_code {})",
                    err.description, err.code, err.err_code
                ),
            )),
            None => Ok(reply),
        }
    }

    async fn publish_one(&self, payload: Bytes) -> Result<Seq, LogError> {
        let reply = self
            .inner
            .client
            .request(self.inner.subject.clone(), payload)
            .await
            .map_err(|e| self.backend("publishing an event", e))?;
        let ack = self.api_reply("publishing an event", &reply.payload)?;
        ack.seq
            .ok_or_else(|| self.backend("publishing an event", "the ack carries no sequence"))
    }

    async fn publish_batch(&self, mut payloads: Vec<Bytes>) -> Result<Seq, LogError> {
        let n = payloads.len();
        let id = format!(
            "{}-{}",
            self.inner.batch_prefix,
            self.inner.batches.fetch_add(1, Ordering::Relaxed)
        );
        let headers = |i: usize| {
            let mut h = HeaderMap::new();
            h.insert(header::NATS_BATCH_ID, id.as_str());
            h.insert(header::NATS_BATCH_SEQUENCE, (i + 1).to_string().as_str());
            if i + 1 == n {
                h.insert(header::NATS_BATCH_COMMIT, header::NATS_BATCH_COMMIT_FINAL);
            }
            h
        };
        let what = "appending a batch";
        let client = &self.inner.client;
        let subject = &self.inner.subject;
        let commit = payloads
            .pop()
            .ok_or_else(|| self.backend(what, "empty batch"))?;
        for (i, payload) in payloads.into_iter().enumerate() {
            // Unacknowledged: a message the server refused or lost makes the commit fail
            // (batch incomplete), and the commit's count is checked below.
            client
                .publish_with_headers(subject.clone(), headers(i), payload)
                .await
                .map_err(|e| self.backend(what, e))?;
        }
        let reply = client
            .request_with_headers(subject.clone(), headers(n - 1), commit)
            .await
            .map_err(|e| self.backend(what, e))?;
        let ack = self.api_reply(what, &reply.payload)?;
        if let Some(count) = ack.count
            && count != n as u64
        {
            return Err(self.backend(
                what,
                format!("the server committed {count} of {n} messages"),
            ));
        }
        ack.seq
            .ok_or_else(|| self.backend(what, "the commit ack carries no sequence"))
    }
}

#[async_trait]
impl EventLog for JetStreamLog {
    async fn append(&self, batch: Vec<NewEvent>) -> Result<SeqRange, LogError> {
        let n = batch.len();
        if n == 0 {
            let last = self.last_seq().await?;
            return Ok(SeqRange {
                first: last + 1,
                last,
            });
        }
        if n > MAX_ATOMIC_BATCH {
            return Err(self.backend(
                "appending",
                format!(
                    "a batch of {n} events exceeds JetStream's atomic batch limit of \
                     {MAX_ATOMIC_BATCH}; append it in smaller batches"
                ),
            ));
        }
        let envelopes = codec::stamp(batch, 0, self.inner.clock.now_us());
        let payloads = envelopes
            .iter()
            .map(|env| codec::encode_envelope(env).map(Bytes::from))
            .collect::<Result<Vec<_>, _>>()?;
        let last = if n == 1 {
            let payload = payloads.into_iter().next().unwrap_or_default();
            self.publish_one(payload).await?
        } else {
            self.publish_batch(payloads).await?
        };
        Ok(SeqRange {
            first: last + 1 - n as Seq,
            last,
        })
    }

    async fn read(&self, from: Seq, max: usize) -> Result<Vec<Envelope>, LogError> {
        read::read(self, from, max).await
    }

    async fn last_seq(&self) -> Result<Seq, LogError> {
        Ok(self.bounds().await?.1)
    }

    async fn snapshot(&self) -> Result<Option<Snapshot>, LogError> {
        let mut object = match self.inner.snapshots.get(SNAPSHOT_OBJECT).await {
            Ok(object) => object,
            Err(e) if e.kind() == object_store::GetErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(self.backend("fetching the snapshot", e)),
        };
        let mut bytes = Vec::with_capacity(object.info.size);
        object
            .read_to_end(&mut bytes)
            .await
            .map_err(|e| self.backend("reading the snapshot", e))?;
        let store = format!("snapshot bucket of stream {}", self.inner.name);
        codec::decode_snapshot(&bytes, &store).map(Some)
    }

    async fn compact(&self, snapshot: Snapshot) -> Result<(), LogError> {
        let (_, last) = self.bounds().await?;
        if snapshot.upto > last {
            return Err(LogError::SnapshotAhead {
                upto: snapshot.upto,
                last,
            });
        }
        let current = self.snapshot_upto().await?;
        if snapshot.upto < current {
            return Err(self.backend(
                "compacting",
                format!(
                    "the snapshot at seq {} is older than the stored one at seq {current}",
                    snapshot.upto
                ),
            ));
        }
        let body = codec::encode_snapshot(&snapshot)?;
        let meta = object_store::ObjectMetadata {
            name: SNAPSHOT_OBJECT.to_owned(),
            description: Some(format!("projection dump through seq {}", snapshot.upto)),
            metadata: [(UPTO_KEY.to_owned(), snapshot.upto.to_string())].into(),
            ..Default::default()
        };
        self.inner
            .snapshots
            .put(meta, &mut body.as_bytes())
            .await
            .map_err(|e| self.backend("storing the snapshot", e))?;
        self.purge_through(snapshot.upto).await?;
        tracing::info!(
            stream = %self.inner.name,
            upto = snapshot.upto,
            snapshot_events = snapshot.events.len(),
            snapshot_bytes = body.len(),
            "event log compacted"
        );
        Ok(())
    }

    fn subscribe(&self, from: Seq) -> BoxStream<'static, Result<Envelope, LogError>> {
        read::subscribe(self.clone(), from)
    }
}
