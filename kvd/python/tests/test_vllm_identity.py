"""The router's golden vector of vLLM's KV identity is vLLM's own: the per-block ``extra_keys``
of ``fixtures/kv-events/vllm_identity_events.json`` (adapter name, cache salt, multimodal item
and offset), which the router's ingest and request hashing are tested against in Rust
(``core/tests/kv_identity.rs``), are what the pinned vLLM publishes for requests of those
identities: ``generate_block_hash_extra_keys`` (the tagged keys its block hashes use, the
adapter's path among them) turned into the untagged per-block list of ``BlockStored`` by
``to_event_extra_keys`` (``vllm/v1/core/kv_cache_utils.py``)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, to_event_extra_keys

FIXTURE = Path(__file__).resolve().parents[3] / "fixtures" / "kv-events" / "vllm_identity_events.json"


def request_of(case: dict) -> SimpleNamespace:
    """The fields of ``vllm.v1.request.Request`` that the extra-key helpers read."""
    features = [
        SimpleNamespace(
            identifier=m["id"],
            mm_hash=m["id"],
            mm_position=SimpleNamespace(offset=m["offset"], length=m["length"]),
        )
        for m in case["mm"]
    ]
    lora = (
        SimpleNamespace(lora_name=case["lora"], lora_path=f"/adapters/{case['lora']}")
        if case["lora"]
        else None
    )
    return SimpleNamespace(
        mm_features=features,
        lora_request=lora,
        cache_salt=case["salt"],
        prompt_embeds=None,
    )


def normalize(keys):
    """msgspec writes tuples as arrays: compare as lists, all the way down."""
    if isinstance(keys, (tuple, list)):
        return [normalize(k) for k in keys]
    return keys


def test_the_fixtures_extra_keys_are_vllms():
    doc = json.loads(FIXTURE.read_text())
    block_size = doc["block_size"]
    events = doc["batch"][1]
    assert len(events) == len(doc["events"])
    for case, event in zip(doc["events"], events):
        request = request_of(case)
        start, stop = case["tokens"]
        blocks = (stop - start) // block_size
        mm_index = 0
        tagged = []
        for i in range(blocks):
            keys, mm_index = generate_block_hash_extra_keys(
                request, i * block_size, (i + 1) * block_size, mm_index
            )
            tagged.append(keys)
        assert normalize(to_event_extra_keys(tagged)) == event["extra_keys"], case
        assert event["lora_name"] == case["lora"]


def test_the_sglang_fixture_is_what_sglang_publishes():
    """``fixtures/kv-events/sglang_identity_events``: the pinned SGLang's own encoding of two
    pages of an adapter's salted sequence (``core/tests/kv_identity.rs`` ingests it)."""
    import msgspec
    from sglang.srt.disaggregation.kv_events import BlockStored, EventBatch

    tokens = list(range(500, 532))
    page = dict(block_size=16, lora_id=None, medium="GPU", cache_salt="tenant-a",
                session_id="conversation-7", lora_name="sql")
    events = [
        BlockStored(block_hashes=[11], parent_block_hash=None, token_ids=tokens[:16], **page),
        BlockStored(block_hashes=[12], parent_block_hash=11, token_ids=tokens[16:], **page),
    ]
    wire = msgspec.msgpack.encode(EventBatch(ts=1.5, events=events, attn_dp_rank=0))
    fixture = FIXTURE.parent / "sglang_identity_events.msgpack.hex"
    assert wire.hex() == fixture.read_text().strip()
