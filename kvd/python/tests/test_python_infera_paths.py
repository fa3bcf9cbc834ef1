"""The Python Infera's module paths for the engine connectors resolve to this package's
classes, under exactly the names ``infera worker vllm|sglang --infera-kvd-socket`` writes into
the engine's configuration (read from the launcher's source, so the two cannot drift)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

LAUNCHER = Path(__file__).resolve().parents[3] / "bins/infera/src/worker/launch/kvd.rs"


def launcher_constant(name: str) -> str:
    found = re.search(rf'pub const {name}: &str = "([^"]+)";', LAUNCHER.read_text())
    assert found, f"{name} not in {LAUNCHER}"
    return found.group(1)


def test_the_vllm_connector_the_launcher_names_is_ours() -> None:
    module = importlib.import_module(launcher_constant("VLLM_CONNECTOR_MODULE"))
    cls = getattr(module, launcher_constant("VLLM_CONNECTOR"))
    from infera_kvd.vllm_connector import InferaKvdConnector

    assert cls is InferaKvdConnector


def test_the_sglang_backend_the_launcher_names_is_ours() -> None:
    module = importlib.import_module(launcher_constant("SGLANG_BACKEND_MODULE"))
    cls = getattr(module, launcher_constant("SGLANG_BACKEND_CLASS"))
    from infera_kvd import sglang_backend

    assert cls is getattr(sglang_backend, sglang_backend.CLASS_NAME)
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

    assert issubclass(cls, HiCacheStorage)
