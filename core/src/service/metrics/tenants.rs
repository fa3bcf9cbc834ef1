//! Ours, per tenant (the key file's names, or `anonymous`; bounded by the file): requests by
//! outcome, refusals by limit, prompt and generated tokens served, and the router's queue
//! (waiters now, time waited, requests it turned away). A tenant's share of the fleet is
//! `rate(infera_tenant_generated_tokens_total[5m])` over the sum of all tenants'.

use super::{Hist, REQUEST_BUCKETS};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

type TenantLabel = [(&'static str, String); 1];
type TenantPair = [(&'static str, String); 2];

fn wait_histogram() -> Histogram {
    Histogram::new(REQUEST_BUCKETS)
}

/// The per-tenant families.
#[derive(Debug)]
pub(crate) struct TenantFamilies {
    requests: Family<TenantPair, Counter>,
    limited: Family<TenantPair, Counter>,
    prompt_tokens: Family<TenantLabel, Counter>,
    generated_tokens: Family<TenantLabel, Counter>,
    pub(crate) queue_waiting: Family<TenantLabel, Gauge>,
    queue_wait: Hist<TenantLabel>,
    queue_refused: Family<TenantPair, Counter>,
}

impl Default for TenantFamilies {
    fn default() -> Self {
        Self {
            requests: Family::default(),
            limited: Family::default(),
            prompt_tokens: Family::default(),
            generated_tokens: Family::default(),
            queue_waiting: Family::default(),
            queue_wait: Family::new_with_constructor(wait_histogram),
            queue_refused: Family::default(),
        }
    }
}

fn one(tenant: &str) -> TenantLabel {
    [("tenant", tenant.to_owned())]
}

impl TenantFamilies {
    pub(crate) fn register(&self, r: &mut Registry) {
        r.register(
            "infera_tenant_requests",
            "Finished requests by tenant and outcome (ok, client_error, worker_error, cancelled)",
            self.requests.clone(),
        );
        r.register(
            "infera_tenant_rate_limited",
            "Requests refused 429 by tenant and the limit that refused them",
            self.limited.clone(),
        );
        r.register(
            "infera_tenant_prompt_tokens",
            "Prompt tokens of requests sent to workers, by tenant",
            self.prompt_tokens.clone(),
        );
        r.register(
            "infera_tenant_generated_tokens",
            "Tokens the workers reported generating, by tenant",
            self.generated_tokens.clone(),
        );
        r.register(
            "infera_router_queue_waiting_requests",
            "Requests waiting in the router's queue for a saturated model, by tenant",
            self.queue_waiting.clone(),
        );
        r.register(
            "infera_router_queue_wait_seconds",
            "Time requests waited in the router's queue before their turn, by tenant",
            self.queue_wait.clone(),
        );
        r.register(
            "infera_router_queue_refused",
            "Requests the router's queue answered 503, by tenant and reason (full, timeout)",
            self.queue_refused.clone(),
        );
    }

    pub(crate) fn finished(
        &self,
        tenant: &str,
        outcome: &'static str,
        prompt: u64,
        generated: u64,
    ) {
        self.requests
            .get_or_create(&[
                ("tenant", tenant.to_owned()),
                ("outcome", outcome.to_owned()),
            ])
            .inc();
        if prompt > 0 {
            self.prompt_tokens
                .get_or_create(&one(tenant))
                .inc_by(prompt);
        }
        if generated > 0 {
            self.generated_tokens
                .get_or_create(&one(tenant))
                .inc_by(generated);
        }
    }

    pub(crate) fn limited(&self, tenant: &str, limit: &'static str) {
        self.limited
            .get_or_create(&[("tenant", tenant.to_owned()), ("limit", limit.to_owned())])
            .inc();
    }

    pub(crate) fn waited(&self, tenant: &str, seconds: f64) {
        self.queue_wait.get_or_create(&one(tenant)).observe(seconds);
    }

    pub(crate) fn refused(&self, tenant: &str, reason: &'static str) {
        self.queue_refused
            .get_or_create(&[("tenant", tenant.to_owned()), ("reason", reason.to_owned())])
            .inc();
    }
}
