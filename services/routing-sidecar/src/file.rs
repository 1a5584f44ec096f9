//! The sidecar's layers through lunakv's one layered loader ([`lunakv_config::layered`]):
//! the [`Cli`] defaults < `--configuration-file` / `--configuration` (llm-d-router's
//! pd-sidecar YAML, a flat map whose keys are the flag names: `port: 8000`,
//! `kv-connector: mooncake`, `enable-tls: [prefiller]`) < the environment
//! ([`ENV_VARS`]: `MOONCAKE_BOOTSTRAP_PORT`, `INFERENCE_POOL`, `ENABLE_PREFILLER_SAMPLING`) <
//! the flags given on the command line.
//!
//! What differs from the master and the store, and why: keys are kebab-case (they are llm-d's
//! flag names); two keys have upstream's newer names as aliases ([`ALIASES`],
//! `model-server-port`, `secure-serving`), which win over the older ones; lists are a YAML
//! sequence or one comma-separated string; durations are Go's (`1m30s`); the file may come
//! inline. Unknown keys are errors that name the key (upstream is strict too), and so are
//! upstream keys this sidecar does not implement ([`UPSTREAM_KEYS`]): silently ignoring a
//! setting would run a different proxy than the file describes.

use clap::ArgMatches;
use clap::parser::ValueSource;
use lunakv_config::gflags::{Upstream, UpstreamFlag};
use lunakv_config::layered::{self, FileText, Names, Schema};

use crate::config::{Cli, ConfigError};

/// The environment variable of each key that has one: upstream's names, one by one.
pub const ENV_VARS: &[(&str, &str)] = &[
    ("mooncake-bootstrap-port", "MOONCAKE_BOOTSTRAP_PORT"),
    ("inference-pool", "INFERENCE_POOL"),
    ("enable-prefiller-sampling", "ENABLE_PREFILLER_SAMPLING"),
];

/// `(alias, key)`: upstream's newer names; in one layer the alias wins.
pub const ALIASES: &[(&str, &str)] = &[
    ("model-server-port", "vllm-port"),
    ("secure-serving", "secure-proxy"),
];

const NOT_IMPLEMENTED: &str =
    "an llm-d-router option lunakv-sidecar does not implement; remove it (see docs/PD.md)";

const fn refused(name: &'static str) -> UpstreamFlag {
    UpstreamFlag {
        name,
        boolean: false,
        treatment: Upstream::Refused(NOT_IMPLEMENTED),
    }
}

/// llm-d-router keys with no implementation here: refused by name (see the module docs).
pub const UPSTREAM_KEYS: &[UpstreamFlag] = &[
    refused("ec-connector"),
    refused("p2p-connector-port"),
    refused("enable-speculative-prefill"),
    refused("enable-p2p-pull"),
    refused("tls-min-version"),
    refused("tls-cipher-suites"),
    refused("pool-group"),
    refused("decode-chunk-size"),
    refused("metrics-port"),
    refused("metrics-cert-dir"),
];

/// What the layered loader needs to know about the sidecar.
pub const SCHEMA: Schema = Schema {
    service: "sidecar",
    // Unused: the sidecar names its variables in ENV_VARS.
    env_prefix: "",
    upstream: UPSTREAM_KEYS,
};

/// Loads the layers over `cli`'s defaults. `matches` says which flags the command line gave:
/// only those are the flag layer (clap's defaults and its reading of the environment, kept for
/// `--help` and clap's messages, are not).
pub fn load(
    cli: Cli,
    matches: &ArgMatches,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Cli, ConfigError> {
    let file = match (&cli.configuration_file, &cli.configuration) {
        (Some(_), Some(_)) => {
            return Err(ConfigError::Invalid(
                "--configuration-file and --configuration are mutually exclusive; pass one".into(),
            ));
        }
        (Some(path), None) => Some(layered::read_file(&SCHEMA, path)?),
        (None, Some(inline)) => Some(FileText {
            name: "--configuration".to_string(),
            text: inline.clone(),
        }),
        (None, None) => None,
    };
    let given =
        |key: &str| matches.value_source(&key.replace('-', "_")) == Some(ValueSource::CommandLine);
    let flags: Vec<(String, String)> = layered::flags_of(&cli)
        .into_iter()
        .filter(|(k, _)| given(k))
        .collect();
    let names = Names {
        env: Some(ENV_VARS),
        aliases: ALIASES,
    };
    let loaded = layered::load_named::<Cli>(&SCHEMA, &names, file.as_ref(), &flags, env)?;
    Ok(Cli {
        configuration_file: cli.configuration_file,
        configuration: cli.configuration,
        ..loaded.config
    })
}

/// Parses `args` (the program name first) and loads the layers: `--configuration-file` (or
/// `--configuration`) < the environment < the flags given.
pub fn parse_args<I, T>(args: I) -> Result<Cli, ConfigError>
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    parse_args_with(args, &lunakv_config::process_env)
}

/// [`parse_args`] with the environment read through `env` (tests pass a map).
pub fn parse_args_with<I, T>(
    args: I,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Cli, ConfigError>
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    use clap::{CommandFactory, FromArgMatches};
    let matches = Cli::command().try_get_matches_from(args)?;
    let cli = Cli::from_arg_matches(&matches)?;
    load(cli, &matches, env)
}

#[cfg(test)]
mod tests {
    use crate::ConfigError;
    use crate::config::{Connector, SidecarConfig};
    use crate::file::{parse_args, parse_args_with};
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

    fn env_of(pairs: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        move |k| {
            pairs
                .iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn file_then_env_then_flags() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("sidecar.yaml");
        std::fs::write(
            &f,
            "mooncake-bootstrap-port: 9001\ninference-pool: from-file\nport: 9100\n\
             enable-prefiller-sampling: false\nidle-conn-timeout: 3s\n",
        )
        .unwrap();
        let file = format!("--configuration-file={}", f.display());
        let env = env_of(&[
            ("MOONCAKE_BOOTSTRAP_PORT", "9002"),
            ("ENABLE_PREFILLER_SAMPLING", "true"),
        ]);
        let c = parse_args_with(
            [
                "x",
                file.as_str(),
                "--port=9200",
                "--prefill-retry-backoff=1.5s",
            ],
            &env,
        )
        .unwrap();
        assert_eq!(c.prefill_retry_backoff, Duration::from_millis(1500));
        assert_eq!(c.mooncake_bootstrap_port, 9002, "env beats the file");
        assert!(c.enable_prefiller_sampling, "env beats the file");
        assert_eq!(c.inference_pool.as_deref(), Some("from-file"));
        assert_eq!(c.port, 9200, "a flag beats the file");
        assert_eq!(c.idle_conn_timeout, Duration::from_secs(3));
        let c =
            parse_args_with(["x", file.as_str(), "--mooncake-bootstrap-port=9003"], &env).unwrap();
        assert_eq!(c.mooncake_bootstrap_port, 9003, "a flag beats env");
        // A flag given with its default value still beats the file.
        let c = parse_args_with(["x", file.as_str(), "--port=8000"], &|_| None).unwrap();
        assert_eq!((c.port, c.mooncake_bootstrap_port), (8000, 9001));
        // List flags and the aliases go through the same layers.
        let c = parse_args_with(
            [
                "x",
                "--configuration={enable-tls: decoder, secure-proxy: false}",
                "--enable-tls=prefiller",
                "--secure-serving=true",
            ],
            &|_| None,
        )
        .and_then(SidecarConfig::from_cli)
        .unwrap();
        assert!(c.tls.prefiller && !c.tls.decoder);
        assert!(c.secure_proxy);
    }

    #[test]
    fn a_bad_environment_value_names_its_variable() {
        let e = parse_args_with(
            ["x"],
            &env_of(&[("ENABLE_PREFILLER_SAMPLING", "sometimes")]),
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("enable-prefiller-sampling")
                && e.contains("sometimes")
                && e.contains("environment variable ENABLE_PREFILLER_SAMPLING"),
            "{e}"
        );
        let e = parse_args_with(["x"], &env_of(&[("MOONCAKE_BOOTSTRAP_PORT", "0")]))
            .and_then(SidecarConfig::from_cli)
            .unwrap_err()
            .to_string();
        assert!(e.contains("--mooncake-bootstrap-port 0"), "{e}");
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
