"""The SGLang HiCache backend, created by SGLang's own storage-backend factory (its ``dynamic``
hook), against a real ``infera kvd``: pages set by one rank are read byte-exact into host-pool
pages by another process's backend; a restart gives misses."""

from __future__ import annotations

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
from sglang.srt.mem_cache.storage import StorageBackendFactory

PAGE = (2, 4, 16, 2, 8)  # a flat host page: k/v, layers, tokens, heads, head size


def backend(socket: str, tp_rank: int = 0, retention: str = "long", mla: bool = False) -> HiCacheStorage:
    config = HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=2, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=False, is_page_first_layout=True, model_name="org/model",
        extra_config={
            "backend_name": "infera_kvd",
            "module_path": "infera_kvd.sglang_backend",
            "class_name": "InferaKvdHiCacheStorage",
            "socket": socket,
            "retention": retention,
        },
    )
    return StorageBackendFactory.create_backend("dynamic", config, None)


def pages(n: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(PAGE, generator=gen).to(torch.bfloat16) for _ in range(n)]


def test_pages_set_by_one_backend_are_read_byte_exact_by_another(daemon):
    writer = backend(daemon.socket)
    keys = [f"page-{i:04x}" for i in range(5)]
    data = pages(5, seed=1)
    assert writer.batch_set(keys, data)
    assert writer.batch_exists(keys + ["missing"]) == 5
    assert writer.batch_exists(["missing"] + keys) == 0, "the prefix stops at the first miss"

    reader = backend(daemon.socket)  # another replica, same model and rank layout
    targets = [torch.zeros(PAGE, dtype=torch.bfloat16) for _ in keys]
    got = reader.batch_get(keys, targets)
    assert all(g is t for g, t in zip(got, targets))
    assert all(torch.equal(t, d) for t, d in zip(targets, data))
    assert reader.get("missing", torch.zeros(PAGE, dtype=torch.bfloat16)) is None

    # Another TP rank holds other shards: not visible to rank 0's namespace.
    assert backend(daemon.socket, tp_rank=1).batch_exists(keys) == 0


def test_mla_pages_are_written_once_and_shared_by_every_rank(daemon):
    (page,) = pages(1, seed=2)
    assert backend(daemon.socket, tp_rank=1, mla=True).set("mla-page", page), "a non-writer rank succeeds without writing"
    assert backend(daemon.socket, tp_rank=1, mla=True).exists("mla-page") is False
    assert backend(daemon.socket, tp_rank=0, mla=True).set("mla-page", page)
    target = torch.zeros(PAGE, dtype=torch.bfloat16)
    assert backend(daemon.socket, tp_rank=1, mla=True).get("mla-page", target) is target
    assert torch.equal(target, page)


def test_a_daemon_restart_gives_misses_not_errors(daemon):
    b = backend(daemon.socket, retention="short")
    keys = ["a", "b"]
    assert b.batch_set(keys, pages(2, seed=3))
    daemon.stop()
    assert b.batch_exists(keys) == 0
    assert b.batch_get(keys, [torch.zeros(PAGE, dtype=torch.bfloat16)] * 2) == [None, None]
    assert b.batch_set(keys, pages(2, seed=3)) is False
    daemon.start()
    assert b.batch_exists(keys) == 0, "short pages lived in RAM only"
    assert b.batch_set(keys, pages(2, seed=4)) is True
    assert b.batch_exists(keys) == 2
