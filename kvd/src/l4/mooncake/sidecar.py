"""kvd's Mooncake Store sidecar: one MooncakeDistributedStore client, driven by `infera kvd`.

kvd starts it as `python3 -c <this file> CONFIG_JSON` and speaks to it over stdin/stdout; the
store's Python binding is the only public client of a Mooncake Store, and running it in its own
process keeps its threads, its allocator and its GIL out of the daemon. Values never cross the
pipe: they sit in kvd's shared memory (a memfd this process maps through /proc), registered
with the store, so a put is `batch_upsert_from` out of it and a get `batch_get_into` it, at
the sizes the replica descriptors give.

Frames (little-endian): a request is `u32 length`, then `u8 op`, `u32 count`, and per item
`u16 name length`, the name, `u64 offset`, `u64 length`; a reply is `u32 length`, then `u8 0`
and per item `i64 result`, `u64 offset`, or `u8 1` and an error message. Ops: 1 health, 2 put
(the items' bytes at offset/length), 3 get (results packed from offset 0; result -1: missing,
-2: no room left in this reply), 4 exists (1 or 0), 5 remove. Results below -2 are the store's
error codes. The first reply (count 0) says whether setup worked.
"""

import ctypes
import json
import mmap
import os
import struct
import sys

HEALTH, PUT, GET, EXISTS, REMOVE = 1, 2, 3, 4, 5
MISSING, NO_ROOM = -1, -2
# Mooncake's "object not found" (OBJECT_NOT_FOUND): a remove of a missing key did its job.
NOT_FOUND = -704


def read_exact(stream, n):
    buf = bytearray()
    while len(buf) < n:
        chunk = stream.read(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


def reply(out, results=None, error=None):
    if error is not None:
        body = b"\x01" + error.encode("utf-8", "replace")[:4096]
    else:
        body = b"\x00" + b"".join(struct.pack("<qQ", r, o) for r, o in results)
    out.write(struct.pack("<I", len(body)) + body)
    out.flush()


def parse(body):
    op, count = struct.unpack_from("<BI", body, 0)
    at, items = 5, []
    for _ in range(count):
        (n,) = struct.unpack_from("<H", body, at)
        name = body[at + 2 : at + 2 + n].decode("ascii")
        offset, length = struct.unpack_from("<QQ", body, at + 2 + n)
        items.append((name, offset, length))
        at += 2 + n + 16
    return op, items


def value_size(replicas):
    """A value's size from its replica descriptors (one master round trip for the batch); 0
    when the store holds none."""
    for replica in replicas or ():
        if replica.is_memory_replica():
            return replica.get_memory_descriptor().buffer_descriptor.size
        if replica.is_disk_replica():
            return replica.get_disk_descriptor().size
    return 0


def get(store, names, base, limit):
    """Reads the values straight into the staging area (`batch_get_into`), back to back from
    offset 0; those that do not fit are NO_ROOM, for kvd to ask again."""
    replicas = store.batch_get_replica_desc(names)
    results, placed, at = [], [], 0
    for name in names:
        size = value_size(replicas.get(name))
        if size <= 0:
            results.append((MISSING, 0))
        elif at + size > limit:
            results.append((NO_ROOM, 0))
        else:
            results.append((size, at))
            placed.append((len(results) - 1, name, at, size))
            at += size
    if placed:
        got = store.batch_get_into(
            [name for _, name, _, _ in placed],
            [base + offset for _, _, offset, _ in placed],
            [size for _, _, _, size in placed],
        )
        for (i, _, offset, size), rc in zip(placed, got):
            # A value replaced or removed since its size was read is a miss, never part of one.
            if rc == NOT_FOUND or (0 <= rc and rc != size):
                results[i] = (MISSING, 0)
            elif rc < 0:
                results[i] = (int(rc), 0)
    return results


def main():
    config = json.loads(sys.argv[1])
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    # Mooncake logs to stderr; stdout is the protocol's alone.
    sys.stdout = sys.stderr
    try:
        from mooncake.store import MooncakeDistributedStore

        shm_fd = os.open(config["shm_path"], os.O_RDWR)
        shm = mmap.mmap(shm_fd, config["shm_bytes"])
        base = ctypes.addressof(ctypes.c_char.from_buffer(shm))
        store = MooncakeDistributedStore()
        rc = store.setup(
            config["local_hostname"],
            config["metadata_server"],
            config["global_segment_size"],
            config["local_buffer_size"],
            config["protocol"],
            config["device_name"],
            config["master_address"],
        )
        if rc != 0:
            raise RuntimeError(f"MooncakeDistributedStore.setup returned {rc}")
        rc = store.register_buffer(base, config["shm_bytes"])
        if rc != 0:
            raise RuntimeError(f"register_buffer of kvd's shared memory returned {rc}")
    except Exception as e:  # noqa: BLE001 - reported to kvd, which logs it
        reply(out, error=f"{type(e).__name__}: {e}")
        return
    reply(out, results=[])
    limit = config["shm_bytes"]
    while True:
        try:
            (length,) = struct.unpack("<I", read_exact(inp, 4))
            op, items = parse(read_exact(inp, length))
        except EOFError:
            break
        names = [name for name, _, _ in items]
        try:
            if op == HEALTH:
                results = [(int(store.health_check()), 0)]
            elif op == PUT:
                rcs = store.batch_upsert_from(names, [base + o for _, o, _ in items], [n for _, _, n in items])
                results = [(int(rc), 0) for rc in rcs]
            elif op == GET:
                results = get(store, names, base, limit)
            elif op == EXISTS:
                results = [(int(rc), 0) for rc in store.batch_is_exist(names)]
            elif op == REMOVE:
                rcs = store.batch_remove(names, True)
                results = [(0 if rc == NOT_FOUND else int(rc), 0) for rc in rcs]
            else:
                reply(out, error=f"unknown op {op}")
                continue
        except Exception as e:  # noqa: BLE001 - one failed call, not a failed sidecar
            reply(out, error=f"{type(e).__name__}: {e}")
            continue
        reply(out, results=results)
    store.close()


main()
