//! # lunakv-python
//!
//! The native half of the `lunakv` wheel: the Python module `mooncake._lunakv`, re-exported by
//! `python/mooncake/store.py` as `mooncake.store` and by `python/mooncake/engine.py` as
//! `mooncake.engine`, so that vLLM's `MooncakeStoreConnector` (`from mooncake.store import
//! MooncakeDistributedStore, ReplicateConfig`) and `MooncakeConnector` (`from mooncake.engine
//! import TransferEngine`) run unchanged on lunakv. Store methods are thin wrappers over the
//! blocking [`lunakv_client::StoreClient`]; engine methods over lunakv-transfer's raw regions.
//!
//! ## Conventions (upstream Mooncake's, kept exactly)
//! - Status results are ints: `0` ok, Mooncake's negative error codes on failure
//!   ([`lunakv_client::ClientError::code`]): -200 pool full, -704 not found, -600 bad
//!   arguments, -900 master unreachable. Reads return the bytes read. Batch calls return one
//!   result per key. `get` returns `b""` when the object is missing.
//! - No call raises for a store failure: `setup` against a dead master returns non-zero, every
//!   call before `setup` or after `close` returns -600 (`b""`, `[-600, ...]`). Only wrong Python
//!   argument *types* raise `TypeError`, as pybind11 does upstream.
//! - Buffers are caller memory addressed by raw integer pointers (numpy `ctypes.data`, torch
//!   `data_ptr()`). The caller promises that each `(ptr, size)` range is valid, and not freed or
//!   resized, for the duration of the call, as upstream requires. The module rejects what it can
//!   check with -600: a null pointer, a negative size, a range that wraps the address space, and
//!   destination ranges that overlap each other.
//! - A buffer may be GPU memory (torch CUDA tensors' `data_ptr()`): every call detects it and
//!   copies by DMA, never with the CPU (docs/GPU.md; `register_buffer` classifies it once),
//!   except the layer-wise session ranges, which are staged by the CPU and refuse device memory
//!   with -600 (README, "Layer-wise sessions").
//!
//! ## Threads and safety
//! Every `StoreClient` call runs with the GIL released (`Python::detach`), so vLLM's sending and
//! receiving threads and the model loop run in parallel. Every call also runs under
//! `catch_unwind`: a Rust panic is logged and answered with -1 (INTERNAL_ERROR) instead of
//! unwinding into the interpreter. Clients still open at interpreter exit are closed by an
//! `atexit` hook (an embedded segment is unmounted at once, not after the master's client TTL).
//!
//! ## Logging and traces
//! Rust-side warnings and errors (why a `setup` failed, a refused config) go to stderr through
//! `tracing`, filtered by `LUNAKV_LOG`, else `RUST_LOG`, default `warn`. With
//! `OTEL_EXPORTER_OTLP_ENDPOINT` set, store calls are also exported as OpenTelemetry spans
//! (docs/TRACING.md); an `atexit` hook flushes them.
//!
//! ## Modules
//! - `mooncake.store` (`python/mooncake/store.py`): [`store::MooncakeDistributedStore`],
//!   `ReplicateConfig`, `ReplicaDescriptor`.
//! - `mooncake.engine` (`python/mooncake/engine.py`): [`engine::TransferEngine`], upstream's P/D
//!   engine over lunakv-transfer's raw registered regions (see `engine/`).
//!
//! Both share one process-wide `lunakv_transfer::TransferEngine` ([`shared`]): vLLM's
//! MultiConnector[MooncakeConnector + MooncakeStoreConnector] runs them in one worker process,
//! and its connections to a peer are pooled once. They also share how a call runs ([`call`]:
//! without the GIL, panics caught, Mooncake's codes) and where this process is reached
//! ([`host`]: `local_hostname`, the environment, the transport chosen); neither module imports
//! the other.
// The crate's API is the Python module; its Rust items are private on purpose, and the map above
// links them for readers of `cargo doc --document-private-items`.
#![allow(rustdoc::private_intra_doc_links)]

mod call;
mod engine;
mod host;
mod mem;
mod shared;
mod store;
mod testing;
mod types;
mod upstream;

use pyo3::prelude::*;

/// The native module `mooncake._lunakv`.
#[pymodule]
fn _lunakv(m: &Bound<'_, PyModule>) -> PyResult<()> {
    init_logging();
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<store::MooncakeDistributedStore>()?;
    m.add_class::<types::ReplicateConfig>()?;
    m.add_class::<types::SoftPinAction>()?;
    m.add_class::<types::ReplicaDescriptor>()?;
    m.add_class::<types::MemoryDescriptor>()?;
    m.add_class::<types::BufferDescriptor>()?;
    m.add_class::<types::DiskDescriptor>()?;
    m.add_class::<engine::TransferEngine>()?;
    m.add_function(wrap_pyfunction!(store::close_all, m)?)?;
    m.add_function(wrap_pyfunction!(flush_traces, m)?)?;
    m.add_function(wrap_pyfunction!(device_split_stats, m)?)?;
    // The device test double, re-exported by `mooncake._lunakv_testing` (tests only).
    m.add_function(wrap_pyfunction!(testing::device_layer, m)?)?;
    m.add_function(wrap_pyfunction!(testing::device_alloc, m)?)?;
    m.add_function(wrap_pyfunction!(testing::device_free, m)?)?;
    m.add_function(wrap_pyfunction!(testing::device_read, m)?)?;
    m.add_function(wrap_pyfunction!(testing::device_write, m)?)?;
    m.add_function(wrap_pyfunction!(testing::device_stats, m)?)?;
    m.add_function(wrap_pyfunction!(testing::host_only_read, m)?)?;
    let atexit = m.py().import("atexit")?;
    // atexit runs hooks last-registered first: traces are flushed after the clients closed.
    atexit.call_method1("register", (m.getattr("_flush_traces")?,))?;
    atexit.call_method1("register", (m.getattr("_close_all")?,))?;
    Ok(())
}

/// The module's telemetry guard; `_flush_traces` takes it at exit.
static TELEMETRY: parking_lot::Mutex<Option<lunakv_telemetry::Telemetry>> =
    parking_lot::Mutex::new(None);

/// Installs a stderr `tracing` subscriber (and the OTLP exporter when configured) unless the
/// host process already has one.
fn init_logging() {
    let t = lunakv_telemetry::Init::new("mooncake-python")
        .log_env(&["LUNAKV_LOG", "RUST_LOG"])
        .default_log_filter("warn")
        .log_target(false)
        .install();
    *TELEMETRY.lock() = Some(t);
}

/// Exports the spans still queued and stops the exporter (registered with `atexit`).
#[pyfunction]
#[pyo3(name = "_flush_traces")]
fn flush_traces(py: Python<'_>) {
    if let Some(t) = TELEMETRY.lock().take() {
        py.detach(move || t.shutdown());
    }
}

/// The device layer's name and its split counts (docs/GPU.md, "Refused 2D copies"): 2D copies
/// the backend refused and runs copied in parts. Works with any backend; `make test-gpu` prints
/// it per mode so a GPU run shows whether the split happened.
#[pyfunction]
#[pyo3(name = "_device_split_stats")]
fn device_split_stats() -> std::collections::HashMap<&'static str, String> {
    let s = lunakv_transfer::device::split_stats();
    std::collections::HashMap::from([
        ("layer", lunakv_transfer::device::layer_name().to_string()),
        ("refused_2d", s.refused_2d.to_string()),
        ("split_runs", s.split_runs.to_string()),
    ])
}
