//! `--out FILE.parquet`: per-request rows of every configuration, plus `FILE.summary.parquet` with
//! one row per configuration. Both are written to temporary files first and renamed only when both
//! are complete, so a failed run leaves nothing half-written.
//!
//! Request columns: `config` (label), `config_index`, `request_id`, `arrival_us`, `worker`,
//! `decode_worker` (nullable), `overlap_blocks`, `blocks`, `gpu_hit_blocks`, `host_hit_blocks`,
//! `disk_hit_blocks`, `cached_tokens`, `input_tokens`, `output_tokens`, `queue_us`, `ttft_us`,
//! `tpot_us`, `finish_us`, `retention` (nullable), `rejected`.
//! Summary columns: `config`, `config_index`, `rank`, `hit_rate`, `ideal_hit_rate`, `gpu_hit_rate`,
//! `host_hit_rate`, `disk_hit_rate`, `ttft_p50_ms`, `ttft_p90_ms`, `ttft_p99_ms`, `tpot_p50_ms`,
//! `queue_p50_ms`, `output_tokens_per_s`, `requests_per_s`, `max_share`, `imbalance`, `params`
//! (JSON of the configuration).
//!
//! [`write_measured`] writes the same two files for a run that was measured rather than simulated
//! (`infera bench --out`), so that replayed and live results can be joined on `request_id`.

use crate::report::Summary;
use crate::sim::{SimConfig, SimResult};
use arrow_array::builder::{
    BooleanBuilder, Float64Builder, StringBuilder, UInt32Builder, UInt64Builder,
};
use arrow_array::{ArrayRef, RecordBatch};
use arrow_schema::{DataType, Field, Schema};
use parquet::arrow::ArrowWriter;
use parquet::basic::Compression;
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

/// One configuration's results as written.
#[derive(Debug)]
pub struct Written<'a> {
    pub label: &'a str,
    pub rank: usize,
    pub config: &'a SimConfig,
    pub result: &'a SimResult,
    pub summary: &'a Summary,
}

/// The summary file that goes with `out`: `results.parquet` → `results.summary.parquet`.
pub fn summary_path(out: &Path) -> PathBuf {
    let stem = out
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    out.with_file_name(format!("{stem}.summary.parquet"))
}

/// One configuration as the writers see it: `params` is the JSON written in the summary.
struct Run<'a> {
    label: &'a str,
    rank: usize,
    params: String,
    result: &'a SimResult,
    summary: &'a Summary,
}

/// Writes both files atomically (see the module docs).
pub fn write(out: &Path, runs: &[Written<'_>]) -> Result<(), OutputError> {
    let runs: Vec<Run<'_>> = runs
        .iter()
        .map(|r| Run {
            label: r.label,
            rank: r.rank,
            params: serde_json::to_string(r.config).unwrap_or_default(),
            result: r.result,
            summary: r.summary,
        })
        .collect();
    write_runs(out, &runs)
}

/// Writes both files atomically for one measured run: `label` names it in the `config` column,
/// `params` is the JSON written in the summary's `params` column.
pub fn write_measured(
    out: &Path,
    label: &str,
    params: String,
    result: &SimResult,
    summary: &Summary,
) -> Result<(), OutputError> {
    write_runs(
        out,
        &[Run {
            label,
            rank: 1,
            params,
            result,
            summary,
        }],
    )
}

fn write_runs(out: &Path, runs: &[Run<'_>]) -> Result<(), OutputError> {
    let summary = summary_path(out);
    let tmp_req = tmp_path(out);
    let tmp_sum = tmp_path(&summary);
    let res = write_file(&tmp_req, requests_batch(runs))
        .and_then(|_| write_file(&tmp_sum, summary_batch(runs)));
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

fn requests_batch(runs: &[Run<'_>]) -> Result<RecordBatch, arrow_schema::ArrowError> {
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
    for (ci, run) in runs.iter().enumerate() {
        for r in &run.result.requests {
            config.append_value(run.label);
            config_index.append_value(ci as u32);
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
        }
    }
    let u32_names = [
        "overlap_blocks",
        "blocks",
        "gpu_hit_blocks",
        "host_hit_blocks",
        "disk_hit_blocks",
        "cached_tokens",
        "input_tokens",
        "output_tokens",
    ];
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
    ]);
    cols.extend([
        Arc::new(queue.finish()) as ArrayRef,
        Arc::new(ttft.finish()),
        Arc::new(tpot.finish()),
        Arc::new(finish.finish()),
        Arc::new(retention.finish()),
        Arc::new(rejected.finish()),
    ]);
    RecordBatch::try_new(Arc::new(Schema::new(fields)), cols)
}

fn summary_batch(runs: &[Run<'_>]) -> Result<RecordBatch, arrow_schema::ArrowError> {
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
    for (ci, run) in runs.iter().enumerate() {
        let s = run.summary;
        config.append_value(run.label);
        params.append_value(&run.params);
        config_index.append_value(ci as u32);
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
    fields.push(Field::new("params", DataType::Utf8, false));
    cols.push(Arc::new(params.finish()));
    RecordBatch::try_new(Arc::new(Schema::new(fields)), cols)
}
