"""The Python Infera's import path of its vLLM KV connector, kept so that existing
``--kv-transfer-config`` values (``"kv_connector_module_path":
"infera.engine.vllm.kvd_connector"``, which ``infera worker vllm --infera-kvd-socket`` writes
too) load Infera's connector unchanged: :mod:`infera_kvd.vllm_connector`.

It sits beside ``__main__.py`` (``python -m infera.engine.vllm``) in this package, which
replaces the Python Infera's (same distribution name, ``amd-infera``).
"""

from __future__ import annotations

from typing import Any

CLASS_NAME = "InferaKvdConnector"


def __getattr__(name: str) -> Any:
    # vLLM imports this module and then asks for the class: build it (importing vLLM) only then.
    from infera_kvd import vllm_connector

    return getattr(vllm_connector, name)
