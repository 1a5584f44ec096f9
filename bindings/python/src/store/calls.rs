//! What the Python methods share: caller ranges checked and grouped per key, puts (with
//! upsert), gets into caller ranges, per-key calls, and the warnings of refused keys.

use lunakv_client::{ClientError, StoreClient};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use super::handle::MooncakeDistributedStore;
use crate::call::{INTERNAL_ERROR, code, count_code, detached, scatter, unit_code};
use crate::mem::{INVALID_PARAMS, PyInt, Range, RangeError, disjoint};
use crate::types::{ReplicaDescriptor, ReplicateConfig};

/// Puts `items`. With `upsert`, each key's current object is removed first
/// ([`StoreClient::prepare_upsert`]) and a key whose removal failed is not put: its result is
/// that failure.
fn put_items(
    c: &StoreClient,
    items: &[(&str, Vec<&[u8]>)],
    cfg: &lunakv_client::ReplicateConfig,
    upsert: bool,
) -> Vec<Result<(), ClientError>> {
    if !upsert {
        return c.batch_put(items, cfg);
    }
    let keys: Vec<&str> = items.iter().map(|(k, _)| *k).collect();
    let prepared = c.prepare_upsert(&keys);
    scatter(
        items.iter().zip(prepared),
        |((k, parts), p)| p.map(|()| (*k, parts.clone())).map_err(Err),
        |ready, idx| c.batch_put(&ready, &cfg.select(items.len(), idx)),
        |r| r,
        || Err(ClientError::Closed),
    )
}

impl MooncakeDistributedStore {
    /// Puts objects given as lists of caller ranges; one result per key.
    pub(super) fn put_ranges(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        ranges: Vec<Result<Vec<Range>, RangeError>>,
        config: Option<PyRef<'_, ReplicateConfig>>,
        upsert: bool,
    ) -> Vec<i64> {
        let n = keys.len();
        let Some(c) = self.client() else {
            return vec![INVALID_PARAMS; n];
        };
        let cfg = config.map(|c| c.to_client()).unwrap_or_default();
        detached(py, vec![INTERNAL_ERROR; n], move || {
            scatter(
                keys.iter().zip(ranges),
                |(key, r)| match r {
                    // SAFETY: the caller promised these ranges are valid readable memory for
                    // the duration of this call (module docs); they were checked by Range::new.
                    Ok(parts) => Ok((
                        key.as_str(),
                        parts
                            .iter()
                            .map(|p| unsafe { p.slice() })
                            .collect::<Vec<_>>(),
                    )),
                    Err(msg) => {
                        tracing::error!("lunakv: put of '{key}' refused: {msg}");
                        Err(INVALID_PARAMS)
                    }
                },
                |items, idx| put_items(&c, &items, &cfg.select(n, idx), upsert),
                |r| unit_code("put", r),
                || INVALID_PARAMS,
            )
        })
    }

    /// `put` / `put_batch` / `put_parts` and their upsert forms: each object made of its
    /// bytes-like parts. 0 when every object was stored, else the first failure's code.
    pub(super) fn put_values(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        objects: Vec<Vec<Bound<'_, PyAny>>>,
        config: Option<PyRef<'_, ReplicateConfig>>,
        upsert: bool,
        call: &str,
    ) -> i64 {
        if keys.len() != objects.len() {
            tracing::error!(
                "lunakv: {call} refused: {} keys but {} values",
                keys.len(),
                objects.len()
            );
            return INVALID_PARAMS;
        }
        // A batch with an invalid key is refused whole, before anything is stored, so -400
        // means no key of it was put (a caller retrying the batch cannot double-put). Failures met while putting (no space,
        // a key that exists) leave the other keys stored and answer the first error, as
        // upstream's put_batch does; batch_put_from answers per key.
        if let Some((i, e)) = keys
            .iter()
            .enumerate()
            .find_map(|(i, k)| lunakv_proto::validate_key(k).err().map(|e| (i, e)))
        {
            let e = ClientError::InvalidKey(e);
            tracing::error!(
                "lunakv: {call} refused: key #{i} of {}: {e}; nothing of the call was stored",
                keys.len()
            );
            return code(&e);
        }
        let Ok(owned) = objects
            .iter()
            .map(|parts| parts.iter().map(as_bytes).collect::<PyResult<Vec<_>>>())
            .collect::<PyResult<Vec<_>>>()
        else {
            tracing::error!("lunakv: {call} refused: a value is not bytes-like");
            return INVALID_PARAMS;
        };
        let Some(c) = self.client() else {
            return INVALID_PARAMS;
        };
        let cfg = config.map(|c| c.to_client()).unwrap_or_default();
        let data: Vec<Vec<&[u8]>> = owned
            .iter()
            .map(|parts| parts.iter().map(|b| b.as_bytes()).collect())
            .collect();
        detached(py, INTERNAL_ERROR, move || {
            let items: Vec<(&str, Vec<&[u8]>)> = keys
                .iter()
                .map(String::as_str)
                .zip(data.iter().cloned())
                .collect();
            put_items(&c, &items, &cfg, upsert)
                .into_iter()
                .find_map(|r| r.err())
                .map_or(0, |e| code(&e))
        })
    }

    /// Reads objects into lists of caller ranges; one result (bytes read, or a code) per key.
    pub(super) fn get_ranges(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        ranges: Vec<Result<Vec<Range>, RangeError>>,
    ) -> Vec<i64> {
        let n = keys.len();
        let Some(c) = self.client() else {
            return vec![INVALID_PARAMS; n];
        };
        if !disjoint(ranges.iter().flatten().flatten()) {
            tracing::error!("lunakv: get refused: destination buffers overlap each other");
            return vec![INVALID_PARAMS; n];
        }
        detached(py, vec![INTERNAL_ERROR; n], move || {
            scatter(
                keys.iter().zip(ranges),
                |(key, r)| match r {
                    // SAFETY: the caller promised these ranges are valid writable memory for the
                    // duration of this call; `disjoint` above proved no two of them overlap.
                    Ok(parts) => Ok((
                        key.as_str(),
                        parts
                            .iter()
                            .map(|p| unsafe { p.slice_mut() })
                            .collect::<Vec<_>>(),
                    )),
                    Err(msg) => {
                        tracing::error!("lunakv: get of '{key}' refused: {msg}");
                        Err(INVALID_PARAMS)
                    }
                },
                |items, _| {
                    let (ks, mut dsts): (Vec<&str>, Vec<Vec<&mut [u8]>>) =
                        items.into_iter().unzip();
                    if ks.len() == 1 {
                        vec![c.get_into_parts(ks[0], &mut dsts[0])]
                    } else {
                        c.batch_get_into(&ks, &mut dsts)
                    }
                },
                |r| count_code("get", r),
                || INVALID_PARAMS,
            )
        })
    }

    /// One status per key from a per-key client call (exists, remove).
    pub(super) fn per_key<T, F, M>(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        call: F,
        map: M,
    ) -> Vec<i64>
    where
        F: FnOnce(&StoreClient, &[&str]) -> Vec<Result<T, ClientError>> + Send,
        M: Fn(T) -> i64 + Send,
        T: Send,
    {
        let n = keys.len();
        let Some(c) = self.client() else {
            return vec![INVALID_PARAMS; n];
        };
        detached(py, vec![INTERNAL_ERROR; n], move || {
            let ks: Vec<&str> = keys.iter().map(String::as_str).collect();
            call(&c, &ks)
                .into_iter()
                .map(|r| match r {
                    Ok(v) => map(v),
                    Err(e) => code(&e),
                })
                .collect()
        })
    }

    pub(super) fn replicas(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
    ) -> Vec<(String, Vec<ReplicaDescriptor>)> {
        let Some(c) = self.client() else {
            return Vec::new();
        };
        detached(py, Vec::new(), move || {
            let ks: Vec<&str> = keys.iter().map(String::as_str).collect();
            let found = c.batch_replicas(&ks);
            keys.iter()
                .zip(found)
                .filter_map(|(k, r)| match r {
                    Ok(reps) => Some((
                        k.clone(),
                        reps.iter().map(ReplicaDescriptor::from).collect(),
                    )),
                    Err(e) => {
                        tracing::debug!("lunakv: replica query for '{k}' failed: {e}");
                        None
                    }
                })
                .collect()
        })
    }
}

/// `value` as `bytes`: itself when it is `bytes` (no copy), else `bytes(value)`.
fn as_bytes<'py>(value: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyBytes>> {
    if let Ok(b) = value.cast::<PyBytes>() {
        return Ok(b.clone());
    }
    if value.is_instance_of::<pyo3::types::PyString>() {
        return Err(pyo3::exceptions::PyTypeError::new_err(
            "str is not bytes-like",
        ));
    }
    let b = value.py().get_type::<PyBytes>().call1((value,))?;
    Ok(b.cast_into::<PyBytes>()?)
}

/// A `mooncake.store.BufferHandle` holding `data`, or `None` for a miss (no object is empty: a
/// put of 0 bytes is refused).
pub(super) fn buffer_handle<'py>(
    py: Python<'py>,
    data: Option<&[u8]>,
) -> PyResult<Bound<'py, PyAny>> {
    let Some(data) = data.filter(|d| !d.is_empty()) else {
        return Ok(py.None().into_bound(py));
    };
    // A zeroed handle of the right length, filled in place: one copy of the object.
    let h = py
        .import("mooncake.store")?
        .getattr("BufferHandle")?
        .call1((data.len(),))?;
    let ba = h.cast::<pyo3::types::PyByteArray>()?;
    // SAFETY: `ba` was just made, is not shared with Python code yet, and is not resized while
    // the slice lives.
    unsafe { ba.as_bytes_mut() }.copy_from_slice(data);
    Ok(h)
}

/// Per-key single ranges; None when the list lengths disagree.
pub(super) fn single_ranges(
    n: usize,
    ptrs: &[PyInt],
    sizes: &[PyInt],
) -> Option<Vec<Result<Vec<Range>, RangeError>>> {
    if ptrs.len() != n || sizes.len() != n {
        tracing::error!(
            "lunakv: refused: {n} keys, {} pointers, {} sizes: pass one of each per key",
            ptrs.len(),
            sizes.len()
        );
        return None;
    }
    Some(
        ptrs.iter()
            .zip(sizes)
            .map(|(p, s)| Range::new(p.0, s.0).map(|r| vec![r]))
            .collect(),
    )
}

/// Per-key lists of ranges; None when the outer list lengths disagree.
pub(super) fn multi_ranges(
    n: usize,
    ptrs: &[Vec<PyInt>],
    sizes: &[Vec<PyInt>],
) -> Option<Vec<Result<Vec<Range>, RangeError>>> {
    if ptrs.len() != n || sizes.len() != n {
        tracing::error!(
            "lunakv: refused: {n} keys, {} pointer lists, {} size lists: pass one of each per key",
            ptrs.len(),
            sizes.len()
        );
        return None;
    }
    Some(
        ptrs.iter()
            .zip(sizes)
            .map(|(p, s)| Range::list(p, s))
            .collect(),
    )
}

/// Per-key lists of `(offset, range)`; None when the outer list lengths disagree. A key whose
/// inner lists disagree, or with a bad pointer, size or offset, fails alone.
#[allow(clippy::type_complexity)]
pub(super) fn offset_ranges(
    n: usize,
    ptrs: &[Vec<PyInt>],
    sizes: &[Vec<PyInt>],
    offsets: &[Vec<PyInt>],
) -> Option<Vec<Result<Vec<(u64, Range)>, RangeError>>> {
    if ptrs.len() != n || sizes.len() != n || offsets.len() != n {
        tracing::error!(
            "lunakv: refused: {n} keys, {} pointer lists, {} size lists, {} offset lists: pass \
             one of each per key",
            ptrs.len(),
            sizes.len(),
            offsets.len()
        );
        return None;
    }
    Some(
        ptrs.iter()
            .zip(sizes)
            .zip(offsets)
            .map(|((p, s), o)| {
                if o.len() != p.len() {
                    return Err(RangeError::Offsets {
                        ptrs: p.len(),
                        offsets: o.len(),
                    });
                }
                let ranges = Range::list(p, s)?;
                o.iter()
                    .zip(ranges)
                    .map(|(off, r)| {
                        u64::try_from(off.0)
                            .map(|off| (off, r))
                            .map_err(|_| RangeError::Offset(off.0))
                    })
                    .collect()
            })
            .collect(),
    )
}

/// One warning per call that refused keys at a session bound, naming the bound: the caller
/// sees only -200, which also means a full pool.
pub(super) fn warn_session_limit<T>(call: &str, results: &[Result<T, ClientError>]) {
    let mut refused = results
        .iter()
        .filter_map(|r| r.as_ref().err())
        .filter(|e| matches!(e, ClientError::SessionLimit { .. }));
    if let Some(first) = refused.next() {
        tracing::warn!(
            "lunakv: {call} refused {} key(s) at a session bound: {first}",
            1 + refused.count()
        );
    }
}
