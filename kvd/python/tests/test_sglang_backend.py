"""The SGLang HiCache backend, created by SGLang's own storage-backend factory (its ``dynamic``
hook), against a real ``infera kvd``: pages set by one rank are read byte-exact into host-pool
pages by another process's backend; a restart gives misses. The zero-copy ``_v1`` interface
runs against SGLang's own host pool (``MHATokenToKVPoolHost`` on CPU), in both its layouts."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.storage import StorageBackendFactory

PAGE = (2, 4, 16, 2, 8)  # a flat host page: k/v, layers, tokens, heads, head size
HOST_PAGE = 16  # tokens per page of the real host pools


def backend(
    socket: str, tp_rank: int = 0, retention: str = "long", mla: bool = False, page_first: bool = True, **extra: Any
) -> HiCacheStorage:
    config = HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=2, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=False, is_page_first_layout=page_first, model_name="org/model",
        extra_config={
            "backend_name": "infera_kvd",
            "module_path": "infera_kvd.sglang_backend",
            "class_name": "InferaKvdHiCacheStorage",
            "socket": socket,
            "retention": retention,
            **extra,
        },
    )
    return StorageBackendFactory.create_backend("dynamic", config, None)


def host_pool(layout: str) -> Any:
    """A real SGLang host KV pool on CPU (the device pool it mirrors on CPU too)."""
    layers, heads, dim = 4, 2, 16
    device = MHATokenToKVPool(
        size=256, page_size=HOST_PAGE, dtype=torch.bfloat16, head_num=heads, head_dim=dim,
        layer_num=layers, device="cpu", enable_memory_saver=False,
    )
    return MHATokenToKVPoolHost(
        device.get_device_pool_infos()[0].buffer_info, 2, 0, HOST_PAGE, layout,
        pin_memory=False,
        device_capacity_tokens=device.size,
        start_layer=device.start_layer,
        end_layer=device.end_layer,
        write_back_staging=device.hicache_write_back_staging,
    )


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


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_v1_pages_move_in_place_between_two_host_pools(daemon, layout):
    def v1(pool: Any) -> HiCacheStorage:
        b = backend(daemon.socket, page_first=layout != "layer_first", interface_v1=1)
        b.register_mem_pool_host(pool)
        return b

    src, dst = host_pool(layout), host_pool(layout)
    gen = torch.Generator().manual_seed(5)
    src.kv_buffer.copy_(torch.randn(src.kv_buffer.shape, generator=gen).to(src.kv_buffer.dtype))
    keys = [f"v1-{layout}-{i}" for i in range(3)]
    at_src = src.alloc(3 * HOST_PAGE)
    assert v1(src).batch_set_v1(keys, at_src) == [True] * 3

    dst.alloc(2 * HOST_PAGE)  # the reader's pages sit elsewhere in its pool
    at_dst = dst.alloc(4 * HOST_PAGE)
    before = dst.get_data_page(at_dst[3 * HOST_PAGE], flat=True).clone()
    assert v1(dst).batch_get_v1(keys + ["missing"], at_dst) == [True, True, True, False]
    for i in range(3):
        got = dst.get_data_page(at_dst[i * HOST_PAGE], flat=True)
        assert torch.equal(got, src.get_data_page(at_src[i * HOST_PAGE], flat=True)), f"page {i}"
    assert torch.equal(dst.get_data_page(at_dst[3 * HOST_PAGE], flat=True), before), "a miss writes nothing"

    # The _v1 byte order is the pool's ranges, not a flat page: the interfaces never mix.
    assert backend(daemon.socket, page_first=layout != "layer_first").batch_exists(keys) == 0
    assert v1(dst).batch_exists(keys) == 3

    daemon.stop()
    assert v1(dst).batch_get_v1(keys, at_dst[: 3 * HOST_PAGE]) == [False] * 3
    assert v1(src).batch_set_v1(keys, at_src) == [False] * 3
    daemon.start()


def test_v1_without_a_host_pool_is_a_clear_error(daemon):
    b = backend(daemon.socket, interface_v1=1)
    with pytest.raises(RuntimeError, match="host pool"):
        b.batch_get_v1(["k"], torch.arange(HOST_PAGE))
