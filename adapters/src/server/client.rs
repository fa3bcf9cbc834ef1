//! What the server asks of its clients: the connection deadlines and cap of the serve loop
//! ([`crate::serve`]), the memory budget of request parsing (the private `body` module) and the
//! admin token.
//!
//! # Admin token
//! With [`ClientOptions::admin_token`] set, the admin endpoints (`/v1/admin/*`) and the workers
//! view (`/v1/workers`, which lists every worker's URL) require `Authorization: Bearer <token>`;
//! a missing or wrong token is answered 401 with an OpenAI error body
//! (`"type": "AuthenticationError"`) and `WWW-Authenticate: Bearer`. The token is compared in
//! constant time (its length aside). Every other route is unchanged, and without a token
//! configured nothing is asked.

use super::ServerState;
use super::http::ApiError;
use crate::serve::ServeLimits;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse as _, Response};
use infera_core::event::Retention;
use std::fmt;
use std::sync::Arc;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The client-facing bounds of the server.
#[derive(Debug, Clone, Default)]
pub struct ClientOptions {
    /// Connection deadlines and cap (`--client-header-timeout`, `--client-idle-timeout`,
    /// `--client-body-timeout`, `--max-connections`).
    pub limits: ServeLimits,
    /// The bearer token of the admin endpoints (`--admin-token`); `None` leaves them open.
    pub admin_token: Option<AdminToken>,
    /// Bytes of request bodies being read and parsed at once (`--parse-budget`).
    pub parse_budget: ParseBudget,
    /// The retention stamped on a request that asks for none (`--default-retention`).
    pub default_retention: Retention,
    /// The tenants and their keys (`--api-keys`); `None`: no key is asked for, every request
    /// is the anonymous tenant's.
    pub api_keys: Option<super::tenants::KeyStore>,
}

/// A bearer token; never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct AdminToken(Arc<str>);

impl AdminToken {
    /// Wraps `token` (as configured; the caller checks it is usable in a header).
    pub fn new(token: &str) -> Self {
        Self(Arc::from(token))
    }

    /// Whether `presented` is this token; takes the same time wherever they differ.
    fn matches(&self, presented: &[u8]) -> bool {
        let expected = self.0.as_bytes();
        if expected.len() != presented.len() {
            return false;
        }
        let diff = expected
            .iter()
            .zip(presented)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b));
        std::hint::black_box(diff) == 0
    }
}

impl fmt::Debug for AdminToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("AdminToken(<redacted>)")
    }
}

/// Bytes of request bodies in parse at once, server-wide: a body is charged as its bytes
/// arrive and released when it is parsed; one that does not fit is answered 503 with
/// `Retry-After` (see the private `body` module). Clones share the budget.
#[derive(Debug, Clone)]
pub struct ParseBudget {
    bytes: usize,
    permits: Option<Arc<Semaphore>>,
}

impl ParseBudget {
    /// The default: 512 MiB.
    pub const DEFAULT_BYTES: usize = 512 << 20;

    /// A budget of `bytes`; 0 is unlimited.
    pub fn new(bytes: usize) -> Self {
        let bytes = bytes.min(Semaphore::MAX_PERMITS);
        Self {
            bytes,
            permits: (bytes > 0).then(|| Arc::new(Semaphore::new(bytes))),
        }
    }

    /// The budget in bytes; 0 is unlimited.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Charges `n` more bytes to `held`; `false` when they do not fit now.
    pub(super) fn charge(&self, held: &mut Option<OwnedSemaphorePermit>, n: usize) -> bool {
        let Some(permits) = &self.permits else {
            return true;
        };
        let Ok(n) = u32::try_from(n) else {
            return false;
        };
        match Arc::clone(permits).try_acquire_many_owned(n) {
            Ok(more) => {
                match held {
                    Some(p) => p.merge(more),
                    None => *held = Some(more),
                }
                true
            }
            Err(_) => false,
        }
    }
}

impl Default for ParseBudget {
    fn default() -> Self {
        Self::new(Self::DEFAULT_BYTES)
    }
}

/// The admin routes' guard (see the module docs).
pub(super) async fn require_admin(
    State(st): State<ServerState>,
    req: Request,
    next: Next,
) -> Response {
    let Some(token) = &st.inner.options.client.admin_token else {
        return next.run(req).await;
    };
    let presented = req
        .headers()
        .get(header::AUTHORIZATION)
        .map(HeaderValue::as_bytes)
        .and_then(|v| v.strip_prefix(b"Bearer ").map(<[u8]>::trim_ascii));
    match presented {
        Some(p) if token.matches(p) => next.run(req).await,
        presented => {
            let message = if presented.is_none() {
                "this endpoint needs the server's admin token: send Authorization: Bearer <token>"
            } else {
                "the admin token is wrong"
            };
            tracing::debug!(path = %req.uri().path(), "admin request refused");
            let mut resp = ApiError::new(StatusCode::UNAUTHORIZED, message).into_response();
            resp.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            resp
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_match_only_themselves_and_never_print() {
        let t = AdminToken::new("s3cret");
        assert!(t.matches(b"s3cret"));
        assert!(!t.matches(b"s3cres"));
        assert!(!t.matches(b"s3cret "));
        assert!(!t.matches(b""));
        assert!(!format!("{t:?}").contains("s3cret"));
    }

    #[test]
    fn a_budget_charges_until_full_and_frees_what_is_dropped() {
        let budget = ParseBudget::new(100);
        let mut a = None;
        assert!(budget.charge(&mut a, 60));
        assert!(budget.charge(&mut a, 30));
        let mut b = None;
        assert!(!budget.charge(&mut b, 20));
        drop(a);
        assert!(budget.charge(&mut b, 100));
        let mut c = None;
        assert!(ParseBudget::new(0).charge(&mut c, usize::MAX));
    }
}
