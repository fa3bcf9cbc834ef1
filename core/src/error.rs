//! One table of what went wrong, as a client is told: every error a request can end with has an
//! [`ErrorCode`], and the code alone decides the HTTP status, the OpenAI error `type` and the
//! Anthropic error `type` (each mapping written once, here). Errors of the ports and the kernel
//! name their code through [`ServiceError`]; the edges render it.
//!
//! A status a worker answered with is classified back into a code with
//! [`ErrorCode::of_status`], so the edge speaks one vocabulary whichever side failed.

use crate::policy::RouteError;
use crate::ports::transport::TransportError;
use http::StatusCode;

/// What kind of failure a request ended with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorCode {
    /// The request is malformed or names something it may not (400).
    BadRequest,
    /// An admin route without the right bearer token (401).
    Unauthorized,
    /// Authenticated, but not allowed: a disabled admin feature, a refused permission (403).
    Forbidden,
    /// No such model or route (404).
    NotFound,
    /// The client did not send its request in time (408).
    RequestTimeout,
    /// The request contradicts the state it would change (409).
    Conflict,
    /// The body is over a size limit (413).
    PayloadTooLarge,
    /// A worker or the server is at its admission limit: come back later (429).
    RateLimited,
    /// A bug or a configuration the server cannot serve (500).
    Internal,
    /// A worker failed or answered something unusable (502).
    BadGateway,
    /// Nothing can take the request now (no worker, draining, over a budget) (503).
    Unavailable,
    /// A worker went quiet or ran past its time (504).
    GatewayTimeout,
}

impl ErrorCode {
    /// The HTTP status.
    pub fn http_status(self) -> StatusCode {
        match self {
            ErrorCode::BadRequest => StatusCode::BAD_REQUEST,
            ErrorCode::Unauthorized => StatusCode::UNAUTHORIZED,
            ErrorCode::Forbidden => StatusCode::FORBIDDEN,
            ErrorCode::NotFound => StatusCode::NOT_FOUND,
            ErrorCode::RequestTimeout => StatusCode::REQUEST_TIMEOUT,
            ErrorCode::Conflict => StatusCode::CONFLICT,
            ErrorCode::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ErrorCode::RateLimited => StatusCode::TOO_MANY_REQUESTS,
            ErrorCode::Internal => StatusCode::INTERNAL_SERVER_ERROR,
            ErrorCode::BadGateway => StatusCode::BAD_GATEWAY,
            ErrorCode::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            ErrorCode::GatewayTimeout => StatusCode::GATEWAY_TIMEOUT,
        }
    }

    /// The `error.type` of an OpenAI-style error body (the Python SDK's exception names).
    pub fn openai_type(self) -> &'static str {
        match self {
            ErrorCode::BadRequest => "BadRequestError",
            ErrorCode::Unauthorized => "AuthenticationError",
            ErrorCode::Forbidden => "PermissionDeniedError",
            ErrorCode::NotFound => "NotFoundError",
            ErrorCode::Conflict => "ConflictError",
            ErrorCode::RequestTimeout | ErrorCode::GatewayTimeout => "TimeoutError",
            ErrorCode::PayloadTooLarge => "RequestTooLargeError",
            ErrorCode::RateLimited => "RateLimitError",
            ErrorCode::Internal => "InternalServerError",
            ErrorCode::BadGateway => "BadGatewayError",
            ErrorCode::Unavailable => "ServiceUnavailableError",
        }
    }

    /// The `error.type` of an Anthropic Messages error body.
    pub fn anthropic_type(self) -> &'static str {
        match self {
            ErrorCode::BadRequest | ErrorCode::RequestTimeout | ErrorCode::Conflict => {
                "invalid_request_error"
            }
            ErrorCode::Forbidden => "permission_error",
            ErrorCode::Unauthorized => "authentication_error",
            ErrorCode::NotFound => "not_found_error",
            ErrorCode::PayloadTooLarge => "request_too_large",
            ErrorCode::RateLimited => "rate_limit_error",
            ErrorCode::Unavailable => "overloaded_error",
            ErrorCode::Internal | ErrorCode::BadGateway | ErrorCode::GatewayTimeout => "api_error",
        }
    }

    /// The code of an HTTP status (a worker's answer, a framework's rejection): the exact
    /// status where it has one, else by class (other 4xx: a bad request; other 5xx: internal).
    pub fn of_status(status: StatusCode) -> Self {
        match status {
            StatusCode::UNAUTHORIZED => ErrorCode::Unauthorized,
            StatusCode::FORBIDDEN => ErrorCode::Forbidden,
            StatusCode::NOT_FOUND => ErrorCode::NotFound,
            StatusCode::REQUEST_TIMEOUT => ErrorCode::RequestTimeout,
            StatusCode::CONFLICT => ErrorCode::Conflict,
            StatusCode::PAYLOAD_TOO_LARGE => ErrorCode::PayloadTooLarge,
            StatusCode::TOO_MANY_REQUESTS => ErrorCode::RateLimited,
            StatusCode::BAD_GATEWAY => ErrorCode::BadGateway,
            StatusCode::SERVICE_UNAVAILABLE => ErrorCode::Unavailable,
            StatusCode::GATEWAY_TIMEOUT => ErrorCode::GatewayTimeout,
            s if s.is_client_error() => ErrorCode::BadRequest,
            _ => ErrorCode::Internal,
        }
    }
}

/// An error that knows its [`ErrorCode`].
pub trait ServiceError: std::error::Error {
    fn code(&self) -> ErrorCode;
}

impl ServiceError for RouteError {
    fn code(&self) -> ErrorCode {
        match self {
            RouteError::UnknownModel { .. } => ErrorCode::NotFound,
            RouteError::NoWorker { .. }
            | RouteError::UnknownWorker(_)
            | RouteError::Draining(_)
            | RouteError::UnknownRank { .. } => ErrorCode::Unavailable,
            RouteError::WrongModel { .. } => ErrorCode::BadRequest,
            RouteError::MissingBlockSize(_) | RouteError::BadPick { .. } => ErrorCode::Internal,
        }
    }
}

impl ServiceError for TransportError {
    fn code(&self) -> ErrorCode {
        match self {
            TransportError::Overloaded { .. } => ErrorCode::RateLimited,
            TransportError::Timeout(_) => ErrorCode::GatewayTimeout,
            TransportError::Unreachable(_)
            | TransportError::Sequence(_)
            | TransportError::Failed(_) => ErrorCode::BadGateway,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: [ErrorCode; 12] = [
        ErrorCode::BadRequest,
        ErrorCode::Unauthorized,
        ErrorCode::Forbidden,
        ErrorCode::NotFound,
        ErrorCode::RequestTimeout,
        ErrorCode::Conflict,
        ErrorCode::PayloadTooLarge,
        ErrorCode::RateLimited,
        ErrorCode::Internal,
        ErrorCode::BadGateway,
        ErrorCode::Unavailable,
        ErrorCode::GatewayTimeout,
    ];

    #[test]
    fn every_code_survives_its_own_status_and_statuses_fall_into_their_class() {
        for code in ALL {
            assert_eq!(ErrorCode::of_status(code.http_status()), code);
        }
        assert_eq!(
            ErrorCode::of_status(StatusCode::UNPROCESSABLE_ENTITY),
            ErrorCode::BadRequest
        );
        assert_eq!(
            ErrorCode::of_status(StatusCode::NOT_IMPLEMENTED),
            ErrorCode::Internal
        );
    }

    #[test]
    fn the_client_facing_names_are_the_sdks() {
        assert_eq!(ErrorCode::RateLimited.openai_type(), "RateLimitError");
        assert_eq!(ErrorCode::Unavailable.anthropic_type(), "overloaded_error");
        assert_eq!(ErrorCode::GatewayTimeout.anthropic_type(), "api_error");
        let timeout = TransportError::Timeout("quiet".into());
        assert_eq!(timeout.code().http_status(), StatusCode::GATEWAY_TIMEOUT);
        let unknown = RouteError::UnknownModel {
            model: "m".into(),
            served: Vec::new(),
        };
        assert_eq!(unknown.code(), ErrorCode::NotFound);
    }
}
