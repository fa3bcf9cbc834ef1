//! An S3 bucket (AWS S3 or any S3-compatible store: MinIO, Ceph RGW, ...) as an L4
//! [`RemoteStore`], LMCache's `s3://` remote: one object per block, named as every L4 names
//! its blocks ([`super::name`]), holding kvd's framed block.
//!
//! - **Where.** `s3://HOST[:PORT]` is LMCache's form: `HOST` is the bucket's own
//!   (virtual-hosted) endpoint, e.g. `my-bucket.s3.us-east-1.amazonaws.com`, and objects are
//!   `/<name>` on it. `s3://HOST[:PORT]/BUCKET` addresses the bucket by path, as MinIO and
//!   Ceph endpoints usually want.
//! - **Settings** (LMCache's `connector_extra` keys, each overridable by `INFERA_L4_<KEY>`):
//!   `s3_region` (else `AWS_REGION` / `AWS_DEFAULT_REGION`; required), `disable_tls` (plain
//!   HTTP, port 80 by default; else HTTPS on 443, verified against the system's roots),
//!   `aws_access_key_id` / `aws_secret_access_key` (else `AWS_ACCESS_KEY_ID` /
//!   `AWS_SECRET_ACCESS_KEY`, with `AWS_SESSION_TOKEN`; required), `s3_max_inflight_reqs`
//!   (64: requests in flight at once). LMCache's tuning keys for its CRT client
//!   (`s3_part_size`, `s3_num_io_threads`, `s3_prefer_http2`, `s3_enable_s3express`) do not
//!   apply and are reported as ignored.
//! - **Requests** are HTTP/1.1 on kept-alive connections, signed with SigV4 ([`sign`]; the
//!   payload unsigned: the frame carries its own checksum): PUT, GET (a missing object is a
//!   miss), HEAD (`exists`), DELETE (a missing object counts as removed), and HEAD of the
//!   bucket for health. A batch's objects go out concurrently.

pub mod sign;

use super::frame::Framed;
use super::remote::{RemoteError, RemoteStore};
use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt, Limited};
use hyper::{Method, Request, StatusCode};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use sign::Credentials;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::sync::Semaphore;

/// The `connector_extra` keys this client reads.
pub const KEYS: [&str; 5] = [
    "s3_region",
    "disable_tls",
    "aws_access_key_id",
    "aws_secret_access_key",
    "s3_max_inflight_reqs",
];
/// The longest error body read for its message.
const ERROR_BODY: usize = 4096;

/// Where the bucket is and how to sign for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct S3Config {
    pub tls: bool,
    pub host: String,
    /// `None`: the scheme's default port.
    pub port: Option<u16>,
    /// The bucket, when it is addressed by path.
    pub bucket: Option<String>,
    pub region: String,
    pub credentials: Credentials,
    /// Requests in flight at once.
    pub inflight: usize,
    /// How long a connection may take.
    pub connect_timeout: Duration,
}

impl S3Config {
    /// The endpoint of `s3://<rest>` (settings still to come from [`S3Config::settle`]).
    ///
    /// # Errors
    /// A malformed URL, as one line.
    pub fn from_url(rest: &str, url: &str) -> Result<Self, String> {
        let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
        let bucket = path.trim_end_matches('/');
        if bucket.contains('/') || bucket.contains(['?', '#']) {
            return Err(format!(
                "{url}: expected s3://HOST[:PORT] or s3://HOST[:PORT]/BUCKET"
            ));
        }
        let (host, port) = match authority.rsplit_once(':') {
            Some((h, p)) if !h.ends_with(']') || authority.starts_with('[') => {
                if p.contains(']') {
                    (authority, None)
                } else {
                    let port = p
                        .parse::<u16>()
                        .map_err(|_| format!("{url}: bad port {p:?}"))?;
                    (h, Some(port))
                }
            }
            _ => (authority, None),
        };
        let host = host.trim_start_matches('[').trim_end_matches(']');
        if host.is_empty() {
            return Err(format!("{url}: no host"));
        }
        Ok(Self {
            tls: true,
            host: host.to_owned(),
            port,
            bucket: (!bucket.is_empty()).then(|| bucket.to_owned()),
            region: String::new(),
            credentials: Credentials {
                access_key: String::new(),
                secret_key: String::new(),
                session_token: None,
            },
            inflight: 64,
            connect_timeout: Duration::from_secs(30),
        })
    }

    /// Takes the region, TLS, credentials and concurrency from `get` (a `connector_extra`
    /// key, `INFERA_L4_<KEY>` winning) and `env` (the AWS variables); `timeout` bounds a
    /// connection.
    ///
    /// # Errors
    /// A missing region or credential, or a bad value, as one line.
    pub fn settle(
        &mut self,
        get: &dyn Fn(&str) -> Option<String>,
        env: &dyn Fn(&str) -> Option<String>,
        timeout: Duration,
    ) -> Result<(), String> {
        self.region = get("s3_region")
            .or_else(|| env("AWS_REGION"))
            .or_else(|| env("AWS_DEFAULT_REGION"))
            .ok_or("an s3:// store needs its region: connector_extra s3_region (or AWS_REGION)")?;
        if let Some(v) = get("disable_tls") {
            self.tls = match v.to_ascii_lowercase().as_str() {
                "true" | "1" | "yes" => false,
                "false" | "0" | "no" => true,
                _ => return Err(format!("disable_tls {v:?}: true or false")),
            };
        }
        let access = get("aws_access_key_id").or_else(|| env("AWS_ACCESS_KEY_ID"));
        let secret = get("aws_secret_access_key").or_else(|| env("AWS_SECRET_ACCESS_KEY"));
        let (Some(access_key), Some(secret_key)) = (access, secret) else {
            return Err(
                "an s3:// store needs credentials: connector_extra aws_access_key_id and \
                        aws_secret_access_key (or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY)"
                    .into(),
            );
        };
        self.credentials = Credentials {
            access_key,
            secret_key,
            session_token: env("AWS_SESSION_TOKEN"),
        };
        if let Some(v) = get("s3_max_inflight_reqs") {
            self.inflight = v
                .parse::<usize>()
                .ok()
                .filter(|n| (1..=4096).contains(n))
                .ok_or_else(|| {
                    format!("s3_max_inflight_reqs {v:?}: a whole number from 1 to 4096")
                })?;
        }
        self.connect_timeout = timeout;
        Ok(())
    }

    /// `HOST[:PORT]` as the `Host` header says it (the port only when not the default).
    fn authority(&self) -> String {
        let host = if self.host.contains(':') {
            format!("[{}]", self.host)
        } else {
            self.host.clone()
        };
        match self.port {
            Some(p) if p != if self.tls { 443 } else { 80 } => format!("{host}:{p}"),
            _ => host,
        }
    }

    /// The URL without credentials, for logs.
    pub fn describe(&self) -> String {
        let scheme = if self.tls { "https" } else { "http" };
        let bucket = self
            .bucket
            .as_deref()
            .map(|b| format!("/{b}"))
            .unwrap_or_default();
        format!(
            "s3 {scheme}://{}{bucket} ({})",
            self.authority(),
            self.region
        )
    }
}

/// A request body of up to three parts (a frame's head, body and trailer), its length known up
/// front (S3 wants a `Content-Length`, never a chunked upload). Each part is taken out (left
/// empty) as it is sent, so what is left to send is every part's bytes.
#[derive(Debug, Default)]
struct Payload {
    parts: [Bytes; 3],
}

impl Body for Payload {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let next = self.get_mut().parts.iter_mut().find(|p| !p.is_empty());
        Poll::Ready(next.map(|part| Ok(Frame::data(std::mem::take(part)))))
    }

    fn is_end_stream(&self) -> bool {
        self.parts.iter().all(Bytes::is_empty)
    }

    fn size_hint(&self) -> SizeHint {
        let left: usize = self.parts.iter().map(Bytes::len).sum();
        SizeHint::with_exact(left as u64)
    }
}

type HttpsClient = Client<hyper_rustls::HttpsConnector<HttpConnector>, Payload>;

/// An S3 bucket; see the module docs.
#[derive(Debug)]
pub struct S3Store {
    config: Arc<S3Config>,
    /// Why there is no client (HTTPS without system roots), said by every call.
    client: Result<HttpsClient, String>,
    inflight: Semaphore,
    max_value: usize,
}

fn client(config: &S3Config) -> Result<HttpsClient, String> {
    let mut http = HttpConnector::new();
    http.set_connect_timeout(Some(config.connect_timeout));
    http.set_nodelay(true);
    http.enforce_http(false);
    let builder = hyper_rustls::HttpsConnectorBuilder::new();
    let builder = if config.tls {
        builder.with_native_roots().map_err(|e| {
            format!(
                "no system TLS root certificates to verify {}: {e}",
                config.describe()
            )
        })?
    } else {
        // Plain HTTP only: no certificate is ever verified.
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_root_certificates(rustls::RootCertStore::empty())
            .with_no_client_auth();
        builder.with_tls_config(tls)
    };
    let https = builder.https_or_http().enable_http1().wrap_connector(http);
    Ok(Client::builder(TokioExecutor::new()).build(https))
}

/// S3's error code in an error body (`<Code>NoSuchBucket</Code>`), else the status alone.
fn failure(what: &str, status: StatusCode, body: &[u8]) -> RemoteError {
    let text = String::from_utf8_lossy(body);
    let code = text
        .split_once("<Code>")
        .and_then(|(_, rest)| rest.split_once("</Code>"))
        .map(|(code, _)| format!(" ({code})"))
        .unwrap_or_default();
    RemoteError::Protocol(format!("S3 {what} answered {status}{code}"))
}

impl S3Store {
    /// A client of the bucket `config` names; values over `max_value` bytes read as misses.
    pub fn new(config: S3Config, max_value: usize) -> Self {
        Self {
            client: client(&config),
            inflight: Semaphore::new(config.inflight),
            config: Arc::new(config),
            max_value,
        }
    }

    /// One request: `method` on the object `name` (the bucket when `None`); the status and
    /// the body, read up to `limit` bytes (`None` past it).
    async fn call(
        &self,
        method: Method,
        name: Option<&str>,
        body: Payload,
        limit: usize,
    ) -> Result<(StatusCode, Option<Bytes>), RemoteError> {
        let client = self
            .client
            .as_ref()
            .map_err(|e| RemoteError::Protocol(e.clone()))?;
        let _permit = self
            .inflight
            .acquire()
            .await
            .map_err(|_| RemoteError::Protocol("the S3 client is closed".into()))?;
        let config = &self.config;
        let mut path = String::from("/");
        if let Some(bucket) = &config.bucket {
            path.push_str(bucket);
            if name.is_some() {
                path.push('/');
            }
        }
        path.push_str(name.unwrap_or_default());
        let path = sign::uri_encode(&path);
        let authority = config.authority();
        let scheme = if config.tls { "https" } else { "http" };
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let date = sign::amz_date(now);
        let mut signed = vec![
            ("host", authority.as_str()),
            ("x-amz-content-sha256", sign::UNSIGNED_PAYLOAD),
            ("x-amz-date", date.as_str()),
        ];
        if let Some(token) = &config.credentials.session_token {
            signed.push(("x-amz-security-token", token.as_str()));
        }
        let auth = sign::authorization(
            &config.credentials,
            &config.region,
            "s3",
            &sign::Request {
                method: method.as_str(),
                path: &path,
                headers: &signed,
                amz_date: &date,
                payload_hash: sign::UNSIGNED_PAYLOAD,
            },
        );
        let mut request = Request::builder()
            .method(method)
            .uri(format!("{scheme}://{authority}{path}"));
        for (name, value) in &signed {
            request = request.header(*name, *value);
        }
        let request = request
            .header("authorization", auth)
            .body(body)
            .map_err(|e| RemoteError::Protocol(format!("cannot build an S3 request: {e}")))?;
        let response = client.request(request).await.map_err(|e| {
            // The client's own message is terse ("client error (Connect)"): say why.
            let mut why = e.to_string();
            let mut source = std::error::Error::source(&e);
            while let Some(cause) = source {
                why = format!("{why}: {cause}");
                source = cause.source();
            }
            RemoteError::Io(std::io::Error::other(format!("S3 {authority}: {why}")))
        })?;
        let status = response.status();
        let body = match Limited::new(response.into_body(), limit).collect().await {
            Ok(body) => Some(body.to_bytes()),
            Err(_) => None,
        };
        Ok((status, body))
    }
}

#[async_trait::async_trait]
impl RemoteStore for S3Store {
    fn describe(&self) -> String {
        self.config.describe()
    }

    fn backend(&self) -> &'static str {
        "lmcache"
    }

    fn streams(&self) -> usize {
        8
    }

    fn twin(&self) -> Option<Arc<dyn RemoteStore>> {
        Some(Arc::new(Self::new((*self.config).clone(), self.max_value)))
    }

    async fn health(&self) -> Result<(), RemoteError> {
        let (status, body) = self
            .call(Method::HEAD, None, Payload::default(), ERROR_BODY)
            .await?;
        if status.is_success() {
            return Ok(());
        }
        Err(failure(
            "HEAD of the bucket",
            status,
            &body.unwrap_or_default(),
        ))
    }

    async fn put_batch(&self, items: &[(String, Framed)]) -> Result<Vec<usize>, RemoteError> {
        let puts = items.iter().map(|(name, framed)| async move {
            let body = Payload {
                parts: [
                    framed.head.clone(),
                    framed.body.clone(),
                    framed.tail.clone(),
                ],
            };
            let (status, answer) = self.call(Method::PUT, Some(name), body, ERROR_BODY).await?;
            if status.is_success() {
                return Ok(());
            }
            Err(failure("PUT", status, &answer.unwrap_or_default()))
        });
        // A bucket keeps whatever it is sent, or fails: it refuses no value of its own accord.
        futures::future::try_join_all(puts)
            .await
            .map(|_| Vec::new())
    }

    async fn get_batch(&self, names: &[String]) -> Result<Vec<Option<Bytes>>, RemoteError> {
        let gets = names.iter().map(|name| async move {
            let (status, body) = self
                .call(Method::GET, Some(name), Payload::default(), self.max_value)
                .await?;
            match status {
                // A value too large to be one of ours reads as a miss.
                StatusCode::OK => Ok(body),
                StatusCode::NOT_FOUND => Ok(None),
                _ => Err(failure("GET", status, &body.unwrap_or_default())),
            }
        });
        futures::future::try_join_all(gets).await
    }

    async fn exists_batch(&self, names: &[String]) -> Result<Vec<bool>, RemoteError> {
        let heads = names.iter().map(|name| async move {
            let (status, _) = self
                .call(Method::HEAD, Some(name), Payload::default(), ERROR_BODY)
                .await?;
            match status {
                StatusCode::OK => Ok(true),
                StatusCode::NOT_FOUND => Ok(false),
                _ => Err(failure("HEAD", status, &[])),
            }
        });
        futures::future::try_join_all(heads).await
    }

    async fn remove_batch(&self, names: &[String]) -> Result<(), RemoteError> {
        let deletes = names.iter().map(|name| async move {
            let (status, body) = self
                .call(Method::DELETE, Some(name), Payload::default(), ERROR_BODY)
                .await?;
            if status.is_success() || status == StatusCode::NOT_FOUND {
                return Ok(());
            }
            Err(failure("DELETE", status, &body.unwrap_or_default()))
        });
        futures::future::try_join_all(deletes).await.map(drop)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_name_the_endpoint_and_the_bucket() {
        let c = S3Config::from_url("b.s3.us-east-1.amazonaws.com", "s3://…").unwrap();
        assert_eq!(
            (c.host.as_str(), c.port, c.bucket.as_deref()),
            ("b.s3.us-east-1.amazonaws.com", None, None)
        );
        assert_eq!(c.authority(), "b.s3.us-east-1.amazonaws.com");
        let c = S3Config::from_url("127.0.0.1:9000/kv/", "s3://…").unwrap();
        assert_eq!(
            (c.host.as_str(), c.port, c.bucket.as_deref()),
            ("127.0.0.1", Some(9000), Some("kv"))
        );
        assert_eq!(c.authority(), "127.0.0.1:9000");
        let c = S3Config::from_url("[::1]:443", "s3://…").unwrap();
        assert_eq!(
            (c.host.as_str(), c.authority()),
            ("::1", "[::1]".to_owned())
        );
        for bad in ["", ":9000", "h:x", "h/a/b"] {
            assert!(S3Config::from_url(bad, "s3://…").is_err(), "{bad}");
        }
    }

    #[test]
    fn settings_come_from_the_extra_keys_then_the_aws_variables() {
        let mut c = S3Config::from_url("127.0.0.1:9000/kv", "s3://…").unwrap();
        let none = |_: &str| None;
        let e = c.settle(&none, &none, Duration::from_secs(1)).unwrap_err();
        assert!(e.contains("s3_region"), "{e}");
        let aws = |k: &str| match k {
            "AWS_REGION" => Some("eu-west-1".to_owned()),
            "AWS_ACCESS_KEY_ID" => Some("AK".to_owned()),
            "AWS_SECRET_ACCESS_KEY" => Some("SK".to_owned()),
            _ => None,
        };
        let extra = |k: &str| match k {
            "disable_tls" => Some("True".to_owned()),
            "aws_access_key_id" => Some("EXTRA".to_owned()),
            "s3_max_inflight_reqs" => Some("8".to_owned()),
            _ => None,
        };
        c.settle(&extra, &aws, Duration::from_secs(1)).unwrap();
        assert_eq!(
            (c.region.as_str(), c.tls, c.inflight),
            ("eu-west-1", false, 8)
        );
        assert_eq!(
            (
                c.credentials.access_key.as_str(),
                c.credentials.secret_key.as_str()
            ),
            ("EXTRA", "SK")
        );
        let no_secret = |k: &str| (k == "AWS_REGION").then(|| "r".to_owned());
        let e = c
            .settle(&none, &no_secret, Duration::from_secs(1))
            .unwrap_err();
        assert!(e.contains("credentials") && !e.contains('\n'), "{e}");
    }
}
