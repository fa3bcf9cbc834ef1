//! The port every remote L4 store implements: [`RemoteStore`], batched operations on opaque
//! values under NUL-free string names. Deadlines, retries and the circuit breaker live in the
//! caller ([`super::L4`]); a store only reports what happened.

use super::frame::Framed;
use std::io;

/// Why a remote operation failed.
#[derive(Debug, thiserror::Error)]
pub enum RemoteError {
    /// Connecting, reading or writing failed.
    #[error("{0}")]
    Io(#[from] io::Error),
    /// The store answered something this client does not understand, or an error.
    #[error("{0}")]
    Protocol(String),
}

/// A remote store: see the module docs. Names are what [`super::name`] builds.
#[async_trait::async_trait]
pub trait RemoteStore: Send + Sync + std::fmt::Debug {
    /// The store's URL without credentials, for logs.
    fn describe(&self) -> String;

    /// The backend's name, as `--long-backend` spells it (`lmcache`, `mooncake`).
    fn backend(&self) -> &'static str;

    /// How many batches the store serves at once: the L4 spreads a batch of puts or gets over
    /// this many concurrent calls (the network stores keep a connection each; a store that
    /// serves one call at a time says 1, so a batch stays whole).
    fn streams(&self) -> usize {
        4
    }

    /// How many calls a batch of puts is spread over (by default [`RemoteStore::streams`]).
    fn write_streams(&self) -> usize {
        self.streams()
    }

    /// Another client of the same store, with connections of its own, for the L4's writer
    /// thread (a runtime of its own at a lower OS priority, so that checksumming and sending
    /// blocks never takes a core from the daemon's SETs). Its connections must never serve the
    /// daemon's runtime. `None` (the default: a store that serves one call at a time) keeps the
    /// writer a task on the daemon's runtime, sharing this client.
    fn twin(&self) -> Option<std::sync::Arc<dyn RemoteStore>> {
        None
    }

    /// Whether [`RemoteStore::put_batch`] seals the frames to seal ([`Framed::seal`]) itself,
    /// as it copies them out or writes them to a socket ([`super::frame::copy_to`],
    /// [`super::frame::write_to`]: one pass over each value instead of two, each piece
    /// checksummed from cache right before its copy). The L4's writer then leaves the
    /// trailers to the store. By default false: frames come sealed.
    fn seals(&self) -> bool {
        false
    }

    /// Whether the store answers at all (a cheap round trip).
    async fn health(&self) -> Result<(), RemoteError>;

    /// Writes each `(name, value)`; done when the store has answered every write. Returns the
    /// indices of the values it answered but did not keep (it is full, or the name is busy):
    /// the store is up, and a refused name holds no new value (it may still hold an older one,
    /// which the caller removes). A store that cannot be reached, or answers what this client
    /// does not understand, is an error.
    async fn put_batch(&self, items: &[(String, Framed)]) -> Result<Vec<usize>, RemoteError>;

    /// Reads each name: its value, or `None` when the store holds none (or only part of one).
    async fn get_batch(&self, names: &[String]) -> Result<Vec<Option<bytes::Bytes>>, RemoteError>;

    /// Whether the store holds a committed value under each name.
    async fn exists_batch(&self, names: &[String]) -> Result<Vec<bool>, RemoteError>;

    /// Removes each name's value (a store without deletes overwrites it with an empty value,
    /// which reads as a miss).
    async fn remove_batch(&self, names: &[String]) -> Result<(), RemoteError>;
}
