"""The whole upstream `mooncake.store` surface: every call is implemented or refused by name.

UPSTREAM_METHODS is every method of upstream's `MooncakeDistributedStore`, read from
kvcache-ai/Mooncake `mooncake-integration/store/store_py.cpp` at commit 3b5a594 (2026-08-22);
UPSTREAM_MODULE the module's other classes, enums and functions there. A call lunakv does not
implement must raise an error that names it and says why (never a silent no-op, never a bare
"no attribute"), and `hasattr` must answer False for it, so engines that probe fall back.
"""

from __future__ import annotations

import importlib

import pytest

UPSTREAM_METHODS = [
    "_get_pyclient_capsule", "setup", "setup_dummy", "init_all", "mount_segment",
    "unmount_segment", "allocate_and_mount_segment", "unmount_and_free_segment",
    "unmount_local_disk_segment", "alloc_from_mem_pool", "get", "get_batch",
    "get_offload_rpc_read_count", "get_buffer", "batch_get_buffer", "remove", "remove_by_regex",
    "remove_all", "batch_remove", "is_exist", "batch_is_exist", "close", "health_check",
    "get_size", "get_tensor_with_tp", "batch_get_tensor_with_tp", "get_tensor",
    "put_tensor_with_tp", "batch_put_tensor_with_tp", "put_tensor", "batch_get_tensor",
    "batch_put_tensor", "save_tensor_to_safetensor", "load_tensor_from_safetensor", "pub_tensor",
    "batch_pub_tensor", "pub_tensor_with_tp", "batch_pub_tensor_with_tp", "get_tensor_into",
    "batch_get_tensor_into", "get_tensor_into_cuda", "batch_get_tensor_into_cuda",
    "get_tensor_with_tp_into", "batch_get_tensor_with_tp_into", "put_tensor_from",
    "batch_put_tensor_from", "put_tensor_with_tp_from", "batch_put_tensor_with_tp_from",
    "upsert_tensor", "upsert_tensor_from", "batch_upsert_tensor_from", "batch_upsert_tensor",
    "upsert_pub_tensor", "batch_upsert_pub_tensor", "get_tensor_with_parallelism",
    "batch_get_tensor_with_parallelism", "get_tensor_with_parallelism_into",
    "batch_get_tensor_with_parallelism_into", "put_tensor_with_parallelism",
    "batch_put_tensor_with_parallelism", "put_tensor_with_parallelism_from",
    "batch_put_tensor_with_parallelism_from", "upsert_tensor_with_parallelism",
    "upsert_tensor_with_parallelism_from", "batch_upsert_tensor_with_parallelism_from",
    "batch_upsert_tensor_with_parallelism", "upsert_from", "batch_upsert_from", "upsert",
    "upsert_parts", "upsert_batch", "register_buffer", "unregister_buffer", "get_into",
    "get_into_ranges", "batch_get_into", "put_from", "put_from_with_metadata", "batch_put_from",
    "put", "put_parts", "put_batch", "get_hostname", "batch_put_from_multi_buffers",
    "batch_get_into_multi_buffers", "batch_get_session_start",
    "batch_get_into_multi_buffer_ranges", "batch_get_session_end", "batch_put_session_start",
    "batch_put_from_multi_buffer_ranges", "batch_put_session_end", "batch_put_session_revoke",
    "get_replica_desc", "batch_get_replica_desc", "batch_replica_clear", "create_copy_task",
    "create_move_task", "query_task",
]

UPSTREAM_MODULE = [
    "ReplicateConfig", "MemoryDescriptor", "DiskDescriptor", "ReplicaDescriptor", "Descriptor",
    "QueryTaskResponse", "MooncakeHostMemAllocator", "ParallelAxis", "TensorParallelism",
    "ReadTarget", "MooncakeDistributedNoFRegister", "MooncakeDistributedStore", "ObjectDataType",
    "SoftPinAction", "ReplicaStatus", "TaskType", "TaskStatus", "_serialize_tensor",
    "_tensor_metadata_size", "_deserialize_tensor", "_get_pyclient_from_wrapper",
    "bind_to_numa_node", "get_alloc_func_addr", "get_free_func_addr",
]

# What engines call today (vLLM, vLLM-Ascend's layer-wise path, SGLang, LMCache): these must be
# real methods, not refusals.
ENGINE_CALLS = [
    "setup", "setup_dummy", "register_buffer", "unregister_buffer", "batch_is_exist",
    "batch_put_from", "batch_get_into", "batch_put_from_multi_buffers",
    "batch_get_into_multi_buffers", "put_parts", "get_buffer", "batch_get_buffer", "remove_all",
    "batch_get_replica_desc", "upsert", "upsert_parts", "remove_by_regex",
    "batch_put_session_start", "batch_put_from_multi_buffer_ranges", "batch_put_session_end",
    "batch_put_session_revoke", "batch_get_session_start", "batch_get_into_multi_buffer_ranges",
    "batch_get_session_end",
]


def test_every_upstream_method_is_implemented_or_refused_by_name():
    from mooncake.store import MooncakeDistributedStore

    s = MooncakeDistributedStore()
    implemented, refused = [], []
    for name in UPSTREAM_METHODS:
        if callable(getattr(MooncakeDistributedStore, name, None)):
            implemented.append(name)
            continue
        assert not hasattr(s, name), name
        with pytest.raises(AttributeError) as e:
            getattr(s, name)
        msg = str(e.value)
        assert f"MooncakeDistributedStore.{name}" in msg and "lunakv does not implement" in msg, msg
        assert len(msg.split(": ", 1)[1]) > 40, f"{name}: the reason is missing: {msg}"
        refused.append(name)
    for name in ENGINE_CALLS:
        assert name in implemented, f"{name} is called by engines and must be implemented"
    # An unknown name is Python's usual error.
    with pytest.raises(AttributeError, match="has no attribute 'no_such_call'"):
        s.no_such_call
    assert len(implemented) + len(refused) == len(UPSTREAM_METHODS)


def test_every_upstream_module_name_imports_or_is_refused_by_name():
    m = importlib.import_module("mooncake.store")
    for name in UPSTREAM_MODULE:
        try:
            getattr(m, name)
        except ImportError as e:
            assert f"mooncake.store.{name}" in str(e) and "lunakv does not implement" in str(e)
    for name in ("MooncakeHostMemAllocator", "SoftPinAction", "ReplicateConfig"):
        getattr(m, name)


def test_soft_pin_action_and_ttl_are_upstreams():
    from mooncake.store import ReplicateConfig, SoftPinAction

    c = ReplicateConfig()
    assert c.soft_pin_action == SoftPinAction.PRESERVE and c.soft_pin_ttl_ms is None
    c.soft_pin_action = SoftPinAction.ENABLE
    c.soft_pin_ttl_ms = 1000
    assert (c.soft_pin_action, c.soft_pin_ttl_ms) == (SoftPinAction.ENABLE, 1000)
