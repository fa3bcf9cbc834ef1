"""The pyo3 client against a real daemon, checked by an independent peer.

The peer is ``kvd/tests/peers/kvd_client.py`` (msgpack written from PROTOCOLS section 6, the
same peer the Rust client's tests use): what the pyo3 client writes — inline or in place through
an arena lease — the peer reads byte-exact with its class, and what the peer writes the pyo3
client reads in place.
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

from conftest import ROOT, Daemon
from infera_kvd import KvdClient, KvdError, KvdUnavailable
from infera_kvd._native import Client

spec = importlib.util.spec_from_file_location("kvd_peer", ROOT / "kvd" / "tests" / "peers" / "kvd_client.py")
peer_mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(peer_mod)

NS = {"model": "m", "compat_key": "c"}


def peer(daemon: Daemon) -> "peer_mod.Peer":
    p = peer_mod.Peer(daemon.socket)
    p.send("hello", client_id="peer", protocol_version=1, prefers_shared_arena=False)
    assert p.recv()["op"] == "hello_ack"
    return p


def peer_get(p, key: bytes) -> dict:
    p.send("get", key=key, **NS)
    return p.recv()


def client(daemon: Daemon, **kw) -> KvdClient:
    return KvdClient(daemon.socket, NS["model"], NS["compat_key"], **kw)


def test_hello_offers_the_arena_and_reports_the_pin_state(daemon):
    c = client(daemon)
    ack = c.hello()
    assert ack["protocol_version"] == 1
    size, slot, pid = ack["shared_arena"]
    assert size > 0 and pid == daemon.proc.pid
    info = c.arena_info()
    assert info["arena_bytes"] == size
    # Pinning is never required: without a CUDA driver or a HIP runtime the arena is plain
    # memory, and says why, naming both.
    assert info["pinned"] == (info["pin_backend"] in ("cuda", "hip"))
    if not info["pinned"]:
        assert "CUDA: " in info["pin_note"] and "HIP: " in info["pin_note"]


def test_batched_set_exists_get_with_retention_seen_by_the_peer(daemon):
    c = client(daemon)
    keys = [b"k1", b"k2", b"k3"]
    values = [b"one", bytearray(b"two" * 1000), np.arange(100, dtype=np.int32)]
    assert c.set(keys, values, retention="long", ttl_s=3600) == [True, True, True]
    assert c.exists(keys + [b"absent"]) == [True, True, True, False]
    assert c.get([b"k2", b"absent"]) == [b"two" * 1000, None]
    p = peer(daemon)
    hit = peer_get(p, b"k3")
    assert hit["value"] == np.arange(100, dtype=np.int32).tobytes()
    assert hit["retention"] == "long"


def test_a_lower_class_never_overwrites_a_higher_one(daemon):
    c = client(daemon)
    assert c.set([b"k"], [b"long value"], retention="long") == [True]
    assert c.set([b"k"], [b"short value"], retention="short") == [False]
    lease = c.reserve(16)
    np.frombuffer(lease, dtype=np.uint8)[:5] = np.frombuffer(b"none!", dtype=np.uint8)
    assert not c.commit(b"k", lease, 5, retention="none")
    assert peer_get(peer(daemon), b"k") == {"op": "get_response", "value": b"long value", "retention": "long"}


def test_a_lease_is_filled_in_place_and_the_peer_reads_it(daemon):
    c = client(daemon)
    data = np.random.default_rng(1).integers(0, 255, 200_000, dtype=np.uint8)
    lease = c.reserve(len(data))
    assert lease is not None and len(lease) >= len(data)
    np.frombuffer(lease, dtype=np.uint8)[: len(data)] = data  # straight into the arena
    assert c.commit(b"big", lease, len(data), retention="short")
    assert not c.commit(b"again", lease, len(data)), "a lease commits once"
    hit = peer_get(peer(daemon), b"big")
    assert hit["value"] == data.tobytes()
    assert hit["retention"] == "short"


def test_the_peer_writes_and_the_client_reads_in_place(daemon):
    p = peer(daemon)
    p.send("set", key=b"from-peer", value=b"x" * 5000 + b"end", retention="long", **NS)
    assert p.recv()["accepted"] is True
    (slot, missing) = client(daemon).lookup([b"from-peer", b"nothing"])
    assert missing is None
    assert slot.in_arena and slot.retention == "long"
    view = memoryview(slot)
    assert view.readonly
    assert bytes(view[-3:]) == b"end" and len(view) == 5003
    assert slot.valid()
    with pytest.raises(ValueError, match="read-only"):
        np.frombuffer(slot, dtype=np.uint8)[0:1] = 0  # the daemon's bytes cannot be changed


def test_without_an_arena_the_same_calls_work_inline(make_daemon):
    d = make_daemon(arena="0").start()
    c = client(d)
    assert c.hello()["shared_arena"] is None
    assert c.reserve(100) is None
    assert c.set([b"a"], [b"inline"]) == [True]
    (slot,) = c.lookup([b"a"])
    assert not slot.in_arena and bytes(memoryview(slot)) == b"inline"


def test_bad_input_is_a_clear_error(daemon):
    c = client(daemon)
    with pytest.raises(ValueError, match="unknown retention"):
        c.set([b"a"], [b"v"], retention="forever")
    with pytest.raises(ValueError, match="2 keys but 1 values"):
        c.set([b"a", b"b"], [b"v"])
    with pytest.raises(ValueError, match="timeout_s"):
        Client(daemon.socket, timeout_s=0)
    with pytest.raises(TypeError):
        c.exists(["not-bytes"])


def test_a_restarted_daemon_costs_one_failed_call_then_reconnects(daemon):
    c = client(daemon)
    assert c.set([b"a"], [b"v"], retention="long") == [True]
    lease = c.reserve(10)
    daemon.stop()
    with pytest.raises(KvdUnavailable):
        c.exists([b"a"])
    assert c.try_exists_prefix([b"a"]) == 0  # the miss the engines see
    daemon.start()
    assert c.exists([b"a"]) == [True]  # `long` came back from L3
    assert not c.commit(b"late", lease, 10), "a lease dies with its connection"
    assert c.arena_info()["reconnects"] >= 1
    assert issubclass(KvdUnavailable, KvdError)


def test_the_deadline_bounds_a_call_to_a_daemon_that_does_not_answer(tmp_path):
    import socket

    path = str(tmp_path / "mute.sock")
    mute = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    mute.bind(path)
    mute.listen(1)  # accepts connections, never answers
    c = Client(path, timeout_s=0.3, shared_arena=False, pin=False)
    with pytest.raises(KvdUnavailable, match="no reply within"):
        c.hello()
    mute.close()
    os.unlink(path)
