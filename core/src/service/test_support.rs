//! Fixtures shared by the service's unit tests: a service with no workers over a transport that
//! no test reaches, a worker record, and the fleet changes the edges make.

use super::{Service, ServiceOptions};
use crate::clock::SystemClock;
use crate::event::{Engine, Event, WorkerDeregistered, WorkerRecord, WorkerRegistered};
use crate::fleet::FleetConfig;
use crate::ids::WorkerId;
use crate::log::NewEvent;
use crate::policy::{PolicyKind, RouterConfig};
use crate::ports::transport::{Inbound, Outbound, RequestTransport, TransportError};
use async_trait::async_trait;
use std::sync::Arc;

/// A transport whose every worker is unreachable.
#[derive(Debug)]
struct Nowhere;

#[async_trait]
impl RequestTransport for Nowhere {
    fn name(&self) -> &'static str {
        "nowhere"
    }

    async fn send(&self, req: Outbound) -> Result<Inbound, TransportError> {
        Err(TransportError::Unreachable(format!(
            "{} is not reachable from a unit test",
            req.url
        )))
    }
}

/// A service with no workers and the default router.
pub(crate) fn state() -> Service {
    state_with(PolicyKind::default())
}

/// A service with no workers and the router's `policy`.
pub(crate) fn state_with(policy: PolicyKind) -> Service {
    let options = ServiceOptions {
        router: RouterConfig {
            policy,
            ..RouterConfig::default()
        },
        fleet: FleetConfig::default(),
        request_max_retries: 0,
        max_body_bytes: 1 << 16,
    };
    Service::new(options, Arc::new(Nowhere), Arc::new(SystemClock))
}

/// A vLLM worker `id` of model `m`, block size 16, one dp rank, HTTP transport.
pub(crate) fn record(id: &str) -> WorkerRecord {
    WorkerRecord::mixed(
        WorkerId::new(id),
        format!("http://{id}"),
        "m",
        Engine::Vllm,
        16,
    )
}

impl Service {
    /// Registers `record`, as discovery does.
    pub(crate) fn register_worker(&self, record: WorkerRecord) {
        self.apply(vec![NewEvent::new(Event::WorkerRegistered(
            WorkerRegistered { record },
        ))]);
    }

    /// Deregisters `worker`, as discovery does.
    pub(crate) fn deregister_worker(&self, worker: WorkerId, reason: String) {
        self.apply(vec![NewEvent::new(Event::WorkerDeregistered(
            WorkerDeregistered { worker, reason },
        ))]);
    }

    pub(crate) fn worker_count(&self) -> usize {
        self.with_fleet(|f| f.worker_count())
    }
}
