"""``python -m infera.engine.vllm ARGS…`` is ``infera worker vllm ARGS…``:
launch vLLM and join the fleet."""

from infera._exec import exec_infera

if __name__ == "__main__":
    exec_infera("worker", "vllm")
