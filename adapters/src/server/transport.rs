//! `--request-transport http`: the request transport port
//! ([`infera_core::ports::transport`]) over HTTP/1 — POST to `worker.url + path` with
//! hyper-util's pooled client (plain HTTP: workers are in-cluster), the port's headers as they
//! are. A dropped body closes the connection, which an engine sees as a client disconnect.

use async_trait::async_trait;
use axum::body::Bytes;
use axum::http::{Request, header};
use futures::StreamExt as _;
use http_body_util::{BodyExt as _, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use infera_core::ports::transport::{Inbound, Outbound, RequestTransport, TransportError};

/// The HTTP request transport. See the module docs.
#[derive(Debug, Clone)]
pub struct HttpTransport {
    client: Client<HttpConnector, Full<Bytes>>,
}

impl HttpTransport {
    /// A transport with its own connection pool.
    pub fn new() -> Self {
        Self {
            client: Client::builder(TokioExecutor::new()).build(nodelay_connector()),
        }
    }
}

/// An HTTP connector with `TCP_NODELAY`, so small writes (a request's head and body, streamed
/// chunks) are not held back by Nagle's algorithm. Every client that talks to engines uses it.
pub fn nodelay_connector() -> HttpConnector {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector
}

impl Default for HttpTransport {
    fn default() -> Self {
        Self::new()
    }
}

#[async_trait]
impl RequestTransport for HttpTransport {
    fn name(&self) -> &'static str {
        "http"
    }

    async fn send(&self, req: Outbound) -> Result<Inbound, TransportError> {
        let target = format!("{}{}", req.url, req.path);
        let mut builder = Request::post(&target).header(header::CONTENT_TYPE, "application/json");
        if let Some(headers) = builder.headers_mut() {
            headers.extend(req.headers);
        }
        let http_req = builder.body(Full::new(req.body)).map_err(|e| {
            TransportError::Failed(format!("cannot build the request to {target}: {e}"))
        })?;
        let resp = self.client.request(http_req).await.map_err(|e| {
            TransportError::Unreachable(format!(
                "worker {} at {}: {e}",
                req.worker.as_str(),
                req.url
            ))
        })?;
        let (parts, body) = resp.into_parts();
        let body = body
            .into_data_stream()
            .map(|r| r.map_err(|e| TransportError::Failed(e.to_string())))
            .boxed();
        Ok(Inbound {
            status: parts.status,
            content_type: parts.headers.get(header::CONTENT_TYPE).cloned(),
            body,
        })
    }
}
