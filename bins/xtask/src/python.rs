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
//! 4. The package a Python Infera user installs (`amd-infera`, see `kvd/python/README.md`), the
//!    way they install it: `pip install ./kvd/python` into a fresh venv
//!    (`target/py-wheel-venv`, made again every run), through the package's build backend
//!    (maturin's, which stages the `infera` binary first). The step hands it the debug binary
//!    stripped of its debug info (`INFERA_WHEEL_BINARY`) and the debug profile for the extension
//!    (`MATURIN_PEP517_ARGS`), so it rebuilds nothing; then `pytest kvd/python/wheel-tests` runs
//!    the installed entry points.

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

    let binary = stripped_binary(root)?;
    let fresh = root.join(WHEEL_VENV);
    if fresh.exists() {
        std::fs::remove_dir_all(&fresh).with_context(|| format!("cannot remove {WHEEL_VENV}"))?;
    }
    // The base interpreter of the pinned venv, with the pip it bundles.
    let mut create = Command::new(bin.join("python"));
    create.current_dir(root).args(["-m", "venv", WHEEL_VENV]);
    crate::run_step("python step: a fresh venv for the wheel", &mut create)?;
    // The build requirement (maturin, pinned in the test requirements), fetched once.
    let deps = root.join(WHEEL_OUT).join("build-deps");
    let maturin = requirements
        .lines()
        .find(|line| line.starts_with("maturin=="))
        .context("kvd/python/requirements-test.txt pins no maturin")?;
    let version = maturin.trim_start_matches("maturin==");
    let fetched = std::fs::read_dir(&deps).is_ok_and(|entries| {
        entries.filter_map(Result::ok).any(|entry| {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            name.starts_with(&format!("maturin-{version}-")) && name.ends_with(".whl")
        })
    });
    if !fetched {
        let mut fetch = Command::new(bin.join("python"));
        fetch
            .args(["-m", "pip", "download", "--quiet", "--no-deps", "--dest"])
            .arg(&deps)
            .arg(maturin);
        crate::run_step("python step: maturin for the build", &mut fetch)?;
    }
    // What a user runs, `pip install ./kvd/python` (build isolation, maturin from the folder
    // above), with the binary and the extension of the debug profile, already built above,
    // instead of a release build.
    let mut install = Command::new(fresh.join("bin/python"));
    install
        .current_dir(root)
        .args(["-m", "pip", "install", "--no-index", "--find-links"])
        .arg(&deps)
        .args(["--disable-pip-version-check", "--quiet", "./kvd/python"])
        .env("INFERA_WHEEL_BINARY", &binary)
        .env("MATURIN_PEP517_ARGS", "--profile dev")
        .env("CARGO_TARGET_DIR", root.join("target"));
    crate::run_step("python step: pip install ./kvd/python", &mut install)?;

    let mut pytest = Command::new(bin.join("python"));
    pytest
        .current_dir(root.join("kvd/python"))
        .args(["-m", "pytest", "-q", "wheel-tests", "--basetemp"])
        .arg(root.join("target/pytest/wheel-tests"))
        .env("INFERA_WHEEL_VENV", &fresh);
    crate::run_step("python step: pytest kvd/python/wheel-tests", &mut pytest)
}

/// The pinned venv's interpreter (with maturin), made by [`test`].
pub(crate) fn venv_python(root: &Path) -> PathBuf {
    root.join(VENV).join("bin/python")
}

/// The debug binary stripped of its debug info, for the wheel; returns its path.
pub(crate) fn stripped_binary(root: &Path) -> anyhow::Result<PathBuf> {
    let out = root.join(WHEEL_OUT);
    std::fs::create_dir_all(&out).with_context(|| format!("cannot create {WHEEL_OUT}"))?;
    let stripped = out.join("infera");
    let mut strip = Command::new("strip");
    strip
        .arg("--strip-debug")
        .arg("-o")
        .arg(&stripped)
        .arg(root.join("target/debug/infera"));
    crate::run_step("python step: strip the binary", &mut strip)?;
    Ok(stripped)
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
