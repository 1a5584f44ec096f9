//! How queued copies merge: sorted by device address, the same piece of consecutive vLLM
//! blocks forms a run with one pitch on each side, issued as one 2D copy.

use std::sync::OnceLock;

use lunakv_config::switched_on;

use super::*;

/// One copy waiting for [`Copier::flush`]: `dev` is the device side, `host` the host side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Pending {
    pub(super) ordinal: u32,
    pub(super) dir: CopyDir,
    pub(super) dev: usize,
    pub(super) host: usize,
    pub(super) len: usize,
}

/// Set `LUNAKV_DEVICE_COALESCE=0` to issue one driver call per piece (diagnostics: the GPU
/// check compares both).
pub(super) const COALESCE_ENV: &str = "LUNAKV_DEVICE_COALESCE";

/// Largest pitch handed to a 2D copy: CUDA's `CU_DEVICE_ATTRIBUTE_MAX_PITCH` is 2^31 - 1 on
/// every GPU it has shipped on; wider strides are issued row by row.
pub(super) const MAX_PITCH: usize = i32::MAX as usize;

pub(super) fn coalescing() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| switched_on(COALESCE_ENV))
}

/// A run of copies that is one 2D copy: `height` rows of `len` bytes, row `r` at
/// `dev + r * dev_pitch` and `host + r * host_pitch`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Run {
    pub(super) ordinal: u32,
    pub(super) dir: CopyDir,
    pub(super) dev: usize,
    pub(super) dev_pitch: usize,
    pub(super) host: usize,
    pub(super) host_pitch: usize,
    pub(super) len: usize,
    pub(super) height: usize,
}

impl Run {
    /// One copy as a run of one row.
    pub(super) fn single(p: &Pending) -> Run {
        Run {
            ordinal: p.ordinal,
            dir: p.dir,
            dev: p.dev,
            dev_pitch: p.len,
            host: p.host,
            host_pitch: p.len,
            len: p.len,
            height: 1,
        }
    }
}

/// How many device copies each request put in the queue since the last flush. vLLM's batches
/// queue the same count for every object (one per layer and K/V), which lets [`coalesce`]
/// merge them in order instead of sorting them.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Shape {
    per_request: usize,
    mixed: bool,
}

impl Shape {
    /// One request (a gather or scatter) queued `n` device copies.
    pub(super) fn note(&mut self, n: usize) {
        if n == 0 {
            return;
        }
        if self.per_request == 0 {
            self.per_request = n;
        } else if self.per_request != n {
            self.mixed = true;
        }
    }

    fn columns(self) -> Option<usize> {
        (!self.mixed && self.per_request > 0).then_some(self.per_request)
    }
}

/// Groups `pending` into runs (sorted by device, direction, size and device address; a run
/// keeps one device pitch and one host pitch, both at least the row size).
///
/// A batch of 8192 pieces took 0.1-0.2 ms to sort on the CI machine, more than the rest of
/// queuing it. When each request queued `k` copies ([`Shape`]) and the queue, read as `k`
/// columns (copy `i` of every request), is `k` increasing sequences over disjoint address
/// ranges (vLLM: copy `i` of every block is in layer `i`'s tensor, at growing block offsets),
/// the sorted order is the columns one after another; that is checked in one pass and used
/// instead. Anything else is sorted.
pub(super) fn coalesce(mut pending: Vec<Pending>, shape: Shape) -> Vec<Run> {
    if let Some(k) = shape.columns()
        && let Some(order) = column_order(&pending, k)
    {
        let sorted = order
            .into_iter()
            .flat_map(|c| pending[c..].iter().step_by(k).copied());
        return runs_of(sorted);
    }
    pending.sort_unstable_by_key(|p| (p.ordinal, p.dir == CopyDir::HostToDevice, p.len, p.dev));
    runs_of(pending.into_iter())
}

/// The columns of `pending` (copy `c` of every request, `k` per request) in device address
/// order, if every copy shares one device, direction and size, each column rises strictly and
/// the columns do not interleave: then reading them in this order is the sorted order.
pub(super) fn column_order(pending: &[Pending], k: usize) -> Option<Vec<usize>> {
    let n = pending.len();
    let first = pending.first()?;
    if k == 0 || !n.is_multiple_of(k) {
        return None;
    }
    if pending
        .iter()
        .any(|p| p.ordinal != first.ordinal || p.dir != first.dir || p.len != first.len)
    {
        return None;
    }
    if (k..n).any(|i| pending[i].dev <= pending[i - k].dev) {
        return None;
    }
    let mut cols: Vec<usize> = (0..k).collect();
    cols.sort_unstable_by_key(|&c| pending[c].dev);
    let last = |c: usize| pending[n - k + c].dev;
    if cols.windows(2).any(|w| last(w[0]) >= pending[w[1]].dev) {
        return None;
    }
    Some(cols)
}

/// Runs of `sorted` copies, in order. Not reserved for one run per copy: a vLLM batch's 4096
/// copies per thread make a run or a few per KV tensor.
fn runs_of(sorted: impl Iterator<Item = Pending>) -> Vec<Run> {
    let mut runs: Vec<Run> = Vec::new();
    for p in sorted {
        if let Some(r) = runs.last_mut()
            && r.ordinal == p.ordinal
            && r.dir == p.dir
            && r.len == p.len
        {
            let last_dev = r.dev + (r.height - 1) * r.dev_pitch;
            let last_host = r.host + (r.height - 1) * r.host_pitch;
            let dp = p.dev.wrapping_sub(last_dev);
            let hp = p.host.wrapping_sub(last_host);
            let fits = |pitch: usize| (p.len..=MAX_PITCH).contains(&pitch);
            let extends = if r.height == 1 {
                fits(dp) && fits(hp)
            } else {
                dp == r.dev_pitch && hp == r.host_pitch
            };
            if extends {
                if r.height == 1 {
                    r.dev_pitch = dp;
                    r.host_pitch = hp;
                }
                r.height += 1;
                continue;
            }
        }
        runs.push(Run::single(&p));
    }
    runs
}
