//! Caller memory given as integer pointers: validation, and the one place slices are made.

use lunakv_client::ErrorCode;
use pyo3::prelude::*;

/// Mooncake's INVALID_PARAMS, the answer to any argument this module refuses.
pub const INVALID_PARAMS: i64 = ErrorCode::InvalidParams as i64;

/// A Python int as `i128`, so a negative or oversized pointer or size reaches [`Range::new`]
/// (and its clear refusal) instead of raising `OverflowError` during argument parsing. Ints that
/// fit an `i64` (every real pointer and size) take PyO3's one-call `i64` path: its `i128` path
/// shifts the int apart in 64-bit halves, and at 2 x 1024 ints per vLLM batch (32 objects x 32
/// layers of pointers and sizes) that was ~100 us per call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PyInt(pub i128);

impl<'a, 'py> FromPyObject<'a, 'py> for PyInt {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<PyInt> {
        match obj.extract::<i64>() {
            Ok(v) => Ok(PyInt(i128::from(v))),
            // Out of i64 range (or not an int: then this raises the TypeError upstream raises).
            Err(_) => obj.extract::<i128>().map(PyInt),
        }
    }
}

/// A bound at or above the end of this process's user address space: the power of two above a
/// stack address (stacks sit at the top of user space), and never below 2^47 (x86-64's 4-level
/// user space; arm64's is 2^48 and comes out of the stack address). An address past it (a
/// kernel-half pointer, a negative number cast to a pointer) would fault on the first copy and
/// kill the interpreter, so it is refused instead. 32-bit targets check nothing here.
fn user_space_end() -> usize {
    static END: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *END.get_or_init(|| {
        #[cfg(target_pointer_width = "64")]
        {
            let probe = 0u8;
            let at = std::hint::black_box(&probe) as *const u8 as usize;
            (at | 1)
                .checked_next_power_of_two()
                .unwrap_or(usize::MAX)
                .max(1 << 47)
        }
        #[cfg(not(target_pointer_width = "64"))]
        usize::MAX
    })
}

/// Why a caller's `(ptr, size)` was refused; the call logs it and returns -600.
#[derive(Debug, thiserror::Error)]
pub enum RangeError {
    #[error("buffer pointer {0:#x} is not a valid address")]
    Pointer(i128),
    #[error("buffer size {0} is negative or too large")]
    Size(i128),
    #[error("buffer {ptr:#x}+{len} wraps the address space")]
    Wraps { ptr: usize, len: usize },
    #[error(
        "buffer {ptr:#x}+{len} is not user-space memory (this process's addresses end below {end:#x}): pass a numpy/torch data pointer"
    )]
    NotUserSpace { ptr: usize, len: usize, end: usize },
    #[error("{ptrs} buffer pointers but {sizes} sizes: pass one size per pointer")]
    Counts { ptrs: usize, sizes: usize },
    #[error("{ptrs} buffer pointers but {offsets} offsets: pass one offset per pointer")]
    Offsets { ptrs: usize, offsets: usize },
    #[error("object offset {0} is negative or too large")]
    Offset(i128),
}

/// A checked `(ptr, len)` range of caller memory. Holding one promises nothing about the memory
/// itself; only [`Range::slice`] and [`Range::slice_mut`] turn it into a slice.
#[derive(Debug, Clone, Copy)]
pub struct Range {
    pub ptr: usize,
    pub len: usize,
}

impl Range {
    /// Checks what can be checked about a Python `(ptr, size)` pair: a non-null pointer, a
    /// non-negative size no larger than `isize::MAX`, no wrap past the end of the address space,
    /// and an end inside user space ([`user_space_end`]). `Err` carries the reason for the log.
    pub fn new(ptr: i128, size: i128) -> Result<Range, RangeError> {
        if ptr <= 0 || ptr > usize::MAX as i128 {
            return Err(RangeError::Pointer(ptr));
        }
        if size < 0 || size > isize::MAX as i128 {
            return Err(RangeError::Size(size));
        }
        let (ptr, len) = (ptr as usize, size as usize);
        let Some(end) = ptr.checked_add(len) else {
            return Err(RangeError::Wraps { ptr, len });
        };
        if end > user_space_end() {
            return Err(RangeError::NotUserSpace {
                ptr,
                len,
                end: user_space_end(),
            });
        }
        Ok(Range { ptr, len })
    }

    /// Checks parallel pointer and size lists (one object's pieces).
    pub fn list(ptrs: &[PyInt], sizes: &[PyInt]) -> Result<Vec<Range>, RangeError> {
        if ptrs.len() != sizes.len() {
            return Err(RangeError::Counts {
                ptrs: ptrs.len(),
                sizes: sizes.len(),
            });
        }
        ptrs.iter()
            .zip(sizes)
            .map(|(p, s)| Range::new(p.0, s.0))
            .collect()
    }

    /// The range may be GPU memory (a CUDA tensor's `data_ptr()`): such a slice is only handed
    /// to lunakv-transfer, whose paths classify every piece and copy device pieces by DMA,
    /// never with the CPU (`lunakv_transfer::device`, docs/GPU.md).
    ///
    /// # Safety
    /// The caller of the Python method promised that `ptr..ptr+len` is readable memory that
    /// stays valid and unmodified by others for the duration of the call (upstream's contract).
    pub unsafe fn slice<'a>(self) -> &'a [u8] {
        // SAFETY: `ptr` is non-null (checked in `new`), `u8` needs no alignment, `len` is at
        // most isize::MAX without wrapping, and the caller vouches for validity as documented.
        unsafe { std::slice::from_raw_parts(self.ptr as *const u8, self.len) }
    }

    /// # Safety
    /// As [`Range::slice`], and the memory must be writable and not referenced by any other
    /// live slice: [`disjoint`] checks the latter across one call's destinations.
    pub unsafe fn slice_mut<'a>(self) -> &'a mut [u8] {
        // SAFETY: as in `slice`; exclusivity among this call's destinations is checked by
        // `disjoint` before any `slice_mut` is made, and the caller promises no one else
        // writes the memory during the call.
        unsafe { std::slice::from_raw_parts_mut(self.ptr as *mut u8, self.len) }
    }
}

/// True when no two non-empty ranges overlap (destinations must be exclusive).
pub fn disjoint<'a>(ranges: impl IntoIterator<Item = &'a Range>) -> bool {
    let mut v: Vec<(usize, usize)> = ranges
        .into_iter()
        .filter(|r| r.len > 0)
        .map(|r| (r.ptr, r.ptr + r.len))
        .collect();
    v.sort_unstable();
    v.windows(2).all(|w| w[0].1 <= w[1].0)
}
