"""The connectors' block keys are the router's: `POST /v1/cache/prewarm` and the mock engine
derive them in Rust (`infera_core::ports::kv_store::block_keys`), whose unit test pins the same
vectors, so a prewarm promotes exactly the blocks a connector loads."""

from infera_kvd.keys import block_keys


def test_the_keys_are_the_vectors_the_router_derives():
    assert [k.hex() for k in block_keys(list(range(10)), 4)] == [
        "baed642339816affb3fe8719792d0e4c",
        "bedd165f7f7d59c7d8ade8eb75481d59",
    ]
    assert [k.hex() for k in block_keys([4294967295, 0, 7, 100000], 2)] == [
        "72a4fa3544e43a836ffcb268ce06ccdb",
        "e2ab000db0f1145e2c40d763dd19d1bf",
    ]


def test_a_later_window_keeps_the_chain():
    tokens = list(range(64))
    assert block_keys(tokens, 8, start=3, stop=6) == block_keys(tokens, 8)[3:6]


def test_a_scope_starts_another_chain_the_router_derives_too():
    """``infera_core::ports::kv_store::scoped_block_keys`` pins the same vector."""
    assert [k.hex() for k in block_keys(list(range(10)), 4, scope=b"sql")] == [
        "2c4ce5a7bd8a90b5dc6a5b3b08b861c2",
        "7706e4a19b08570068daaa9895821ba7",
    ]
    assert block_keys(list(range(10)), 4, scope=b"") == block_keys(list(range(10)), 4)
