//! What the request service answers: a worker's [`Reply`] (read whole or relayed as a stream),
//! or a [`RequestError`] whose [`ErrorCode`] the edge renders in its protocol's shape.

use crate::error::{ErrorCode, ServiceError};
use crate::ports::transport::TransportError;
use bytes::Bytes;
use futures::stream::BoxStream;
use http::{HeaderValue, StatusCode};

/// Why a request got no answer from a worker: what the client is told (its [`ErrorCode`]
/// decides the status and the error's type at the edge).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct RequestError {
    pub code: ErrorCode,
    pub message: String,
    /// Come back after this many seconds (`Retry-After`, with a 429 or 503).
    pub retry_after_s: Option<u32>,
}

impl RequestError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
            retry_after_s: None,
        }
    }

    /// An error of a port or the kernel, under its own code.
    pub fn of(e: &(impl ServiceError + ?Sized)) -> Self {
        Self::new(e.code(), e.to_string())
    }

    /// The HTTP status of its code.
    pub fn status(&self) -> StatusCode {
        self.code.http_status()
    }
}

impl ServiceError for RequestError {
    fn code(&self) -> ErrorCode {
        self.code
    }
}

/// A worker's answer, as the client gets it.
#[derive(Debug)]
pub struct Reply {
    /// The status the worker answered.
    pub status: StatusCode,
    /// The worker's content type, when the transport knows it.
    pub content_type: Option<HeaderValue>,
    pub body: ReplyBody,
}

/// The body of a [`Reply`].
pub enum ReplyBody {
    /// An answer read whole (the client did not ask for a stream).
    Full(Bytes),
    /// A stream relayed frame by frame as the worker sends it. An `Err` item is the last: the
    /// worker failed midway and the stream could not continue elsewhere; the edge ends the
    /// client's stream with an error event, never silently.
    Stream(BoxStream<'static, Result<Bytes, TransportError>>),
}

impl std::fmt::Debug for ReplyBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReplyBody::Full(b) => write!(f, "Full({} bytes)", b.len()),
            ReplyBody::Stream(_) => f.write_str("Stream(..)"),
        }
    }
}
