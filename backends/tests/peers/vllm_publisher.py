#!/usr/bin/env python3
"""An independent vLLM-shaped KV-event publisher (pyzmq + msgpack) for backends/tests/zmq_events.rs.

Protocol with the Rust test, over stdin/stdout lines:
  -> "READY <port>"        PUB bound on tcp://127.0.0.1:<port>
  (publishes probe batches [-1.0, [], 0] until it reads "GO")
  <- "GO"
  (publishes COUNT real batches, multipart [b"kv-events", seq (8 bytes big-endian), payload])
  -> "DONE"
  (exits when stdin closes)
A missing module prints "ERROR ... pip install pyzmq msgpack" and exits 3.

Batch i (see expected_batch in zmq_events.rs, which must match):
  BlockStored (tagged map, vLLM >= 0.26): hashes [2^63+2i, 2^63+2i+1], parent 2^63+2i-1 (none for
    i = 0), tokens 32i..32i+32, block size 16, GPU, full attention
  i odd:        BlockRemoved (map) [2^63+2i]
  i % 3 == 2:   BlockStored (legacy tagged array) [i], no parent, tokens 0..16, CPU
  i == 0:       BlockTransferred (unknown kind, skipped)
  last:         AllBlocksCleared (map)
"""

import select
import sys

try:
    import msgpack
    import zmq
except ImportError as exc:  # the Rust test turns this into a failure naming the fix
    print(f"ERROR {exc}: pip install pyzmq msgpack", flush=True)
    sys.exit(3)

BASE = 1 << 63
TOPIC = b"kv-events"


def real_batch(i, count):
    h0, h1 = BASE + 2 * i, BASE + 2 * i + 1
    events = [
        {
            "type": "BlockStored",
            "block_hashes": [h0, h1],
            "parent_block_hash": None if i == 0 else BASE + 2 * i - 1,
            "token_ids": list(range(32 * i, 32 * i + 32)),
            "block_size": 16,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
            "extra_keys": [None, None],
            "group_idx": 0,
            "kv_cache_spec_kind": "full_attention",
        }
    ]
    if i % 2 == 1:
        events.append({"type": "BlockRemoved", "block_hashes": [h0], "medium": "GPU", "group_idx": 0})
    if i % 3 == 2:
        events.append(["BlockStored", [i], None, list(range(16)), 16, None, "CPU"])
    if i == 0:
        events.append(["BlockTransferred", [1], "GPU", "CPU"])
    if i == count - 1:
        events.append({"type": "AllBlocksCleared"})
    return [1700000000.0 + i, events, 0]


def main():
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    print(f"READY {port}", flush=True)
    seq = 0

    def send(batch):
        nonlocal seq
        pub.send_multipart([TOPIC, seq.to_bytes(8, "big"), msgpack.packb(batch, use_bin_type=True)])
        seq += 1

    # PUB drops messages until the subscription arrives: probe until the test has seen one.
    while True:
        send([-1.0, [], 0])
        ready, _, _ = select.select([sys.stdin], [], [], 0.02)
        if ready:
            line = sys.stdin.readline()
            if not line:
                return
            if line.strip() == "GO":
                break
    for i in range(count):
        send(real_batch(i, count))
    print("DONE", flush=True)
    sys.stdin.read()
    pub.close(linger=0)
    ctx.term()


if __name__ == "__main__":
    main()
