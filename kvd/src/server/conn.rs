//! One client connection: read a frame, answer it, repeat.
//!
//! Frames are read straight into a buffer of their exact size (no intermediate copy for large
//! values, no zeroing) and replies are written with one `writev` of their parts, so a 1 MiB
//! value crosses the daemon without being copied. A client that said
//! `hello{prefers_shared_arena: true}` to a daemon with an arena gets the memfd right after
//! `hello_ack`, and from then on offsets instead of bytes for arena-resident values.

use super::{Hint, Shared};
use crate::arena::send_fd;
use crate::proto::{self, DecodedRequest, FrameError, PROTOCOL_VERSION, Request, Response};
use crate::store::{Got, Reservation};
use crate::wire::write_parts;
use bytes::{Bytes, BytesMut};
use std::io;
use std::sync::Arc;
use tokio::io::{AsyncReadExt, BufReader};
use tokio::net::UnixStream;
use tokio::net::unix::OwnedReadHalf;
use tokio_util::sync::CancellationToken;

/// What reading one frame produced.
enum Read {
    Frame(Bytes),
    Eof,
    Broken(FrameError),
}

async fn read_frame(rd: &mut BufReader<OwnedReadHalf>, max: usize) -> io::Result<Read> {
    let mut header = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        let n = rd.read(&mut header[got..]).await?;
        if n == 0 {
            return Ok(if got == 0 {
                Read::Eof
            } else {
                Read::Broken(FrameError::Truncated { got, want: 4 })
            });
        }
        got += n;
    }
    let len = u32::from_be_bytes(header) as usize;
    if len > max {
        return Ok(Read::Broken(FrameError::TooLarge {
            len: len as u64,
            max,
        }));
    }
    let mut body = BytesMut::with_capacity(len);
    while body.len() < len {
        // `read_buf` fills the spare capacity; `take` stops it at the frame's end.
        let want = len - body.len();
        let n = (&mut *rd).take(want as u64).read_buf(&mut body).await?;
        if n == 0 {
            return Ok(Read::Broken(FrameError::Truncated {
                got: body.len(),
                want: len,
            }));
        }
    }
    Ok(Read::Frame(body.freeze()))
}

/// Per-connection state.
struct Conn {
    id: u64,
    /// The client mapped the arena: answer offsets where possible.
    arena: bool,
}

pub(super) async fn connection(
    stream: UnixStream,
    shared: Arc<Shared>,
    token: CancellationToken,
    id: u64,
) {
    if shared.socket_buffer > 0 {
        let size = shared.socket_buffer;
        let _ = rustix::net::sockopt::set_socket_send_buffer_size(&stream, size);
        let _ = rustix::net::sockopt::set_socket_recv_buffer_size(&stream, size);
    }
    let (rd, mut wr) = stream.into_split();
    let mut rd = BufReader::with_capacity(64 << 10, rd);
    let mut conn = Conn { id, arena: false };
    loop {
        let read = tokio::select! {
            () = token.cancelled() => break,
            read = read_frame(&mut rd, shared.max_frame) => read,
        };
        let frame = match read {
            Ok(Read::Frame(frame)) => frame,
            Ok(Read::Eof) => break,
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
        let (id, reply, send_arena) = match proto::decode_request(&frame) {
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
            }
        }
        Request::Get { ns, key } => match store.get(&ns, &key, now, conn.arena).await {
            Some(Got::Shared(slot, _)) => Response::GetShared(slot),
            Some(Got::Bytes(value, retention)) => Response::Get {
                value: Some(value),
                retention: Some(retention),
            },
            None => Response::Get {
                value: None,
                retention: None,
            },
        },
        Request::BatchGet { ns, keys } => batch_get(shared, conn, &ns, &keys, now).await,
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
            let queued = shared.hints.try_send(Hint { ns, keys, deadline });
            store.note_hint(queued.is_err());
            return None;
        }
        Request::Exists { ns, keys } => Response::Exists {
            present: store.exists(&ns, &keys, now),
        },
        Request::Clear { ns } => Response::Clear {
            cleared_entries: store.clear(&ns),
        },
        Request::Stats { extended } => Response::Stats(store.stats().to_reply(extended)),
    })
}

async fn batch_get(
    shared: &Shared,
    conn: &Conn,
    ns: &crate::proto::Namespace,
    keys: &[Bytes],
    now: u64,
) -> Response {
    let got = shared.store.get_many(ns, keys, now, conn.arena).await;
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
