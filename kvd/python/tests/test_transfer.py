"""The two copy paths of a packed block — the Rust ``BlockCopier`` for host caches and the torch
path for any device — write the same bytes, read each other's values, and refuse bad input."""

from __future__ import annotations

import pytest
import torch

from infera_kvd import KvdClient
from infera_kvd.packed import PackedLayout
from infera_kvd.transfer import LayerCache, copier, load_block, save_block

SHAPE = (2, 6, 16, 2, 8)  # vLLM's (k/v, blocks, tokens, heads, head size)


def caches(seed: int | None) -> list[LayerCache]:
    gen = torch.Generator().manual_seed(seed or 0)
    make = (lambda: torch.randn(SHAPE, generator=gen).to(torch.bfloat16)) if seed is not None else (lambda: torch.zeros(SHAPE, dtype=torch.bfloat16))
    return [LayerCache(f"l{i}", make(), 1) for i in range(3)]


def test_rust_and_torch_paths_write_and_read_the_same_packed_bytes(daemon):
    client = KvdClient(daemon.socket, "m", "layout")
    src = caches(seed=1)
    layout = PackedLayout(3, 16, src[0].block_bytes, "layout")
    fast = copier(src, layout)
    assert fast is not None and fast.packed_bytes == layout.total_bytes

    assert save_block(client, b"rust", src, 2, layout, "short", None, fast)
    assert save_block(client, b"torch", src, 2, layout, "short", None)
    assert client.get([b"rust"]) == client.get([b"torch"])

    rust_dst, torch_dst = caches(None), caches(None)
    (slot,) = client.lookup([b"torch"])
    assert load_block(slot, rust_dst, 4, layout, copier(rust_dst, layout))
    (slot,) = client.lookup([b"rust"])
    assert load_block(slot, torch_dst, 4, layout)
    for s, r, t in zip(src, rust_dst, torch_dst):
        assert torch.equal(r.block(4), s.block(2)) and torch.equal(t.block(4), s.block(2))
        assert r.tensor[:, :4].abs().sum() == 0, "no other block was touched"


def test_bad_blocks_leases_and_layouts_are_refused(daemon):
    client = KvdClient(daemon.socket, "m", "layout")
    src = caches(seed=2)
    layout = PackedLayout(3, 16, src[0].block_bytes, "layout")
    fast = copier(src, layout)
    lease = client.reserve(layout.total_bytes)
    with pytest.raises(ValueError, match="outside the cache's 6 blocks"):
        fast.pack(lease, 6)
    fast.pack(lease, 0)
    assert client.commit(b"k", lease, layout.total_bytes)
    with pytest.raises(ValueError, match="already committed"):
        fast.pack(lease, 0)
    other = PackedLayout(3, 16, src[0].block_bytes, "another-layout")
    (slot,) = client.lookup([b"k"])
    assert not load_block(slot, caches(None), 0, other, copier(caches(None), other)), "a foreign layout is a miss"
    assert not load_block(slot, caches(None), 0, other)
    # Non-contiguous caches take the torch path.
    assert copier([LayerCache("t", src[0].tensor.transpose(3, 4), 1)], layout) is None


def test_the_cuda_copier_refuses_host_tensors_by_name():
    # The CUDA copier itself runs only on a GPU machine (bench/packed_block.py --device cuda);
    # here: host caches are the host copier's, and the CUDA one says why it cannot take them.
    from infera_kvd._native import DeviceBlockCopier

    src = caches(seed=3)
    layout = PackedLayout(3, 16, src[0].block_bytes, "layout")
    assert type(copier(src, layout)).__name__ == "BlockCopier"
    with pytest.raises(ValueError, match="layer 0: the cache must be a contiguous CUDA tensor"):
        DeviceBlockCopier([s.tensor for s in src], src[0].tensor.stride(1) * 2, [(0, 64)], 6, layout.header())
