"""The vLLM worker: ``python -m infera.engine.vllm`` runs ``infera worker vllm``."""
