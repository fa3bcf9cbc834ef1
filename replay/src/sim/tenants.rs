//! The server's tenancy in the simulator: each request of the trace's `tenant` column is
//! admitted by its tenant's limits from `--api-keys` (the server's `Usage`, on the virtual
//! clock), and queued at its own priority (bounded by its tenant's floor, else the tenant's
//! default) and its tenant's weight.
//!
//! A request a limit refuses is answered 429 at once, as the server does before the router's
//! queue: it is counted as rejected, with the limit's name, and a session's next turn follows
//! it. An admitted request holds its tenant's concurrency until it finishes, and is charged
//! its generated tokens then. The key file is parsed afresh for every run, so each
//! configuration of a sweep starts with full buckets.

use super::SimError;
use crate::trace::TraceRequest;
use infera_core::clock::Micros;
use infera_core::tenancy::limits::Permit;
use infera_core::tenancy::{ANONYMOUS, Tenant, Tenants};
use std::sync::Arc;

/// Where a request waits in the router's queue.
#[derive(Debug, Clone)]
pub(super) struct Place {
    pub(super) tenant: Arc<str>,
    pub(super) weight: u32,
    pub(super) priority: i32,
}

/// The tenants of one run and the permits of its requests in flight.
#[derive(Debug)]
pub(super) struct Gate {
    tenants: Option<Tenants>,
    /// `--tenant-weight`: overrides the key file's weight.
    weights: Vec<(String, u32)>,
    permits: Vec<Option<Permit>>,
}

impl Gate {
    /// The gate of a run of `n` requests.
    ///
    /// # Errors
    /// The key file is not valid.
    pub(super) fn new(
        keys: Option<&str>,
        weights: &[(String, u32)],
        n: usize,
    ) -> Result<Self, SimError> {
        let tenants = keys
            .map(|text| Tenants::parse(text, None, 0))
            .transpose()
            .map_err(|e| SimError::Invalid(format!("--api-keys: {e}")))?;
        Ok(Self {
            tenants,
            weights: weights.to_vec(),
            permits: (0..n).map(|_| None).collect(),
        })
    }

    /// Admits request `i` at `now` by its tenant's limits; its place in the queue, or the name
    /// of the limit that refused it.
    pub(super) fn admit(
        &mut self,
        i: usize,
        r: &TraceRequest,
        now: Micros,
    ) -> Result<Place, &'static str> {
        let name = r.tenant.as_deref().unwrap_or(ANONYMOUS);
        let tenant: Option<&Arc<Tenant>> = self.tenants.as_ref().and_then(|t| t.named(name));
        if let Some(t) = tenant.filter(|t| t.limits.any()) {
            let permit = t
                .usage
                .admit(now, u64::from(r.input_length), 1)
                .map_err(|refusal| refusal.limit.as_str())?;
            self.permits[i] = Some(permit);
        }
        let weight = self
            .weights
            .iter()
            .find(|(t, _)| t == name)
            .map(|(_, w)| *w)
            .or(tenant.map(|t| t.weight))
            .unwrap_or(1);
        Ok(Place {
            tenant: tenant.map_or_else(|| Arc::from(name), |t| Arc::clone(&t.name)),
            weight,
            // As the server: the request's own priority, bounded by its tenant's floor.
            priority: tenant.map_or(r.priority.unwrap_or(0), |t| t.priority(r.priority)),
        })
    }

    /// Request `i` finished at `now` having generated `tokens`: charged, its concurrency freed.
    pub(super) fn finish(&mut self, i: usize, now: Micros, tokens: u64) {
        if let Some(permit) = self.permits[i].take() {
            permit.generated(now, tokens);
        }
    }
}
