"""The packed multi-layer block: one kvd value per block holding every layer.

Layout (little-endian)::

    header (64 bytes): magic b"IKVP", version u32 = 1, layers u32, tokens u32,
                       slice_bytes u64, layout u64, 32 bytes zero
    then `layers` slices of `slice_bytes` each, in the layer order of the namespace

``layout`` is a 64-bit digest of the compat key, so bytes written under another layout are
rejected on load even if someone stored them under this namespace.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

MAGIC = b"IKVP"
VERSION = 1
HEADER = struct.Struct("<4sIIIQQ32x")
HEADER_BYTES = HEADER.size


@dataclass(frozen=True)
class PackedLayout:
    """The shape of one packed block."""

    layers: int
    tokens: int
    slice_bytes: int
    compat_key: str

    @property
    def layout_id(self) -> int:
        return int.from_bytes(hashlib.sha256(self.compat_key.encode()).digest()[:8], "little")

    @property
    def total_bytes(self) -> int:
        return HEADER_BYTES + self.layers * self.slice_bytes

    def header(self) -> bytes:
        return HEADER.pack(MAGIC, VERSION, self.layers, self.tokens, self.slice_bytes, self.layout_id)

    def offset(self, layer: int) -> int:
        return HEADER_BYTES + layer * self.slice_bytes

    def matches(self, value: memoryview | bytes) -> bool:
        """Whether ``value`` is a block of exactly this layout."""
        if len(value) != self.total_bytes:
            return False
        return bytes(value[:HEADER_BYTES]) == self.header()
