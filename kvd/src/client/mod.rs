//! [`KvdClient`]: an async client of the kvd wire protocol (ours or the Python daemon), used by
//! the tests, the benches and the router's prewarm. One connection, one request in flight per
//! call; the lower-level [`KvdClient::send`] / [`KvdClient::recv`] pipeline with `id`s.
//!
//! [`KvdClient::connect_shared`] negotiates the shared arena: the daemon's memfd arrives over
//! `SCM_RIGHTS` and is mapped ([`ClientArena`]); gets of arena-resident values then come back as
//! offsets ([`KvdClient::get_shared`] gives them to the caller for zero-copy use; [`KvdClient::get`]
//! copies the bytes out), and [`KvdClient::put`] writes through `set_reserve`/`set_commit`.
//!
//! After `hello` (or [`KvdClient::connect_shared`]) the client knows where the daemon publishes
//! its inventory, if it does ([`KvdClient::kv_events_endpoint`],
//! [`KvdClient::kv_events_replay_endpoint`]): what a worker launcher puts in its registration.
//!
//! Errors say whether to retry: a transport failure ([`ClientError::is_retryable`]) is worth a
//! reconnect and retry; a refusal or a protocol mismatch is not.

mod arena;

pub use arena::ClientArena;

use crate::arena::recv_fd;
use crate::proto::{
    self, DecodedResponse, Namespace, PROTOCOL_VERSION, Request, Response, SetAck, SetItem,
    SharedSlot, StatsReply,
};
use crate::wire::write_parts;
use bytes::{Bytes, BytesMut};
use infera_core::event::Retention;
use rmpv::Value;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio::io::{AsyncReadExt, BufReader};
use tokio::net::UnixStream;
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};

/// Why a call failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The daemon is not reachable at the path.
    #[error("cannot connect to kvd at {path}: {source}")]
    Connect { path: PathBuf, source: io::Error },
    /// The connection failed mid-call.
    #[error("kvd connection failed: {0}")]
    Io(#[from] io::Error),
    /// The daemon closed the connection.
    #[error("kvd closed the connection")]
    Closed,
    /// The daemon answered `error{code, message}`.
    #[error("kvd refused the request: {code}: {message}")]
    Server { code: String, message: String },
    /// The reply is not the documented one.
    #[error("kvd sent an unexpected reply: {0}")]
    Protocol(String),
}

impl ClientError {
    /// Whether reconnecting and retrying may succeed: transport failures and the daemon's
    /// internal errors yes; refusals of the request itself and protocol mismatches no.
    pub fn is_retryable(&self) -> bool {
        match self {
            ClientError::Connect { .. } | ClientError::Io(_) | ClientError::Closed => true,
            ClientError::Server { code, .. } => code == "internal_error",
            ClientError::Protocol(_) => false,
        }
    }
}

/// `hello_ack`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HelloAck {
    pub server_id: String,
    pub protocol_version: u64,
    /// `[arena_size, slot_size, server_pid]` when a shared arena is offered.
    pub shared_arena: Option<[u64; 3]>,
    /// Where the daemon publishes its inventory (ours; `None` when it does not, or for the
    /// Python kvd).
    pub kv_events_endpoint: Option<String>,
    /// The replay socket of that publication.
    pub kv_events_replay_endpoint: Option<String>,
}

impl HelloAck {
    fn from_response(response: Response) -> Result<Self, ClientError> {
        match response {
            Response::HelloAck {
                server_id,
                protocol_version,
                shared_arena,
                kv_events_endpoint,
                kv_events_replay_endpoint,
            } => Ok(HelloAck {
                server_id,
                protocol_version,
                shared_arena,
                kv_events_endpoint,
                kv_events_replay_endpoint,
            }),
            Response::Error { code, message } => Err(ClientError::Server { code, message }),
            other => Err(unexpected("hello_ack", &other)),
        }
    }
}

/// A hit: the bytes and their class.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hit {
    pub value: Bytes,
    pub retention: Option<Retention>,
}

/// `set_reserve_response`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reservation {
    /// 0 when refused.
    pub lease_token: u64,
    pub slot_id: i64,
    pub payload_offset: u64,
    pub payload_max_size: u64,
    /// Why it was refused (`no_arena`, ...); empty when granted.
    pub reason: String,
}

/// What [`KvdClient::get_shared`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SharedGet {
    /// An arena slot: read it with [`ClientArena::read`] or [`ClientArena::copy`].
    Slot(SharedSlot),
    /// A value the daemon sent inline (not arena-resident).
    Inline(Hit),
}

/// See the module docs.
#[derive(Debug)]
pub struct KvdClient {
    rd: BufReader<OwnedReadHalf>,
    wr: OwnedWriteHalf,
    max_frame: usize,
    arena: Option<Arc<ClientArena>>,
    /// A lease taken ahead by [`KvdClient::put`].
    spare: Option<Reservation>,
    /// The last `hello_ack`'s inventory endpoints.
    kv_events: (Option<String>, Option<String>),
}

impl KvdClient {
    /// Connects to the daemon at `path`.
    ///
    /// # Errors
    /// [`ClientError::Connect`].
    pub async fn connect(path: impl AsRef<Path>) -> Result<Self, ClientError> {
        let path = path.as_ref();
        let stream = UnixStream::connect(path)
            .await
            .map_err(|source| ClientError::Connect {
                path: path.to_path_buf(),
                source,
            })?;
        Ok(Self::from_stream(stream, None))
    }

    fn from_stream(stream: UnixStream, arena: Option<Arc<ClientArena>>) -> Self {
        let _ = rustix::net::sockopt::set_socket_send_buffer_size(&stream, 4 << 20);
        let _ = rustix::net::sockopt::set_socket_recv_buffer_size(&stream, 4 << 20);
        let (rd, wr) = stream.into_split();
        Self {
            rd: BufReader::with_capacity(64 << 10, rd),
            wr,
            max_frame: usize::MAX,
            arena,
            spare: None,
            kv_events: (None, None),
        }
    }

    /// Connects and says `hello{prefers_shared_arena: true}`; when the daemon offers its arena,
    /// receives and maps it. The handshake is read unbuffered, so the descriptor that follows
    /// `hello_ack` is not swallowed.
    ///
    /// # Errors
    /// [`ClientError::Connect`], a transport error, or [`ClientError::Protocol`] when the
    /// reply or the descriptor is not the documented one.
    pub async fn connect_shared(
        path: impl AsRef<Path>,
        client_id: &str,
    ) -> Result<(Self, HelloAck), ClientError> {
        let path = path.as_ref();
        let mut stream =
            UnixStream::connect(path)
                .await
                .map_err(|source| ClientError::Connect {
                    path: path.to_path_buf(),
                    source,
                })?;
        let hello = Request::Hello {
            client_id: client_id.to_owned(),
            protocol_version: PROTOCOL_VERSION,
            prefers_shared_arena: true,
        };
        write_parts(&mut stream, &hello.encode(None)).await?;
        let mut header = [0u8; 4];
        stream.read_exact(&mut header).await?;
        let mut body = vec![0u8; u32::from_be_bytes(header) as usize];
        stream.read_exact(&mut body).await?;
        let reply = proto::decode_response(&Bytes::from(body))
            .map_err(|e| ClientError::Protocol(e.to_string()))?;
        let ack = HelloAck::from_response(reply.response)?;
        let arena = match ack.shared_arena {
            Some(info) => {
                let fd = recv_fd(&stream).await?;
                Some(Arc::new(ClientArena::open(fd, info).map_err(|e| {
                    ClientError::Protocol(format!("cannot map the shared arena: {e}"))
                })?))
            }
            None => None,
        };
        let mut client = Self::from_stream(stream, arena);
        client.kv_events = (
            ack.kv_events_endpoint.clone(),
            ack.kv_events_replay_endpoint.clone(),
        );
        Ok((client, ack))
    }

    /// Where the daemon publishes its inventory as KV events (`tcp://HOST:PORT`, as bound: a
    /// wildcard host means this host), as its last `hello_ack` said; `None` before `hello`, or
    /// when it does not publish.
    pub fn kv_events_endpoint(&self) -> Option<&str> {
        self.kv_events.0.as_deref()
    }

    /// The replay socket of that publication, as its last `hello_ack` said.
    pub fn kv_events_replay_endpoint(&self) -> Option<&str> {
        self.kv_events.1.as_deref()
    }

    /// The mapped arena, after [`KvdClient::connect_shared`] got one.
    pub fn arena(&self) -> Option<&ClientArena> {
        self.arena.as_deref()
    }

    /// The mapped arena as a shared handle, for views that may outlive this connection (the
    /// mapping stays valid while any handle lives; slots read through it still validate).
    pub fn arena_handle(&self) -> Option<Arc<ClientArena>> {
        self.arena.clone()
    }

    /// Sends one request without waiting for its reply.
    ///
    /// # Errors
    /// [`ClientError::Io`].
    pub async fn send(&mut self, request: &Request, id: Option<&Value>) -> Result<(), ClientError> {
        write_parts(&mut self.wr, &request.encode(id)).await?;
        Ok(())
    }

    /// Reads the next reply.
    ///
    /// # Errors
    /// [`ClientError::Closed`], [`ClientError::Io`] or [`ClientError::Protocol`].
    pub async fn recv(&mut self) -> Result<DecodedResponse, ClientError> {
        let mut header = [0u8; 4];
        match self.rd.read_exact(&mut header).await {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Err(ClientError::Closed),
            Err(e) => return Err(e.into()),
        }
        let len = u32::from_be_bytes(header) as usize;
        if len > self.max_frame {
            return Err(ClientError::Protocol(format!("a reply of {len} bytes")));
        }
        let mut body = BytesMut::with_capacity(len);
        while body.len() < len {
            let want = (len - body.len()) as u64;
            if (&mut self.rd).take(want).read_buf(&mut body).await? == 0 {
                return Err(ClientError::Closed);
            }
        }
        proto::decode_response(&body.freeze()).map_err(|e| ClientError::Protocol(e.to_string()))
    }

    async fn call(&mut self, request: Request) -> Result<Response, ClientError> {
        self.send(&request, None).await?;
        match self.recv().await?.response {
            Response::Error { code, message } => Err(ClientError::Server { code, message }),
            response => Ok(response),
        }
    }

    /// `hello`; remembers the inventory endpoints it names
    /// ([`KvdClient::kv_events_endpoint`]).
    pub async fn hello(&mut self, client_id: &str) -> Result<HelloAck, ClientError> {
        let reply = self
            .call(Request::Hello {
                client_id: client_id.to_owned(),
                protocol_version: PROTOCOL_VERSION,
                prefers_shared_arena: false,
            })
            .await?;
        let ack = HelloAck::from_response(reply)?;
        self.kv_events = (
            ack.kv_events_endpoint.clone(),
            ack.kv_events_replay_endpoint.clone(),
        );
        Ok(ack)
    }

    /// `get`: the value, or `None` on a miss.
    pub async fn get(&mut self, ns: &Namespace, key: &[u8]) -> Result<Option<Hit>, ClientError> {
        let request = Request::Get {
            ns: ns.clone(),
            key: Bytes::copy_from_slice(key),
        };
        match self.call(request).await? {
            Response::Get { value, retention } => Ok(value.map(|value| Hit { value, retention })),
            Response::GetShared(slot) => Ok(self.copy_slot(&slot)),
            other => Err(unexpected("get_response", &other)),
        }
    }

    fn copy_slot(&self, slot: &SharedSlot) -> Option<Hit> {
        let value = self.arena.as_ref()?.copy(slot)?;
        Some(Hit {
            value,
            retention: slot.retention,
        })
    }

    /// `get` for zero-copy use: the arena slot when the value is arena-resident (validate it
    /// with [`ClientArena::read`]), else the inline value.
    pub async fn get_shared(
        &mut self,
        ns: &Namespace,
        key: &[u8],
    ) -> Result<Option<SharedGet>, ClientError> {
        let request = Request::Get {
            ns: ns.clone(),
            key: Bytes::copy_from_slice(key),
        };
        match self.call(request).await? {
            Response::Get { value, retention } => {
                Ok(value.map(|value| SharedGet::Inline(Hit { value, retention })))
            }
            Response::GetShared(slot) => Ok(Some(SharedGet::Slot(slot))),
            other => Err(unexpected("get_response", &other)),
        }
    }

    /// Writes through the arena when one is mapped (`set_reserve`, copy, `set_commit`), else
    /// (or when the daemon refuses the lease) with an inline `set`. A TTL is whole seconds here,
    /// as `set_commit` carries it.
    ///
    /// The commit travels with the `set_reserve` of the next put (same size) in one round trip,
    /// so a steady stream of puts costs one round trip and one copy each; the spare lease is
    /// held by this connection (and released with it).
    pub async fn put(
        &mut self,
        ns: &Namespace,
        key: Bytes,
        value: &[u8],
        retention: Retention,
        ttl_seconds: Option<u64>,
    ) -> Result<SetAck, ClientError> {
        let len = value.len() as u64;
        if self.arena.is_some() {
            let lease = match self.spare.take() {
                Some(spare) if spare.payload_max_size >= len => spare,
                other => {
                    if let Some(unfit) = other {
                        self.set_cancel(unfit.lease_token).await?;
                    }
                    self.set_reserve(len).await?
                }
            };
            if lease.lease_token != 0 {
                let written = self
                    .arena
                    .as_ref()
                    .map(|a| a.write(lease.payload_offset, lease.payload_max_size, value));
                if let Some(Err(e)) = written {
                    self.set_cancel(lease.lease_token).await?;
                    return Err(ClientError::Protocol(e.to_string()));
                }
                let commit = Request::SetCommit {
                    ns: ns.clone(),
                    lease_token: lease.lease_token,
                    key,
                    length: len,
                    retention,
                    ttl_seconds: ttl_seconds.unwrap_or(0),
                };
                let mut parts = commit.encode(None);
                parts.extend(Request::SetReserve { size: len }.encode(None));
                write_parts(&mut self.wr, &parts).await?;
                let ack = match self.recv().await?.response {
                    Response::SetCommit { accepted, reason } => SetAck {
                        accepted,
                        reason: (!reason.is_empty()).then_some(reason),
                    },
                    Response::Error { code, message } => {
                        return Err(ClientError::Server { code, message });
                    }
                    other => return Err(unexpected("set_commit_response", &other)),
                };
                if let Response::SetReserve {
                    lease_token,
                    slot_id,
                    payload_offset,
                    payload_max_size,
                    reason,
                } = self.recv().await?.response
                    && lease_token != 0
                {
                    self.spare = Some(Reservation {
                        lease_token,
                        slot_id,
                        payload_offset,
                        payload_max_size,
                        reason,
                    });
                }
                return Ok(ack);
            }
        }
        let mut item = SetItem::new(key, Bytes::copy_from_slice(value)).retention(retention);
        if let Some(ttl) = ttl_seconds {
            item = item.ttl_seconds(ttl as f64);
        }
        self.set(ns, item).await
    }

    /// `batch_get`: one result per key, in order.
    pub async fn batch_get(
        &mut self,
        ns: &Namespace,
        keys: Vec<Bytes>,
    ) -> Result<Vec<Option<Hit>>, ClientError> {
        let n = keys.len();
        match self
            .call(Request::BatchGet {
                ns: ns.clone(),
                keys,
            })
            .await?
        {
            Response::BatchGet { values, retentions } if values.len() == n => Ok(values
                .into_iter()
                .zip(retentions.into_iter().chain(std::iter::repeat(None)))
                .map(|(v, retention)| v.map(|value| Hit { value, retention }))
                .collect()),
            Response::BatchGetShared { slots, .. } if slots.len() == n => Ok(slots
                .iter()
                .map(|s| s.as_ref().and_then(|s| self.copy_slot(s)))
                .collect()),
            other => Err(unexpected("batch_get_response", &other)),
        }
    }

    /// `batch_get` for zero-copy use: per key, the arena slot or the inline value (as
    /// [`KvdClient::get_shared`]), or `None` on a miss.
    pub async fn batch_get_shared(
        &mut self,
        ns: &Namespace,
        keys: Vec<Bytes>,
    ) -> Result<Vec<Option<SharedGet>>, ClientError> {
        let n = keys.len();
        match self
            .call(Request::BatchGet {
                ns: ns.clone(),
                keys,
            })
            .await?
        {
            Response::BatchGet { values, retentions } if values.len() == n => Ok(values
                .into_iter()
                .zip(retentions.into_iter().chain(std::iter::repeat(None)))
                .map(|(v, retention)| v.map(|value| SharedGet::Inline(Hit { value, retention })))
                .collect()),
            Response::BatchGetShared { slots, .. } if slots.len() == n => {
                Ok(slots.into_iter().map(|s| s.map(SharedGet::Slot)).collect())
            }
            other => Err(unexpected("batch_get_response", &other)),
        }
    }

    /// `set`.
    pub async fn set(&mut self, ns: &Namespace, item: SetItem) -> Result<SetAck, ClientError> {
        match self
            .call(Request::Set {
                ns: ns.clone(),
                item,
            })
            .await?
        {
            Response::SetAck(ack) => Ok(ack),
            other => Err(unexpected("set_ack", &other)),
        }
    }

    /// `batch_set`: one ack per item, in order.
    pub async fn batch_set(
        &mut self,
        ns: &Namespace,
        items: Vec<SetItem>,
    ) -> Result<Vec<SetAck>, ClientError> {
        let n = items.len();
        match self
            .call(Request::BatchSet {
                ns: ns.clone(),
                items,
            })
            .await?
        {
            Response::BatchSetAck(acks) if acks.len() == n => Ok(acks),
            other => Err(unexpected("batch_set_ack", &other)),
        }
    }

    /// `exists`: one flag per key, in order.
    pub async fn exists(
        &mut self,
        ns: &Namespace,
        keys: Vec<Bytes>,
    ) -> Result<Vec<bool>, ClientError> {
        let n = keys.len();
        match self
            .call(Request::Exists {
                ns: ns.clone(),
                keys,
            })
            .await?
        {
            Response::Exists { present } if present.len() == n => Ok(present),
            other => Err(unexpected("exists_response", &other)),
        }
    }

    /// `clear`: the namespace, or everything for the empty namespace. Returns entries dropped.
    pub async fn clear(&mut self, ns: &Namespace) -> Result<u64, ClientError> {
        match self.call(Request::Clear { ns: ns.clone() }).await? {
            Response::Clear { cleared_entries } => Ok(cleared_entries),
            other => Err(unexpected("clear_ack", &other)),
        }
    }

    /// `stats`; `extended` asks for our additional counters (the Python daemon ignores it).
    pub async fn stats(&mut self, extended: bool) -> Result<StatsReply, ClientError> {
        match self.call(Request::Stats { extended }).await? {
            Response::Stats(stats) => Ok(stats),
            other => Err(unexpected("stats_response", &other)),
        }
    }

    /// `prefetch_hint`: one-way, nothing is read back.
    pub async fn prefetch_hint(
        &mut self,
        ns: &Namespace,
        keys: Vec<Bytes>,
        deadline_ms: u64,
    ) -> Result<(), ClientError> {
        let request = Request::PrefetchHint {
            ns: ns.clone(),
            keys,
            deadline_ms,
        };
        self.send(&request, None).await
    }

    /// `set_reserve` (shared arena).
    pub async fn set_reserve(&mut self, size: u64) -> Result<Reservation, ClientError> {
        match self.call(Request::SetReserve { size }).await? {
            Response::SetReserve {
                lease_token,
                slot_id,
                payload_offset,
                payload_max_size,
                reason,
            } => Ok(Reservation {
                lease_token,
                slot_id,
                payload_offset,
                payload_max_size,
                reason,
            }),
            other => Err(unexpected("set_reserve_response", &other)),
        }
    }

    /// `set_commit` (shared arena): `(accepted, reason)`.
    pub async fn set_commit(
        &mut self,
        ns: &Namespace,
        lease_token: u64,
        key: Bytes,
        length: u64,
        retention: Retention,
        ttl_seconds: u64,
    ) -> Result<(bool, String), ClientError> {
        let request = Request::SetCommit {
            ns: ns.clone(),
            lease_token,
            key,
            length,
            retention,
            ttl_seconds,
        };
        match self.call(request).await? {
            Response::SetCommit { accepted, reason } => Ok((accepted, reason)),
            other => Err(unexpected("set_commit_response", &other)),
        }
    }

    /// `set_cancel` (shared arena).
    pub async fn set_cancel(&mut self, lease_token: u64) -> Result<(), ClientError> {
        match self.call(Request::SetCancel { lease_token }).await? {
            Response::SetCancel => Ok(()),
            other => Err(unexpected("set_cancel_response", &other)),
        }
    }
}

fn unexpected(want: &str, got: &Response) -> ClientError {
    ClientError::Protocol(format!("expected {want}, got {}", got.op()))
}
