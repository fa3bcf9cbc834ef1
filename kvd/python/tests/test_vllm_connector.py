"""The vLLM connector against the real vLLM package and a real ``infera kvd``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

from infera_kvd import vllm_connector
from infera_kvd.keys import block_keys
from vllm_engine import BLOCK, Engine

PROMPT = list(range(1000, 1100))  # 100 tokens: 6 full blocks, 6 loadable (one token left to compute)


def test_blocks_saved_by_one_engine_are_loaded_byte_exact_by_a_second(daemon):
    a = Engine(daemon.socket)
    external, _ = a.prefill(a.request("a1", PROMPT))
    assert external == 0

    b = Engine(daemon.socket, first_block=20)  # another replica: other block ids
    external, blocks = b.prefill(b.request("b1", PROMPT))
    assert external == 6 * BLOCK
    assert b.load_errors == set()
    b.assert_blocks_hold(PROMPT, blocks, 6)

    # A prompt sharing three blocks, then diverging, loads exactly those three.
    fork = PROMPT[: 3 * BLOCK] + [7] * 40
    external, blocks = b.prefill(b.request("b2", fork))
    assert external == 3 * BLOCK
    b.assert_blocks_hold(fork, blocks, 3)
    a.shutdown()
    b.shutdown()


def test_retention_none_never_reaches_disk_and_long_survives_a_daemon_restart(make_daemon):
    d = make_daemon().start()
    a = Engine(d.socket)
    long_prompt, none_prompt = PROMPT, list(range(5000, 5100))
    a.prefill(a.request("long", long_prompt, retention="long"))
    a.prefill(a.request("none", none_prompt, retention="none"))
    a.shutdown()
    d.stop()
    d.start()  # same L3 directory; L2 starts empty

    b = Engine(d.socket)
    external, blocks = b.prefill(b.request("long", long_prompt))
    assert external == 6 * BLOCK, "long blocks come back from L3"
    b.assert_blocks_hold(long_prompt, blocks, 6)
    external, _ = b.prefill(b.request("none", none_prompt))
    assert external == 0, "none blocks were never written to disk"
    b.shutdown()


def test_a_kvd_restart_mid_run_gives_misses_never_a_crash_or_wrong_bytes(daemon):
    a = Engine(daemon.socket)
    a.prefill(a.request("a1", PROMPT, retention="short"))

    # The scheduler sees the blocks, then the daemon restarts before the worker loads them.
    b = Engine(daemon.socket, first_block=30)
    req = b.request("b1", PROMPT)
    assert b.scheduler.get_num_new_matched_tokens(req, 0) == (6 * BLOCK, False)
    b.scheduler.request_finished(req, [])
    daemon.stop()
    external, blocks = b.prefill(b.request("b2", PROMPT))  # daemon down: a miss, saves skipped
    assert external == 0
    b.assert_blocks_hold(PROMPT, blocks, 6)

    daemon.start()  # short blocks lived in L2 only: gone
    c = Engine(daemon.socket, first_block=10)
    external, _ = c.prefill(c.request("c1", PROMPT))
    assert external == 0
    d = Engine(daemon.socket, first_block=40)
    external, blocks = d.prefill(d.request("d1", PROMPT))
    assert external == 6 * BLOCK, "c's saves after the restart are read back"
    d.assert_blocks_hold(PROMPT, blocks, 6)
    for e in (a, b, c, d):
        e.shutdown()


def test_a_block_lost_between_the_scheduler_and_the_worker_is_a_load_error(daemon):
    a = Engine(daemon.socket)
    a.prefill(a.request("a1", PROMPT, retention="short"))
    b = Engine(daemon.socket, first_block=30)
    req = b.request("b1", PROMPT)
    external, _ = b.scheduler.get_num_new_matched_tokens(req, 0)
    assert external == 6 * BLOCK
    # Drive the rest of the step by hand with the daemon restarted (blocks gone) in between.
    daemon.stop()
    daemon.start()
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    blocks = KVCacheBlocks(([KVCacheBlock(i) for i in range(30, 37)],))
    b.scheduler.update_state_after_alloc(req, blocks, external)
    req.num_computed_tokens = external
    out = SchedulerOutput([NewRequestData.from_request(req, blocks.get_block_ids())], CachedRequestData.make_empty(), {"b1": 4}, 4, {}, {}, set(), [])
    b.worker.bind_connector_metadata(b.scheduler.build_connector_meta(out))
    b.worker.start_load_kv(None)
    assert b.worker.get_block_ids_with_load_errors() == set(range(30, 36))
    assert all(b.kv[n][:, 30:36].abs().sum() == 0 for n in b.layer_names), "no bytes were claimed"
    a.shutdown()
    b.shutdown()


def test_retention_and_ttl_come_from_kv_transfer_params():
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    def req(params):
        return Request("r", [1], SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params}), None)

    assert vllm_connector.retention_of(req({}), "long") == ("long", None)
    assert vllm_connector.retention_of(req({"infera_retention": "none", "infera_ttl_seconds": 30}), "long") == ("none", 30.0)
    assert vllm_connector.retention_of(req({"infera_retention": "ephemeral"}), "long") == ("long", None)
    assert vllm_connector.retention_of(req({"infera_retention": "bogus", "infera_ttl_seconds": -1}), "short") == ("short", None)


def test_an_interface_drift_is_a_clear_error_naming_the_vllm_version():
    class Drifted(KVConnectorBase_V1):
        def start_load_kv(self, forward_context, layer_names):  # parameters changed upstream
            pass

    with pytest.raises(vllm_connector.VllmInterfaceError, match=r"vLLM 9\.9\.9 declares start_load_kv"):
        vllm_connector._build(base=Drifted, version="9.9.9")
    with pytest.raises(vllm_connector.VllmInterfaceError, match=r"KVConnectorBase_V1\.get_num_new_matched_tokens, which vLLM 9\.9\.9 does not have"):
        vllm_connector.check_interface(object, "9.9.9")
    # The installed vLLM passes, and the class is what vLLM's factory loads by name.
    vllm_connector.check_interface(KVConnectorBase_V1, vllm.__version__)
    assert issubclass(vllm_connector.InferaKvdConnector, KVConnectorBase_V1)


def test_keys_do_not_depend_on_the_process():
    code = "from infera_kvd.keys import block_keys; print(b''.join(block_keys(list(range(1000, 1100)), 16)).hex())"
    runs = {
        subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": seed}, capture_output=True, text=True, check=True).stdout.strip()
        for seed in ("1", "2")
    }
    assert runs == {b"".join(block_keys(PROMPT, BLOCK)).hex()}


def test_an_adapters_or_a_tenants_blocks_are_never_loaded_for_another(daemon):
    """vLLM keys an adapter's, a salted request's and an image's blocks apart from plain text's
    (``generate_block_hash_extra_keys``); so does the connector, or it would load one adapter's
    KV into another's request (wrong output) and one tenant's into another's (a leak)."""
    from vllm.lora.request import LoRARequest

    a = Engine(daemon.socket)
    a.prefill(a.request("a1", PROMPT))
    b = Engine(daemon.socket, num_blocks=128, first_block=20)

    def scoped(req_id, lora=None, salt=None):
        req = b.request(req_id, PROMPT)
        if lora:
            req.lora_request = LoRARequest(lora, 1, f"/adapters/{lora}")
        req.cache_salt = salt
        return req

    assert b.prefill(scoped("b1", lora="sql"))[0] == 0, "no base blocks for an adapter"
    assert b.prefill(scoped("b2", salt="tenant-a"))[0] == 0, "no unsalted blocks for a tenant"
    external, blocks = b.prefill(scoped("b3", lora="sql"))
    assert external == 6 * BLOCK, "the adapter's own blocks are found"
    b.assert_blocks_hold(PROMPT, blocks, 6)
    assert b.prefill(scoped("b4", lora="chat"))[0] == 0, "nor another adapter's"
    assert b.prefill(scoped("b5", salt="tenant-b"))[0] == 0, "nor another tenant's"
    assert b.prefill(scoped("b6", salt="tenant-a"))[0] == 6 * BLOCK
    assert b.prefill(b.request("b7", PROMPT))[0] == 6 * BLOCK, "plain text still shares"
    assert vllm_connector.identity_scope(b.request("b8", PROMPT)) == b""
    # The router derives the same scope from the request it routes (the Rust golden string
    # of infera_core::kv_events::kvd::identity_scope), so it can name what this connector saved.
    assert vllm_connector.identity_scope(scoped("b9", lora="sql", salt="s")) == (
        b'{"lora":"sql","salt":"s"}'
    )
    a.shutdown()
    b.shutdown()
