//! One client connection: read a frame, answer it, repeat.
//!
//! Frames are read straight into a buffer of their exact size (no intermediate copy for large
//! values, no zeroing) and replies are written with one `writev` of their parts, so a 1 MiB
//! value crosses the daemon without being copied. Waiting for a request is bounded by the idle
//! timeout, reading a started frame by the frame timeout (see [`super`]). A client that said
//! `hello{prefers_shared_arena: true}` to a daemon with an arena gets the memfd right after
//! `hello_ack`, and from then on offsets instead of bytes for arena-resident values.
//!
//! A `get` or `batch_get` that found anything is timed from its dispatch to its reply written,
//! one sample of the daemon's load meter ([`crate::inventory::load`]).

use super::{Hint, Shared};
use crate::arena::send_fd;
use crate::inventory::Served;
use crate::proto::{self, DecodedRequest, FrameError, PROTOCOL_VERSION, Request, Response};
use crate::store::{Got, Reservation};
use crate::wire::write_parts;
use bytes::{Bytes, BytesMut};
use std::io;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};
use tokio::net::UnixStream;
use tokio::net::unix::OwnedReadHalf;
use tokio::sync::OwnedSemaphorePermit;
use tokio_util::sync::CancellationToken;

/// The read buffer of a connection: small, since an idle connection keeps it, and a large
/// frame body is read straight into its own buffer anyway.
const READ_BUFFER: usize = 16 << 10;

/// What reading one frame produced.
enum Read {
    Frame(Bytes),
    Eof,
    /// No request began within the idle timeout.
    Idle,
    Broken(FrameError),
}

/// Reads one frame: waits up to `idle` for its first byte, then up to `whole` for the rest.
async fn read_frame(
    rd: &mut BufReader<OwnedReadHalf>,
    max: usize,
    idle: Option<Duration>,
    whole: Duration,
) -> io::Result<Read> {
    let started = match idle {
        Some(idle) => match tokio::time::timeout(idle, rd.fill_buf()).await {
            Ok(buf) => !buf?.is_empty(),
            Err(_) => return Ok(Read::Idle),
        },
        None => !rd.fill_buf().await?.is_empty(),
    };
    if !started {
        return Ok(Read::Eof);
    }
    let mut got = 0;
    let mut want = 4;
    let rest = read_started_frame(rd, max, &mut got, &mut want);
    match tokio::time::timeout(whole, rest).await {
        Ok(read) => read,
        Err(_) => Ok(Read::Broken(FrameError::TimedOut {
            got,
            want,
            after_ms: whole.as_millis() as u64,
        })),
    }
}

/// The rest of [`read_frame`], once a first byte is buffered; `got` and `want` track progress
/// (the length prefix, then the body) for the timeout's message.
async fn read_started_frame(
    rd: &mut BufReader<OwnedReadHalf>,
    max: usize,
    got: &mut usize,
    want: &mut usize,
) -> io::Result<Read> {
    let mut header = [0u8; 4];
    while *got < 4 {
        let n = rd.read(&mut header[*got..]).await?;
        if n == 0 {
            return Ok(Read::Broken(FrameError::Truncated { got: *got, want: 4 }));
        }
        *got += n;
    }
    let len = u32::from_be_bytes(header) as usize;
    if len > max {
        return Ok(Read::Broken(FrameError::TooLarge {
            len: len as u64,
            max,
        }));
    }
    *got = 0;
    *want = len;
    let mut body = BytesMut::with_capacity(len);
    while body.len() < len {
        // `read_buf` fills the spare capacity; `take` stops it at the frame's end.
        let left = len - body.len();
        let n = (&mut *rd).take(left as u64).read_buf(&mut body).await?;
        if n == 0 {
            return Ok(Read::Broken(FrameError::Truncated {
                got: body.len(),
                want: len,
            }));
        }
        *got = body.len();
    }
    Ok(Read::Frame(body.freeze()))
}

/// Answers a connection over `--max-connections` with an error frame and closes it. The
/// socket is fresh, so the small frame fits its buffer: a non-blocking write, never a wait.
pub(super) fn refuse(stream: &UnixStream, max: usize) {
    tracing::warn!(max, "kvd refused a connection: --max-connections reached");
    let reply = Response::error(
        "too_many_connections",
        format!(
            "the daemon already serves {max} connections (--max-connections); close idle \
             clients or raise the limit"
        ),
    );
    let frame: Vec<u8> = reply.encode(None).iter().flat_map(|p| p.to_vec()).collect();
    let _ = stream.try_write(&frame);
}

/// Per-connection state.
struct Conn {
    id: u64,
    /// The client mapped the arena: answer offsets where possible.
    arena: bool,
    /// What the request in hand served, for the load meter once its reply is written.
    served: Option<Served>,
}

/// Serves one connection; `_slot` is its place under `--max-connections`.
pub(super) async fn connection(
    stream: UnixStream,
    shared: Arc<Shared>,
    token: CancellationToken,
    id: u64,
    _slot: OwnedSemaphorePermit,
) {
    if shared.socket_buffer > 0 {
        let size = shared.socket_buffer;
        let _ = rustix::net::sockopt::set_socket_send_buffer_size(&stream, size);
        let _ = rustix::net::sockopt::set_socket_recv_buffer_size(&stream, size);
    }
    let (rd, mut wr) = stream.into_split();
    let mut rd = BufReader::with_capacity(READ_BUFFER, rd);
    let mut conn = Conn {
        id,
        arena: false,
        served: None,
    };
    loop {
        let read = tokio::select! {
            () = token.cancelled() => break,
            read = read_frame(&mut rd, shared.max_frame, shared.idle_timeout, shared.frame_timeout) => read,
        };
        let frame = match read {
            Ok(Read::Frame(frame)) => frame,
            Ok(Read::Eof) => break,
            Ok(Read::Idle) => {
                tracing::debug!(conn = conn.id, "kvd closing an idle connection");
                break;
            }
            Ok(Read::Broken(error)) => {
                tracing::debug!(%error, "kvd closing a connection on a broken frame");
                let reply = Response::error(error.code(), error.to_string());
                let _ = write_parts(&mut wr, &reply.encode(None)).await;
                break;
            }
            Err(error) => {
                tracing::debug!(%error, "kvd connection read failed");
                break;
            }
        };
        let started = std::time::Instant::now();
        let (id, reply, send_arena) = match proto::decode_request(&frame, shared.limits) {
            Ok(DecodedRequest { id, request }) => match request {
                Ok(request) => {
                    let hello_arena = matches!(
                        request,
                        Request::Hello {
                            prefers_shared_arena: true,
                            ..
                        }
                    ) && shared.store.arena().is_some();
                    let reply = dispatch(&shared, &mut conn, request).await;
                    (id, reply, hello_arena)
                }
                Err(error) => (id, Some(error.to_response()), false),
            },
            Err(error) => {
                let reply = Response::error(error.code(), error.to_string());
                let _ = write_parts(&mut wr, &reply.encode(None)).await;
                break;
            }
        };
        drop(frame);
        if let Some(reply) = reply
            && let Err(error) = write_parts(&mut wr, &reply.encode(id.as_ref())).await
        {
            tracing::debug!(%error, "kvd connection write failed");
            break;
        }
        if let Some(served) = conn.served.take() {
            shared.load.record(&served, started.elapsed());
        }
        if send_arena && let Some(arena) = shared.store.arena() {
            match send_fd(wr.as_ref(), arena.fd()).await {
                Ok(()) => conn.arena = true,
                Err(error) => {
                    tracing::warn!(%error, "kvd could not pass the arena descriptor; closing");
                    break;
                }
            }
        }
    }
    let released = shared.store.drop_connection(conn.id);
    if released > 0 {
        tracing::debug!(
            released,
            conn = conn.id,
            "kvd released the leases of a closed connection"
        );
    }
}

/// Answers one request; `None` for the one-way `prefetch_hint`.
async fn dispatch(shared: &Shared, conn: &mut Conn, request: Request) -> Option<Response> {
    let store = &shared.store;
    let now = shared.clock.now_ms();
    Some(match request {
        Request::Hello {
            client_id,
            protocol_version,
            prefers_shared_arena,
        } => {
            tracing::debug!(%client_id, protocol_version, prefers_shared_arena, "kvd hello");
            Response::HelloAck {
                server_id: shared.server_id.clone(),
                protocol_version: PROTOCOL_VERSION,
                shared_arena: store
                    .arena()
                    .filter(|_| prefers_shared_arena)
                    .map(|a| a.info()),
                kv_events_endpoint: shared.kv_events.as_ref().map(|(e, _)| e.clone()),
                kv_events_replay_endpoint: shared.kv_events.as_ref().and_then(|(_, r)| r.clone()),
            }
        }
        Request::Get { ns, key } => {
            let (mut got, served) = store
                .get_many_served(&ns, std::slice::from_ref(&key), now, conn.arena)
                .await;
            conn.served = Some(served);
            match got.pop().flatten() {
                Some(Got::Shared(slot, _)) => Response::GetShared(slot),
                Some(Got::Bytes(value, retention)) => Response::Get {
                    value: Some(value),
                    retention: Some(retention),
                },
                None => Response::Get {
                    value: None,
                    retention: None,
                },
            }
        }
        Request::BatchGet { ns, keys } => {
            let (got, served) = store.get_many_served(&ns, &keys, now, conn.arena).await;
            conn.served = Some(served);
            batch_get(shared, conn, got)
        }
        Request::Set { ns, item } => Response::SetAck(store.set(&ns, &item, now).await),
        Request::BatchSet { ns, items } => {
            Response::BatchSetAck(store.set_many(&ns, &items, now).await)
        }
        Request::SetReserve { size } => {
            let granted = if conn.arena {
                store.reserve(conn.id, size)
            } else {
                Err("no_arena")
            };
            match granted {
                Ok(Reservation {
                    lease_token,
                    slot_id,
                    payload_offset,
                    payload_max_size,
                }) => Response::SetReserve {
                    lease_token,
                    slot_id: i64::from(slot_id),
                    payload_offset,
                    payload_max_size,
                    reason: String::new(),
                },
                Err(reason) => Response::SetReserve {
                    lease_token: 0,
                    slot_id: -1,
                    payload_offset: 0,
                    payload_max_size: 0,
                    reason: reason.to_owned(),
                },
            }
        }
        Request::SetCommit {
            ns,
            lease_token,
            key,
            length,
            retention,
            ttl_seconds,
        } => {
            let (accepted, reason) = store
                .commit(
                    conn.id,
                    lease_token,
                    &ns,
                    &key,
                    length,
                    retention,
                    ttl_seconds,
                    now,
                )
                .await;
            Response::SetCommit { accepted, reason }
        }
        Request::SetCancel { lease_token } => {
            store.cancel(conn.id, lease_token);
            Response::SetCancel
        }
        Request::PrefetchHint {
            ns,
            keys,
            deadline_ms,
        } => {
            let deadline = tokio::time::Instant::now()
                + std::time::Duration::from_millis(deadline_ms.min(3_600_000));
            // Keys plus their handles, charged against the queue's byte budget.
            let cost = keys.iter().map(|k| k.len() + 32).sum::<usize>();
            let queued = u32::try_from(cost)
                .ok()
                .and_then(|cost| shared.hint_bytes.clone().try_acquire_many_owned(cost).ok())
                .is_some_and(|bytes| {
                    let hint = Hint {
                        ns,
                        keys,
                        deadline,
                        _bytes: bytes,
                    };
                    shared.hints.try_send(hint).is_ok()
                });
            store.note_hint(!queued);
            return None;
        }
        Request::Exists { ns, keys } => Response::Exists {
            present: store.exists(&ns, &keys, now),
        },
        Request::Clear { ns } => Response::Clear {
            cleared_entries: store.clear(&ns),
        },
        Request::Stats { extended } => Response::Stats(shared.stats().to_reply(extended)),
    })
}

fn batch_get(shared: &Shared, conn: &Conn, got: Vec<Option<Got>>) -> Response {
    let all_shared = got.iter().flatten().all(|g| matches!(g, Got::Shared(..)));
    if conn.arena && all_shared && got.iter().any(Option::is_some) {
        let slot_size = shared.store.arena().map_or(0, |a| a.slot_size());
        let slots = got
            .into_iter()
            .map(|g| match g {
                Some(Got::Shared(s, _)) => Some(s),
                _ => None,
            })
            .collect();
        return Response::BatchGetShared { slots, slot_size };
    }
    // Inline (or mixed placements): arena values go out pinned, not copied.
    let (values, retentions) = got
        .into_iter()
        .map(|g| match g {
            Some(Got::Bytes(v, r)) => (Some(v), Some(r)),
            Some(Got::Shared(s, v)) => {
                let retention = v.as_ref().and(s.retention);
                (v, retention)
            }
            None => (None, None),
        })
        .unzip();
    Response::BatchGet { values, retentions }
}
