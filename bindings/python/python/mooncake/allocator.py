"""``mooncake.allocator``: upstream's custom GPU memory pools, which lunakv does not provide.

Upstream Mooncake ships pluggable ``torch.cuda.MemPool`` allocators here (``NVLinkAllocator``
for its NVLink/fabric transport, ``BarexAllocator`` for BAREX, ``AscendAllocator`` for Ascend
NPUs). Engines ask for them only when a custom memory pool is switched on (SGLang's
``SGLANG_MOONCAKE_CUSTOM_MEM_POOL=NVLINK|BAREX``, vLLM/SGLang disaggregation over NVLink), as::

    from mooncake.allocator import NVLinkAllocator
    pool = torch.cuda.MemPool(NVLinkAllocator.get_allocator(device).allocator())

lunakv has no NVLink or BAREX transport, so a pool allocated that way would buy nothing: its
memory would still move over shm/tcp (rdma where available). Importing one of these names
raises ``ImportError`` naming the alternative. The callers upstream catch exactly that
``ImportError`` and fall back to torch's default pool, which lunakv serves directly: register
the ordinary KV-cache tensors with ``MooncakeDistributedStore.register_buffer`` or
``TransferEngine.batch_register_memory``.

``import mooncake.allocator`` itself succeeds, so feature probes can tell "lunakv, no custom
pools" from "no mooncake package at all".
"""

AVAILABLE = False

_UNAVAILABLE = {
    "NVLinkAllocator": "NVLink",
    "BarexAllocator": "BAREX",
    "AscendAllocator": "Ascend NPU",
    "MooncakeAllocator": "custom",
}

__all__ = ["AVAILABLE"]


def _message(name: str) -> str:
    kind = _UNAVAILABLE[name]
    return (
        f"mooncake.allocator.{name} is not available: lunakv (this `mooncake` package) has no "
        f"{kind} memory-pool allocator, because it has no {kind} transport. Use torch's default "
        "CUDA memory pool instead (unset SGLANG_MOONCAKE_CUSTOM_MEM_POOL or the engine's "
        "custom-pool option) and register the KV-cache tensors as they are: "
        "MooncakeDistributedStore.register_buffer(tensor.untyped_storage().data_ptr(), nbytes) "
        "or TransferEngine.batch_register_memory(...). lunakv moves that memory over shared "
        "memory, tcp or rdma (docs/GPU.md, docs/RDMA.md)."
    )


def __getattr__(name: str):
    # `from mooncake.allocator import NVLinkAllocator` lands here: an ImportError (not an
    # AttributeError turned into a bare "cannot import name") carries the reason and the fix.
    if name in _UNAVAILABLE:
        raise ImportError(_message(name), name=name, path=__file__)
    raise AttributeError(f"module 'mooncake.allocator' has no attribute {name!r}")
