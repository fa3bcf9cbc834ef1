//! `cargo xtask bench routing [-- ARGS]`: the routing-quality suite.
//!
//! Builds and runs `infera-replay`'s `routing_suite` example in release mode (the simulator is
//! an order of magnitude slower unoptimised), which replays the standard traces under each policy
//! and prints the markdown table quoted in docs/benchmarks.md. `ARGS` go to the
//! example: `--threads N`, `--out FILE.md`.

use std::ffi::OsString;
use std::path::Path;
use std::process::Command;

/// The command that runs the suite with `extra` arguments.
pub fn command(root: &Path, extra: &[OsString]) -> Command {
    let mut command = super::cargo(root);
    command
        .args([
            "run",
            "--quiet",
            "--release",
            "-p",
            "infera-replay",
            "--example",
            "routing_suite",
            "--",
        ])
        .args(extra);
    command
}

/// Runs the suite.
///
/// # Errors
/// When the example fails to build or to run.
pub fn run(root: &Path, extra: &[OsString]) -> anyhow::Result<()> {
    super::run_step("routing-quality suite", &mut command(root, extra))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_suite_runs_the_release_example_with_the_extra_arguments() {
        let command = command(Path::new("."), &["--threads".into(), "2".into()]);
        let args: Vec<_> = command.get_args().collect();
        let at = |s: &str| args.iter().position(|a| *a == s);
        assert!(at("--release").is_some() && at("routing_suite").is_some());
        assert_eq!(args[args.len() - 3..], ["--", "--threads", "2"]);
    }
}
