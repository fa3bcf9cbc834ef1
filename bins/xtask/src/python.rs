//! `cargo xtask test`'s Python step: the package `kvd/python` (the vLLM connector, the SGLang
//! HiCache backend and the pyo3 client of `kvd/py`) against the real `vllm` and `sglang`
//! packages and a real `infera kvd`, then its wheel with the `infera` binary through the Python
//! Infera's entry points.
//!
//! 1. A virtual environment under `target/py-venv`, made with `$INFERA_PYTHON` (default
//!    `python3`, which must be CPython 3.11: the pinned sglang wheel is built for it), holding
//!    exactly `kvd/python/requirements-test.txt` (`pip install --no-deps`). It is cached: a
//!    stamp file records the requirements it was made from, and it is made again only when they
//!    change (the first run downloads ~2.7 GB of wheels, mostly torch's CUDA runtime, which
//!    PyPI's torch needs even to import on CPU: 37 s to download and 31 s to install on an idle
//!    2-core machine, 8.5 minutes with four builds beside it).
//! 2. `cargo build -p infera` (the daemon the tests start), then `maturin develop` (the
//!    extension, debug profile, into the venv; the Rust dependencies are the workspace's own).
//! 3. `pytest kvd/python/tests`, with `INFERA_BIN` naming the daemon binary.
//! 4. The wheel a Python Infera user installs (`amd-infera`, see `kvd/python/README.md`): the
//!    debug `infera` binary, stripped of its debug info (521 MB to 97 MB), is staged into the
//!    package, `maturin build --strip` packs it with the extension (a 29 MB wheel) and the
//!    staged copy is removed; the wheel is installed with `--no-deps` into a fresh venv without
//!    pip (`target/py-wheel-venv`, made again every run) and `pytest kvd/python/wheel-tests`
//!    runs its entry points. The step adds about 12 s to a run on a loaded 2-core machine
//!    (strip 0.6 s, wheel 7 s, venv and install 2.5 s, tests 2 s) and rebuilds nothing that
//!    `maturin develop` built.

use anyhow::{Context, bail};
use std::path::{Path, PathBuf};
use std::process::Command;

const REQUIREMENTS: &str = "kvd/python/requirements-test.txt";
const VENV: &str = "target/py-venv";
const STAMP: &str = ".infera-requirements";
/// Where the wheel step stages the binary; git-ignored, and `pyproject.toml` includes it.
const STAGED_BINARY: &str = "kvd/python/src/infera/_bin/infera";
const WHEEL_OUT: &str = "target/py-wheel";
const WHEEL_VENV: &str = "target/py-wheel-venv";

/// Runs the Python step (see the module docs).
///
/// # Errors
/// The first step that fails, by name.
pub fn test(root: &Path, cargo: impl Fn() -> Command) -> anyhow::Result<()> {
    let venv = root.join(VENV);
    let requirements = std::fs::read_to_string(root.join(REQUIREMENTS))
        .with_context(|| format!("cannot read {REQUIREMENTS}"))?;
    ensure_venv(root, &venv, &requirements)?;
    let bin = venv.join("bin");
    // A binary left staged by an interrupted run would be packed into the develop install too.
    remove_staged_binary(root)?;

    let mut build = cargo();
    build.args(["build", "-p", "infera"]);
    crate::run_step("python step: the infera binary", &mut build)?;

    let mut develop = Command::new(bin.join("maturin"));
    develop
        .current_dir(root.join("kvd/python"))
        .args(["develop", "--quiet"])
        .env("VIRTUAL_ENV", &venv)
        .env("CARGO_TARGET_DIR", root.join("target"));
    crate::run_step("python step: the extension", &mut develop)?;

    // pytest creates its basetemp, not the directory above it.
    std::fs::create_dir_all(root.join("target/pytest"))
        .context("cannot create target/pytest for pytest's temporary files")?;
    let mut pytest = Command::new(bin.join("python"));
    pytest
        .current_dir(root.join("kvd/python"))
        .args(["-m", "pytest", "-q", "tests", "--basetemp"])
        // One run's temporary files at most (each test's kvd preallocates its L3 region):
        // pytest empties its basetemp at the start of a run instead of keeping three runs.
        .arg(root.join("target/pytest/tests"))
        .env("INFERA_BIN", root.join("target/debug/infera"));
    crate::run_step("python step: pytest kvd/python/tests", &mut pytest)?;

    let wheel = build_wheel(root, &venv)?;
    let fresh = root.join(WHEEL_VENV);
    if fresh.exists() {
        std::fs::remove_dir_all(&fresh).with_context(|| format!("cannot remove {WHEEL_VENV}"))?;
    }
    // The base interpreter of the pinned venv; without pip: the wheel is all it will hold.
    let mut create = Command::new(bin.join("python"));
    create
        .current_dir(root)
        .args(["-m", "venv", "--without-pip", WHEEL_VENV]);
    crate::run_step("python step: a fresh venv for the wheel", &mut create)?;
    let mut install = Command::new(bin.join("python"));
    install
        .current_dir(root)
        .args(["-m", "pip", "--python"])
        .arg(fresh.join("bin/python"))
        .args([
            "install",
            "--no-deps",
            "--no-index",
            "--no-cache-dir",
            "--disable-pip-version-check",
            "--quiet",
        ])
        .arg(&wheel);
    crate::run_step("python step: install the wheel", &mut install)?;

    let mut pytest = Command::new(bin.join("python"));
    pytest
        .current_dir(root.join("kvd/python"))
        .args(["-m", "pytest", "-q", "wheel-tests", "--basetemp"])
        .arg(root.join("target/pytest/wheel-tests"))
        .env("INFERA_WHEEL_VENV", &fresh);
    crate::run_step("python step: pytest kvd/python/wheel-tests", &mut pytest)
}

/// Stages the stripped debug binary, builds the wheel into [`WHEEL_OUT`] and unstages the
/// binary; returns the wheel's path.
fn build_wheel(root: &Path, venv: &Path) -> anyhow::Result<PathBuf> {
    let staged = root.join(STAGED_BINARY);
    if let Some(dir) = staged.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    let mut strip = Command::new("strip");
    strip
        .arg("-o")
        .arg(&staged)
        .arg(root.join("target/debug/infera"));
    crate::run_step("python step: stage the binary", &mut strip)?;

    let out = root.join(WHEEL_OUT);
    if out.exists() {
        std::fs::remove_dir_all(&out).with_context(|| format!("cannot remove {WHEEL_OUT}"))?;
    }
    let mut build = Command::new(venv.join("bin/maturin"));
    build
        .current_dir(root.join("kvd/python"))
        .args(["build", "--quiet", "--strip", "--interpreter"])
        .arg(venv.join("bin/python"))
        .arg("--out")
        .arg(&out)
        .env("VIRTUAL_ENV", venv)
        .env("CARGO_TARGET_DIR", root.join("target"));
    let built = crate::run_step("python step: the wheel", &mut build);
    remove_staged_binary(root)?;
    built?;

    let wheels: Vec<PathBuf> = std::fs::read_dir(&out)
        .with_context(|| format!("cannot read {WHEEL_OUT}"))?
        .filter_map(|entry| entry.ok().map(|entry| entry.path()))
        .filter(|path| path.extension().is_some_and(|ext| ext == "whl"))
        .collect();
    match wheels.as_slice() {
        [wheel] => Ok(wheel.clone()),
        _ => bail!("python step: expected one wheel in {WHEEL_OUT}, found {wheels:?}"),
    }
}

/// Removes the staged binary, if any.
fn remove_staged_binary(root: &Path) -> anyhow::Result<()> {
    match std::fs::remove_file(root.join(STAGED_BINARY)) {
        Err(error) if error.kind() != std::io::ErrorKind::NotFound => {
            Err(error).with_context(|| format!("cannot remove {STAGED_BINARY}"))
        }
        _ => Ok(()),
    }
}

/// Makes the venv unless one made from these `requirements` exists.
fn ensure_venv(root: &Path, venv: &Path, requirements: &str) -> anyhow::Result<()> {
    let stamp = venv.join(STAMP);
    if std::fs::read_to_string(&stamp).is_ok_and(|s| s == requirements) {
        println!("xtask: python step: reusing {VENV}");
        return Ok(());
    }
    let python = std::env::var_os("INFERA_PYTHON").unwrap_or_else(|| "python3".into());
    let version = Command::new(&python)
        .args(["-c", "import sys; print('%d.%d' % sys.version_info[:2])"])
        .output()
        .with_context(|| format!("python step: cannot run {python:?}; install CPython 3.11"))?;
    let version = String::from_utf8_lossy(&version.stdout).trim().to_owned();
    if version != "3.11" {
        bail!(
            "python step: {python:?} is Python {version}; the pinned sglang wheel needs CPython \
             3.11 (set INFERA_PYTHON to a python3.11)"
        );
    }
    if venv.exists() {
        std::fs::remove_dir_all(venv).with_context(|| format!("cannot remove the old {VENV}"))?;
    }
    let mut create = Command::new(&python);
    create.current_dir(root).args(["-m", "venv", VENV]);
    crate::run_step("python step: venv", &mut create)?;
    let mut install = Command::new(venv.join("bin/pip"));
    install.current_dir(root).args([
        "install",
        "--no-deps",
        "--disable-pip-version-check",
        "--quiet",
        "-r",
        REQUIREMENTS,
    ]);
    crate::run_step("python step: pinned packages", &mut install)?;
    std::fs::write(&stamp, requirements).with_context(|| format!("cannot write {STAMP}"))?;
    Ok(())
}
