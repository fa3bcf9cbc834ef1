"""Infera's kvd, engine side.

- :mod:`infera_kvd.client`: :class:`KvdClient`, the Rust client (``infera_kvd._native``) with
  namespaces, retention and TTL per call, and the shared arena as buffers.
- :mod:`infera_kvd.keys`: block keys every engine, replica and the router's prewarm derive
  identically from token ids.
- :mod:`infera_kvd.packed`: the packed multi-layer block (a header, then one slice per layer).
- :mod:`infera_kvd.vllm_connector`: ``InferaKvdConnector``, a vLLM ``KVConnectorBase_V1``
  (vLLM is imported only when the class is first used).
- :mod:`infera_kvd.sglang_backend`: ``InferaKvdHiCacheStorage``, an SGLang HiCache storage
  backend for its ``dynamic`` storage hook.
"""

from infera_kvd._native import KvdError, KvdUnavailable
from infera_kvd.client import KvdClient
from infera_kvd.keys import block_keys

__all__ = ["KvdClient", "KvdError", "KvdUnavailable", "block_keys"]
