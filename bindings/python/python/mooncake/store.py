"""``mooncake.store``: the distributed KV-cache store client, as upstream Mooncake names it.

``MooncakeDistributedStore`` and ``ReplicateConfig`` keep upstream's signatures and return
conventions (0 / negative error codes, ``bytes``, lists of ints), backed by lunakv's Rust client.
"""

import ctypes
import mmap
import threading

from mooncake._lunakv import (
    Descriptor,
    DiskDescriptor,
    MemoryDescriptor,
    MooncakeDistributedStore,
    ReplicaDescriptor,
    ReplicateConfig,
    SoftPinAction,
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


class MooncakeHostMemAllocator:
    """Upstream's host-memory allocator for SGLang's standalone storage
    (``MooncakeHostTensorAllocator`` wraps ``alloc``'s address in a tensor). Upstream hands out
    memory a separate real-client process can map; lunakv has no such process (the engine moves
    its own bytes, ``setup_dummy``), so this is page-aligned anonymous memory of this process,
    for ``register_buffer``. ``alloc`` returns the address, 0 when it cannot; ``free`` returns 0,
    or -1 for an address it did not hand out."""

    _libc = ctypes.CDLL(None, use_errno=True)
    _libc.mmap.restype = ctypes.c_void_p
    _libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                           ctypes.c_int, ctypes.c_long]
    _libc.munmap.restype = ctypes.c_int
    _libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]

    def __init__(self) -> None:
        self._sizes: dict[int, int] = {}
        self._lock = threading.Lock()

    def alloc(self, size: int) -> int:
        if size <= 0:
            return 0
        addr = self._libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE,
                               mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        if addr is None or addr == ctypes.c_void_p(-1).value:
            return 0
        with self._lock:
            self._sizes[addr] = size
        return addr

    def free(self, ptr: int) -> int:
        with self._lock:
            size = self._sizes.pop(ptr, None)
        if size is None:
            return -1
        return self._libc.munmap(ptr, size)


# Upstream's module-level names lunakv does not implement: importing one raises an ImportError
# (an attribute lookup an AttributeError) that names it and the alternative.
_NOT_IMPLEMENTED = {
    "get_alloc_func_addr": "there is no custom allocator to plug into torch: use torch's default "
    "allocator and register_buffer the tensors",
    "get_free_func_addr": "there is no custom allocator to plug into torch: use torch's default "
    "allocator and register_buffer the tensors",
    "bind_to_numa_node": "lunakv does not pin its threads to NUMA nodes: start the engine under "
    "numactl or taskset",
    "MooncakeDistributedNoFRegister": "lunakv has no NVMe-oF tier: the SSD tier runs on "
    "lunakv-store --enable_offload (docs/OFFLOAD.md)",
    "QueryTaskResponse": "replica copy and move tasks are not implemented",
    "TaskType": "replica copy and move tasks are not implemented",
    "TaskStatus": "replica copy and move tasks are not implemented",
    "ObjectDataType": "objects carry no data type: every object is bytes",
    "ReplicaStatus": "ReplicaDescriptor.status is a string (\"COMPLETE\")",
    "ParallelAxis": "the tensor helpers are not implemented: put and get tensor bytes with "
    "put_from / get_into",
    "TensorParallelism": "the tensor helpers are not implemented: put and get tensor bytes with "
    "put_from / get_into",
    "ReadTarget": "the tensor helpers are not implemented: put and get tensor bytes with "
    "put_from / get_into",
    "_serialize_tensor": "the tensor helpers are not implemented",
    "_tensor_metadata_size": "the tensor helpers are not implemented",
    "_deserialize_tensor": "the tensor helpers are not implemented",
    "_get_pyclient_from_wrapper": "it hands out upstream's C++ client, which lunakv does not have",
}


def __getattr__(name: str):
    why = _NOT_IMPLEMENTED.get(name)
    if why is None:
        raise AttributeError(f"module 'mooncake.store' has no attribute {name!r}")
    raise ImportError(
        f"mooncake.store.{name} is upstream Mooncake's and lunakv does not implement it: {why} "
        "(bindings/python/README.md lists the whole surface)",
        name=name,
        path=__file__,
    )


__all__ = [
    "BufferHandle",
    "Descriptor",
    "DiskDescriptor",
    "MemoryDescriptor",
    "MooncakeDistributedStore",
    "MooncakeHostMemAllocator",
    "ReplicaDescriptor",
    "ReplicateConfig",
    "SoftPinAction",
]
