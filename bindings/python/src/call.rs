//! How every Python call runs, for `mooncake.store` and `mooncake.engine` alike: without the
//! GIL and with panics caught ([`detached`]), answered with Mooncake's integer codes ([`code`]),
//! and, for batch calls, one answer per key in the caller's order ([`scatter`]).

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

/// One answer per input, in the inputs' order, from one batch over the inputs that pass.
///
/// A batch call checks each key's arguments alone, so one bad key fails alone while the others
/// still run in a single batch. `check` turns an input into the item the batch takes, or into
/// that input's answer (a refusal it has logged). `run` gets the items that passed and the
/// indices of their inputs (for per-key settings such as a replicate config's), and returns
/// one result per item, in order; `answer` maps each. An item `run` returned no result for
/// answers `missing()`.
pub(crate) fn scatter<T, I, R, O>(
    inputs: impl IntoIterator<Item = T>,
    mut check: impl FnMut(T) -> Result<I, O>,
    run: impl FnOnce(Vec<I>, &[usize]) -> Vec<R>,
    mut answer: impl FnMut(R) -> O,
    missing: impl Fn() -> O,
) -> Vec<O> {
    let inputs = inputs.into_iter();
    let mut out: Vec<Option<O>> = Vec::with_capacity(inputs.size_hint().0);
    let mut items = Vec::with_capacity(out.capacity());
    let mut idx = Vec::with_capacity(out.capacity());
    for (i, input) in inputs.enumerate() {
        match check(input) {
            Ok(item) => {
                items.push(item);
                idx.push(i);
                out.push(None);
            }
            Err(refused) => out.push(Some(refused)),
        }
    }
    let mut results = run(items, &idx).into_iter();
    out.into_iter()
        .map(|o| o.unwrap_or_else(|| results.next().map_or_else(&missing, &mut answer)))
        .collect()
}
