//! Where this process is reached and how it moves bytes, for `mooncake.store`'s `setup` and
//! `mooncake.engine`'s `initialize` alike: the environment variables they read ([`env()`]), the
//! host part of `local_hostname` ([`strip_port`]), the IP a served port binds to
//! ([`resolve_ip`]), and the transport chosen, as Python sees it ([`protocol_info`]).

use std::collections::HashMap;
use std::net::{IpAddr, ToSocketAddrs};

use lunakv_transfer::ProtocolChoice;

/// The variable `name`, unless it is unset or empty.
pub(crate) fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

/// Why `local_hostname` gives no IP to bind to.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ResolveError {
    #[error("local_hostname '{host}' does not resolve ({source}): pass this host's IP")]
    Unresolvable {
        host: String,
        source: std::io::Error,
    },
    #[error("local_hostname '{host}' resolves to no address: pass this host's IP")]
    NoAddress { host: String },
}

/// `"host"`, `"host:port"`, `"[v6]:port"` -> the host part.
pub(crate) fn strip_port(host: &str) -> &str {
    if let Some(rest) = host.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    match host.rsplit_once(':') {
        Some((h, p)) if !h.contains(':') && p.parse::<u16>().is_ok() => h,
        _ => host,
    }
}

/// The IP embedded mode binds its segment to: the address itself, or the name resolved
/// (IPv4 preferred).
pub(crate) fn resolve_ip(host: &str) -> Result<IpAddr, ResolveError> {
    let h = strip_port(host);
    if let Ok(ip) = h.parse::<IpAddr>() {
        return Ok(ip);
    }
    let addrs: Vec<IpAddr> = (h, 0)
        .to_socket_addrs()
        .map_err(|source| ResolveError::Unresolvable {
            host: host.to_string(),
            source,
        })?
        .map(|s| s.ip())
        .collect();
    addrs
        .iter()
        .find(|ip| ip.is_ipv4())
        .or(addrs.first())
        .copied()
        .ok_or_else(|| ResolveError::NoAddress {
            host: host.to_string(),
        })
}

/// The protocol choice as Python sees it: `{"requested", "effective", "reason", "display"}`.
pub(crate) fn protocol_info(p: &ProtocolChoice) -> HashMap<&'static str, String> {
    HashMap::from([
        ("requested", p.requested.as_str().to_owned()),
        ("effective", p.effective.as_str().to_owned()),
        ("reason", p.reason_str().to_owned()),
        ("display", p.to_string()),
    ])
}
