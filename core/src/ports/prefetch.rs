//! The prefetch port: where the server's `POST /v1/cache/prewarm` hints go (the kvd client, in
//! the server binary; PROTOCOLS.md §4).

use async_trait::async_trait;

/// Why a hint was not delivered.
#[derive(Debug, thiserror::Error)]
pub enum PrefetchError {
    /// The daemon could not be reached, or its connection failed (retryable).
    #[error("the kv-cache daemon is unavailable: {0}")]
    Unavailable(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The daemon did not answer within the call's deadline (retryable).
    #[error("the kv-cache daemon did not answer within {0} ms")]
    Timeout(u64),
}

/// Where prefetch hints go.
#[async_trait]
pub trait KvPrefetch: Send + Sync + std::fmt::Debug {
    /// Sends one hint: promote `keys` of the namespace `(model, compat_key)` within
    /// `deadline_ms`. Fire and forget: the daemon drops a hint whose deadline passed.
    ///
    /// # Errors
    /// [`PrefetchError`] when the hint did not reach the daemon.
    async fn prefetch(
        &self,
        model: &str,
        compat_key: &str,
        keys: Vec<Vec<u8>>,
        deadline_ms: u64,
    ) -> Result<(), PrefetchError>;
}
