"""A second process that loads KV blocks the way vLLM's store worker does.

Usage: kv_worker.py MASTER GLOBAL_SEGMENT_SIZE LAYERS BLOCKS BLOCK_LEN OUT_NPY KEY...

Sets up a MooncakeDistributedStore (positional setup, as vLLM calls it), registers its own KV
cache buffer, checks batch_is_exist, then batch_get_into_multi_buffers of key i into block
``BLOCKS - 1 - i`` (a different layout from the writer's). Saves the buffer to OUT_NPY and prints
one line ``results=<json list>``.
"""

import json
import sys

import numpy as np

from mooncake.store import MooncakeDistributedStore


def main() -> int:
    master, gss, layers, blocks, block_len, out = sys.argv[1:7]
    keys = sys.argv[7:]
    layers, blocks, block_len, gss = int(layers), int(blocks), int(block_len), int(gss)
    kv = np.zeros((layers, blocks, block_len), dtype=np.uint8)
    base = kv.ctypes.data
    store = MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", "P2PHANDSHAKE", gss, 16 << 20, "tcp", "", master)
    if rc != 0:
        print(f"setup failed: {rc}", file=sys.stderr)
        return 1
    if store.register_buffer(base, kv.nbytes) != 0:
        print("register_buffer failed", file=sys.stderr)
        return 1
    exists = store.batch_is_exist(keys)
    if exists != [1] * len(keys):
        print(f"batch_is_exist: {exists}", file=sys.stderr)
        return 1
    layer_stride = blocks * block_len
    all_ptrs, all_sizes = [], []
    for i in range(len(keys)):
        block = blocks - 1 - i
        all_ptrs.append([base + layer * layer_stride + block * block_len for layer in range(layers)])
        all_sizes.append([block_len] * layers)
    results = store.batch_get_into_multi_buffers(keys, all_ptrs, all_sizes)
    np.save(out, kv)
    store.unregister_buffer(base)
    store.close()
    print("results=" + json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
