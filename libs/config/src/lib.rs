//! Configuration for lunakv: what every lunakv process reads before it starts.
//!
//! - [`client`]: `mooncake_config.json`, the file vLLM's `MooncakeStoreConnector` reads through
//!   `MOONCAKE_CONFIG_PATH`, parsed and validated the way vLLM does (same field names, defaults,
//!   environment overrides, and the exact startup messages), plus the checks vLLM misses. Used by
//!   `libs/client` (engine setup), `tools/lunakv` (`--config`) and `make run`.
//! - [`store`]: `StoreConfig`, the configuration of the standalone store-client `lunakv-store`,
//!   named and defaulted like Mooncake's `mooncake_client`; its clap struct is
//!   [`store::StoreArgs`]. Used by `services/store`.
//! - [`layered`]: the one layered loader (serde defaults < file < env < flags) the master's,
//!   the store's and the sidecar's keys go through; a service gives it a [`layered::Schema`]
//!   and its clap struct.
//! - [`master`]: the master's flags ([`master::MasterArgs`]) and `master.yaml`.
//! - [`connectors`]: does a routing sidecar's `--kv-connector` match its engines'
//!   `--kv-transfer-config` (`lunakv doctor` and the Kubernetes overlay test).
//! - [`duration`]: Go durations (`1m30s`) as llm-d's flags write them, for the sidecar and the
//!   bootstrap.
//! - [`size`]: human sizes, `"80GB"` = 80 GiB as in vLLM's parser; also a serde `with` module.
//! - [`tls`]: where the master, the bootstrap and their clients find their mTLS certificates
//!   (`LUNAKV_TLS_*`), and the master's admin identities.
//! - [`messages`]: user-facing messages several crates print or pin (the tenant refusal, the
//!   master's unshared-namespace rule).
//!
//! Shared pieces live here: one [`ConfigError`] whose variants callers can branch on and whose
//! messages name the field, the bad value and the fix; [`ConfigWarning`]s, returned rather than
//! logged (this crate has no logger; the binary logs them); [`HostPort`] and [`Protocol`].
//!
//! Environment variables are always read through a caller-supplied function
//! (`&dyn Fn(&str) -> Option<String>`), never from the process directly, so tests pass a map
//! and never call `std::env::set_var`. Production code passes [`process_env`]. An empty value counts
//! as unset, as in upstream's `if os.getenv(...)` checks.
#![forbid(unsafe_code)]

pub mod auth;
pub mod client;
pub mod connectors;
pub mod duration;
pub mod etcd;
pub mod gflags;
pub mod key_table;
pub mod layered;
pub mod master;
pub mod messages;
pub mod security_help;
pub mod size;
pub mod store;
pub mod tls;

use std::fmt;
use std::net::Ipv6Addr;
use std::path::PathBuf;
use std::str::FromStr;

pub use client::{Mode, MooncakeConfig};

// The TLS files' variables live here, not in tls.rs: the client config reads them over its
// file's `tls_*` keys, and the TLS settings read that file through the client config.
/// This process's certificate (PEM).
pub const ENV_TLS_CERT: &str = "LUNAKV_TLS_CERT";
/// The key of [`ENV_TLS_CERT`] (PEM).
pub const ENV_TLS_KEY: &str = "LUNAKV_TLS_KEY";
/// The CA that signs the peers' certificates (PEM).
pub const ENV_TLS_CACERT: &str = "LUNAKV_TLS_CACERT";
pub use duration::{DurationError, parse_duration};
pub use etcd::{EtcdCredentials, EtcdEndpoints, MasterAddress};
pub use size::{SizeError, parse_size};
pub use store::StoreConfig;

/// Reads the real process environment; pass it where an env function is expected.
/// Returns `None` for unset, empty, or non-UTF-8 variables.
pub fn process_env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

/// A switch in the environment that is on unless `var` says 0, off, false or no (for paths
/// that are on by default and may be turned off to compare or to work around a fault).
pub fn switched_on(var: &str) -> bool {
    !matches!(
        std::env::var(var).as_deref().map(str::trim),
        Ok("0" | "off" | "false" | "no")
    )
}

/// A loaded configuration together with the warnings found while loading it.
/// The caller logs the warnings (`for w in &loaded.warnings { tracing::warn!("{w}") }`).
#[derive(Debug, Clone, PartialEq)]
pub struct Loaded<T> {
    pub config: T,
    pub warnings: Vec<ConfigWarning>,
}

/// Every way a configuration can be refused.
///
/// Four messages are vLLM's, byte for byte, because operators grep for them:
/// [`UnknownMode`](Self::UnknownMode), [`LocalBufferSizeZero`](Self::LocalBufferSizeZero),
/// [`EmbeddedRequiresSegment`](Self::EmbeddedRequiresSegment),
/// [`StandaloneRequiresNoSegment`](Self::StandaloneRequiresNoSegment), and so is
/// [`EnvNotSet`](Self::EnvNotSet) for `MOONCAKE_CONFIG_PATH`. Every other message names the field,
/// the bad value, and the fix.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// `The environment variable 'MOONCAKE_CONFIG_PATH' is not set.` (vLLM's message)
    #[error("The environment variable '{var}' is not set.")]
    EnvNotSet { var: &'static str },

    /// The config file could not be read.
    #[error("cannot read config file {}: {source}; check the path and its permissions", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// Malformed or truncated JSON. `message` says what the parser expected; `truncated` is set
    /// when the text ended early (an empty or cut-off file).
    #[error("{origin}: invalid JSON at line {line}, column {column}: {message}")]
    Json {
        origin: String,
        line: usize,
        column: usize,
        message: String,
        truncated: bool,
    },

    /// The document parsed but is not a JSON object.
    #[error(
        "{origin}: expected a JSON object at the top level, like {{\"mode\": \"embedded\", \"master_server_address\": \"127.0.0.1:50051\"}}, got {found}"
    )]
    NotAnObject { origin: String, found: String },

    /// A field has the wrong JSON type (`"protocol": 5`).
    #[error("{field}: expected {expected}, got {value}; write e.g. \"{field}\": {example}")]
    WrongType {
        field: String,
        /// The value as JSON text.
        value: String,
        expected: &'static str,
        example: &'static str,
    },

    /// A boolean given as anything but JSON `true`/`false`, most importantly the string `"false"`,
    /// which vLLM's `bool("false")` reads as true.
    #[error(
        "{field} must be a JSON boolean, got {value}: vLLM reads any non-empty string, even \"false\", as true, so lunakv refuses it; write \"{field}\": true or \"{field}\": false, without quotes"
    )]
    NotABool {
        field: String,
        /// The value as JSON text (`"false"` with its quotes).
        value: String,
    },

    /// A size that does not parse (the inner error names the value and shows valid sizes).
    #[error("{field}: {error}")]
    InvalidSize { field: String, error: SizeError },

    /// vLLM check 1: `unknown Mooncake mode: 'x'`.
    #[error("unknown Mooncake mode: '{mode}'")]
    UnknownMode { mode: String },

    /// vLLM check 2: `local_buffer_size must be > 0`.
    #[error("local_buffer_size must be > 0")]
    LocalBufferSizeZero,

    /// vLLM check 3: `embedded mode requires global_segment_size > 0`.
    #[error("embedded mode requires global_segment_size > 0")]
    EmbeddedRequiresSegment,

    /// vLLM check 4: `standalone-store mode requires global_segment_size == 0`.
    #[error("standalone-store mode requires global_segment_size == 0")]
    StandaloneRequiresNoSegment { global_segment_size: u64 },

    /// A required value is missing or empty.
    #[error("{field} is not set: {fix}")]
    Missing { field: String, fix: String },

    /// An address that is not `host:port`.
    #[error("{field} '{value}' is not a host:port address: {reason}; write it like \"{example}\"")]
    InvalidAddress {
        field: String,
        value: String,
        reason: String,
        example: &'static str,
    },

    /// An etcd endpoint list that does not parse.
    #[error(
        "{field} '{value}' is not a valid etcd endpoint list: {reason}; write \"h1:2379;h2:2379\" (or \"etcd://h1:2379;h2:2379\" as a master address)"
    )]
    InvalidEtcdEndpoints {
        field: String,
        value: String,
        reason: String,
    },

    /// A protocol name lunakv does not know.
    #[error("{field} '{value}' is not a known protocol; use \"tcp\"")]
    UnknownProtocol { field: String, value: String },

    /// Any other bad value: `reason` says what is wrong with it, `fix` what to write instead.
    #[error("{field} '{value}' is invalid: {reason}; {fix}")]
    Invalid {
        field: String,
        value: String,
        reason: String,
        fix: String,
    },
}

/// Something accepted but worth telling the operator. `Display` is the log line.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ConfigWarning {
    /// A key lunakv does not know. vLLM ignores unknown keys, and so does lunakv, but says so:
    /// a typo (`global_segement_size`) would otherwise silently fall back to the default.
    UnknownKey {
        origin: String,
        key: String,
        /// The known key it most resembles, if any.
        did_you_mean: Option<&'static str>,
    },
    /// `enable_ssd_offload` / `ssd_offload_path`: read by older connectors, ignored by vLLM.
    IgnoredSsdOffloadKey { key: String },
    /// An environment variable replaced a value the file set.
    EnvOverride {
        var: &'static str,
        field: &'static str,
        file_value: String,
        env_value: String,
    },
    /// embedded + enable_offload with no MOONCAKE_PREFERRED_SEGMENT (vLLM warns the same).
    EmbeddedOffloadWithoutPreferredSegment,
    /// standalone-store without enable_offload (vLLM warns the same).
    StandaloneWithoutOffload,
    /// A metadata server other than P2PHANDSHAKE: lunakv's master hosts transfer metadata.
    MetadataServerIgnored { field: &'static str, value: String },
    /// No longer emitted (the SSD tier exists, docs/OFFLOAD.md); kept so matches elsewhere compile.
    OffloadNotImplemented,
}

impl fmt::Display for ConfigWarning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::UnknownKey {
                origin,
                key,
                did_you_mean,
            } => {
                write!(f, "{origin}: unknown key \"{key}\" is ignored")?;
                match did_you_mean {
                    Some(k) => write!(f, "; did you mean \"{k}\"?"),
                    None => write!(f, " (vLLM ignores it too)"),
                }
            }
            Self::IgnoredSsdOffloadKey { key } => write!(
                f,
                "\"{key}\" is ignored: for an SSD tier use \"mode\": \"standalone-store\" with \"enable_offload\": true, and enable offload on the master and the store-client too"
            ),
            Self::EnvOverride {
                var,
                field,
                file_value,
                env_value,
            } => write!(
                f,
                "{var}={env_value} overrides {field} \"{file_value}\" from the config file"
            ),
            Self::EmbeddedOffloadWithoutPreferredSegment => write!(
                f,
                "embedded mode with enable_offload but no MOONCAKE_PREFERRED_SEGMENT: the SSD tier will only see puts that happen to land on the owner segment; set MOONCAKE_PREFERRED_SEGMENT=host:port of the offloading store-client"
            ),
            Self::StandaloneWithoutOffload => write!(
                f,
                "standalone-store mode without enable_offload: the store-client's pool is DRAM only; set \"enable_offload\": true (here, on the master and on the store-client) for an SSD tier"
            ),
            Self::MetadataServerIgnored { field, value } => write!(
                f,
                "{field} \"{value}\" is ignored: lunakv's master hosts the transfer metadata (P2PHANDSHAKE behaviour); etcd metadata comes in a later release"
            ),
            Self::OffloadNotImplemented => write!(
                f,
                "enable_offload is accepted but the SSD tier is not implemented yet: this store-client serves DRAM only"
            ),
        }
    }
}

/// A transfer protocol name as it appears in configs and flags (`"tcp"`, `"rdma"`).
/// Parsing accepts any case; unknown names are [`ConfigError::UnknownProtocol`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Protocol {
    Tcp,
    Rdma,
}

impl Protocol {
    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::Tcp => "tcp",
            Protocol::Rdma => "rdma",
        }
    }

    /// Parses `value` for `field` (the field name goes into the error).
    pub fn parse_for(field: &str, value: &str) -> Result<Self, ConfigError> {
        match value.trim().to_ascii_lowercase().as_str() {
            "tcp" => Ok(Protocol::Tcp),
            "rdma" => Ok(Protocol::Rdma),
            _ => Err(ConfigError::UnknownProtocol {
                field: field.to_string(),
                value: value.to_string(),
            }),
        }
    }
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Protocol {
    type Err = ConfigError;
    fn from_str(s: &str) -> Result<Self, ConfigError> {
        Protocol::parse_for("protocol", s)
    }
}

/// A `host:port` pair. `host` is a name or an IP; an IPv6 literal is kept without brackets.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct HostPort {
    pub host: String,
    pub port: u16,
}

impl fmt::Display for HostPort {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

impl HostPort {
    /// Parses `host:port`, `[v6]:port`. Port 0 is refused (a peer address needs a real port).
    /// `example` is shown in the error (`"127.0.0.1:50051"`).
    pub fn parse(field: &str, value: &str, example: &'static str) -> Result<Self, ConfigError> {
        let bad = |reason: &str| ConfigError::InvalidAddress {
            field: field.to_string(),
            value: value.to_string(),
            reason: reason.to_string(),
            example,
        };
        let v = value.trim();
        if v.is_empty() {
            return Err(bad("it is empty"));
        }
        if v.contains(char::is_whitespace) || v.contains(';') || v.contains(',') {
            return Err(bad("it must be a single address"));
        }
        let (host, port) = if let Some(rest) = v.strip_prefix('[') {
            let (h, p) = rest
                .split_once("]:")
                .ok_or_else(|| bad("write an IPv6 host as [addr]:port"))?;
            if h.parse::<Ipv6Addr>().is_err() {
                return Err(bad("the part in brackets is not an IPv6 address"));
            }
            (h, p)
        } else {
            let (h, p) = v
                .rsplit_once(':')
                .ok_or_else(|| bad("the port is missing"))?;
            if h.contains(':') {
                return Err(bad("write an IPv6 host in brackets, [addr]:port"));
            }
            (h, p)
        };
        if host.is_empty() {
            return Err(bad("the host is missing"));
        }
        let port: u16 = port
            .parse()
            .map_err(|_| bad("the port must be a number from 1 to 65535"))?;
        if port == 0 {
            return Err(bad("the port must be a number from 1 to 65535"));
        }
        Ok(HostPort {
            host: host.to_string(),
            port,
        })
    }
}

/// Tests' environment: a lookup over fixed `(variable, value)` pairs, as `process_env` is.
#[cfg(test)]
pub(crate) fn test_env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
    move |k| {
        vars.iter()
            .find(|(n, _)| *n == k)
            .map(|(_, v)| v.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_port_parses() {
        let hp = |v| HostPort::parse("f", v, "127.0.0.1:1");
        assert_eq!(
            hp("127.0.0.1:50051").unwrap(),
            HostPort {
                host: "127.0.0.1".into(),
                port: 50051
            }
        );
        assert_eq!(
            hp(" master.svc:50051 ").unwrap().to_string(),
            "master.svc:50051"
        );
        let v6 = hp("[::1]:50052").unwrap();
        assert_eq!(v6.host, "::1");
        assert_eq!(v6.to_string(), "[::1]:50052");
        for bad in [
            "",
            "host",
            "host:",
            ":50051",
            "host:0",
            "host:70000",
            "host:x",
            "::1:5",
            "[nope]:5",
            "a:1;b:2",
        ] {
            assert!(
                matches!(hp(bad), Err(ConfigError::InvalidAddress { .. })),
                "{bad:?}"
            );
        }
        assert_eq!(
            hp("host").unwrap_err().to_string(),
            "f 'host' is not a host:port address: the port is missing; write it like \"127.0.0.1:1\""
        );
    }

    #[test]
    fn protocol_parses() {
        assert_eq!("tcp".parse::<Protocol>().unwrap(), Protocol::Tcp);
        assert_eq!("RDMA".parse::<Protocol>().unwrap(), Protocol::Rdma);
        assert_eq!(
            "tpc".parse::<Protocol>().unwrap_err().to_string(),
            "protocol 'tpc' is not a known protocol; use \"tcp\""
        );
    }
}
