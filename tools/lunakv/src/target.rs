//! Which master to talk to, and how: flag > `MOONCAKE_MASTER` > config file > default.
//!
//! The environment is read through a function (as in `lunakv-config`) so the precedence is unit
//! tested without touching the process environment.

use std::path::{Path, PathBuf};

use lunakv_config::client::CONFIG_PATH_ENV;
use lunakv_config::{ConfigWarning, MasterAddress, MooncakeConfig};
use lunakv_proto::ErrorCode;

use crate::error::Coded;

/// The master when nothing names one: Mooncake's default rpc port on loopback.
pub const DEFAULT_MASTER: &str = "127.0.0.1:50051";

/// Where a value came from, for messages ("master 10.0.0.1:50051 (from MOONCAKE_MASTER)").
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    Flag,
    Env,
    Config(PathBuf),
    Default,
}

impl std::fmt::Display for Origin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Origin::Flag => f.write_str("--master"),
            Origin::Env => f.write_str("MOONCAKE_MASTER"),
            Origin::Config(p) => write!(f, "master_server_address in {}", p.display()),
            Origin::Default => f.write_str("the default"),
        }
    }
}

/// The resolved master and client settings for the kv commands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// `host:port` of the master's gRPC endpoint.
    pub master: String,
    pub origin: Origin,
    /// Same-host shared memory for transfers: off with `LUNAKV_DISABLE_SHM=1` or the config's
    /// `"enable_shm": false`.
    pub enable_shm: bool,
}

/// [`resolve`] with the real process environment.
pub fn resolve_cli(master: &Option<String>, config: &Option<PathBuf>) -> anyhow::Result<Target> {
    resolve(
        master.as_deref(),
        config.as_deref(),
        &lunakv_config::process_env,
    )
}

pub fn resolve(
    master_flag: Option<&str>,
    config_flag: Option<&Path>,
    env: &dyn Fn(&str) -> Option<String>,
) -> anyhow::Result<Target> {
    let env = |k: &str| env(k).filter(|v| !v.trim().is_empty());
    let env_master = env("MOONCAKE_MASTER");
    // An explicit --config is always read (a bad file is an error the user wants to see). A
    // path from the environment is read only when it is still needed for the address, so a
    // stale MOONCAKE_CONFIG_PATH does not break `lunakv --master X status`.
    let config_path = match config_flag {
        Some(p) => Some(p.to_path_buf()),
        None if master_flag.is_none() && env_master.is_none() => {
            env(CONFIG_PATH_ENV).map(PathBuf::from)
        }
        None => None,
    };
    let config = config_path.as_deref().map(load_config).transpose()?;

    let (value, origin) = if let Some(m) = master_flag {
        (m.to_owned(), Origin::Flag)
    } else if let Some(m) = env_master {
        (m, Origin::Env)
    } else if let (Some(c), Some(p)) = (&config, &config_path)
        && !c.master_server_address.trim().is_empty()
    {
        (c.master_server_address.clone(), Origin::Config(p.clone()))
    } else {
        (DEFAULT_MASTER.to_owned(), Origin::Default)
    };
    // host:port, or etcd://h1:2379;h2:2379 to follow an HA leader.
    let master = MasterAddress::parse(&origin.to_string(), &value)
        .map_err(|e| Coded::new(ErrorCode::InvalidParams, e.to_string()))?
        .to_string();

    let shm_off = env("LUNAKV_DISABLE_SHM").is_some_and(|v| {
        matches!(
            v.trim().to_ascii_lowercase().as_str(),
            "1" | "true" | "yes" | "on"
        )
    });
    let enable_shm = !shm_off && config.as_ref().is_none_or(|c| c.enable_shm);
    Ok(Target {
        master,
        origin,
        enable_shm,
    })
}

/// Loads and validates the file exactly as an engine's connector would (vLLM's mode and size
/// checks, lunakv's stricter ones), so pointing the CLI at an engine's mooncake_config.json also
/// checks it. The CLI itself then acts as a pure requester whatever the mode.
fn load_config(path: &Path) -> anyhow::Result<MooncakeConfig> {
    let loaded = MooncakeConfig::load(path, &|_: &str| None::<String>)
        .map_err(|e| Coded::new(ErrorCode::InvalidParams, format!("{}: {e}", path.display())))?;
    for w in loaded.warnings.iter().filter(|w| concerns_the_cli(w)) {
        eprintln!("lunakv: warning: {w}");
    }
    Ok(loaded.config)
}

/// Whether a config warning bears on what a CLI call does. Warnings about how the engine sets up
/// its pool (offload, SSD keys, the metadata server) do not: the CLI only makes requests, so on
/// every `put`/`get`/`status` they would repeat advice the call cannot act on. `lunakv doctor`
/// reports them in its `engine_config` row. A typo'd key still warns here: it may be why the
/// CLI reaches the wrong master.
fn concerns_the_cli(w: &ConfigWarning) -> bool {
    !matches!(
        w,
        ConfigWarning::StandaloneWithoutOffload
            | ConfigWarning::EmbeddedOffloadWithoutPreferredSegment
            | ConfigWarning::IgnoredSsdOffloadKey { .. }
            | ConfigWarning::MetadataServerIgnored { .. }
            | ConfigWarning::OffloadNotImplemented
    )
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn env_of(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> + use<> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).cloned()
    }

    fn config_file(body: &str) -> tempfile::NamedTempFile {
        let f = tempfile::NamedTempFile::new().expect("temp file");
        std::fs::write(f.path(), body).expect("write");
        f
    }

    #[test]
    fn default_when_nothing_is_set() {
        let t = resolve(None, None, &env_of(&[])).expect("resolves");
        assert_eq!(t.master, DEFAULT_MASTER);
        assert_eq!(t.origin, Origin::Default);
        assert!(t.enable_shm);
    }

    #[test]
    fn flag_beats_env_beats_config() {
        let f = config_file(r#"{"master_server_address": "10.0.0.3:3", "enable_shm": false}"#);
        let path = f.path().to_str().expect("utf-8 path");
        let env = env_of(&[("MOONCAKE_MASTER", "10.0.0.2:2"), (CONFIG_PATH_ENV, path)]);

        let t = resolve(Some("10.0.0.1:1"), Some(f.path()), &env).expect("resolves");
        assert_eq!((t.master.as_str(), t.origin), ("10.0.0.1:1", Origin::Flag));
        // --config was given explicitly, so its enable_shm still applies.
        assert!(!t.enable_shm);

        let t = resolve(None, Some(f.path()), &env).expect("resolves");
        assert_eq!((t.master.as_str(), t.origin), ("10.0.0.2:2", Origin::Env));

        let t = resolve(None, None, &env_of(&[(CONFIG_PATH_ENV, path)])).expect("resolves");
        assert_eq!(t.master, "10.0.0.3:3");
        assert_eq!(t.origin, Origin::Config(f.path().to_path_buf()));
        assert!(!t.enable_shm);

        let t = resolve(None, Some(f.path()), &env_of(&[])).expect("resolves");
        assert_eq!(t.master, "10.0.0.3:3");
    }

    #[test]
    fn config_without_address_is_refused_like_an_engine_would() {
        let f = config_file(r#"{"mode": "standalone-store", "global_segment_size": 0}"#);
        let e = resolve(None, Some(f.path()), &env_of(&[])).expect_err("invalid config");
        assert!(e.to_string().contains("master_server_address"), "{e}");
    }

    #[test]
    fn stale_config_env_is_ignored_when_the_address_is_known() {
        let env = env_of(&[
            (CONFIG_PATH_ENV, "/nonexistent/mooncake.json"),
            ("MOONCAKE_MASTER", "10.0.0.2:2"),
        ]);
        assert_eq!(
            resolve(None, None, &env).expect("resolves").master,
            "10.0.0.2:2"
        );
        // ...but an explicit --config that cannot be read is an error naming the file.
        let err = resolve(
            None,
            Some(Path::new("/nonexistent/mooncake.json")),
            &env_of(&[]),
        )
        .expect_err("missing file");
        assert!(
            err.to_string().contains("/nonexistent/mooncake.json"),
            "{err}"
        );
    }

    #[test]
    fn bad_addresses_and_files_name_their_source() {
        let err =
            resolve(None, None, &env_of(&[("MOONCAKE_MASTER", "nohost")])).expect_err("no port");
        assert!(err.to_string().contains("MOONCAKE_MASTER"), "{err}");
        let err = resolve(Some("redis://10.0.0.1:6379"), None, &env_of(&[])).expect_err("scheme");
        assert!(err.to_string().contains("--master"), "{err}");
        // An HA address is kept as is: the client library follows the leader through etcd.
        let t = resolve(
            Some("etcd://10.0.0.1:2379;10.0.0.2:2379"),
            None,
            &env_of(&[]),
        )
        .expect("etcd");
        assert_eq!(t.master, "etcd://10.0.0.1:2379;10.0.0.2:2379");
        let f = config_file("{\"master_server_address\": ");
        let err = resolve(None, Some(f.path()), &env_of(&[])).expect_err("truncated");
        assert!(
            err.to_string().contains(&f.path().display().to_string()),
            "{err}"
        );
        assert_eq!(crate::error::code_of(&err), ErrorCode::InvalidParams);
    }

    #[test]
    fn only_warnings_about_the_cli_call_are_printed() {
        assert!(!concerns_the_cli(&ConfigWarning::StandaloneWithoutOffload));
        assert!(!concerns_the_cli(
            &ConfigWarning::EmbeddedOffloadWithoutPreferredSegment
        ));
        assert!(concerns_the_cli(&ConfigWarning::UnknownKey {
            origin: "c.json".into(),
            key: "master_server_adress".into(),
            did_you_mean: Some("master_server_address"),
        }));
    }

    #[test]
    fn shm_can_be_disabled_from_the_environment() {
        let t = resolve(None, None, &env_of(&[("LUNAKV_DISABLE_SHM", "1")])).expect("resolves");
        assert!(!t.enable_shm);
        let t = resolve(None, None, &env_of(&[("LUNAKV_DISABLE_SHM", "0")])).expect("resolves");
        assert!(t.enable_shm);
    }
}
