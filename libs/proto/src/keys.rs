//! Key rules, checked identically by the client (before any RPC) and the master (at the edge).

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
}

/// Checks a key against the rules above.
pub fn validate_key(key: &str) -> Result<(), KeyError> {
    if key.is_empty() {
        return Err(KeyError::Empty);
    }
    if key.len() > MAX_KEY_LEN {
        return Err(KeyError::TooLong {
            len: key.len(),
            max: MAX_KEY_LEN,
        });
    }
    if let Some(at) = key.bytes().position(|b| b == 0) {
        return Err(KeyError::Nul { at });
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
}
