//! The routing-quality suite: the standard traces through the simulator under each policy,
//! printed as the markdown table of docs/benchmarks.md's routing-quality section (see
//! `infera_replay::suite` for what each column measures).
//!
//! ```text
//! cargo xtask bench routing                     # the usual way (release build)
//! cargo run --release -p infera-replay --example routing_suite -- [--threads N] [--out FILE.md]
//! ```
//!
//! The traces: the bundled conversation trace (8 workers, with a cache it cannot fill and at the
//! replay's default of 2,048 blocks per worker), the bundled 1,000-request Mooncake slice (8 workers), and a
//! synthesized agentic trace (`infera trace synth` defaults, seed 0, 4 workers) at low load
//! (4 sessions open at once) and at high load (48), and the conversation trace on a fleet with
//! tiers: 256 GPU blocks per worker, and per worker a node kvd of 8,192 blocks of host RAM and
//! 65,536 on disk (where the router's tiered cost earns its keep). Fleets otherwise use
//! `infera replay`'s defaults. `--only TEXT` runs the traces whose name contains it.

use infera_replay::sim::{SimConfig, TierConfig};
use infera_replay::suite::{self, SuiteTrace};
use infera_replay::trace::synth::{SynthConfig, synthesize};
use infera_replay::trace::{LoadOptions, Trace, load};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// `infera replay`'s default GPU cache: 1,048,576 tokens' worth of blocks per worker (2,048
/// blocks at the bundled traces' 512 tokens).
const DEFAULT_GPU_TOKENS: usize = 1 << 20;
/// A cache no trace of the suite fills.
const UNLIMITED_BLOCKS: usize = 1_000_000;

fn fleet(trace: &Trace, workers: usize, gpu_blocks: Option<usize>) -> SimConfig {
    let block_size = trace.requests.first().map_or(16, |r| r.block_size).max(1);
    let mut c = SimConfig {
        workers,
        ..SimConfig::default()
    };
    c.engine.block_size = block_size;
    c.engine.gpu_blocks =
        gpu_blocks.unwrap_or_else(|| (DEFAULT_GPU_TOKENS / block_size as usize).max(1));
    c
}

fn fixture(name: &str) -> Result<Trace, String> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fixtures/traces")
        .join(name);
    load(&path, &LoadOptions::default()).map_err(|e| e.to_string())
}

fn agentic(concurrency: f64, sessions: usize) -> Result<Trace, String> {
    synthesize(&SynthConfig {
        sessions,
        concurrency,
        ..SynthConfig::default()
    })
    .map_err(|e| e.to_string())
}

/// GPU blocks per worker of the tiered fleet, and its node kvds' host and disk blocks.
const TIERED: (usize, u64, u64) = (256, 8_192, 65_536);

fn tiered(trace: &Trace) -> SimConfig {
    let (gpu, host, disk) = TIERED;
    let mut c = fleet(trace, 8, Some(gpu));
    c.tiers = TierConfig {
        host_blocks: host,
        disk_blocks: disk,
    };
    c
}

fn conversation_again() -> Result<Trace, String> {
    fixture("conversation_trace.parquet")
}

fn traces() -> Result<Vec<SuiteTrace>, String> {
    let conversation = fixture("conversation_trace.parquet")?;
    let mooncake = fixture("mooncake_trace_1000.parquet")?;
    let low = agentic(4.0, 48)?;
    let high = agentic(48.0, 144)?;
    Ok(vec![
        SuiteTrace {
            name: "conversation, unlimited cache".into(),
            base: fleet(&conversation, 8, Some(UNLIMITED_BLOCKS)),
            trace: conversation.clone(),
        },
        SuiteTrace {
            name: "conversation, 2,048 blocks/worker".into(),
            base: fleet(&conversation, 8, None),
            trace: conversation,
        },
        SuiteTrace {
            name: "mooncake 1,000".into(),
            base: fleet(&mooncake, 8, None),
            trace: mooncake,
        },
        SuiteTrace {
            name: "agentic, low load".into(),
            base: fleet(&low, 4, None),
            trace: low,
        },
        SuiteTrace {
            name: "agentic, high load".into(),
            base: fleet(&high, 4, None),
            trace: high,
        },
        SuiteTrace {
            name: "conversation, 256 GPU blocks + kvd tiers".into(),
            base: tiered(&conversation_again()?),
            trace: conversation_again()?,
        },
    ])
}

fn main() -> Result<(), String> {
    let mut threads = None;
    let mut out: Option<PathBuf> = None;
    let mut only: Option<String> = None;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--threads" => {
                let n = args.next().and_then(|v| v.parse::<usize>().ok());
                threads = Some(
                    n.filter(|&n| n > 0)
                        .ok_or("--threads takes a number above 0")?,
                );
            }
            "--out" => out = Some(args.next().ok_or("--out takes a file name")?.into()),
            "--only" => only = Some(args.next().ok_or("--only takes a trace name's part")?),
            other => {
                return Err(format!(
                    "unknown argument {other:?}; expected --threads N, --out FILE.md or --only TEXT"
                ));
            }
        }
    }
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads.unwrap_or(0))
        .build()
        .map_err(|e| e.to_string())?;
    let started = Instant::now();
    let mut traces = traces()?;
    if let Some(only) = &only {
        traces.retain(|t| t.name.contains(only.as_str()));
    }
    let rows = pool
        .install(|| suite::run(&traces))
        .map_err(|e| e.to_string())?;
    let table = suite::markdown(&rows);
    print!("{table}");
    eprintln!(
        "routing suite: {} traces in {:.1} s",
        traces.len(),
        started.elapsed().as_secs_f64()
    );
    if let Some(path) = out {
        std::fs::write(&path, &table)
            .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    }
    Ok(())
}
