"""Copies between paged KV-cache tensors and packed blocks in the shared arena (torch).

A layer's cache is any tensor with one dimension indexing blocks (``block_dim``: 1 for vLLM's
``(2, num_blocks, block_size, heads, head_size)``, 0 for layouts that put blocks first); a
block of a layer is ``kv.select(block_dim, block_id)``, copied with ``Tensor.copy_`` straight
into (save) or out of (load) a ``torch.uint8`` tensor over the arena slot, every layer in one
``torch._foreach_copy_`` call: no bytes objects, no per-layer Python work.
Without an arena lease (a daemon without one, or a value larger than its slots) the block is
assembled in a host tensor and sent inline. For host (CPU) caches, :func:`copier` returns the
Rust ``BlockCopier``, which does the same copies as one ``memcpy`` per contiguous piece with no
Python work per layer. GPU caches go through a packed staging buffer on their device: a save
gathers every layer's block into it (one fused device-to-device ``_foreach_copy_``), then moves
the block to the arena in one copy; a load moves it from the arena in one copy, then scatters
it on the device. One transfer per block instead of one per layer: DMA at the bus's speed when
the arena is pinned, one staged driver copy when it is not.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from infera_kvd._native import BlockCopier
from infera_kvd.client import KvdClient
from infera_kvd.packed import HEADER_BYTES, PackedLayout


@dataclass(frozen=True)
class LayerCache:
    """One layer's paged cache and the dimension that indexes its blocks."""

    name: str
    tensor: torch.Tensor
    block_dim: int

    def block(self, block_id: int) -> torch.Tensor:
        return self.tensor.select(self.block_dim, block_id)

    @property
    def block_bytes(self) -> int:
        t = self.tensor
        return t.numel() // t.shape[self.block_dim] * t.element_size()


def find_block_dim(tensor: torch.Tensor, num_blocks: int) -> int:
    """The dimension of size ``num_blocks`` (the first one of the two leading candidates)."""
    for dim in (0, 1):
        if tensor.dim() > dim and tensor.shape[dim] == num_blocks:
            return dim
    raise ValueError(f"no dimension of {tuple(tensor.shape)} indexes {num_blocks} blocks")


def copier(layers: Sequence[LayerCache], layout: PackedLayout) -> BlockCopier | None:
    """The Rust copier for contiguous host caches of one shape, or None (GPU, other layouts)."""
    first = layers[0].tensor
    same = all(
        layer.tensor.device.type == "cpu"
        and layer.tensor.is_contiguous()
        and layer.tensor.shape == first.shape
        and layer.tensor.dtype == first.dtype
        and layer.block_dim == layers[0].block_dim
        for layer in layers
    )
    if not same:
        return None
    el, dim = first.element_size(), layers[0].block_dim
    inner = first.stride(dim) * el
    pieces = [(0, inner)] if dim == 0 else [(i * first.stride(0) * el, inner) for i in range(first.shape[0])]
    return BlockCopier(
        [layer.tensor.view(torch.uint8).numpy() for layer in layers],
        first.stride(dim) * el,
        pieces,
        first.shape[dim],
        layout.header(),
    )


def as_bytes(buffer: Any) -> torch.Tensor:
    """A ``torch.uint8`` tensor over a buffer (read-only buffers too, without the warning)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buffer, dtype=torch.uint8)


def _body(buf: torch.Tensor, layers: Sequence[LayerCache], block_id: int, layout: PackedLayout) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The layers' block views and the matching slices of a packed buffer."""
    blocks = [layer.block(block_id) for layer in layers]
    first = blocks[0]
    if all(b.shape == first.shape and b.dtype == first.dtype for b in blocks):
        body = buf[HEADER_BYTES : layout.total_bytes].view(first.dtype).view(len(blocks), *first.shape)
        return blocks, list(body.unbind(0))
    slices = [
        buf[layout.offset(i) : layout.offset(i) + layout.slice_bytes].view(b.dtype).view(b.shape)
        for i, b in enumerate(blocks)
    ]
    return blocks, slices


def _device(layers: Sequence[LayerCache]) -> torch.device | None:
    """The one accelerator device every layer's cache is on, else None (host caches)."""
    device = layers[0].tensor.device
    if device.type == "cpu" or any(layer.tensor.device != device for layer in layers):
        return None
    return device


def _pack_into(dst: torch.Tensor, layers: Sequence[LayerCache], block_id: int, layout: PackedLayout) -> None:
    dst[:HEADER_BYTES].copy_(torch.frombuffer(bytearray(layout.header()), dtype=torch.uint8))
    device = _device(layers)
    if device is None:
        blocks, slices = _body(dst, layers, block_id, layout)
        torch._foreach_copy_(slices, blocks)  # one call for every layer
        return
    stage = torch.empty(layout.total_bytes, dtype=torch.uint8, device=device)
    blocks, slices = _body(stage, layers, block_id, layout)
    torch._foreach_copy_(slices, blocks)
    # Blocking: the block is in the arena before the caller commits it.
    dst[HEADER_BYTES : layout.total_bytes].copy_(stage[HEADER_BYTES:])


def _unpack_from(src: torch.Tensor, layers: Sequence[LayerCache], block_id: int, layout: PackedLayout) -> None:
    device = _device(layers)
    if device is None:
        blocks, slices = _body(src, layers, block_id, layout)
        torch._foreach_copy_(blocks, slices)
        return
    stage = torch.empty(layout.total_bytes, dtype=torch.uint8, device=device)
    # Blocking: the arena has been read before the caller checks that the slot was not rewritten.
    stage[HEADER_BYTES:].copy_(src[HEADER_BYTES : layout.total_bytes])
    blocks, slices = _body(stage, layers, block_id, layout)
    torch._foreach_copy_(blocks, slices)


def save_block(
    client: KvdClient,
    key: bytes,
    layers: Sequence[LayerCache],
    block_id: int,
    layout: PackedLayout,
    retention: str,
    ttl_s: float | None,
    fast: BlockCopier | None = None,
) -> bool:
    """Writes block ``block_id`` of every layer as one packed value; True when stored."""
    lease = client.try_reserve(layout.total_bytes)
    if lease is not None:
        if fast is not None:
            fast.pack(lease, block_id)
        else:
            _pack_into(as_bytes(lease), layers, block_id, layout)
        return client.try_commit(key, lease, layout.total_bytes, retention, ttl_s)
    staged = torch.empty(layout.total_bytes, dtype=torch.uint8)
    _pack_into(staged, layers, block_id, layout)
    return client.try_set([key], [staged.numpy()], retention, ttl_s)[0]


def load_block(slot: Any, layers: Sequence[LayerCache], block_id: int, layout: PackedLayout, fast: BlockCopier | None = None) -> bool:
    """Copies a packed value (a ``Slot``) into block ``block_id`` of every layer.

    False — and the block's contents must not be used — when the value has another layout or
    the slot was rewritten while it was being copied.
    """
    if fast is not None:
        return bool(fast.unpack(slot, block_id))
    if not layout.matches(memoryview(slot)):
        return False
    _unpack_from(as_bytes(slot), layers, block_id, layout)
    return bool(slot.valid())
