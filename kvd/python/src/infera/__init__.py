"""Infera, installed under the Python Infera's package name (``amd-infera``).

The ``python -m infera.…`` entry points run the ``infera`` binary shipped in this package
(:mod:`infera._exec`); the engine connectors keep the Python Infera's import paths
(``infera.engine.vllm.kvd_connector``, ``infera.engine.sglang.kvd_adapter``) and live in
:mod:`infera_kvd`.
"""
