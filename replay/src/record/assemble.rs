//! Finished requests as trace rows: the part of the recorder that turns the committed events
//! (and the request-metadata tap) into [`Row`]s in arrival order, shared by the trace recorder
//! ([`super::Recorder`], which writes them to Parquet) and the server's shadow replay
//! ([`crate::shadow`], which keeps them in memory). See the module docs of [`super`] for the
//! order and completeness rules.

use super::think;
use crate::trace::TraceRequest;
use infera_core::event::{Envelope, Event, RequestFinished, RequestRouted, RequestStatus};
use infera_core::ids::WorkerId;
use infera_core::service::RequestMeta;
use std::collections::HashMap;

/// A request routed and not yet finished (its latest attempt).
#[derive(Debug)]
struct InFlight {
    attempt: String,
    arrival_us: u64,
    attempts: u32,
    routed: RequestRouted,
}

/// One finished request, ready for a segment.
#[derive(Debug)]
pub(crate) struct Row {
    /// The router's key of the request ([`RequestId::request_key`](infera_core::ids::RequestId::request_key)); `request.request_id` is
    /// the client's id.
    pub(crate) key: String,
    pub(crate) request: TraceRequest,
    pub(crate) worker: String,
    pub(crate) dp_rank: u32,
    pub(crate) decode_worker: Option<String>,
    pub(crate) overlap_blocks: u32,
    pub(crate) policy: String,
    pub(crate) status: RequestStatus,
    pub(crate) ttft_us: Option<u64>,
    pub(crate) cached_tokens: Option<u32>,
    pub(crate) finish_us: u64,
    pub(crate) attempts: u32,
    /// The session key the router routed it under (`RequestRouted::session`).
    pub(crate) session: Option<infera_core::ids::SessionKey>,
}

/// Puts a request's session, identity and prompt on its row (a prompt whose length does not
/// match the routed prompt is left out: the trace's invariants hold over what the router saw).
/// An adapter's row names the base model as `model` and the adapter as `lora`, as the trace
/// schema has it.
fn attach(req: &mut TraceRequest, meta: RequestMeta) {
    let RequestMeta {
        session_id,
        token_ids,
        adapter,
        cache_salt,
        images,
        priority,
        ..
    } = meta;
    req.priority = priority;
    req.images = images
        .into_iter()
        .map(|run| crate::trace::TraceImage {
            offset: run.offset,
            length: run.length,
            id: run.id.into(),
        })
        .collect();
    if session_id.is_some() {
        req.session_id = session_id;
    }
    if let Some((adapter, base)) = adapter {
        req.model = base;
        req.lora = Some(adapter);
    }
    if cache_salt.is_some() {
        req.cache_salt = cache_salt;
    }
    if let Some(tokens) = token_ids
        && tokens.len() as u64 == u64::from(req.input_length)
    {
        req.token_ids = Some(tokens);
    }
}

/// What [`Assembler::feed`] made of an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fed {
    /// A request event; `Some(bytes)` when it completed a row of about that many bytes.
    Request(Option<u64>),
    /// Any other event (the assembler reads worker registrations for their block size).
    Other,
}

/// See the module docs.
#[derive(Debug, Default)]
pub(crate) struct Assembler {
    block_sizes: HashMap<WorkerId, u32>,
    in_flight: HashMap<String, InFlight>,
    /// Attempts that failed with a worker error, which a retry may still replace.
    failed: HashMap<String, (InFlight, Row)>,
    rows: Vec<Row>,
    /// Arrival of the last row taken: rows arriving earlier are late.
    taken_upto_us: u64,
    /// What the events do not carry, by request key, with when it was noted.
    metas: HashMap<String, (RequestMeta, u64)>,
    /// Each session's last finish, for the think times of its later turns.
    sessions: think::SessionClock,
    pub(crate) late: u64,
    pub(crate) unhashed: u64,
}

impl Row {
    /// About what the row costs to hold and to write.
    pub(crate) fn bytes(&self) -> u64 {
        128 + 8 * self.request.block_hashes.len() as u64
    }
}

impl Assembler {
    /// Requests routed and not finished.
    pub(crate) fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// About what the finished rows not yet taken hold.
    pub(crate) fn held_bytes(&self) -> u64 {
        self.rows.iter().map(Row::bytes).sum()
    }

    /// See [`super::Recorder::note_request`]; it returns nothing: a row it completes was
    /// already counted.
    pub(crate) fn note_request(&mut self, meta: RequestMeta, now_us: u64) {
        if let Some(row) = self.rows.iter_mut().find(|r| r.key == meta.request_id) {
            attach(&mut row.request, meta);
            return;
        }
        self.metas.insert(meta.request_id.clone(), (meta, now_us));
    }

    /// Takes one committed event.
    pub(crate) fn feed(&mut self, env: &Envelope) -> Fed {
        match &env.event {
            Event::RequestRouted(r) => {
                self.routed(r);
                Fed::Request(None)
            }
            Event::RequestPrefilled(_) => Fed::Request(None),
            Event::RequestFinished(f) => Fed::Request(self.finished(f, env.ts_us)),
            other => {
                if let Event::WorkerRegistered(w) = other {
                    self.block_sizes
                        .insert(w.record.worker_id.clone(), w.record.kv_block_size);
                }
                Fed::Other
            }
        }
    }

    fn routed(&mut self, r: &RequestRouted) {
        let key = r.request_id.request_key().to_owned();
        let (arrival_us, attempts) = match self.failed.remove(&key) {
            Some((earlier, _)) => (earlier.arrival_us, earlier.attempts + 1),
            None => (r.at_us, 1),
        };
        self.in_flight.insert(
            key,
            InFlight {
                attempt: r.request_id.0.as_str().to_owned(),
                arrival_us,
                attempts,
                routed: r.clone(),
            },
        );
    }

    fn finished(&mut self, f: &RequestFinished, ts_us: u64) -> Option<u64> {
        let key = f.request_id.request_key();
        let flight = self.in_flight.remove(key)?;
        if flight.attempt != f.request_id.0.as_str() {
            // An older attempt's late news: the newer attempt stays in flight.
            self.in_flight.insert(key.to_owned(), flight);
            return None;
        }
        let Some(row) = self.row(&flight, f, ts_us) else {
            self.unhashed += 1;
            return None;
        };
        if f.status == RequestStatus::WorkerError {
            // Failed before any byte reached the client: a retry may follow at once.
            self.failed.insert(key.to_owned(), (flight, row));
            None
        } else {
            self.push_row(row)
        }
    }

    fn push_row(&mut self, mut row: Row) -> Option<u64> {
        if let Some((meta, _)) = self.metas.remove(&row.key) {
            attach(&mut row.request, meta);
        }
        if row.request.arrival_us < self.taken_upto_us {
            self.late += 1;
            return None;
        }
        let bytes = row.bytes();
        self.rows.push(row);
        Some(bytes)
    }

    fn row(&self, flight: &InFlight, f: &RequestFinished, ts_us: u64) -> Option<Row> {
        let r = &flight.routed;
        let first = r.legs.first()?;
        let block_size = self
            .block_sizes
            .get(&first.worker.worker)
            .copied()
            .filter(|bs| *bs > 0)?;
        let input_length = r.prompt_tokens;
        let blocks = r.blocks.len() as u64;
        let full = u64::from(input_length / block_size);
        if blocks < full || blocks > u64::from(input_length.div_ceil(block_size)) {
            return None;
        }
        let decode = r.legs.get(1).map(|l| l.worker.worker.as_str().to_owned());
        Some(Row {
            key: r.request_id.request_key().to_owned(),
            request: TraceRequest {
                arrival_us: flight.arrival_us,
                request_id: r.request_id.client_id().to_owned(),
                model: r.model.clone(),
                input_length,
                output_length: f.tokens_out,
                block_size,
                block_hashes: r.blocks.iter().map(|b| b.0).collect(),
                token_ids: None,
                session_id: None,
                retention: r.retention,
                ttl_seconds: None,
                think_time_us: None,
                lora: None,
                cache_salt: None,
                images: Vec::new(),
                tenant: r.tenant.clone(),
                priority: None,
            },
            worker: first.worker.worker.as_str().to_owned(),
            dp_rank: first.worker.dp_rank,
            decode_worker: decode,
            overlap_blocks: first.overlap_blocks,
            policy: r.policy.clone(),
            status: f.status,
            ttft_us: f.ttft_us,
            cached_tokens: f.cached_tokens,
            finish_us: ts_us,
            attempts: flight.attempts,
            session: r.session,
        })
    }

    /// Takes the finished rows that can be final at `now_us`, in arrival order with their think
    /// times: those that arrived before the oldest request still in flight (requests in flight
    /// since before `now_us - max_in_flight_us` excepted), or every one when `all`. Failed
    /// attempts not retried by then are final too.
    pub(crate) fn take_ready(&mut self, now_us: u64, max_in_flight_us: u64, all: bool) -> Vec<Row> {
        let failed: Vec<Row> = self.failed.drain().map(|(_, (_, row))| row).collect();
        for row in failed {
            self.push_row(row);
        }
        let horizon = now_us.saturating_sub(max_in_flight_us);
        // Metadata of requests that never finished (or were not recordable) is let go.
        self.metas.retain(|_, (_, at)| *at >= horizon);
        let watermark = if all {
            u64::MAX
        } else {
            self.in_flight
                .values()
                .map(|f| f.arrival_us)
                .filter(|a| *a >= horizon)
                .min()
                .unwrap_or(u64::MAX)
        };
        self.rows.sort_by_key(|r| r.request.arrival_us);
        let ready = self
            .rows
            .partition_point(|r| r.request.arrival_us < watermark);
        let mut rows: Vec<Row> = self.rows.drain(..ready).collect();
        self.sessions.forget_idle(now_us);
        self.sessions
            .stamp(rows.iter_mut().map(|r| (&mut r.request, r.finish_us)));
        if let Some(last) = rows.last() {
            self.taken_upto_us = last.request.arrival_us;
        }
        rows
    }
}
