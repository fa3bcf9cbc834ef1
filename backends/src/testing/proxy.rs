//! A loopback TCP proxy whose connections a test can cut and restore.
//!
//! While cut, existing connections are closed and new ones are accepted and closed at once, so a
//! client sees its stream break and its reconnects fail fast, while the server behind stays up
//! and the test can change its state directly.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

#[derive(Debug)]
struct State {
    cut: bool,
    /// Cancelled on `cut`, replaced on `restore`; every forwarded connection watches it.
    generation: CancellationToken,
}

/// A TCP proxy from a free 127.0.0.1 port to `upstream`; stops on drop.
#[derive(Debug)]
pub struct TcpProxy {
    addr: SocketAddr,
    state: Arc<Mutex<State>>,
    stop: CancellationToken,
    accept: JoinHandle<()>,
}

impl TcpProxy {
    /// Starts forwarding to `upstream`.
    ///
    /// # Errors
    /// If no loopback port can be bound.
    pub async fn start(upstream: SocketAddr) -> std::io::Result<Self> {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
        let addr = listener.local_addr()?;
        let stop = CancellationToken::new();
        let state = Arc::new(Mutex::new(State {
            cut: false,
            generation: stop.child_token(),
        }));
        let accept = tokio::spawn(accept_loop(listener, upstream, state.clone(), stop.clone()));
        Ok(Self {
            addr,
            state,
            stop,
            accept,
        })
    }

    /// The proxy's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://` URL of the proxy (for gRPC clients such as etcd's).
    pub fn http_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Closes every connection and refuses new ones until [`TcpProxy::restore`].
    pub fn cut(&self) {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        state.cut = true;
        state.generation.cancel();
    }

    /// Forwards new connections again.
    pub fn restore(&self) {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        state.cut = false;
        state.generation = self.stop.child_token();
    }
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        self.stop.cancel();
        self.accept.abort();
    }
}

async fn accept_loop(
    listener: TcpListener,
    upstream: SocketAddr,
    state: Arc<Mutex<State>>,
    stop: CancellationToken,
) {
    loop {
        let accepted = tokio::select! {
            _ = stop.cancelled() => return,
            accepted = listener.accept() => accepted,
        };
        let Ok((client, _)) = accepted else { continue };
        let generation = {
            let state = state.lock().unwrap_or_else(PoisonError::into_inner);
            if state.cut {
                None
            } else {
                Some(state.generation.clone())
            }
        };
        // Connections end when either side closes or their generation is cut; the token is a
        // child of `stop`, so none outlives the proxy.
        if let Some(generation) = generation {
            tokio::spawn(forward(client, upstream, generation));
        }
    }
}

async fn forward(mut client: TcpStream, upstream: SocketAddr, generation: CancellationToken) {
    let Ok(mut server) = TcpStream::connect(upstream).await else {
        return;
    };
    tokio::select! {
        _ = generation.cancelled() => {}
        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
    }
}
