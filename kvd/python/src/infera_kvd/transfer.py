"""Copies between paged KV-cache tensors and packed blocks in the shared arena (torch).

A layer's cache is any tensor with one dimension indexing blocks (``block_dim``: 1 for vLLM's
``(2, num_blocks, block_size, heads, head_size)``, 0 for layouts that put blocks first); a
block of a layer is ``kv.select(block_dim, block_id)``, copied with ``Tensor.copy_`` straight
into (save) or out of (load) a ``torch.uint8`` tensor over the arena slot, every layer in one
``torch._foreach_copy_`` call: no bytes objects, no per-layer Python work.
Without an arena lease (a daemon without one, or a value larger than its slots) the block is
assembled in a host tensor and sent inline.

:func:`copier` returns the Rust copier for a cache it can serve, which does the same copies with
no Python work per layer: ``BlockCopier`` for host (CPU) caches (one ``memcpy`` per contiguous
piece), ``DeviceBlockCopier`` for CUDA caches with a pinned arena (one asynchronous DMA per
piece on the current stream, then one wait). Other GPU caches (ROCm, an unpinned arena, CUDA
without its driver) take the torch path through a packed staging buffer on their device: a save
gathers every layer's block into it (one ``_foreach_copy_``) and moves it to the arena in one
copy; a load moves it from the arena in one copy and scatters it on the device.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from infera_kvd._native import BlockCopier, DeviceBlockCopier
from infera_kvd.client import KvdClient
from infera_kvd.packed import HEADER_BYTES, PackedLayout

logger = logging.getLogger("infera_kvd.transfer")


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


class OnStream:
    """A ``DeviceBlockCopier`` that copies on its device's current CUDA stream, after the work
    queued there (the engine's kernels that wrote or will read the block)."""

    def __init__(self, native: DeviceBlockCopier, device: torch.device) -> None:
        self.native, self.device = native, device

    def pack(self, lease: Any, block: int) -> int:
        return self.native.pack(lease, block, torch.cuda.current_stream(self.device).cuda_stream)

    def unpack(self, slot: Any, block: int) -> bool:
        return self.native.unpack(slot, block, torch.cuda.current_stream(self.device).cuda_stream)


def copier(layers: Sequence[LayerCache], layout: PackedLayout, pinned: bool = False) -> BlockCopier | OnStream | None:
    """The Rust copier for contiguous caches of one shape on the host, or on one CUDA device
    when the arena is ``pinned`` (a copy per piece into pageable memory is a staged, waited
    copy each, slower than the torch path's one per block); else None (the torch path)."""
    first = layers[0].tensor
    same = all(
        layer.tensor.device == first.device
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
    geometry = (first.stride(dim) * el, pieces, first.shape[dim], layout.header())
    if first.device.type == "cpu":
        return BlockCopier([layer.tensor.view(torch.uint8).numpy() for layer in layers], *geometry)
    if not pinned or first.device.type != "cuda" or torch.version.hip is not None:
        return None
    try:
        native = DeviceBlockCopier([layer.tensor for layer in layers], *geometry)
    except RuntimeError as e:  # no usable driver: the torch path still works
        logger.warning("infera-kvd: the CUDA copier is unavailable (%s); using torch copies", e)
        return None
    return OnStream(native, first.device)


def describe(fast: BlockCopier | OnStream | None) -> str:
    """How a copier from :func:`copier` moves blocks, for logs."""
    if fast is None:
        return "torch"
    return "Rust CUDA" if isinstance(fast, OnStream) else "Rust host"


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
    fast: BlockCopier | OnStream | None = None,
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


def load_block(slot: Any, layers: Sequence[LayerCache], block_id: int, layout: PackedLayout, fast: BlockCopier | OnStream | None = None) -> bool:
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
