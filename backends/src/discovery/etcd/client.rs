//! A small etcd v3 gRPC client: the RPCs of [`super::proto`] over tonic's HTTP/2 channel.
//!
//! # Members and failover
//!
//! The client holds one lazily connected channel per endpoint (each reconnects by itself) and a
//! preferred member, at first the first endpoint. Every call, and every stream opening, goes to
//! the preferred member; if that attempt fails in a way another member might not (connection
//! refused or reset, `Unavailable`, no answer within the request timeout, …) the next member is
//! tried, and so on once round the list. The member that answers becomes the preferred one. A
//! refusal that any member would repeat (`InvalidArgument`, `PermissionDenied`, lease not found,
//! …) is returned at once. Each attempt has its own deadline, so a call takes at most
//! `members × request_timeout`.
//!
//! Every request carries the `hasleader: true` metadata, so a member cut off from its cluster's
//! leader refuses it (and a watch on it is cancelled) instead of serving stale data.
//!
//! # Streams
//!
//! Watch and lease keepalive are bidirectional streams. Their requests travel through a bounded
//! channel whose first message is queued before the call, because etcd answers (and sends its
//! response headers) only once it has read a request.

use super::endpoint::EtcdEndpoint;
use super::proto::{
    CompactionRequest, CompactionResponse, LeaseGrantRequest, LeaseGrantResponse,
    LeaseKeepAliveRequest, LeaseKeepAliveResponse, LeaseRevokeRequest, LeaseRevokeResponse,
    PutRequest, PutResponse, RangeRequest, RangeResponse, WatchCreateRequest, WatchRequest,
    WatchRequestUnion, WatchResponse,
};
use http::uri::PathAndQuery;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use thiserror::Error;
use tokio::sync::mpsc;
use tonic::client::Grpc;
use tonic::transport::{Channel, ClientTlsConfig, Endpoint};
use tonic::{Code, Status, Streaming};

/// Largest response accepted (a range of a large fleet); tonic's default is 4 MiB.
const MAX_RESPONSE_BYTES: usize = 64 << 20;
/// Keepalive requests queued before the stream counts as stuck.
const KEEPALIVE_QUEUE: usize = 4;

/// A failed etcd call.
#[derive(Debug, Clone, Error)]
pub enum EtcdError {
    /// The member answered with a gRPC error status.
    #[error("etcd {op} at {endpoint}: {code:?}: {message}")]
    Status {
        op: &'static str,
        endpoint: String,
        code: Code,
        message: String,
    },
    /// The member did not answer in time.
    #[error("etcd {op} at {endpoint}: no answer within {timeout:?}")]
    Timeout {
        op: &'static str,
        endpoint: String,
        timeout: Duration,
    },
    /// A stream's request side is closed or stuck.
    #[error("etcd {op}: {message}")]
    Stream { op: &'static str, message: String },
    /// The client could not be set up for an endpoint.
    #[error("etcd endpoint {endpoint}: {message}")]
    Setup { endpoint: String, message: String },
}

impl EtcdError {
    fn status(op: &'static str, endpoint: &EtcdEndpoint, status: &Status) -> Self {
        Self::Status {
            op,
            endpoint: endpoint.url(),
            code: status.code(),
            message: with_causes(status.message(), std::error::Error::source(status)),
        }
    }

    /// Whether repeating the request (on any member) cannot help.
    pub fn is_final(&self) -> bool {
        match self {
            Self::Status { code, .. } => matches!(
                code,
                Code::InvalidArgument
                    | Code::NotFound
                    | Code::AlreadyExists
                    | Code::PermissionDenied
                    | Code::FailedPrecondition
                    | Code::OutOfRange
                    | Code::Unimplemented
                    | Code::Unauthenticated
            ),
            Self::Setup { .. } => true,
            Self::Timeout { .. } | Self::Stream { .. } => false,
        }
    }

    /// Whether the server says the lease does not exist (revoked or expired).
    pub fn is_lease_not_found(&self) -> bool {
        matches!(self, Self::Status { code: Code::NotFound, message, .. } if message.contains("lease not found"))
    }
}

/// How the channels are built.
#[derive(Debug, Clone)]
pub struct ClientOptions {
    /// Bound on connecting and on each attempt of a unary call or stream opening.
    pub request_timeout: Duration,
    /// HTTP/2 ping interval, and how long an unanswered ping may wait before the connection is
    /// dropped.
    pub http2_keepalive: Duration,
}

struct Member {
    endpoint: EtcdEndpoint,
    channel: Channel,
}

/// An etcd v3 client over one or more members. Cheap to clone; clones share the channels.
#[derive(Clone)]
pub struct EtcdClient {
    members: Arc<[Member]>,
    preferred: Arc<AtomicUsize>,
    request_timeout: Duration,
}

impl std::fmt::Debug for EtcdClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let urls: Vec<_> = self.members.iter().map(|m| m.endpoint.url()).collect();
        f.debug_struct("EtcdClient")
            .field("members", &urls)
            .finish_non_exhaustive()
    }
}

impl EtcdClient {
    /// Prepares channels to `endpoints`; nothing is dialled until the first call. Must be called
    /// within a tokio runtime.
    ///
    /// # Errors
    /// [`EtcdError::Setup`] for an empty list or an endpoint tonic cannot use.
    pub fn new(endpoints: &[EtcdEndpoint], options: &ClientOptions) -> Result<Self, EtcdError> {
        if endpoints.is_empty() {
            return Err(EtcdError::Setup {
                endpoint: "(none)".to_owned(),
                message: "no endpoint given".to_owned(),
            });
        }
        let members = endpoints
            .iter()
            .map(|endpoint| {
                let setup = |message: String| EtcdError::Setup {
                    endpoint: endpoint.url(),
                    message,
                };
                let mut builder = Endpoint::from_shared(endpoint.url())
                    .map_err(|e| setup(e.to_string()))?
                    .connect_timeout(options.request_timeout)
                    .http2_keep_alive_interval(options.http2_keepalive)
                    .keep_alive_timeout(options.http2_keepalive)
                    .keep_alive_while_idle(true);
                if endpoint.tls() {
                    // The system's roots (honouring SSL_CERT_FILE / SSL_CERT_DIR), like the
                    // Python client; the name checked is the endpoint's host.
                    builder = builder
                        .tls_config(ClientTlsConfig::new().with_native_roots())
                        .map_err(|e| setup(format!("TLS setup: {e}")))?;
                }
                Ok(Member {
                    endpoint: endpoint.clone(),
                    channel: builder.connect_lazy(),
                })
            })
            .collect::<Result<Vec<_>, EtcdError>>()?;
        Ok(Self {
            members: members.into(),
            preferred: Arc::new(AtomicUsize::new(0)),
            request_timeout: options.request_timeout,
        })
    }

    /// The member calls go to first.
    pub fn preferred_endpoint(&self) -> &EtcdEndpoint {
        &self.members[self.preferred.load(Ordering::Relaxed) % self.members.len()].endpoint
    }

    /// The key-values in `[key, range_end)` (only `key` if `range_end` is empty), with the store
    /// revision.
    ///
    /// # Errors
    /// [`EtcdError`] from the last member tried.
    pub async fn range(&self, key: &[u8], range_end: &[u8]) -> Result<RangeResponse, EtcdError> {
        let request = RangeRequest {
            key: key.to_vec(),
            range_end: range_end.to_vec(),
        };
        self.unary("range", "/etcdserverpb.KV/Range", request).await
    }

    /// Puts `value` under `key`, attached to `lease` (0 for none).
    ///
    /// # Errors
    /// [`EtcdError`] from the last member tried.
    pub async fn put(
        &self,
        key: &[u8],
        value: &[u8],
        lease: i64,
    ) -> Result<PutResponse, EtcdError> {
        let request = PutRequest {
            key: key.to_vec(),
            value: value.to_vec(),
            lease,
        };
        self.unary("put", "/etcdserverpb.KV/Put", request).await
    }

    /// Compacts the history up to `revision` and waits until it is applied.
    ///
    /// # Errors
    /// [`EtcdError`] from the last member tried.
    pub async fn compact(&self, revision: i64) -> Result<CompactionResponse, EtcdError> {
        let request = CompactionRequest {
            revision,
            physical: true,
        };
        self.unary("compact", "/etcdserverpb.KV/Compact", request)
            .await
    }

    /// Grants a lease of `ttl_secs`; returns its id.
    ///
    /// # Errors
    /// [`EtcdError`] from the last member tried, or the server's refusal.
    pub async fn lease_grant(&self, ttl_secs: i64) -> Result<i64, EtcdError> {
        let request = LeaseGrantRequest {
            ttl: ttl_secs,
            id: 0,
        };
        let response: LeaseGrantResponse = self
            .unary("lease grant", "/etcdserverpb.Lease/LeaseGrant", request)
            .await?;
        if !response.error.is_empty() {
            return Err(EtcdError::Status {
                op: "lease grant",
                endpoint: self.preferred_endpoint().url(),
                code: Code::FailedPrecondition,
                message: response.error,
            });
        }
        Ok(response.id)
    }

    /// Revokes `lease`, deleting every key attached to it.
    ///
    /// # Errors
    /// [`EtcdError`] from the last member tried; `NotFound` for an unknown lease.
    pub async fn lease_revoke(&self, lease: i64) -> Result<LeaseRevokeResponse, EtcdError> {
        let request = LeaseRevokeRequest { id: lease };
        self.unary("lease revoke", "/etcdserverpb.Lease/LeaseRevoke", request)
            .await
    }

    /// Opens a keepalive stream for `lease` and sends the first renewal; its answer is the
    /// stream's first message.
    ///
    /// # Errors
    /// [`EtcdError`] from the last member tried.
    pub async fn lease_keep_alive(
        &self,
        lease: i64,
    ) -> Result<(LeaseKeeper, ResponseStream<LeaseKeepAliveResponse>), EtcdError> {
        let first = LeaseKeepAliveRequest { id: lease };
        let (tx, responses) = self
            .bidi(
                "lease keepalive",
                "/etcdserverpb.Lease/LeaseKeepAlive",
                first,
                KEEPALIVE_QUEUE,
            )
            .await?;
        Ok((LeaseKeeper { lease, tx }, responses))
    }

    /// Opens a watch stream with `create`; the stream's first message confirms the creation.
    ///
    /// # Errors
    /// [`EtcdError`] from the last member tried.
    pub async fn watch(
        &self,
        create: WatchCreateRequest,
    ) -> Result<ResponseStream<WatchResponse>, EtcdError> {
        let first = WatchRequest {
            request_union: Some(WatchRequestUnion::CreateRequest(create)),
        };
        let (tx, mut responses) = self
            .bidi("watch", "/etcdserverpb.Watch/Watch", first, 1)
            .await?;
        // Nothing more is sent; the request side stays open for the stream's lifetime, as etcd's
        // own clients keep it, so that the server never sees a half-closed watch.
        responses.requests = Some(Box::new(tx));
        Ok(responses)
    }

    async fn unary<Req, Resp>(
        &self,
        op: &'static str,
        path: &'static str,
        request: Req,
    ) -> Result<Resp, EtcdError>
    where
        Req: prost::Message + Clone + 'static,
        Resp: prost::Message + Default + 'static,
    {
        let (response, _) = self
            .with_failover(op, |channel| {
                let request = request.clone();
                async move {
                    let mut grpc = grpc(channel);
                    ready(&mut grpc).await?;
                    let response = grpc
                        .unary(
                            tagged(request),
                            PathAndQuery::from_static(path),
                            tonic_prost::ProstCodec::default(),
                        )
                        .await?;
                    Ok(response.into_inner())
                }
            })
            .await?;
        Ok(response)
    }

    async fn bidi<Req, Resp>(
        &self,
        op: &'static str,
        path: &'static str,
        first: Req,
        queue: usize,
    ) -> Result<(mpsc::Sender<Req>, ResponseStream<Resp>), EtcdError>
    where
        Req: prost::Message + Clone + 'static,
        Resp: prost::Message + Default + 'static,
    {
        let ((tx, inner), endpoint) = self
            .with_failover(op, |channel| {
                let first = first.clone();
                async move {
                    let (tx, rx) = mpsc::channel(queue);
                    tx.try_send(first).map_err(|_| {
                        Status::internal("the request queue refused the first message")
                    })?;
                    let outbound = futures::stream::unfold(rx, |mut rx| async move {
                        rx.recv().await.map(|message| (message, rx))
                    });
                    let mut grpc = grpc(channel);
                    ready(&mut grpc).await?;
                    let response = grpc
                        .streaming(
                            tagged(outbound),
                            PathAndQuery::from_static(path),
                            tonic_prost::ProstCodec::default(),
                        )
                        .await?;
                    Ok((tx, response.into_inner()))
                }
            })
            .await?;
        let stream = ResponseStream {
            op,
            endpoint,
            inner,
            requests: None,
        };
        Ok((tx, stream))
    }

    /// Runs `attempt` on the preferred member, then on the others in turn while the failure is
    /// one another member might not repeat; returns the result and the member that gave it.
    async fn with_failover<T, F, Fut>(
        &self,
        op: &'static str,
        attempt: F,
    ) -> Result<(T, EtcdEndpoint), EtcdError>
    where
        F: Fn(Channel) -> Fut,
        Fut: Future<Output = Result<T, Status>>,
    {
        let count = self.members.len();
        let first = self.preferred.load(Ordering::Relaxed) % count;
        let mut last = None;
        for step in 0..count {
            let index = (first + step) % count;
            let member = &self.members[index];
            let outcome =
                tokio::time::timeout(self.request_timeout, attempt(member.channel.clone())).await;
            let error = match outcome {
                Ok(Ok(value)) => {
                    if index != first {
                        self.preferred.store(index, Ordering::Relaxed);
                        tracing::info!(endpoint = %member.endpoint, op, "etcd: now using this member");
                    }
                    return Ok((value, member.endpoint.clone()));
                }
                Ok(Err(status)) => EtcdError::status(op, &member.endpoint, &status),
                Err(_) => EtcdError::Timeout {
                    op,
                    endpoint: member.endpoint.url(),
                    timeout: self.request_timeout,
                },
            };
            if error.is_final() {
                return Err(error);
            }
            if step + 1 < count {
                tracing::warn!(error = %error, "etcd: member failed; trying the next one");
            }
            last = Some(error);
        }
        Err(last.unwrap_or(EtcdError::Setup {
            endpoint: "(none)".to_owned(),
            message: "no endpoint given".to_owned(),
        }))
    }
}

/// The sending side of a lease keepalive stream.
#[derive(Debug)]
pub struct LeaseKeeper {
    lease: i64,
    tx: mpsc::Sender<LeaseKeepAliveRequest>,
}

impl LeaseKeeper {
    /// Queues one renewal; its answer arrives on the stream.
    ///
    /// # Errors
    /// [`EtcdError::Stream`] if the stream has ended, or if earlier renewals are still unsent
    /// (the connection is stuck).
    pub fn keep_alive(&self) -> Result<(), EtcdError> {
        self.tx
            .try_send(LeaseKeepAliveRequest { id: self.lease })
            .map_err(|e| EtcdError::Stream {
                op: "lease keepalive",
                message: match e {
                    mpsc::error::TrySendError::Full(_) => {
                        format!("{KEEPALIVE_QUEUE} renewals still unsent; the connection is stuck")
                    }
                    mpsc::error::TrySendError::Closed(_) => "the stream has ended".to_owned(),
                },
            })
    }
}

/// The responses of a bidirectional stream.
pub struct ResponseStream<T> {
    op: &'static str,
    endpoint: EtcdEndpoint,
    inner: Streaming<T>,
    /// A request sender kept open for the stream's lifetime, where the caller holds none.
    requests: Option<Box<dyn std::any::Any + Send + Sync>>,
}

impl<T> std::fmt::Debug for ResponseStream<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseStream")
            .field("op", &self.op)
            .field("endpoint", &self.endpoint.url())
            .finish_non_exhaustive()
    }
}

impl<T> ResponseStream<T> {
    /// The next response; `None` when the server ended the stream.
    ///
    /// # Errors
    /// [`EtcdError::Status`] when the stream broke or the server ended it with an error.
    pub async fn message(&mut self) -> Result<Option<T>, EtcdError> {
        self.inner
            .message()
            .await
            .map_err(|status| EtcdError::status(self.op, &self.endpoint, &status))
    }

    /// The member serving this stream.
    pub fn endpoint(&self) -> &EtcdEndpoint {
        &self.endpoint
    }
}

fn grpc(channel: Channel) -> Grpc<Channel> {
    Grpc::new(channel).max_decoding_message_size(MAX_RESPONSE_BYTES)
}

async fn ready(grpc: &mut Grpc<Channel>) -> Result<(), Status> {
    grpc.ready().await.map_err(|e| {
        let message = with_causes(&e.to_string(), std::error::Error::source(&e));
        Status::unavailable(format!("connection not ready: {message}"))
    })
}

/// `message` followed by each cause that it does not already say (tonic's transport errors say
/// only "transport error"; the cause is a refused connection or a certificate problem).
fn with_causes(message: &str, mut cause: Option<&(dyn std::error::Error + 'static)>) -> String {
    let mut text = message.to_owned();
    while let Some(error) = cause {
        let said = error.to_string();
        if !text.contains(&said) {
            text.push_str(": ");
            text.push_str(&said);
        }
        cause = error.source();
    }
    text
}

/// A request with the `hasleader` metadata (see the module docs).
fn tagged<T>(message: T) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request.metadata_mut().insert(
        "hasleader",
        tonic::metadata::MetadataValue::from_static("true"),
    );
    request
}
