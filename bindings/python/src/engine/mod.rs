//! `TransferEngine`: upstream's P/D transfer engine class (`mooncake.engine.TransferEngine`) over
//! lunakv-transfer's raw registered regions.
//!
//! vLLM's MooncakeConnector calls `initialize(ip, "P2PHANDSHAKE", protocol, "")`,
//! `get_rpc_port()`, `batch_register_memory(ptrs, lens)` and, on the prefill side,
//! `batch_transfer_sync_write("ip:rpc_port", src_ptrs, dst_ptrs, lens)` into the decode engine's
//! registered KV cache. Here:
//!
//! - `initialize` starts a [`RegionServer`] bound to exactly `local_hostname:0` (never 0.0.0.0)
//!   serving this instance's [`MemoryRegistry`]; `get_rpc_port` is its port, so the session id
//!   peers use is `"host:rpc_port"`, as upstream's. No metadata server is involved: whatever
//!   `metadata_server` says (P2PHANDSHAKE, etcd://, http://) is accepted and not needed.
//! - Transfers ride the process-wide engine ([`crate::shared`]) shared with `mooncake.store`.
//! - The remote side refuses any range that is not inside one region its process registered.
//!
//! Return conventions are upstream's: 0 ok, negative on failure (-1 for every failed transfer,
//! as upstream's TransferEnginePy); the reason goes to the log. Nothing raises except wrong
//! Python argument types. Every call that blocks releases the GIL and catches panics.
//!
//! Here the Python methods (one `#[pymethods]` block, as pyo3 takes them); the handle and its
//! state in `handle.rs`; what the methods do (start, register, plan, run) in `ops.rs`.

use std::collections::HashMap;
use std::sync::Arc;

use lunakv_transfer::TransferError;
use parking_lot::RwLock;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::call::detached;
use crate::host::protocol_info;
use crate::mem::Range;

mod handle;
mod ops;

pub use handle::TransferEngine;

use handle::{Dir, ERR_INVALID_ARGUMENT, FAILED, Pending};
use ops::session_endpoint;

#[pymethods]
impl TransferEngine {
    #[new]
    fn py_new() -> Self {
        TransferEngine {
            active: RwLock::new(None),
        }
    }

    /// Starts serving this process's registered memory on `local_hostname` (exactly that
    /// address, port picked by the kernel; a `host:port` form has its port ignored, as upstream
    /// without MC_LEGACY_RPC_PORT_BINDING). `protocol` "tcp" (or "rdma", served over tcp here).
    /// Returns 0, or a negative code.
    #[pyo3(signature = (local_hostname, metadata_server = None, protocol = None, device_name = None))]
    fn initialize(
        &self,
        py: Python<'_>,
        local_hostname: String,
        metadata_server: Option<String>,
        protocol: Option<String>,
        device_name: Option<String>,
    ) -> i64 {
        let _ = (metadata_server, device_name);
        self.init(py, &local_hostname, protocol.as_deref().unwrap_or("tcp"))
    }

    /// Upstream's form with an explicit metadata type ("etcd", "redis", "http"); lunakv needs
    /// no metadata service, so it is accepted and not used.
    #[pyo3(signature = (local_hostname, metadata_server, protocol, device_name, metadata_type))]
    fn initialize_ext(
        &self,
        py: Python<'_>,
        local_hostname: String,
        metadata_server: Option<String>,
        protocol: Option<String>,
        device_name: Option<String>,
        metadata_type: Option<String>,
    ) -> i64 {
        let _ = (metadata_server, device_name, metadata_type);
        self.init(py, &local_hostname, protocol.as_deref().unwrap_or("tcp"))
    }

    /// The port peers reach this engine on; the session id is `"<local_hostname>:<port>"`.
    /// -1 before initialize.
    fn get_rpc_port(&self) -> i64 {
        self.active()
            .map_or(FAILED, |a| i64::from(a.server.local_addr().port()))
    }

    /// lunakv: `{"requested", "effective", "reason"}` of the protocol `initialize` was given
    /// (`None` before initialize). "rdma" on a machine or build without it serves "tcp".
    fn _protocol_info(&self) -> Option<HashMap<&'static str, String>> {
        self.active().map(|a| protocol_info(&a.protocol))
    }

    /// Upstream's handle of the engine, which SGLang hands to `store.setup(engine=...)`: this
    /// object (lunakv's store already shares the process's data path with it).
    fn get_engine(slf: Py<Self>) -> Py<Self> {
        slf
    }

    /// Upstream's probe of a peer session before the first transfer: 0 when the peer's
    /// transfer port answers, -1 when it cannot be reached (the reason is logged). lunakv asks
    /// the peer for one byte at address 0, which no peer registers, on the connection
    /// transfers use; the peer's "out of bounds" is the answer that proves it is there.
    fn send_probe(&self, py: Python<'_>, session_id: String) -> i64 {
        let Some(a) = self.active() else {
            tracing::error!("lunakv: send_probe before initialize");
            return FAILED;
        };
        let endpoint = match session_endpoint(&session_id) {
            Ok(e) => e,
            Err(e) => {
                tracing::error!("lunakv: send_probe refused: {e}");
                return FAILED;
            }
        };
        detached(py, FAILED, move || {
            let mut byte = [0u8; 1];
            match a.engine.read_raw(&endpoint, 0, &mut [&mut byte[..]]) {
                Ok(()) | Err(TransferError::OutOfBounds { .. }) => 0,
                Err(e) => {
                    tracing::warn!("lunakv: send_probe to {endpoint}: {e}");
                    FAILED
                }
            }
        })
    }

    /// lunakv: this engine's session id, `"host:rpc_port"` ("" before initialize).
    fn get_session_id(&self) -> String {
        self.active()
            .map(|a| a.server.endpoint().to_owned())
            .unwrap_or_default()
    }

    /// Registers `[buffer_addr, buffer_addr+capacity)` for peers to write and read. Returns 0,
    /// -1 for a bad pointer/size (or before initialize), -7 if it overlaps a registered buffer.
    /// The memory must stay allocated until `unregister_memory` returns.
    #[pyo3(signature = (buffer_addr, capacity, location = None))]
    fn register_memory(
        &self,
        py: Python<'_>,
        buffer_addr: i128,
        capacity: i128,
        location: Option<String>,
    ) -> i64 {
        let _ = location;
        self.register(py, vec![(buffer_addr, capacity)])
    }

    /// Stops serving the buffer at `buffer_addr` (waits for peers' copies in flight). 0, or -3
    /// if no registered buffer starts there.
    fn unregister_memory(&self, py: Python<'_>, buffer_addr: i128) -> i64 {
        self.unregister(py, vec![buffer_addr])
    }

    /// All or nothing: on failure none of the buffers stays registered.
    #[pyo3(signature = (buffer_addresses, capacities, location = None))]
    fn batch_register_memory(
        &self,
        py: Python<'_>,
        buffer_addresses: Vec<i128>,
        capacities: Vec<i128>,
        location: Option<String>,
    ) -> i64 {
        let _ = location;
        if buffer_addresses.len() != capacities.len() {
            tracing::error!(
                "lunakv: batch_register_memory refused: {} addresses but {} capacities",
                buffer_addresses.len(),
                capacities.len()
            );
            return ERR_INVALID_ARGUMENT;
        }
        self.register(py, buffer_addresses.into_iter().zip(capacities).collect())
    }

    fn batch_unregister_memory(&self, py: Python<'_>, buffer_addresses: Vec<i128>) -> i64 {
        self.unregister(py, buffer_addresses)
    }

    /// Writes `length` bytes at `buffer` into the peer's registered memory at
    /// `peer_buffer_address`. `target_hostname` is the peer's session id `"host:rpc_port"`.
    /// 0, or -1 (bad arguments, peer unreachable, range not registered there).
    #[pyo3(signature = (target_hostname, buffer, peer_buffer_address, length, transport_hint = None))]
    fn transfer_sync_write(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffer: i128,
        peer_buffer_address: i128,
        length: i128,
        transport_hint: Option<String>,
    ) -> i64 {
        let _ = transport_hint;
        self.sync(
            py,
            "transfer_sync_write",
            target_hostname,
            &[buffer],
            &[peer_buffer_address],
            &[length],
            Dir::Write,
        )
    }

    /// Reads `length` bytes of the peer's registered memory into `buffer`. 0 or -1.
    #[pyo3(signature = (target_hostname, buffer, peer_buffer_address, length, transport_hint = None))]
    fn transfer_sync_read(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffer: i128,
        peer_buffer_address: i128,
        length: i128,
        transport_hint: Option<String>,
    ) -> i64 {
        let _ = transport_hint;
        self.sync(
            py,
            "transfer_sync_read",
            target_hostname,
            &[buffer],
            &[peer_buffer_address],
            &[length],
            Dir::Read,
        )
    }

    /// vLLM's P/D send: every `(buffers[i], peer_buffer_addresses[i], lengths[i])` written,
    /// pipelined over the pooled connections. 0 if all succeeded, else -1.
    #[pyo3(signature = (target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint = None))]
    fn batch_transfer_sync_write(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffers: Vec<i128>,
        peer_buffer_addresses: Vec<i128>,
        lengths: Vec<i128>,
        transport_hint: Option<String>,
    ) -> i64 {
        let _ = transport_hint;
        self.sync(
            py,
            "batch_transfer_sync_write",
            target_hostname,
            &buffers,
            &peer_buffer_addresses,
            &lengths,
            Dir::Write,
        )
    }

    #[pyo3(signature = (target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint = None))]
    fn batch_transfer_sync_read(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffers: Vec<i128>,
        peer_buffer_addresses: Vec<i128>,
        lengths: Vec<i128>,
        transport_hint: Option<String>,
    ) -> i64 {
        let _ = transport_hint;
        self.sync(
            py,
            "batch_transfer_sync_read",
            target_hostname,
            &buffers,
            &peer_buffer_addresses,
            &lengths,
            Dir::Read,
        )
    }

    /// Upstream's generic form: `opcode` is `TransferOpcode.Read` (0) or `.Write` (1).
    /// A `notify` other than None is refused ([`refuse_notify`]).
    #[pyo3(signature = (target_hostname, buffer, peer_buffer_address, length, opcode, notify = None, transport_hint = None))]
    #[allow(clippy::too_many_arguments)]
    fn transfer_sync(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffer: i128,
        peer_buffer_address: i128,
        length: i128,
        opcode: i64,
        notify: Option<&Bound<'_, PyAny>>,
        transport_hint: Option<String>,
    ) -> i64 {
        let _ = transport_hint;
        if refuse_notify("transfer_sync", notify) {
            return FAILED;
        }
        let Some(dir) = Dir::from_opcode(opcode) else {
            tracing::error!(
                "lunakv: transfer_sync refused: opcode {opcode} is not Read (0) or Write (1)"
            );
            return FAILED;
        };
        self.sync(
            py,
            "transfer_sync",
            target_hostname,
            &[buffer],
            &[peer_buffer_address],
            &[length],
            dir,
        )
    }

    #[pyo3(signature = (target_hostname, buffers, peer_buffer_addresses, lengths, opcode, notify = None, transport_hint = None))]
    #[allow(clippy::too_many_arguments)]
    fn batch_transfer_sync(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffers: Vec<i128>,
        peer_buffer_addresses: Vec<i128>,
        lengths: Vec<i128>,
        opcode: i64,
        notify: Option<&Bound<'_, PyAny>>,
        transport_hint: Option<String>,
    ) -> i64 {
        let _ = transport_hint;
        if refuse_notify("batch_transfer_sync", notify) {
            return FAILED;
        }
        let Some(dir) = Dir::from_opcode(opcode) else {
            tracing::error!(
                "lunakv: batch_transfer_sync refused: opcode {opcode} is not Read (0) or Write (1)"
            );
            return FAILED;
        };
        self.sync(
            py,
            "batch_transfer_sync",
            target_hostname,
            &buffers,
            &peer_buffer_addresses,
            &lengths,
            dir,
        )
    }

    /// Starts a batch write; returns its batch id (> 0), or 0 if it could not start (as
    /// upstream). Wait with `get_batch_transfer_status([id])`. The buffers must stay valid
    /// until then.
    #[pyo3(signature = (target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint = None))]
    fn batch_transfer_async_write(
        &self,
        target_hostname: &str,
        buffers: Vec<i128>,
        peer_buffer_addresses: Vec<i128>,
        lengths: Vec<i128>,
        transport_hint: Option<String>,
    ) -> i64 {
        let _ = transport_hint;
        self.submit(
            "batch_transfer_async_write",
            target_hostname,
            &buffers,
            &peer_buffer_addresses,
            &lengths,
            Dir::Write,
            0,
        )
    }

    #[pyo3(signature = (target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint = None))]
    fn batch_transfer_async_read(
        &self,
        target_hostname: &str,
        buffers: Vec<i128>,
        peer_buffer_addresses: Vec<i128>,
        lengths: Vec<i128>,
        transport_hint: Option<String>,
    ) -> i64 {
        let _ = transport_hint;
        self.submit(
            "batch_transfer_async_read",
            target_hostname,
            &buffers,
            &peer_buffer_addresses,
            &lengths,
            Dir::Read,
            0,
        )
    }

    #[pyo3(signature = (target_hostname, buffers, peer_buffer_addresses, lengths, opcode, transport_hint = None))]
    #[allow(clippy::too_many_arguments)]
    fn batch_transfer_async(
        &self,
        target_hostname: &str,
        buffers: Vec<i128>,
        peer_buffer_addresses: Vec<i128>,
        lengths: Vec<i128>,
        opcode: i64,
        transport_hint: Option<String>,
    ) -> i64 {
        let _ = transport_hint;
        let Some(dir) = Dir::from_opcode(opcode) else {
            tracing::error!(
                "lunakv: batch_transfer_async refused: opcode {opcode} is not Read (0) or Write (1)"
            );
            return 0;
        };
        self.submit(
            "batch_transfer_async",
            target_hostname,
            &buffers,
            &peer_buffer_addresses,
            &lengths,
            dir,
            0,
        )
    }

    /// Waits for every batch; 0 if all succeeded, -1 if any failed or is unknown.
    fn get_batch_transfer_status(&self, py: Python<'_>, batch_ids: Vec<i128>) -> i64 {
        let pending: Vec<Option<Arc<Pending>>> =
            batch_ids.iter().map(|&id| self.find_batch(id)).collect();
        let rc = detached(py, FAILED, move || {
            let mut rc = 0;
            for p in pending {
                match p {
                    Some(p) if p.wait() == 0 => {}
                    _ => rc = FAILED,
                }
            }
            rc
        });
        for id in batch_ids {
            self.forget_batch(id);
        }
        rc
    }

    /// Starts a single write; returns its batch id, or -1 (as upstream).
    #[pyo3(signature = (target_hostname, buffer, peer_buffer_address, length, transport_hint = None))]
    fn transfer_submit_write(
        &self,
        target_hostname: &str,
        buffer: i128,
        peer_buffer_address: i128,
        length: i128,
        transport_hint: Option<String>,
    ) -> i64 {
        let _ = transport_hint;
        self.submit(
            "transfer_submit_write",
            target_hostname,
            &[buffer],
            &[peer_buffer_address],
            &[length],
            Dir::Write,
            FAILED,
        )
    }

    /// 1 completed, 0 still running, -1 failed or unknown id (upstream's values). A finished
    /// batch is forgotten once its status was returned.
    fn transfer_check_status(&self, batch_id: i128) -> i64 {
        let Some(p) = self.find_batch(batch_id) else {
            return FAILED;
        };
        let r = *p.result.lock();
        match r {
            None => 0,
            Some(r) => {
                self.forget_batch(batch_id);
                if r == 0 { 1 } else { FAILED }
            }
        }
    }

    /// Allocates `length` zeroed bytes registered with this engine; their address, or 0.
    fn allocate_managed_buffer(&self, py: Python<'_>, length: i128) -> u64 {
        let Some(a) = self.active() else {
            return 0;
        };
        let Ok(len) = usize::try_from(length) else {
            return 0;
        };
        if len == 0 {
            return 0;
        }
        detached(py, 0, move || match a.registry.alloc(len) {
            Ok(r) => {
                let addr = r.addr();
                a.managed.lock().insert(addr, r);
                addr
            }
            Err(e) => {
                tracing::error!("lunakv: allocate_managed_buffer({len}): {e}");
                0
            }
        })
    }

    /// Frees a buffer from `allocate_managed_buffer`. 0, or -1 if it is not one.
    fn free_managed_buffer(&self, py: Python<'_>, buffer_addr: i128, length: i128) -> i64 {
        let _ = length;
        let Some(a) = self.active() else {
            return FAILED;
        };
        let Ok(addr) = u64::try_from(buffer_addr) else {
            return FAILED;
        };
        detached(py, FAILED, move || {
            let r = a.managed.lock().remove(&addr);
            match r {
                Some(r) => {
                    drop(r);
                    0
                }
                None => FAILED,
            }
        })
    }

    /// Copies `length` bytes of `src` to `dest_address` (upstream's helper). 0 or -1.
    fn write_bytes_to_buffer(&self, dest_address: i128, src: &[u8], length: i128) -> i64 {
        let r = match Range::new(dest_address, length) {
            Ok(r) if r.len <= src.len() => r,
            _ => return ERR_INVALID_ARGUMENT,
        };
        // SAFETY: the caller promises `dest_address` is `length` writable bytes, host or device
        // (upstream's contract); `src` is a Python bytes object, which cannot overlap caller
        // memory it wrote through a raw pointer.
        match unsafe { lunakv_transfer::device::write_to(r.ptr, &src[..r.len]) } {
            Ok(()) => 0,
            Err(e) => {
                tracing::error!("lunakv: write_bytes_to_buffer: {e}");
                FAILED
            }
        }
    }

    /// `length` bytes at `source_address` (upstream's helper); `b""` for a bad pointer/size.
    fn read_bytes_from_buffer<'py>(
        &self,
        py: Python<'py>,
        source_address: i128,
        length: i128,
    ) -> Bound<'py, PyBytes> {
        match Range::new(source_address, length) {
            Ok(r) => {
                let mut v = vec![0u8; r.len];
                // SAFETY: the caller promises `length` readable bytes (host or device) there.
                match unsafe { lunakv_transfer::device::read_from(r.ptr, &mut v) } {
                    Ok(()) => PyBytes::new(py, &v),
                    Err(e) => {
                        tracing::error!("lunakv: read_bytes_from_buffer: {e}");
                        PyBytes::new(py, b"")
                    }
                }
            }
            Err(msg) => {
                tracing::error!("lunakv: read_bytes_from_buffer refused: {msg}");
                PyBytes::new(py, b"")
            }
        }
    }

    /// lunakv: stops serving and deregisters everything (also done when the object is freed).
    fn shutdown(&self, py: Python<'_>) -> i64 {
        let old = self.active.write().take();
        detached(py, FAILED, move || {
            drop(old);
            0
        })
    }

    /// lunakv test hook: identity of the process-wide transfer engine this object moves bytes
    /// with (see `MooncakeDistributedStore._transfer_engine_id`). 0 before initialize.
    fn _transfer_engine_id(&self) -> usize {
        self.active().map_or(0, |a| crate::shared::id(&a.engine))
    }

    /// lunakv: the region server's counters, `{bytes_written, bytes_read, writes, reads,
    /// out_of_bounds}` (empty before initialize).
    fn _stats(&self) -> HashMap<&'static str, u64> {
        let Some(a) = self.active() else {
            return HashMap::new();
        };
        let s = a.server.stats();
        HashMap::from([
            ("bytes_written", s.bytes_written),
            ("bytes_read", s.bytes_read),
            ("writes", s.writes),
            ("reads", s.reads),
            ("out_of_bounds", s.out_of_bounds),
        ])
    }
}

/// Upstream delivers a `TransferNotify` to the peer after the transfer; lunakv has no
/// notification channel, so a transfer that asks for one fails (-1, one error line) instead of
/// moving the bytes and leaving the peer waiting for a notification that never comes.
fn refuse_notify(call: &str, notify: Option<&Bound<'_, PyAny>>) -> bool {
    if notify.is_none_or(|n| n.is_none()) {
        return false;
    }
    tracing::error!(
        "lunakv: {call} refused: notify is not supported (lunakv has no notification channel, the peer would never receive it); pass notify=None and signal the peer another way"
    );
    true
}
