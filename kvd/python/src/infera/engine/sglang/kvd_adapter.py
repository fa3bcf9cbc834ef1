"""The Python Infera's import path of its SGLang HiCache storage backend, kept so that existing
``--hicache-storage-backend-extra-config`` values (``"module_path":
"infera.engine.sglang.kvd_adapter", "class_name": "InferaKvdBackend"``, which ``infera worker
sglang --infera-kvd-socket`` writes too) load Infera's backend unchanged:
:mod:`infera_kvd.sglang_backend`.

It sits beside ``__main__.py`` (``python -m infera.engine.sglang``) in this package, which
replaces the Python Infera's (same distribution name, ``amd-infera``).
"""

from __future__ import annotations

from typing import Any

CLASS_NAME = "InferaKvdBackend"


def __getattr__(name: str) -> Any:
    # SGLang's factory imports this module and then asks for the class: build it only then.
    from infera_kvd import sglang_backend

    if name == CLASS_NAME:
        return getattr(sglang_backend, sglang_backend.CLASS_NAME)
    return getattr(sglang_backend, name)
