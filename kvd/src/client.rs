//! [`KvdClient`]: an async client of the kvd wire protocol (ours or the Python daemon), used by
//! the tests and by the router's prewarm. One connection, one request in flight per call; the
//! lower-level [`KvdClient::send`] / [`KvdClient::recv`] pipeline with `id`s.
//!
//! Errors say whether to retry: a transport failure ([`ClientError::is_retryable`]) is worth a
//! reconnect and retry; a refusal or a protocol mismatch is not.

use crate::proto::{
    self, DecodedResponse, Namespace, PROTOCOL_VERSION, Request, Response, SetAck, SetItem,
    StatsReply,
};
use bytes::{Bytes, BytesMut};
use infera_core::event::Retention;
use rmpv::Value;
use std::io;
use std::path::{Path, PathBuf};
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader, BufWriter};
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

/// See the module docs.
#[derive(Debug)]
pub struct KvdClient {
    rd: BufReader<OwnedReadHalf>,
    wr: BufWriter<OwnedWriteHalf>,
    max_frame: usize,
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
        let (rd, wr) = stream.into_split();
        Ok(Self {
            rd: BufReader::with_capacity(64 << 10, rd),
            wr: BufWriter::with_capacity(64 << 10, wr),
            max_frame: usize::MAX,
        })
    }

    /// Sends one request without waiting for its reply.
    ///
    /// # Errors
    /// [`ClientError::Io`].
    pub async fn send(&mut self, request: &Request, id: Option<&Value>) -> Result<(), ClientError> {
        for part in request.encode(id) {
            self.wr.write_all(&part).await?;
        }
        self.wr.flush().await?;
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
        let mut body = BytesMut::zeroed(len);
        match self.rd.read_exact(&mut body).await {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Err(ClientError::Closed),
            Err(e) => return Err(e.into()),
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

    /// `hello`.
    pub async fn hello(&mut self, client_id: &str) -> Result<HelloAck, ClientError> {
        match self
            .call(Request::Hello {
                client_id: client_id.to_owned(),
                protocol_version: PROTOCOL_VERSION,
                prefers_shared_arena: false,
            })
            .await?
        {
            Response::HelloAck {
                server_id,
                protocol_version,
                shared_arena,
            } => Ok(HelloAck {
                server_id,
                protocol_version,
                shared_arena,
            }),
            other => Err(unexpected("hello_ack", &other)),
        }
    }

    /// `get`: the value, or `None` on a miss.
    pub async fn get(&mut self, ns: &Namespace, key: &[u8]) -> Result<Option<Hit>, ClientError> {
        let request = Request::Get {
            ns: ns.clone(),
            key: Bytes::copy_from_slice(key),
        };
        match self.call(request).await? {
            Response::Get { value, retention } => Ok(value.map(|value| Hit { value, retention })),
            other => Err(unexpected("get_response", &other)),
        }
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
