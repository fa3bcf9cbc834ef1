//! Infera's backends: the plugins chosen by flags, behind core's ports — discovery (etcd,
//! kubernetes), request transport (http, nats), KV-event transport (zmq, nats), durable event
//! stores (JetStream, SQL) and remote L4 cache stores. Backends contain no routing policy.
pub mod discovery;
pub mod log;
pub mod nats;
#[doc(hidden)]
pub mod testing;
pub mod zmq;
