//! The SSRF allowlist for prefill targets: host AND port must match (upstream checked the
//! host only, llm-d-router #979). Sources: a static list and/or a file re-read when it changes.

use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use parking_lot::RwLock;

/// One allowed target.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Entry {
    host: String,
    /// `None` = any port (written `host:*`, an explicit choice).
    port: Option<u16>,
}

fn norm_host(h: &str) -> String {
    let h = h.trim().trim_start_matches('[').trim_end_matches(']');
    match h.parse::<IpAddr>() {
        Ok(ip) => ip.to_string(),
        Err(_) => h.trim_end_matches('.').to_ascii_lowercase(),
    }
}

/// Splits `host:port` / `[v6]:port`.
pub fn split_host_port(s: &str) -> Option<(String, String)> {
    let s = s.trim();
    if let Some(rest) = s.strip_prefix('[') {
        let (h, p) = rest.split_once("]:")?;
        return Some((h.to_string(), p.to_string()));
    }
    let (h, p) = s.rsplit_once(':')?;
    if h.is_empty() || h.contains(':') {
        return None;
    }
    Some((h.to_string(), p.to_string()))
}

/// An allowlist line that is skipped (with a warning) rather than failing the sidecar.
#[derive(Debug, thiserror::Error)]
enum EntryError {
    #[error("'{0}' is not host:port")]
    NotHostPort(String),
    #[error("'{0}': bad port")]
    BadPort(String),
}

fn parse_entry(s: &str) -> Result<Entry, EntryError> {
    let (h, p) = split_host_port(s).ok_or_else(|| EntryError::NotHostPort(s.to_string()))?;
    let port = if p == "*" {
        None
    } else {
        Some(
            p.parse::<u16>()
                .map_err(|_| EntryError::BadPort(s.to_string()))?,
        )
    };
    Ok(Entry {
        host: norm_host(&h),
        port,
    })
}

fn parse_list<'a>(items: impl Iterator<Item = &'a str>) -> Vec<Entry> {
    items
        .map(|l| l.split('#').next().unwrap_or("").trim())
        .filter(|l| !l.is_empty())
        .filter_map(|l| match parse_entry(l) {
            Ok(e) => Some(e),
            Err(e) => {
                tracing::warn!("ignoring SSRF allowlist entry: {e}");
                None
            }
        })
        .collect()
}

/// The allowlist. Cheap to check (a read lock and a short scan).
#[derive(Debug, Default)]
pub struct Allowlist {
    fixed: Vec<Entry>,
    from_file: RwLock<Vec<Entry>>,
}

impl Allowlist {
    pub fn new(fixed: &[String], file: Option<&PathBuf>) -> Arc<Allowlist> {
        let a = Arc::new(Allowlist {
            fixed: parse_list(fixed.iter().map(|s| s.as_str())),
            from_file: RwLock::new(Vec::new()),
        });
        if let Some(f) = file {
            a.reload(f);
        }
        a
    }

    fn reload(&self, f: &PathBuf) {
        match std::fs::read_to_string(f) {
            Ok(text) => {
                let entries = parse_list(text.lines());
                tracing::info!(file = %f.display(), entries = entries.len(), "SSRF allowlist loaded");
                *self.from_file.write() = entries;
            }
            Err(e) => {
                tracing::warn!(file = %f.display(), error = %e, "cannot read the SSRF allowlist file; keeping the previous list")
            }
        }
    }

    /// Re-reads `file` whenever its modification time or size changes (checked every `every`).
    pub fn watch(self: &Arc<Self>, file: PathBuf, every: Duration) -> tokio::task::JoinHandle<()> {
        let me = self.clone();
        tokio::spawn(async move {
            let stamp = |f: &PathBuf| -> Option<(SystemTime, u64)> {
                let m = std::fs::metadata(f).ok()?;
                Some((m.modified().ok()?, m.len()))
            };
            let mut last = stamp(&file);
            loop {
                tokio::time::sleep(every).await;
                let now = stamp(&file);
                if now != last {
                    last = now;
                    me.reload(&file);
                }
            }
        })
    }

    /// True if `host:port` is allowed.
    pub fn allows(&self, host: &str, port: u16) -> bool {
        let h = norm_host(host);
        let hit = |e: &Entry| e.host == h && e.port.is_none_or(|p| p == port);
        self.fixed.iter().any(hit) || self.from_file.read().iter().any(hit)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_and_port_both_checked() {
        let a = Allowlist::new(
            &[
                "10.0.0.5:8000".into(),
                "Prefill-0.svc:8200".into(),
                "[::1]:9".into(),
                "wild:*".into(),
            ],
            None,
        );
        assert!(a.allows("10.0.0.5", 8000));
        assert!(!a.allows("10.0.0.5", 8001), "same host, other port");
        assert!(!a.allows("10.0.0.6", 8000));
        assert!(a.allows("prefill-0.svc", 8200));
        assert!(a.allows("::1", 9));
        assert!(a.allows("wild", 1));
    }

    #[test]
    fn split() {
        assert_eq!(split_host_port("a:1"), Some(("a".into(), "1".into())));
        assert_eq!(
            split_host_port("[::1]:80"),
            Some(("::1".into(), "80".into()))
        );
        assert_eq!(split_host_port("::1"), None);
        assert_eq!(split_host_port("nohost"), None);
    }
}
