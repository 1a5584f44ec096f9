//! `mooncake_config.json`: the engine-side configuration, as vLLM's `MooncakeStoreConnector` reads it.
//!
//! ```json
//! {"mode": "embedded", "metadata_server": "P2PHANDSHAKE",
//!  "master_server_address": "127.0.0.1:50051", "global_segment_size": "80GB",
//!  "local_buffer_size": "4GB", "protocol": "tcp", "device_name": "", "enable_offload": false}
//! ```
//!
//! # Loading
//! [`MooncakeConfig::load_from_env`] is what an engine calls: the file named by
//! `MOONCAKE_CONFIG_PATH` (unset: vLLM's `The environment variable 'MOONCAKE_CONFIG_PATH' is not set.`),
//! then the environment overrides, then validation. [`MooncakeConfig::load`] does the same for a
//! given path, [`MooncakeConfig::from_json_str`] only parses.
//!
//! # Fields and defaults (vLLM's)
//! | field | default | notes |
//! |---|---|---|
//! | `mode` | `"embedded"` | or `"standalone-store"` |
//! | `master_server_address` | `""` | required; `host:port`, or `etcd://h1:2379;h2:2379` for an HA master |
//! | `metadata_server` | `""` | lunakv's master hosts metadata; anything but `""`/`P2PHANDSHAKE` warns |
//! | `protocol` | `"rdma"` | vLLM's default; `"tcp"` or `"rdma"` |
//! | `device_name` | `""` | RDMA device list |
//! | `global_segment_size` | 4 GiB | size: integer or `"80GB"` |
//! | `local_buffer_size` | 4 GiB | size |
//! | `enable_offload` | `false` | a JSON boolean only (the string `"false"` is an error) |
//! | `tenant_id` | `"default"` | |
//! | `local_hostname` | `""` | not read by vLLM (which uses its own IP); read by Mooncake's Python |
//! | `enable_shm` | `true` | lunakv only: same-host shared-memory transfers |
//! | `tls_cert`, `tls_key`, `tls_cacert` | `""` | lunakv only: mTLS to the master (PEM paths, relative to this file; docs/SECURITY.md) |
//!
//! `null` for any field means "use the default".
//!
//! # Environment (later rows win)
//! Upstream Mooncake uses its env variables *instead of* a file when MOONCAKE_CONFIG_PATH is unset;
//! vLLM requires the file. lunakv requires the file (vLLM's behaviour) and lets these variables
//! override its values, which is what a per-pod override in Kubernetes needs; each override of a
//! value the file set is reported as a [`ConfigWarning::EnvOverride`].
//! - `MOONCAKE_MASTER` -> master_server_address; `MOONCAKE_TE_META_DATA_SERVER` -> metadata_server;
//!   `MOONCAKE_GLOBAL_SEGMENT_SIZE`, `MOONCAKE_LOCAL_BUFFER_SIZE` -> sizes; `MOONCAKE_PROTOCOL`;
//!   `MOONCAKE_DEVICE` -> device_name; `MOONCAKE_PREFERRED_SEGMENT` -> preferred_segment (env only);
//!   `MOONCAKE_TENANT_ID` -> tenant_id.
//! - local_hostname: `MOONCAKE_REQUESTER_LOCAL_HOSTNAME` (vLLM's), else `MOONCAKE_LOCAL_HOSTNAME`,
//!   else the file, else `VLLM_HOST_IP` (vLLM's `get_ip()`), else `""` (the client picks an address).
//! - `LUNAKV_DISABLE_SHM=1` forces enable_shm off.
//! - `LUNAKV_TLS_CERT`, `LUNAKV_TLS_KEY`, `LUNAKV_TLS_CACERT` -> tls_cert, tls_key, tls_cacert
//!   ([`crate::tls`]).
//!
//! # Checks
//! In vLLM's order, with its messages: unknown mode; `local_buffer_size must be > 0`; embedded
//! requires global_segment_size > 0; standalone-store requires == 0. Then lunakv's: master address
//! set and `host:port`; preferred segment `host:port`. Type errors (strings where booleans belong,
//! bad sizes) are caught while parsing and name the field.
//!
//! # Unknown keys
//! Warned about, not refused: vLLM ignores them, the same file is shared with vLLM and other
//! readers (sglang, Mooncake's Python) that add their own keys, and refusing would break configs
//! that work upstream. The warning suggests the known key a typo most resembles.

use std::path::Path;

use serde::Serialize;
use serde_json::{Map, Value};

use crate::size::{parse_size, size_from_json_number};
use crate::{ConfigError, ConfigWarning, HostPort, Loaded, Protocol};

/// The environment variable naming the config file.
pub const CONFIG_PATH_ENV: &str = "MOONCAKE_CONFIG_PATH";
/// vLLM's default global_segment_size: 4 GiB.
pub const DEFAULT_GLOBAL_SEGMENT_SIZE: u64 = 4 << 30;
/// vLLM's default local_buffer_size: 4 GiB.
pub const DEFAULT_LOCAL_BUFFER_SIZE: u64 = 4 << 30;
/// The metadata server value meaning "peers exchange metadata directly".
pub const P2P_HANDSHAKE: &str = "P2PHANDSHAKE";

/// Keys of the schema, for unknown-key detection and suggestions.
const KNOWN_KEYS: &[&str] = &[
    "local_hostname",
    "metadata_server",
    "master_server_address",
    "protocol",
    "device_name",
    "mode",
    "global_segment_size",
    "local_buffer_size",
    "enable_offload",
    "tenant_id",
    "enable_shm",
    "tls_cert",
    "tls_key",
    "tls_cacert",
];

/// Who owns the DRAM pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize)]
pub enum Mode {
    /// Each engine rank contributes `global_segment_size` (> 0) of its own DRAM.
    #[default]
    #[serde(rename = "embedded")]
    Embedded,
    /// A `lunakv-store` owns the pool; engine ranks are pure requesters (`global_segment_size == 0`).
    #[serde(rename = "standalone-store")]
    StandaloneStore,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Embedded => "embedded",
            Mode::StandaloneStore => "standalone-store",
        }
    }
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Mode {
    type Err = ConfigError;
    /// Exact, case-sensitive names, as vLLM compares them.
    fn from_str(s: &str) -> Result<Self, ConfigError> {
        match s {
            "embedded" => Ok(Mode::Embedded),
            "standalone-store" => Ok(Mode::StandaloneStore),
            _ => Err(ConfigError::UnknownMode {
                mode: s.to_string(),
            }),
        }
    }
}

/// `mooncake_config.json`, resolved. Build one in code (`MooncakeConfig { .., ..Default::default() }`)
/// and call [`validate`](Self::validate), or load one with [`load_from_env`](Self::load_from_env).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MooncakeConfig {
    /// This process's address as peers should reach it; `""` = let the client pick.
    pub local_hostname: String,
    pub metadata_server: String,
    pub master_server_address: String,
    pub protocol: Protocol,
    pub device_name: String,
    pub mode: Mode,
    /// Bytes of DRAM this process contributes to the pool (0 = pure requester).
    pub global_segment_size: u64,
    /// Bytes of the staging buffer registered with the transfer engine.
    pub local_buffer_size: u64,
    pub enable_offload: bool,
    pub tenant_id: String,
    /// lunakv: map a same-host segment's memory instead of copying over tcp.
    pub enable_shm: bool,
    /// `MOONCAKE_PREFERRED_SEGMENT`: the segment (`host:port`) puts should land on. Env only.
    #[serde(skip)]
    pub preferred_segment: Option<String>,
    /// lunakv: the client certificate, its key and the CA for mTLS to the master (PEM paths;
    /// `LUNAKV_TLS_*` win; [`crate::tls`]).
    pub tls_cert: String,
    pub tls_key: String,
    pub tls_cacert: String,
}

impl Default for MooncakeConfig {
    fn default() -> Self {
        MooncakeConfig {
            local_hostname: String::new(),
            metadata_server: String::new(),
            master_server_address: String::new(),
            protocol: Protocol::Rdma,
            device_name: String::new(),
            mode: Mode::Embedded,
            global_segment_size: DEFAULT_GLOBAL_SEGMENT_SIZE,
            local_buffer_size: DEFAULT_LOCAL_BUFFER_SIZE,
            enable_offload: false,
            tenant_id: "default".to_string(),
            enable_shm: true,
            preferred_segment: None,
            tls_cert: String::new(),
            tls_key: String::new(),
            tls_cacert: String::new(),
        }
    }
}

impl MooncakeConfig {
    /// `MOONCAKE_CONFIG_PATH` -> [`load`](Self::load). Unset or empty:
    /// `The environment variable 'MOONCAKE_CONFIG_PATH' is not set.`
    pub fn load_from_env(
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Loaded<Self>, ConfigError> {
        let path = get(env, CONFIG_PATH_ENV).ok_or(ConfigError::EnvNotSet {
            var: CONFIG_PATH_ENV,
        })?;
        Self::load(Path::new(&path), env)
    }

    /// Reads and parses `path`, applies the environment overrides, validates.
    pub fn load(
        path: &Path,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Loaded<Self>, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let Loaded {
            mut config,
            mut warnings,
        } = Self::from_json_str(&text, &path.display().to_string())?;
        config.apply_env(env, &mut warnings)?;
        warnings.extend(config.validate()?);
        Ok(Loaded { config, warnings })
    }

    /// [`load`](Self::load) without any environment override.
    pub fn load_file(path: &Path) -> Result<Loaded<Self>, ConfigError> {
        Self::load(path, &|_| None)
    }

    /// Parses JSON text (no environment, no validation). `origin` names the source in messages
    /// (a path, or e.g. `"--config-json"`). Warnings: unknown and ignored keys.
    pub fn from_json_str(text: &str, origin: &str) -> Result<Loaded<Self>, ConfigError> {
        let value: Value = serde_json::from_str(text).map_err(|e| json_error(origin, &e))?;
        let Value::Object(map) = value else {
            return Err(ConfigError::NotAnObject {
                origin: origin.to_string(),
                found: json_kind(&value),
            });
        };
        Self::from_map(&map, origin)
    }

    fn from_map(map: &Map<String, Value>, origin: &str) -> Result<Loaded<Self>, ConfigError> {
        let mut c = MooncakeConfig::default();
        let mut warnings = Vec::new();
        // mode first: vLLM's first check is the mode.
        if let Some(mode) = string_field(map, "mode", "\"embedded\"")? {
            c.mode = mode.parse()?;
        }
        let strings: [(&str, &mut String, &'static str); 8] = [
            ("local_hostname", &mut c.local_hostname, "\"10.0.0.5\""),
            (
                "metadata_server",
                &mut c.metadata_server,
                "\"P2PHANDSHAKE\"",
            ),
            (
                "master_server_address",
                &mut c.master_server_address,
                "\"127.0.0.1:50051\"",
            ),
            ("device_name", &mut c.device_name, "\"\""),
            ("tenant_id", &mut c.tenant_id, "\"default\""),
            ("tls_cert", &mut c.tls_cert, "\"/etc/lunakv/tls/tls.crt\""),
            ("tls_key", &mut c.tls_key, "\"/etc/lunakv/tls/tls.key\""),
            (
                "tls_cacert",
                &mut c.tls_cacert,
                "\"/etc/lunakv/tls/ca.crt\"",
            ),
        ];
        for (key, slot, example) in strings {
            if let Some(v) = string_field(map, key, example)? {
                *slot = v;
            }
        }
        if let Some(p) = string_field(map, "protocol", "\"tcp\"")? {
            c.protocol = Protocol::parse_for("protocol", &p)?;
        }
        if let Some(n) = size_field(map, "global_segment_size")? {
            c.global_segment_size = n;
        }
        if let Some(n) = size_field(map, "local_buffer_size")? {
            c.local_buffer_size = n;
        }
        if let Some(b) = bool_field(map, "enable_offload")? {
            c.enable_offload = b;
        }
        if let Some(b) = bool_field(map, "enable_shm")? {
            c.enable_shm = b;
        }
        for key in map.keys() {
            if KNOWN_KEYS.contains(&key.as_str()) {
                continue;
            }
            if key == "enable_ssd_offload" || key == "ssd_offload_path" {
                warnings.push(ConfigWarning::IgnoredSsdOffloadKey { key: key.clone() });
            } else {
                warnings.push(ConfigWarning::UnknownKey {
                    origin: origin.to_string(),
                    key: key.clone(),
                    did_you_mean: closest_key(key),
                });
            }
        }
        Ok(Loaded {
            config: c,
            warnings,
        })
    }

    /// Applies the environment overrides (see the module docs for the list and precedence).
    /// Pushes an [`ConfigWarning::EnvOverride`] for each value the file had set differently.
    pub fn apply_env(
        &mut self,
        env: &dyn Fn(&str) -> Option<String>,
        warnings: &mut Vec<ConfigWarning>,
    ) -> Result<(), ConfigError> {
        let defaults = MooncakeConfig::default();
        let mut set_string =
            |var: &'static str, field: &'static str, slot: &mut String, default: &str| {
                if let Some(v) = get(env, var) {
                    if *slot != v && *slot != default {
                        warnings.push(ConfigWarning::EnvOverride {
                            var,
                            field,
                            file_value: slot.clone(),
                            env_value: v.clone(),
                        });
                    }
                    *slot = v;
                }
            };
        set_string(
            "MOONCAKE_MASTER",
            "master_server_address",
            &mut self.master_server_address,
            "",
        );
        set_string(
            "MOONCAKE_TE_META_DATA_SERVER",
            "metadata_server",
            &mut self.metadata_server,
            "",
        );
        set_string("MOONCAKE_DEVICE", "device_name", &mut self.device_name, "");
        // Upstream's name when the config comes from the environment (SGLang documents it).
        set_string(
            "MOONCAKE_TENANT_ID",
            "tenant_id",
            &mut self.tenant_id,
            "default",
        );
        set_string(crate::ENV_TLS_CERT, "tls_cert", &mut self.tls_cert, "");
        set_string(crate::ENV_TLS_KEY, "tls_key", &mut self.tls_key, "");
        set_string(
            crate::ENV_TLS_CACERT,
            "tls_cacert",
            &mut self.tls_cacert,
            "",
        );
        // local_hostname: the Mooncake variables, else the file, else VLLM_HOST_IP.
        let file_hostname = std::mem::take(&mut self.local_hostname);
        let from_env = [
            "MOONCAKE_REQUESTER_LOCAL_HOSTNAME",
            "MOONCAKE_LOCAL_HOSTNAME",
        ]
        .into_iter()
        .find_map(|var| get(env, var).map(|v| (var, v)));
        self.local_hostname = match from_env {
            Some((var, env_value)) => {
                if !file_hostname.is_empty() && file_hostname != env_value {
                    warnings.push(ConfigWarning::EnvOverride {
                        var,
                        field: "local_hostname",
                        file_value: file_hostname,
                        env_value: env_value.clone(),
                    });
                }
                env_value
            }
            None if !file_hostname.is_empty() => file_hostname,
            None => get(env, "VLLM_HOST_IP").unwrap_or_default(),
        };
        for (var, field, slot, default) in [
            (
                "MOONCAKE_GLOBAL_SEGMENT_SIZE",
                "global_segment_size",
                &mut self.global_segment_size,
                defaults.global_segment_size,
            ),
            (
                "MOONCAKE_LOCAL_BUFFER_SIZE",
                "local_buffer_size",
                &mut self.local_buffer_size,
                defaults.local_buffer_size,
            ),
        ] {
            if let Some(v) = get(env, var) {
                let n = parse_size(&v).map_err(|error| ConfigError::InvalidSize {
                    field: var.to_string(),
                    error,
                })?;
                if *slot != n && *slot != default {
                    warnings.push(ConfigWarning::EnvOverride {
                        var,
                        field,
                        file_value: slot.to_string(),
                        env_value: v,
                    });
                }
                *slot = n;
            }
        }
        if let Some(v) = get(env, "MOONCAKE_PROTOCOL") {
            let p = Protocol::parse_for("MOONCAKE_PROTOCOL", &v)?;
            if self.protocol != p && self.protocol != defaults.protocol {
                warnings.push(ConfigWarning::EnvOverride {
                    var: "MOONCAKE_PROTOCOL",
                    field: "protocol",
                    file_value: self.protocol.to_string(),
                    env_value: v,
                });
            }
            self.protocol = p;
        }
        if let Some(v) = get(env, "MOONCAKE_PREFERRED_SEGMENT") {
            self.preferred_segment = Some(v);
        }
        if let Some(v) = get(env, "LUNAKV_DISABLE_SHM") {
            match v.to_ascii_lowercase().as_str() {
                "1" | "true" | "yes" | "on" => self.enable_shm = false,
                "0" | "false" | "no" | "off" => {}
                _ => {
                    return Err(ConfigError::Invalid {
                        field: "LUNAKV_DISABLE_SHM".to_string(),
                        value: v,
                        reason: "not a boolean".to_string(),
                        fix: "set LUNAKV_DISABLE_SHM=1 to force tcp, or unset it".to_string(),
                    });
                }
            }
        }
        Ok(())
    }

    /// The startup checks: vLLM's four in vLLM's order with vLLM's messages, then lunakv's.
    /// Returns the warnings vLLM also gives (offload pairing) plus lunakv's.
    pub fn validate(&self) -> Result<Vec<ConfigWarning>, ConfigError> {
        // 1. The mode is an enum here, so an unknown one was refused while parsing.
        // 2.
        if self.local_buffer_size == 0 {
            return Err(ConfigError::LocalBufferSizeZero);
        }
        // 3, 4.
        match self.mode {
            Mode::Embedded if self.global_segment_size == 0 => {
                return Err(ConfigError::EmbeddedRequiresSegment);
            }
            Mode::StandaloneStore if self.global_segment_size != 0 => {
                return Err(ConfigError::StandaloneRequiresNoSegment {
                    global_segment_size: self.global_segment_size,
                });
            }
            _ => {}
        }
        // lunakv's checks.
        if self.master_server_address.trim().is_empty() {
            return Err(ConfigError::Missing {
                field: "master_server_address".to_string(),
                fix: "set \"master_server_address\": \"127.0.0.1:50051\" (the lunakv-master's host:port) in mooncake_config.json, or MOONCAKE_MASTER".to_string(),
            });
        }
        self.master_address()?;
        self.preferred_segment()?;

        let mut warnings = Vec::new();
        match self.mode {
            Mode::Embedded if self.enable_offload && self.preferred_segment.is_none() => {
                warnings.push(ConfigWarning::EmbeddedOffloadWithoutPreferredSegment)
            }
            Mode::StandaloneStore if !self.enable_offload => {
                warnings.push(ConfigWarning::StandaloneWithoutOffload)
            }
            _ => {}
        }
        if !self.metadata_server.is_empty() && self.metadata_server != P2P_HANDSHAKE {
            warnings.push(ConfigWarning::MetadataServerIgnored {
                field: "metadata_server",
                value: self.metadata_server.clone(),
            });
        }
        Ok(warnings)
    }

    /// embedded mode: this process contributes DRAM to the pool.
    pub fn is_embedded(&self) -> bool {
        self.mode == Mode::Embedded
    }

    /// The master's address: `host:port`, or `etcd://h1:2379;h2:2379` (HA: the leader is
    /// looked up, and followed, in etcd).
    pub fn master_address(&self) -> Result<crate::MasterAddress, ConfigError> {
        crate::MasterAddress::parse("master_server_address", &self.master_server_address)
    }

    /// `MOONCAKE_PREFERRED_SEGMENT` parsed, if set.
    pub fn preferred_segment(&self) -> Result<Option<HostPort>, ConfigError> {
        self.preferred_segment
            .as_deref()
            .map(|v| HostPort::parse("MOONCAKE_PREFERRED_SEGMENT", v, "10.0.0.5:50052"))
            .transpose()
    }

    /// The config as pretty JSON that [`from_json_str`](Self::from_json_str) (and vLLM) reads back;
    /// sizes as byte counts. `make run` prints this for the engine.
    pub fn to_json_pretty(&self) -> String {
        // Serializing plain strings, integers and bools into a String cannot fail.
        serde_json::to_string_pretty(self).unwrap_or_default()
    }
}

// === parsing helpers ===

fn get(env: &dyn Fn(&str) -> Option<String>, var: &str) -> Option<String> {
    env(var).filter(|v| !v.is_empty())
}

fn json_error(origin: &str, e: &serde_json::Error) -> ConfigError {
    let truncated = e.is_eof();
    let full = e.to_string();
    // serde_json appends " at line L column C"; the variant carries those separately.
    let mut message = match full.rfind(" at line ") {
        Some(i) => full[..i].to_string(),
        None => full,
    };
    if truncated {
        message.push_str(" (the file ends early: is it empty or truncated?)");
    }
    ConfigError::Json {
        origin: origin.to_string(),
        line: e.line(),
        column: e.column(),
        message,
        truncated,
    }
}

fn json_kind(v: &Value) -> String {
    match v {
        Value::Null => "null".into(),
        Value::Bool(b) => format!("the boolean {b}"),
        Value::Number(n) => format!("the number {n}"),
        Value::String(s) => format!("the string {}", Value::String(s.clone())),
        Value::Array(_) => "an array".into(),
        Value::Object(_) => "an object".into(),
    }
}

fn string_field(
    map: &Map<String, Value>,
    key: &str,
    example: &'static str,
) -> Result<Option<String>, ConfigError> {
    match map.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(other) => Err(ConfigError::WrongType {
            field: key.to_string(),
            value: other.to_string(),
            expected: "a string",
            example,
        }),
    }
}

fn size_field(map: &Map<String, Value>, key: &str) -> Result<Option<u64>, ConfigError> {
    let invalid = |error| ConfigError::InvalidSize {
        field: key.to_string(),
        error,
    };
    match map.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => size_from_json_number(n).map(Some).map_err(invalid),
        Some(Value::String(s)) => parse_size(s).map(Some).map_err(invalid),
        Some(other) => Err(ConfigError::WrongType {
            field: key.to_string(),
            value: other.to_string(),
            expected: "a size (a byte count or a string like \"80GB\")",
            example: "\"80GB\"",
        }),
    }
}

fn bool_field(map: &Map<String, Value>, key: &str) -> Result<Option<bool>, ConfigError> {
    match map.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(other) => Err(ConfigError::NotABool {
            field: key.to_string(),
            value: other.to_string(),
        }),
    }
}

/// The known key within edit distance 2 of `key` (typos), if any.
fn closest_key(key: &str) -> Option<&'static str> {
    KNOWN_KEYS
        .iter()
        .map(|k| (edit_distance(&key.to_ascii_lowercase(), k), *k))
        .filter(|(d, _)| *d <= 2)
        .min_by_key(|(d, _)| *d)
        .map(|(_, k)| k)
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1];
        for (j, cb) in b.iter().enumerate() {
            let sub = prev[j] + usize::from(ca != *cb);
            cur.push(sub.min(prev[j + 1] + 1).min(cur[j] + 1));
        }
        prev = cur;
    }
    prev[b.len()]
}
