#!/usr/bin/env python3
"""Live TTFT of a conversation's next turn after its prefix was evicted from the GPU to the
node's kvd (host RAM), with the router's tiered cost (the default) against the GPU-only cost
(``--router-host-cache-hit-weight 0``, what the router did before it saw kvd).

The fleet is the one of ``bins/infera/tests/kvd_tiers.rs``, at the mocks' real speed: etcd, two
"nodes" each with an ``infera kvd`` and an ``infera worker mock`` (256 GPU blocks, saving to and
loading from its node's kvd), and ``infera server``. For each conversation: turn 1 on node a,
other prompts that evict it from a's GPU, its system prompt on node b's GPU; then turn 2
through the router, timed to its first token (``max_tokens`` 1, streamed). The server is
restarted with each setting in turn (A B A B ...) on the same nodes; the medians are printed.

    python3 bins/infera/benches/kvd_turns.py [--infera target/release/infera] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
TOKENIZER = str(ROOT / "fixtures" / "tokenizers" / "deepseek-v4")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_mock_port() -> int:
    """A free port whose + 10000 and + 20000 (the mock's kv-event ports) exist too."""
    while True:
        port = free_port()
        if port < 45000:
            return port


def spawn(stack: ExitStack, argv: list[str]) -> subprocess.Popen:
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    stack.callback(lambda: (proc.terminate(), proc.wait(10)))
    return proc


def wait_for(what: str, probe, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if probe():
                return
        except OSError:
            pass
        time.sleep(0.05)
    sys.exit(f"timed out waiting for {what}")


def get(port: int, path: str):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
        return json.load(r)


def complete(port: int, prompt: str) -> float:
    """Seconds to the first streamed token."""
    body = json.dumps(
        {"model": TOKENIZER, "prompt": prompt, "max_tokens": 1, "stream": True}
    ).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        body,
        {"content-type": "application/json"},
    )
    start = time.perf_counter()
    with urllib.request.urlopen(req, timeout=30) as r:
        for line in r:
            if line.startswith(b"data: {"):
                return time.perf_counter() - start
    sys.exit("no token streamed")


def words(tag: str, n: int) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


def entry(port: int, worker: int) -> dict:
    for w in get(port, "/v1/workers")["data"]:
        if w["record"]["worker_id"] == f"127.0.0.1:{worker}":
            return w
    return {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--infera", default=str(ROOT / "target" / "release" / "infera"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--turns", type=int, default=6, help="conversations per round")
    args = ap.parse_args()
    infera = args.infera
    with ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        etcd_port, peer = free_port(), free_port()
        etcd = f"http://127.0.0.1:{etcd_port}"
        spawn(stack, ["etcd", "--data-dir", os.path.join(tmp, "etcd"),
                      "--listen-client-urls", etcd, "--advertise-client-urls", etcd,
                      "--listen-peer-urls", f"http://127.0.0.1:{peer}"])
        nodes = []
        for name in ("a", "b"):
            sock = os.path.join(tmp, f"{name}.sock")
            events = free_port()
            spawn(stack, [infera, "kvd", "--socket", sock,
                          "--kv-events-endpoint", f"tcp://127.0.0.1:{events}",
                          "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{free_port()}"])
            wait_for("kvd", lambda: os.path.exists(sock))
            port = free_mock_port()
            spawn(stack, [infera, "worker", "mock", "--model-path", TOKENIZER,
                          "--host", "127.0.0.1", "--port", str(port), "--block-size", "16",
                          "--discovery-backend", "etcd", "--etcd-endpoint", etcd,
                          "--request-transport", "http", "--kv-event-transport", "zmq",
                          "--gpu-blocks", "256", "--infera-kvd-socket", sock])
            nodes.append(port)
        a, b = nodes
        results: dict[str, list[float]] = {"tiered (default)": [], "GPU-only": []}
        settings = {"tiered (default)": [], "GPU-only": ["--router-host-cache-hit-weight", "0"]}
        for rnd in range(args.rounds):
            for label, extra in settings.items():
                port = free_port()
                server = subprocess.Popen(
                    [infera, "server", "--router-tokenizer-path", TOKENIZER,
                     "--host", "127.0.0.1", "--port", str(port),
                     "--discovery-backend", "etcd", "--etcd-endpoint", etcd,
                     "--request-transport", "http", "--kv-event-transport", "zmq", *extra],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                try:
                    wait_for("the server to know both kvds", lambda: all(
                        entry(port, w).get("kvd") for w in (a, b)))

                    def host_blocks() -> int:
                        return entry(port, a)["kvd"]["tiers"]["host"]["blocks"]

                    # The server's subscription is up once a's next save reaches it.
                    complete(a, words(f"r{rnd}{label[0]}probe", 40))
                    wait_for("a's kvd events", lambda: host_blocks() > 0)
                    for c in range(args.turns):
                        tag = f"r{rnd}{label[0]}c{c}"
                        system = words(f"{tag}sys", 120)
                        turn1 = f"{system} {words(f'{tag}hist', 200)}"
                        before = host_blocks()
                        complete(a, turn1)
                        for i in range(6):
                            complete(a, words(f"{tag}other{i}x", 250))
                        wait_for("a's kvd to publish the turn and the others",
                                 lambda: host_blocks() >= before + 350)
                        complete(b, system)
                        wait_for("the router to see b's system prompt",
                                 lambda: entry(port, b)["load"][0]["cached_blocks"] >= 10)
                        results[label].append(
                            complete(port, f"{turn1} {words(f'{tag}q', 20)}"))
                finally:
                    server.terminate()
                    server.wait(10)
        for label, ttfts in results.items():
            ms = sorted(t * 1000 for t in ttfts)
            print(f"{label}: TTFT p50 {statistics.median(ms):.1f} ms "
                  f"(min {ms[0]:.1f}, max {ms[-1]:.1f}, n {len(ms)})")
        tiered = statistics.median(results["tiered (default)"])
        gpu_only = statistics.median(results["GPU-only"])
        print(f"tiered / GPU-only: {tiered / gpu_only:.2f}")


if __name__ == "__main__":
    main()
