//! Flags, with llm-d-router's pd-sidecar names and defaults, and their validation.

use std::net::{IpAddr, Ipv4Addr};
use std::path::PathBuf;
use std::time::Duration;

use clap::{ArgAction, Parser};
use serde::{Deserialize, Serialize};

/// The KV connectors the sidecar knows how to drive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Connector {
    NixlV2,
    SharedStorage,
    Mooncake,
}

impl Connector {
    pub const VALID: &'static [&'static str] = &["nixlv2", "shared-storage", "mooncake"];

    pub fn parse(s: &str) -> Result<Connector, ConfigError> {
        match s.trim().to_ascii_lowercase().as_str() {
            "nixlv2" => Ok(Connector::NixlV2),
            "shared-storage" => Ok(Connector::SharedStorage),
            "mooncake" => Ok(Connector::Mooncake),
            _ => Err(ConfigError::UnknownConnector(s.to_string())),
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            Connector::NixlV2 => "nixlv2",
            Connector::SharedStorage => "shared-storage",
            Connector::Mooncake => "mooncake",
        }
    }
}

/// Invalid flags; main prints the message and exits non-zero.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("unknown --kv-connector '{0}'; valid connectors: nixlv2, shared-storage, mooncake")]
    UnknownConnector(String),
    #[error("unknown TLS stage '{0}' in {1}; valid stages: prefiller, decoder")]
    UnknownStage(String, &'static str),
    #[error("{0}")]
    Invalid(String),
    /// Bad command line (or `--help` / `--version`): `clap::Error::exit` prints it.
    #[error(transparent)]
    Flags(#[from] clap::Error),
    /// A bad key or value in the file or the environment, naming where it came from.
    #[error(transparent)]
    Layers(#[from] lunakv_config::layered::LayeredError),
}

// Bool flags take Go's forms (`--flag`, `--flag=false`), and a repeated flag takes its last
// value, as with Go's flag package, so upstream manifests work unchanged.
//
// The same struct is the layered loader's config (serde, keys = the flag names, as llm-d's
// YAML writes them; see [`crate::file`]): the flags are a contract and every one is a key, so
// a second struct would only repeat them. Its `Default` is clap's defaults (a test holds
// them equal).
/// lunakv-sidecar: P/D disaggregation proxy, a drop-in for llm-d-router's pd-sidecar.
#[derive(Debug, Clone, PartialEq, Parser, Serialize, Deserialize)]
#[command(name = "lunakv-sidecar", version, args_override_self = true)]
#[serde(default, deny_unknown_fields, rename_all = "kebab-case")]
pub struct Cli {
    /// Port the sidecar listens on (port+i for data-parallel rank i).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Address the listeners bind [default: 0.0.0.0, like upstream: the sidecar is the decode
    /// pod's ingress; pass 127.0.0.1 to keep it local].
    #[arg(long, default_value = "0.0.0.0")]
    pub host: IpAddr,
    /// Local model server port (port+i for data-parallel rank i).
    #[arg(
        long = "vllm-port",
        alias = "model-server-port",
        default_value_t = 8200
    )]
    pub vllm_port: u16,
    /// Local model server host.
    #[arg(long = "model-server-host", default_value = "127.0.0.1")]
    pub model_server_host: String,
    /// KV connector protocol: nixlv2 | shared-storage | mooncake.
    #[arg(long = "kv-connector", default_value = "nixlv2")]
    pub kv_connector: String,
    /// Port of the prefill host's Mooncake bootstrap server.
    #[arg(long = "mooncake-bootstrap-port", env = "MOONCAKE_BOOTSTRAP_PORT", default_value_t = 8998,
          value_parser = clap::value_parser!(u16).range(1..=65535))]
    pub mooncake_bootstrap_port: u16,
    /// Data-parallel ranks served (listener port+i -> model server port+i).
    #[arg(long = "data-parallel-size", default_value_t = 1,
          value_parser = clap::value_parser!(u16).range(1..=256))]
    pub data_parallel_size: u16,
    /// Serve HTTPS (self-signed unless --cert-path is given). `--secure-serving` is upstream's
    /// newer name.
    #[arg(long = "secure-proxy", alias = "secure-serving", default_value_t = true, action = ArgAction::Set,
          num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub secure_proxy: bool,
    /// Directory holding tls.crt and tls.key (reloaded when they change).
    #[arg(long = "cert-path")]
    pub cert_path: Option<PathBuf>,
    /// Stages reached over TLS: comma list of prefiller, decoder.
    #[serde(with = "crate::values::list")]
    #[arg(long = "enable-tls", value_delimiter = ',', num_args = 0..=1, require_equals = true,
          default_missing_value = "prefiller,decoder")]
    pub enable_tls: Vec<String>,
    /// Stages whose certificates are not verified: comma list of prefiller, decoder.
    #[serde(with = "crate::values::list")]
    #[arg(long = "tls-insecure-skip-verify", value_delimiter = ',', num_args = 0..=1,
          require_equals = true, default_missing_value = "prefiller,decoder")]
    pub tls_insecure_skip_verify: Vec<String>,
    /// Retries of a failed prefill (connect errors, 502/503/504).
    #[arg(long = "prefill-max-retries", default_value_t = 0)]
    pub prefill_max_retries: u32,
    /// Wait before each prefill retry (e.g. 200ms, 1s).
    #[serde(with = "crate::values::go_duration")]
    #[arg(long = "prefill-retry-backoff", default_value = "200ms", value_parser = parse_duration)]
    pub prefill_retry_backoff: Duration,
    /// Only allow prefill targets on the allowlist (host AND port).
    #[arg(long = "enable-ssrf-protection", default_value_t = false, action = ArgAction::Set,
          num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub enable_ssrf_protection: bool,
    /// Static allowlist: comma list of host:port (host:* allows any port of host).
    #[serde(with = "crate::values::list")]
    #[arg(long = "ssrf-allowlist", value_delimiter = ',')]
    pub ssrf_allowlist: Vec<String>,
    /// Allowlist file, one host:port per line (# comments); re-read when it changes.
    #[arg(long = "ssrf-allowlist-file")]
    pub ssrf_allowlist_file: Option<PathBuf>,
    /// Upstream's pod-watching allowlist source (needs the Kubernetes API; not supported here:
    /// use --ssrf-allowlist or --ssrf-allowlist-file).
    #[arg(long = "inference-pool", env = "INFERENCE_POOL")]
    pub inference_pool: Option<String>,
    /// Idle connections kept per upstream host.
    #[arg(long = "max-idle-conns-per-host", default_value_t = 1024)]
    pub max_idle_conns_per_host: usize,
    /// Idle keep-alive to upstreams; keep it below the engine's (vLLM/uvicorn: 5 s).
    #[serde(with = "crate::values::go_duration")]
    #[arg(long = "idle-conn-timeout", default_value = "4s", value_parser = parse_duration)]
    pub idle_conn_timeout: Duration,
    /// Largest request body accepted on the disaggregated routes (413 beyond).
    #[arg(long = "max-body-bytes", default_value_t = 64 << 20)]
    pub max_body_bytes: usize,
    /// Memory the disaggregated routes may spend on request bodies at once, all requests
    /// together, each body charged 4 times its size (raw, parsed, one copy per leg); a body that
    /// does not fit is refused with 503 (lunakv's own flag).
    #[arg(long = "max-buffered-body-bytes", default_value_t = 512 << 20)]
    pub max_buffered_body_bytes: usize,
    /// Accepted for compatibility; sampling parameters always go to the prefiller unchanged.
    #[arg(long = "enable-prefiller-sampling", env = "ENABLE_PREFILLER_SAMPLING", default_value_t = false, action = ArgAction::Set,
          num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub enable_prefiller_sampling: bool,
    /// Accepted for compatibility; spans always go to the tracing subscriber (RUST_LOG).
    #[arg(long = "tracing", default_value_t = false, action = ArgAction::Set,
          num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub tracing: bool,
    /// Runtime worker threads: 0 = one per CPU, 1 = a single-threaded runtime (no cross-thread
    /// wake-ups per request; plenty for one engine's traffic).
    #[arg(long = "worker-threads", default_value_t = 0)]
    pub worker_threads: usize,
    /// llm-d-router's YAML configuration (keys = flag names), under env and flags; see
    /// [`crate::file`].
    #[arg(long = "configuration-file")]
    #[serde(skip)]
    pub configuration_file: Option<PathBuf>,
    /// The same YAML inline (`--configuration='{port: 8085}'`); excludes --configuration-file.
    #[arg(long = "configuration")]
    #[serde(skip)]
    pub configuration: Option<String>,
}

impl Default for Cli {
    /// The flags' defaults, as `lunakv-sidecar` with no flags and no environment.
    fn default() -> Self {
        Cli {
            port: 8000,
            host: IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            vllm_port: 8200,
            model_server_host: "127.0.0.1".to_string(),
            kv_connector: "nixlv2".to_string(),
            mooncake_bootstrap_port: 8998,
            data_parallel_size: 1,
            secure_proxy: true,
            cert_path: None,
            enable_tls: Vec::new(),
            tls_insecure_skip_verify: Vec::new(),
            prefill_max_retries: 0,
            prefill_retry_backoff: Duration::from_millis(200),
            enable_ssrf_protection: false,
            ssrf_allowlist: Vec::new(),
            ssrf_allowlist_file: None,
            inference_pool: None,
            max_idle_conns_per_host: 1024,
            idle_conn_timeout: Duration::from_secs(4),
            max_body_bytes: 64 << 20,
            max_buffered_body_bytes: 512 << 20,
            enable_prefiller_sampling: false,
            tracing: false,
            worker_threads: 0,
            configuration_file: None,
            configuration: None,
        }
    }
}

/// Which stages use TLS / skip verification.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stages {
    pub prefiller: bool,
    pub decoder: bool,
}

impl Stages {
    fn parse(list: &[String], flag: &'static str) -> Result<Stages, ConfigError> {
        let mut s = Stages::default();
        for item in list.iter().map(|x| x.trim()).filter(|x| !x.is_empty()) {
            match item {
                "prefiller" | "prefill" => s.prefiller = true,
                "decoder" | "decode" => s.decoder = true,
                other => return Err(ConfigError::UnknownStage(other.to_string(), flag)),
            }
        }
        Ok(s)
    }
}

/// Validated configuration.
#[derive(Debug, Clone)]
pub struct SidecarConfig {
    pub host: IpAddr,
    pub port: u16,
    pub model_server_host: String,
    pub vllm_port: u16,
    pub connector: Connector,
    pub bootstrap_port: u16,
    pub data_parallel_size: u16,
    pub secure_proxy: bool,
    pub cert_path: Option<PathBuf>,
    pub tls: Stages,
    pub skip_verify: Stages,
    pub prefill_max_retries: u32,
    pub prefill_retry_backoff: Duration,
    pub ssrf: bool,
    pub ssrf_allowlist: Vec<String>,
    pub ssrf_allowlist_file: Option<PathBuf>,
    pub max_idle_conns_per_host: usize,
    pub idle_conn_timeout: Duration,
    pub max_body_bytes: usize,
    pub max_buffered_body_bytes: usize,
    pub worker_threads: usize,
}

impl SidecarConfig {
    pub fn from_cli(c: Cli) -> Result<SidecarConfig, ConfigError> {
        let connector = Connector::parse(&c.kv_connector)?;
        if let Some(pool) = c.inference_pool.as_deref().filter(|p| !p.is_empty()) {
            // The pool's pod list needs the Kubernetes API, which this sidecar does not watch:
            // refuse rather than protect nothing (or everything) while the operator thinks the
            // pool is the allowlist.
            if c.enable_ssrf_protection {
                return Err(ConfigError::Invalid(format!(
                    "--inference-pool / INFERENCE_POOL '{pool}': lunakv-sidecar cannot read an InferencePool (it needs the Kubernetes API); list the prefill pods' host:port with --ssrf-allowlist or --ssrf-allowlist-file instead"
                )));
            }
            tracing::warn!(
                pool,
                "--inference-pool is ignored without --enable-ssrf-protection (and is not supported with it: use --ssrf-allowlist or --ssrf-allowlist-file)"
            );
        }
        if c.idle_conn_timeout >= Duration::from_secs(5) {
            tracing::warn!(
                idle = ?c.idle_conn_timeout,
                "--idle-conn-timeout is not below vLLM's 5 s keep-alive: idle connections may be reset under a request (502s)"
            );
        }
        // clap refuses these on the command line; the file and the environment reach here.
        if c.mooncake_bootstrap_port == 0 {
            return Err(ConfigError::Invalid(
                "--mooncake-bootstrap-port 0 is not a port; give 1..65535 (default 8998)".into(),
            ));
        }
        if !(1..=256).contains(&c.data_parallel_size) {
            return Err(ConfigError::Invalid(format!(
                "--data-parallel-size {} is out of range; give 1..256 (default 1)",
                c.data_parallel_size
            )));
        }
        if c.port as u32 + c.data_parallel_size as u32 - 1 > 65535
            || c.vllm_port as u32 + c.data_parallel_size as u32 - 1 > 65535
        {
            return Err(ConfigError::Invalid(
                "--data-parallel-size pushes a port past 65535".into(),
            ));
        }
        if c.max_body_bytes == 0 {
            return Err(ConfigError::Invalid("--max-body-bytes must be > 0".into()));
        }
        let one = c.max_body_bytes.saturating_mul(crate::body::BODY_COPIES);
        if c.max_buffered_body_bytes < one {
            return Err(ConfigError::Invalid(format!(
                "--max-buffered-body-bytes={} is below {} x --max-body-bytes={} (= {one}; a body is charged {} times its size): a body of the allowed size could never be buffered; raise it or lower --max-body-bytes",
                c.max_buffered_body_bytes,
                crate::body::BODY_COPIES,
                c.max_body_bytes,
                crate::body::BODY_COPIES
            )));
        }
        Ok(SidecarConfig {
            host: c.host,
            port: c.port,
            model_server_host: c.model_server_host,
            vllm_port: c.vllm_port,
            connector,
            bootstrap_port: c.mooncake_bootstrap_port,
            data_parallel_size: c.data_parallel_size,
            secure_proxy: c.secure_proxy,
            cert_path: c.cert_path,
            tls: Stages::parse(&c.enable_tls, "--enable-tls")?,
            skip_verify: Stages::parse(&c.tls_insecure_skip_verify, "--tls-insecure-skip-verify")?,
            prefill_max_retries: c.prefill_max_retries,
            prefill_retry_backoff: c.prefill_retry_backoff,
            ssrf: c.enable_ssrf_protection,
            ssrf_allowlist: c.ssrf_allowlist,
            ssrf_allowlist_file: c.ssrf_allowlist_file,
            max_idle_conns_per_host: c.max_idle_conns_per_host,
            idle_conn_timeout: c.idle_conn_timeout,
            max_body_bytes: c.max_body_bytes,
            max_buffered_body_bytes: c.max_buffered_body_bytes,
            worker_threads: c.worker_threads,
        })
    }
}

/// Go durations (`200ms`, `1m30s`) as llm-d's flags write them, or bare seconds.
pub use lunakv_config::parse_duration;

#[cfg(test)]
mod tests {
    use super::*;

    fn cli(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("lunakv-sidecar").chain(args.iter().copied()))
    }

    #[test]
    fn defaults_match_upstream() {
        let c = SidecarConfig::from_cli(cli(&[]).unwrap()).unwrap();
        assert_eq!(c.port, 8000);
        assert_eq!(c.vllm_port, 8200);
        assert_eq!(c.connector, Connector::NixlV2);
        assert_eq!(c.prefill_max_retries, 0);
        assert_eq!(c.prefill_retry_backoff, Duration::from_millis(200));
        assert!(c.secure_proxy);
        assert!(!c.ssrf);
        assert!(c.idle_conn_timeout < Duration::from_secs(5));
        assert_eq!(c.max_buffered_body_bytes, 512 << 20);
    }

    #[test]
    fn durations_are_go_durations_as_llm_d_writes_them() {
        let c = SidecarConfig::from_cli(
            cli(&["--idle-conn-timeout=1m30s", "--prefill-retry-backoff=1.5s"]).unwrap(),
        )
        .unwrap();
        assert_eq!(c.idle_conn_timeout, Duration::from_secs(90));
        assert_eq!(c.prefill_retry_backoff, Duration::from_millis(1500));
        let e = cli(&["--idle-conn-timeout=1m30"])
            .expect_err("no unit")
            .to_string();
        assert!(e.contains("1m30s"), "{e}");
    }

    #[test]
    fn body_budget_must_hold_one_body() {
        let e = SidecarConfig::from_cli(
            cli(&["--max-body-bytes=1000", "--max-buffered-body-bytes=3999"]).unwrap(),
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("--max-buffered-body-bytes=3999") && e.contains("--max-body-bytes=1000"),
            "{e}"
        );
    }

    #[test]
    fn go_style_flags() {
        let c = cli(&[
            "--secure-proxy=false",
            "--model-server-port=9000",
            "--kv-connector=mooncake",
            "--enable-tls=prefiller",
            "--enable-ssrf-protection",
            "--mooncake-bootstrap-port=1234",
        ])
        .unwrap();
        let c = SidecarConfig::from_cli(c).unwrap();
        assert!(!c.secure_proxy);
        assert!(c.ssrf);
        assert_eq!(c.vllm_port, 9000);
        assert_eq!(c.connector, Connector::Mooncake);
        assert_eq!(c.bootstrap_port, 1234);
        assert!(c.tls.prefiller && !c.tls.decoder);
        assert!(cli(&["--mooncake-bootstrap-port=0"]).is_err());
    }

    #[test]
    fn defaults_are_the_flags_defaults() {
        let mut c = cli(&[]).unwrap();
        // Set by clap from the environment where the test runs; not a default.
        c.mooncake_bootstrap_port = 8998;
        c.inference_pool = None;
        c.enable_prefiller_sampling = false;
        assert_eq!(c, Cli::default());
    }

    #[test]
    fn unknown_connector_lists_valid_ones() {
        let e = SidecarConfig::from_cli(cli(&["--kv-connector=lmcache"]).unwrap()).unwrap_err();
        let m = e.to_string();
        for v in Connector::VALID {
            assert!(m.contains(v), "{m}");
        }
    }
}
