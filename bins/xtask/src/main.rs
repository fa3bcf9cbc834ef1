//! `cargo xtask`: development tasks for the Infera workspace.
//!
//! - `cargo xtask test [-- ARGS]`: make sure the system tools the tests need are installed
//!   (installing what is missing, see [`tools`]), then run every test of the workspace (unit,
//!   integration, examples, doc tests) and compile every benchmark. `ARGS` are extra
//!   `cargo test` arguments (e.g. `-- -p infera`, which narrows both steps to that package, or
//!   `-- -- --nocapture`). Without a package selection it then runs the Python tests of
//!   `kvd/python` against real vLLM and SGLang (see [`python`]).
//! - `cargo xtask bench [-- ARGS]`: `cargo bench --workspace ARGS`.
//! - `cargo xtask bench routing [-- ARGS]`: the routing-quality suite (see [`routing`]): the
//!   standard traces through the replay under each policy, as a markdown table.
//! - `cargo xtask bench e2e [--against REF] [--rounds N] [-- ARGS]`: the end-to-end bench, or
//!   the tree and `REF` built apart and run in alternating rounds, their ratios as a markdown
//!   table (see [`against`]).
//! - `cargo xtask chaos [-- ARGS]`: the chaos suite (`bins/infera/benches/chaos/`): each fault
//!   injected into a real fleet on loopback under steady load, as a markdown table; fails when
//!   a fault leaves a request hung or wrong. `ARGS` go to `cargo bench` (e.g. `--profile dev`
//!   to reuse the test build instead of building in release).
//! - `cargo xtask image [-- --binary PATH] [--tag TAG]`: the container image, built and started
//!   (see [`image`]); `test` does the same with the debug binary, where a Docker engine answers.
//! - `cargo xtask tools`: only the tool check and installation.
//! - `cargo xtask commits [-- RANGE]`: the commit messages of `RANGE` (default the last
//!   commit) against CONTRIBUTING.md (see [`commits`]).
//! - `cargo xtask layers`: the crates' dependency rules (see [`layers`]); `test` checks them
//!   first, and that the binary builds without warnings with every backend compiled out.
//!
//! Every step is printed before it runs; the first failing step ends the task with a non-zero
//! exit code, naming what failed.

// Tests may unwrap; the non-test build still denies it everywhere.

mod against;
mod commits;
mod image;
mod layers;
mod python;
mod routing;
mod tools;

use anyhow::{Context, bail};
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

const USAGE: &str = "usage: cargo xtask \
    <test|bench|bench routing|bench e2e|chaos|image|tools|layers|commits> [-- extra arguments]";

fn main() -> ExitCode {
    match run(std::env::args_os().skip(1).collect()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("xtask: error: {error:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: Vec<OsString>) -> anyhow::Result<()> {
    let Some((task, rest)) = args.split_first() else {
        bail!("no task given\n{USAGE}");
    };
    if task == "bench" && rest.first().is_some_and(|a| a == "e2e") {
        let root = workspace_root();
        return against::run(&root, &against::Args::parse(&rest[1..])?, cargo);
    }
    let routing = task == "bench" && rest.first().is_some_and(|a| a == "routing");
    let rest = if routing { &rest[1..] } else { rest };
    let extra: Vec<OsString> = match rest.split_first() {
        None => Vec::new(),
        Some((separator, extra)) if separator == "--" => extra.to_vec(),
        Some((unexpected, _)) => {
            bail!("unexpected argument {unexpected:?}; put cargo arguments after `--`\n{USAGE}")
        }
    };
    let root = workspace_root();
    match task.to_str() {
        Some("test") => test(&root, &extra),
        Some("bench") if routing => routing::run(&root, &extra),
        Some("bench") => bench(&root, &extra),
        Some("chaos") => chaos(&root, &extra),
        Some("image") => {
            image::build_and_check(&root, &image::Args::parse(&extra)?, || cargo(&root))
        }
        Some("tools") if extra.is_empty() => tools::ensure().map(drop),
        Some("layers") if extra.is_empty() => layers::check(&root),
        Some("commits") if extra.len() <= 1 => {
            commits::check(&root, extra.first().and_then(|r| r.to_str()))
        }
        Some("help" | "--help" | "-h") => {
            println!("{USAGE}");
            Ok(())
        }
        _ => bail!("unknown task {task:?}\n{USAGE}"),
    }
}

/// Installs missing tools, runs all tests (unit, integration, examples, doc tests), and
/// compiles all benchmarks.
fn test(root: &Path, extra: &[OsString]) -> anyhow::Result<()> {
    layers::check(root)?;
    layers::check_without_backends(root)?;
    let tools = tools::ensure()?;
    let scope = package_scope(extra);

    // Plain `cargo test` runs lib, bin and integration tests, builds examples, then runs doc
    // tests; it neither builds nor runs benchmarks.
    let mut tests = cargo(root);
    tests.args(["test", "--no-fail-fast"]);
    if scope == [OsString::from("--workspace")] {
        tests.arg("--workspace");
    }
    tests.args(extra);

    // Benchmarks are compiled, not run, with the test profile: they reuse the dependencies the
    // tests just built instead of building the whole workspace again in release mode.
    let mut benches = cargo(root);
    benches
        .arg("test")
        .args(&scope)
        .args(["--benches", "--no-run"]);

    for (name, mut command) in [("tests", tests), ("benchmark build", benches)] {
        tools.export_to(&mut command);
        run_step(name, &mut command)?;
    }
    if scope == [OsString::from("--workspace")] {
        python::test(root, || cargo(root))?;
        image_step(root)?;
    }
    println!("xtask: all tests passed and all benchmarks compiled");
    Ok(())
}

/// The image built from the stripped debug binary and started (see [`image`]); skipped, saying
/// so, where no Docker engine answers.
fn image_step(root: &Path) -> anyhow::Result<()> {
    let engine = Command::new("docker")
        .args(["version", "--format", "{{.Server.Version}}"])
        .output();
    match engine {
        Ok(out) if out.status.success() => {}
        Ok(out) => {
            let why = String::from_utf8_lossy(&out.stderr);
            println!(
                "xtask: image step SKIPPED: no Docker engine answers ({})",
                why.trim()
            );
            return Ok(());
        }
        Err(error) => {
            println!("xtask: image step SKIPPED: no docker command ({error})");
            return Ok(());
        }
    }
    let args = image::Args {
        binary: Some(python::stripped_binary(root)?),
        tag: Some("infera:test".into()),
        package: Some(image::PackageBuild {
            python: python::venv_python(root),
            maturin_args: "--profile dev".into(),
        }),
    };
    image::build_and_check(root, &args, || cargo(root))
}

/// The package selection in `extra` (`-p NAME`, `--package NAME`, `--package=NAME`), or
/// `--workspace` when there is none.
fn package_scope(extra: &[OsString]) -> Vec<OsString> {
    let mut scope = Vec::new();
    let mut args = extra.iter().take_while(|arg| *arg != "--");
    while let Some(arg) = args.next() {
        if arg == "-p" || arg == "--package" {
            scope.push(arg.clone());
            scope.extend(args.next().cloned());
        } else if arg
            .to_str()
            .is_some_and(|text| text.starts_with("--package="))
        {
            scope.push(arg.clone());
        }
    }
    if scope.is_empty() {
        scope.push("--workspace".into());
    }
    scope
}

/// Runs the criterion benchmarks.
fn bench(root: &Path, extra: &[OsString]) -> anyhow::Result<()> {
    let tools = tools::ensure()?;
    let mut command = cargo(root);
    command.args(["bench", "--workspace"]).args(extra);
    tools.export_to(&mut command);
    run_step("benchmarks", &mut command)
}

/// Runs the chaos suite.
fn chaos(root: &Path, extra: &[OsString]) -> anyhow::Result<()> {
    let tools = tools::ensure()?;
    let mut command = cargo(root);
    command
        .args(["bench", "-p", "infera", "--bench", "chaos"])
        .args(extra);
    tools.export_to(&mut command);
    run_step("chaos suite", &mut command)
}

fn cargo(root: &Path) -> Command {
    let mut command = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    command.current_dir(root);
    command
}

/// Prints and runs one step, failing with its name if it does not succeed.
fn run_step(name: &str, command: &mut Command) -> anyhow::Result<()> {
    println!("xtask: {name}: {}", tools::describe(command));
    let status = command
        .status()
        .with_context(|| format!("{name}: could not start {:?}", command.get_program()))?;
    if !status.success() {
        bail!("{name} failed ({status})");
    }
    Ok(())
}

/// The workspace root: two levels above this crate's manifest.
fn workspace_root() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest
        .ancestors()
        .nth(2)
        .map_or_else(|| manifest.to_path_buf(), Path::to_path_buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_workspace_root_holds_the_workspace_manifest() {
        let manifest = std::fs::read_to_string(workspace_root().join("Cargo.toml")).unwrap();
        assert!(manifest.contains("[workspace]"));
    }

    #[test]
    fn package_selection_replaces_the_workspace() {
        let args = |list: &[&str]| list.iter().map(OsString::from).collect::<Vec<_>>();
        assert_eq!(package_scope(&[]), args(&["--workspace"]));
        assert_eq!(
            package_scope(&args(&["-p", "infera", "--package=xtask", "--release"])),
            args(&["-p", "infera", "--package=xtask"])
        );
        assert_eq!(
            package_scope(&args(&["--", "-p", "not-a-package-flag"])),
            args(&["--workspace"])
        );
    }

    #[test]
    fn bad_command_lines_are_rejected_with_the_usage() {
        let error = run(vec![]).unwrap_err().to_string();
        assert!(error.contains("usage"), "{error}");
        let error = run(vec!["frobnicate".into()]).unwrap_err().to_string();
        assert!(error.contains("unknown task"), "{error}");
        let error = run(vec!["test".into(), "-p".into()])
            .unwrap_err()
            .to_string();
        assert!(error.contains("after `--`"), "{error}");
    }
}
