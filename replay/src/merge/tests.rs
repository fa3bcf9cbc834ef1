//! Slices written by `crate::output` and read back; the merge's errors.

use super::*;
use crate::output::{self, Written};
use crate::report::Summary;

fn outcome(i: usize, cfg: usize) -> RequestOutcome {
    RequestOutcome {
        index: i,
        request_id: format!("r{i}"),
        arrival_us: 1_000 * i as u64,
        worker: format!("sim-{}:8000", i % 3),
        decode_worker: i.is_multiple_of(2).then(|| "sim-decode-0:8000".to_owned()),
        overlap_blocks: (i * 7 % 5) as u32,
        blocks: 5,
        gpu_hit_blocks: (i % 4) as u32,
        host_hit_blocks: (i % 2) as u32,
        disk_hit_blocks: 0,
        cached_tokens: 64,
        input_tokens: 80,
        output_tokens: 1 + (i % 9) as u32,
        queue_us: 17 * i as u64 + cfg as u64,
        ttft_us: 1_234 + 31 * i as u64 + cfg as u64,
        finish_us: 9_999 + i as u64,
        tpot_us: 1.0 / (3.0 + i as f64),
        retention: Retention::ALL.get(i % 5).copied(),
        rejected: i % 7 == 3,
        limited: (i % 7 == 3).then(|| Limit::ALL[i % 4].as_str()),
        tenant: (!i.is_multiple_of(3)).then(|| format!("t{}", i % 2)),
        router_queue_us: 5 * i as u64,
    }
}

fn result(cfg: usize) -> SimResult {
    SimResult {
        requests: (0..40).map(|i| outcome(i, cfg)).collect(),
        workers: (0..4).map(|w| format!("sim-{w}:8000")).collect(),
        block_ledger: Vec::new(),
        events: 77 + cfg as u64,
        steps: 1_000 + cfg as u64,
        makespan_us: 123_456,
        block_size: 16,
    }
}

fn meta(configs: usize, shard: Shard) -> SweepMeta {
    SweepMeta {
        trace: "t.parquet".into(),
        trace_digest: "a".into(),
        grid_digest: "b".into(),
        configs,
        axes: vec!["kv-overlap-weight=0,1,2,4,8".into()],
        tune: true,
        shard,
    }
}

/// Writes slice `shard` of a five-configuration grid to `dir`.
fn write_slice(dir: &Path, shard: Shard, meta: &SweepMeta) -> PathBuf {
    let path = dir.join(format!("slice-{}-{}.parquet", shard.index, shard.count));
    let held: Vec<usize> = (0..meta.configs).filter(|&i| shard.holds(i)).collect();
    let results: Vec<SimResult> = held.iter().map(|&i| result(i)).collect();
    let summaries: Vec<Summary> = results.iter().map(|r| Summary::of(r, 0.5)).collect();
    let labels: Vec<String> = held.iter().map(|i| format!("config {i}")).collect();
    let values: Vec<Vec<(String, String)>> = held
        .iter()
        .map(|i| vec![("kv-overlap-weight".into(), i.to_string())])
        .collect();
    let written: Vec<Written<'_>> = (0..held.len())
        .map(|k| Written {
            label: &labels[k],
            index: held[k],
            rank: 1,
            params: "{}",
            values: &values[k],
            result: &results[k],
            summary: &summaries[k],
        })
        .collect();
    output::write(&path, &written, meta).expect("write a slice");
    path
}

#[test]
fn slices_read_back_to_the_results_and_summaries_written() {
    let dir = tempfile::tempdir().unwrap();
    let slices: Vec<PathBuf> = (0..2)
        .map(|index| {
            let shard = Shard { index, count: 2 };
            write_slice(dir.path(), shard, &meta(5, shard))
        })
        .collect();
    // A folder stands for its files, and a summary file for its request file.
    let merged = merge(&[dir.path().to_path_buf(), output::summary_path(&slices[0])]).unwrap();
    assert_eq!(merged.files, slices);
    assert_eq!(merged.meta, meta(5, Shard::WHOLE));
    assert_eq!(merged.configs.len(), 5);
    for (i, c) in merged.configs.iter().enumerate() {
        let want = result(i);
        assert_eq!(c.index, i);
        assert_eq!(c.values, [("kv-overlap-weight".to_owned(), i.to_string())]);
        assert_eq!(c.result.requests, want.requests);
        assert_eq!(
            (c.result.workers.clone(), c.result.steps, c.result.events),
            (want.workers.clone(), want.steps, want.events)
        );
        assert_eq!(c.result.makespan_us, want.makespan_us);
        assert_eq!(
            Summary::of(&c.result, c.ideal_hit_rate),
            Summary::of(&want, 0.5)
        );
    }
}

#[test]
fn a_missing_doubled_or_foreign_slice_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let shard = |index, count| Shard { index, count };
    let s0 = write_slice(dir.path(), shard(0, 3), &meta(5, shard(0, 3)));
    let s2 = write_slice(dir.path(), shard(2, 3), &meta(5, shard(2, 3)));
    let err = merge(&[s0.clone(), s2.clone()]).unwrap_err().to_string();
    assert!(
        err.contains("2 of the sweep's 5") && err.contains("missing slices: 1/3"),
        "{err}"
    );
    // The whole grid again, in 1 slice: configurations 0 and 3 twice.
    let whole = write_slice(dir.path(), Shard::WHOLE, &meta(5, Shard::WHOLE));
    let err = merge(&[s0.clone(), whole]).unwrap_err().to_string();
    assert!(err.contains("configuration 0 is in both"), "{err}");
    let mut other = meta(5, shard(1, 3));
    other.grid_digest = "c".into();
    let elsewhere = tempfile::tempdir().unwrap();
    let foreign = write_slice(elsewhere.path(), shard(1, 3), &other);
    let err = merge(&[s0, foreign, s2]).unwrap_err().to_string();
    assert!(err.contains("comes from another sweep"), "{err}");
    let err = merge(&[]).unwrap_err().to_string();
    assert!(err.contains("no slices"), "{err}");
}
