//! Prefill/decode (PD) two-leg dispatch (PROTOCOLS.md §7): how one request decided onto a prefill
//! and a decode worker is driven through both, per the PD protocol the pair registered in
//! `disagg_meta.protocol` (both legs must agree).
//!
//! | protocol | legs | prefill body | decode body |
//! |---|---|---|---|
//! | `sglang-bootstrap` | both at once | the client's, plus `bootstrap_host`, `bootstrap_port` (the prefill's registration), a fresh random u63 `bootstrap_room` and `rid` `infera-<room, 16 hex digits>` | the same, plus `disagg_prefill_dp_rank` (the prefill's rank) when the prefill fronts several DP ranks |
//! | `vllm-mori-write` | both at once | one token, not streamed; `kv_transfer_params {do_remote_decode: true, transfer_id, remote_dp_size, tp_size, remote_tp_size}` of the decode | the client's; `{do_remote_prefill: true, transfer_id, …}` of the prefill |
//! | `vllm-nixl` | prefill, then decode | one token, not streamed; `{do_remote_decode: true, do_remote_prefill: false, remote_engine_id: null, remote_block_ids: null, remote_host: null, remote_port: null}` | the client's, with the `kv_transfer_params` the prefill answered |
//! | `vllm-mooncake` | prefill, then decode | one token; `{do_remote_decode: true, do_remote_prefill: false, transfer_id}` | the client's; `{do_remote_prefill: true, remote_bootstrap_addr, remote_engine_id, transfer_id}` from the prefill's registration (`remote_engine_id` is `<engine_id>_dp<rank>` for a prefill of several DP ranks, as vLLM registers each rank), overlaid by whatever the prefill answered |
//! | `vllm-mori-read` | prefill, then decode | as `vllm-mori-write` | the client's; the prefill's `transfer_id`, `remote_engine_id`, `remote_block_ids`, plus its parallelism |
//! | `atom-mooncake` | prefill, then decode (completions and chat alike: ATOM answers `kv_transfer_params` on both) | one token; the decode's `remote_host`, `remote_port`, `remote_handshake_port`, `remote_dp_size`, `remote_tp_size` | the client's; the prefill's answer verbatim plus its `remote_dp_size`, `remote_tp_size`, `remote_dp_rank` (the rank it answered) |
//!
//! "One token" is `max_tokens: 1` (and `max_completion_tokens: 1` on chat), `stream: false`,
//! no `stream_options`, no `min_tokens` (vLLM's disaggregated proxy does the same). The decode
//! leg keeps the client's `max_tokens` and `stream`. Every leg's `kv_transfer_params` keeps the
//! server's `infera_retention` stamp (PROTOCOLS.md §5). MoRI parses peer addresses out of the
//! engine's request id, so both MoRI legs carry a forged `X-Request-Id`
//! (`___prefill_addr_host:H,handshake:P,notify:N___decode_addr_…_<room>`); the other
//! protocols get the attempt's request id there, the same on both legs.
//!
//! # DP ranks
//! A leg whose worker fronts several DP ranks (`dp_size > 1`) is pinned to the rank the router
//! chose with `X-data-parallel-rank` (its rank within the worker's registration), every
//! protocol alike. For a prefill of several ranks the room's residue modulo its `dp_size` is
//! that rank (SGLang's `follow_bootstrap_room` balancer places a PD request by it), and the
//! decode leg names it where its connector needs it (SGLang's `disagg_prefill_dp_rank`,
//! Mooncake's per-rank engine id); ATOM reports the rank that served its prefill itself.
//!
//! # Failures
//! Everything here happens before the client's first byte. The dispatcher (`super::dispatch`) retries
//! a [`LegError`] on another pair when the failed leg's worker could not take the request (or
//! answered 5xx), as it does for one leg. A concurrent dispatch drops the other leg as soon as
//! one fails — for HTTP that closes its connection, which vLLM takes as an abort; SGLang also
//! gets `POST /abort_request` for each leg left running, then and whenever the client goes away
//! or the decode stream fails later ([`abort`]) — and the client gets the decode
//! leg's response only once the prefill leg has answered with a success status. The prefill's
//! body is then drained in the background (a failure there is logged; the decode leg reports
//! its own outcome). The prefill leg has completed (`RequestPrefilled`) when its whole answer
//! arrived. A pair whose protocols differ, or whose registration lacks a parameter the
//! protocol needs, is a 500 naming both workers; a prefill answer the decode leg cannot be
//! built from is a 502.

use crate::error::{ErrorCode, ServiceError};
use crate::event::{Role, WorkerRecord};
use crate::ids::WorkerRank;
use crate::pd::{PdProtocol, Registered};
use crate::ports::transport::{
    Inbound, Outbound, RequestTransport, TransportError, engine_dp_rank,
};
use crate::rng::splitmix64;
use abort::{AbortGuard, LegTarget, PrefillMark};
use bytes::Bytes;
use futures::StreamExt as _;
use serde_json::{Map, Value};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// One leg's worker.
#[derive(Debug, Clone)]
pub struct Leg {
    pub rank: WorkerRank,
    /// The worker's URL, without a trailing slash.
    pub url: String,
    pub record: WorkerRecord,
}

impl Leg {
    /// The engine-side DP rank this leg is steered to, when its worker fronts several
    /// ([`engine_dp_rank`]).
    pub(crate) fn engine_dp_rank(&self) -> Option<u32> {
        engine_dp_rank(&self.rank, &self.record)
    }
}

/// The two workers of one decision.
#[derive(Debug, Clone)]
pub struct Pair {
    pub prefill: Leg,
    pub decode: Leg,
}

/// Why a pair cannot be driven.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum PdError {
    /// The legs registered different protocols (or one registered none).
    #[error(
        "PD protocol mismatch: prefill worker {prefill} registers {prefill_protocol}, decode \
         worker {decode} registers {decode_protocol}; both legs of a pair must register the same \
         disagg_meta.protocol"
    )]
    Mismatch {
        prefill: String,
        prefill_protocol: String,
        decode: String,
        decode_protocol: String,
    },
    /// Both legs registered a protocol this server does not speak.
    #[error(
        "PD protocol {protocol:?} of prefill worker {prefill} and decode worker {decode} is not \
         one this server speaks ({known})"
    )]
    Unknown {
        protocol: String,
        prefill: String,
        decode: String,
        known: String,
    },
    /// A registration lacks a parameter the protocol needs.
    #[error("{role} worker {worker} ({protocol}): disagg_meta.params.{key} is missing or invalid")]
    Meta {
        role: &'static str,
        worker: String,
        protocol: &'static str,
        key: &'static str,
    },
    /// The prefill's answer does not carry what the decode leg needs.
    #[error("prefill worker {worker} ({protocol}): {message}")]
    Handoff {
        worker: String,
        protocol: &'static str,
        message: String,
    },
}

impl ServiceError for PdError {
    /// Internal for the fleet's configuration, a bad gateway for a prefill's answer.
    fn code(&self) -> ErrorCode {
        match self {
            PdError::Handoff { .. } => ErrorCode::BadGateway,
            _ => ErrorCode::Internal,
        }
    }
}

/// The protocol both workers registered.
///
/// # Errors
/// [`PdError::Mismatch`] when they differ or one has none, [`PdError::Unknown`] for a name this
/// server does not speak.
pub(crate) fn resolve(
    prefill: &WorkerRecord,
    decode: &WorkerRecord,
) -> Result<PdProtocol, PdError> {
    let p = Registered::of(prefill).protocol;
    let d = Registered::of(decode).protocol;
    match (p, d) {
        (Some(p), Some(d)) if p == d => PdProtocol::parse(p).ok_or_else(|| PdError::Unknown {
            protocol: p.to_owned(),
            prefill: prefill.worker_id.to_string(),
            decode: decode.worker_id.to_string(),
            known: PdProtocol::known(),
        }),
        _ => Err(PdError::Mismatch {
            prefill: prefill.worker_id.to_string(),
            prefill_protocol: p.unwrap_or("no protocol").to_owned(),
            decode: decode.worker_id.to_string(),
            decode_protocol: d.unwrap_or("no protocol").to_owned(),
        }),
    }
}

static NEXT_ROOM: AtomicU64 = AtomicU64::new(0);

/// A fresh random u63 (SGLang's `bootstrap_room`; the other protocols derive their
/// `transfer_id` from it): SplitMix64 over a per-process seed and a counter, so two requests
/// never share one within a process and processes do not collide in practice.
pub(crate) fn new_room(seed: u64) -> u64 {
    let mut state = seed
        ^ NEXT_ROOM
            .fetch_add(1, Ordering::Relaxed)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15);
    splitmix64(&mut state) >> 1
}

mod abort;
mod shape;
#[cfg(test)]
mod tests;

pub(crate) use shape::{Shape, sglang_rid};

/// A leg that failed before the client's first byte.
#[derive(Debug)]
pub(crate) enum LegError {
    /// The leg's transport failed.
    Transport {
        role: Role,
        rank: WorkerRank,
        error: TransportError,
    },
    /// The prefill leg answered an error status.
    Status { rank: WorkerRank, response: Inbound },
    /// The pair cannot be driven.
    Pd(PdError),
}

impl From<PdError> for LegError {
    fn from(e: PdError) -> Self {
        LegError::Pd(e)
    }
}

/// Sends one attempt's two legs and resolves to the decode leg's response. See the module docs.
///
/// `trace` holds the attempt's trace context headers (empty unless traces are exported).
/// `prefilled` runs once the prefill leg has completed (its whole answer arrived with a success
/// status), at most once, and not at all when it failed.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn send(
    transport: &Arc<dyn RequestTransport>,
    shape: Shape<'_>,
    path: &'static str,
    base: &Map<String, Value>,
    stream: bool,
    request_id: &str,
    max_handoff_bytes: usize,
    trace: &http::HeaderMap,
    prefilled: impl FnOnce() + Send + 'static,
) -> Result<Inbound, LegError> {
    let pair = shape.pair;
    let engine_id = shape
        .engine_request_id()?
        .unwrap_or_else(|| request_id.to_owned());
    let outbound = |leg: &Leg, body: &Map<String, Value>, stream: bool| {
        let mut out = Outbound::new(
            leg.rank.worker.clone(),
            leg.url.clone(),
            path,
            Bytes::from(serde_json::to_vec(body).unwrap_or_default()),
            stream,
            request_id,
        )
        .with_engine_request_id(Some(&engine_id))
        .with_dp_rank(leg.engine_dp_rank());
        // The attempt's trace context, on both legs.
        out.headers
            .extend(trace.iter().map(|(k, v)| (k.clone(), v.clone())));
        out
    };
    let prefill_body = shape.prefill_body(base)?;
    let prefill_stream = prefill_body
        .get("stream")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let prefill_out = outbound(&pair.prefill, &prefill_body, prefill_stream);
    let prefill = async {
        match transport.send(prefill_out).await {
            Err(error) => Err(LegError::Transport {
                role: Role::Prefill,
                rank: pair.prefill.rank.clone(),
                error: on_leg(Role::Prefill, error),
            }),
            Ok(response) if !response.status.is_success() => Err(LegError::Status {
                rank: pair.prefill.rank.clone(),
                response,
            }),
            Ok(response) => Ok(response),
        }
    };
    let send_decode = |body: Map<String, Value>| async move {
        transport
            .send(outbound(&pair.decode, &body, stream))
            .await
            .map_err(|error| LegError::Transport {
                role: Role::Decode,
                rank: pair.decode.rank.clone(),
                error: on_leg(Role::Decode, error),
            })
    };
    if shape.protocol.concurrent() {
        let decode_body = shape.decode_body(base, None)?;
        // SGLang needs an explicit abort of a leg left running (see `abort`); for the
        // others, dropping a leg closes its connection, which the engine takes as an abort.
        let mut guard = (shape.protocol == PdProtocol::SglangBootstrap).then(|| {
            let target = |leg: &Leg| LegTarget {
                worker: leg.rank.worker.clone(),
                url: leg.url.clone(),
            };
            AbortGuard::new(
                transport.clone(),
                sglang_rid(shape.room),
                request_id.to_owned(),
                target(&pair.prefill),
                target(&pair.decode),
            )
        });
        let mark = guard.as_ref().map(AbortGuard::prefill);
        let prefill = async {
            let r = prefill.await;
            if r.is_err()
                && let Some(mark) = &mark
            {
                mark.ended();
            }
            r
        };
        // The first leg to fail drops the other; the guard (dropped with this attempt) aborts
        // the leg that was left running.
        let (prefill, mut decode) =
            match futures::future::try_join(prefill, send_decode(decode_body)).await {
                Ok(legs) => legs,
                Err(e) => {
                    if let (Some(g), LegError::Transport { role, .. }) = (&mut guard, &e)
                        && *role == Role::Decode
                    {
                        g.decode_failed();
                    }
                    return Err(e);
                }
            };
        tokio::spawn(drain_prefill(
            prefill,
            pair.prefill.rank.clone(),
            mark,
            prefilled,
        ));
        if let Some(mut g) = guard {
            if decode.status.is_success() {
                decode.body = g.guard_body(decode.body);
            } else {
                // The decode leg refused the request: nothing runs there, and a prefill still
                // running waits for a peer that never comes (the guard aborts it here).
                g.decode_failed();
            }
        }
        return Ok(decode);
    }
    let prefill = prefill.await?;
    let answer =
        collect(prefill, max_handoff_bytes)
            .await
            .map_err(|error| LegError::Transport {
                role: Role::Prefill,
                rank: pair.prefill.rank.clone(),
                error: on_leg(Role::Prefill, error),
            })?;
    prefilled();
    let handoff = shape.handoff(&answer)?;
    send_decode(shape.decode_body(base, handoff)?).await
}

/// `error` with the leg it happened on named first (same kind, so the same status and retry).
fn on_leg(role: Role, error: TransportError) -> TransportError {
    let leg = |m: String| format!("{} leg: {m}", role.as_str());
    match error {
        TransportError::Unreachable(m) => TransportError::Unreachable(leg(m)),
        TransportError::Overloaded {
            message,
            retry_after_s,
        } => TransportError::Overloaded {
            message: leg(message),
            retry_after_s,
        },
        TransportError::Timeout(m) => TransportError::Timeout(leg(m)),
        TransportError::Sequence(m) => TransportError::Sequence(leg(m)),
        TransportError::Failed(m) => TransportError::Failed(leg(m)),
    }
}

/// The whole body of a (small) response, up to `max` bytes.
async fn collect(response: Inbound, max: usize) -> Result<Vec<u8>, TransportError> {
    let mut body = response.body;
    let mut out = Vec::new();
    while let Some(chunk) = body.next().await {
        out.extend_from_slice(&chunk?);
        if out.len() > max {
            return Err(TransportError::Failed(format!(
                "the prefill answer is larger than {max} bytes"
            )));
        }
    }
    Ok(out)
}

/// Reads a concurrent prefill leg's answer to its end, so the engine finishes the hand-off;
/// then the leg has completed (`prefilled`) and is no longer running (`mark`). A failure
/// midway is logged; the leg then counts as running (an SGLang abort still reaches it).
async fn drain_prefill(
    response: Inbound,
    rank: WorkerRank,
    mark: Option<PrefillMark>,
    prefilled: impl FnOnce(),
) {
    let mut body = response.body;
    while let Some(chunk) = body.next().await {
        if let Err(e) = chunk {
            tracing::warn!(worker = %rank.worker.as_str(), dp_rank = rank.dp_rank, error = %e,
                "PD prefill leg failed after the decode leg started");
            return;
        }
    }
    if let Some(mark) = mark {
        mark.ended();
    }
    prefilled();
}
