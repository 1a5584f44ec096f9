//! The pool's shared secrets: a pool token every caller of the master presents, and an admin
//! token for what can wipe the pool (RemoveAll, and the admin port's object and segment listings).
//!
//! Each comes from `LUNAKV_AUTH_TOKEN` / `LUNAKV_ADMIN_TOKEN`, or from the file that
//! `LUNAKV_AUTH_TOKEN_FILE` / `LUNAKV_ADMIN_TOKEN_FILE` names (a mounted Kubernetes Secret).
//! The master enforces what is set; clients (engines, stores, the CLI) send what is set. Nothing
//! set means no check, as on loopback. See docs/SECURITY.md.

use std::fmt;

use crate::ConfigError;

pub const ENV_AUTH_TOKEN: &str = "LUNAKV_AUTH_TOKEN";
pub const ENV_AUTH_TOKEN_FILE: &str = "LUNAKV_AUTH_TOKEN_FILE";
pub const ENV_ADMIN_TOKEN: &str = "LUNAKV_ADMIN_TOKEN";
pub const ENV_ADMIN_TOKEN_FILE: &str = "LUNAKV_ADMIN_TOKEN_FILE";

/// Shorter tokens can be guessed; 16 is what `openssl rand -hex 8` gives, the least we take.
pub const MIN_TOKEN_LEN: usize = 16;

/// A token. Its `Debug` never shows it.
#[derive(Clone, PartialEq, Eq)]
pub struct Token(String);

impl Token {
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Compares in time independent of where the first difference is, so a caller cannot
    /// learn the token a byte at a time from response times.
    pub fn matches(&self, presented: &[u8]) -> bool {
        let mine = self.0.as_bytes();
        if mine.len() != presented.len() {
            return false;
        }
        mine.iter()
            .zip(presented)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
    }
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Token(***)")
    }
}

/// The tokens this process enforces (master) or presents (clients).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PoolTokens {
    pub pool: Option<Token>,
    pub admin: Option<Token>,
}

impl PoolTokens {
    /// Reads the four variables through `env`; every refusal names the variable and the fix.
    pub fn from_env(env: &dyn Fn(&str) -> Option<String>) -> Result<PoolTokens, ConfigError> {
        Ok(PoolTokens {
            pool: token(env, ENV_AUTH_TOKEN, ENV_AUTH_TOKEN_FILE)?,
            admin: token(env, ENV_ADMIN_TOKEN, ENV_ADMIN_TOKEN_FILE)?,
        })
    }

    /// What a client sends: the admin token when it has one (it is accepted wherever the pool
    /// token is), else the pool token.
    pub fn presented(&self) -> Option<&Token> {
        self.admin.as_ref().or(self.pool.as_ref())
    }

    pub fn is_empty(&self) -> bool {
        self.pool.is_none() && self.admin.is_none()
    }
}

fn token(
    env: &dyn Fn(&str) -> Option<String>,
    var: &str,
    file_var: &str,
) -> Result<Option<Token>, ConfigError> {
    let invalid = |field: &str, value: &str, reason: String, fix: String| ConfigError::Invalid {
        field: field.to_string(),
        value: value.to_string(),
        reason,
        fix,
    };
    let (raw, from) = match (env(var), env(file_var)) {
        (None, None) => return Ok(None),
        (Some(_), Some(path)) => {
            return Err(invalid(
                file_var,
                &path,
                format!("{var} is set too"),
                format!("set one of {var} and {file_var}"),
            ));
        }
        (Some(t), None) => (t, var.to_string()),
        (None, Some(path)) => {
            let t = std::fs::read_to_string(&path).map_err(|e| {
                invalid(
                    file_var,
                    &path,
                    format!("cannot read it: {e}"),
                    "point it at a readable file holding the token (a mounted Secret)".into(),
                )
            })?;
            (t, format!("{file_var} ({path})"))
        }
    };
    let t = raw.trim();
    if t.len() < MIN_TOKEN_LEN || !t.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(invalid(
            &from,
            "***",
            format!(
                "a token is at least {MIN_TOKEN_LEN} printable ASCII characters without spaces"
            ),
            "generate one with `openssl rand -hex 32`".into(),
        ));
    }
    Ok(Some(Token(t.to_string())))
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::test_env as env;

    #[test]
    fn tokens_load_from_values_and_files_and_refuse_clearly() {
        assert!(PoolTokens::from_env(&env(&[])).unwrap().is_empty());
        let good = "0123456789abcdef0123";
        let t = PoolTokens::from_env(&env(&[(ENV_AUTH_TOKEN, good)])).unwrap();
        assert_eq!(t.presented().map(Token::as_str), Some(good));
        assert!(!format!("{t:?}").contains(good));
        assert!(t.pool.as_ref().unwrap().matches(good.as_bytes()));
        assert!(!t.pool.as_ref().unwrap().matches(b"0123456789abcdef0124"));
        assert!(!t.pool.as_ref().unwrap().matches(b"short"));

        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("admin");
        std::fs::write(&f, "fedcba9876543210fedc\n").unwrap();
        let f = f.display().to_string();
        let t = PoolTokens::from_env(&env(&[(ENV_AUTH_TOKEN, good), (ENV_ADMIN_TOKEN_FILE, &f)]))
            .unwrap();
        assert_eq!(
            t.presented().map(Token::as_str),
            Some("fedcba9876543210fedc"),
            "the admin token is sent when set, trimmed"
        );

        let e = PoolTokens::from_env(&env(&[(ENV_AUTH_TOKEN, "short")]))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(ENV_AUTH_TOKEN) && e.contains("openssl rand") && !e.contains("short'"),
            "{e}"
        );
        let e = PoolTokens::from_env(&env(&[(ENV_AUTH_TOKEN, good), (ENV_AUTH_TOKEN_FILE, &f)]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("set one of"), "{e}");
        let e = PoolTokens::from_env(&env(&[(ENV_ADMIN_TOKEN_FILE, "/nonexistent/t")]))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(ENV_ADMIN_TOKEN_FILE) && e.contains("/nonexistent/t"),
            "{e}"
        );
    }
}
