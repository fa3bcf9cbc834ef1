"""Save and load of one packed 64-layer block: the connector's arena path against memcpy and
against the ``tobytes()`` path (bytes objects over the socket, as the Python connector does),
on the same data, side by side in one run.

    python bench/packed_block.py --socket /path/to/kvd.sock [--layers 64] [--rounds 50]
    python bench/packed_block.py --socket ... --device cuda   # on a GPU machine

With ``--device cuda`` the KV cache lives on the GPU, so a save is device -> arena and a load
arena -> device, measured once with the arena pinned through the CUDA driver and once without,
beside the bus alone (the whole block in one copy between the device and an arena slot).

memcpy is one contiguous copy of the block's bytes (``numpy.copyto``) into faulted-in memory
that is not in cache, as an arena slot is (the hot-cache figure is printed too); a path's figure
is bytes / time and its share of memcpy's. The arena is filled once before timing, as a running
engine's is. The arena path pays two round trips
per save (reserve, commit) and one per load, plus one copy per layer between the paged cache
and the arena slot.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from infera_kvd.client import KvdClient
from infera_kvd.packed import PackedLayout
from infera_kvd.transfer import LayerCache, as_bytes, copier, load_block, save_block


def best(fn, rounds: int) -> float:
    fn()
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--socket", required=True)
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--block-tokens", type=int, default=16)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--device", default="cpu", help="where the KV cache lives: cpu or cuda")
    a = ap.parse_args()

    torch.manual_seed(0)
    num_blocks = 8
    shape = (2, num_blocks, a.block_tokens, a.heads, a.head_size)
    src = [LayerCache(f"l{i}", torch.randn(shape).to(torch.bfloat16).to(a.device), 1) for i in range(a.layers)]
    dst = [LayerCache(f"l{i}", torch.zeros(shape, dtype=torch.bfloat16, device=a.device), 1) for i in range(a.layers)]
    layout = PackedLayout(a.layers, a.block_tokens, src[0].block_bytes, "bench")
    total = layout.total_bytes
    rows = []
    for pin in [True, False] if a.device != "cpu" else [True]:
        rows += run(a, src, dst, layout, pin)
    print(f"{'path':<34}{'time':>12}{'GB/s':>10}{'of memcpy':>12}")
    t_memcpy = rows[0][1]
    for name, t in rows:
        print(f"{name:<34}{t * 1e6:>10.0f}us{total / t / 1e9:>10.2f}{t_memcpy / t:>11.0%}")


def run(a, src, dst, layout: PackedLayout, pin: bool) -> list[tuple[str, float]]:
    total = layout.total_bytes
    client = KvdClient(a.socket, "bench", f"bench-{pin}", pin=pin)
    client.hello()
    info = client.arena_info()
    tag = f" [{a.device}, {'pinned' if info['pinned'] else 'unpinned'}]"
    print(f"block: {a.layers} layers x {layout.slice_bytes} B = {total / 2**20:.2f} MiB; arena: {info}")

    # memcpy into memory already faulted in but not in cache (a pool larger than the caches,
    # like arena slots), and into one hot buffer.
    data = np.random.default_rng(0).integers(0, 255, total, dtype=np.uint8)
    pool = [np.ones(total, np.uint8) for _ in range(max(1, (256 << 20) // total))]
    turn = iter(range(1 << 62))
    t_memcpy = best(lambda: np.copyto(pool[next(turn) % len(pool)], data), a.rounds)
    t_hot = best(lambda: np.copyto(pool[0], data), a.rounds)

    # A running engine's arena has had every slot written: fill it once before timing.
    key = b"arena-block"
    save_block(client, b"warm", src, 3, layout, "short", None)  # decides the slot size
    client.close()
    client.hello()  # the new connection's hello reports the slot size
    info = client.arena_info()
    slots = (info["arena_bytes"] or 0) // max(1, info["slot_bytes"] or layout.total_bytes)
    for i in range(slots + 1):
        save_block(client, b"warm-%d" % i, src, 3, layout, "short", None)
    t_save = best(lambda: save_block(client, key, src, 3, layout, "short", None), a.rounds)

    def arena_load() -> None:
        (slot,) = client.lookup([key])
        assert slot is not None and slot.in_arena and load_block(slot, dst, 5, layout)

    t_load = best(arena_load, a.rounds)
    assert all(torch.equal(s.block(3), d.block(5)) for s, d in zip(src, dst))
    rows = [("memcpy", t_memcpy), ("memcpy (hot)", t_hot), ("arena save, torch" + tag, t_save), ("arena load, torch" + tag, t_load)]

    if a.device != "cpu":
        # The bus alone: the whole block in one copy between the device and an arena lease.
        lease = client.reserve(total)
        view, dev = as_bytes(lease)[:total], torch.empty(total, dtype=torch.uint8, device=a.device)
        rows.append(("one copy device -> arena" + tag, best(lambda: view.copy_(dev), a.rounds)))
        rows.append(("one copy arena -> device" + tag, best(lambda: dev.copy_(view), a.rounds)))
        client.cancel(lease)

    fast_src, fast_dst = copier(src, layout, info["pinned"]), copier(dst, layout, info["pinned"])
    if fast_src is not None and fast_dst is not None:  # the Rust copier (host or CUDA caches)
        rows.append(("arena save, Rust" + tag, best(lambda: save_block(client, key, src, 3, layout, "short", None, fast_src), a.rounds)))

        def fast_load() -> None:
            (slot,) = client.lookup([key])
            assert slot is not None and slot.in_arena and load_block(slot, dst, 4, layout, fast_dst)

        rows.append(("arena load, Rust" + tag, best(fast_load, a.rounds)))
        assert all(torch.equal(s.block(3), d.block(4)) for s, d in zip(src, dst))

    def tobytes_save() -> None:
        blob = layout.header() + b"".join(layer.block(3).cpu().contiguous().view(torch.uint8).numpy().tobytes() for layer in src)
        client.set([b"bytes-block"], [blob], "short")

    def tobytes_load() -> None:
        (blob,) = client.get([b"bytes-block"])
        for i, layer in enumerate(dst):
            off = layout.offset(i)
            part = torch.frombuffer(bytearray(blob[off : off + layout.slice_bytes]), dtype=torch.bfloat16)
            layer.block(6).copy_(part.view(layer.block(6).shape))

    t_bsave = best(tobytes_save, a.rounds)
    t_bload = best(tobytes_load, a.rounds)
    assert all(torch.equal(s.block(3), d.block(6)) for s, d in zip(src, dst))
    return rows + [("tobytes save" + tag, t_bsave), ("tobytes load" + tag, t_bload)]


if __name__ == "__main__":
    main()
