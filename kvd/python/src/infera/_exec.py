"""Runs the ``infera`` binary shipped inside this package in place of the Python process.

Each ``python -m infera.…`` entry point of the Python Infera (and the ``infera`` console script)
calls :func:`exec_infera` with its subcommand. ``os.execv`` replaces the interpreter with the
binary, so the process id, stdout/stderr, exit code and signal handling are the binary's own,
exactly as if it had been started directly: a manifest's ``python -m infera.server …`` runs
``infera server …`` with the same arguments.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

# Package data: the binary travels inside the package, so it is found wherever pip put the
# package (a venv, --user, --target, PYTHONPATH), independent of the install scheme's bin dir.
BINARY = Path(__file__).resolve().parent / "_bin" / "infera"


def exec_infera(*subcommand: str) -> None:
    """Replaces this process with ``infera SUBCOMMAND… ARGS…``, ARGS being this process's own."""
    if not os.access(BINARY, os.X_OK):
        sys.exit(
            f"infera: this installation lacks its binary ({BINARY} is missing or not "
            "executable); install the wheel built as kvd/python/README.md describes"
        )
    # The interpreter ignores SIGPIPE and SIGXFSZ; an exec'd program inherits ignored
    # signals, so give the binary the dispositions it would have had when started directly.
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(BINARY, [str(BINARY), *subcommand, *sys.argv[1:]])


def main() -> None:
    """The ``infera`` console script: the binary with this command line."""
    exec_infera()
