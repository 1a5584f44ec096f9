//! mTLS on the master's and the bootstrap's gRPC ports: where each process finds its
//! certificate, its key and the CA it trusts, and which client identities are admins.
//!
//! The same three variables serve servers and clients (docs/SECURITY.md, "mTLS and identities"):
//!
//! | variable | on a server (master, bootstrap) | on a client (engine, store, CLI, standby master) |
//! |---|---|---|
//! | `LUNAKV_TLS_CERT`, `LUNAKV_TLS_KEY` | its certificate and key: TLS on | the client certificate it presents |
//! | `LUNAKV_TLS_CACERT` | the CA client certificates must chain to: a client certificate is required | the CA the server's certificate must chain to: TLS on |
//! | `LUNAKV_TLS_SERVER_NAME` | - | the name expected in the server's certificate (default: the host dialled) |
//! | `LUNAKV_ADMIN_IDENTITIES` | master: the client identities (CN or first SAN) that are admins | - |
//! | `LUNAKV_ADMIN_TLS` | master: `1` serves the admin HTTP port (metrics, probes, listings) as HTTPS with the same files; client certificates asked but optional | - |
//!
//! An engine may give the three files as `tls_cert`, `tls_key` and `tls_cacert` in the
//! mooncake_config.json that `MOONCAKE_CONFIG_PATH` names; the variables win. The files are PEM;
//! servers and clients reread them when they change ([`crate`] only finds them; `lunakv-tls`
//! loads them). Nothing set: plaintext, as on loopback.

use std::path::{Path, PathBuf};

use crate::ConfigError;

pub use crate::{ENV_TLS_CACERT, ENV_TLS_CERT, ENV_TLS_KEY};
pub const ENV_TLS_SERVER_NAME: &str = "LUNAKV_TLS_SERVER_NAME";
pub const ENV_ADMIN_IDENTITIES: &str = "LUNAKV_ADMIN_IDENTITIES";
/// Master: the client certificate identities that may mount segments (comma list).
pub const ENV_MOUNT_IDENTITIES: &str = "LUNAKV_MOUNT_IDENTITIES";
pub const ENV_ADMIN_TLS: &str = "LUNAKV_ADMIN_TLS";

/// The mooncake_config.json keys an engine may give its files in.
pub const KEY_TLS_CERT: &str = "tls_cert";
pub const KEY_TLS_KEY: &str = "tls_key";
pub const KEY_TLS_CACERT: &str = "tls_cacert";

/// One PEM file and where its path was given (a variable, or a key of a config file), so every
/// message about it names both.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFile {
    pub path: PathBuf,
    /// `LUNAKV_TLS_CERT`, or `tls_cert in /etc/mooncake/config.json`.
    pub origin: String,
}

impl std::fmt::Display for TlsFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.path.display(), self.origin)
    }
}

/// What a process found: a certificate and its key, a CA, a server name to expect.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsPaths {
    pub cert: Option<TlsFile>,
    pub key: Option<TlsFile>,
    pub ca: Option<TlsFile>,
    /// Clients only: the name the server's certificate must carry.
    pub server_name: Option<String>,
}

impl TlsPaths {
    /// A server's files, from the variables. Refused: a certificate without its key (or the
    /// reverse), a CA without a certificate (a server cannot ask for client certificates
    /// without speaking TLS), a file that cannot be read.
    pub fn server_from_env(env: &dyn Fn(&str) -> Option<String>) -> Result<TlsPaths, ConfigError> {
        let p = TlsPaths::from_vars(env);
        p.check_pair()?;
        if p.ca.is_some() && p.cert.is_none() {
            return Err(invalid(
                ENV_TLS_CACERT,
                &p.ca
                    .as_ref()
                    .map(|c| c.path.display().to_string())
                    .unwrap_or_default(),
                "a server asks for client certificates only over TLS, and TLS needs its own \
                 certificate",
                "set LUNAKV_TLS_CERT and LUNAKV_TLS_KEY to this server's certificate and key too",
            ));
        }
        p.check_readable()?;
        Ok(p)
    }

    /// A client's files: the variables, else the `tls_*` keys of the mooncake_config.json that
    /// `MOONCAKE_CONFIG_PATH` names (relative paths there are relative to the file). Refused: a
    /// certificate without its key (or the reverse), a certificate without the CA (the client
    /// must verify the server it sends it to), a file that cannot be read.
    pub fn client_from_env(env: &dyn Fn(&str) -> Option<String>) -> Result<TlsPaths, ConfigError> {
        let mut p = TlsPaths::from_vars(env);
        if p.cert.is_none() && p.key.is_none() && p.ca.is_none() {
            p = TlsPaths {
                server_name: p.server_name,
                ..config_file_paths(env)
            };
        }
        p.check_pair()?;
        if let (Some(c), None) = (&p.cert, &p.ca) {
            return Err(invalid(
                &c.origin,
                &c.path.display().to_string(),
                "a client certificate is only sent over TLS, and the client needs the CA to \
                 verify the server it sends it to",
                "set LUNAKV_TLS_CACERT (or tls_cacert) to the CA that signed the server's \
                 certificate",
            ));
        }
        p.check_readable()?;
        Ok(p)
    }

    /// A server's files ask every caller for a certificate from the CA (mTLS).
    pub fn requires_client_certificates(&self) -> bool {
        self.cert.is_some() && self.ca.is_some()
    }

    /// Whether TLS is on: a server with a certificate, a client with a CA.
    pub fn is_on(&self) -> bool {
        self.cert.is_some() || self.ca.is_some()
    }

    fn from_vars(env: &dyn Fn(&str) -> Option<String>) -> TlsPaths {
        let file = |var: &str| {
            env(var).map(|p| TlsFile {
                path: PathBuf::from(p.trim()),
                origin: var.to_string(),
            })
        };
        TlsPaths {
            cert: file(ENV_TLS_CERT),
            key: file(ENV_TLS_KEY),
            ca: file(ENV_TLS_CACERT),
            server_name: env(ENV_TLS_SERVER_NAME).map(|s| s.trim().to_string()),
        }
    }

    fn check_pair(&self) -> Result<(), ConfigError> {
        match (&self.cert, &self.key) {
            (Some(_), Some(_)) | (None, None) => Ok(()),
            (Some(f), None) | (None, Some(f)) => Err(invalid(
                &f.origin,
                &f.path.display().to_string(),
                "a certificate needs its key, and a key its certificate",
                "set both LUNAKV_TLS_CERT and LUNAKV_TLS_KEY (or tls_cert and tls_key), or neither",
            )),
        }
    }

    fn check_readable(&self) -> Result<(), ConfigError> {
        for f in [&self.cert, &self.key, &self.ca].into_iter().flatten() {
            if let Err(e) = std::fs::File::open(&f.path) {
                return Err(invalid(
                    &f.origin,
                    &f.path.display().to_string(),
                    &format!("cannot read it: {e}"),
                    "point it at a readable PEM file (a mounted Secret, for example)",
                ));
            }
        }
        Ok(())
    }
}

/// The `tls_*` keys of the engine's mooncake_config.json, when `MOONCAKE_CONFIG_PATH` names one
/// that parses. A file that does not is reported by the setup that loads it, not here.
fn config_file_paths(env: &dyn Fn(&str) -> Option<String>) -> TlsPaths {
    let Some(path) = env(crate::client::CONFIG_PATH_ENV) else {
        return TlsPaths::default();
    };
    let path = PathBuf::from(path);
    let Ok(text) = std::fs::read_to_string(&path) else {
        return TlsPaths::default();
    };
    let Ok(loaded) = crate::MooncakeConfig::from_json_str(&text, &path.display().to_string())
    else {
        return TlsPaths::default();
    };
    let c = loaded.config;
    let dir = path.parent().unwrap_or(Path::new("."));
    let file = |key: &str, value: &str| {
        (!value.trim().is_empty()).then(|| TlsFile {
            path: dir.join(value.trim()),
            origin: format!("{key} in {}", path.display()),
        })
    };
    TlsPaths {
        cert: file(KEY_TLS_CERT, &c.tls_cert),
        key: file(KEY_TLS_KEY, &c.tls_key),
        ca: file(KEY_TLS_CACERT, &c.tls_cacert),
        server_name: None,
    }
}

/// `LUNAKV_ADMIN_IDENTITIES`: a comma list of client identities (a certificate's CN, or its
/// first SAN when it has no CN) that may call the admin RPCs and act on what others mounted or
/// reserved. Empty or unset: none.
pub fn admin_identities(env: &dyn Fn(&str) -> Option<String>) -> Result<Vec<String>, ConfigError> {
    identity_list(env, ENV_ADMIN_IDENTITIES)
}

/// `LUNAKV_MOUNT_IDENTITIES`: the certificate identities that may mount a segment (the
/// store-clients', and the engines' in embedded mode); empty: any admitted caller may.
pub fn mount_identities(env: &dyn Fn(&str) -> Option<String>) -> Result<Vec<String>, ConfigError> {
    identity_list(env, ENV_MOUNT_IDENTITIES)
}

/// A comma list of certificate identities from `var`.
fn identity_list(
    env: &dyn Fn(&str) -> Option<String>,
    var: &str,
) -> Result<Vec<String>, ConfigError> {
    let Some(v) = env(var) else {
        return Ok(Vec::new());
    };
    let mut out = Vec::new();
    for part in v.split(',') {
        let id = part.trim();
        if id.is_empty() {
            continue;
        }
        if id.chars().any(char::is_control) {
            return Err(invalid(
                var,
                &v,
                "an identity holds a control character",
                "write the identities as a comma list of CNs, e.g. lunakv-admin,lunakv-master",
            ));
        }
        out.push(id.to_string());
    }
    Ok(out)
}

/// `LUNAKV_ADMIN_TLS`: whether the master's admin HTTP port serves HTTPS (`1`/`true`/`on`;
/// unset, `0`, `false`, `off`: plaintext, the default). It needs the server's files
/// ([`TlsPaths::server_from_env`]); the master refuses to start when they are missing.
pub fn admin_tls(env: &dyn Fn(&str) -> Option<String>) -> Result<bool, ConfigError> {
    let Some(v) = env(ENV_ADMIN_TLS) else {
        return Ok(false);
    };
    match v.trim().to_ascii_lowercase().as_str() {
        "" | "0" | "false" | "off" | "no" => Ok(false),
        "1" | "true" | "on" | "yes" => Ok(true),
        _ => Err(invalid(
            ENV_ADMIN_TLS,
            &v,
            "not a switch",
            "set it to 1 (the admin port serves HTTPS) or 0 (plaintext)",
        )),
    }
}

fn invalid(field: &str, value: &str, reason: &str, fix: &str) -> ConfigError {
    ConfigError::Invalid {
        field: field.to_string(),
        value: value.to_string(),
        reason: reason.to_string(),
        fix: fix.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::test_env as env;

    #[test]
    fn servers_and_clients_find_their_files_and_refuse_half_configurations_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let f = |n: &str| {
            let p = dir.path().join(n);
            std::fs::write(&p, "-----BEGIN X-----\n").unwrap();
            p.display().to_string()
        };
        let (cert, key, ca) = (f("c.pem"), f("k.pem"), f("ca.pem"));

        assert!(!TlsPaths::server_from_env(&env(&[])).unwrap().is_on());
        assert!(!TlsPaths::client_from_env(&env(&[])).unwrap().is_on());
        let s =
            TlsPaths::server_from_env(&env(&[(ENV_TLS_CERT, &cert), (ENV_TLS_KEY, &key)])).unwrap();
        assert!(s.is_on() && s.ca.is_none());
        let c = TlsPaths::client_from_env(&env(&[(ENV_TLS_CACERT, &ca)])).unwrap();
        assert!(c.is_on() && c.cert.is_none());

        let e = TlsPaths::server_from_env(&env(&[(ENV_TLS_CERT, &cert)]))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(ENV_TLS_CERT) && e.contains("LUNAKV_TLS_KEY"),
            "{e}"
        );
        let e = TlsPaths::server_from_env(&env(&[(ENV_TLS_CACERT, &ca)]))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(ENV_TLS_CACERT) && e.contains("LUNAKV_TLS_CERT"),
            "{e}"
        );
        let e = TlsPaths::client_from_env(&env(&[(ENV_TLS_CERT, &cert), (ENV_TLS_KEY, &key)]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("LUNAKV_TLS_CACERT"), "{e}");
        let e = TlsPaths::client_from_env(&env(&[(ENV_TLS_CACERT, "/nonexistent/ca.pem")]))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(ENV_TLS_CACERT) && e.contains("/nonexistent/ca.pem"),
            "{e}"
        );
    }

    #[test]
    fn an_engine_may_name_its_files_in_mooncake_config_json_and_the_variables_win() {
        let dir = tempfile::tempdir().unwrap();
        for n in ["c.pem", "k.pem", "ca.pem", "other-ca.pem"] {
            std::fs::write(dir.path().join(n), "-----BEGIN X-----\n").unwrap();
        }
        let cfg = dir.path().join("mooncake_config.json");
        std::fs::write(
            &cfg,
            r#"{"master_server_address": "m:50051", "tls_cert": "c.pem", "tls_key": "k.pem",
                "tls_cacert": "ca.pem"}"#,
        )
        .unwrap();
        let cfg = cfg.display().to_string();
        let p = TlsPaths::client_from_env(&env(&[("MOONCAKE_CONFIG_PATH", &cfg)])).unwrap();
        assert_eq!(p.ca.as_ref().unwrap().path, dir.path().join("ca.pem"));
        assert!(p.cert.as_ref().unwrap().origin.starts_with("tls_cert in "));
        let other = dir.path().join("other-ca.pem").display().to_string();
        let p = TlsPaths::client_from_env(&env(&[
            ("MOONCAKE_CONFIG_PATH", &cfg),
            (ENV_TLS_CACERT, &other),
        ]))
        .unwrap();
        assert!(
            p.cert.is_none(),
            "the variables replace the file's keys as a whole"
        );
        assert_eq!(p.ca.unwrap().origin, ENV_TLS_CACERT);
    }

    #[test]
    fn admin_tls_is_a_switch_off_by_default() {
        assert!(!admin_tls(&env(&[])).unwrap());
        assert!(admin_tls(&env(&[(ENV_ADMIN_TLS, "1")])).unwrap());
        assert!(!admin_tls(&env(&[(ENV_ADMIN_TLS, "off")])).unwrap());
        let e = admin_tls(&env(&[(ENV_ADMIN_TLS, "maybe")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains(ENV_ADMIN_TLS), "{e}");
    }

    #[test]
    fn admin_identities_are_a_comma_list() {
        assert!(admin_identities(&env(&[])).unwrap().is_empty());
        assert_eq!(
            admin_identities(&env(&[(ENV_ADMIN_IDENTITIES, " admin, lunakv-master ,")])).unwrap(),
            vec!["admin".to_string(), "lunakv-master".to_string()]
        );
    }
}
