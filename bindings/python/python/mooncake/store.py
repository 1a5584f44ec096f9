"""``mooncake.store``: the distributed KV-cache store client, as upstream Mooncake names it.

``MooncakeDistributedStore`` and ``ReplicateConfig`` keep upstream's signatures and return
conventions (0 / negative error codes, ``bytes``, lists of ints), backed by lunakv's Rust client.
"""

import ctypes

from mooncake._lunakv import (
    Descriptor,
    DiskDescriptor,
    MemoryDescriptor,
    MooncakeDistributedStore,
    ReplicaDescriptor,
    ReplicateConfig,
)


class BufferHandle(bytearray):
    """Upstream's ``BufferHandle`` (what ``get_buffer`` returns): the object's bytes, with the
    buffer protocol (``memoryview``, ``torch.frombuffer``, ``numpy.frombuffer``), ``ptr()`` (the
    address of the bytes, valid while the handle lives and is not resized) and ``size()``."""

    def ptr(self) -> int:
        if not self:
            return 0
        return ctypes.addressof((ctypes.c_char * len(self)).from_buffer(self))

    def size(self) -> int:
        return len(self)


__all__ = [
    "BufferHandle",
    "Descriptor",
    "DiskDescriptor",
    "MemoryDescriptor",
    "MooncakeDistributedStore",
    "ReplicaDescriptor",
    "ReplicateConfig",
]
