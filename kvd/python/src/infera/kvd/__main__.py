"""``python -m infera.kvd ARGS…`` is ``infera kvd ARGS…``: the KV-cache daemon."""

from infera._exec import exec_infera

if __name__ == "__main__":
    exec_infera("kvd")
