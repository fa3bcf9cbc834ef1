//! [`TraceError`]: everything that can go wrong loading, importing or writing a trace.
//!
//! Every variant names the file it is about and, where the input has them, the line (JSONL, CSV,
//! 1-based physical line numbers) or the column and row (Parquet, 0-based row index across the
//! file, as DuckDB's `rowid` and pandas count). Messages are lowercase and say what was expected.
//! Only [`TraceError::Io`] can be worth retrying; every other variant is a property of the input
//! and fails again until the input is fixed.

use std::path::{Path, PathBuf};

/// An error from [`crate::trace::load`], [`crate::trace::write_parquet`] or an importer.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// The file or directory could not be opened, listed or read.
    #[error("cannot read {}: {source}", .path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A JSONL or CSV line is malformed: bad JSON or CSV, a missing field, a field of the wrong type
    /// or range, or a block count inconsistent with the input length.
    #[error("{}:{line}: {message}", .path.display())]
    Line {
        path: PathBuf,
        line: usize,
        message: String,
    },
    /// A timestamp is earlier than the one before it: traces must be in arrival order.
    #[error(
        "{}:{line}: timestamp {value} is earlier than {previous} on line {previous_line}; \
         the trace must be sorted by arrival time",
        .path.display()
    )]
    NotMonotonic {
        path: PathBuf,
        line: usize,
        value: String,
        previous_line: usize,
        previous: String,
    },
    /// A Parquet column is missing, has the wrong type, or holds an invalid value.
    #[error("{}: column `{column}`{}: {message}", .path.display(), .row.map(|r| format!(", row {r}")).unwrap_or_default())]
    Column {
        path: PathBuf,
        column: String,
        /// 0-based row across the whole file, when one row is at fault.
        row: Option<usize>,
        message: String,
    },
    /// The Parquet file could not be decoded, or its metadata is not an Infera trace's.
    #[error("{}: {message}", .path.display())]
    Parquet { path: PathBuf, message: String },
    /// The input parsed but holds no request.
    #[error("{}: the trace has no requests", .path.display())]
    Empty { path: PathBuf },
    /// The path's extension names no format this crate reads.
    #[error(
        "{}: unsupported trace format {ext:?}; expected .parquet, .jsonl (Mooncake), .csv (Azure) \
         or a directory of .parquet segments",
        .path.display()
    )]
    UnsupportedFormat { path: PathBuf, ext: String },
    /// A [`crate::trace::LoadOptions`] value is out of range.
    #[error("invalid load option: {0}")]
    InvalidOption(String),
    /// A [`crate::trace::synth::SynthConfig`] value is out of range.
    #[error("invalid synth setting: {0}")]
    InvalidSynth(String),
    /// A Parquet trace's own block size differs from the one the caller gave.
    #[error(
        "{}: request {request_id:?} has block size {found}, but the trace block size given is \
         {given}; a Parquet trace carries its own (leave the option out, or re-import the source \
         with the right one)",
        .path.display()
    )]
    BlockSizeMismatch {
        path: PathBuf,
        request_id: String,
        found: u32,
        given: u32,
    },
    /// A trace handed to the writer breaks an invariant of the format.
    #[error("cannot write {}: request {index} ({request_id:?}), field `{field}`: {message}", .path.display())]
    InvalidRequest {
        path: PathBuf,
        index: usize,
        request_id: String,
        field: &'static str,
        message: String,
    },
    /// Writing the output failed; nothing was left at the destination.
    #[error("cannot write {}: {message}", .path.display())]
    Write { path: PathBuf, message: String },
}

impl TraceError {
    /// Whether trying again unchanged could succeed (only I/O errors can be transient).
    pub fn is_retryable(&self) -> bool {
        matches!(self, TraceError::Io { .. } | TraceError::Write { .. })
    }

    pub(crate) fn io(path: &Path, source: std::io::Error) -> Self {
        TraceError::Io {
            path: path.to_path_buf(),
            source,
        }
    }

    pub(crate) fn line(path: &Path, line: usize, message: impl Into<String>) -> Self {
        TraceError::Line {
            path: path.to_path_buf(),
            line,
            message: message.into(),
        }
    }

    pub(crate) fn column(
        path: &Path,
        column: &str,
        row: Option<usize>,
        message: impl Into<String>,
    ) -> Self {
        TraceError::Column {
            path: path.to_path_buf(),
            column: column.to_owned(),
            row,
            message: message.into(),
        }
    }
}
