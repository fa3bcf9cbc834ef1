"""``python -m infera.server ARGS…`` is ``infera server ARGS…``:
the OpenAI-compatible HTTP server and KV-aware router."""

from infera._exec import exec_infera

if __name__ == "__main__":
    exec_infera("server")
