//! HTTP/1.1 client helpers shared by the integration tests that talk to the mock engine and to
//! the server (one exchange per fresh connection, bounded by [`TIMEOUT`]).
#![allow(dead_code)] // each test binary uses its own subset

pub mod fleet;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use serde_json::Value;
use std::net::SocketAddr;
use std::time::Duration;
use tokio::net::TcpStream;
use tokio::task::JoinHandle;

/// Upper bound of every wait in these tests: a guard against a hung test, never a
/// synchronisation.
pub const TIMEOUT: Duration = Duration::from_secs(20);

/// One HTTP/1.1 exchange on a fresh connection; the connection lives as long as this.
pub struct Exchange {
    pub response: Response<Incoming>,
    _conn: AbortOnDrop,
}

/// Closes the connection (aborts its task) when dropped.
struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

pub async fn request(addr: SocketAddr, method: &str, path: &str, body: Vec<u8>) -> Exchange {
    request_with(addr, method, path, &[], body).await
}

/// [`request`] with extra headers.
pub async fn request_with(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Vec<u8>,
) -> Exchange {
    let stream = TcpStream::connect(addr).await.expect("connect");
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .expect("handshake");
    let conn = tokio::spawn(async move {
        let _ = conn.await;
    });
    let mut builder = Request::builder()
        .method(method)
        .uri(path)
        .header("host", addr.to_string())
        .header("content-type", "application/json");
    for (name, value) in headers {
        builder = builder.header(*name, *value);
    }
    let req = builder.body(Full::new(Bytes::from(body))).expect("request");
    let response = tokio::time::timeout(TIMEOUT, sender.send_request(req))
        .await
        .expect("response in time")
        .expect("response");
    Exchange {
        response,
        _conn: AbortOnDrop(conn),
    }
}

pub async fn body_of(ex: Exchange) -> (u16, String) {
    let Exchange { response, _conn } = ex;
    let status = response.status().as_u16();
    let bytes = tokio::time::timeout(TIMEOUT, response.into_body().collect())
        .await
        .expect("body in time")
        .expect("body")
        .to_bytes();
    (
        status,
        String::from_utf8(bytes.to_vec()).expect("utf-8 body"),
    )
}

pub async fn post(addr: SocketAddr, path: &str, body: &Value) -> (u16, Value) {
    let (status, text) =
        body_of(request(addr, "POST", path, body.to_string().into_bytes()).await).await;
    let value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("json body ({e}): {text}"));
    (status, value)
}

pub async fn post_raw(addr: SocketAddr, path: &str, body: Vec<u8>) -> (u16, Value) {
    let (status, text) = body_of(request(addr, "POST", path, body).await).await;
    let value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("json body ({e}): {text}"));
    (status, value)
}

pub async fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    body_of(request(addr, "GET", path, Vec::new()).await).await
}

/// One exchange, returning the status and the body as text.
pub async fn exchange(addr: SocketAddr, method: &str, path: &str, body: Vec<u8>) -> (u16, String) {
    body_of(request(addr, method, path, body).await).await
}
