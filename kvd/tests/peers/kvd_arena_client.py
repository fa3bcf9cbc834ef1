#!/usr/bin/env python3
"""An independent kvd client for the shared-arena path and for broken frames, written from
PROTOCOLS section 6: msgpack over a Unix socket, the arena memfd received with SCM_RIGHTS and
mapped with mmap, slots read with the seqlock header (u32 LE version, odd while written; u32 LE
length; 8 reserved) that sits 16 bytes before each payload offset.

Usage: kvd_arena_client.py SOCKET_PATH. Exits non-zero on the first mismatch and prints
"python peer: ok" on success. Driven by kvd/tests/arena.rs against a daemon whose arena slot
size is decided by the first write (10240 bytes here). Leaves key b"py-a1" (model "py-arena",
retention long, bytes(range(256)) * 40) for the Rust side.
"""

import array
import mmap
import os
import socket
import struct
import sys

import msgpack

HEADER = 16


def expect(cond, what):
    if not cond:
        print(f"python peer: FAILED: {what}", file=sys.stderr)
        sys.exit(1)


class Peer:
    def __init__(self, path):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)

    def send(self, op, **fields):
        body = msgpack.packb({"op": op, **fields}, use_bin_type=True)
        self.sock.sendall(struct.pack(">I", len(body)) + body)

    def _exact(self, n):
        # Exact-size reads: nothing past a reply is consumed, so the F byte that carries the
        # arena descriptor stays in the socket for recvmsg.
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise EOFError("kvd closed the connection")
            buf += chunk
        return bytes(buf)

    def recv(self):
        (length,) = struct.unpack(">I", self._exact(4))
        return msgpack.unpackb(self._exact(length), raw=False)

    def call(self, op, **fields):
        self.send(op, **fields)
        return self.recv()

    def recv_fd(self):
        msg, ancillary, _flags, _addr = self.sock.recvmsg(1, socket.CMSG_SPACE(4))
        expect(msg == b"F", f"the descriptor comes with the F marker, got {msg!r}")
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds = array.array("i")
                fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
                return fds[0]
        expect(False, "no SCM_RIGHTS descriptor arrived")


def read_slot(mm, offset, length, version):
    """Seqlock read: the header must show `version` (even) and `length` before and after."""
    v1, l1 = struct.unpack_from("<II", mm, offset - HEADER)
    if v1 % 2 or v1 != version or l1 != length:
        return None
    data = bytes(mm[offset : offset + length])
    (v2,) = struct.unpack_from("<I", mm, offset - HEADER)
    return data if v2 == v1 else None


def broken_frames(path):
    def raw():
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        return s

    def reply_then_eof(s):
        head = s.recv(4, socket.MSG_WAITALL)
        (length,) = struct.unpack(">I", head)
        body = s.recv(length, socket.MSG_WAITALL)
        reply = msgpack.unpackb(body, raw=False)
        rest = s.recv(1)
        expect(rest == b"", f"the daemon closes after a broken frame, got {rest!r}")
        return reply

    for body in (b"\x93\x01\x02\x03", b"\xc1", b"", b"\x81\xa2op"):
        s = raw()
        s.sendall(struct.pack(">I", len(body)) + body)
        r = reply_then_eof(s)
        expect(r["op"] == "error" and r["code"] == "bad_frame", f"garbage {body!r}: {r}")
    s = raw()
    s.sendall(struct.pack(">I", 1 << 31))
    r = reply_then_eof(s)
    expect(r["code"] == "frame_too_large", f"oversized: {r}")
    s = raw()
    s.sendall(struct.pack(">I", 100) + b"\x80" * 10)
    s.shutdown(socket.SHUT_WR)
    r = reply_then_eof(s)
    expect(r["code"] == "truncated_frame", f"truncated: {r}")


def main(path):
    p = Peer(path)
    ack = p.call("hello", client_id="py-arena", protocol_version=1, prefers_shared_arena=True)
    expect(set(ack) == {"op", "server_id", "protocol_version", "shared_arena"}, f"hello: {ack}")
    arena = ack["shared_arena"]
    expect(isinstance(arena, list) and len(arena) == 3, f"shared_arena: {arena}")
    size, _slot_size, pid = arena
    expect(pid > 0, f"server pid: {arena}")
    fd = p.recv_fd()
    expect(os.fstat(fd).st_size >= size, "the descriptor holds the whole arena")
    mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    ns = {"model": "py-arena", "compat_key": ""}

    # Zero-copy write: reserve, write into our own mapping, commit.
    value = bytes(range(256)) * 40
    lease = p.call("set_reserve", size=len(value))
    expect(set(lease) == {"op", "lease_token", "slot_id", "payload_offset", "payload_max_size", "reason"},
           f"set_reserve fields: {lease}")
    expect(lease["lease_token"] > 0 and lease["reason"] == "", f"set_reserve: {lease}")
    expect(lease["payload_max_size"] >= len(value), f"room: {lease}")
    off = lease["payload_offset"]
    mm[off : off + len(value)] = value
    r = p.call("set_commit", lease_token=lease["lease_token"], key=b"py-a1", length=len(value),
               retention="long", ttl_seconds=0, **ns)
    expect(r == {"op": "set_commit_response", "accepted": True, "reason": ""}, f"set_commit: {r}")

    # Zero-copy read.
    r = p.call("get", key=b"py-a1", **ns)
    expect(r["op"] == "get_shared_response", f"get: {r}")
    expect(set(r) == {"op", "slot_offset", "length", "version", "retention", "slot_size"}, f"fields: {r}")
    expect(r["retention"] == "long" and r["version"] % 2 == 0, f"get_shared: {r}")
    expect(read_slot(mm, r["slot_offset"], r["length"], r["version"]) == value, "arena bytes")

    # An inline set lands in the arena too.
    r = p.call("set", key=b"py-a2", value=b"x" * 5000, retention="short", metadata={},
               ttl_seconds=None, **ns)
    expect(r == {"op": "set_ack", "accepted": True, "reason": None}, f"set: {r}")
    r = p.call("get", key=b"py-a2", **ns)
    expect(r["op"] == "get_shared_response", f"get a2: {r}")
    expect(read_slot(mm, r["slot_offset"], r["length"], r["version"]) == b"x" * 5000, "a2 bytes")

    # A miss is an inline reply, as for inline clients.
    r = p.call("get", key=b"nope", **ns)
    expect(r == {"op": "get_response", "value": None, "retention": None}, f"miss: {r}")

    r = p.call("batch_get", keys=[b"py-a1", b"nope", b"py-a2"], **ns)
    expect(r["op"] == "batch_get_shared_response", f"batch_get: {r}")
    expect(r["offsets"][1] == -1 and r["lengths"][1] == 0 and r["retentions"][1] is None, f"miss: {r}")
    expect(r["retentions"][0] == "long" and r["retentions"][2] == "short", f"classes: {r}")
    for i, want in ((0, value), (2, b"x" * 5000)):
        got = read_slot(mm, r["offsets"][i], r["lengths"][i], r["versions"][i])
        expect(got == want, f"batch slot {i}")

    # Lease errors.
    r = p.call("set_commit", lease_token=987654, key=b"z", length=1, retention="short", ttl_seconds=0, **ns)
    expect(r == {"op": "set_commit_response", "accepted": False, "reason": "unknown_lease"}, f"unknown: {r}")
    lease = p.call("set_reserve", size=10)
    r = p.call("set_commit", lease_token=lease["lease_token"], key=b"z",
               length=lease["payload_max_size"] + 1, retention="short", ttl_seconds=0, **ns)
    expect(r["accepted"] is False and r["reason"] == "oversize_commit", f"oversize commit: {r}")
    lease = p.call("set_reserve", size=10)
    r = p.call("set_cancel", lease_token=lease["lease_token"])
    expect(r == {"op": "set_cancel_response"}, f"cancel: {r}")
    r = p.call("set_commit", lease_token=lease["lease_token"], key=b"z", length=1, retention="short",
               ttl_seconds=0, **ns)
    expect(r["reason"] == "unknown_lease", f"commit after cancel: {r}")
    r = p.call("set_reserve", size=size * 2)
    expect(r["lease_token"] == 0 and r["reason"] == "oversize" and r["slot_id"] == -1, f"too big: {r}")

    # Another connection, inline: same bytes, and it cannot commit our lease.
    q = Peer(path)
    ack = q.call("hello", client_id="py-inline", protocol_version=1, prefers_shared_arena=False)
    expect(ack["shared_arena"] is None, f"inline hello: {ack}")
    r = q.call("get", key=b"py-a1", **ns)
    expect(r == {"op": "get_response", "value": value, "retention": "long"}, "inline get of an arena value")
    r = q.call("set_reserve", size=10)
    expect(r["lease_token"] == 0 and r["reason"] == "no_arena", f"reserve without the arena: {r}")
    lease = p.call("set_reserve", size=10)
    r = q.call("set_commit", lease_token=lease["lease_token"], key=b"z", length=1, retention="short",
               ttl_seconds=0, **ns)
    expect(r["accepted"] is False and r["reason"] == "wrong_owner", f"foreign commit: {r}")
    p.call("set_cancel", lease_token=lease["lease_token"])

    # The remaining ops on an arena connection.
    tmp = {"model": "py-arena-tmp", "compat_key": ""}
    r = p.call("batch_set", keys=[b"t1", b"t2"], values=[b"1" * 300, b"2" * 300],
               retentions=["short", "long"], metadatas=[{}, {}], ttls_seconds=None, **tmp)
    expect(r == {"op": "batch_set_ack", "accepted": [True, True], "reasons": [None, None]}, f"batch_set: {r}")
    r = p.call("batch_get", keys=[b"t1", b"t2"], **tmp)
    expect(r["op"] == "batch_get_shared_response", f"batch_get after batch_set: {r}")
    got = [read_slot(mm, r["offsets"][i], r["lengths"][i], r["versions"][i]) for i in (0, 1)]
    expect(got == [b"1" * 300, b"2" * 300], "batch_set bytes in the arena")
    p.send("prefetch_hint", keys=[b"t1"], deadline_ms=50, **tmp)  # one-way
    r = p.call("exists", keys=[b"t1", b"t3"], **tmp)
    expect(r == {"op": "exists_response", "present": [True, False]}, f"exists: {r}")
    r = p.call("stats")
    expect(r["op"] == "stats_response" and r["entries"] >= 4, f"stats: {r}")
    expect("l3_entries" not in r, "extended counters only when asked")
    r = p.call("clear", **tmp)
    expect(r == {"op": "clear_ack", "cleared_entries": 2}, f"clear: {r}")
    r = p.call("get", key=b"t1", **tmp)
    expect(r == {"op": "get_response", "value": None, "retention": None}, f"after clear: {r}")

    r = p.call("frobnicate")
    expect(r["op"] == "error" and r["code"] == "unknown_op", f"unknown op: {r}")
    r = p.call("exists", keys=[b"py-a1"], **ns)
    expect(r["present"] == [True], "the connection survives a bad op")
    broken_frames(path)
    print("python peer: ok")


if __name__ == "__main__":
    main(sys.argv[1])
