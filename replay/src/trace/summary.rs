//! [`summarize`]: the first statistics an operator wants from a trace, and a readable report.
//!
//! Definitions (they match `fixtures/traces/README.md`):
//! - span: last arrival − first arrival; rate: requests / span.
//! - percentiles: linear interpolation between closest ranks (numpy's default).
//! - ideal hit rate: requests are taken in arrival order (ties in file order); block `i` of a
//!   request is a hit if an earlier request had the same chained id at the same block size and
//!   model (ids are chained, so a set of seen ids is exact chain matching). Rate = hit blocks / all
//!   blocks; the token-weighted rate counts `min(hit blocks × block size, input_length)` tokens
//!   per request over all input tokens. The cache is unlimited and never evicts.

use super::Trace;
use rustc_hash::{FxHashMap, FxHashSet};
use std::fmt;

/// Mean, percentiles and maximum of a length distribution (tokens).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct LengthStats {
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: u32,
}

impl LengthStats {
    /// Statistics of `values` (any order); all zero when empty.
    pub fn of(values: &[u32]) -> Self {
        if values.is_empty() {
            return Self::default();
        }
        let mut sorted = values.to_vec();
        sorted.sort_unstable();
        let sum: u64 = sorted.iter().map(|&v| u64::from(v)).sum();
        Self {
            mean: sum as f64 / sorted.len() as f64,
            p50: percentile(&sorted, 0.50),
            p90: percentile(&sorted, 0.90),
            p99: percentile(&sorted, 0.99),
            max: sorted[sorted.len() - 1],
        }
    }
}

/// The `q` quantile (0..=1) of sorted values by linear interpolation; 0 when empty.
pub fn percentile(sorted: &[u32], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let pos = q.clamp(0.0, 1.0) * (sorted.len() - 1) as f64;
    let lo = pos.floor() as usize;
    let hi = pos.ceil() as usize;
    let (a, b) = (f64::from(sorted[lo]), f64::from(sorted[hi]));
    a + (b - a) * (pos - lo as f64)
}

/// What [`summarize`] found; `Display` prints a report.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceSummary {
    pub source: String,
    pub requests: usize,
    /// Last arrival − first arrival, seconds.
    pub span_s: f64,
    /// Requests per second over the span; `None` when the span is zero.
    pub rate_per_s: Option<f64>,
    pub input: LengthStats,
    pub output: LengthStats,
    /// Distinct block sizes, ascending.
    pub block_sizes: Vec<u32>,
    pub blocks_total: u64,
    pub blocks_distinct: u64,
    pub hit_blocks: u64,
    /// Ideal hit rate with an unlimited cache, by blocks (0..=1).
    pub ideal_hit_rate: f64,
    /// Ideal hit rate weighted by tokens (0..=1).
    pub ideal_token_hit_rate: f64,
    /// Requests with at least one hit block.
    pub requests_with_hit: usize,
    pub notes: Vec<String>,
}

/// Summarizes a trace (see the module docs for the definitions). Never panics; an empty trace
/// gives zeros.
pub fn summarize(trace: &Trace) -> TraceSummary {
    let reqs = &trace.requests;
    let mut order: Vec<usize> = (0..reqs.len()).collect();
    // Stable: ties keep file order.
    order.sort_by_key(|&i| reqs[i].arrival_us);

    let mut models: FxHashMap<&str, u32> = FxHashMap::default();
    let mut seen: FxHashSet<(u32, u32, u64)> = FxHashSet::default();
    let (mut total, mut hits, mut hit_tokens, mut input_tokens) = (0u64, 0u64, 0u64, 0u64);
    let mut requests_with_hit = 0;
    let mut block_sizes: Vec<u32> = Vec::new();
    for &i in &order {
        let r = &reqs[i];
        let next_model = models.len() as u32;
        let model = *models.entry(r.model.as_str()).or_insert(next_model);
        if !block_sizes.contains(&r.block_size) {
            block_sizes.push(r.block_size);
        }
        // As the engines key them: the same blocks under another adapter or salt are others.
        let blocks = r.engine_blocks();
        let hit = blocks
            .iter()
            .filter(|&&h| seen.contains(&(model, r.block_size, h)))
            .count() as u64;
        seen.extend(blocks.iter().map(|&h| (model, r.block_size, h)));
        total += r.block_hashes.len() as u64;
        hits += hit;
        hit_tokens += (hit * u64::from(r.block_size)).min(u64::from(r.input_length));
        input_tokens += u64::from(r.input_length);
        requests_with_hit += usize::from(hit > 0);
    }
    block_sizes.sort_unstable();

    let first = order.first().map_or(0, |&i| reqs[i].arrival_us);
    let last = order.last().map_or(0, |&i| reqs[i].arrival_us);
    let span_s = (last - first) as f64 / 1e6;
    let ratio = |a: u64, b: u64| if b == 0 { 0.0 } else { a as f64 / b as f64 };
    let inputs: Vec<u32> = reqs.iter().map(|r| r.input_length).collect();
    let outputs: Vec<u32> = reqs.iter().map(|r| r.output_length).collect();
    TraceSummary {
        source: trace.source.clone(),
        requests: reqs.len(),
        span_s,
        rate_per_s: (span_s > 0.0).then(|| reqs.len() as f64 / span_s),
        input: LengthStats::of(&inputs),
        output: LengthStats::of(&outputs),
        block_sizes,
        blocks_total: total,
        blocks_distinct: seen.len() as u64,
        hit_blocks: hits,
        ideal_hit_rate: ratio(hits, total),
        ideal_token_hit_rate: ratio(hit_tokens, input_tokens),
        requests_with_hit,
        notes: trace.notes.clone(),
    }
}

/// `1234567` → `1,234,567`.
fn thousands(v: u64) -> String {
    let digits = v.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn tokens(v: f64) -> String {
    thousands(v.round().max(0.0) as u64)
}

impl fmt::Display for LengthStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "mean {}  p50 {}  p90 {}  p99 {}  max {}",
            tokens(self.mean),
            tokens(self.p50),
            tokens(self.p90),
            tokens(self.p99),
            thousands(u64::from(self.max))
        )
    }
}

impl fmt::Display for TraceSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let pct = |x: f64| x * 100.0;
        writeln!(f, "trace           {}", self.source)?;
        writeln!(f, "requests        {}", thousands(self.requests as u64))?;
        writeln!(
            f,
            "span            {:.3} s ({:.1} min)",
            self.span_s,
            self.span_s / 60.0
        )?;
        match self.rate_per_s {
            Some(r) => writeln!(f, "rate            {r:.2} req/s")?,
            None => writeln!(f, "rate            n/a (all arrivals at one instant)")?,
        }
        writeln!(f, "input tokens    {}", self.input)?;
        writeln!(f, "output tokens   {}", self.output)?;
        let sizes: Vec<String> = self.block_sizes.iter().map(u32::to_string).collect();
        writeln!(
            f,
            "blocks          {} total, {} distinct (block size {})",
            thousands(self.blocks_total),
            thousands(self.blocks_distinct),
            sizes.join(", ")
        )?;
        let with_hit = if self.requests == 0 {
            0.0
        } else {
            self.requests_with_hit as f64 / self.requests as f64
        };
        writeln!(
            f,
            "ideal hit rate  {:.1} % of blocks ({:.1} % of tokens), unlimited cache in arrival \
             order; {:.2} % of requests hit at least one block",
            pct(self.ideal_hit_rate),
            pct(self.ideal_token_hit_rate),
            pct(with_hit)
        )?;
        if !self.notes.is_empty() {
            writeln!(f, "notes")?;
            for note in &self.notes {
                writeln!(f, "  - {note}")?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::TraceRequest;
    use super::*;

    fn req(arrival_us: u64, input_length: u32, block_hashes: Vec<u64>) -> TraceRequest {
        TraceRequest {
            arrival_us,
            request_id: format!("r{arrival_us}"),
            model: "m".into(),
            input_length,
            output_length: 1,
            block_size: 4,
            block_hashes,
            token_ids: None,
            session_id: None,
            retention: None,
            ttl_seconds: None,
            think_time_us: None,
            lora: None,
            cache_salt: None,
            images: Vec::new(),
            tenant: None,
            priority: None,
        }
    }

    #[test]
    fn percentiles_interpolate_linearly() {
        assert_eq!(percentile(&[], 0.5), 0.0);
        assert_eq!(percentile(&[7], 0.99), 7.0);
        assert_eq!(percentile(&[1, 2, 3, 4], 0.5), 2.5);
        assert!((percentile(&[0, 10], 0.99) - 9.9).abs() < 1e-9);
        let s = LengthStats::of(&[4, 1, 3, 2]);
        assert_eq!((s.mean, s.p50, s.max), (2.5, 2.5, 4));
    }

    #[test]
    fn hit_rate_counts_blocks_seen_in_earlier_requests_only() {
        let trace = Trace {
            requests: vec![
                // Repeats inside one request are not hits.
                req(0, 12, vec![1, 2, 2]),
                req(1_000_000, 10, vec![1, 2, 3]),
                req(2_000_000, 5, vec![1, 9]),
            ],
            source: "t".into(),
            notes: vec![],
        };
        let s = summarize(&trace);
        assert_eq!((s.blocks_total, s.blocks_distinct, s.hit_blocks), (8, 4, 3));
        assert_eq!(s.requests_with_hit, 2);
        assert!((s.ideal_hit_rate - 3.0 / 8.0).abs() < 1e-12);
        // tokens: min(2*4, 10) + min(1*4, 5) = 12 of 27.
        assert!((s.ideal_token_hit_rate - 12.0 / 27.0).abs() < 1e-12);
        assert_eq!(s.span_s, 2.0);
        assert_eq!(s.rate_per_s, Some(1.5));
        assert!(s.to_string().contains("37.5 % of blocks"), "{s}");
    }

    #[test]
    fn ties_are_taken_in_file_order_and_unsorted_input_is_sorted() {
        let trace = Trace {
            requests: vec![req(5, 4, vec![1]), req(0, 4, vec![1]), req(5, 4, vec![1])],
            source: "t".into(),
            notes: vec![],
        };
        let s = summarize(&trace);
        assert_eq!(s.hit_blocks, 2);
    }

    #[test]
    fn empty_trace_summarizes_to_zeros() {
        let s = summarize(&Trace {
            requests: vec![],
            source: "e".into(),
            notes: vec![],
        });
        assert_eq!((s.requests, s.blocks_total, s.rate_per_s), (0, 0, None));
        assert!(s.to_string().contains("n/a"));
    }

    #[test]
    fn thousands_separators() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(1000), "1,000");
        assert_eq!(thousands(1234567), "1,234,567");
    }
}
