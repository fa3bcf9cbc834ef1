//! The router's queue: when every worker of a model is saturated, requests wait in the router
//! instead of piling up in the engines' queues, and leave in a fair order.
//!
//! # Saturation
//! A rank is saturated when the prompt tokens routed to it and not yet prefilled (the fleet's
//! `queued_prefill_tokens`, which counts every replica's requests) reach
//! [`QueueConfig::threshold`] times its prefill budget: the tokens its engine prefills in one
//! step (`max_num_batched_tokens` in its registration, vLLM's default of 8192 when absent).
//! A model whose every candidate rank is saturated queues new requests; so does a model that
//! already has waiters, so nobody overtakes them. Dynamo's router queues on the same signal
//! (`router_queue_threshold`, a fraction of `max_num_batched_tokens`).
//!
//! # Order and release
//! Waiters are ordered by [`crate::tenancy::queue::FairQueue`]: priority first, then weighted
//! fair share of prompt tokens between tenants. Whenever an event is committed while someone
//! waits (a prefill done, a request finished, a worker registered), the queue is pumped: while
//! a model has room, its next waiter is released — one at a time per model, the next only
//! after the released one's decision is committed, so a burst of releases never overshoots
//! the room it was released into. A waiter that gives up (client gone, or past
//! [`QueueConfig::timeout`], answered 503 with `Retry-After`) leaves the queue; past
//! [`QueueConfig::max_waiting`] waiters a new request is answered 503 at once. Streams already
//! admitted are never cut.

use super::Service;
use super::reply::RequestError;
use crate::error::ErrorCode;
use crate::tenancy::queue::{FairQueue, Place, QUANTUM};
use crate::tenancy::{Permit, Tenant};
use rustc_hash::FxHashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

/// When the router queues, and for how long. See the module docs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct QueueConfig {
    /// Queue when every rank's unprefilled tokens reach this many prefill budgets; `None`:
    /// never queue (`--router-queue-threshold off`).
    pub threshold: Option<f64>,
    /// The longest a request waits before it is answered 503.
    pub timeout: Duration,
    /// Waiters at most, over all models; past it a request is answered 503 at once.
    pub max_waiting: usize,
}

impl Default for QueueConfig {
    /// Four prefill budgets (Dynamo's default `router_queue_threshold`), 60 s, 10,000 waiters.
    fn default() -> Self {
        Self {
            threshold: Some(4.0),
            timeout: Duration::from_secs(60),
            max_waiting: 10_000,
        }
    }
}

/// Whose a request is: its place in the queue (tenant, the tenant's weight, its priority) and
/// the tenant's hold on its limits, which the attempt that answers charges the generated
/// tokens to.
#[derive(Debug, Clone)]
pub struct Share {
    pub tenant: Arc<str>,
    pub weight: u32,
    pub priority: i32,
    pub permit: Option<Arc<Permit>>,
}

impl Share {
    /// A request of `tenant` at `priority` (already within the tenant's floor), holding
    /// `permit`.
    pub fn of(tenant: &Tenant, priority: i32, permit: Option<Permit>) -> Self {
        Share {
            tenant: Arc::clone(&tenant.name),
            weight: tenant.weight,
            priority,
            permit: permit.map(Arc::new),
        }
    }
}

impl Default for Share {
    fn default() -> Self {
        Share {
            tenant: Arc::from(crate::tenancy::ANONYMOUS),
            weight: 1,
            priority: 0,
            permit: None,
        }
    }
}

#[derive(Debug)]
struct ModelQueue {
    queue: FairQueue<oneshot::Sender<()>>,
    /// The waiter released and not yet decided for.
    released: Option<Place>,
}

#[derive(Debug, Default)]
struct Waiting {
    models: FxHashMap<String, ModelQueue>,
}

/// The queue's state. See the module docs.
#[derive(Debug)]
pub(crate) struct Admission {
    config: Mutex<QueueConfig>,
    waiting: Mutex<Waiting>,
    /// Requests waiting, over all models (read without the lock on every commit).
    count: AtomicUsize,
}

impl Default for Admission {
    fn default() -> Self {
        Admission {
            config: Mutex::new(QueueConfig::default()),
            waiting: Mutex::new(Waiting::default()),
            count: AtomicUsize::new(0),
        }
    }
}

impl Admission {
    fn waiting(&self) -> MutexGuard<'_, Waiting> {
        self.waiting.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn config(&self) -> QueueConfig {
        *self.config.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Requests waiting now.
    pub(crate) fn len(&self) -> usize {
        self.count.load(Ordering::Relaxed)
    }

    /// Waiters per tenant, for the metrics.
    pub(crate) fn by_tenant(&self) -> FxHashMap<Arc<str>, usize> {
        let mut out: FxHashMap<Arc<str>, usize> = FxHashMap::default();
        for mq in self.waiting().models.values() {
            for (t, n) in mq.queue.waiting_by_tenant() {
                *out.entry(t).or_default() += n;
            }
        }
        out
    }
}

/// A request let through the queue, or waiting in it. Dropping it before the request's
/// decision is committed gives its turn to the next waiter.
#[derive(Debug)]
pub struct Admitted {
    st: Service,
    model: String,
    place: Place,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        let adm = &self.st.inner.admission;
        let mut w = adm.waiting();
        let Some(mq) = w.models.get_mut(&self.model) else {
            return;
        };
        if mq.queue.remove(self.place).is_some() {
            adm.count.fetch_sub(1, Ordering::Relaxed);
        } else if mq.released == Some(self.place) {
            mq.released = None;
        }
        if mq.queue.is_empty() && mq.released.is_none() {
            w.models.remove(&self.model);
        }
        let pump = adm.len() > 0;
        drop(w);
        if pump {
            self.st.pump();
        }
    }
}

impl Service {
    /// Replaces the queue's configuration.
    pub fn set_queue(&self, config: QueueConfig) {
        *self
            .inner
            .admission
            .config
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = config;
    }

    /// Requests waiting in the router's queue.
    pub fn queued(&self) -> usize {
        self.inner.admission.len()
    }

    /// Counts a request of `tenant` refused by `limit` (the edge checks the limits).
    pub fn rate_limited(&self, tenant: &str, limit: crate::tenancy::Limit) {
        self.inner.metrics.tenants.limited(tenant, limit.as_str());
    }

    /// Lets a request for `model` costing `cost` prompt tokens through, at once when the model
    /// has room and nobody waits, else when its turn comes. Hold the result until the
    /// request's decision is committed. See the module docs.
    ///
    /// # Errors
    /// 503 with `Retry-After` when the queue is full or the wait passed its timeout.
    pub async fn admit(
        &self,
        model: &str,
        share: &Share,
        cost: u64,
    ) -> Result<Option<Admitted>, RequestError> {
        let adm = &self.inner.admission;
        let config = adm.config();
        let Some(threshold) = config.threshold else {
            return Ok(None);
        };
        let (rx, admitted) = {
            let plane = self.lock();
            let mut w = adm.waiting();
            let busy = w
                .models
                .get(model)
                .is_some_and(|m| m.released.is_some() || !m.queue.is_empty());
            if !busy && plane.kernel.fleet().has_room(model, threshold) {
                return Ok(None);
            }
            if adm.len() >= config.max_waiting {
                self.inner.metrics.tenants.refused(&share.tenant, "full");
                return Err(unavailable(format!(
                    "the router's queue is full ({} requests wait for saturated workers)",
                    config.max_waiting
                )));
            }
            let (tx, rx) = oneshot::channel();
            let mq = w
                .models
                .entry(model.to_owned())
                .or_insert_with(|| ModelQueue {
                    queue: FairQueue::new(QUANTUM),
                    released: None,
                });
            let place = mq
                .queue
                .push(share.priority, &share.tenant, share.weight, cost, tx);
            adm.count.fetch_add(1, Ordering::Relaxed);
            let admitted = Admitted {
                st: self.clone(),
                model: model.to_owned(),
                place,
            };
            (rx, admitted)
        };
        let started = Instant::now();
        let released = tokio::time::timeout(config.timeout, rx).await;
        let waited = started.elapsed().as_secs_f64();
        match released {
            Ok(Ok(())) => {
                self.inner.metrics.tenants.waited(&share.tenant, waited);
                Ok(Some(admitted))
            }
            _ => {
                // `admitted` leaves the queue as it drops.
                self.inner.metrics.tenants.refused(&share.tenant, "timeout");
                Err(unavailable(format!(
                    "every worker of {model} stayed saturated for {} s; try again later",
                    config.timeout.as_secs()
                )))
            }
        }
    }

    /// Releases waiters while their models have room (see the module docs).
    pub(crate) fn pump(&self) {
        let adm = &self.inner.admission;
        let Some(threshold) = adm.config().threshold else {
            return;
        };
        let plane = self.lock();
        let fleet = plane.kernel.fleet();
        let mut w = adm.waiting();
        for (model, mq) in &mut w.models {
            while mq.released.is_none() && !mq.queue.is_empty() && fleet.has_room(model, threshold)
            {
                let Some((place, tx)) = mq.queue.pop_with_place() else {
                    break;
                };
                adm.count.fetch_sub(1, Ordering::Relaxed);
                if tx.send(()).is_ok() {
                    mq.released = Some(place);
                }
            }
        }
        w.models
            .retain(|_, mq| !mq.queue.is_empty() || mq.released.is_some());
    }
}

fn unavailable(message: String) -> RequestError {
    RequestError {
        retry_after_s: Some(2),
        ..RequestError::new(ErrorCode::Unavailable, message)
    }
}
