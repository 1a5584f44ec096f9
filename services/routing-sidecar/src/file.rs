//! `--configuration-file` / `--configuration`: llm-d-router's pd-sidecar YAML, a flat map whose
//! keys are the flag names (`port: 8000`, `kv-connector: mooncake`, `enable-tls: [prefiller]`).
//! It is the bottom layer: a value from the file applies only where neither a flag nor an
//! environment variable (`MOONCAKE_BOOTSTRAP_PORT`, `INFERENCE_POOL`,
//! `ENABLE_PREFILLER_SAMPLING`) set it, so the order is file < env < flags.
//!
//! Unknown keys are errors that name the key (upstream is strict too), and so are upstream keys
//! this sidecar does not implement: silently ignoring a setting would run a different proxy
//! than the file describes. lunakv's own flags (`host`, `ssrf-allowlist`, `idle-conn-timeout`,
//! ...) are accepted under their flag names as well.

use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::ArgMatches;
use clap::parser::ValueSource;
use serde::Deserialize;

use crate::config::{Cli, ConfigError, parse_duration};

/// A list given as a YAML sequence or as one comma-separated string (`prefiller,decoder`).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum List {
    Seq(Vec<String>),
    Csv(String),
}

impl List {
    fn items(self) -> Vec<String> {
        match self {
            List::Seq(v) => v,
            List::Csv(s) => s
                .split(',')
                .map(|x| x.trim().to_string())
                .filter(|x| !x.is_empty())
                .collect(),
        }
    }
}

/// Every key the file may hold.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
struct FileConfig {
    port: Option<u16>,
    model_server_port: Option<u16>,
    vllm_port: Option<u16>,
    mooncake_bootstrap_port: Option<u16>,
    data_parallel_size: Option<u16>,
    kv_connector: Option<String>,
    enable_ssrf_protection: Option<bool>,
    enable_prefiller_sampling: Option<bool>,
    secure_serving: Option<bool>,
    secure_proxy: Option<bool>,
    cert_path: Option<PathBuf>,
    enable_tls: Option<List>,
    tls_insecure_skip_verify: Option<List>,
    inference_pool: Option<String>,
    max_idle_conns_per_host: Option<usize>,
    prefill_max_retries: Option<u32>,
    prefill_retry_backoff: Option<String>,
    tracing: Option<bool>,
    // lunakv's own flags.
    host: Option<std::net::IpAddr>,
    model_server_host: Option<String>,
    ssrf_allowlist: Option<List>,
    ssrf_allowlist_file: Option<PathBuf>,
    idle_conn_timeout: Option<String>,
    max_body_bytes: Option<usize>,
    max_buffered_body_bytes: Option<usize>,
    worker_threads: Option<usize>,
    // Upstream keys with no implementation here: refused by name (see the module docs).
    ec_connector: Option<serde_norway::Value>,
    p2p_connector_port: Option<serde_norway::Value>,
    enable_speculative_prefill: Option<serde_norway::Value>,
    enable_p2p_pull: Option<serde_norway::Value>,
    tls_min_version: Option<serde_norway::Value>,
    tls_cipher_suites: Option<serde_norway::Value>,
    pool_group: Option<serde_norway::Value>,
    decode_chunk_size: Option<serde_norway::Value>,
    metrics_port: Option<serde_norway::Value>,
    metrics_cert_dir: Option<serde_norway::Value>,
}

fn bad(source: &str, msg: impl std::fmt::Display) -> ConfigError {
    ConfigError::Invalid(format!("{source}: {msg}"))
}

/// Reads the YAML named by `--configuration-file` or given inline by `--configuration` and
/// merges it under what the command line and the environment set.
pub fn merge(cli: &mut Cli, m: &ArgMatches) -> Result<(), ConfigError> {
    let (source, text) = match (&cli.configuration_file, &cli.configuration) {
        (Some(_), Some(_)) => {
            return Err(ConfigError::Invalid(
                "--configuration-file and --configuration are mutually exclusive; pass one".into(),
            ));
        }
        (Some(path), None) => (
            format!("configuration file {}", path.display()),
            read(path)?,
        ),
        (None, Some(inline)) => ("--configuration".to_string(), inline.clone()),
        (None, None) => return Ok(()),
    };
    // An empty document is an empty configuration, not an error.
    if text.trim().is_empty() {
        return Ok(());
    }
    let f: FileConfig = serde_norway::from_str(&text).map_err(|e| bad(&source, e))?;
    f.apply(cli, m, &source)
}

fn read(path: &Path) -> Result<String, ConfigError> {
    std::fs::read_to_string(path).map_err(|e| {
        ConfigError::Invalid(format!(
            "cannot read --configuration-file {}: {e}",
            path.display()
        ))
    })
}

impl FileConfig {
    fn apply(self, cli: &mut Cli, m: &ArgMatches, source: &str) -> Result<(), ConfigError> {
        let unsupported = [
            ("ec-connector", self.ec_connector.is_some()),
            ("p2p-connector-port", self.p2p_connector_port.is_some()),
            (
                "enable-speculative-prefill",
                self.enable_speculative_prefill.is_some(),
            ),
            ("enable-p2p-pull", self.enable_p2p_pull.is_some()),
            ("tls-min-version", self.tls_min_version.is_some()),
            ("tls-cipher-suites", self.tls_cipher_suites.is_some()),
            ("pool-group", self.pool_group.is_some()),
            ("decode-chunk-size", self.decode_chunk_size.is_some()),
            ("metrics-port", self.metrics_port.is_some()),
            ("metrics-cert-dir", self.metrics_cert_dir.is_some()),
        ];
        if let Some((key, _)) = unsupported.iter().find(|(_, set)| *set) {
            return Err(bad(
                source,
                format!(
                    "field `{key}` is an llm-d-router option lunakv-sidecar does not implement; remove it (see docs/PD.md)"
                ),
            ));
        }
        // Only where neither a flag nor an environment variable spoke.
        let free = |id: &str| {
            !matches!(
                m.value_source(id),
                Some(ValueSource::CommandLine | ValueSource::EnvVariable)
            )
        };
        let port_range = |key: &str, v: u16| {
            if v == 0 {
                Err(bad(
                    source,
                    format!("field `{key}`: 0 is not a port (1..65535)"),
                ))
            } else {
                Ok(v)
            }
        };
        let duration = |key: &str, v: &str| -> Result<Duration, ConfigError> {
            parse_duration(v).map_err(|e| bad(source, format!("field `{key}`: {e}")))
        };
        macro_rules! set {
            ($field:ident, $id:literal, $v:expr) => {
                if let Some(v) = $v
                    && free($id)
                {
                    cli.$field = v;
                }
            };
        }
        set!(port, "port", self.port);
        // model-server-port is the newer name; it wins over vllm-port in the file too.
        set!(
            vllm_port,
            "vllm_port",
            self.model_server_port.or(self.vllm_port)
        );
        if let Some(p) = self.mooncake_bootstrap_port {
            let p = port_range("mooncake-bootstrap-port", p)?;
            set!(mooncake_bootstrap_port, "mooncake_bootstrap_port", Some(p));
        }
        if let Some(n) = self.data_parallel_size {
            if n == 0 {
                return Err(bad(
                    source,
                    "field `data-parallel-size`: must be at least 1",
                ));
            }
            set!(data_parallel_size, "data_parallel_size", Some(n));
        }
        set!(kv_connector, "kv_connector", self.kv_connector);
        set!(
            enable_ssrf_protection,
            "enable_ssrf_protection",
            self.enable_ssrf_protection
        );
        set!(
            enable_prefiller_sampling,
            "enable_prefiller_sampling",
            self.enable_prefiller_sampling
        );
        set!(
            secure_proxy,
            "secure_proxy",
            self.secure_serving.or(self.secure_proxy)
        );
        set!(cert_path, "cert_path", self.cert_path.map(Some));
        set!(enable_tls, "enable_tls", self.enable_tls.map(List::items));
        set!(
            tls_insecure_skip_verify,
            "tls_insecure_skip_verify",
            self.tls_insecure_skip_verify.map(List::items)
        );
        set!(
            inference_pool,
            "inference_pool",
            self.inference_pool.map(Some)
        );
        set!(
            max_idle_conns_per_host,
            "max_idle_conns_per_host",
            self.max_idle_conns_per_host
        );
        set!(
            prefill_max_retries,
            "prefill_max_retries",
            self.prefill_max_retries
        );
        if let Some(v) = &self.prefill_retry_backoff {
            let d = duration("prefill-retry-backoff", v)?;
            set!(prefill_retry_backoff, "prefill_retry_backoff", Some(d));
        }
        set!(tracing, "tracing", self.tracing);
        set!(host, "host", self.host);
        set!(
            model_server_host,
            "model_server_host",
            self.model_server_host
        );
        set!(
            ssrf_allowlist,
            "ssrf_allowlist",
            self.ssrf_allowlist.map(List::items)
        );
        set!(
            ssrf_allowlist_file,
            "ssrf_allowlist_file",
            self.ssrf_allowlist_file.map(Some)
        );
        if let Some(v) = &self.idle_conn_timeout {
            let d = duration("idle-conn-timeout", v)?;
            set!(idle_conn_timeout, "idle_conn_timeout", Some(d));
        }
        set!(max_body_bytes, "max_body_bytes", self.max_body_bytes);
        set!(
            max_buffered_body_bytes,
            "max_buffered_body_bytes",
            self.max_buffered_body_bytes
        );
        set!(worker_threads, "worker_threads", self.worker_threads);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::ConfigError;
    use crate::config::{Connector, SidecarConfig, parse_args};
    use std::time::Duration;

    fn with_file(yaml: &str, flags: &[&str]) -> Result<SidecarConfig, ConfigError> {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("sidecar.yaml");
        std::fs::write(&f, yaml).unwrap();
        let arg = format!("--configuration-file={}", f.display());
        let args = ["lunakv-sidecar", arg.as_str()]
            .into_iter()
            .chain(flags.iter().copied());
        parse_args(args).and_then(SidecarConfig::from_cli)
    }

    #[test]
    fn file_values_apply_under_flags() {
        let yaml = "port: 9100\nmodel-server-port: 9300\nvllm-port: 9999\nkv-connector: mooncake\n\
                    enable-tls: [prefiller]\ntls-insecure-skip-verify: prefiller,decoder\n\
                    prefill-max-retries: 3\nprefill-retry-backoff: 1s\nsecure-serving: false\n\
                    data-parallel-size: 2\nssrf-allowlist: [\"a:1\", \"b:2\"]\n";
        let c = with_file(yaml, &["--port=9200"]).unwrap();
        assert_eq!(c.port, 9200, "a flag beats the file");
        assert_eq!(c.vllm_port, 9300, "model-server-port wins over vllm-port");
        assert_eq!(c.connector, Connector::Mooncake);
        assert!(c.tls.prefiller && !c.tls.decoder);
        assert!(c.skip_verify.prefiller && c.skip_verify.decoder);
        assert_eq!(c.prefill_max_retries, 3);
        assert_eq!(c.prefill_retry_backoff, Duration::from_secs(1));
        assert!(!c.secure_proxy);
        assert_eq!(c.data_parallel_size, 2);
        assert_eq!(c.ssrf_allowlist, vec!["a:1".to_string(), "b:2".to_string()]);
        // Flags still win field by field.
        let c = with_file(yaml, &["--kv-connector=nixlv2", "--secure-proxy=true"]).unwrap();
        assert_eq!(c.connector, Connector::NixlV2);
        assert!(c.secure_proxy);
        // Inline, and an empty document.
        let c = parse_args([
            "x",
            "--configuration={port: 8085, kv-connector: shared-storage}",
        ])
        .and_then(SidecarConfig::from_cli)
        .unwrap();
        assert_eq!((c.port, c.connector), (8085, Connector::SharedStorage));
        assert_eq!(with_file("", &[]).unwrap().port, 8000);
    }

    #[test]
    fn bad_files_name_the_field_and_the_value() {
        let cases: &[(&str, &[&str])] = &[
            ("prot: 8000\n", &["prot", "sidecar.yaml"]),
            ("port: eighty\n", &["port", "eighty"]),
            ("port: 70000\n", &["port", "70000"]),
            (
                "mooncake-bootstrap-port: 0\n",
                &["mooncake-bootstrap-port", "0"],
            ),
            ("data-parallel-size: 0\n", &["data-parallel-size"]),
            (
                "prefill-retry-backoff: soon\n",
                &["prefill-retry-backoff", "soon"],
            ),
            ("kv-connector: lmcache\n", &["lmcache", "mooncake"]),
            ("enable-tls: [encoder]\n", &["encoder", "--enable-tls"]),
            (
                "decode-chunk-size: 4\n",
                &["decode-chunk-size", "does not implement"],
            ),
            ("- a\n- b\n", &["sidecar.yaml"]),
        ];
        for (yaml, needles) in cases {
            let e = with_file(yaml, &[]).expect_err(yaml).to_string();
            for n in *needles {
                assert!(e.contains(n), "{yaml:?}: {e}");
            }
        }
        let e = parse_args(["x", "--configuration-file=/nonexistent/x.yaml"]).unwrap_err();
        assert!(e.to_string().contains("/nonexistent/x.yaml"), "{e}");
        let e = parse_args(["x", "--configuration-file=/x", "--configuration={}"]).unwrap_err();
        assert!(e.to_string().contains("mutually exclusive"), "{e}");
    }

    #[test]
    fn inference_pool_with_ssrf_is_refused_with_the_alternative() {
        let e = parse_args(["x", "--enable-ssrf-protection", "--inference-pool=ns/pool"])
            .and_then(SidecarConfig::from_cli)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("ns/pool") && e.contains("--ssrf-allowlist"),
            "{e}"
        );
        // Without SSRF protection upstream does not use it either: accepted, ignored.
        assert!(
            parse_args(["x", "--inference-pool=ns/pool"])
                .and_then(SidecarConfig::from_cli)
                .is_ok()
        );
    }
}
