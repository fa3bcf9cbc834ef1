"""Fixtures: a real ``infera kvd`` process per test on a socket in the test's temp dir.

The binary is ``$INFERA_BIN`` (``cargo xtask test`` sets it) or the workspace's
``target/debug/infera``. A daemon that does not come up fails the test loudly.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
START_DEADLINE_S = 30.0


def infera_bin() -> str:
    path = os.environ.get("INFERA_BIN") or str(ROOT / "target" / "debug" / "infera")
    if not os.access(path, os.X_OK):
        pytest.fail(f"no infera binary at {path}: run `cargo build -p infera` or set INFERA_BIN")
    return path


class Daemon:
    """One ``infera kvd`` on ``socket`` with an L3 tablespace under ``long_path``."""

    def __init__(self, tmp: Path, max_bytes: str = "256MiB", arena: str = "auto", long_path: Path | None = None) -> None:
        self.socket = str(tmp / "kvd.sock")
        self.long_path = long_path or tmp / "l3"
        self.long_path.mkdir(exist_ok=True)
        self.args = [
            infera_bin(), "kvd", "--socket", self.socket, "--max-bytes", max_bytes,
            "--shared-arena-bytes", arena, "--long-path", str(self.long_path), "--long-bytes", "256MiB",
            "--io-mode", "buffered", "--kv-events-endpoint", "off",
        ]
        self.log = tmp / "kvd.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Daemon":
        """Starts the process and returns once it logged that it listens."""
        self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        ready = threading.Event()
        proc = self.proc

        def pump() -> None:  # copies the daemon's output to the log, flagging readiness
            with open(self.log, "ab") as log:
                for line in proc.stdout:
                    log.write(line)
                    log.flush()
                    if b"kvd listening" in line:
                        ready.set()
            ready.set()  # exited: wake the waiter, which sees the exit code

        threading.Thread(target=pump, daemon=True).start()
        if not ready.wait(START_DEADLINE_S) or proc.poll() is not None:
            self.stop()
            pytest.fail(f"infera kvd did not come up within {START_DEADLINE_S}s: {self.log.read_text()[-2000:]}")
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


@pytest.fixture
def daemon(tmp_path: Path):
    d = Daemon(tmp_path).start()
    yield d
    d.stop()


@pytest.fixture
def make_daemon(tmp_path: Path):
    made: list[Daemon] = []

    def make(**kw) -> Daemon:
        d = Daemon(tmp_path, **kw)
        made.append(d)
        return d

    yield make
    for d in made:
        d.stop()
