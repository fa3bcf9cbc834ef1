#!/usr/bin/env python3
"""An independent kvd client: msgpack over a Unix socket, written from PROTOCOLS section 6.

Usage: kvd_client.py SOCKET_PATH. Exits non-zero with a message on the first mismatch and
prints "python peer: ok" on success. Driven by kvd/tests/protocol.rs; needs `pip install msgpack`.
It leaves key b"py-key-1" (model "py-model", retention long) in the store for the Rust side.
"""

import socket
import struct
import sys

import msgpack


class Peer:
    def __init__(self, path):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)

    def send(self, op, **fields):
        body = msgpack.packb({"op": op, **fields}, use_bin_type=True)
        self.sock.sendall(struct.pack(">I", len(body)) + body)

    def _exact(self, n):
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise EOFError("kvd closed the connection")
            buf += chunk
        return bytes(buf)

    def recv(self):
        (length,) = struct.unpack(">I", self._exact(4))
        reply = msgpack.unpackb(self._exact(length), raw=False)
        if not isinstance(reply, dict):
            raise AssertionError(f"reply is not a map: {reply!r}")
        return reply

    def call(self, op, **fields):
        self.send(op, **fields)
        return self.recv()


def expect(cond, what):
    if not cond:
        print(f"python peer: FAILED: {what}", file=sys.stderr)
        sys.exit(1)


def main(path):
    p = Peer(path)
    ack = p.call("hello", client_id="py-peer", protocol_version=1, prefers_shared_arena=False)
    expect(ack["op"] == "hello_ack", f"hello: {ack}")
    expect(set(ack) == {"op", "server_id", "protocol_version", "shared_arena"}, f"hello fields: {ack}")
    expect(ack["protocol_version"] == 1 and ack["shared_arena"] is None, f"hello values: {ack}")

    ns = {"model": "py-model", "compat_key": ""}
    r = p.call("get", key=b"py-key-1", **ns)
    expect(r == {"op": "get_response", "value": None, "retention": None}, f"miss: {r}")

    r = p.call("set", key=b"py-key-1", value=b"value-1", retention="long", metadata={"layers": 2},
               ttl_seconds=None, **ns)
    expect(r == {"op": "set_ack", "accepted": True, "reason": None}, f"set: {r}")
    r = p.call("get", key=b"py-key-1", **ns)
    expect(r == {"op": "get_response", "value": b"value-1", "retention": "long"}, f"hit: {r}")
    expect(isinstance(r["value"], bytes), "values come back as bin")

    r = p.call("set", key=b"py-key-1", value=b"x", retention="short", metadata={},
               ttl_seconds=None, **ns)
    expect(r["accepted"] is False and r["reason"] == "retention_downgrade_not_allowed", f"downgrade: {r}")

    r = p.call("batch_set", keys=[b"b1", b"b2"], values=[b"one", b"two"],
               retentions=["short", "ephemeral"], metadatas=[{}, {}], ttls_seconds=[None, 30.5], **ns)
    expect(r == {"op": "batch_set_ack", "accepted": [True, True], "reasons": [None, None]}, f"batch_set: {r}")
    r = p.call("batch_set", keys=[b"b1"], values=[], retentions=[], metadatas=[], **ns)
    expect(r["op"] == "error" and r["code"] == "batch_set_arity_mismatch", f"arity: {r}")

    r = p.call("batch_get", keys=[b"b1", b"nope", b"b2"], **ns)
    expect(r == {"op": "batch_get_response", "values": [b"one", None, b"two"],
                 "retentions": ["short", None, "ephemeral"]}, f"batch_get: {r}")

    r = p.call("exists", keys=[b"b1", b"nope", b"py-key-1"], **ns)
    expect(r == {"op": "exists_response", "present": [True, False, True]}, f"exists: {r}")

    # Pipelined with ids: replies in order, ids echoed.
    for i in range(5):
        p.send("exists", keys=[b"b1"], id=i, **ns)
    for i in range(5):
        r = p.recv()
        expect(r.get("id") == i and r["present"] == [True], f"pipelined {i}: {r}")

    p.send("prefetch_hint", keys=[b"b1"], deadline_ms=100, **ns)  # one-way: no reply to read

    r = p.call("stats")
    expect(r["op"] == "stats_response", f"stats: {r}")
    expect(set(r) == {"op", "entries", "host_bytes", "spillover_bytes", "long_bytes", "gets_total",
                      "sets_total", "hits_total", "misses_total", "evictions_total"},
           f"stats fields are upstream's: {sorted(r)}")
    expect(r["entries"] == 3 and r["host_bytes"] == len(b"value-1") + 6, f"stats values: {r}")

    r = p.call("set_reserve", size=4096)
    expect(r["op"] == "set_reserve_response" and r["lease_token"] == 0 and r["reason"] == "no_arena",
           f"set_reserve: {r}")

    r = p.call("clear", model="py-model", compat_key="other")
    expect(r == {"op": "clear_ack", "cleared_entries": 0}, f"clear other: {r}")

    r = p.call("frobnicate")
    expect(r["op"] == "error" and r["code"] == "unknown_op", f"unknown op: {r}")
    r = p.call("exists", keys=[b"b1"], **ns)
    expect(r["present"] == [True], "the connection survives a bad op")
    print("python peer: ok")


if __name__ == "__main__":
    main(sys.argv[1])
