//! `infera replay merge`: the `--out` files of a sweep's `--shard` slices read back and joined
//! into the whole grid, so that the merged table, Pareto front and files are the ones a single
//! unsharded run prints and writes.
//!
//! Each configuration is rebuilt from its rows ([`crate::output`] writes every field that
//! [`crate::report::Summary::of`] reads), and its summary is computed again from them, not
//! copied: the numbers are the unsharded run's to the last bit.
//!
//! The slices must come from one sweep (the same trace and grid digests in their footers, see
//! [`crate::shard`]) and hold every configuration of the grid exactly once; otherwise the merge
//! names the slices that differ, the configurations missing, or the one held twice.

use crate::output::summary_path;
use crate::shard::{META_KEY, Shard, SweepMeta};
use crate::sim::{RequestOutcome, SimResult};
use arrow_array::cast::AsArray;
use arrow_array::types::{Float64Type, UInt32Type, UInt64Type};
use arrow_array::{Array, RecordBatch};
use infera_core::event::Retention;
use infera_core::tenancy::Limit;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum MergeError {
    #[error(
        "no slices to merge: give the --out files of `infera replay --shard` (or their folder)"
    )]
    NoInput,
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Format { path: PathBuf, message: String },
    #[error(
        "{path} comes from another sweep than {first} (a different trace, flags or grid): \
         merge the slices of one `infera replay --shard` command line"
    )]
    OtherSweep { first: PathBuf, path: PathBuf },
    #[error("configuration {index} is in both {first} and {second}")]
    Twice {
        index: usize,
        first: PathBuf,
        second: PathBuf,
    },
    #[error(
        "{missing} of the sweep's {configs} configurations are in no slice given (the first: \
         {first:?}); missing slices: {slices}"
    )]
    Missing {
        missing: usize,
        configs: usize,
        first: Vec<usize>,
        slices: String,
    },
}

/// One configuration as read back.
#[derive(Debug, Clone)]
pub struct Config {
    /// Its place in the grid.
    pub index: usize,
    pub label: String,
    /// The configuration as JSON.
    pub params: String,
    pub values: Vec<(String, String)>,
    pub ideal_hit_rate: f64,
    pub result: SimResult,
}

/// The whole grid, in grid order.
#[derive(Debug)]
pub struct Merged {
    /// The sweep, as one unsharded run describes it.
    pub meta: SweepMeta,
    pub configs: Vec<Config>,
    /// The files read.
    pub files: Vec<PathBuf>,
}

/// The request files among `inputs`: each file as given (a `*.summary.parquet` stands for its
/// request file), each folder's `*.parquet` files, in name order.
pub fn slice_files(inputs: &[PathBuf]) -> Result<Vec<PathBuf>, MergeError> {
    let mut files = Vec::new();
    for input in inputs {
        if input.is_dir() {
            let entries = std::fs::read_dir(input).map_err(|e| MergeError::Io {
                path: input.clone(),
                source: e,
            })?;
            let mut found: Vec<PathBuf> = entries
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "parquet"))
                .collect();
            found.sort();
            files.extend(found);
        } else {
            files.push(input.clone());
        }
    }
    let mut requests: Vec<PathBuf> = files.into_iter().map(request_file).collect();
    requests.sort();
    requests.dedup();
    if requests.is_empty() {
        return Err(MergeError::NoInput);
    }
    Ok(requests)
}

/// `x.summary.parquet` → `x.parquet`; any other path as it is.
fn request_file(p: PathBuf) -> PathBuf {
    let name = p.file_name().map(|n| n.to_string_lossy().into_owned());
    match name
        .as_deref()
        .and_then(|n| n.strip_suffix(".summary.parquet"))
    {
        Some(stem) => p.with_file_name(format!("{stem}.parquet")),
        None => p,
    }
}

/// Reads and joins the slices (see the module docs).
pub fn merge(inputs: &[PathBuf]) -> Result<Merged, MergeError> {
    let files = slice_files(inputs)?;
    let mut meta: Option<(SweepMeta, PathBuf)> = None;
    let mut held: BTreeMap<usize, (Config, PathBuf)> = BTreeMap::new();
    let mut shards: Vec<Shard> = Vec::new();
    for path in &files {
        let (m, configs) = read_slice(path)?;
        match &meta {
            Some((first, first_path)) if !first.same_sweep(&m) => {
                return Err(MergeError::OtherSweep {
                    first: first_path.clone(),
                    path: path.clone(),
                });
            }
            Some(_) => {}
            None => meta = Some((m.clone(), path.clone())),
        }
        shards.push(m.shard);
        for c in configs {
            if let Some((_, first)) = held.get(&c.index) {
                return Err(MergeError::Twice {
                    index: c.index,
                    first: first.clone(),
                    second: path.clone(),
                });
            }
            held.insert(c.index, (c, path.clone()));
        }
    }
    let Some((mut meta, _)) = meta else {
        return Err(MergeError::NoInput);
    };
    let missing: Vec<usize> = (0..meta.configs)
        .filter(|i| !held.contains_key(i))
        .collect();
    if !missing.is_empty() {
        return Err(MergeError::Missing {
            missing: missing.len(),
            configs: meta.configs,
            first: missing.iter().copied().take(8).collect(),
            slices: missing_slices(&shards, &missing),
        });
    }
    if let Some(extra) = held.keys().find(|&&i| i >= meta.configs) {
        return Err(MergeError::Format {
            path: held[extra].1.clone(),
            message: format!(
                "configuration {extra} is beyond the sweep's {} configurations",
                meta.configs
            ),
        });
    }
    meta.shard = Shard::WHOLE;
    Ok(Merged {
        meta,
        configs: held.into_values().map(|(c, _)| c).collect(),
        files,
    })
}

/// The slices, in the counts the given ones were cut in, that would hold `missing`.
fn missing_slices(seen: &[Shard], missing: &[usize]) -> String {
    let mut counts: Vec<usize> = seen.iter().map(|s| s.count).collect();
    counts.sort_unstable();
    counts.dedup();
    let mut names: Vec<String> = Vec::new();
    for count in counts {
        for index in 0..count {
            let shard = Shard { index, count };
            if !seen.contains(&shard) && missing.iter().any(|&i| shard.holds(i)) {
                names.push(shard.to_string());
            }
        }
    }
    if names.is_empty() {
        "none of the given cuts (slices of different counts overlap)".to_owned()
    } else {
        names.join(", ")
    }
}

/// One slice's meta and configurations, from its request file and the summary beside it.
pub fn read_slice(path: &Path) -> Result<(SweepMeta, Vec<Config>), MergeError> {
    let summary = summary_path(path);
    let (meta, summaries) = read_batches(&summary)?;
    let meta = meta.ok_or_else(|| MergeError::Format {
        path: summary.clone(),
        message: format!(
            "no `{META_KEY}` in its footer: not written by `infera replay --out` (or by a \
             version before slices)"
        ),
    })?;
    let mut configs: Vec<Config> = Vec::new();
    let mut at: BTreeMap<usize, usize> = BTreeMap::new();
    for b in &summaries {
        let c = Columns { path: &summary, b };
        let (index, label, params) = (c.u32("config_index")?, c.text("config")?, c.text("params")?);
        let (values, workers) = (c.texts("values")?, c.texts("workers")?);
        let ideal = c.f64("ideal_hit_rate")?;
        let (makespan, steps, events) = (c.u64("makespan_us")?, c.u64("steps")?, c.u64("events")?);
        let block_size = c.u32("block_size")?;
        for row in 0..b.num_rows() {
            let index = index.value(row) as usize;
            at.insert(index, configs.len());
            configs.push(Config {
                index,
                label: label.value(row).to_owned(),
                params: params.value(row).to_owned(),
                values: pairs(&summary, &values[row])?,
                ideal_hit_rate: ideal.value(row),
                result: SimResult {
                    requests: Vec::new(),
                    workers: workers[row].clone(),
                    block_ledger: Vec::new(),
                    events: events.value(row),
                    steps: steps.value(row),
                    makespan_us: makespan.value(row),
                    block_size: block_size.value(row),
                },
            });
        }
    }
    let (_, batches) = read_batches(path)?;
    for b in &batches {
        read_requests(path, b, &at, &mut configs)?;
    }
    Ok((meta, configs))
}

/// Appends each row of a request batch to its configuration.
fn read_requests(
    path: &Path,
    b: &RecordBatch,
    at: &BTreeMap<usize, usize>,
    configs: &mut [Config],
) -> Result<(), MergeError> {
    let c = Columns { path, b };
    let index = c.u32("config_index")?;
    let (id, worker) = (c.text("request_id")?, c.text("worker")?);
    let (decode, retention) = (c.text("decode_worker")?, c.text("retention")?);
    let (tenant, limited) = (c.text("tenant")?, c.text("limited")?);
    let counts: Vec<_> = crate::output::COUNT_COLUMNS
        .into_iter()
        .map(|n| c.u32(n))
        .collect::<Result<_, _>>()?;
    let times: Vec<_> = [
        "arrival_us",
        "queue_us",
        "ttft_us",
        "finish_us",
        "router_queue_us",
    ]
    .into_iter()
    .map(|n| c.u64(n))
    .collect::<Result<_, _>>()?;
    let tpot = c.f64("tpot_us")?;
    let rejected = c
        .column("rejected")?
        .as_boolean_opt()
        .ok_or_else(|| c.wrong("rejected", "boolean"))?;
    fn opt(a: &arrow_array::StringArray, row: usize) -> Option<&str> {
        a.is_valid(row).then(|| a.value(row))
    }
    for row in 0..b.num_rows() {
        let index = index.value(row) as usize;
        let slot = *at.get(&index).ok_or_else(|| MergeError::Format {
            path: path.to_path_buf(),
            message: format!("row {row}: configuration {index} is not in the summary file"),
        })?;
        let requests = &mut configs[slot].result.requests;
        let count = |i: usize| counts[i].value(row);
        let retention = match opt(retention, row) {
            None => None,
            Some(s) => Some(Retention::parse(s).ok_or_else(|| c.bad("retention", row, s))?),
        };
        let limited = match opt(limited, row) {
            None => None,
            Some(s) => Some(
                Limit::ALL
                    .into_iter()
                    .map(Limit::as_str)
                    .find(|n| *n == s)
                    .ok_or_else(|| c.bad("limited", row, s))?,
            ),
        };
        requests.push(RequestOutcome {
            index: requests.len(),
            request_id: id.value(row).to_owned(),
            arrival_us: times[0].value(row),
            worker: worker.value(row).to_owned(),
            decode_worker: opt(decode, row).map(str::to_owned),
            overlap_blocks: count(0),
            blocks: count(1),
            gpu_hit_blocks: count(2),
            host_hit_blocks: count(3),
            disk_hit_blocks: count(4),
            cached_tokens: count(5),
            input_tokens: count(6),
            output_tokens: count(7),
            queue_us: times[1].value(row),
            ttft_us: times[2].value(row),
            finish_us: times[3].value(row),
            tpot_us: tpot.value(row),
            retention,
            rejected: rejected.value(row),
            limited,
            tenant: opt(tenant, row).map(str::to_owned),
            router_queue_us: times[4].value(row),
        });
    }
    Ok(())
}

/// `key=value` texts back into pairs.
fn pairs(path: &Path, texts: &[String]) -> Result<Vec<(String, String)>, MergeError> {
    texts
        .iter()
        .map(|t| {
            t.split_once('=')
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .ok_or_else(|| MergeError::Format {
                    path: path.to_path_buf(),
                    message: format!("column `values`: `{t}` is not key=value"),
                })
        })
        .collect()
}

/// A file's sweep meta (if any) and its record batches.
fn read_batches(path: &Path) -> Result<(Option<SweepMeta>, Vec<RecordBatch>), MergeError> {
    let format = |message: String| MergeError::Format {
        path: path.to_path_buf(),
        message,
    };
    let file = File::open(path).map_err(|e| MergeError::Io {
        path: path.to_path_buf(),
        source: e,
    })?;
    let builder = ParquetRecordBatchReaderBuilder::try_new(file)
        .map_err(|e| format(format!("not a readable Parquet file: {e}")))?;
    let meta = builder
        .metadata()
        .file_metadata()
        .key_value_metadata()
        .and_then(|kv| kv.iter().find(|e| e.key == META_KEY))
        .and_then(|e| e.value.as_deref())
        .map(|text| {
            serde_json::from_str::<SweepMeta>(text)
                .map_err(|e| format(format!("`{META_KEY}` in its footer is not readable: {e}")))
        })
        .transpose()?;
    let reader = builder
        .build()
        .map_err(|e| format(format!("cannot read: {e}")))?;
    let batches = reader
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format(format!("cannot decode a record batch: {e}")))?;
    Ok((meta, batches))
}

/// Typed columns of one batch, with errors that name the file and column.
struct Columns<'a> {
    path: &'a Path,
    b: &'a RecordBatch,
}

impl<'a> Columns<'a> {
    fn column(&self, name: &str) -> Result<&'a dyn Array, MergeError> {
        self.b
            .column_by_name(name)
            .map(|a| a.as_ref())
            .ok_or_else(|| MergeError::Format {
                path: self.path.to_path_buf(),
                message: format!(
                    "no column `{name}`: not written by `infera replay --out` of this version"
                ),
            })
    }

    fn wrong(&self, name: &str, ty: &str) -> MergeError {
        MergeError::Format {
            path: self.path.to_path_buf(),
            message: format!("column `{name}` is not {ty}"),
        }
    }

    fn bad(&self, name: &str, row: usize, value: &str) -> MergeError {
        MergeError::Format {
            path: self.path.to_path_buf(),
            message: format!("column `{name}`, row {row}: unknown value `{value}`"),
        }
    }

    fn u32(&self, name: &str) -> Result<&'a arrow_array::UInt32Array, MergeError> {
        self.column(name)?
            .as_primitive_opt::<UInt32Type>()
            .ok_or_else(|| self.wrong(name, "u32"))
    }

    fn u64(&self, name: &str) -> Result<&'a arrow_array::UInt64Array, MergeError> {
        self.column(name)?
            .as_primitive_opt::<UInt64Type>()
            .ok_or_else(|| self.wrong(name, "u64"))
    }

    fn f64(&self, name: &str) -> Result<&'a arrow_array::Float64Array, MergeError> {
        self.column(name)?
            .as_primitive_opt::<Float64Type>()
            .ok_or_else(|| self.wrong(name, "f64"))
    }

    fn text(&self, name: &str) -> Result<&'a arrow_array::StringArray, MergeError> {
        self.column(name)?
            .as_string_opt::<i32>()
            .ok_or_else(|| self.wrong(name, "text"))
    }

    /// A list-of-text column, row by row.
    fn texts(&self, name: &str) -> Result<Vec<Vec<String>>, MergeError> {
        let list = self
            .column(name)?
            .as_list_opt::<i32>()
            .ok_or_else(|| self.wrong(name, "a list of text"))?;
        (0..list.len())
            .map(|row| {
                let items = list.value(row);
                let items = items
                    .as_string_opt::<i32>()
                    .ok_or_else(|| self.wrong(name, "a list of text"))?;
                Ok(items.iter().map(|s| s.unwrap_or("").to_owned()).collect())
            })
            .collect()
    }
}

#[cfg(test)]
mod tests;
