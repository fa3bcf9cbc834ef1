"""The built ``amd-infera`` wheel, installed with ``--no-deps`` into a fresh virtual environment
(``$INFERA_WHEEL_VENV``, which ``cargo xtask test`` makes), run the way the Python Infera's
manifests run it: every ``python -m infera.…`` entry point and the ``infera`` console script
behave as the shipped binary does with the same arguments (help, ``--check-config``, usage
errors, SIGTERM), and the engine connectors import under the Python Infera's paths.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from pathlib import Path
from typing import NamedTuple

import pytest

# Every step of these tests is bounded: a hung entry point fails its test, never the suite.
DEADLINE_S = 60.0


class Entry(NamedTuple):
    module: str  # python -m MODULE
    subcommand: list[str]  # runs `infera SUBCOMMAND…`
    valid: list[str]  # a valid command line ({tmp}: the test's directory)
    field: tuple[tuple[str, ...], object]  # a field of --check-config's JSON it sets, and its value
    bad_flag: str  # an Infera flag of the entry point that refuses the value "zookeeper"


# Fleet-wide flags the manifests' command lines carry (etcd: validating needs no cluster).
DISCOVERY = ["--discovery-backend", "etcd", "--etcd-endpoint", "127.0.0.1:2379"]
ENTRY_POINTS = [
    Entry("infera.server", ["server"], ["--port", "8123", "--router-tokenizer-path", "{tmp}", *DISCOVERY],
          (("http", "port"), 8123), "--request-transport"),
    Entry("infera.engine.vllm", ["worker", "vllm"], ["--model-path", "org/m", "--port", "8001", *DISCOVERY],
          (("engine",), "vllm"), "--kv-event-transport"),
    Entry("infera.engine.sglang", ["worker", "sglang"], ["--model-path", "org/m", "--port", "8002", *DISCOVERY],
          (("engine",), "sglang"), "--request-transport"),
    Entry("infera.engine.atom", ["worker", "atom"], ["--model", "org/m", "--server-port", "8003", *DISCOVERY],
          (("engine",), "atom"), "--kv-event-transport"),
    Entry("infera.kvd", ["kvd"], ["--socket", "{tmp}/kvd.sock", "--max-bytes", "64MiB"],
          (("socket",), "{tmp}/kvd.sock"), "--io-mode"),
]
IDS = [entry.module for entry in ENTRY_POINTS]


@pytest.fixture(scope="session")
def venv() -> Path:
    path = os.environ.get("INFERA_WHEEL_VENV")
    if not path or not (Path(path) / "bin" / "python").exists():
        pytest.fail("INFERA_WHEEL_VENV must name a venv with the wheel installed (cargo xtask test)")
    return Path(path)


@pytest.fixture(scope="session")
def binary(venv: Path) -> Path:
    """The binary inside the installed package (not the workspace's build)."""
    found = list((venv / "lib").glob("python3*/site-packages/infera/_bin/infera"))
    assert len(found) == 1, f"the installed package holds no single infera binary: {found}"
    assert os.access(found[0], os.X_OK), f"{found[0]} is not executable"
    return found[0]


def clean_env() -> dict[str, str]:
    """This environment without the variables the commands read (the machine's own must not
    change the defaults under test)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("INFERA_", "NATS_", "HF_"))}
    env.pop("RUST_LOG", None)
    return env


def run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, env=clean_env(), capture_output=True, text=True, timeout=DEADLINE_S)


def module(venv: Path, name: str, args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return run([str(venv / "bin" / "python"), "-m", name, *args], cwd)


def assert_same(via_python: subprocess.CompletedProcess[str], direct: subprocess.CompletedProcess[str]) -> None:
    """The entry point's exit code and output are exactly the binary's."""
    assert via_python.returncode == direct.returncode, via_python.stderr
    assert via_python.stdout == direct.stdout
    assert via_python.stderr == direct.stderr


def fill(args: list[str], tmp: Path) -> list[str]:
    return [arg.format(tmp=tmp) for arg in args]


@pytest.fixture
def tmp(tmp_path: Path) -> Path:
    (tmp_path / "tokenizer.json").write_text("{}")  # readable is all --check-config asks
    return tmp_path


@pytest.mark.parametrize("entry", ENTRY_POINTS, ids=IDS)
def test_help_names_the_subcommand(venv: Path, binary: Path, tmp: Path, entry: Entry) -> None:
    result = module(venv, entry.module, ["--help"], tmp)
    assert result.returncode == 0, result.stderr
    assert f"Usage: infera {' '.join(entry.subcommand)} [OPTIONS]" in result.stdout
    assert_same(result, run([str(binary), *entry.subcommand, "--help"], tmp))


@pytest.mark.parametrize("entry", ENTRY_POINTS, ids=IDS)
def test_check_config_prints_the_configuration(venv: Path, binary: Path, tmp: Path, entry: Entry) -> None:
    args = [*fill(entry.valid, tmp), "--check-config"]
    result = module(venv, entry.module, args, tmp)
    assert result.returncode == 0, result.stderr
    config = json.loads(result.stdout)
    path, expected = entry.field
    for key in path:
        config = config[key]
    assert config == (expected.format(tmp=tmp) if isinstance(expected, str) else expected)
    assert_same(result, run([str(binary), *entry.subcommand, *args], tmp))


@pytest.mark.parametrize("entry", ENTRY_POINTS, ids=IDS)
def test_a_usage_error_exits_2_with_the_binarys_message(venv: Path, binary: Path, tmp: Path, entry: Entry) -> None:
    # Workers forward unknown flags to the engine, so the error is a bad value of an Infera flag.
    args = [*fill(entry.valid, tmp), entry.bad_flag, "zookeeper"]
    result = module(venv, entry.module, args, tmp)
    assert result.returncode == 2, result.stderr
    assert f"invalid value 'zookeeper' for '{entry.bad_flag}" in result.stderr
    assert result.stdout == ""
    assert_same(result, run([str(binary), *entry.subcommand, *args], tmp))


def test_gaie_is_forwarded_to_infera_gaie(venv: Path, binary: Path, tmp: Path) -> None:
    result = module(venv, "infera.gaie", ["--help"], tmp)
    assert_same(result, run([str(binary), "gaie", "--help"], tmp))
    # Until the binary has the subcommand, the forwarding shows in clap's refusal of it.
    if "\n  gaie " in run([str(binary), "--help"], tmp).stdout:
        assert result.returncode == 0, result.stderr
        assert "Usage: infera gaie [OPTIONS]" in result.stdout
    else:
        assert result.returncode == 2
        assert "unrecognized subcommand 'gaie'" in result.stderr


def test_the_console_script_is_the_binary(venv: Path, binary: Path, tmp: Path) -> None:
    script = venv / "bin" / "infera"
    for args in (["--version"], ["server", "--help"], ["no-such-command"]):
        assert_same(run([str(script), *args], tmp), run([str(binary), *args], tmp))
    assert run([str(script), "--version"], tmp).stdout.startswith("infera ")


def test_kvd_runs_in_place_of_python_and_stops_cleanly_on_sigterm(venv: Path, binary: Path, tmp: Path) -> None:
    socket = tmp / "kvd.sock"
    proc = subprocess.Popen(
        [str(venv / "bin" / "python"), "-m", "infera.kvd", "--socket", str(socket), "--max-bytes", "64MiB"],
        env=clean_env(), stderr=subprocess.PIPE, text=True,
    )
    watchdog = threading.Timer(DEADLINE_S, proc.kill)  # bounds the wait for the log line
    watchdog.start()
    try:
        # The daemon logs when it listens (its signal handlers are installed before that).
        for line in proc.stderr:
            if "kvd listening" in line:
                break
        else:
            pytest.fail(f"python -m infera.kvd exited ({proc.wait(DEADLINE_S)}) before listening")
        # The process Popen started is now the binary itself (exec'd, not a child of Python),
        # so the signal reaches the daemon directly.
        assert Path(f"/proc/{proc.pid}/exe").resolve() == binary.resolve()
        assert socket.is_socket()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(DEADLINE_S) == 0
        assert not socket.exists(), "the daemon removes its socket on shutdown"
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait(DEADLINE_S)


def test_the_connectors_import_under_the_python_inferas_paths(venv: Path, tmp: Path) -> None:
    # Resolving the modules needs neither vLLM nor SGLang (the classes import them when built).
    code = (
        "import infera_kvd, infera.engine.vllm.kvd_connector as v, infera.engine.sglang.kvd_adapter as s;"
        "print(v.CLASS_NAME, s.CLASS_NAME, infera_kvd.KvdClient.__name__)"
    )
    result = run([str(venv / "bin" / "python"), "-c", code], tmp)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["InferaKvdConnector", "InferaKvdBackend", "KvdClient"]
