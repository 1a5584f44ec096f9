//! Errors that carry a Mooncake error code, so `--json` failures report `"code"` the way the
//! Python API would (-704 OBJECT_NOT_FOUND, -900 RPC_FAIL, ...).

use lunakv_client::ClientError;
use lunakv_proto::ErrorCode;

/// An error from the CLI itself (bad input file, unreachable master for `status`) with the
/// code the client library would use for the same situation.
#[derive(Debug)]
pub struct Coded {
    pub code: ErrorCode,
    pub message: String,
}

impl Coded {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Coded {
        Coded {
            code,
            message: message.into(),
        }
    }
}

impl std::fmt::Display for Coded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Coded {}

/// The Mooncake code of the first coded error in the chain; INTERNAL_ERROR when none is.
pub fn code_of(e: &anyhow::Error) -> ErrorCode {
    for cause in e.chain() {
        if let Some(c) = cause.downcast_ref::<ClientError>() {
            return c.code();
        }
        if let Some(c) = cause.downcast_ref::<Coded>() {
            return c.code;
        }
    }
    ErrorCode::InternalError
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_survive_context() {
        let e = anyhow::Error::new(ClientError::ObjectNotFound("k".into())).context("get k");
        assert_eq!(code_of(&e), ErrorCode::ObjectNotFound);
        let e = anyhow::Error::new(Coded::new(ErrorCode::RpcFail, "down"));
        assert_eq!(code_of(&e).as_i32(), -900);
        assert_eq!(code_of(&anyhow::anyhow!("plain")), ErrorCode::InternalError);
    }
}
