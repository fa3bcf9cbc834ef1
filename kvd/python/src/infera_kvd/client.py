"""``KvdClient``: the Rust client (``infera_kvd._native.Client``) bound to one namespace.

Every call has a deadline (``timeout_s``); a failed connection is replaced on the next call, so
a restarted daemon costs misses, not errors: the ``try_*`` methods turn
``KvdUnavailable``/``KvdError`` into misses and log them once per state change.

The shared arena: :meth:`KvdClient.lookup` returns ``Slot`` buffers read in place and
:meth:`KvdClient.reserve` a writable ``Lease`` to fill in place and :meth:`KvdClient.commit`.
``torch.frombuffer(slot_or_lease, dtype=torch.uint8)`` is a tensor over arena memory, so a copy
from or to the KV cache is the only copy. Whether the arena is pinned for DMA (CUDA driver
or HIP runtime present) is in :meth:`KvdClient.arena_info` and logged once.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

from infera_kvd._native import Client, KvdError, Lease, Slot

logger = logging.getLogger("infera_kvd")

RETENTIONS = ("none", "ephemeral", "short", "long")
DEFAULT_SOCKET = "/tmp/infera-kvd.sock"


def socket_path(explicit: str | None = None) -> str:
    """``explicit``, else ``INFERA_KVD_SOCKET``, else the daemon's default path."""
    return explicit or os.environ.get("INFERA_KVD_SOCKET") or DEFAULT_SOCKET


class KvdClient:
    """A namespace ``(model, compat_key)`` on the daemon at ``path``."""

    def __init__(
        self,
        path: str,
        model: str,
        compat_key: str,
        *,
        client_id: str = "infera-kvd-py",
        timeout_s: float = 5.0,
        shared_arena: bool = True,
        pin: bool = True,
    ) -> None:
        self.path = path
        self.model = model
        self.compat_key = compat_key
        self._native = Client(path, client_id=client_id, timeout_s=timeout_s, shared_arena=shared_arena, pin=pin)
        self._healthy: bool | None = None
        self._arena_logged = False

    def _note(self, ok: bool, what: str, error: Exception | None = None) -> None:
        if ok and self._healthy is not True:
            info = self._native.arena_info()
            logger.info("kvd at %s answers (%s); arena: %s", self.path, what, info)
        elif not ok and self._healthy is not False:
            logger.warning("kvd at %s failed (%s): %s; treating as misses until it answers", self.path, what, error)
        self._healthy = ok

    # Plain calls (raise KvdError / KvdUnavailable).
    def hello(self) -> dict[str, Any]:
        return self._native.hello()

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        return self._native.exists(self.model, self.compat_key, list(keys))

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        return self._native.get(self.model, self.compat_key, list(keys))

    def set(self, keys: Sequence[bytes], values: Sequence[Any], retention: str = "short", ttl_s: float | None = None) -> list[bool]:
        """Stores ``values`` (any C-contiguous buffers: bytes, numpy arrays, ...) under ``keys``."""
        views = [memoryview(v).cast("B") for v in values]
        return self._native.set(self.model, self.compat_key, list(keys), views, retention, ttl_s)

    def lookup(self, keys: Sequence[bytes]) -> list[Slot | None]:
        return self._native.lookup(self.model, self.compat_key, list(keys))

    def reserve(self, size: int) -> Lease | None:
        return self._native.reserve(size)

    def commit(self, key: bytes, lease: Lease, length: int, retention: str = "short", ttl_s: float | None = None) -> bool:
        return self._native.commit(self.model, self.compat_key, key, lease, length, retention, ttl_s)

    def cancel(self, lease: Lease) -> None:
        self._native.cancel(lease)

    def stats(self) -> dict[str, int]:
        return self._native.stats()

    def arena_info(self) -> dict[str, Any]:
        return self._native.arena_info()

    def close(self) -> None:
        self._native.close()

    # Calls that turn a failure into a miss.
    def try_exists_prefix(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, the daemon holds (0 when it cannot answer)."""
        if not keys:
            return 0
        try:
            present = self.exists(keys)
        except KvdError as e:
            self._note(False, "exists", e)
            return 0
        self._note(True, "exists")
        n = 0
        for p in present:
            if not p:
                break
            n += 1
        return n

    def try_lookup(self, keys: Sequence[bytes]) -> list[Slot | None]:
        try:
            slots = self.lookup(keys)
        except KvdError as e:
            self._note(False, "lookup", e)
            return [None] * len(keys)
        self._note(True, "lookup")
        return slots

    def try_reserve(self, size: int) -> Lease | None:
        try:
            return self.reserve(size)
        except KvdError as e:
            self._note(False, "reserve", e)
            return None

    def try_commit(self, key: bytes, lease: Lease, length: int, retention: str, ttl_s: float | None) -> bool:
        try:
            ok = self.commit(key, lease, length, retention, ttl_s)
        except KvdError as e:
            self._note(False, "commit", e)
            return False
        self._note(True, "commit")
        return ok

    def try_set(self, keys: Sequence[bytes], values: Sequence[Any], retention: str, ttl_s: float | None) -> list[bool]:
        try:
            acks = self.set(keys, values, retention, ttl_s)
        except KvdError as e:
            self._note(False, "set", e)
            return [False] * len(keys)
        self._note(True, "set")
        return acks
