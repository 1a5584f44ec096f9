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

/// Groups `pending` into runs (sorted by device, direction, size and device address; a run
/// keeps one device pitch and one host pitch, both at least the row size).
pub(super) fn coalesce(mut pending: Vec<Pending>) -> Vec<Run> {
    pending.sort_unstable_by_key(|p| (p.ordinal, p.dir == CopyDir::HostToDevice, p.len, p.dev));
    let mut runs: Vec<Run> = Vec::with_capacity(pending.len());
    for p in pending {
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
