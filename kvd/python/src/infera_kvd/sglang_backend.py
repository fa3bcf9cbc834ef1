"""``InferaKvdHiCacheStorage``: an SGLang HiCache storage backend over kvd.

Use SGLang's dynamic storage hook::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "infera_kvd",
        "module_path": "infera_kvd.sglang_backend", "class_name": "InferaKvdHiCacheStorage",
        "socket": "/run/infera/kvd.sock", "retention": "short"}'

Pages travel as SGLang hands them. With ``"interface_v1": 1`` in the extra config, SGLang's
zero-copy interface (``batch_get_v1``/``batch_set_v1``, as its Mooncake and 3FS backends use):
the backend reads and writes the host pool's pages in place, by the addresses the pool gives
(``get_page_buffer_meta``), one ``memcpy`` per range into or out of an arena slot, in Rust with
the GIL released. Without it, flat host-pool pages through ``batch_get``/``batch_set``: a set
copies the page tensor straight into a reserved arena slot, a get copies an arena slot straight
into the target page. No bytes objects either way.

Keys are SGLang's page hashes; the namespace is the model with a compat key of the rank layout
(``tp``/``pp``/``cp``; MLA pages, identical on every TP rank, share rank 0's) and, for the
``_v1`` interface, of the byte order it stores (the pool's ranges in order, which differs from a
flat page), so the two interfaces never read each other's values. SGLang is imported when the
class is first looked up.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

logger = logging.getLogger("infera_kvd.sglang")

CLASS_NAME = "InferaKvdHiCacheStorage"


def interface_v1(config: Any) -> bool:
    """Whether SGLang drives this backend through its zero-copy ``_v1`` interface."""
    return bool(int((config.extra_config or {}).get("interface_v1", 0)))


def compat_key(config: Any) -> str:
    tp_rank = 0 if config.is_mla_model else config.tp_rank
    key = f"sglang-page1-tp{tp_rank}of{config.tp_size}-pp{config.pp_rank}of{config.pp_size}"
    if config.attn_cp_size > 1:
        key += f"-cp{config.attn_cp_rank}of{config.attn_cp_size}"
    key += "-mla" if config.is_mla_model else ""
    if interface_v1(config):
        key += "-v1-" + ("pagefirst" if config.is_page_first_layout else "layerfirst")
    return key


def _build() -> type:
    import torch

    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

    from infera_kvd._native import gather, scatter
    from infera_kvd.client import RETENTIONS, KvdClient, socket_path
    from infera_kvd.transfer import as_bytes

    class InferaKvdHiCacheStorage(HiCacheStorage):
        def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
            extra = dict(storage_config.extra_config or {})
            model = extra.get("model") or storage_config.model_name
            if not model:
                raise ValueError("infera-kvd: no model name (set the extra config's model)")
            self.retention = extra.get("retention", "short")
            if self.retention not in RETENTIONS:
                raise ValueError(f"infera-kvd: retention {self.retention!r} is not one of {RETENTIONS}")
            ttl = extra.get("ttl_s")
            self.ttl_s = float(ttl) if ttl else None
            self.is_writer = storage_config.is_storage_writer
            self.client = KvdClient(
                socket_path(extra.get("socket")),
                model,
                compat_key(storage_config),
                timeout_s=float(extra.get("timeout_s", 5.0)),
                client_id=f"sglang-{compat_key(storage_config)}",
            )
            logger.info("infera-kvd HiCache backend: model %s, namespace %s", model, self.client.compat_key)

        def _keys(self, keys: list[str]) -> list[bytes]:
            return [k.encode() for k in keys]

        def exists(self, key: str) -> bool:
            return self.client.try_exists_prefix(self._keys([key])) == 1

        def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
            return self.client.try_exists_prefix(self._keys(keys))

        def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
            return self.batch_get([key], [target_location])[0]

        def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list[Any]:
            slots = self.client.try_lookup(self._keys(keys))
            out: list[Any] = []
            for slot, target in zip(slots, target_locations or [None] * len(keys)):
                if slot is None or target is None:
                    out.append(None)
                    continue
                dst = target.view(-1).view(torch.uint8)
                if dst.numel() != len(slot):
                    logger.warning("infera-kvd: a page of %d bytes for a target of %d; ignored", len(slot), dst.numel())
                    out.append(None)
                    continue
                dst.copy_(as_bytes(slot))
                out.append(target if slot.valid() else None)
            return out

        def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
            return self.batch_set([key], [value])

        def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None) -> bool:
            if not self.is_writer:
                return True  # another rank writes this replicated page
            ok = True
            for key, value in zip(self._keys(keys), values or []):
                src = value.contiguous().view(-1).view(torch.uint8)
                lease = self.client.try_reserve(src.numel())
                if lease is not None:
                    as_bytes(lease)[: src.numel()].copy_(src)
                    ok &= self.client.try_commit(key, lease, src.numel(), self.retention, self.ttl_s)
                else:
                    ok &= self.client.try_set([key], [src.numpy()], self.retention, self.ttl_s)[0]
            return ok

        def _page_ranges(self, keys: list[str], host_indices: Any) -> list[list[tuple[int, int]]]:
            """Each key's page in the registered host pool, as (address, length) ranges."""
            pool = getattr(self, "mem_pool_host", None)
            if pool is None:
                raise RuntimeError("infera-kvd: the _v1 interface needs a host pool (register_mem_pool_host)")
            ptrs, sizes = pool.get_page_buffer_meta(host_indices)
            if not keys or len(ptrs) != len(sizes) or len(ptrs) % len(keys):
                raise ValueError(f"infera-kvd: {len(ptrs)} host ranges for {len(keys)} pages")
            per = len(ptrs) // len(keys)
            ranges = list(zip((int(p) for p in ptrs), (int(n) for n in sizes)))
            return [ranges[i * per : (i + 1) * per] for i in range(len(keys))]

        def batch_get_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
            if not keys:
                return []
            pages = self._page_ranges(keys, host_indices)
            slots = self.client.try_lookup(self._keys(keys))
            return [slot is not None and scatter(slot, ranges) for slot, ranges in zip(slots, pages)]

        def batch_set_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
            if not keys:
                return []
            if not self.is_writer:
                return [True] * len(keys)  # another rank writes this replicated page
            out: list[bool] = []
            for key, ranges in zip(self._keys(keys), self._page_ranges(keys, host_indices)):
                size = sum(n for _, n in ranges)
                lease = self.client.try_reserve(size)
                if lease is not None:
                    length = gather(lease, ranges)
                    out.append(self.client.try_commit(key, lease, length, self.retention, self.ttl_s))
                    continue
                # No arena, or a page larger than its slots: the page goes inline.
                staged = torch.empty(size, dtype=torch.uint8)
                at = staged.data_ptr()
                for addr, n in ranges:
                    ctypes.memmove(at, addr, n)
                    at += n
                out.append(self.client.try_set([key], [staged.numpy()], self.retention, self.ttl_s)[0])
            return out

        def clear(self) -> None:
            return None  # entries leave by retention class and TTL; kvd owns eviction

        def get_stats(self) -> Any:
            return None

        def close(self) -> None:
            self.client.close()

    InferaKvdHiCacheStorage.__module__ = __name__
    return InferaKvdHiCacheStorage


_built: type | None = None


def __getattr__(name: str) -> Any:
    global _built
    if name == CLASS_NAME:
        if _built is None:
            _built = _build()
        return _built
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
