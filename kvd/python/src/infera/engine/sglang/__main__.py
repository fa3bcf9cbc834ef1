"""``python -m infera.engine.sglang ARGS…`` is ``infera worker sglang ARGS…``:
launch SGLang and join the fleet."""

from infera._exec import exec_infera

if __name__ == "__main__":
    exec_infera("worker", "sglang")
