//! `setup`: its arguments (positional or a config dict), the client options they make, the
//! bounded wait for a master, connecting, and closing every client at interpreter exit.

use std::sync::Arc;
use std::time::Duration;

use lunakv_client::{ClientOptions, MasterWait, StoreClient, tenant_or_default};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::handle::MooncakeDistributedStore;
use crate::call::{INTERNAL_ERROR, code, detached};
use crate::host::{ResolveError, env, resolve_ip, strip_port};
use crate::mem::INVALID_PARAMS;

/// Upstream's setup defaults (16 MiB each).
pub(super) const DEFAULT_SETUP_SIZE: i128 = 16 << 20;
/// How long `setup` waits for a master that is not reachable yet, unless
/// `LUNAKV_SETUP_WAIT_SEC` says otherwise. Upstream's setup retries its connection a few times
/// (its RPC client pool: 3 attempts about 1 s apart) and fails; engines started together with
/// the master (one rollout) need longer than that.
const DEFAULT_SETUP_WAIT: Duration = Duration::from_secs(30);
/// The variable that bounds the wait (seconds, 0 = fail on the first attempt).
const SETUP_WAIT_ENV: &str = "LUNAKV_SETUP_WAIT_SEC";

/// The wait for the master `setup` makes: [`SETUP_WAIT_ENV`], else [`DEFAULT_SETUP_WAIT`].
fn setup_wait(env: &dyn Fn(&str) -> Option<String>) -> MasterWait {
    let Some(v) = env(SETUP_WAIT_ENV).filter(|v| !v.trim().is_empty()) else {
        return MasterWait::AtMost(DEFAULT_SETUP_WAIT);
    };
    match v.trim().parse::<f64>() {
        Ok(s) if s.is_finite() && s >= 0.0 => MasterWait::AtMost(Duration::from_secs_f64(s)),
        _ => {
            tracing::warn!(
                "lunakv: {SETUP_WAIT_ENV}={v:?} is not a number of seconds; waiting up to {} s \
                 for the master",
                DEFAULT_SETUP_WAIT.as_secs()
            );
            MasterWait::AtMost(DEFAULT_SETUP_WAIT)
        }
    }
}

/// The variables that bound the layer-wise sessions' staged state (keys, bytes, idle seconds).
const SESSION_MAX_KEYS_ENV: &str = "LUNAKV_SESSION_MAX_KEYS";
const SESSION_MAX_BYTES_ENV: &str = "LUNAKV_SESSION_MAX_BYTES";
const SESSION_IDLE_ENV: &str = "LUNAKV_SESSION_IDLE_SEC";

/// Applies the session bounds the environment sets; a value that does not parse keeps the
/// default, with a warning naming it.
fn session_bounds(opts: &mut ClientOptions, env: &dyn Fn(&str) -> Option<String>) {
    let get = |name: &str| {
        env(name)
            .map(|v| v.trim().to_owned())
            .filter(|v| !v.is_empty())
    };
    let bad = |name: &str, v: &str| {
        tracing::warn!("lunakv: {name}={v:?} does not parse; keeping the default");
    };
    if let Some(v) = get(SESSION_MAX_KEYS_ENV) {
        match v.parse::<usize>() {
            Ok(n) => opts.session_max_keys = n,
            Err(_) => bad(SESSION_MAX_KEYS_ENV, &v),
        }
    }
    if let Some(v) = get(SESSION_MAX_BYTES_ENV) {
        match lunakv_config::parse_size(&v) {
            Ok(n) => opts.session_max_bytes = n,
            Err(_) => bad(SESSION_MAX_BYTES_ENV, &v),
        }
    }
    if let Some(v) = get(SESSION_IDLE_ENV) {
        match v.parse::<f64>() {
            Ok(s) if s.is_finite() && s > 0.0 => {
                opts.session_idle_timeout = Duration::from_secs_f64(s);
            }
            _ => bad(SESSION_IDLE_ENV, &v),
        }
    }
}

/// A key that never exists; `health_check` asks the master about it.
pub(super) const HEALTH_KEY: &str = "__lunakv_health_check__";

/// Every client set up in this process, so [`close_all`] can close them at interpreter exit.
static LIVE: parking_lot::Mutex<Vec<std::sync::Weak<StoreClient>>> =
    parking_lot::Mutex::new(Vec::new());

/// Closes every client still open (registered with `atexit` by the module), so an engine that
/// exits without `close()` unmounts its segment at once instead of when the master's client
/// TTL runs out, as upstream's resource tracker does.
#[pyfunction]
#[pyo3(name = "_close_all")]
pub fn close_all(py: Python<'_>) {
    let live: Vec<Arc<StoreClient>> = LIVE.lock().drain(..).filter_map(|w| w.upgrade()).collect();
    detached(py, (), move || {
        for c in live {
            if let Err(e) = c.close() {
                tracing::warn!("lunakv: close at exit: {e}");
            }
        }
    });
}

/// What `setup` needs, from its positional form or from its config-dict form.
pub(super) struct SetupArgs {
    pub(super) local_hostname: String,
    pub(super) global_segment_size: i128,
    pub(super) local_buffer_size: i128,
    pub(super) protocol: String,
    pub(super) master_server_addr: String,
    /// Upstream's `tenant_id` (empty or `"default"`: the default tenant).
    pub(super) tenant_id: String,
}

impl MooncakeDistributedStore {
    /// Builds the options, connects (GIL released) and installs the client. Returns 0 or a
    /// negative code; the reason goes to the log.
    pub(super) fn connect(&self, py: Python<'_>, a: SetupArgs) -> i64 {
        let opts = match options(&a) {
            Ok(o) => o,
            Err(msg) => {
                tracing::error!("lunakv: setup refused: {msg}");
                return INVALID_PARAMS;
            }
        };
        self.install(py, opts)
    }

    pub(super) fn install(&self, py: Python<'_>, mut opts: ClientOptions) -> i64 {
        // A master not reachable yet (started in the same rollout) is waited for, boundedly:
        // setup still returns a code, now after the wait (RPC_FAIL when it never answered).
        // Refusals and malformed addresses return at once.
        opts.master_wait = setup_wait(&lunakv_config::process_env);
        session_bounds(&mut opts, &lunakv_config::process_env);
        // A second setup replaces the first client, as upstream re-creates its client. The lock
        // is released before the GIL is: no lock is ever held across `detached`.
        let old = self.client.write().take();
        if let Some(old) = old {
            detached(py, (), move || drop(old.close()));
        }
        let hostname = opts.local_hostname.clone();
        let connected = detached(py, Err(None), move || {
            let engine = if opts.protocol == "rdma" {
                crate::shared::engine_for_rdma(opts.enable_shm)
            } else {
                crate::shared::engine(opts.enable_shm)
            };
            let c = StoreClient::connect_with_engine(opts, engine).map_err(Some)?;
            // A requester's connect makes no RPC, so a peer that accepts TCP but never answers
            // would pass. Upstream's setup talks to the master; so does this one: one
            // existence query, bounded by the client's RPC timeout.
            match c.exists(HEALTH_KEY) {
                Ok(_) => Ok(c),
                Err(e) => {
                    let _ = c.close();
                    Err(Some(e))
                }
            }
        });
        match connected {
            Ok(c) => {
                *self.hostname.write() = c.segment_name().unwrap_or(hostname);
                let c = Arc::new(c);
                {
                    let mut live = LIVE.lock();
                    live.retain(|w| w.strong_count() > 0);
                    live.push(Arc::downgrade(&c));
                }
                *self.client.write() = Some(c);
                0
            }
            Err(Some(e)) => {
                tracing::error!("lunakv: setup failed: {e}");
                code(&e)
            }
            Err(None) => INTERNAL_ERROR,
        }
    }
}

/// Why setup refused its arguments (logged; setup returns -600).
#[derive(Debug, thiserror::Error)]
pub(super) enum SetupError {
    #[error("config key '{key}': {source}")]
    Key { key: String, source: PyErr },
    #[error("config key '{key}': {source}")]
    Size {
        key: String,
        source: lunakv_config::SizeError,
    },
    #[error("{field} {value} must be >= 0")]
    Negative { field: &'static str, value: i128 },
    #[error(
        "local_hostname is empty (and MOONCAKE_LOCAL_HOSTNAME / VLLM_HOST_IP are unset): pass this host's IP"
    )]
    NoHostname,
    #[error(transparent)]
    Resolve(#[from] ResolveError),
}

pub(super) fn setup_args_from_dict(d: &Bound<'_, PyDict>) -> Result<SetupArgs, SetupError> {
    let key_err = |k: &str, source| SetupError::Key {
        key: k.to_string(),
        source,
    };
    let get = |k: &str| -> Result<Option<String>, SetupError> {
        match d.get_item(k) {
            Ok(Some(v)) if !v.is_none() => v
                .str()
                .map(|s| Some(s.to_string()))
                .map_err(|e| key_err(k, e)),
            Ok(_) => Ok(None),
            Err(e) => Err(key_err(k, e)),
        }
    };
    let size = |k: &str| -> Result<i128, SetupError> {
        match get(k)? {
            None => Ok(DEFAULT_SETUP_SIZE),
            Some(s) => lunakv_config::parse_size(&s)
                .map(i128::from)
                .map_err(|source| SetupError::Size {
                    key: k.to_string(),
                    source,
                }),
        }
    };
    for k in ["enable_offload", "enable_ssd_offload"] {
        if get(k)?.is_some_and(|v| matches!(v.to_ascii_lowercase().as_str(), "true" | "1")) {
            warn_ignored_offload(k);
        }
    }
    if let Some(p) = get("ipc_socket_path")?.filter(|p| !p.is_empty()) {
        tracing::warn!(
            "lunakv: ipc_socket_path={p:?} is ignored: a requester finds its store's shm socket through the master"
        );
    }
    Ok(SetupArgs {
        local_hostname: get("local_hostname")?.unwrap_or_default(),
        global_segment_size: size("global_segment_size")?,
        local_buffer_size: size("local_buffer_size")?,
        protocol: get("protocol")?.unwrap_or_else(|| "tcp".to_owned()),
        master_server_addr: get("master_server_addr")?
            .or(get("master_server_address")?)
            .unwrap_or_else(|| "127.0.0.1:50051".to_owned()),
        tenant_id: tenant_or_default(&get("tenant_id")?.unwrap_or_default()),
    })
}

pub(super) fn warn_ignored_offload(key: &str) {
    tracing::warn!(
        "lunakv: {key} is ignored in setup; the SSD tier runs on lunakv-store (--enable_offload, docs/OFFLOAD.md)"
    );
}

/// `ClientOptions` from setup's arguments plus the environment lunakv honours.
pub(super) fn options(a: &SetupArgs) -> Result<ClientOptions, SetupError> {
    let global_segment_size =
        u64::try_from(a.global_segment_size).map_err(|_| SetupError::Negative {
            field: "global_segment_size",
            value: a.global_segment_size,
        })?;
    let local_buffer_size =
        u64::try_from(a.local_buffer_size).map_err(|_| SetupError::Negative {
            field: "local_buffer_size",
            value: a.local_buffer_size,
        })?;
    let defaults = ClientOptions::default();
    let host = Some(a.local_hostname.trim().to_owned())
        .filter(|h| !h.is_empty())
        .or_else(|| env("MOONCAKE_REQUESTER_LOCAL_HOSTNAME"))
        .or_else(|| env("MOONCAKE_LOCAL_HOSTNAME"))
        .or_else(|| env("VLLM_HOST_IP"))
        .ok_or(SetupError::NoHostname)?;
    let local_hostname = if global_segment_size > 0 {
        resolve_ip(&host)?.to_string()
    } else {
        strip_port(&host).to_owned()
    };
    let enable_shm = match env("LUNAKV_DISABLE_SHM").map(|v| v.to_ascii_lowercase()) {
        None => true,
        Some(v) if matches!(v.as_str(), "0" | "false" | "no" | "off") => true,
        Some(_) => false,
    };
    Ok(ClientOptions {
        master_server_address: a.master_server_addr.trim().to_owned(),
        local_hostname,
        global_segment_size,
        // Upstream allows 0 ("pure server"); lunakv has no staging buffer, so any value works.
        local_buffer_size: if local_buffer_size == 0 {
            defaults.local_buffer_size
        } else {
            local_buffer_size
        },
        protocol: a.protocol.trim().to_ascii_lowercase(),
        enable_shm,
        preferred_segment: env("MOONCAKE_PREFERRED_SEGMENT"),
        tenant_id: a.tenant_id.clone(),
        ..defaults
    })
}
