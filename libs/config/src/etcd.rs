//! etcd endpoint lists and the two forms of a master address.
//!
//! Upstream separates etcd endpoints with `;` (`--etcd_endpoints="h1:2379;h2:2379"`) and clients
//! name an HA master as `etcd://h1:2379;h2:2379`. lunakv accepts both, plus `,` as a separator
//! and `http://` on an endpoint.

use std::fmt;

use crate::{ConfigError, HostPort};

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
            let part = part
                .strip_prefix("http://")
                .unwrap_or(part)
                .trim_end_matches('/');
            if part.contains("://") {
                return Err(bad(format!(
                    "endpoint '{part}' has a scheme lunakv does not speak (only plain http)"
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
        for bad in [
            "",
            "etcd://",
            "h1:2379;;h2:2379",
            "h1",
            "h1:x",
            "https://h:1",
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
