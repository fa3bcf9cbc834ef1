"""One simulated vLLM engine for the tests: vLLM's own config, request, block and scheduler
output types, our connector created by vLLM's connector factory in both roles, and CPU torch
tensors as the paged KV cache. ``prefill`` drives one scheduler step and one worker step in
vLLM's call order; the "model" writes each computed block's KV as a function of its key and
layer, so any engine can tell which bytes a block must hold.
"""

from __future__ import annotations

import hashlib

import torch
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request

from infera_kvd.keys import block_keys

BLOCK = 16
HEADS = 2
HEAD_SIZE = 8


def expected_block(key: bytes, layer: int) -> torch.Tensor:
    """What the model computes for a block: deterministic in its key and layer."""
    seed = int.from_bytes(hashlib.sha256(key + bytes([layer])).digest()[:8], "little")
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2, BLOCK, HEADS, HEAD_SIZE, generator=gen).to(torch.bfloat16)


class Engine:
    def __init__(self, socket: str, layers: int = 4, num_blocks: int = 64, first_block: int = 0) -> None:
        transfer = KVTransferConfig(
            kv_connector="InferaKvdConnector",
            kv_connector_module_path="infera_kvd.vllm_connector",
            kv_role="kv_both",
            kv_connector_extra_config={"socket": socket, "model": "test-model", "timeout_s": 2.0},
        )
        config = VllmConfig(kv_transfer_config=transfer, cache_config=CacheConfig(block_size=BLOCK), device_config=DeviceConfig(device="cpu"))
        self.layer_names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.bfloat16)
        kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(self.layer_names, spec)])
        self.scheduler = KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, kv_cache_config)
        self.worker = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kv_cache_config)
        self.kv = {n: torch.zeros(2, num_blocks, BLOCK, HEADS, HEAD_SIZE, dtype=torch.bfloat16) for n in self.layer_names}
        self.worker.register_kv_caches(self.kv)
        self.next_block = first_block
        self.load_errors: set[int] = set()

    def request(self, req_id: str, prompt: list[int], retention: str | None = None) -> Request:
        params = {"infera_retention": retention} if retention else {}
        return Request(req_id, prompt, SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params}), None)

    def prefill(self, req: Request) -> tuple[int, list[int]]:
        """One scheduler step and one worker step; returns (tokens from kvd, block ids)."""
        prompt = req.prompt_token_ids
        external, is_async = self.scheduler.get_num_new_matched_tokens(req, 0)
        assert is_async is False
        n = -(-len(prompt) // BLOCK)
        block_ids = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        blocks = KVCacheBlocks(([KVCacheBlock(i) for i in block_ids],))
        self.scheduler.update_state_after_alloc(req, blocks, external)
        req.num_computed_tokens = external
        new = NewRequestData.from_request(req, blocks.get_block_ids())
        out = SchedulerOutput(
            scheduled_new_reqs=[new],
            scheduled_cached_reqs=CachedRequestData.make_empty(),
            num_scheduled_tokens={req.request_id: len(prompt) - external},
            total_num_scheduled_tokens=len(prompt) - external,
            scheduled_spec_decode_tokens={},
            scheduled_encoder_inputs={},
            finished_req_ids=set(),
            free_encoder_mm_hashes=[],
        )
        meta = self.scheduler.build_connector_meta(out)

        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(None)
        errors = self.worker.get_block_ids_with_load_errors()
        self.load_errors |= errors
        keys = block_keys(prompt, BLOCK)
        first_computed = external // BLOCK
        for layer, name in enumerate(self.layer_names):
            self.worker.wait_for_layer_load(name)
            for i, block in enumerate(block_ids[: len(keys)]):
                if i >= first_computed or block in errors:  # the model computes these
                    self.kv[name][:, block] = expected_block(keys[i], layer)
            self.worker.save_kv_layer(name, self.kv[name], None)
        self.worker.wait_for_save()
        self.worker.clear_connector_metadata()
        self.scheduler.request_finished(req, block_ids)
        return external, block_ids

    def assert_blocks_hold(self, prompt: list[int], block_ids: list[int], count: int) -> None:
        keys = block_keys(prompt, BLOCK)
        for layer, name in enumerate(self.layer_names):
            for i in range(count):
                assert torch.equal(self.kv[name][:, block_ids[i]], expected_block(keys[i], layer)), (name, i)

    def shutdown(self) -> None:
        self.worker.shutdown()
        self.scheduler.shutdown()
