//! How every Python call runs, for `mooncake.store` and `mooncake.engine` alike: without the
//! GIL and with panics caught ([`detached`]), answered with Mooncake's integer codes ([`code`]).

use std::panic::{AssertUnwindSafe, catch_unwind};

use lunakv_client::{ClientError, ErrorCode};
use pyo3::prelude::*;

/// Answer of a call whose Rust side panicked (the panic is logged, never propagated).
pub(crate) const INTERNAL_ERROR: i64 = ErrorCode::InternalError as i64;

/// Runs `f` with the GIL released and any panic turned into `on_panic`.
pub(crate) fn detached<T, F>(py: Python<'_>, on_panic: T, f: F) -> T
where
    T: Send,
    F: FnOnce() -> T + Send,
{
    py.detach(move || match catch_unwind(AssertUnwindSafe(f)) {
        Ok(v) => v,
        Err(_) => {
            tracing::error!(
                "lunakv: internal error (a panic, reported above); the call returns INTERNAL_ERROR"
            );
            on_panic
        }
    })
}

/// The Mooncake error code Python sees for `e`.
pub(crate) fn code(e: &ClientError) -> i64 {
    i64::from(e.code().as_i32())
}

/// 0, or the error's code (logged at debug: per-key failures are the caller's to handle).
pub(crate) fn unit_code(what: &str, r: Result<(), ClientError>) -> i64 {
    match r {
        Ok(()) => 0,
        Err(e) => {
            tracing::debug!("lunakv: {what} failed: {e}");
            code(&e)
        }
    }
}

/// The byte count, or the error's code.
pub(crate) fn count_code(what: &str, r: Result<u64, ClientError>) -> i64 {
    match r {
        Ok(n) => i64::try_from(n).unwrap_or(i64::MAX),
        Err(e) => {
            tracing::debug!("lunakv: {what} failed: {e}");
            code(&e)
        }
    }
}
