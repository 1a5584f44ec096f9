"""``mooncake.store``: the distributed KV-cache store client, as upstream Mooncake names it.

``MooncakeDistributedStore`` and ``ReplicateConfig`` keep upstream's signatures and return
conventions (0 / negative error codes, ``bytes``, lists of ints), backed by lunakv's Rust client.
"""

from mooncake._lunakv import (
    Descriptor,
    DiskDescriptor,
    MemoryDescriptor,
    MooncakeDistributedStore,
    ReplicaDescriptor,
    ReplicateConfig,
)

__all__ = [
    "Descriptor",
    "DiskDescriptor",
    "MemoryDescriptor",
    "MooncakeDistributedStore",
    "ReplicaDescriptor",
    "ReplicateConfig",
]
