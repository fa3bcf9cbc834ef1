//! The one HTTP/1.1 serve loop of this crate: `infera server`'s API ([`crate::server::serve`])
//! and the mock engine ([`crate::mock::MockServer::serve`]) both run their axum routes here.
//!
//! # Bounds (every one of [`ServeLimits`])
//! - **Connections.** At most [`ServeLimits::max_connections`] at once. A connection accepted
//!   beyond it is answered `503` with `Retry-After: 1` by one non-blocking write and closed at
//!   once: the accept loop never waits for a slot, so a flood of held connections cannot keep
//!   the listener from answering (the default leaves a quarter of the open-file limit free).
//! - **Request heads.** A connection's first request head must be complete within
//!   [`ServeLimits::header_timeout`] of its accept, and every later one within that long of its
//!   first byte; otherwise the connection is closed (slow or stalled headers).
//! - **Idle keep-alive.** A connection with no request in flight that sends nothing for
//!   [`ServeLimits::idle_timeout`] after its last response is closed.
//! - **Bodies.** A request body must arrive whole within [`ServeLimits::body_timeout`] of its
//!   request head; past it the body yields a [`BodyTimeout`] error, which handlers answer 408.
//! - **Slow readers.** A write to the client that makes no progress for
//!   [`ServeLimits::write_timeout`] (the client stopped reading and its socket buffer is full)
//!   fails, and the connection is closed: its response body is dropped, which ends the request
//!   toward its worker, so a client that never reads cannot hold a worker slot.
//!
//! A response being written (a long stream) is never cut by the other deadlines.
//!
//! # Accept errors
//! Per-connection errors (reset or aborted before accept) are skipped; any other error (the
//! open-file limit reached, no buffer space) is logged and the loop waits [`ACCEPT_BACKOFF`]
//! before accepting again instead of spinning.
//!
//! # Shutdown
//! When the shutdown future completes the listener is closed, every connection is asked to
//! finish (idle ones close at once, busy ones after their response) and the loop returns once
//! all have ended. Connections are tasks of a `JoinSet` owned by the loop: dropping the serve
//! future ends them too.

use axum::Router;
use axum::body::Body;
use hyper::body::{Frame, Incoming, SizeHint};
use hyper::server::conn::http1;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll, ready};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, watch};
use tokio::task::JoinSet;
use tokio::time::{Instant, Sleep};

/// How long the accept loop waits after an accept error that is not the peer's.
pub const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// The deadlines and the connection cap of one listener. `None` turns a deadline off.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServeLimits {
    /// Longest wait for a complete request head (from accept for the first request, from its
    /// first byte for later ones).
    pub header_timeout: Option<Duration>,
    /// Longest silence of a keep-alive connection between a response and the next request.
    pub idle_timeout: Option<Duration>,
    /// Longest wait for a whole request body after its head.
    pub body_timeout: Option<Duration>,
    /// Longest a write to the client may make no progress.
    pub write_timeout: Option<Duration>,
    /// Connections served at once; more are answered 503 and closed.
    pub max_connections: usize,
}

impl ServeLimits {
    /// The default request-head deadline.
    pub const HEADER_TIMEOUT: Duration = Duration::from_secs(10);
    /// The default keep-alive idle deadline.
    pub const IDLE_TIMEOUT: Duration = Duration::from_secs(60);
    /// The default request-body deadline.
    pub const BODY_TIMEOUT: Duration = Duration::from_secs(60);
    /// The default stalled-write deadline.
    pub const WRITE_TIMEOUT: Duration = Duration::from_secs(60);
}

impl Default for ServeLimits {
    fn default() -> Self {
        Self {
            header_timeout: Some(Self::HEADER_TIMEOUT),
            idle_timeout: Some(Self::IDLE_TIMEOUT),
            body_timeout: Some(Self::BODY_TIMEOUT),
            write_timeout: Some(Self::WRITE_TIMEOUT),
            max_connections: default_max_connections(),
        }
    }
}

/// Three quarters of this process's open-file limit (the soft `RLIMIT_NOFILE`), at least 64:
/// the rest stays free for workers, the event log and kvd. 1,024 where the limit is unknown.
pub fn default_max_connections() -> usize {
    #[cfg(target_os = "linux")]
    let limit = rustix::process::getrlimit(rustix::process::Resource::Nofile).current;
    #[cfg(not(target_os = "linux"))]
    let limit: Option<u64> = None;
    limit.map_or(1024, |n| {
        usize::try_from(n / 4 * 3)
            .unwrap_or(usize::MAX)
            .clamp(64, 1 << 20)
    })
}

/// The error a request body yields when it did not arrive within
/// [`ServeLimits::body_timeout`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the request body did not arrive within {0:?}")]
pub struct BodyTimeout(pub Duration);

/// What an over-the-cap connection is told before it is closed.
const BUSY: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
retry-after: 1\r\nconnection: close\r\ncontent-length: 120\r\n\r\n\
{\"error\":{\"message\":\"the server is at its connection limit; retry shortly\",\"type\":\"ServiceUnavailableError\",\"code\":503}}";

/// Serves `app` on `listener` within `limits` until `shutdown` completes, then lets the open
/// connections finish (see the module docs).
///
/// # Errors
/// None today: accept errors are logged and retried. The `Result` keeps the shape of
/// `axum::serve` for callers.
pub async fn serve<F>(
    listener: TcpListener,
    app: Router,
    limits: ServeLimits,
    shutdown: F,
) -> io::Result<()>
where
    F: Future<Output = ()> + Send + 'static,
{
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let limits = Arc::new(limits);
    let (closing, closing_rx) = watch::channel(false);
    let mut conns: JoinSet<()> = JoinSet::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            () = &mut shutdown => break,
            Some(done) = conns.join_next(), if !conns.is_empty() => {
                log_join(done);
                continue;
            }
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((tcp, _peer)) => {
                let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
                    refuse(&tcp);
                    continue;
                };
                // Streamed tokens are small writes: without TCP_NODELAY, Nagle's algorithm
                // holds each one until the client's delayed ACK (up to 40 ms).
                if let Err(e) = tcp.set_nodelay(true) {
                    tracing::debug!(error = %e, "cannot set TCP_NODELAY on an accepted connection");
                }
                conns.spawn(connection(
                    tcp,
                    app.clone(),
                    Arc::clone(&limits),
                    slot,
                    closing_rx.clone(),
                ));
            }
            Err(e) if is_peer_error(&e) => {}
            Err(e) => {
                tracing::warn!(error = %e, backoff_ms = ACCEPT_BACKOFF.as_millis() as u64,
                    "accept failed; retrying after a pause");
                tokio::select! {
                    () = &mut shutdown => break,
                    () = tokio::time::sleep(ACCEPT_BACKOFF) => {}
                }
            }
        }
    }
    drop(listener);
    closing.send_replace(true);
    while let Some(done) = conns.join_next().await {
        log_join(done);
    }
    Ok(())
}

fn log_join(done: Result<(), tokio::task::JoinError>) {
    if let Err(e) = done
        && e.is_panic()
    {
        tracing::error!(error = %e, "a connection task panicked");
    }
}

/// Errors of one connection that died before it was accepted: the listener is fine.
fn is_peer_error(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
    )
}

/// Answers an over-the-cap connection 503 without waiting, then closes it. What the client
/// already sent is read first so that closing does not reset the answer away.
fn refuse(tcp: &TcpStream) {
    let mut sink = [0u8; 4096];
    for _ in 0..16 {
        match tcp.try_read(&mut sink) {
            Ok(n) if n > 0 => {}
            _ => break,
        }
    }
    if let Err(e) = tcp.try_write(BUSY) {
        tracing::debug!(error = %e, "cannot answer an over-the-cap connection");
    }
    tracing::debug!("connection refused: at the connection limit");
}

/// What a connection is doing, as its watchdog sees it.
#[derive(Debug, Default)]
struct Activity {
    /// Requests whose response has not ended.
    in_flight: AtomicUsize,
    /// Bytes of a next request arrived while no request was in flight.
    head_started: AtomicBool,
    /// Responses ended so far.
    finished: AtomicU64,
    /// Woken on every change above.
    changed: Notify,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Waiting for (the rest of) a request head.
    Head,
    /// A request is in flight: its body and response have their own bounds.
    Busy,
    /// Keep-alive, between a response and the next request's first byte.
    Idle,
}

impl Activity {
    fn phase(&self) -> (Phase, u64) {
        let finished = self.finished.load(Ordering::Acquire);
        let phase = if self.in_flight.load(Ordering::Acquire) > 0 {
            Phase::Busy
        } else if finished == 0 || self.head_started.load(Ordering::Acquire) {
            Phase::Head
        } else {
            Phase::Idle
        };
        (phase, finished)
    }

    fn read_some(&self) {
        if self.in_flight.load(Ordering::Acquire) == 0
            && !self.head_started.swap(true, Ordering::AcqRel)
        {
            self.changed.notify_one();
        }
    }

    fn request_started(self: &Arc<Self>) -> InFlight {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        self.head_started.store(false, Ordering::Release);
        self.changed.notify_one();
        InFlight(Arc::clone(self))
    }
}

/// One request in flight; dropped when its response body ends (or is dropped).
#[derive(Debug)]
struct InFlight(Arc<Activity>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.finished.fetch_add(1, Ordering::AcqRel);
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
        self.0.changed.notify_one();
    }
}

/// Resolves with the name of the deadline a connection missed.
async fn watchdog(activity: &Activity, limits: &ServeLimits) -> &'static str {
    let mut current = None;
    let mut since = Instant::now();
    loop {
        let key = activity.phase();
        if current != Some(key) {
            current = Some(key);
            since = Instant::now();
        }
        let (limit, missed) = match key.0 {
            Phase::Busy => (None, ""),
            Phase::Head => (limits.header_timeout, "header timeout"),
            Phase::Idle => (limits.idle_timeout, "idle timeout"),
        };
        match limit {
            None => activity.changed.notified().await,
            Some(limit) => tokio::select! {
                () = activity.changed.notified() => {}
                () = tokio::time::sleep_until(since + limit) => return missed,
            },
        }
    }
}

/// Serves one connection until it ends, misses a deadline, or the server shuts down.
async fn connection(
    tcp: TcpStream,
    app: Router,
    limits: Arc<ServeLimits>,
    slot: OwnedSemaphorePermit,
    mut closing: watch::Receiver<bool>,
) {
    let activity = Arc::new(Activity::default());
    let io = TokioIo::new(Watched {
        slot: Some(slot),
        inner: tcp,
        activity: Arc::clone(&activity),
        write_timeout: limits.write_timeout,
        stalled: None,
    });
    let routes = TowerToHyperService::new(app);
    let body_timeout = limits.body_timeout;
    let service = hyper::service::service_fn({
        let activity = Arc::clone(&activity);
        move |req: Request<Incoming>| {
            let in_flight = activity.request_started();
            let req = req.map(|body| match body_timeout {
                Some(limit) => Body::new(Deadline {
                    inner: body,
                    limit,
                    sleep: Box::pin(tokio::time::sleep(limit)),
                }),
                None => Body::new(body),
            });
            let answered = hyper::service::Service::call(&routes, req);
            async move {
                let resp: Response<Body> = answered.await?;
                Ok::<_, Infallible>(resp.map(|inner| {
                    Body::new(Tracked {
                        inner,
                        _in_flight: in_flight,
                    })
                }))
            }
        }
    });
    let mut conn = Box::pin(
        http1::Builder::new()
            // Ours covers the keep-alive wait too; hyper's would need a timer and restart.
            .header_read_timeout(None)
            .serve_connection(io, service),
    );
    let mut watchdog = std::pin::pin!(watchdog(&activity, &limits));
    let mut asked_to_close = false;
    loop {
        tokio::select! {
            served = conn.as_mut() => {
                if let Err(e) = served {
                    tracing::debug!(error = %e, "client connection ended with an error");
                }
                break;
            }
            missed = &mut watchdog => {
                tracing::debug!(deadline = missed, "closing a client connection");
                break;
            }
            Ok(()) = closing.changed(), if !asked_to_close => {
                asked_to_close = true;
                conn.as_mut().graceful_shutdown();
            }
        }
    }
}

/// The connection's socket, reporting reads to its watchdog and failing a write that stalls
/// past `write_timeout`. It holds the connection's slot and frees it before the peer can see
/// the connection end: on shutdown, and on drop (fields drop in order).
struct Watched {
    slot: Option<OwnedSemaphorePermit>,
    inner: TcpStream,
    activity: Arc<Activity>,
    write_timeout: Option<Duration>,
    /// Armed while a write is pending: when it fires, the write fails.
    stalled: Option<Pin<Box<Sleep>>>,
}

impl Watched {
    /// Passes a write's outcome through, arming the stall deadline while it is pending and
    /// failing it once the deadline passes.
    fn stall_check<T>(
        &mut self,
        cx: &mut Context<'_>,
        polled: Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        let Some(limit) = self.write_timeout else {
            return polled;
        };
        if polled.is_ready() {
            self.stalled = None;
            return polled;
        }
        let deadline = self
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        match deadline.as_mut().poll(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(()) => {
                tracing::debug!(
                    timeout_ms = limit.as_millis() as u64,
                    "closing a client connection: it stopped reading"
                );
                Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("the client read nothing for {limit:?}"),
                )))
            }
        }
    }
}

impl AsyncRead for Watched {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.activity.read_some();
        }
        polled
    }
}

impl AsyncWrite for Watched {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.stall_check(cx, polled)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.stall_check(cx, polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.slot = None;
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// A request body that fails with [`BodyTimeout`] once its deadline passes.
struct Deadline {
    inner: Incoming,
    limit: Duration,
    sleep: Pin<Box<Sleep>>,
}

impl hyper::body::Body for Deadline {
    type Data = bytes::Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        if let Poll::Ready(frame) = Pin::new(&mut self.inner).poll_frame(cx) {
            return Poll::Ready(frame.map(|f| f.map_err(Into::into)));
        }
        ready!(self.sleep.as_mut().poll(cx));
        Poll::Ready(Some(Err(Box::new(BodyTimeout(self.limit)))))
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// A response body that holds its request's [`InFlight`] until it ends.
struct Tracked {
    inner: Body,
    _in_flight: InFlight,
}

impl hyper::body::Body for Tracked {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_busy_answer_declares_its_length() {
        let split = BUSY
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .expect("head ends");
        let body = &BUSY[split + 4..];
        assert_eq!(body.len(), 120);
        let parsed: serde_json::Value = serde_json::from_slice(body).expect("json body");
        assert_eq!(parsed["error"]["code"], 503);
    }

    #[test]
    fn the_default_cap_leaves_file_descriptors_free() {
        assert!(default_max_connections() >= 64);
    }
}
