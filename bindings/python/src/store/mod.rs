//! `MooncakeDistributedStore`: upstream's Python class over `StoreClient`. Here its Python
//! methods, which pyo3 takes as one `#[pymethods]` block; the handle in `handle.rs`, `setup`'s
//! arguments and connection in `setup.rs`, and what the methods share in `calls.rs`.

use lunakv_client::{ClientError, ClientOptions, tenant_or_default};
use parking_lot::RwLock;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::call::{INTERNAL_ERROR, code, count_code, detached, scatter, unit_code};
use crate::host::{env, strip_port};
use crate::mem::{INVALID_PARAMS, PyInt, Range, disjoint};
use crate::types::{ReplicaDescriptor, ReplicateConfig};

mod calls;
mod handle;
mod setup;

pub use handle::MooncakeDistributedStore;
pub use setup::close_all;

use calls::{buffer_handle, multi_ranges, offset_ranges, single_ranges, warn_session_limit};
use setup::{
    DEFAULT_SETUP_SIZE, HEALTH_KEY, SetupArgs, options, setup_args_from_dict, warn_ignored_offload,
};

#[pymethods]
impl MooncakeDistributedStore {
    #[new]
    fn py_new() -> Self {
        MooncakeDistributedStore {
            client: RwLock::new(None),
            hostname: RwLock::new(String::new()),
        }
    }

    /// Connects to the master; in embedded mode (`global_segment_size > 0`) also serves this
    /// process's segment. Returns 0, or a negative code (the reason is logged). Also accepts
    /// upstream's single config-dict form: `setup({"local_hostname": ..., ...})`.
    #[pyo3(signature = (
        local_hostname,
        metadata_server = None,
        global_segment_size = DEFAULT_SETUP_SIZE,
        local_buffer_size = DEFAULT_SETUP_SIZE,
        protocol = None,
        rdma_devices = None,
        master_server_addr = None,
        engine = None,
        enable_ssd_offload = false,
        ssd_offload_path = None,
        tenant_id = None,
        enable_client_http_server = false,
        client_http_port = 9300,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn setup(
        &self,
        py: Python<'_>,
        local_hostname: &Bound<'_, PyAny>,
        metadata_server: Option<String>,
        global_segment_size: i128,
        local_buffer_size: i128,
        protocol: Option<String>,
        rdma_devices: Option<String>,
        master_server_addr: Option<String>,
        engine: Option<&Bound<'_, PyAny>>,
        enable_ssd_offload: bool,
        ssd_offload_path: Option<String>,
        tenant_id: Option<String>,
        enable_client_http_server: bool,
        client_http_port: i64,
    ) -> PyResult<i64> {
        // Accepted for signature compatibility. lunakv's master is its own metadata service,
        // transfers need no device list, and the SSD tier is configured on lunakv-store.
        let _ = (metadata_server, rdma_devices, engine, ssd_offload_path);
        let _ = (enable_client_http_server, client_http_port);
        if enable_ssd_offload {
            warn_ignored_offload("enable_ssd_offload");
        }
        if let Ok(dict) = local_hostname.cast::<PyDict>() {
            return Ok(match setup_args_from_dict(dict) {
                Ok(a) => self.connect(py, a),
                Err(msg) => {
                    tracing::error!("lunakv: setup refused: {msg}");
                    INVALID_PARAMS
                }
            });
        }
        let a = SetupArgs {
            local_hostname: local_hostname.extract()?,
            global_segment_size,
            local_buffer_size,
            protocol: protocol.unwrap_or_else(|| "tcp".to_owned()),
            master_server_addr: master_server_addr.unwrap_or_else(|| "127.0.0.1:50051".to_owned()),
            tenant_id: tenant_or_default(tenant_id.as_deref().unwrap_or_default()),
        };
        Ok(self.connect(py, a))
    }

    /// lunakv extension: setup from the mooncake_config.json named by `MOONCAKE_CONFIG_PATH`,
    /// with the environment overrides vLLM and Mooncake honour (MOONCAKE_MASTER,
    /// MOONCAKE_LOCAL_HOSTNAME, MOONCAKE_PREFERRED_SEGMENT, ...). Returns 0 or a negative code.
    fn setup_from_env(&self, py: Python<'_>) -> i64 {
        let loaded = match lunakv_config::MooncakeConfig::load_from_env(&lunakv_config::process_env)
        {
            Ok(l) => l,
            Err(e) => {
                tracing::error!("lunakv: setup_from_env: {e}");
                return INVALID_PARAMS;
            }
        };
        for w in &loaded.warnings {
            tracing::warn!("lunakv: {w}");
        }
        match ClientOptions::from_mooncake_config(&loaded.config) {
            Ok(opts) => self.install(py, opts),
            Err(e) => {
                tracing::error!("lunakv: setup_from_env: {e}");
                code(&e)
            }
        }
    }

    /// lunakv test hook: identity of the transfer engine this client moves bytes with (equal to
    /// `TransferEngine._transfer_engine_id()` when the two modules share one). 0 before setup.
    fn _transfer_engine_id(&self) -> usize {
        self.client().map_or(0, |c| crate::shared::id(c.engine()))
    }

    /// lunakv: `{"requested", "effective", "reason", "display"}` of the protocol setup was
    /// given (`None` before setup). "rdma" where this build or machine has none serves "tcp";
    /// `display` is `tcp (rdma unavailable: <reason>)` as `lunakv status` shows it.
    fn _protocol_info(&self) -> Option<std::collections::HashMap<&'static str, String>> {
        self.client()
            .map(|c| crate::host::protocol_info(c.protocol()))
    }

    /// This client's address: its segment ("host:port") in embedded mode, else the hostname
    /// given to setup.
    fn get_hostname(&self) -> String {
        self.hostname.read().clone()
    }

    /// 0 healthy, 1 not set up or closed, 2 master unreachable (upstream's values).
    fn health_check(&self, py: Python<'_>) -> i64 {
        let Some(c) = self.client() else { return 1 };
        detached(py, 2, move || match c.exists(HEALTH_KEY) {
            Ok(_) => 0,
            Err(ClientError::Closed) => 1,
            Err(_) => 2,
        })
    }

    // === buffers ===

    /// Records a caller buffer. Returns 0, or -600 for a bad pointer/size or an overlap.
    #[pyo3(signature = (buffer_ptr, size))]
    fn register_buffer(&self, py: Python<'_>, buffer_ptr: i128, size: i128) -> i64 {
        let Some(c) = self.client() else {
            return INVALID_PARAMS;
        };
        let r = match Range::new(buffer_ptr, size) {
            Ok(r) => r,
            Err(msg) => {
                tracing::error!("lunakv: register_buffer refused: {msg}");
                return INVALID_PARAMS;
            }
        };
        detached(py, INTERNAL_ERROR, move || {
            match c.register_buffer(r.ptr, r.len) {
                Ok(()) => 0,
                Err(e) => {
                    tracing::error!("lunakv: register_buffer: {e}");
                    code(&e)
                }
            }
        })
    }

    #[pyo3(signature = (buffer_ptr))]
    fn unregister_buffer(&self, py: Python<'_>, buffer_ptr: i128) -> i64 {
        let Some(c) = self.client() else {
            return INVALID_PARAMS;
        };
        let Ok(ptr) = usize::try_from(buffer_ptr) else {
            return INVALID_PARAMS;
        };
        detached(py, INTERNAL_ERROR, move || match c.unregister_buffer(ptr) {
            Ok(()) => 0,
            Err(e) => code(&e),
        })
    }

    // === bytes in, bytes out ===

    /// Stores `value` (bytes, bytearray, memoryview, a numpy array: anything `bytes()` takes).
    #[pyo3(signature = (key, value, config = None))]
    fn put(
        &self,
        py: Python<'_>,
        key: String,
        value: &Bound<'_, PyAny>,
        config: Option<PyRef<'_, ReplicateConfig>>,
    ) -> i64 {
        self.put_values(
            py,
            vec![key],
            vec![vec![value.clone()]],
            config,
            false,
            "put",
        )
    }

    /// Stores several values; 0 if all were stored, else the first failure's code.
    #[pyo3(signature = (keys, values, config = None))]
    fn put_batch(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        values: Vec<Bound<'_, PyAny>>,
        config: Option<PyRef<'_, ReplicateConfig>>,
    ) -> i64 {
        self.put_values(
            py,
            keys,
            values.into_iter().map(|v| vec![v]).collect(),
            config,
            false,
            "put_batch",
        )
    }

    /// LMCache's save path: one object made of `parts` (each bytes-like), in order. 0 or a
    /// negative code.
    #[pyo3(signature = (key, *parts, config = None))]
    fn put_parts(
        &self,
        py: Python<'_>,
        key: String,
        parts: Vec<Bound<'_, PyAny>>,
        config: Option<PyRef<'_, ReplicateConfig>>,
    ) -> i64 {
        self.put_values(py, vec![key], vec![parts], config, false, "put_parts")
    }

    /// Upstream's `upsert_parts`: `put_parts` that replaces what `key` holds. 0 or a negative
    /// code.
    #[pyo3(signature = (key, *parts, config = None))]
    fn upsert_parts(
        &self,
        py: Python<'_>,
        key: String,
        parts: Vec<Bound<'_, PyAny>>,
        config: Option<PyRef<'_, ReplicateConfig>>,
    ) -> i64 {
        self.put_values(py, vec![key], vec![parts], config, true, "upsert_parts")
    }

    /// SGLang's standalone storage (`standalone_storage`): upstream's "dummy" client hands
    /// every call to a real client process at `server_address`. lunakv has no such split:
    /// this process talks to the master itself and moves bytes over shared memory with the
    /// store on its host. So the master comes from the engine's Mooncake config
    /// (`MOONCAKE_MASTER`, or `master_server_address` in `MOONCAKE_CONFIG_PATH`'s file), and
    /// the lunakv-store at `server_address` (its transfer address, default port 50052 like
    /// upstream's real client) is where puts land first. Pool memory comes from
    /// `MooncakeHostMemAllocator`. 0, or INVALID_PARAMS with the reason logged.
    fn setup_dummy(
        &self,
        py: Python<'_>,
        mem_pool_size: i128,
        local_buffer_size: i128,
        server_address: String,
    ) -> i64 {
        let _ = mem_pool_size;
        let master = env("MOONCAKE_MASTER").or_else(|| {
            lunakv_config::MooncakeConfig::load_from_env(&lunakv_config::process_env)
                .ok()
                .map(|l| l.config.master_server_address)
                .filter(|m| !m.is_empty())
        });
        let Some(master) = master else {
            tracing::error!(
                "lunakv: setup_dummy refused: lunakv has no dummy client, so this process reaches \
                 the master itself; set MOONCAKE_MASTER (or master_server_address in the file \
                 MOONCAKE_CONFIG_PATH names). The store at {server_address} is then the \
                 preferred segment"
            );
            return INVALID_PARAMS;
        };
        let a = SetupArgs {
            local_hostname: strip_port(server_address.trim()).to_owned(),
            global_segment_size: 0,
            local_buffer_size,
            protocol: "tcp".to_owned(),
            master_server_addr: master,
            tenant_id: tenant_or_default(&env("MOONCAKE_TENANT_ID").unwrap_or_default()),
        };
        let mut opts = match options(&a) {
            Ok(o) => o,
            Err(msg) => {
                tracing::error!("lunakv: setup_dummy refused: {msg}");
                return INVALID_PARAMS;
            }
        };
        opts.preferred_segment = Some(server_address.trim().to_owned());
        self.install(py, opts)
    }

    /// Upstream calls lunakv does not implement raise `AttributeError` naming them and the
    /// alternative ([`crate::upstream`]); any other unknown name is Python's usual error.
    fn __getattr__(&self, name: &str) -> PyResult<Py<PyAny>> {
        Err(pyo3::exceptions::PyAttributeError::new_err(
            crate::upstream::refusal(name).unwrap_or_else(|| {
                format!("'MooncakeDistributedStore' object has no attribute '{name}'")
            }),
        ))
    }

    /// Upstream's `get_buffer` (LMCache's load path): the object as a `BufferHandle` (a
    /// `bytearray` with upstream's `ptr()` and `size()`), or `None` if it is missing or the read
    /// failed.
    fn get_buffer<'py>(&self, py: Python<'py>, key: String) -> PyResult<Bound<'py, PyAny>> {
        let mut got = self.batch_get_buffer(py, vec![key])?;
        Ok(got.pop().unwrap_or_else(|| py.None().into_bound(py)))
    }

    /// One `BufferHandle` per key, `None` for each missing one. The bytes are copied once, from
    /// the transfer's buffer into the handle (not through a `bytes` first).
    fn batch_get_buffer<'py>(
        &self,
        py: Python<'py>,
        keys: Vec<String>,
    ) -> PyResult<Vec<Bound<'py, PyAny>>> {
        let n = keys.len();
        let got: Vec<Option<Vec<u8>>> = match self.client() {
            None => vec![None; n],
            Some(c) => detached(py, vec![None; n], move || {
                let ks: Vec<&str> = keys.iter().map(String::as_str).collect();
                c.batch_get(&ks).into_iter().map(Result::ok).collect()
            }),
        };
        got.iter()
            .map(|v| buffer_handle(py, v.as_deref()))
            .collect()
    }

    // === upstream's upsert family: put, replacing what the key holds ===

    /// As `put`, but an existing object under `key` is replaced (upstream's upsert): 0 or a
    /// negative code (-705 while another put of the key is in progress).
    #[pyo3(signature = (key, value, config = None))]
    fn upsert(
        &self,
        py: Python<'_>,
        key: String,
        value: &Bound<'_, PyAny>,
        config: Option<PyRef<'_, ReplicateConfig>>,
    ) -> i64 {
        self.put_values(
            py,
            vec![key],
            vec![vec![value.clone()]],
            config,
            true,
            "upsert",
        )
    }

    /// As `put_batch`, replacing existing objects.
    #[pyo3(signature = (keys, values, config = None))]
    fn upsert_batch(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        values: Vec<Bound<'_, PyAny>>,
        config: Option<PyRef<'_, ReplicateConfig>>,
    ) -> i64 {
        self.put_values(
            py,
            keys,
            values.into_iter().map(|v| vec![v]).collect(),
            config,
            true,
            "upsert_batch",
        )
    }

    /// As `put_from`, replacing an existing object.
    #[pyo3(signature = (key, buffer_ptr, size, config = None))]
    fn upsert_from(
        &self,
        py: Python<'_>,
        key: String,
        buffer_ptr: i128,
        size: i128,
        config: Option<PyRef<'_, ReplicateConfig>>,
    ) -> i64 {
        let r = Range::new(buffer_ptr, size).map(|r| vec![r]);
        self.put_ranges(py, vec![key], vec![r], config, true)[0]
    }

    /// As `batch_put_from`, replacing existing objects; one result per key.
    #[pyo3(signature = (keys, buffer_ptrs, sizes, config = None))]
    fn batch_upsert_from(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        buffer_ptrs: Vec<PyInt>,
        sizes: Vec<PyInt>,
        config: Option<PyRef<'_, ReplicateConfig>>,
    ) -> Vec<i64> {
        match single_ranges(keys.len(), &buffer_ptrs, &sizes) {
            Some(r) => self.put_ranges(py, keys, r, config, true),
            None => vec![INVALID_PARAMS; keys.len()],
        }
    }

    /// The object's bytes, or `b""` if it is missing or the read failed.
    fn get<'py>(&self, py: Python<'py>, key: String) -> Bound<'py, PyBytes> {
        let got = match self.client() {
            None => None,
            Some(c) => detached(py, None, move || match c.get(&key) {
                Ok(v) => Some(v),
                Err(e) => {
                    tracing::debug!("lunakv: get failed: {e}");
                    None
                }
            }),
        };
        PyBytes::new(py, got.as_deref().unwrap_or_default())
    }

    /// One `bytes` per key (`b""` for each missing one).
    fn get_batch<'py>(&self, py: Python<'py>, keys: Vec<String>) -> Vec<Bound<'py, PyBytes>> {
        let n = keys.len();
        let got: Vec<Option<Vec<u8>>> = match self.client() {
            None => vec![None; n],
            Some(c) => detached(py, vec![None; n], move || {
                let ks: Vec<&str> = keys.iter().map(String::as_str).collect();
                c.batch_get(&ks).into_iter().map(Result::ok).collect()
            }),
        };
        got.iter()
            .map(|v| PyBytes::new(py, v.as_deref().unwrap_or_default()))
            .collect()
    }

    // === caller buffers by pointer ===

    /// Stores `size` bytes at `buffer_ptr`. Returns 0 or a negative code.
    #[pyo3(signature = (key, buffer_ptr, size, config = None))]
    fn put_from(
        &self,
        py: Python<'_>,
        key: String,
        buffer_ptr: i128,
        size: i128,
        config: Option<PyRef<'_, ReplicateConfig>>,
    ) -> i64 {
        let r = Range::new(buffer_ptr, size).map(|r| vec![r]);
        self.put_ranges(py, vec![key], vec![r], config, false)[0]
    }

    /// Reads the object into `buffer_ptr` (capacity `size`). Returns the bytes read, or a
    /// negative code (-704 missing, -10 buffer too small, -600 bad pointer/size).
    #[pyo3(signature = (key, buffer_ptr, size))]
    fn get_into(&self, py: Python<'_>, key: String, buffer_ptr: i128, size: i128) -> i64 {
        let r = Range::new(buffer_ptr, size).map(|r| vec![r]);
        self.get_ranges(py, vec![key], vec![r])[0]
    }

    #[pyo3(signature = (keys, buffer_ptrs, sizes, config = None))]
    fn batch_put_from(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        buffer_ptrs: Vec<PyInt>,
        sizes: Vec<PyInt>,
        config: Option<PyRef<'_, ReplicateConfig>>,
    ) -> Vec<i64> {
        match single_ranges(keys.len(), &buffer_ptrs, &sizes) {
            Some(r) => self.put_ranges(py, keys, r, config, false),
            None => vec![INVALID_PARAMS; keys.len()],
        }
    }

    #[pyo3(signature = (keys, buffer_ptrs, sizes))]
    fn batch_get_into(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        buffer_ptrs: Vec<PyInt>,
        sizes: Vec<PyInt>,
    ) -> Vec<i64> {
        match single_ranges(keys.len(), &buffer_ptrs, &sizes) {
            Some(r) => self.get_ranges(py, keys, r),
            None => vec![INVALID_PARAMS; keys.len()],
        }
    }

    /// vLLM's save path: object `i` is the concatenation of the pieces
    /// `all_buffer_ptrs[i][j]` / `all_sizes[i][j]` (one per layer). One result per key.
    #[pyo3(signature = (keys, all_buffer_ptrs, all_sizes, config = None))]
    fn batch_put_from_multi_buffers(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        all_buffer_ptrs: Vec<Vec<PyInt>>,
        all_sizes: Vec<Vec<PyInt>>,
        config: Option<PyRef<'_, ReplicateConfig>>,
    ) -> Vec<i64> {
        match multi_ranges(keys.len(), &all_buffer_ptrs, &all_sizes) {
            Some(r) => self.put_ranges(py, keys, r, config, false),
            None => vec![INVALID_PARAMS; keys.len()],
        }
    }

    /// vLLM's load path: scatters object `i` over its pieces in order. Returns the bytes read
    /// per key, or a negative code. `prefer_alloc_in_same_node` is accepted (lunakv always
    /// prefers a same-host replica).
    #[pyo3(signature = (keys, all_buffer_ptrs, all_sizes, prefer_alloc_in_same_node = false))]
    fn batch_get_into_multi_buffers(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        all_buffer_ptrs: Vec<Vec<PyInt>>,
        all_sizes: Vec<Vec<PyInt>>,
        prefer_alloc_in_same_node: bool,
    ) -> Vec<i64> {
        let _ = prefer_alloc_in_same_node;
        match multi_ranges(keys.len(), &all_buffer_ptrs, &all_sizes) {
            Some(r) => self.get_ranges(py, keys, r),
            None => vec![INVALID_PARAMS; keys.len()],
        }
    }

    // === layer-wise sessions (upstream's session API) ===

    /// Reserves each object (PutStart) without moving bytes. One code per key: 0, or negative
    /// (-600 for a key whose put session is already open, -200 past the session bounds).
    #[pyo3(signature = (keys, sizes, config = None))]
    fn batch_put_session_start(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        sizes: Vec<PyInt>,
        config: Option<PyRef<'_, ReplicateConfig>>,
    ) -> Vec<i64> {
        let n = keys.len();
        let Some(c) = self.client() else {
            return vec![INVALID_PARAMS; n];
        };
        if sizes.len() != n {
            tracing::error!(
                "lunakv: batch_put_session_start refused: {n} keys but {} sizes",
                sizes.len()
            );
            return vec![INVALID_PARAMS; n];
        }
        let cfg = config.map(|c| c.to_client()).unwrap_or_default();
        detached(py, vec![INTERNAL_ERROR; n], move || {
            scatter(
                keys.iter().zip(&sizes),
                |(key, size)| match u64::try_from(size.0) {
                    Ok(s) => Ok((key.as_str(), s)),
                    Err(_) => {
                        tracing::error!(
                            "lunakv: put session of '{key}' refused: size {} is negative or too \
                             large",
                            size.0
                        );
                        Err(INVALID_PARAMS)
                    }
                },
                |items, _| {
                    let got = c.batch_put_session_start(&items, &cfg);
                    warn_session_limit("batch_put_session_start", &got);
                    got
                },
                |r| unit_code("put session start", r),
                || INVALID_PARAMS,
            )
        })
    }

    /// Writes ranges into objects whose put session is open: object `i` gets
    /// `all_sizes[i][j]` bytes from `all_buffer_ptrs[i][j]` at `all_dst_offsets[i][j]`. One
    /// result per key: the bytes written, or a negative code (-600 for a key with no open
    /// session or a range outside its object; nothing of that key is written).
    #[pyo3(signature = (keys, all_buffer_ptrs, all_sizes, all_dst_offsets))]
    fn batch_put_from_multi_buffer_ranges(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        all_buffer_ptrs: Vec<Vec<PyInt>>,
        all_sizes: Vec<Vec<PyInt>>,
        all_dst_offsets: Vec<Vec<PyInt>>,
    ) -> Vec<i64> {
        let n = keys.len();
        let Some(c) = self.client() else {
            return vec![INVALID_PARAMS; n];
        };
        let Some(ranges) = offset_ranges(n, &all_buffer_ptrs, &all_sizes, &all_dst_offsets) else {
            return vec![INVALID_PARAMS; n];
        };
        detached(py, vec![INTERNAL_ERROR; n], move || {
            scatter(
                keys.iter().zip(ranges),
                |(key, r)| match r {
                    // SAFETY: the caller promised these ranges are valid readable memory for
                    // the duration of this call (module docs); they were checked by Range::new.
                    Ok(parts) => Ok((
                        key.as_str(),
                        parts
                            .iter()
                            .map(|(o, p)| (*o, unsafe { p.slice() }))
                            .collect::<Vec<_>>(),
                    )),
                    Err(msg) => {
                        tracing::error!("lunakv: range put of '{key}' refused: {msg}");
                        Err(INVALID_PARAMS)
                    }
                },
                |items, _| c.batch_put_ranges(&items),
                |r| count_code("range put", r),
                || INVALID_PARAMS,
            )
        })
    }

    /// Writes each session's object to its replicas and publishes it (PutEnd). One code per
    /// key: 0, or negative (-600 without an open session; a failed end keeps the session for
    /// another end or a revoke).
    fn batch_put_session_end(&self, py: Python<'_>, keys: Vec<String>) -> Vec<i64> {
        self.per_key(py, keys, |c, ks| c.batch_put_session_end(ks), |()| 0)
    }

    /// Abandons each open put session (PutRevoke): the key can be put again. One code per key:
    /// 0, or negative (-600 without an open session).
    fn batch_put_session_revoke(&self, py: Python<'_>, keys: Vec<String>) -> Vec<i64> {
        self.per_key(py, keys, |c, ks| c.batch_put_session_revoke(ks), |()| 0)
    }

    /// Opens a get session per key (starting it again replaces it). One code per key: 0, or
    /// negative (-704 missing, -200 past the session bounds).
    fn batch_get_session_start(&self, py: Python<'_>, keys: Vec<String>) -> Vec<i64> {
        self.per_key(
            py,
            keys,
            |c, ks| {
                let got = c.batch_get_session_start(ks);
                warn_session_limit("batch_get_session_start", &got);
                got
            },
            |()| 0,
        )
    }

    /// Reads ranges of objects with an open get session: `all_sizes[i][j]` bytes at
    /// `all_src_offsets[i][j]` into `all_buffer_ptrs[i][j]`. One result per key: the bytes
    /// read, or a negative code (-600 for a key with no open session or a range outside its
    /// object).
    #[pyo3(signature = (keys, all_buffer_ptrs, all_sizes, all_src_offsets))]
    fn batch_get_into_multi_buffer_ranges(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        all_buffer_ptrs: Vec<Vec<PyInt>>,
        all_sizes: Vec<Vec<PyInt>>,
        all_src_offsets: Vec<Vec<PyInt>>,
    ) -> Vec<i64> {
        let n = keys.len();
        let Some(c) = self.client() else {
            return vec![INVALID_PARAMS; n];
        };
        let Some(ranges) = offset_ranges(n, &all_buffer_ptrs, &all_sizes, &all_src_offsets) else {
            return vec![INVALID_PARAMS; n];
        };
        if !disjoint(ranges.iter().flatten().flatten().map(|(_, r)| r)) {
            tracing::error!("lunakv: range get refused: destination buffers overlap each other");
            return vec![INVALID_PARAMS; n];
        }
        detached(py, vec![INTERNAL_ERROR; n], move || {
            scatter(
                keys.iter().zip(ranges),
                |(key, r)| match r {
                    // SAFETY: the caller promised these ranges are valid writable memory for
                    // the duration of this call; `disjoint` above proved no two of them overlap.
                    Ok(parts) => Ok((
                        key.as_str(),
                        parts
                            .iter()
                            .map(|(o, p)| (*o, unsafe { p.slice_mut() }))
                            .collect::<Vec<_>>(),
                    )),
                    Err(msg) => {
                        tracing::error!("lunakv: range get of '{key}' refused: {msg}");
                        Err(INVALID_PARAMS)
                    }
                },
                |mut items, _| c.batch_get_ranges(&mut items),
                |r| count_code("range get", r),
                || INVALID_PARAMS,
            )
        })
    }

    /// Drops the get sessions of `keys`. 0 (also for keys without one, as upstream).
    fn batch_get_session_end(&self, py: Python<'_>, keys: Vec<String>) -> i64 {
        let Some(c) = self.client() else {
            return INVALID_PARAMS;
        };
        detached(py, INTERNAL_ERROR, move || {
            let ks: Vec<&str> = keys.iter().map(String::as_str).collect();
            c.batch_get_session_end(&ks);
            0
        })
    }

    /// lunakv test hook: `(open put sessions, open get sessions, bytes they stage)`.
    fn _session_counts(&self) -> (usize, usize, u64) {
        self.client().map_or((0, 0, 0), |c| c.session_counts())
    }

    // === metadata ===

    /// 1 if the object exists, 0 if not, a negative code on failure.
    fn is_exist(&self, py: Python<'_>, key: String) -> i64 {
        self.batch_is_exist(py, vec![key])[0]
    }

    /// One of 1 / 0 / negative code per key (vLLM treats anything but 1 as missing).
    fn batch_is_exist(&self, py: Python<'_>, keys: Vec<String>) -> Vec<i64> {
        self.per_key(py, keys, |c, ks| c.batch_exists(ks), i64::from)
    }

    /// The object's size in bytes, or a negative code.
    fn get_size(&self, py: Python<'_>, key: String) -> i64 {
        let Some(c) = self.client() else {
            return INVALID_PARAMS;
        };
        detached(py, INTERNAL_ERROR, move || match c.get_size(&key) {
            Ok(n) => i64::try_from(n).unwrap_or(i64::MAX),
            Err(e) => code(&e),
        })
    }

    #[pyo3(signature = (key, force = false))]
    fn remove(&self, py: Python<'_>, key: String, force: bool) -> i64 {
        self.batch_remove(py, vec![key], force)[0]
    }

    #[pyo3(signature = (keys, force = false))]
    fn batch_remove(&self, py: Python<'_>, keys: Vec<String>, force: bool) -> Vec<i64> {
        self.per_key(py, keys, move |c, ks| c.batch_remove(ks, force), |()| 0)
    }

    /// Removes every object (leased ones too with `force`). Returns how many, or a negative code.
    #[pyo3(signature = (force = false))]
    fn remove_all(&self, py: Python<'_>, force: bool) -> i64 {
        let Some(c) = self.client() else {
            return INVALID_PARAMS;
        };
        detached(py, INTERNAL_ERROR, move || match c.remove_all(force) {
            Ok(n) => i64::try_from(n).unwrap_or(i64::MAX),
            Err(e) => code(&e),
        })
    }

    /// Removes every object whose key matches `regex` (Rust regex syntax, RE2-like; leased and
    /// in-progress ones too with `force`). Returns how many, or a negative code (-600 for a
    /// pattern that does not compile, with the reason in the log).
    #[pyo3(signature = (regex_pattern, force = false))]
    fn remove_by_regex(&self, py: Python<'_>, regex_pattern: String, force: bool) -> i64 {
        let Some(c) = self.client() else {
            return INVALID_PARAMS;
        };
        detached(py, INTERNAL_ERROR, move || {
            match c.remove_by_regex(&regex_pattern, force) {
                Ok(n) => i64::try_from(n).unwrap_or(i64::MAX),
                Err(e) => {
                    tracing::error!("lunakv: remove_by_regex failed: {e}");
                    code(&e)
                }
            }
        })
    }

    /// The replicas of one object (empty if it is missing).
    fn get_replica_desc(&self, py: Python<'_>, key: String) -> Vec<ReplicaDescriptor> {
        self.replicas(py, vec![key])
            .pop()
            .map(|(_, r)| r)
            .unwrap_or_default()
    }

    /// `{key: [ReplicaDescriptor, ...]}` for the keys that exist (missing keys are absent,
    /// as upstream).
    fn batch_get_replica_desc<'py>(
        &self,
        py: Python<'py>,
        keys: Vec<String>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (k, reps) in self.replicas(py, keys) {
            d.set_item(k, reps)?;
        }
        Ok(d)
    }

    /// Stops the client (in embedded mode, unmounts its segment). Returns 0 or a negative code;
    /// later calls return -600 until the next setup. Idempotent.
    fn close(&self, py: Python<'_>) -> i64 {
        let Some(c) = self.client.write().take() else {
            return 0;
        };
        detached(py, INTERNAL_ERROR, move || {
            let r = match c.close() {
                Ok(()) => 0,
                Err(e) => {
                    tracing::warn!("lunakv: close: {e}");
                    code(&e)
                }
            };
            // Drop the last reference (and the client's runtime) without the GIL.
            drop(c);
            r
        })
    }
}
