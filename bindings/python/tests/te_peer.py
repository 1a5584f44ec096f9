"""A second Python process for the `mooncake.engine` tests: the decode side of P/D.

Usage: te_peer.py LAYERS BLOCKS BLOCK_LEN [MASTER]

Initializes a TransferEngine on 127.0.0.1 the way vLLM's MooncakeConnector does, registers a KV
cache (one numpy array, layers x blocks x block_len) with batch_register_memory (one region per
layer, as vLLM registers one per layer tensor), and, given MASTER, also sets up a
MooncakeDistributedStore requester (standalone-store) with a second, same-shaped buffer.
Prints one line ``ready session=... base=... engine_id=... store_engine_id=...``, then serves
commands read from stdin, one per line, answering one line each:

    fill SEED            fill the P/D buffer with random bytes      -> ok
    dump PATH            np.save the P/D buffer                     -> ok
    load PATH KEY...     batch_get_into_multi_buffers key i into block i of the store buffer,
                         np.save it                                 -> ok results=[...]
    exit
"""

import json
import sys

import numpy as np

from mooncake.engine import TransferEngine


def main() -> int:
    layers, blocks, block_len = (int(a) for a in sys.argv[1:4])
    master = sys.argv[4] if len(sys.argv) > 4 else None
    kv = np.zeros((layers, blocks, block_len), dtype=np.uint8)
    te = TransferEngine()
    if te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        print("initialize failed", flush=True)
        return 1
    stride = blocks * block_len
    ptrs = [kv.ctypes.data + layer * stride for layer in range(layers)]
    if te.batch_register_memory(ptrs, [stride] * layers) != 0:
        print("batch_register_memory failed", flush=True)
        return 1
    store = None
    kv2 = np.zeros_like(kv)
    if master:
        from mooncake.store import MooncakeDistributedStore

        store = MooncakeDistributedStore()
        rc = store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master)
        if rc != 0:
            print(f"store setup failed {rc}", flush=True)
            return 1
        store.register_buffer(kv2.ctypes.data, kv2.nbytes)
    print(
        f"ready session=127.0.0.1:{te.get_rpc_port()} base={kv.ctypes.data} "
        f"engine_id={te._transfer_engine_id()} "
        f"store_engine_id={store._transfer_engine_id() if store else 0}",
        flush=True,
    )
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "fill":
            kv[:] = np.random.default_rng(int(args[0])).integers(0, 256, kv.shape, dtype=np.uint8)
            print("ok", flush=True)
        elif cmd == "dump":
            np.save(args[0], kv)
            print("ok", flush=True)
        elif cmd == "load":
            assert store is not None
            keys = args[1:]
            all_ptrs = [[kv2.ctypes.data + layer * stride + i * block_len for layer in range(layers)] for i in range(len(keys))]
            all_sizes = [[block_len] * layers for _ in keys]
            results = store.batch_get_into_multi_buffers(keys, all_ptrs, all_sizes)
            np.save(args[0], kv2)
            print("ok results=" + json.dumps(results), flush=True)
        elif cmd == "exit":
            break
    te.batch_unregister_memory(ptrs)
    if store:
        store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
