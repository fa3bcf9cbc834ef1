//! The native trace file: Parquet holding the [`super::schema`] columns, snappy-compressed.
//!
//! Layout: one row per request in arrival order, row groups of at most [`ROWS_PER_GROUP`] rows,
//! snappy pages; `arrival_us` and `block_hashes` use `DELTA_BINARY_PACKED` and `request_id`
//! `DELTA_BYTE_ARRAY` (no dictionary), the other columns the writer's defaults. The footer holds
//! these key-value metadata entries:
//!
//! | key | value |
//! |---|---|
//! | `infera.trace.version` | `"1"` ([`TRACE_FORMAT_VERSION`]); a file without it is read as version 1 |
//! | `infera.trace.source` | [`Trace::source`] |
//! | `infera.trace.notes` | [`Trace::notes`] as a JSON array of strings |
//!
//! A directory is read as recorded segments: every `*.parquet` file in it, in file-name order,
//! concatenated; arrivals must keep increasing across segment boundaries, and empty segments are
//! allowed as long as the whole is not empty.
//!
//! [`write_parquet`] is atomic: it validates the trace, writes `.<name>.<pid>-<n>.tmp` in the
//! destination directory, fsyncs it and renames it over the destination (then fsyncs the
//! directory), so readers see the old file or the complete new one, and a failure leaves nothing.

use super::schema::{
    META_NOTES, META_SOURCE, META_VERSION, TRACE_FORMAT_VERSION, check_schema, col,
    from_record_batch, to_record_batch, trace_schema,
};
use super::{Trace, TraceError, check_request};
use arrow_array::{Array as _, ArrayRef, RecordBatch};
use arrow_schema::{ArrowError, Field, Schema, SchemaRef};
use parquet::arrow::ProjectionMask;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::arrow::arrow_writer::ArrowWriter;
use parquet::basic::{Compression, Encoding};
use parquet::file::metadata::KeyValue;
use parquet::file::properties::{WriterProperties, WriterPropertiesBuilder};
use parquet::schema::types::ColumnPath;
use std::fs::{self, File, OpenOptions};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// Rows per row group (and per record batch) when writing.
pub const ROWS_PER_GROUP: usize = 64 * 1024;

/// Rows per record batch when reading.
const READ_BATCH_ROWS: usize = 16 * 1024;

/// Reads one trace file.
///
/// # Errors
/// [`TraceError::Parquet`] when the file is not Parquet or has an unsupported version,
/// [`TraceError::Column`] naming the column (and row) that is missing, mistyped or invalid,
/// [`TraceError::Empty`] without rows, [`TraceError::Io`] when it cannot be opened.
pub fn read_file(path: &Path) -> Result<Trace, TraceError> {
    let trace = read_segment(path)?;
    if trace.requests.is_empty() {
        return Err(TraceError::Empty {
            path: path.to_path_buf(),
        });
    }
    Ok(trace)
}

/// Reads every `*.parquet` in `dir` in file-name order as one trace.
///
/// # Errors
/// As [`read_file`] for each segment; [`TraceError::Column`] on `arrival_us` when a segment starts
/// before the previous one ended; [`TraceError::Empty`] when no segment holds a row.
pub fn read_dir(dir: &Path) -> Result<Trace, TraceError> {
    let mut files: Vec<PathBuf> = Vec::new();
    for entry in fs::read_dir(dir).map_err(|e| TraceError::io(dir, e))? {
        let entry = entry.map_err(|e| TraceError::io(dir, e))?;
        let path = entry.path();
        let is_parquet = path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("parquet"));
        if is_parquet && path.is_file() {
            files.push(path);
        }
    }
    files.sort_by(|a, b| a.file_name().cmp(&b.file_name()));

    let mut out = Trace {
        requests: Vec::new(),
        source: String::new(),
        notes: Vec::new(),
    };
    let mut last: Option<(u64, String)> = None;
    for file in &files {
        let segment = read_segment(file)?;
        if let (Some(first), Some((prev, prev_name))) = (segment.requests.first(), &last)
            && first.arrival_us < *prev
        {
            return Err(TraceError::column(
                file,
                col::ARRIVAL_US,
                Some(0),
                format!(
                    "arrival {} us is earlier than the end of the previous segment {prev_name} \
                     ({prev} us); segments must be in arrival order by file name",
                    first.arrival_us
                ),
            ));
        }
        if let Some(r) = segment.requests.last() {
            last = Some((r.arrival_us, super::file_name(file)));
        }
        if out.source.is_empty() {
            out.source = segment.source;
        }
        for note in segment.notes {
            if !out.notes.contains(&note) {
                out.notes.push(note);
            }
        }
        out.requests.extend(segment.requests);
    }
    if out.requests.is_empty() {
        return Err(TraceError::Empty {
            path: dir.to_path_buf(),
        });
    }
    out.notes.push(format!(
        "read {} segment(s) from {}",
        files.len(),
        dir.display()
    ));
    Ok(out)
}

/// Reads one file, allowing it to be empty. Decoder panics on corrupt input become errors.
fn read_segment(path: &Path) -> Result<Trace, TraceError> {
    let file = File::open(path).map_err(|e| TraceError::io(path, e))?;
    match catch_unwind(AssertUnwindSafe(|| decode(path, file))) {
        Ok(result) => result,
        Err(_) => Err(TraceError::Parquet {
            path: path.to_path_buf(),
            message: "the Parquet decoder failed on corrupt data".to_owned(),
        }),
    }
}

fn decode(path: &Path, file: File) -> Result<Trace, TraceError> {
    let parquet_err = |what: &str, e: parquet::errors::ParquetError| TraceError::Parquet {
        path: path.to_path_buf(),
        message: format!("{what}: {e}"),
    };
    let builder = ParquetRecordBatchReaderBuilder::try_new(file)
        .map_err(|e| parquet_err("not a readable Parquet file", e))?;

    let metadata = builder.metadata().file_metadata().key_value_metadata();
    let get = |key: &str| {
        metadata
            .and_then(|kv| kv.iter().find(|e| e.key == key))
            .and_then(|e| e.value.clone())
    };
    let mut notes = Vec::new();
    match get(META_VERSION) {
        Some(v) if v == TRACE_FORMAT_VERSION => {}
        Some(v) => {
            return Err(TraceError::Parquet {
                path: path.to_path_buf(),
                message: format!(
                    "unsupported trace format version {v:?} (metadata `{META_VERSION}`); this \
                     build reads version {TRACE_FORMAT_VERSION}"
                ),
            });
        }
        None => notes.push(format!(
            "{}: no `{META_VERSION}` metadata, read as version {TRACE_FORMAT_VERSION}",
            super::file_name(path)
        )),
    }
    if let Some(text) = get(META_NOTES) {
        let stored: Vec<String> = serde_json::from_str(&text).map_err(|e| TraceError::Parquet {
            path: path.to_path_buf(),
            message: format!("metadata `{META_NOTES}` is not a JSON array of strings: {e}"),
        })?;
        notes.splice(0..0, stored);
    }
    let source = get(META_SOURCE).unwrap_or_else(|| super::file_name(path));

    check_schema(builder.schema())
        .map_err(|e| TraceError::column(path, e.column, e.row, e.message))?;
    let known: Vec<usize> = builder
        .schema()
        .fields()
        .iter()
        .enumerate()
        .filter(|(_, f)| col::ALL.contains(&f.name().as_str()))
        .map(|(i, _)| i)
        .collect();
    let mask = ProjectionMask::roots(builder.parquet_schema(), known);
    let rows_hint = usize::try_from(builder.metadata().file_metadata().num_rows()).unwrap_or(0);
    let reader = builder
        .with_projection(mask)
        .with_batch_size(READ_BATCH_ROWS)
        .build()
        .map_err(|e| parquet_err("cannot read", e))?;

    let mut requests = Vec::with_capacity(rows_hint.min(1 << 24));
    let mut previous: Option<u64> = None;
    for batch in reader {
        let batch = batch.map_err(|e| TraceError::Parquet {
            path: path.to_path_buf(),
            message: format!("cannot decode a record batch: {e}"),
        })?;
        let offset = requests.len();
        let rows = from_record_batch(&batch).map_err(|e| {
            TraceError::column(path, e.column, e.row.map(|r| r + offset), e.message)
        })?;
        for (i, row) in rows.iter().enumerate() {
            check_request(row, previous)
                .map_err(|(column, m)| TraceError::column(path, column, Some(offset + i), m))?;
            previous = Some(row.arrival_us);
        }
        requests.extend(rows);
    }
    Ok(Trace {
        requests,
        source,
        notes,
    })
}

/// Writes `trace` to `path` atomically (see the module docs).
///
/// # Errors
/// [`TraceError::InvalidRequest`] when a request breaks a format invariant (nothing is written),
/// [`TraceError::Empty`] for a trace without requests, [`TraceError::Write`] when the file cannot
/// be created, written, synced or renamed; in every case no file is left behind.
pub fn write_parquet(trace: &Trace, path: &Path) -> Result<(), TraceError> {
    write_parquet_with(trace, &[], path)
}

/// [`write_parquet`] with more columns after the trace's: one array per field, each with one
/// value per request (the recorder's routing decision and outcome). Readers ignore them.
///
/// # Errors
/// As [`write_parquet`]; also [`TraceError::Write`] when an extra column's length is not the
/// number of requests or its name is one of the trace's.
pub fn write_parquet_with(
    trace: &Trace,
    extra: &[(Field, ArrayRef)],
    path: &Path,
) -> Result<(), TraceError> {
    if trace.requests.is_empty() {
        return Err(TraceError::Empty {
            path: path.to_path_buf(),
        });
    }
    let mut previous = None;
    for (index, req) in trace.requests.iter().enumerate() {
        check_request(req, previous).map_err(|(field, message)| TraceError::InvalidRequest {
            path: path.to_path_buf(),
            index,
            request_id: req.request_id.clone(),
            field,
            message,
        })?;
        previous = Some(req.arrival_us);
    }
    let write_err = |message: String| TraceError::Write {
        path: path.to_path_buf(),
        message,
    };
    for (field, array) in extra {
        if array.len() != trace.requests.len() || col::ALL.contains(&field.name().as_str()) {
            return Err(write_err(format!(
                "extra column `{}` must be new and hold one value per request",
                field.name()
            )));
        }
    }
    let notes = serde_json::to_string(&trace.notes)
        .map_err(|e| write_err(format!("cannot encode notes: {e}")))?;
    let delta = |b: WriterPropertiesBuilder, path: &[&str], encoding| {
        let path = ColumnPath::new(path.iter().map(|p| (*p).to_owned()).collect());
        b.set_column_dictionary_enabled(path.clone(), false)
            .set_column_encoding(path, encoding)
    };
    let mut props = WriterProperties::builder();
    // Arrivals grow and chained ids are mostly consecutive: deltas are tiny. Request ids share
    // long prefixes. Dictionaries would only overflow on these near-unique columns.
    props = delta(props, &[col::ARRIVAL_US], Encoding::DELTA_BINARY_PACKED);
    props = delta(
        props,
        &[col::BLOCK_HASHES, "list", "item"],
        Encoding::DELTA_BINARY_PACKED,
    );
    props = delta(props, &[col::REQUEST_ID], Encoding::DELTA_BYTE_ARRAY);
    let metadata = vec![
        KeyValue::new(META_VERSION.to_owned(), TRACE_FORMAT_VERSION.to_owned()),
        KeyValue::new(META_SOURCE.to_owned(), trace.source.clone()),
        KeyValue::new(META_NOTES.to_owned(), notes),
    ];
    let base = trace_schema();
    let mut fields: Vec<Field> = base.fields().iter().map(|f| f.as_ref().clone()).collect();
    fields.extend(extra.iter().map(|(f, _)| f.clone()));
    let schema = Arc::new(Schema::new(fields));
    let mut start = 0;
    let batches = trace.requests.chunks(ROWS_PER_GROUP).map(|chunk| {
        let base = to_record_batch(chunk)?;
        let mut columns = base.columns().to_vec();
        columns.extend(extra.iter().map(|(_, a)| a.slice(start, chunk.len())));
        start += chunk.len();
        RecordBatch::try_new(schema.clone(), columns)
    });
    write_atomic(path, schema.clone(), props, metadata, batches)
}

/// Writes record batches of `schema` to `path` atomically (temporary file, fsync, rename, fsync
/// of the directory), snappy-compressed in row groups of at most [`ROWS_PER_GROUP`] rows, with
/// `metadata` in the footer. Used for traces and for the recorder's event files.
///
/// # Errors
/// [`TraceError::Write`] when a batch cannot be built or the file cannot be created, written,
/// synced or renamed; no file is left behind.
pub fn write_atomic(
    path: &Path,
    schema: SchemaRef,
    props: WriterPropertiesBuilder,
    metadata: Vec<KeyValue>,
    batches: impl IntoIterator<Item = Result<RecordBatch, ArrowError>>,
) -> Result<(), TraceError> {
    let write_err = |message: String| TraceError::Write {
        path: path.to_path_buf(),
        message,
    };
    let props = props
        .set_compression(Compression::SNAPPY)
        .set_max_row_group_row_count(Some(ROWS_PER_GROUP))
        .set_key_value_metadata(Some(metadata))
        .build();
    let mut pending = PendingFile::create(path)?;
    let file = pending
        .file
        .take()
        .ok_or_else(|| write_err("temporary file vanished".to_owned()))?;
    let mut writer =
        ArrowWriter::try_new(file, schema, Some(props)).map_err(|e| write_err(e.to_string()))?;
    for batch in batches {
        let batch = batch.map_err(|e| write_err(e.to_string()))?;
        writer.write(&batch).map_err(|e| write_err(e.to_string()))?;
    }
    let file = writer
        .into_inner()
        .map_err(|e| write_err(format!("cannot finish the file: {e}")))?;
    file.sync_all()
        .map_err(|e| write_err(format!("cannot sync the file: {e}")))?;
    drop(file);
    fs::rename(&pending.path, path).map_err(|e| {
        write_err(format!(
            "cannot rename {} into place: {e}",
            pending.path.display()
        ))
    })?;
    pending.committed = true;
    // Make the rename durable. Some filesystems cannot sync a directory; the data is complete
    // either way, so this step is best effort.
    if let Ok(dir) = File::open(pending.dir()) {
        let _ = dir.sync_all();
    }
    Ok(())
}

/// A temporary file beside the destination, removed on drop unless committed.
struct PendingFile {
    path: PathBuf,
    file: Option<File>,
    committed: bool,
}

impl PendingFile {
    fn create(dest: &Path) -> Result<Self, TraceError> {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let Some(name) = dest.file_name() else {
            return Err(TraceError::Write {
                path: dest.to_path_buf(),
                message: "the destination is not a file path".to_owned(),
            });
        };
        let dir = match dest.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let mut last_error = None;
        for _ in 0..16 {
            let n = COUNTER.fetch_add(1, Ordering::Relaxed);
            let tmp = dir.join(format!(
                ".{}.{}-{n}.tmp",
                name.to_string_lossy(),
                std::process::id()
            ));
            match OpenOptions::new().write(true).create_new(true).open(&tmp) {
                Ok(file) => {
                    return Ok(Self {
                        path: tmp,
                        file: Some(file),
                        committed: false,
                    });
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => last_error = Some(e),
                Err(e) => {
                    return Err(TraceError::Write {
                        path: dest.to_path_buf(),
                        message: format!(
                            "cannot create a temporary file in {}: {e}",
                            dir.display()
                        ),
                    });
                }
            }
        }
        Err(TraceError::Write {
            path: dest.to_path_buf(),
            message: format!(
                "cannot create a temporary file in {}: {}",
                dir.display(),
                last_error.map(|e| e.to_string()).unwrap_or_default()
            ),
        })
    }

    fn dir(&self) -> &Path {
        self.path.parent().unwrap_or(Path::new("."))
    }
}

impl Drop for PendingFile {
    fn drop(&mut self) {
        if !self.committed {
            self.file = None;
            let _ = fs::remove_file(&self.path);
        }
    }
}
