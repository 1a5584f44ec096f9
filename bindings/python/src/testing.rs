//! `mooncake._lunakv_testing`'s native half: the device test double, for the tests that prove
//! no data path dereferences a device pointer (docs/GPU.md). Every function raises
//! `RuntimeError` unless the process runs with `LUNAKV_DEVICE=fake` (or `fake-blind`).

use std::collections::HashMap;

use lunakv_transfer::device::{self, fake};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

fn err(e: device::DeviceError) -> PyErr {
    PyRuntimeError::new_err(e.to_string())
}

/// The device layer this process uses: "none", "cuda", "fake" or "fake-blind".
#[pyfunction]
#[pyo3(name = "_device_layer")]
pub fn device_layer() -> &'static str {
    device::layer_name()
}

/// Allocates `nbytes` of fake device memory; its address (any CPU access to it is SIGSEGV).
#[pyfunction]
#[pyo3(name = "_device_alloc")]
pub fn device_alloc(nbytes: usize) -> PyResult<usize> {
    fake::alloc(nbytes).map_err(err)
}

#[pyfunction]
#[pyo3(name = "_device_free")]
pub fn device_free(addr: usize) -> PyResult<()> {
    fake::free(addr).map_err(err)
}

/// `n` bytes of fake device memory at `addr`, read through the double's second mapping.
#[pyfunction]
#[pyo3(name = "_device_read")]
pub fn device_read<'py>(py: Python<'py>, addr: usize, n: usize) -> PyResult<Bound<'py, PyBytes>> {
    let v = fake::read(addr, n).map_err(err)?;
    Ok(PyBytes::new(py, &v))
}

/// Writes `data` into fake device memory at `addr` through the double's second mapping.
#[pyfunction]
#[pyo3(name = "_device_write")]
pub fn device_write(addr: usize, data: &[u8]) -> PyResult<()> {
    fake::write(addr, data).map_err(err)
}

/// The double's counters: copies each way (and bytes), synchronizations, pins, streams.
#[pyfunction]
#[pyo3(name = "_device_stats")]
pub fn device_stats() -> PyResult<HashMap<&'static str, u64>> {
    let s = fake::stats().map_err(err)?;
    Ok(HashMap::from([
        ("d2h_copies", s.d2h_copies),
        ("copies_2d", s.copies_2d),
        ("copy_calls", s.copy_calls),
        ("refused_2d", s.refused_2d),
        ("copy_ns", s.copy_ns),
        ("h2d_copies", s.h2d_copies),
        ("d2h_bytes", s.d2h_bytes),
        ("h2d_bytes", s.h2d_bytes),
        ("syncs", s.syncs),
        ("pins", s.pins),
        ("unpins", s.unpins),
        ("pinned_bytes", s.pinned_bytes),
        ("streams", s.streams),
    ]))
}

/// Reads `n` bytes at `addr` with a plain CPU copy, as a host-only path would: on fake device
/// memory this kills the process with SIGSEGV (the crash tests run it in a subprocess).
#[pyfunction]
#[pyo3(name = "_host_only_read")]
pub fn host_only_read<'py>(
    py: Python<'py>,
    addr: usize,
    n: usize,
) -> PyResult<Bound<'py, PyBytes>> {
    fake::active().map_err(err)?;
    let mut v = vec![0u8; n];
    // SAFETY: deliberately unsound on device memory: this is the crash the double must produce.
    // Test-only, reachable only with the double active.
    unsafe {
        std::ptr::copy_nonoverlapping(std::hint::black_box(addr) as *const u8, v.as_mut_ptr(), n)
    };
    Ok(PyBytes::new(py, &v))
}
