"""The package's PEP 517 build backend: maturin's, with the `infera` binary built first.

maturin packs one kind of artifact per project (here the pyo3 extension), so the binary is
built by cargo and staged at ``src/infera/_bin/infera`` (git-ignored), which the wheel includes
(``tool.maturin.include``), and removed after the build. ``pip install ./kvd/python`` and ``pip
wheel ./kvd/python`` therefore give a working installation in one command, from a checkout of
the workspace (the binary's crates live beside this package, so there is no sdist).

Environment:

- ``INFERA_WHEEL_PROFILE``: the cargo profile of the binary (default ``release``, which
  carries no debug info); ``MATURIN_PEP517_ARGS`` sets the extension's (``--profile dev``).
- ``INFERA_WHEEL_BINARY``: pack this already-built binary (an absolute path) instead of
  building one.
- ``CARGO``, ``CARGO_TARGET_DIR``: as cargo reads them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import maturin

_PACKAGE = Path(__file__).resolve().parents[1]
_WORKSPACE = _PACKAGE.parents[1]
_STAGED = _PACKAGE / "src" / "infera" / "_bin" / "infera"

# maturin's hooks that need no binary.
get_requires_for_build_wheel = maturin.get_requires_for_build_wheel
get_requires_for_build_editable = maturin.get_requires_for_build_editable
prepare_metadata_for_build_wheel = maturin.prepare_metadata_for_build_wheel
if hasattr(maturin, "prepare_metadata_for_build_editable"):
    prepare_metadata_for_build_editable = maturin.prepare_metadata_for_build_editable


def _built_binary() -> Path:
    given = os.environ.get("INFERA_WHEEL_BINARY")
    if given:
        path = Path(given)
        if not path.is_file():
            raise RuntimeError(
                f"INFERA_WHEEL_BINARY={given}: no such file (pip runs this backend in "
                f"{Path.cwd()}: give an absolute path)"
            )
        return path
    if not (_WORKSPACE / "bins" / "infera" / "Cargo.toml").is_file():
        raise RuntimeError(
            f"the infera binary is built from the workspace around {_PACKAGE}, "
            "which is not there: build the wheel from a checkout"
        )
    profile = os.environ.get("INFERA_WHEEL_PROFILE", "release")
    cargo = os.environ.get("CARGO", "cargo")
    command = [cargo, "build", "--locked", "--profile", profile, "-p", "infera"]
    print(f"Running `{' '.join(command)}` in {_WORKSPACE}", flush=True)
    # cargo reports on stderr; pip shows the backend's output with -v.
    subprocess.run(command, cwd=_WORKSPACE, check=True, stdout=sys.stderr)
    target = Path(os.environ.get("CARGO_TARGET_DIR", _WORKSPACE / "target"))
    return target / ("debug" if profile == "dev" else profile) / "infera"


@contextlib.contextmanager
def _staged_binary():
    binary = _built_binary()
    _STAGED.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(binary, _STAGED)
    _STAGED.chmod(0o755)
    try:
        yield
    finally:
        _STAGED.unlink(missing_ok=True)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    with _staged_binary():
        return maturin.build_wheel(wheel_directory, config_settings, metadata_directory)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    with _staged_binary():
        return maturin.build_editable(wheel_directory, config_settings, metadata_directory)


def build_sdist(sdist_directory, config_settings=None):
    raise RuntimeError(
        "amd-infera has no sdist: its binary is built from the whole Rust workspace; "
        "build a wheel from a checkout (pip wheel ./kvd/python)"
    )
