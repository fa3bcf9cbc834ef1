"""``python -m infera.gaie ARGS…`` is ``infera gaie ARGS…``:
the Gateway API Inference Extension's endpoint picker."""

from infera._exec import exec_infera

if __name__ == "__main__":
    exec_infera("gaie")
