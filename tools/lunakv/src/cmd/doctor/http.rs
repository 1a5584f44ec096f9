//! The admin endpoints (bootstrap, sidecar, vLLM, store metrics), through lunakv's HTTP client.

use std::net::ToSocketAddrs;
use std::time::Duration;

/// Why an HTTP probe of a service got no answer. The check's line already names the service
/// and the URL's path, so transport failures say only the cause.
#[derive(Debug, thiserror::Error)]
pub(super) enum GetError {
    #[error("bad address {addr:?} ({source}); give host:port")]
    BadAddress {
        addr: String,
        source: std::io::Error,
    },
    #[error("{0:?} resolves to no address")]
    NoAddress(String),
    #[error("{}", cause_of(.0))]
    Http(lunakv_http::HttpError),
}

fn cause_of(e: &lunakv_http::HttpError) -> String {
    match e {
        lunakv_http::HttpError::Transport { msg, .. } => msg.clone(),
        lunakv_http::HttpError::Timeout { after, .. } => format!("no answer within {after:?}"),
        other => other.to_string(),
    }
}

/// GET `http://addr{path}` with a short timeout; (status, body).
pub(super) fn http_get(addr: &str, path: &str) -> Result<(u16, String), GetError> {
    let timeout = Duration::from_secs(3);
    // Checked first so that a typo reads as one, not as a connection error.
    addr.to_socket_addrs()
        .map_err(|source| GetError::BadAddress {
            addr: addr.to_string(),
            source,
        })?
        .next()
        .ok_or_else(|| GetError::NoAddress(addr.to_string()))?;
    let r = lunakv_http::get_blocking(&format!("http://{addr}{path}"), timeout)
        .map_err(GetError::Http)?;
    Ok((r.status.as_u16(), r.text()))
}
