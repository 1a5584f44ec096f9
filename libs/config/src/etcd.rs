//! etcd endpoint lists and the two forms of a master address.
//!
//! Upstream separates etcd endpoints with `;` (`--etcd_endpoints="h1:2379;h2:2379"`) and clients
//! name an HA master as `etcd://h1:2379;h2:2379`. lunakv accepts both, plus `,` as a separator
//! and `http://` on an endpoint.

use std::fmt;
use std::path::PathBuf;

use crate::{ConfigError, HostPort};

/// The CA that signed etcd's certificate (PEM file): etcd is reached over TLS.
pub const ENV_ETCD_CACERT: &str = "LUNAKV_ETCD_CACERT";
/// This client's certificate (PEM file), for an etcd with `--client-cert-auth`.
pub const ENV_ETCD_CERT: &str = "LUNAKV_ETCD_CERT";
/// The key of [`ENV_ETCD_CERT`] (PEM file).
pub const ENV_ETCD_KEY: &str = "LUNAKV_ETCD_KEY";
/// An etcd user (`name`, or `name:password` as etcdctl's `--user`), for an etcd with
/// `auth enable`.
pub const ENV_ETCD_USER: &str = "LUNAKV_ETCD_USER";
/// The password of [`ENV_ETCD_USER`] (wins over a password given there).
pub const ENV_ETCD_PASSWORD: &str = "LUNAKV_ETCD_PASSWORD";

/// How every lunakv etcd client (masters, bootstraps, engines following an HA master) reaches a
/// secured etcd: etcdctl's `--cacert`, `--cert`, `--key` and `--user`, as `LUNAKV_ETCD_*`
/// environment variables. Nothing set means plain http without a user, as on loopback.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct EtcdCredentials {
    /// `(path, PEM)` of the CA.
    pub ca: Option<(PathBuf, Vec<u8>)>,
    /// `(certificate PEM, key PEM)`.
    pub identity: Option<(Vec<u8>, Vec<u8>)>,
    /// `(user, password)`.
    pub user: Option<(String, String)>,
}

impl fmt::Debug for EtcdCredentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdCredentials")
            .field("ca", &self.ca.as_ref().map(|(p, _)| p))
            .field("identity", &self.identity.is_some())
            .field("user", &self.user.as_ref().map(|(u, _)| u))
            .finish()
    }
}

impl EtcdCredentials {
    /// Reads `LUNAKV_ETCD_*` through `env` and loads the PEM files they name. Every refusal names
    /// the variable, its value and the fix.
    pub fn from_env(env: &dyn Fn(&str) -> Option<String>) -> Result<EtcdCredentials, ConfigError> {
        let invalid = |var: &str, value: &str, reason: String, fix: &str| ConfigError::Invalid {
            field: var.to_string(),
            value: value.to_string(),
            reason,
            fix: fix.to_string(),
        };
        let read = |var: &str| -> Result<Option<(PathBuf, Vec<u8>)>, ConfigError> {
            let Some(path) = env(var) else {
                return Ok(None);
            };
            let bytes = std::fs::read(&path).map_err(|e| {
                invalid(
                    var,
                    &path,
                    format!("cannot read it: {e}"),
                    "point it at a readable PEM file (a mounted Secret, for example)",
                )
            })?;
            if !String::from_utf8_lossy(&bytes).contains("-----BEGIN ") {
                return Err(invalid(
                    var,
                    &path,
                    "the file holds no PEM block (-----BEGIN ...)".into(),
                    "give the PEM file, not a DER one or a directory",
                ));
            }
            Ok(Some((PathBuf::from(path), bytes)))
        };
        let ca = read(ENV_ETCD_CACERT)?;
        let cert = read(ENV_ETCD_CERT)?;
        let key = read(ENV_ETCD_KEY)?;
        let identity = match (cert, key) {
            (None, None) => None,
            (Some((_, c)), Some((_, k))) => Some((c, k)),
            (Some((p, _)), None) | (None, Some((p, _))) => {
                return Err(invalid(
                    if env(ENV_ETCD_CERT).is_some() {
                        ENV_ETCD_CERT
                    } else {
                        ENV_ETCD_KEY
                    },
                    &p.display().to_string(),
                    "a client certificate needs its key, and a key its certificate".into(),
                    "set both LUNAKV_ETCD_CERT and LUNAKV_ETCD_KEY, or neither",
                ));
            }
        };
        if identity.is_some() && ca.is_none() {
            return Err(invalid(
                ENV_ETCD_CACERT,
                "",
                "a client certificate is only sent over TLS, and TLS needs the CA".into(),
                "set LUNAKV_ETCD_CACERT to the CA that signed etcd's certificate",
            ));
        }
        let user = match env(ENV_ETCD_USER) {
            None => {
                if env(ENV_ETCD_PASSWORD).is_some() {
                    return Err(invalid(
                        ENV_ETCD_PASSWORD,
                        "(set)",
                        "a password without a user".into(),
                        "set LUNAKV_ETCD_USER to the etcd user it belongs to",
                    ));
                }
                None
            }
            Some(u) => {
                let (name, inline) = match u.split_once(':') {
                    Some((n, p)) => (n.to_string(), Some(p.to_string())),
                    None => (u.clone(), None),
                };
                let Some(password) = env(ENV_ETCD_PASSWORD).or(inline) else {
                    return Err(invalid(
                        ENV_ETCD_USER,
                        &name,
                        "no password given".into(),
                        "set LUNAKV_ETCD_PASSWORD, or LUNAKV_ETCD_USER=name:password",
                    ));
                };
                if name.is_empty() {
                    return Err(invalid(
                        ENV_ETCD_USER,
                        &u.replace(&password, "***"),
                        "the user name is empty".into(),
                        "write LUNAKV_ETCD_USER=name (or name:password)",
                    ));
                }
                Some((name, password))
            }
        };
        Ok(EtcdCredentials { ca, identity, user })
    }

    /// Whether anything is set (TLS or a user).
    pub fn is_secured(&self) -> bool {
        self.ca.is_some() || self.user.is_some()
    }
}

/// A non-empty list of etcd client endpoints.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdEndpoints(pub Vec<HostPort>);

impl EtcdEndpoints {
    /// Parses `h1:2379;h2:2379`, `etcd://h1:2379;h2:2379`, `h1:2379,h2:2379`, `http://h1:2379`.
    pub fn parse(field: &str, value: &str) -> Result<EtcdEndpoints, ConfigError> {
        let bad = |reason: String| ConfigError::InvalidEtcdEndpoints {
            field: field.to_string(),
            value: value.to_string(),
            reason,
        };
        let v = value.trim();
        let v = v.strip_prefix("etcd://").unwrap_or(v);
        if v.is_empty() {
            return Err(bad("it is empty".into()));
        }
        let mut out = Vec::new();
        for part in v.split([';', ',']) {
            let part = part.trim();
            if part.is_empty() {
                return Err(bad("an endpoint between separators is empty".into()));
            }
            // TLS is chosen for all endpoints together, by LUNAKV_ETCD_CACERT
            // ([`EtcdCredentials`]), so the scheme only has to be one lunakv speaks.
            let part = part
                .strip_prefix("http://")
                .or_else(|| part.strip_prefix("https://"))
                .unwrap_or(part)
                .trim_end_matches('/');
            if part.contains("://") {
                return Err(bad(format!(
                    "endpoint '{part}' has a scheme lunakv does not speak (http, or https with \
                     LUNAKV_ETCD_CACERT set)"
                )));
            }
            let hp = HostPort::parse(field, part, "127.0.0.1:2379").map_err(|e| match e {
                ConfigError::InvalidAddress { value, reason, .. } => {
                    bad(format!("endpoint '{value}': {reason}"))
                }
                other => other,
            })?;
            out.push(hp);
        }
        Ok(EtcdEndpoints(out))
    }

    /// Each endpoint as `host:port`.
    pub fn to_strings(&self) -> Vec<String> {
        self.0.iter().map(ToString::to_string).collect()
    }
}

impl fmt::Display for EtcdEndpoints {
    /// `h1:2379;h2:2379`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_strings().join(";"))
    }
}

/// Where a client finds the master.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MasterAddress {
    /// One master at host:port.
    Direct(HostPort),
    /// HA: the leader named by the leader key in etcd.
    Etcd(EtcdEndpoints),
}

impl MasterAddress {
    /// `host:port` or `etcd://h1:2379;h2:2379`. Any other `scheme://` is a
    /// [`ConfigError::Invalid`] that names the field and the two accepted forms.
    pub fn parse(field: &str, value: &str) -> Result<MasterAddress, ConfigError> {
        let v = value.trim();
        if v.starts_with("etcd://") {
            return EtcdEndpoints::parse(field, v).map(MasterAddress::Etcd);
        }
        if let Some((scheme, _)) = v.split_once("://") {
            return Err(ConfigError::Invalid {
                field: field.to_string(),
                value: value.to_string(),
                reason: format!("{scheme}:// is not a master address scheme lunakv knows"),
                fix: "use host:port, e.g. \"127.0.0.1:50051\", or etcd://h1:2379;h2:2379 for an HA master".to_string(),
            });
        }
        HostPort::parse(field, v, "127.0.0.1:50051").map(MasterAddress::Direct)
    }
}

impl fmt::Display for MasterAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MasterAddress::Direct(hp) => write!(f, "{hp}"),
            MasterAddress::Etcd(e) => write!(f, "etcd://{e}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::test_env as env;

    fn refusal(vars: &[(&str, &str)]) -> String {
        EtcdCredentials::from_env(&env(vars))
            .expect_err("refused")
            .to_string()
    }

    #[test]
    fn etcd_credentials_load_and_refuse_with_the_variable_named() {
        let dir = tempfile::tempdir().unwrap();
        let pem = dir.path().join("ca.pem");
        std::fs::write(
            &pem,
            "-----BEGIN CERTIFICATE-----\nx\n-----END CERTIFICATE-----\n",
        )
        .unwrap();
        let der = dir.path().join("ca.der");
        std::fs::write(&der, [0x30, 0x82]).unwrap();
        let pem = pem.to_str().unwrap();
        let der = der.to_str().unwrap();

        let none = EtcdCredentials::from_env(&env(&[])).unwrap();
        assert!(!none.is_secured());

        let c = EtcdCredentials::from_env(&env(&[
            (ENV_ETCD_CACERT, pem),
            (ENV_ETCD_USER, "lunakv:pw"),
        ]))
        .unwrap();
        assert!(c.ca.is_some() && c.identity.is_none());
        assert_eq!(c.user, Some(("lunakv".into(), "pw".into())));
        // LUNAKV_ETCD_PASSWORD wins over an inline one; the password never shows in Debug.
        let c = EtcdCredentials::from_env(&env(&[
            (ENV_ETCD_USER, "lunakv:old"),
            (ENV_ETCD_PASSWORD, "new"),
        ]))
        .unwrap();
        assert_eq!(c.user, Some(("lunakv".into(), "new".into())));
        assert!(!format!("{c:?}").contains("new"));

        let e = refusal(&[(ENV_ETCD_CACERT, "/nonexistent/ca.pem")]);
        assert!(
            e.contains("LUNAKV_ETCD_CACERT") && e.contains("/nonexistent/ca.pem"),
            "{e}"
        );
        let e = refusal(&[(ENV_ETCD_CACERT, der)]);
        assert!(e.contains("no PEM block"), "{e}");
        let e = refusal(&[(ENV_ETCD_CACERT, pem), (ENV_ETCD_CERT, pem)]);
        assert!(e.contains("LUNAKV_ETCD_KEY"), "{e}");
        let e = refusal(&[(ENV_ETCD_CERT, pem), (ENV_ETCD_KEY, pem)]);
        assert!(e.contains("LUNAKV_ETCD_CACERT"), "{e}");
        let e = refusal(&[(ENV_ETCD_USER, "lunakv")]);
        assert!(e.contains("LUNAKV_ETCD_PASSWORD"), "{e}");
        let e = refusal(&[(ENV_ETCD_PASSWORD, "pw")]);
        assert!(e.contains("LUNAKV_ETCD_USER") && !e.contains("pw'"), "{e}");
        let e = refusal(&[(ENV_ETCD_USER, ":pw")]);
        assert!(e.contains("empty") && !e.contains(":pw"), "{e}");
    }

    #[test]
    fn endpoint_lists_parse() {
        let e = EtcdEndpoints::parse("etcd_endpoints", "h1:2379;h2:2379").expect("list");
        assert_eq!(e.to_string(), "h1:2379;h2:2379");
        assert_eq!(
            EtcdEndpoints::parse("f", "etcd://h1:2379,http://h2:2379/")
                .expect("forms")
                .to_string(),
            "h1:2379;h2:2379"
        );
        // https:// is accepted: TLS is switched on for every endpoint by LUNAKV_ETCD_CACERT.
        assert_eq!(
            EtcdEndpoints::parse("f", "https://h1:2379")
                .expect("https")
                .to_string(),
            "h1:2379"
        );
        for bad in [
            "",
            "etcd://",
            "h1:2379;;h2:2379",
            "h1",
            "h1:x",
            "grpc://h:1",
        ] {
            let err = EtcdEndpoints::parse("--etcd_endpoints", bad).expect_err(bad);
            assert!(
                err.to_string().contains("h1:2379;h2:2379"),
                "the message shows the right form: {err}"
            );
        }
    }

    #[test]
    fn master_addresses_parse() {
        assert!(matches!(
            MasterAddress::parse("m", "etcd://h1:2379;h2:2379"),
            Ok(MasterAddress::Etcd(e)) if e.0.len() == 2
        ));
        assert!(matches!(
            MasterAddress::parse("m", "10.0.0.1:50051"),
            Ok(MasterAddress::Direct(_))
        ));
        let e = MasterAddress::parse("m", "redis://h:1").expect_err("scheme");
        assert!(e.to_string().contains("etcd://"), "{e}");
    }
}
