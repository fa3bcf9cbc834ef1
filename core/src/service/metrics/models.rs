//! Ours, per served model (a base model or an adapter, as the request named it): requests by
//! status, the time to the client's first byte, and the prompt blocks the router saw and
//! predicted cached. A fleet serving several models reads each one's traffic, latency and
//! cache hit rate apart: `infera_model_predicted_cached_blocks_total / infera_model_prompt_blocks_total`.
//! Model names are bounded: only models some worker serves reach a decision.

use super::{Hist, REQUEST_BUCKETS};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// `model`.
pub type ModelLabel = [(&'static str, String); 1];

fn first_byte_histogram() -> Histogram {
    Histogram::new(REQUEST_BUCKETS)
}

/// The per-model families.
#[derive(Debug)]
pub(crate) struct ModelFamilies {
    requests: Family<[(&'static str, String); 2], Counter>,
    first_byte: Hist<ModelLabel>,
    prompt_blocks: Family<ModelLabel, Counter>,
    predicted_blocks: Family<ModelLabel, Counter>,
}

impl Default for ModelFamilies {
    fn default() -> Self {
        Self {
            requests: Family::default(),
            first_byte: Family::new_with_constructor(first_byte_histogram),
            prompt_blocks: Family::default(),
            predicted_blocks: Family::default(),
        }
    }
}

impl ModelFamilies {
    pub(crate) fn register(&self, r: &mut Registry) {
        r.register(
            "infera_model_requests",
            "Finished requests by model and status",
            self.requests.clone(),
        );
        r.register(
            "infera_model_time_to_first_byte_seconds",
            "Dispatch to the client's first byte (the first token of a stream), by model",
            self.first_byte.clone(),
        );
        r.register(
            "infera_model_prompt_blocks",
            "Complete prompt blocks of routed requests, by model",
            self.prompt_blocks.clone(),
        );
        r.register(
            "infera_model_predicted_cached_blocks",
            "Of those, the blocks the router predicted cached on the chosen worker, by model",
            self.predicted_blocks.clone(),
        );
    }

    /// A routing decision for `model`: `blocks` prompt blocks, `hits` of them predicted cached.
    pub(crate) fn routed(&self, model: &str, blocks: usize, hits: u32) {
        let label = [("model", model.to_owned())];
        self.prompt_blocks
            .get_or_create(&label)
            .inc_by(blocks as u64);
        self.predicted_blocks
            .get_or_create(&label)
            .inc_by(u64::from(hits));
    }

    /// The client's first byte for a request of `model`, `seconds` after dispatch.
    pub(crate) fn first_byte(&self, model: &str, seconds: f64) {
        self.first_byte
            .get_or_create(&[("model", model.to_owned())])
            .observe(seconds);
    }

    /// A finished request of `model` with `status` (`ok`, `client_error`, …).
    pub(crate) fn finished(&self, model: &str, status: &'static str) {
        self.requests
            .get_or_create(&[("model", model.to_owned()), ("status", status.to_owned())])
            .inc();
    }
}
