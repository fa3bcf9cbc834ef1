//! `--out FILE.parquet`: per-request rows of every configuration, plus `FILE.summary.parquet` with
//! one row per configuration. Both are written to temporary files first and renamed only when both
//! are complete, so a failed run leaves nothing half-written.
//!
//! Request columns: `config` (label), `config_index`, `request_id`, `arrival_us`, `worker`,
//! `decode_worker` (nullable), `overlap_blocks`, `blocks`, `gpu_hit_blocks`, `host_hit_blocks`,
//! `disk_hit_blocks`, `cached_tokens`, `input_tokens`, `output_tokens`, `queue_us`, `ttft_us`,
//! `tpot_us`, `finish_us`, `retention` (nullable), `rejected`, `tenant` (nullable), `limited`
//! (the tenant limit that refused it, nullable), `router_queue_us`.
//! Summary columns: `config`, `config_index`, `rank`, `hit_rate`, `ideal_hit_rate`, `gpu_hit_rate`,
//! `host_hit_rate`, `disk_hit_rate`, `ttft_p50_ms`, `ttft_p90_ms`, `ttft_p99_ms`, `tpot_p50_ms`,
//! `queue_p50_ms`, `output_tokens_per_s`, `requests_per_s`, `max_share`, `imbalance`, `params`
//! (JSON of the configuration), `values` (the swept `key=value` pairs), `workers` (the fleet in
//! order), `makespan_us`, `steps`, `events`, `block_size`.
//!
//! `config_index` is the configuration's place in the whole grid, also in a `--shard` slice; a
//! replay's files carry a [`SweepMeta`] in their footers (see [`crate::shard`]). The two files
//! hold everything [`Summary::of`] reads, so [`crate::merge`] rebuilds each configuration's
//! summary from them exactly.
//!
//! [`write_measured`] writes the same two files for a run that was measured rather than simulated
//! (`infera bench --out`), so that replayed and live results can be joined on `request_id`.

use crate::report::Summary;
use crate::shard::{META_KEY, SweepMeta};
use crate::sim::{SimConfig, SimResult};
use arrow_array::builder::{
    BooleanBuilder, Float64Builder, ListBuilder, StringBuilder, UInt32Builder, UInt64Builder,
};
use arrow_array::{ArrayRef, RecordBatch};
use arrow_schema::{DataType, Field, Schema};
use parquet::arrow::ArrowWriter;
use parquet::basic::Compression;
use parquet::file::metadata::KeyValue;
use parquet::file::properties::WriterProperties;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

#[derive(Debug, thiserror::Error)]
pub enum OutputError {
    #[error("cannot write {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot encode {path} as parquet: {message}")]
    Encode { path: PathBuf, message: String },
}

/// The request file's `UInt32` columns, in order: a request's block and token counts.
pub(crate) const COUNT_COLUMNS: [&str; 8] = [
    "overlap_blocks",
    "blocks",
    "gpu_hit_blocks",
    "host_hit_blocks",
    "disk_hit_blocks",
    "cached_tokens",
    "input_tokens",
    "output_tokens",
];

/// One configuration's results as written.
#[derive(Debug)]
pub struct Written<'a> {
    pub label: &'a str,
    /// Its place in the whole grid.
    pub index: usize,
    pub rank: usize,
    /// The configuration as JSON ([`params`]).
    pub params: &'a str,
    /// The swept `key=value` pairs.
    pub values: &'a [(String, String)],
    pub result: &'a SimResult,
    pub summary: &'a Summary,
}

/// The summary's `params` of a simulated configuration.
pub fn params(config: &SimConfig) -> String {
    serde_json::to_string(config).unwrap_or_default()
}

/// The summary file that goes with `out`: `results.parquet` → `results.summary.parquet`.
pub fn summary_path(out: &Path) -> PathBuf {
    let stem = out
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    out.with_file_name(format!("{stem}.summary.parquet"))
}

/// Writes both files atomically (see the module docs), with `meta` in their footers.
pub fn write(out: &Path, runs: &[Written<'_>], meta: &SweepMeta) -> Result<(), OutputError> {
    let meta = serde_json::to_string(meta).unwrap_or_default();
    write_runs(out, runs, Some(meta))
}

/// Writes both files atomically for one measured run: `label` names it in the `config` column,
/// `params` is the JSON written in the summary's `params` column.
pub fn write_measured(
    out: &Path,
    label: &str,
    params: &str,
    result: &SimResult,
    summary: &Summary,
) -> Result<(), OutputError> {
    let run = Written {
        label,
        index: 0,
        rank: 1,
        params,
        values: &[],
        result,
        summary,
    };
    write_runs(out, &[run], None)
}

fn write_runs(out: &Path, runs: &[Written<'_>], meta: Option<String>) -> Result<(), OutputError> {
    let summary = summary_path(out);
    let tmp_req = tmp_path(out);
    let tmp_sum = tmp_path(&summary);
    let res = write_file(&tmp_req, requests_batch(runs), meta.clone())
        .and_then(|_| write_file(&tmp_sum, summary_batch(runs), meta));
    let res = res.and_then(|_| {
        std::fs::rename(&tmp_req, out).map_err(|e| OutputError::Io {
            path: out.into(),
            source: e,
        })?;
        std::fs::rename(&tmp_sum, &summary).map_err(|e| OutputError::Io {
            path: summary.clone(),
            source: e,
        })
    });
    if res.is_err() {
        let _ = std::fs::remove_file(&tmp_req);
        let _ = std::fs::remove_file(&tmp_sum);
    }
    res
}

fn tmp_path(p: &Path) -> PathBuf {
    let name = p
        .file_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    p.with_file_name(format!(".{name}.tmp-{}", std::process::id()))
}

fn write_file(
    path: &Path,
    batch: Result<RecordBatch, arrow_schema::ArrowError>,
    meta: Option<String>,
) -> Result<(), OutputError> {
    let enc = |e: String| OutputError::Encode {
        path: path.into(),
        message: e,
    };
    let batch = batch.map_err(|e| enc(e.to_string()))?;
    let file = File::create(path).map_err(|e| OutputError::Io {
        path: path.into(),
        source: e,
    })?;
    let props = WriterProperties::builder()
        .set_compression(Compression::SNAPPY)
        .set_key_value_metadata(meta.map(|m| vec![KeyValue::new(META_KEY.to_owned(), m)]))
        .build();
    let mut w =
        ArrowWriter::try_new(file, batch.schema(), Some(props)).map_err(|e| enc(e.to_string()))?;
    w.write(&batch).map_err(|e| enc(e.to_string()))?;
    let file = w.into_inner().map_err(|e| enc(e.to_string()))?;
    file.sync_all().map_err(|e| OutputError::Io {
        path: path.into(),
        source: e,
    })
}

fn requests_batch(runs: &[Written<'_>]) -> Result<RecordBatch, arrow_schema::ArrowError> {
    let n: usize = runs.iter().map(|r| r.result.requests.len()).sum();
    let mut config = StringBuilder::new();
    let mut config_index = UInt32Builder::with_capacity(n);
    let mut request_id = StringBuilder::new();
    let mut arrival = UInt64Builder::with_capacity(n);
    let mut worker = StringBuilder::new();
    let mut decode_worker = StringBuilder::new();
    let mut u32s: Vec<UInt32Builder> = (0..8).map(|_| UInt32Builder::with_capacity(n)).collect();
    let mut queue = UInt64Builder::with_capacity(n);
    let mut ttft = UInt64Builder::with_capacity(n);
    let mut tpot = Float64Builder::with_capacity(n);
    let mut finish = UInt64Builder::with_capacity(n);
    let mut retention = StringBuilder::new();
    let mut rejected = BooleanBuilder::with_capacity(n);
    let mut tenant = StringBuilder::new();
    let mut limited = StringBuilder::new();
    let mut router_queue = UInt64Builder::with_capacity(n);
    for run in runs {
        for r in &run.result.requests {
            config.append_value(run.label);
            config_index.append_value(run.index as u32);
            request_id.append_value(&r.request_id);
            arrival.append_value(r.arrival_us);
            worker.append_value(&r.worker);
            decode_worker.append_option(r.decode_worker.as_deref());
            let vals = [
                r.overlap_blocks,
                r.blocks,
                r.gpu_hit_blocks,
                r.host_hit_blocks,
                r.disk_hit_blocks,
                r.cached_tokens,
                r.input_tokens,
                r.output_tokens,
            ];
            for (b, v) in u32s.iter_mut().zip(vals) {
                b.append_value(v);
            }
            queue.append_value(r.queue_us);
            ttft.append_value(r.ttft_us);
            tpot.append_value(r.tpot_us);
            finish.append_value(r.finish_us);
            retention.append_option(r.retention.map(|c| c.as_str()));
            rejected.append_value(r.rejected);
            tenant.append_option(r.tenant.as_deref());
            limited.append_option(r.limited);
            router_queue.append_value(r.router_queue_us);
        }
    }
    let u32_names = COUNT_COLUMNS;
    let mut fields = vec![
        Field::new("config", DataType::Utf8, false),
        Field::new("config_index", DataType::UInt32, false),
        Field::new("request_id", DataType::Utf8, false),
        Field::new("arrival_us", DataType::UInt64, false),
        Field::new("worker", DataType::Utf8, false),
        Field::new("decode_worker", DataType::Utf8, true),
    ];
    let mut cols: Vec<ArrayRef> = vec![
        Arc::new(config.finish()),
        Arc::new(config_index.finish()),
        Arc::new(request_id.finish()),
        Arc::new(arrival.finish()),
        Arc::new(worker.finish()),
        Arc::new(decode_worker.finish()),
    ];
    for (name, mut b) in u32_names.iter().zip(u32s) {
        fields.push(Field::new(*name, DataType::UInt32, false));
        cols.push(Arc::new(b.finish()));
    }
    fields.extend([
        Field::new("queue_us", DataType::UInt64, false),
        Field::new("ttft_us", DataType::UInt64, false),
        Field::new("tpot_us", DataType::Float64, false),
        Field::new("finish_us", DataType::UInt64, false),
        Field::new("retention", DataType::Utf8, true),
        Field::new("rejected", DataType::Boolean, false),
        Field::new("tenant", DataType::Utf8, true),
        Field::new("limited", DataType::Utf8, true),
        Field::new("router_queue_us", DataType::UInt64, false),
    ]);
    cols.extend([
        Arc::new(queue.finish()) as ArrayRef,
        Arc::new(ttft.finish()),
        Arc::new(tpot.finish()),
        Arc::new(finish.finish()),
        Arc::new(retention.finish()),
        Arc::new(rejected.finish()),
        Arc::new(tenant.finish()),
        Arc::new(limited.finish()),
        Arc::new(router_queue.finish()),
    ]);
    RecordBatch::try_new(Arc::new(Schema::new(fields)), cols)
}

fn summary_batch(runs: &[Written<'_>]) -> Result<RecordBatch, arrow_schema::ArrowError> {
    let mut config = StringBuilder::new();
    let mut params = StringBuilder::new();
    let mut config_index = UInt32Builder::new();
    let mut rank = UInt32Builder::new();
    let names = [
        "hit_rate",
        "ideal_hit_rate",
        "gpu_hit_rate",
        "host_hit_rate",
        "disk_hit_rate",
        "ttft_p50_ms",
        "ttft_p90_ms",
        "ttft_p99_ms",
        "tpot_p50_ms",
        "queue_p50_ms",
        "output_tokens_per_s",
        "requests_per_s",
        "max_share",
        "imbalance",
    ];
    let mut f64s: Vec<Float64Builder> = names.iter().map(|_| Float64Builder::new()).collect();
    let mut values = ListBuilder::new(StringBuilder::new()).with_field(text_item());
    let mut workers = ListBuilder::new(StringBuilder::new()).with_field(text_item());
    let [mut makespan, mut steps, mut events] = [(); 3].map(|_| UInt64Builder::new());
    let mut block_size = UInt32Builder::new();
    for run in runs {
        let s = run.summary;
        config.append_value(run.label);
        params.append_value(run.params);
        config_index.append_value(run.index as u32);
        for (k, v) in run.values {
            values.values().append_value(format!("{k}={v}"));
        }
        values.append(true);
        for w in &run.result.workers {
            workers.values().append_value(w);
        }
        workers.append(true);
        makespan.append_value(run.result.makespan_us);
        steps.append_value(run.result.steps);
        events.append_value(run.result.events);
        block_size.append_value(run.result.block_size);
        rank.append_value(run.rank as u32);
        let max_share = s.shares.iter().map(|x| x.1).fold(0.0, f64::max);
        let vals = [
            s.hit_rate,
            s.ideal_hit_rate,
            s.gpu_hit_rate,
            s.host_hit_rate,
            s.disk_hit_rate,
            s.ttft_p50_ms,
            s.ttft_p90_ms,
            s.ttft_p99_ms,
            s.tpot_p50_ms,
            s.queue_p50_ms,
            s.output_tokens_per_s,
            s.requests_per_s,
            max_share,
            s.imbalance,
        ];
        for (b, v) in f64s.iter_mut().zip(vals) {
            b.append_value(v);
        }
    }
    let mut fields = vec![
        Field::new("config", DataType::Utf8, false),
        Field::new("config_index", DataType::UInt32, false),
        Field::new("rank", DataType::UInt32, false),
    ];
    let mut cols: Vec<ArrayRef> = vec![
        Arc::new(config.finish()),
        Arc::new(config_index.finish()),
        Arc::new(rank.finish()),
    ];
    for (name, mut b) in names.iter().zip(f64s) {
        fields.push(Field::new(*name, DataType::Float64, false));
        cols.push(Arc::new(b.finish()));
    }
    let text_list = DataType::List(Arc::new(text_item()));
    fields.extend([
        Field::new("params", DataType::Utf8, false),
        Field::new("values", text_list.clone(), false),
        Field::new("workers", text_list, false),
        Field::new("makespan_us", DataType::UInt64, false),
        Field::new("steps", DataType::UInt64, false),
        Field::new("events", DataType::UInt64, false),
        Field::new("block_size", DataType::UInt32, false),
    ]);
    cols.extend([
        Arc::new(params.finish()) as ArrayRef,
        Arc::new(values.finish()),
        Arc::new(workers.finish()),
        Arc::new(makespan.finish()),
        Arc::new(steps.finish()),
        Arc::new(events.finish()),
        Arc::new(block_size.finish()),
    ]);
    RecordBatch::try_new(Arc::new(Schema::new(fields)), cols)
}

/// The item of the summary's list columns: text, never null.
fn text_item() -> Field {
    Field::new_list_field(DataType::Utf8, false)
}
