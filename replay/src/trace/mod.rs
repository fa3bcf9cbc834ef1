//! Request traces: the versioned format `infera replay` reads, its Parquet encoding, and importers
//! for public traces.
//!
//! A [`Trace`] is a list of [`TraceRequest`]s sorted by arrival, plus a source description and
//! human-readable notes (what an importer did to the data). [`load`] picks the reader by path:
//!
//! | path | reader |
//! |---|---|
//! | `*.parquet` | [`parquet`]: the native format, schema in [`schema`] |
//! | a directory | every `*.parquet` in it, in file-name order (recorded segments), concatenated |
//! | `*.jsonl` | [`mooncake`]: Mooncake / FAST'25 traces (`timestamp`, `input_length`, `output_length`, `hash_ids`) |
//! | `*.csv` | [`azure`]: Azure LLM inference traces (`TIMESTAMP,ContextTokens,GeneratedTokens`) |
//!
//! # Invariants (checked on every load and by [`write_parquet`])
//! - at least one request (an empty trace is an error);
//! - `arrival_us` never decreases from one request to the next (ties keep file order);
//! - `block_size > 0` and `floor(input_length / block_size) <= block_hashes.len() <=
//!   ceil(input_length / block_size)`: one hash per complete block, plus one for a trailing partial
//!   block when the source hashed it (Mooncake does, the router does not);
//! - `block_hashes[i]` identifies the whole prefix `0..=i` (chained), so two requests share block
//!   `i` exactly when they share the value;
//! - `token_ids`, when present, has exactly `input_length` entries.
//!
//! [`synth::synthesize`] generates traces of agentic multi-turn sessions from a seed.
//!
//! [`summarize`] computes the statistics an operator looks at first (rate, lengths, ideal hit rate).

pub mod azure;
mod error;
pub mod mooncake;
pub mod parquet;
mod scale;
pub mod schema;
pub mod spread;
pub mod summary;
pub mod synth;

pub use error::TraceError;
pub use parquet::{write_atomic, write_parquet, write_parquet_with};
pub use schema::{from_record_batch, to_record_batch, trace_schema};
pub use spread::{BucketSpread, spread_buckets};
pub use summary::{LengthStats, TraceSummary, summarize};

use infera_core::event::Retention;
use serde::{Deserialize, Serialize};
use std::path::Path;

/// One request of a trace: when it arrived and what its prompt looked like to the KV cache.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TraceRequest {
    /// Microseconds since the start of the trace.
    pub arrival_us: u64,
    pub request_id: String,
    pub model: String,
    /// Prompt tokens.
    pub input_length: u32,
    /// Generated tokens.
    pub output_length: u32,
    /// Tokens per block of `block_hashes`.
    pub block_size: u32,
    /// One chained prefix id per prompt block (see the module invariants).
    pub block_hashes: Vec<u64>,
    /// The prompt's token ids, when the recorder kept them.
    pub token_ids: Option<Vec<u32>>,
    pub session_id: Option<String>,
    pub retention: Option<Retention>,
    pub ttl_seconds: Option<u32>,
    /// For a session's turn after its first: the client's think time between receiving the
    /// previous turn's answer (the previous row of the same `session_id`) and sending this one.
    /// Session playback ([`crate::sim::Playback::Sessions`]) issues the turn that long after its
    /// predecessor finished instead of at `arrival_us`.
    #[serde(default)]
    pub think_time_us: Option<u64>,
    /// The LoRA adapter the request ran under, if any (its `model` is then the adapter's name).
    #[serde(default)]
    pub lora: Option<String>,
    /// The request's `cache_salt`, if any.
    #[serde(default)]
    pub cache_salt: Option<String>,
    /// The prompt's images: their placeholder runs, in prompt order, and the identifiers the
    /// engines key them by.
    #[serde(default)]
    pub images: Vec<TraceImage>,
    /// The tenant whose key the request was sent with (`infera server --api-keys`), if any:
    /// the replay's router queue shares a saturated fleet between tenants.
    #[serde(default)]
    pub tenant: Option<String>,
    /// The priority the request asked for (vLLM's body `priority` or the `x-infera-priority`
    /// header; lower is sooner), if any: the replay's router queue bounds it by the tenant's
    /// floor as the server does, and queues a request without one at its tenant's default.
    #[serde(default)]
    pub priority: Option<i32>,
}

/// One image of a request's prompt (see `infera_core::hashing::identity::MmRun`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TraceImage {
    /// Index of the run's first placeholder token in the prompt.
    pub offset: u32,
    /// Placeholder tokens in the run.
    pub length: u32,
    /// The image's identifier (vLLM's `mm_hash`).
    pub id: String,
}

impl TraceRequest {
    /// The prompt's blocks as an engine keys them: `block_hashes`, further keyed by the
    /// request's adapter, salt and images when it has them (as vLLM keys such blocks, see
    /// `infera_core::hashing::identity`: the adapter every block, the salt the first, an image
    /// the blocks its run overlaps), so that the same blocks under another adapter, salt or
    /// image never match. Keying ids that already carry the identity (a recorder's router
    /// hashes) keeps equal ids equal and distinct ones distinct.
    pub fn engine_blocks(&self) -> std::borrow::Cow<'_, [u64]> {
        use infera_core::hashing::KvIdentity;
        use infera_core::hashing::identity::{MmRun, hash_block_keyed};
        let identity = KvIdentity {
            lora: self.lora.as_deref().map(Box::from),
            salt: self.cache_salt.as_deref().map(Box::from),
            mm: self
                .images
                .iter()
                .map(|i| MmRun {
                    offset: i.offset,
                    length: i.length,
                    id: i.id.as_str().into(),
                })
                .collect(),
        };
        if identity.is_plain() {
            return std::borrow::Cow::Borrowed(&self.block_hashes);
        }
        // Each id stands for its block's tokens, as two u32 "tokens"; the keys are the ones of
        // the block's token range.
        let bs = self.block_size;
        let mut keys = Vec::new();
        let mut prev = None;
        let mut out = Vec::with_capacity(self.block_hashes.len());
        for (i, &h) in (0u32..).zip(&self.block_hashes) {
            let start = i.saturating_mul(bs);
            identity.block_keys(start, start.saturating_add(bs), &mut keys);
            let keyed = hash_block_keyed(&[h as u32, (h >> 32) as u32], prev, &keys);
            out.push(keyed.0);
            prev = Some(keyed);
        }
        std::borrow::Cow::Owned(out)
    }
}

/// A whole trace, in arrival order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Trace {
    pub requests: Vec<TraceRequest>,
    /// Where the trace came from (file name and format, or the recorder's description).
    pub source: String,
    /// Facts worth printing alongside results, e.g. how bucketed timestamps were spread.
    pub notes: Vec<String>,
}

/// How [`load`] imports a trace. Only the importers use these; Parquet traces are read as written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadOptions {
    /// Seed for the deterministic spreading of bucketed timestamps.
    pub seed: u64,
    /// Spread requests that share a Mooncake timestamp over the gap to the next one
    /// (see [`spread_buckets`]); off keeps the timestamps as recorded.
    pub spread_buckets: bool,
    /// Tokens per block of the trace's hash ids. `None`: the format's own — 512 for Mooncake
    /// ([`mooncake::MOONCAKE_BLOCK_SIZE`]; its public traces all use it, but other producers
    /// write 16- or 64-token blocks), [`azure::AZURE_BLOCK_SIZE`] for the ids invented for Azure
    /// traces. Parquet traces carry theirs: a value here must match it.
    pub block_size: Option<u32>,
    /// Model name given to imported requests.
    pub model: String,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            seed: 0,
            spread_buckets: true,
            block_size: None,
            model: "default".to_owned(),
        }
    }
}

/// Loads a trace, choosing the reader by extension (`.parquet`, `.jsonl`, `.csv`) or reading every
/// `*.parquet` in a directory in name order.
///
/// # Errors
/// [`TraceError`] naming the file and the line or column at fault: unreadable paths, malformed
/// input, non-monotonic arrivals, inconsistent block counts, empty traces, unknown extensions,
/// a zero [`LoadOptions::block_size`] or one a Parquet trace contradicts. Never panics on any
/// input.
pub fn load(path: &Path, opts: &LoadOptions) -> Result<Trace, TraceError> {
    if opts.block_size == Some(0) {
        return Err(TraceError::InvalidOption(
            "the trace block size must be positive".to_owned(),
        ));
    }
    let meta = std::fs::metadata(path).map_err(|e| TraceError::io(path, e))?;
    if meta.is_dir() {
        return parquet::read_dir(path).and_then(|t| check_block_size(path, t, opts));
    }
    let ext = path
        .extension()
        .map(|e| e.to_string_lossy().to_ascii_lowercase())
        .unwrap_or_default();
    match ext.as_str() {
        "parquet" => parquet::read_file(path).and_then(|t| check_block_size(path, t, opts)),
        "jsonl" => mooncake::import(path, opts),
        "csv" => azure::import(path, opts),
        _ => Err(TraceError::UnsupportedFormat {
            path: path.to_path_buf(),
            ext: if ext.is_empty() {
                "(none)".to_owned()
            } else {
                format!(".{ext}")
            },
        }),
    }
}

/// A Parquet trace read as written, unless the caller said its block size is another.
fn check_block_size(path: &Path, trace: Trace, opts: &LoadOptions) -> Result<Trace, TraceError> {
    let Some(given) = opts.block_size else {
        return Ok(trace);
    };
    match trace.requests.iter().find(|r| r.block_size != given) {
        None => Ok(trace),
        Some(r) => Err(TraceError::BlockSizeMismatch {
            path: path.to_path_buf(),
            request_id: r.request_id.clone(),
            found: r.block_size,
            given,
        }),
    }
}

/// `ceil(input_length / block_size)`: the number of blocks a prompt spans, the partial one included.
pub fn blocks_for(input_length: u32, block_size: u32) -> u64 {
    if block_size == 0 {
        return 0;
    }
    u64::from(input_length).div_ceil(u64::from(block_size))
}

/// Checks one request against the format invariants, given the previous request's arrival.
///
/// Returns the offending field and what is wrong with it.
pub(crate) fn check_request(
    req: &TraceRequest,
    previous_arrival_us: Option<u64>,
) -> Result<(), (&'static str, String)> {
    if let Some(prev) = previous_arrival_us
        && req.arrival_us < prev
    {
        return Err((
            schema::col::ARRIVAL_US,
            format!(
                "arrival {} us is earlier than the previous request's {prev} us; rows must be \
                 sorted by arrival",
                req.arrival_us
            ),
        ));
    }
    if req.block_size == 0 {
        return Err((
            schema::col::BLOCK_SIZE,
            "block size must be positive".to_owned(),
        ));
    }
    let full = u64::from(req.input_length / req.block_size);
    let all = blocks_for(req.input_length, req.block_size);
    let n = req.block_hashes.len() as u64;
    if n < full || n > all {
        return Err((
            schema::col::BLOCK_HASHES,
            format!(
                "{n} block hashes for input_length {} at block size {}: expected {}",
                req.input_length,
                req.block_size,
                if full == all {
                    format!("{full}")
                } else {
                    format!("{full} (complete blocks) or {all} (with the partial one)")
                }
            ),
        ));
    }
    if let Some(tokens) = &req.token_ids
        && tokens.len() as u64 != u64::from(req.input_length)
    {
        return Err((
            schema::col::TOKEN_IDS,
            format!(
                "{} token ids but input_length is {}",
                tokens.len(),
                req.input_length
            ),
        ));
    }
    Ok(())
}

/// Reads a whole text file, reporting invalid UTF-8 with the line it is on.
pub(crate) fn read_text(path: &Path) -> Result<String, TraceError> {
    let bytes = std::fs::read(path).map_err(|e| TraceError::io(path, e))?;
    String::from_utf8(bytes).map_err(|e| {
        let good = e.utf8_error().valid_up_to();
        let line = 1 + e.as_bytes()[..good].iter().filter(|&&b| b == b'\n').count();
        TraceError::line(path, line, "invalid UTF-8")
    })
}

/// The non-blank lines of a text, with their 1-based line numbers and without a trailing `\r`.
pub(crate) fn numbered_lines(text: &str) -> impl Iterator<Item = (usize, &str)> {
    text.split('\n')
        .enumerate()
        .map(|(i, l)| (i + 1, l.strip_suffix('\r').unwrap_or(l)))
        .filter(|(_, l)| !l.trim().is_empty())
}

/// The file name without its extension, for request ids (`conversation_trace-17`).
pub(crate) fn file_stem(path: &Path) -> String {
    path.file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "trace".to_owned())
}

/// The file name for source descriptions (no machine-specific directories).
pub(crate) fn file_name(path: &Path) -> String {
    path.file_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.display().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(arrival_us: u64, input_length: u32, block_size: u32, n: usize) -> TraceRequest {
        TraceRequest {
            arrival_us,
            request_id: "r".into(),
            model: "m".into(),
            input_length,
            output_length: 1,
            block_size,
            block_hashes: (0..n as u64).collect(),
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
    fn blocks_for_rounds_up() {
        assert_eq!(blocks_for(0, 512), 0);
        assert_eq!(blocks_for(1, 512), 1);
        assert_eq!(blocks_for(512, 512), 1);
        assert_eq!(blocks_for(513, 512), 2);
        assert_eq!(blocks_for(u32::MAX, 1), u64::from(u32::MAX));
        assert_eq!(blocks_for(5, 0), 0);
    }

    #[test]
    fn check_accepts_complete_or_partial_block_counts() {
        assert!(check_request(&req(0, 1000, 512, 1), None).is_ok());
        assert!(check_request(&req(0, 1000, 512, 2), None).is_ok());
        assert!(check_request(&req(0, 1024, 512, 2), None).is_ok());
        assert_eq!(
            check_request(&req(0, 1024, 512, 3), None).map_err(|e| e.0),
            Err("block_hashes")
        );
        assert_eq!(
            check_request(&req(0, 1000, 512, 0), None).map_err(|e| e.0),
            Err("block_hashes")
        );
        assert_eq!(
            check_request(&req(0, 10, 0, 0), None).map_err(|e| e.0),
            Err("block_size")
        );
        assert_eq!(
            check_request(&req(5, 10, 16, 1), Some(6)).map_err(|e| e.0),
            Err("arrival_us")
        );
        let mut r = req(5, 3, 16, 1);
        r.token_ids = Some(vec![1, 2]);
        assert_eq!(check_request(&r, None).map_err(|e| e.0), Err("token_ids"));
    }

    #[test]
    fn numbered_lines_skip_blanks_and_strip_cr() {
        let lines: Vec<_> = numbered_lines("a\r\n\n  \nb").collect();
        assert_eq!(lines, vec![(1, "a"), (4, "b")]);
    }
}
