//! Infera's backends: the plugins chosen by flags, behind core's ports (`infera_core::ports`) —
//! discovery (etcd, kubernetes), request transport (nats), KV-event transport (zmq, nats) and
//! durable event stores (JetStream, SQL). Backends contain no routing policy and depend on
//! `infera-core` only.
//!
//! Each backend is a Cargo feature, all on by default: `etcd`, `kubernetes`, `nats`, `zmq`,
//! `sql`. Opening a backend that was compiled out is an error naming its feature
//! ([`NotBuilt`]). `testsuite` adds [`testing`]: the harness that starts real services for
//! tests, and the conformance suites.

pub mod discovery;
pub mod log;
#[cfg(feature = "nats")]
pub mod nats;
#[cfg(feature = "testsuite")]
#[doc(hidden)]
pub mod testing;
#[cfg(feature = "zmq")]
pub mod zmq;

/// A backend named by configuration whose Cargo feature was not enabled in this build.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "the {backend} backend is not in this build: rebuild with the `{feature}` feature of infera-backends"
)]
pub struct NotBuilt {
    /// The backend as the user named it.
    pub backend: &'static str,
    /// The Cargo feature that builds it.
    pub feature: &'static str,
}
