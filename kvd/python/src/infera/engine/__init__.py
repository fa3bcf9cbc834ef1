"""The Python Infera's engine launchers (``python -m infera.engine.vllm|sglang|atom``) and
connectors."""
