"""``python -m infera.engine.atom ARGS…`` is ``infera worker atom ARGS…``:
launch ATOM and join the fleet."""

from infera._exec import exec_infera

if __name__ == "__main__":
    exec_infera("worker", "atom")
