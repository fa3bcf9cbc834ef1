//! `cargo xtask bench e2e [--against REF] [--rounds N] [-- ARGS]`: the end-to-end bench
//! (`bins/infera/benches/e2e.rs`), alone or side by side with another commit.
//!
//! Without `--against` it is `cargo bench -p infera --bench e2e -- ARGS`. With it, the tree
//! and `REF` (any commit name git knows) are built in release, each in its own target folder
//! (REF's source is exported with `git archive` under `target/against/<commit>/`, so the two
//! builds never overwrite each other's artifacts), then run in turn, REF first, `N` rounds
//! (default 5) of each, `ARGS` (criterion's: a filter such as `e2e/added`) given to both.
//! Machines drift within minutes: alternating the two and reading medians is what makes their
//! ratio trustworthy on a shared VM. It prints each benchmark's median time over the rounds for
//! both and the median of the per-round ratios (tree over REF: below 1 is faster), as the
//! commit message of a change to the request path states it; each run's whole output is kept
//! in `target/against/<commit>/round-<i>-{ref,tree}.log`.

use anyhow::{Context, bail};
use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// What `bench e2e` was asked.
#[derive(Debug, Default, PartialEq)]
pub struct Args {
    pub against: Option<String>,
    pub rounds: usize,
    /// Criterion's arguments.
    pub bench: Vec<OsString>,
}

impl Args {
    /// Parses `[--against REF] [--rounds N] [-- ARGS]`.
    pub fn parse(args: &[OsString]) -> anyhow::Result<Self> {
        let mut out = Args {
            rounds: 5,
            ..Args::default()
        };
        let mut it = args.iter();
        while let Some(arg) = it.next() {
            let mut value = |flag: &str| {
                it.next()
                    .and_then(|v| v.to_str())
                    .map(str::to_owned)
                    .with_context(|| format!("{flag} needs a value"))
            };
            match arg.to_str() {
                Some("--against") => out.against = Some(value("--against")?),
                Some("--rounds") => {
                    out.rounds = value("--rounds")?
                        .parse()
                        .ok()
                        .filter(|n| *n > 0)
                        .context("--rounds takes a number of at least 1")?;
                }
                Some("--") => {
                    out.bench = it.cloned().collect();
                    break;
                }
                _ => bail!(
                    "unexpected argument {arg:?} (bench e2e [--against REF] [--rounds N] [-- ARGS])"
                ),
            }
        }
        Ok(out)
    }
}

/// Runs the task (see the module docs); `cargo` makes a cargo command in a folder.
pub fn run(root: &Path, args: &Args, cargo: impl Fn(&Path) -> Command) -> anyhow::Result<()> {
    let Some(reference) = &args.against else {
        let mut command = cargo(root);
        command
            .args(["bench", "-p", "infera", "--bench", "e2e", "--"])
            .args(&args.bench);
        return crate::run_step("e2e bench", &mut command);
    };
    let commit = git(
        root,
        &["rev-parse", "--verify", &format!("{reference}^{{commit}}")],
    )?;
    let base = root.join("target/against").join(&commit);
    let source = base.join("src");
    if !source.join("Cargo.toml").exists() {
        export(root, &commit, &source)?;
    }
    let reference_exe = build(cargo(&source), &base.join("target"), "REF")?;
    let tree_exe = build(cargo(root), &root.join("target"), "tree")?;
    let mut rounds: Vec<(Times, Times)> = Vec::new();
    for round in 0..args.rounds {
        let side = |exe: &Path, dir: &Path, name: &str| -> anyhow::Result<Times> {
            let log = base.join(format!("round-{round}-{name}.log"));
            println!("xtask: round {} of {}: {name}", round + 1, args.rounds);
            let out = Command::new(exe)
                .arg("--bench")
                .args(&args.bench)
                .current_dir(dir.join("bins/infera"))
                .stderr(Stdio::inherit())
                .output()
                .with_context(|| format!("running {}", exe.display()))?;
            let text = String::from_utf8_lossy(&out.stdout);
            std::fs::write(&log, text.as_bytes())
                .with_context(|| format!("writing {}", log.display()))?;
            if !out.status.success() {
                bail!(
                    "the {name} bench failed ({}); see {}",
                    out.status,
                    log.display()
                );
            }
            Ok(parse_times(&text))
        };
        let reference = side(&reference_exe, &source, "ref")?;
        let tree = side(&tree_exe, root, "tree")?;
        rounds.push((reference, tree));
    }
    print!("{}", table(reference, &commit, &rounds));
    Ok(())
}

/// Writes `commit`'s tracked files into `dir`.
fn export(root: &Path, commit: &str, dir: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    println!("xtask: exporting {commit} to {}", dir.display());
    let mut archive = Command::new("git")
        .args(["archive", "--format=tar", commit])
        .current_dir(root)
        .stdout(Stdio::piped())
        .spawn()
        .context("starting git archive")?;
    let stdout = archive.stdout.take().context("git archive's output")?;
    let untar = Command::new("tar")
        .arg("-x")
        .arg("-C")
        .arg(dir)
        .stdin(stdout)
        .status()
        .context("starting tar")?;
    let archived = archive.wait().context("waiting for git archive")?;
    if !(untar.success() && archived.success()) {
        // A half-written tree must not pass for a whole one next time.
        let _ = std::fs::remove_dir_all(dir);
        bail!("exporting {commit} failed (git archive {archived}, tar {untar})");
    }
    Ok(())
}

/// Builds the e2e bench with `command` (cargo, in the tree to build) into `target`; its
/// executable.
fn build(mut command: Command, target: &Path, name: &str) -> anyhow::Result<PathBuf> {
    command
        .args(["bench", "-p", "infera", "--bench", "e2e", "--no-run"])
        .args(["--message-format", "json-render-diagnostics"])
        .env("CARGO_TARGET_DIR", target)
        .stderr(Stdio::inherit());
    println!(
        "xtask: building the {name} bench: {}",
        crate::tools::describe(&command)
    );
    let out = command.output().context("starting cargo")?;
    if !out.status.success() {
        bail!("building the {name} bench failed ({})", out.status);
    }
    executable(&String::from_utf8_lossy(&out.stdout))
        .with_context(|| format!("cargo named no e2e executable for the {name} build"))
}

/// The e2e bench's executable in cargo's JSON messages.
fn executable(messages: &str) -> Option<PathBuf> {
    messages
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|m| m["reason"] == "compiler-artifact" && m["target"]["name"] == "e2e")
        .find_map(|m| m["executable"].as_str().map(PathBuf::from))
}

/// Each benchmark's time estimate in nanoseconds (the middle of criterion's `time:` line).
type Times = BTreeMap<String, f64>;

/// Reads criterion's report: a benchmark's id on a line of its own or before its `time:`.
fn parse_times(text: &str) -> Times {
    let mut times = Times::new();
    let mut id: Option<String> = None;
    for line in text.lines() {
        let (head, tail) = match line.split_once("time:") {
            Some((head, tail)) => (head.trim(), Some(tail)),
            None => (line.trim(), None),
        };
        if !head.is_empty() && !line.starts_with(char::is_whitespace) {
            id = head.split_whitespace().next().map(str::to_owned);
        }
        let (Some(tail), Some(name)) = (tail, &id) else {
            continue;
        };
        let inner = tail.trim().trim_start_matches('[').trim_end_matches(']');
        let words: Vec<&str> = inner.split_whitespace().collect();
        if let [_, _, value, unit, _, _] = words.as_slice()
            && let Some(ns) = nanos(value, unit)
        {
            times.insert(name.clone(), ns);
        }
    }
    times
}

fn nanos(value: &str, unit: &str) -> Option<f64> {
    let scale = match unit {
        "ps" => 1e-3,
        "ns" => 1.0,
        "µs" | "us" => 1e3,
        "ms" => 1e6,
        "s" => 1e9,
        _ => return None,
    };
    value.parse::<f64>().ok().map(|v| v * scale)
}

fn median(mut v: Vec<f64>) -> Option<f64> {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied()
}

/// The side-by-side table of `rounds` (REF's times, the tree's).
fn table(reference: &str, commit: &str, rounds: &[(Times, Times)]) -> String {
    let short = &commit[..commit.len().min(10)];
    let mut out = format!(
        "\n{} alternating rounds, tree against {reference} ({short}): median time, and the \
         median of the rounds' ratios (tree / REF; below 1 is faster)\n\n\
         | benchmark | REF | tree | ratio |\n|---|---|---|---|\n",
        rounds.len()
    );
    let names: std::collections::BTreeSet<&String> = rounds
        .iter()
        .flat_map(|(a, b)| a.keys().chain(b.keys()))
        .collect();
    for name in names {
        let pairs: Vec<(f64, f64)> = rounds
            .iter()
            .filter_map(|(a, b)| Some((*a.get(name)?, *b.get(name)?)))
            .collect();
        let a = median(pairs.iter().map(|p| p.0).collect());
        let b = median(pairs.iter().map(|p| p.1).collect());
        let ratio = median(pairs.iter().map(|p| p.1 / p.0).collect());
        let (Some(a), Some(b), Some(ratio)) = (a, b, ratio) else {
            out.push_str(&format!("| {name} | not in both | | |\n"));
            continue;
        };
        out.push_str(&format!(
            "| {name} | {} | {} | {ratio:.3} |\n",
            human(a),
            human(b)
        ));
    }
    out
}

fn human(ns: f64) -> String {
    match ns {
        n if n >= 1e6 => format!("{:.2} ms", n / 1e6),
        n if n >= 1e3 => format!("{:.1} µs", n / 1e3),
        n => format!("{n:.0} ns"),
    }
}

fn git(root: &Path, args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new("git")
        .args(args)
        .current_dir(root)
        .output()
        .context("starting git")?;
    if !out.status.success() {
        bail!(
            "git {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    const REPORT: &str = "\
Benchmarking e2e/cold/1k: Warming up for 3.0000 s
e2e/cold/1k             time:   [121.04 µs 122.17 µs 123.80 µs]
                        change: [-1.2% +0.3% +1.9%] (p = 0.70 > 0.05)
e2e/throughput/kv-aware-1k-c32
                        time:   [76.102 µs 76.900 µs 77.711 µs]
                        thrpt:  [12.868 Kelem/s 13.004 Kelem/s 13.140 Kelem/s]
e2e/cold/32k            time:   [4.1 ms 4.2 ms 4.3 ms]
decision/hash_only      time:   [950.00 ns 990.50 ns 1.0100 µs]
e2e/added: keys and limits on against off, added p50 per round (µs): 1 vs 1; median ratio 1.000
";

    #[test]
    fn criterion_reports_are_read_as_nanoseconds_per_benchmark() {
        let t = parse_times(REPORT);
        assert_eq!(t.len(), 4, "{t:?}");
        assert!((t["e2e/cold/1k"] - 122_170.0).abs() < 1e-6);
        assert!((t["e2e/throughput/kv-aware-1k-c32"] - 76_900.0).abs() < 1e-6);
        assert!((t["e2e/cold/32k"] - 4_200_000.0).abs() < 1e-6);
        assert!((t["decision/hash_only"] - 990.5).abs() < 1e-6);
    }

    #[test]
    fn the_table_gives_medians_and_the_median_ratio() {
        let round = |a: f64, b: f64| {
            (
                Times::from([("x".to_owned(), a)]),
                Times::from([("x".to_owned(), b)]),
            )
        };
        let rounds = [round(100.0, 90.0), round(200.0, 100.0), round(100.0, 110.0)];
        let t = table("HEAD~1", "0123456789abcdef", &rounds);
        assert!(t.contains("| x | 100 ns | 100 ns | 0.900 |"), "{t}");
        assert!(t.contains("HEAD~1 (0123456789)"), "{t}");
    }

    #[test]
    fn arguments_are_parsed_and_bad_ones_refused() {
        let args = |list: &[&str]| list.iter().map(OsString::from).collect::<Vec<_>>();
        let parsed = Args::parse(&args(&["--against", "HEAD~1", "--", "e2e/added"])).unwrap();
        assert_eq!(parsed.against.as_deref(), Some("HEAD~1"));
        assert_eq!(parsed.rounds, 5);
        assert_eq!(parsed.bench, args(&["e2e/added"]));
        assert_eq!(Args::parse(&args(&["--rounds", "7"])).unwrap().rounds, 7);
        for bad in [
            &["--rounds", "0"][..],
            &["--rounds"],
            &["--against"],
            &["e2e"],
        ] {
            assert!(Args::parse(&args(bad)).is_err(), "{bad:?}");
        }
    }
}
