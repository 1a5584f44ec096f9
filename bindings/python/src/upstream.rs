//! Upstream `MooncakeDistributedStore` calls lunakv does not implement, each with the reason and
//! the way to do the same on lunakv. A call of one raises `AttributeError` naming it (so the
//! `hasattr` probes engines make still answer False and they fall back), never a silent no-op.
//! The list is checked against upstream's binding (mooncake-integration/store/store_py.cpp) by
//! tests/test_upstream_surface.py.

const SEGMENTS: &str = "a lunakv client does not mount segments by hand: run lunakv-store (or \
    setup with global_segment_size > 0, which mounts this process's segment)";
const TENSORS: &str = "the tensor helpers (tensor metadata plus bytes) are not implemented: store \
    a tensor's bytes with put_from / batch_put_from(tensor.data_ptr(), nbytes) and read them \
    back with get_into / batch_get_into, keeping dtype and shape on the caller's side";
const TASKS: &str = "replica copy and move tasks are not implemented: replicas are placed when \
    an object is put (ReplicateConfig.replica_num, preferred_segments)";

/// (name, why and what to do instead).
pub const NOT_IMPLEMENTED: &[(&str, &str)] = &[
    ("init_all", SEGMENTS),
    ("mount_segment", SEGMENTS),
    ("unmount_segment", SEGMENTS),
    ("allocate_and_mount_segment", SEGMENTS),
    ("unmount_and_free_segment", SEGMENTS),
    ("unmount_local_disk_segment", SEGMENTS),
    (
        "alloc_from_mem_pool",
        "there is no dummy client's memory pool to allocate from: allocate host memory with \
         mooncake.store.MooncakeHostMemAllocator().alloc(size) and register_buffer it",
    ),
    (
        "get_offload_rpc_read_count",
        "lunakv has no offload RPC server: disk-tier reads go through the store-client's \
         transfer port and are counted in lunakv-store's /metrics",
    ),
    ("get_tensor", TENSORS),
    ("put_tensor", TENSORS),
    ("batch_get_tensor", TENSORS),
    ("batch_put_tensor", TENSORS),
    ("get_tensor_with_tp", TENSORS),
    ("batch_get_tensor_with_tp", TENSORS),
    ("put_tensor_with_tp", TENSORS),
    ("batch_put_tensor_with_tp", TENSORS),
    ("save_tensor_to_safetensor", TENSORS),
    ("load_tensor_from_safetensor", TENSORS),
    ("pub_tensor", TENSORS),
    ("batch_pub_tensor", TENSORS),
    ("pub_tensor_with_tp", TENSORS),
    ("batch_pub_tensor_with_tp", TENSORS),
    ("get_tensor_into", TENSORS),
    ("batch_get_tensor_into", TENSORS),
    ("get_tensor_into_cuda", TENSORS),
    ("batch_get_tensor_into_cuda", TENSORS),
    ("get_tensor_with_tp_into", TENSORS),
    ("batch_get_tensor_with_tp_into", TENSORS),
    ("put_tensor_from", TENSORS),
    ("batch_put_tensor_from", TENSORS),
    ("put_tensor_with_tp_from", TENSORS),
    ("batch_put_tensor_with_tp_from", TENSORS),
    ("upsert_tensor", TENSORS),
    ("upsert_tensor_from", TENSORS),
    ("batch_upsert_tensor_from", TENSORS),
    ("batch_upsert_tensor", TENSORS),
    ("upsert_pub_tensor", TENSORS),
    ("batch_upsert_pub_tensor", TENSORS),
    ("get_tensor_with_parallelism", TENSORS),
    ("batch_get_tensor_with_parallelism", TENSORS),
    ("get_tensor_with_parallelism_into", TENSORS),
    ("batch_get_tensor_with_parallelism_into", TENSORS),
    ("put_tensor_with_parallelism", TENSORS),
    ("batch_put_tensor_with_parallelism", TENSORS),
    ("put_tensor_with_parallelism_from", TENSORS),
    ("batch_put_tensor_with_parallelism_from", TENSORS),
    ("upsert_tensor_with_parallelism", TENSORS),
    ("upsert_tensor_with_parallelism_from", TENSORS),
    ("batch_upsert_tensor_with_parallelism_from", TENSORS),
    ("batch_upsert_tensor_with_parallelism", TENSORS),
    (
        "get_into_ranges",
        "scatter reads of several objects into one buffer are not implemented: read each \
         object with batch_get_into_multi_buffers (one pointer and size per piece)",
    ),
    (
        "put_from_with_metadata",
        "a metadata blob stored beside an object is not implemented: put the metadata as its \
         own object (or as the first piece of batch_put_from_multi_buffers)",
    ),
    ("batch_replica_clear", TASKS),
    ("create_copy_task", TASKS),
    ("create_move_task", TASKS),
    ("query_task", TASKS),
    (
        "_get_pyclient_capsule",
        "it hands out upstream's C++ client object, which lunakv does not have",
    ),
];

/// The refusal for `name`, when it is an upstream call lunakv does not implement.
pub fn refusal(name: &str) -> Option<String> {
    NOT_IMPLEMENTED
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(n, why)| {
            format!(
                "MooncakeDistributedStore.{n} is upstream Mooncake's and lunakv does not \
                 implement it: {why} (bindings/python/README.md lists the whole surface)"
            )
        })
}
