"""kvd's Mooncake Store sidecar: one MooncakeDistributedStore client, driven by `infera kvd`.

kvd starts it as `python3 -c <this file> CONFIG_JSON` and speaks to it over stdin/stdout; the
store's Python binding is the only public client of a Mooncake Store, and running it in its own
process keeps its threads, its allocator and its GIL out of the daemon. Values never cross the
pipe: they sit in kvd's shared memory (a memfd this process maps through /proc), registered
with the store, so a put is `batch_upsert_from` out of it and a get `batch_get_into` it.

Frames (little-endian): a request is `u32 length`, then `u8 op`, `u32 count`, and per item
`u16 name length`, the name, `u64 offset`, `u64 length`; a reply is `u32 length`, then `u8 0`
and per item `i64 result`, `u64 offset`, or `u8 1` and an error message. Ops: 1 health, 2 put
(the items' bytes at offset/length), 6 sizes (each value's size from its replica descriptors,
one master round trip), 3 get (each value into offset/length, where kvd placed it by its size;
result: the length), 4 exists (1 or 0), 5 remove. Result -1: missing; below it, the store's
error codes. kvd may send a command before it has read the previous reply (its gets are
pipelined); replies come in order. The first reply (count 0) says whether setup worked.
"""

import ctypes
import json
import mmap
import os
import struct
import sys

HEALTH, PUT, GET, EXISTS, REMOVE, SIZES = 1, 2, 3, 4, 5, 6
MISSING = -1
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
    """A value's size from its replica descriptors; 0 when the store holds none."""
    for replica in replicas or ():
        if replica.is_memory_replica():
            return replica.get_memory_descriptor().buffer_descriptor.size
        if replica.is_disk_replica():
            return replica.get_disk_descriptor().size
    return 0


def get(store, items, base):
    """Reads each value straight into the staging area where kvd placed it (`batch_get_into`)."""
    got = store.batch_get_into(
        [name for name, _, _ in items],
        [base + offset for _, offset, _ in items],
        [length for _, _, length in items],
    )
    results = []
    for (_, offset, length), rc in zip(items, got):
        if rc == length:
            results.append((length, offset))
        elif rc == NOT_FOUND or rc >= 0:
            # Gone, or replaced by a value of another size since kvd read its size: a miss,
            # never part of a value.
            results.append((MISSING, 0))
        else:
            results.append((int(rc), 0))
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
            elif op == SIZES:
                replicas = store.batch_get_replica_desc(names)
                results = [(value_size(replicas.get(name)) or MISSING, 0) for name in names]
            elif op == GET:
                if any(offset + length > limit for _, offset, length in items):
                    reply(out, error="a get placed outside the staging area")
                    continue
                results = get(store, items, base)
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
