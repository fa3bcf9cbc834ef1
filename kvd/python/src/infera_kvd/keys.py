"""Block keys: the same token ids give the same keys in every process.

A block is ``block_size`` consecutive token ids; only full blocks have keys. The key of block
``i`` chains the key of block ``i - 1`` (empty for the first) with the block's token ids, each as
a little-endian ``uint32``, through SHA-256, truncated to 16 bytes::

    key[i] = sha256(key[i-1] + u32le(tokens[i*bs:(i+1)*bs]))[:16]

so a key names the whole prefix up to its block. Nothing process-local enters it (no Python
hash seed, no engine block hash), which is what lets a restarted engine, another replica of the
same model and layout, and the router's prewarm (which sends these keys as hex) agree. What
makes blocks incompatible — model, dtype, layout, parallel rank — is the namespace's
``compat_key``, not the key.

A request the engine keys by more than its tokens (a LoRA adapter, a ``cache_salt``, images:
vLLM's block-hash extra keys) gives a ``scope``: the chain then starts from
``sha256(b"infera-kv-scope\0" + scope)[:16]`` instead of nothing, so its blocks never share keys
with another adapter's, another tenant's or another image's.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

KEY_BYTES = 16


def block_keys(
    token_ids: Sequence[int], block_size: int, start: int = 0, stop: int | None = None, scope: bytes = b""
) -> list[bytes]:
    """Keys of the full blocks ``start .. stop`` (block indices) of ``token_ids``, in ``scope``
    (empty: plain text, the router's keys).

    Blocks before ``start`` are hashed too (the chain needs them) but not returned.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    full = len(token_ids) // block_size
    stop = full if stop is None else min(stop, full)
    out: list[bytes] = []
    prev = hashlib.sha256(b"infera-kv-scope\0" + scope).digest()[:KEY_BYTES] if scope else b""
    for i in range(stop):
        chunk = array("I", token_ids[i * block_size : (i + 1) * block_size])
        if chunk.itemsize != 4:  # pragma: no cover - every supported platform has 4-byte I
            chunk = array("L", chunk)
        prev = hashlib.sha256(prev + chunk.tobytes()).digest()[:KEY_BYTES]
        if i >= start:
            out.append(prev)
    return out
