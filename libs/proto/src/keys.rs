//! Key rules, checked identically by the client (before any RPC) and the master (at the edge),
//! and the tenant scoping of keys.
//!
//! # Tenants
//! A tenant other than [`DEFAULT_TENANT`] owns a namespace of keys: its client sends each key
//! as `<tenant>\0<key>` (upstream Mooncake's scoped-key form). A user key can never hold a NUL,
//! so a scoped key never equals another tenant's key or a default-tenant key, and the master
//! learns each object's tenant from its key alone: no message carries a tenant field, an
//! owner's inventory keeps it across a master restart, and older clients (default tenant) send
//! the same bytes as before. The default tenant's keys are never scoped, so `default\0k` is
//! refused: one key has one spelling.

/// Longest key accepted, in bytes. vLLM's keys are about 150 bytes; upstream has no hard limit,
/// which lets one bad caller bloat the master's index (upstream #3452).
pub const MAX_KEY_LEN: usize = 4096;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error("key is empty: give every object a non-empty key")]
    Empty,
    #[error(
        "key is {len} bytes, longer than the limit of {max} bytes: shorten it (hash long names)"
    )]
    TooLong { len: usize, max: usize },
    #[error("key contains a NUL byte at offset {at}: keys must be printable text")]
    Nul { at: usize },
    #[error("tenant_id {tenant:?} {why}")]
    Tenant { tenant: String, why: &'static str },
}

/// The tenant of every unscoped key (upstream's default `tenant_id`).
pub const DEFAULT_TENANT: &str = "default";
/// Longest tenant id accepted, in bytes (upstream has no limit; each tenant costs the master a
/// usage row and a metrics series).
pub const MAX_TENANT_LEN: usize = 128;

/// Checks a tenant id with upstream's rules (non-empty, not starting with `_`, no control
/// characters) plus a length bound.
pub fn validate_tenant(tenant: &str) -> Result<(), KeyError> {
    let bad = |why| {
        Err(KeyError::Tenant {
            tenant: tenant.chars().take(MAX_TENANT_LEN).collect(),
            why,
        })
    };
    if tenant.is_empty() {
        return bad("is empty: omit tenant_id (or pass \"default\") for the default tenant");
    }
    if tenant.len() > MAX_TENANT_LEN {
        return bad("is longer than 128 bytes: use a shorter tenant name");
    }
    if tenant.starts_with('_') {
        return bad("starts with '_', which upstream reserves: rename the tenant");
    }
    if tenant.chars().any(char::is_control) {
        return bad("contains a control character: tenant names must be printable text");
    }
    Ok(())
}

/// The key `tenant`'s client sends for its `key` (the key itself for the default tenant).
pub fn scope_key(tenant: &str, key: &str) -> String {
    if tenant == DEFAULT_TENANT {
        key.to_owned()
    } else {
        let mut s = String::with_capacity(tenant.len() + 1 + key.len());
        s.push_str(tenant);
        s.push('\0');
        s.push_str(key);
        s
    }
}

/// `(tenant, user key)` of a key as the master holds it.
pub fn split_scoped(key: &str) -> (&str, &str) {
    key.split_once('\0').unwrap_or((DEFAULT_TENANT, key))
}

/// Checks a key as the master receives it: a user key, or a valid non-default tenant, a NUL,
/// and a user key.
pub fn validate_scoped_key(key: &str) -> Result<(), KeyError> {
    match key.split_once('\0') {
        // Known to hold no NUL: only its length is left to check (the master checks every
        // key of every call, so it is not scanned twice).
        None => validate_length(key),
        Some((tenant, user)) => {
            validate_tenant(tenant)?;
            if tenant == DEFAULT_TENANT {
                return Err(KeyError::Tenant {
                    tenant: tenant.to_owned(),
                    why: "is never written into a key: send the default tenant's keys unscoped",
                });
            }
            validate_key(user).map_err(|e| match e {
                KeyError::Nul { at } => KeyError::Nul {
                    at: at + tenant.len() + 1,
                },
                e => e,
            })
        }
    }
}

/// Checks a key against the rules above.
pub fn validate_key(key: &str) -> Result<(), KeyError> {
    validate_length(key)?;
    if let Some(at) = key.bytes().position(|b| b == 0) {
        return Err(KeyError::Nul { at });
    }
    Ok(())
}

fn validate_length(key: &str) -> Result<(), KeyError> {
    if key.is_empty() {
        return Err(KeyError::Empty);
    }
    if key.len() > MAX_KEY_LEN {
        return Err(KeyError::TooLong {
            len: key.len(),
            max: MAX_KEY_LEN,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_empty_long_and_nul_keys() {
        assert_eq!(validate_key(""), Err(KeyError::Empty));
        let long = "k".repeat(MAX_KEY_LEN + 1);
        assert!(
            matches!(validate_key(&long), Err(KeyError::TooLong { len, .. }) if len == MAX_KEY_LEN + 1)
        );
        assert_eq!(validate_key("a\0b"), Err(KeyError::Nul { at: 1 }));
        assert!(validate_key("Llama@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@abcd").is_ok());
        assert!(validate_key(&"k".repeat(MAX_KEY_LEN)).is_ok());
    }

    #[test]
    fn a_tenant_scopes_its_keys_and_the_default_tenant_does_not() {
        assert_eq!(scope_key(DEFAULT_TENANT, "k"), "k");
        let scoped = scope_key("team-a", "k");
        assert_eq!(scoped, "team-a\0k");
        assert_eq!(split_scoped(&scoped), ("team-a", "k"));
        assert_eq!(split_scoped("k"), (DEFAULT_TENANT, "k"));
        assert!(validate_scoped_key(&scoped).is_ok());
        // A NUL in a user key (or a tenant) can never pass as the separator.
        assert!(validate_scoped_key(&scope_key("a", "b\0c")).is_err());
        assert!(validate_tenant("a\0b").is_err());
        assert_eq!(
            validate_scoped_key("team-a\0b\0c"),
            Err(KeyError::Nul { at: 8 })
        );
        for bad in ["\0k", "_x\0k", "default\0k", "a\tb\0k"] {
            assert!(
                matches!(validate_scoped_key(bad), Err(KeyError::Tenant { .. })),
                "{bad:?}"
            );
        }
        let long = "t".repeat(MAX_TENANT_LEN + 1);
        assert!(validate_tenant(&long).is_err());
        assert!(validate_tenant(&"t".repeat(MAX_TENANT_LEN)).is_ok());
    }
}
