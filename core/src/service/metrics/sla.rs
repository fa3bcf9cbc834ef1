//! The SLA planner's histograms (`--enable-sla-metrics`), with the Python Infera's names,
//! labels and buckets: TTFT, inter-token latency, input and output lengths per router and model.

use super::Hist;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;

/// Buckets of the SLA planner's histograms (`--enable-sla-metrics`).
const TTFT_BUCKETS: [f64; 11] = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0];
const ITL_BUCKETS: [f64; 10] = [
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 1.0,
];
const ISL_BUCKETS: [f64; 8] = [
    64.0, 256.0, 1024.0, 4096.0, 16384.0, 65536.0, 262144.0, 1048576.0,
];
const OSL_BUCKETS: [f64; 8] = [4.0, 16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0, 65536.0];

fn ttft_histogram() -> Histogram {
    Histogram::new(TTFT_BUCKETS)
}
fn itl_histogram() -> Histogram {
    Histogram::new(ITL_BUCKETS)
}
fn isl_histogram() -> Histogram {
    Histogram::new(ISL_BUCKETS)
}
fn osl_histogram() -> Histogram {
    Histogram::new(OSL_BUCKETS)
}

/// `router` and `model`.
pub type SlaLabel = [(&'static str, String); 2];

/// The SLA planner's four histograms (`--enable-sla-metrics`).
#[derive(Debug)]
pub(crate) struct SlaFamilies {
    pub(crate) ttft: Hist<SlaLabel>,
    pub(crate) itl: Hist<SlaLabel>,
    pub(crate) isl: Hist<SlaLabel>,
    pub(crate) osl: Hist<SlaLabel>,
}

impl Default for SlaFamilies {
    fn default() -> Self {
        SlaFamilies {
            ttft: Family::new_with_constructor(ttft_histogram),
            itl: Family::new_with_constructor(itl_histogram),
            isl: Family::new_with_constructor(isl_histogram),
            osl: Family::new_with_constructor(osl_histogram),
        }
    }
}

/// What one successful request showed, for the SLA histograms.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SlaSample {
    /// Dispatch to first token, for a streamed reply.
    pub(crate) ttft_s: Option<f64>,
    /// Dispatch to the last byte.
    pub(crate) total_s: f64,
    pub(crate) input_tokens: u32,
    pub(crate) output_tokens: u32,
}

impl SlaFamilies {
    /// Observes one successful request as the Python Infera does: ISL and OSL when known, and
    /// for a streamed reply its TTFT and, over two or more tokens, the mean gap after it.
    pub(crate) fn observe(&self, router: &'static str, model: &str, s: SlaSample) {
        let label = [("router", router.to_owned()), ("model", model.to_owned())];
        if s.input_tokens > 0 {
            self.isl
                .get_or_create(&label)
                .observe(f64::from(s.input_tokens));
        }
        if s.output_tokens > 0 {
            self.osl
                .get_or_create(&label)
                .observe(f64::from(s.output_tokens));
        }
        let Some(ttft) = s.ttft_s else { return };
        self.ttft.get_or_create(&label).observe(ttft);
        if s.output_tokens > 1 {
            let decode = (s.total_s - ttft).max(0.0);
            self.itl
                .get_or_create(&label)
                .observe(decode / f64::from(s.output_tokens - 1));
        }
    }
}
