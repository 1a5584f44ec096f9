//! Tenant quota policy (upstream's `--tenant_quota_connector_type=file`): the YAML file that
//! names each tenant and its DRAM quota, read at start and rewritten by the admin API.
//!
//! The schema is upstream's, so a policy written for `mooncake_master` loads unchanged:
//! ```yaml
//! version: 1
//! tenants:
//!   - name: tenant-a
//!     quota: 200GB      # an integer of bytes, or B/KB/MB/GB/TB (powers of 1024)
//! ```
//! Saves go to a temporary file in the same directory, fsynced, then renamed over the policy,
//! so a crash leaves the old policy or the new one, never half of one.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::core::TenantQuotas;

/// Tenants a policy may name (each costs a usage row and metrics series).
pub const MAX_TENANTS: usize = 4096;
/// Largest quota accepted (upstream's bound: 2^63 - 1 bytes).
pub const MAX_QUOTA: u64 = i64::MAX as u64;

#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    #[error("tenant quota policy {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "tenant quota policy {path}: {why}; write it as `version: 1` then `tenants:` with \
         `- name: <tenant>` and `quota: <bytes, or 200GB>` for each (docs/TENANTS.md)"
    )]
    Invalid { path: String, why: String },
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PolicyDoc {
    version: Option<u32>,
    #[serde(default)]
    tenants: Vec<TenantDoc>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TenantDoc {
    name: String,
    quota: QuotaDoc,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum QuotaDoc {
    Bytes(u64),
    Text(String),
}

/// A quota [`parse_quota`] refuses; the message names the fix.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum QuotaError {
    #[error("quota {0:?} does not start with a whole number of bytes")]
    NotANumber(String),
    #[error("quota {text:?} has unit {unit:?}; use B, KB, MB, GB or TB")]
    Unit { text: String, unit: String },
    #[error("quota {0:?} must be from 1 byte to {MAX_QUOTA} bytes")]
    Range(String),
}

/// `200GB`, `512MB`, `1024` (bytes): upstream's quota syntax, units in powers of 1024.
pub fn parse_quota(text: &str) -> Result<u64, QuotaError> {
    let t = text.trim();
    let digits = t.bytes().take_while(u8::is_ascii_digit).count();
    let (num, unit) = t.split_at(digits);
    let n: u64 = num
        .parse()
        .map_err(|_| QuotaError::NotANumber(text.to_owned()))?;
    let mult: u64 = match unit.trim() {
        "" | "B" => 1,
        "KB" => 1 << 10,
        "MB" => 1 << 20,
        "GB" => 1 << 30,
        "TB" => 1 << 40,
        u => {
            return Err(QuotaError::Unit {
                text: text.to_owned(),
                unit: u.to_owned(),
            });
        }
    };
    n.checked_mul(mult)
        .filter(|q| (1..=MAX_QUOTA).contains(q))
        .ok_or_else(|| QuotaError::Range(text.to_owned()))
}

/// Parses a policy document into tenant -> quota bytes.
pub fn parse_policy(path: &str, text: &str) -> Result<BTreeMap<String, u64>, PolicyError> {
    let invalid = |why: String| PolicyError::Invalid {
        path: path.to_owned(),
        why,
    };
    let doc: PolicyDoc = serde_norway::from_str(text).map_err(|e| invalid(e.to_string()))?;
    match doc.version {
        Some(1) => {}
        Some(v) => return Err(invalid(format!("version {v} is not supported (only 1)"))),
        None => return Err(invalid("`version: 1` is required".into())),
    }
    if doc.tenants.len() > MAX_TENANTS {
        return Err(invalid(format!(
            "{} tenants, more than the {MAX_TENANTS} lunakv accepts",
            doc.tenants.len()
        )));
    }
    let mut out = BTreeMap::new();
    for t in doc.tenants {
        lunakv_proto::validate_tenant(&t.name).map_err(|e| invalid(e.to_string()))?;
        let q = match t.quota {
            QuotaDoc::Bytes(b) => parse_quota(&b.to_string()),
            QuotaDoc::Text(s) => parse_quota(&s),
        }
        .map_err(|e| invalid(format!("tenant {:?}: {e}", t.name)))?;
        if out.insert(t.name.clone(), q).is_some() {
            return Err(invalid(format!("tenant {:?} is named twice", t.name)));
        }
    }
    Ok(out)
}

/// The policy as upstream writes it.
pub fn render_policy(quotas: &BTreeMap<String, u64>) -> String {
    let mut out = String::from("version: 1\n\n");
    if quotas.is_empty() {
        out.push_str("tenants: []\n");
        return out;
    }
    out.push_str("tenants:\n");
    for (name, q) in quotas {
        // JSON string syntax is a valid YAML double-quoted scalar.
        let quoted = serde_json::to_string(name).unwrap_or_else(|_| format!("{name:?}"));
        out.push_str(&format!("  - name: {quoted}\n    quota: {q}\n"));
    }
    out
}

/// The policy file named by `--tenant_quota_connector_uri`.
#[derive(Debug, Clone)]
pub struct PolicyFile {
    path: PathBuf,
}

impl PolicyFile {
    pub fn new(path: impl Into<PathBuf>) -> PolicyFile {
        PolicyFile { path: path.into() }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn name(&self) -> String {
        self.path.display().to_string()
    }

    pub fn load(&self) -> Result<BTreeMap<String, u64>, PolicyError> {
        let text = std::fs::read_to_string(&self.path).map_err(|source| PolicyError::Io {
            path: self.name(),
            source,
        })?;
        parse_policy(&self.name(), &text)
    }

    pub fn save(&self, quotas: &BTreeMap<String, u64>) -> Result<(), PolicyError> {
        let io = |source| PolicyError::Io {
            path: self.name(),
            source,
        };
        let dir = self
            .path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        let mut tmp = tempfile_in(dir).map_err(io)?;
        tmp.1
            .write_all(render_policy(quotas).as_bytes())
            .map_err(io)?;
        tmp.1.sync_all().map_err(io)?;
        std::fs::rename(&tmp.0, &self.path).map_err(|e| {
            let _ = std::fs::remove_file(&tmp.0);
            io(e)
        })
    }
}

/// A new file next to the policy (so the rename stays on one filesystem).
fn tempfile_in(dir: &Path) -> std::io::Result<(PathBuf, std::fs::File)> {
    let path = dir.join(format!(
        ".tenant_quotas.tmp.{}.{}",
        std::process::id(),
        rand::random::<u32>()
    ));
    let f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&path)?;
    Ok((path, f))
}

/// The policy in force and its file: what `--enable_multi_tenants` adds to a master. Changes
/// through the admin API are saved before they apply, one at a time.
pub struct TenantAdmin {
    file: PolicyFile,
    quotas: TenantQuotas,
    changes: tokio::sync::Mutex<()>,
}

/// Why an admin change of the policy was refused.
#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    #[error("{0}")]
    Invalid(String),
    #[error(
        "tenant {tenant:?} still holds {objects} objects ({dram_bytes} DRAM bytes): remove them \
         (remove_all with its tenant_id) before deleting its policy"
    )]
    NotEmpty {
        tenant: String,
        objects: u64,
        dram_bytes: u64,
    },
    #[error("tenant {0:?} has no quota policy")]
    NotRegistered(String),
    #[error(transparent)]
    Policy(#[from] PolicyError),
}

impl AdminError {
    /// Upstream's code for the error body.
    pub fn code(&self) -> lunakv_proto::ErrorCode {
        use lunakv_proto::ErrorCode;
        match self {
            AdminError::Invalid(_) => ErrorCode::InvalidParams,
            AdminError::NotEmpty { .. } => ErrorCode::TenantNotEmpty,
            AdminError::NotRegistered(_) => ErrorCode::TenantNotRegistered,
            AdminError::Policy(_) => ErrorCode::InternalError,
        }
    }
}

impl TenantAdmin {
    /// Loads the policy file into `quotas` (a missing or malformed file is an error that names
    /// it, as upstream's master refuses to start on one).
    pub fn load(file: PolicyFile, quotas: TenantQuotas) -> Result<TenantAdmin, PolicyError> {
        let policy = file.load()?;
        *quotas.write() = policy.into_iter().collect();
        Ok(TenantAdmin {
            file,
            quotas,
            changes: tokio::sync::Mutex::new(()),
        })
    }

    pub fn file(&self) -> &PolicyFile {
        &self.file
    }

    fn snapshot(&self) -> BTreeMap<String, u64> {
        self.quotas
            .read()
            .iter()
            .map(|(t, q)| (t.clone(), *q))
            .collect()
    }

    /// Sets `tenant`'s quota, saved to the file first.
    pub async fn upsert(&self, tenant: &str, bytes: u64) -> Result<(), AdminError> {
        lunakv_proto::validate_tenant(tenant).map_err(|e| AdminError::Invalid(e.to_string()))?;
        if !(1..=MAX_QUOTA).contains(&bytes) {
            return Err(AdminError::Invalid(format!(
                "requested_quota_bytes {bytes} must be from 1 to {MAX_QUOTA}"
            )));
        }
        let _one = self.changes.lock().await;
        let mut next = self.snapshot();
        if !next.contains_key(tenant) && next.len() >= MAX_TENANTS {
            return Err(AdminError::Invalid(format!(
                "the policy already names {MAX_TENANTS} tenants, the most lunakv accepts"
            )));
        }
        next.insert(tenant.to_owned(), bytes);
        self.save_and_apply(next).await
    }

    /// Drops `tenant`'s quota; refused while it holds objects (`usage` = its objects and DRAM).
    pub async fn delete(&self, tenant: &str, usage: (u64, u64)) -> Result<(), AdminError> {
        let _one = self.changes.lock().await;
        let mut next = self.snapshot();
        if next.remove(tenant).is_none() {
            return Err(AdminError::NotRegistered(tenant.to_owned()));
        }
        if usage.0 > 0 {
            return Err(AdminError::NotEmpty {
                tenant: tenant.to_owned(),
                objects: usage.0,
                dram_bytes: usage.1,
            });
        }
        self.save_and_apply(next).await
    }

    async fn save_and_apply(&self, next: BTreeMap<String, u64>) -> Result<(), AdminError> {
        let file = self.file.clone();
        let saved = next.clone();
        tokio::task::spawn_blocking(move || file.save(&saved))
            .await
            .map_err(|e| AdminError::Invalid(format!("saving the policy failed: {e}")))??;
        *self.quotas.write() = next.into_iter().collect();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upstreams_policy_document_loads_and_round_trips() {
        let text = "version: 1\n\ntenants:\n  - name: tenant-a\n    quota: 200GB\n\n  - name: tenant-b\n    quota: 512\n";
        let p = parse_policy("t.yaml", text).expect("parse");
        assert_eq!(p["tenant-a"], 200 << 30);
        assert_eq!(p["tenant-b"], 512);
        assert_eq!(
            parse_policy("t.yaml", &render_policy(&p)).expect("again"),
            p
        );
        assert!(
            parse_policy("t.yaml", &render_policy(&BTreeMap::new()))
                .expect("empty")
                .is_empty()
        );
    }

    #[test]
    fn a_bad_policy_names_what_is_wrong() {
        for (text, want) in [
            ("tenants: []\n", "version: 1"),
            ("version: 2\ntenants: []\n", "version 2"),
            (
                "version: 1\ntenants:\n  - name: a\n    quota: 5PB\n",
                "unit \"PB\"",
            ),
            (
                "version: 1\ntenants:\n  - name: a\n    quota: 0\n",
                "from 1 byte",
            ),
            (
                "version: 1\ntenants:\n  - name: _a\n    quota: 1\n",
                "reserves",
            ),
            (
                "version: 1\ntenants:\n  - name: a\n    quota: 1\n  - name: a\n    quota: 2\n",
                "named twice",
            ),
        ] {
            let e = parse_policy("t.yaml", text).expect_err(text).to_string();
            assert!(e.contains(want), "{text:?}: {e}");
            assert!(e.contains("t.yaml"), "{e}");
        }
    }

    #[test]
    fn a_save_replaces_the_file_whole() {
        let dir = tempfile::tempdir().expect("dir");
        let f = PolicyFile::new(dir.path().join("q.yaml"));
        assert!(matches!(f.load(), Err(PolicyError::Io { .. })));
        let mut p = BTreeMap::new();
        p.insert("a \"quoted\" tenant".to_string(), 1 << 20);
        f.save(&p).expect("save");
        assert_eq!(f.load().expect("load"), p);
        assert_eq!(std::fs::read_dir(dir.path()).expect("ls").count(), 1);
    }
}
