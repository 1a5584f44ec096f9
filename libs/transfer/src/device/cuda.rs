//! The CUDA backend: the driver API of libcuda.so.1 (shipped with the NVIDIA driver), opened
//! with dlopen at run time. Nothing CUDA is needed to build, and a machine without the driver
//! simply has no device layer.
//!
//! Contexts: torch allocates in each device's *primary* context, so this backend retains the
//! primary context of the pointer's device (`CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL`) and makes it
//! current on the copying thread before it creates or uses a stream there.
//!
//! Ran on an H200 (driver 580) through `make test-gpu`; docs/GPU.md says what did and did not.

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::sync::OnceLock;

use parking_lot::Mutex;

use super::{CopyDir, DeviceError, DeviceLayer, MemKind, StreamId};

type CuResult = c_int;
type CuDevice = c_int;
type CuContext = *mut c_void;
type CuStream = *mut c_void;
type CuDevicePtr = u64;

const CUDA_SUCCESS: CuResult = 0;
/// What cuPointerGetAttribute answers for memory the driver does not know: plain host memory.
const CUDA_ERROR_INVALID_VALUE: CuResult = 1;
const CU_POINTER_ATTRIBUTE_MEMORY_TYPE: c_int = 2;
const CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: c_int = 9;
const CU_MEMORYTYPE_HOST: c_uint = 1;
const CU_MEMORYTYPE_DEVICE: c_uint = 2;
const CU_MEMORYTYPE_ARRAY: c_uint = 3;
const CU_MEMORYTYPE_UNIFIED: c_uint = 4;
/// Blocking streams: a copy queued on one waits for work queued before it on the context's legacy
/// default stream, which is torch's default stream. Upstream copies with `cudaMemcpy` (ordered
/// after that work the same way), so an engine that writes its KV cache with kernels and calls
/// the store without synchronizing reads finished bytes on lunakv as on Mooncake. A
/// non-blocking stream would race those kernels (`make test-gpu` checks the ordering).
const CU_STREAM_DEFAULT: c_uint = 0;
/// What cuPointerGetAttribute answers on a thread with no current context (some drivers).
const CUDA_ERROR_INVALID_CONTEXT: CuResult = 201;
/// Registered memory is pinned for every context, not only the current one.
const CU_MEMHOSTREGISTER_PORTABLE: c_uint = 1;

struct Api {
    init: unsafe extern "C" fn(c_uint) -> CuResult,
    device_get_count: unsafe extern "C" fn(*mut c_int) -> CuResult,
    device_get: unsafe extern "C" fn(*mut CuDevice, c_int) -> CuResult,
    primary_ctx_retain: unsafe extern "C" fn(*mut CuContext, CuDevice) -> CuResult,
    ctx_set_current: unsafe extern "C" fn(CuContext) -> CuResult,
    ctx_get_current: unsafe extern "C" fn(*mut CuContext) -> CuResult,
    pointer_get_attribute: unsafe extern "C" fn(*mut c_void, c_int, CuDevicePtr) -> CuResult,
    stream_create: unsafe extern "C" fn(*mut CuStream, c_uint) -> CuResult,
    stream_destroy: unsafe extern "C" fn(CuStream) -> CuResult,
    stream_synchronize: unsafe extern "C" fn(CuStream) -> CuResult,
    memcpy_dtoh_async: unsafe extern "C" fn(*mut c_void, CuDevicePtr, usize, CuStream) -> CuResult,
    memcpy_htod_async:
        unsafe extern "C" fn(CuDevicePtr, *const c_void, usize, CuStream) -> CuResult,
    memcpy_2d_async: unsafe extern "C" fn(*const Memcpy2D, CuStream) -> CuResult,
    mem_host_register: unsafe extern "C" fn(*mut c_void, usize, c_uint) -> CuResult,
    mem_host_unregister: unsafe extern "C" fn(*mut c_void) -> CuResult,
    get_error_name: unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult,
}

/// `CUDA_MEMCPY2D` (cuda.h, unchanged since CUDA 3.2): a pitched copy between linear memories.
#[repr(C)]
struct Memcpy2D {
    src_x_in_bytes: usize,
    src_y: usize,
    src_memory_type: c_uint,
    src_host: *const c_void,
    src_device: CuDevicePtr,
    src_array: *mut c_void,
    src_pitch: usize,
    dst_x_in_bytes: usize,
    dst_y: usize,
    dst_memory_type: c_uint,
    dst_host: *mut c_void,
    dst_device: CuDevicePtr,
    dst_array: *mut c_void,
    dst_pitch: usize,
    width_in_bytes: usize,
    height: usize,
}

/// The loaded driver. The library handle is never closed: function pointers outlive any user.
pub struct Cuda {
    api: Api,
    devices: c_int,
    /// Retained primary context per ordinal.
    contexts: Mutex<Vec<Option<usize>>>,
}

// SAFETY: the driver API is thread-safe; the struct holds function pointers and context handles
// (opaque driver pointers usable from any thread once made current there).
unsafe impl Send for Cuda {}
// SAFETY: see `Send`.
unsafe impl Sync for Cuda {}

fn dlerror() -> String {
    // SAFETY: dlerror returns null or a NUL-terminated thread-local string.
    unsafe {
        let e = libc::dlerror();
        if e.is_null() {
            "unknown error".into()
        } else {
            CStr::from_ptr(e).to_string_lossy().into_owned()
        }
    }
}

/// The function `names[0]` (else an older alias) of the library `handle`, as `F`.
///
/// # Safety
/// `F` must be the function pointer type of that symbol's C signature.
unsafe fn sym<F: Copy>(handle: usize, names: &[&CStr]) -> Result<F, DeviceError> {
    const { assert!(std::mem::size_of::<F>() == std::mem::size_of::<*mut c_void>()) };
    for n in names {
        // SAFETY: a live handle and a NUL-terminated name.
        let p = unsafe { libc::dlsym(handle as *mut c_void, n.as_ptr()) };
        if !p.is_null() {
            // SAFETY: `F` is a function pointer of the same size (checked above) whose type
            // matches the symbol (the caller's contract).
            return Ok(unsafe { std::mem::transmute_copy::<*mut c_void, F>(&p) });
        }
    }
    Err(DeviceError::Unavailable(format!(
        "libcuda.so.1 lacks {:?}: the NVIDIA driver is too old (need CUDA 11 or newer)",
        names[0]
    )))
}

impl Cuda {
    /// Opens libcuda.so.1, resolves the calls, runs cuInit and counts devices.
    pub fn load() -> Result<Cuda, DeviceError> {
        static HANDLE: OnceLock<usize> = OnceLock::new();
        let handle = match HANDLE.get() {
            Some(&h) => h,
            None => {
                // SAFETY: a constant NUL-terminated name; RTLD_NOW resolves everything up front.
                let h = unsafe { libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW) };
                if h.is_null() {
                    return Err(DeviceError::Unavailable(format!(
                        "cannot load libcuda.so.1 ({}): no NVIDIA driver on this machine",
                        dlerror()
                    )));
                }
                *HANDLE.get_or_init(|| h as usize)
            }
        };
        // SAFETY (every `sym` below): each symbol is the driver API function of that name,
        // whose C signature the field's type spells out (cuda.h).
        let api = unsafe {
            Api {
                init: sym(handle, &[c"cuInit"])?,
                device_get_count: sym(handle, &[c"cuDeviceGetCount"])?,
                device_get: sym(handle, &[c"cuDeviceGet"])?,
                primary_ctx_retain: sym(handle, &[c"cuDevicePrimaryCtxRetain"])?,
                ctx_set_current: sym(handle, &[c"cuCtxSetCurrent"])?,
                ctx_get_current: sym(handle, &[c"cuCtxGetCurrent"])?,
                pointer_get_attribute: sym(handle, &[c"cuPointerGetAttribute"])?,
                stream_create: sym(handle, &[c"cuStreamCreate"])?,
                stream_destroy: sym(handle, &[c"cuStreamDestroy_v2", c"cuStreamDestroy"])?,
                stream_synchronize: sym(handle, &[c"cuStreamSynchronize"])?,
                memcpy_dtoh_async: sym(handle, &[c"cuMemcpyDtoHAsync_v2"])?,
                memcpy_htod_async: sym(handle, &[c"cuMemcpyHtoDAsync_v2"])?,
                memcpy_2d_async: sym(handle, &[c"cuMemcpy2DAsync_v2"])?,
                mem_host_register: sym(handle, &[c"cuMemHostRegister_v2", c"cuMemHostRegister"])?,
                mem_host_unregister: sym(handle, &[c"cuMemHostUnregister"])?,
                get_error_name: sym(handle, &[c"cuGetErrorName"])?,
            }
        };
        let mut c = Cuda {
            api,
            devices: 0,
            contexts: Mutex::new(Vec::new()),
        };
        // SAFETY: cuInit takes flags 0; it is idempotent and safe to call from any thread.
        c.check("cuInit", unsafe { (c.api.init)(0) })
            .map_err(|e| DeviceError::Unavailable(format!("the CUDA driver did not start: {e}")))?;
        let mut n: c_int = 0;
        // SAFETY: `n` is a valid out pointer.
        c.check("cuDeviceGetCount", unsafe {
            (c.api.device_get_count)(&mut n)
        })?;
        if n <= 0 {
            return Err(DeviceError::Unavailable(
                "the CUDA driver sees no GPU".into(),
            ));
        }
        c.devices = n;
        c.contexts = Mutex::new(vec![None; n as usize]);
        Ok(c)
    }

    fn error_name(&self, r: CuResult) -> String {
        let mut p: *const c_char = std::ptr::null();
        // SAFETY: cuGetErrorName writes a pointer to a static string or fails.
        let ok = unsafe { (self.api.get_error_name)(r, &mut p) } == CUDA_SUCCESS;
        if ok && !p.is_null() {
            // SAFETY: a static NUL-terminated string owned by the driver.
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        } else {
            format!("CUresult {r}")
        }
    }

    fn check(&self, call: &'static str, r: CuResult) -> Result<(), DeviceError> {
        if r == CUDA_SUCCESS {
            Ok(())
        } else {
            Err(DeviceError::Driver {
                call,
                error: self.error_name(r),
            })
        }
    }

    /// The retained primary context of device `ordinal`.
    fn context(&self, ordinal: u32) -> Result<CuContext, DeviceError> {
        let mut ctxs = self.contexts.lock();
        let slot = ctxs.get_mut(ordinal as usize).ok_or_else(|| {
            DeviceError::Invalid(format!(
                "device ordinal {ordinal} does not exist ({} GPUs visible)",
                self.devices
            ))
        })?;
        if let Some(c) = *slot {
            return Ok(c as CuContext);
        }
        let mut dev: CuDevice = 0;
        // SAFETY: valid out pointer; the ordinal was bounds-checked above.
        self.check("cuDeviceGet", unsafe {
            (self.api.device_get)(&mut dev, ordinal as c_int)
        })?;
        let mut ctx: CuContext = std::ptr::null_mut();
        // SAFETY: valid out pointer and device handle. Retained for the life of the process.
        self.check("cuDevicePrimaryCtxRetain", unsafe {
            (self.api.primary_ctx_retain)(&mut ctx, dev)
        })?;
        *slot = Some(ctx as usize);
        Ok(ctx)
    }

    /// Registration needs a current context: the thread's own (torch's device) if it has one,
    /// else device 0's primary context. Returns what to restore.
    fn bind_for_pinning(&self) -> Result<u64, DeviceError> {
        let mut cur: CuContext = std::ptr::null_mut();
        // SAFETY: valid out pointer.
        self.check("cuCtxGetCurrent", unsafe {
            (self.api.ctx_get_current)(&mut cur)
        })?;
        if cur.is_null() {
            self.bind_thread(0)
        } else {
            Ok(cur as usize as u64)
        }
    }

    fn attribute(&self, attr: c_int, addr: usize) -> Result<Option<c_uint>, DeviceError> {
        let mut v: c_uint = 0;
        let ask = |v: &mut c_uint| {
            // SAFETY: both attributes asked for are 32-bit values written to `v`.
            unsafe {
                (self.api.pointer_get_attribute)(
                    (v as *mut c_uint).cast(),
                    attr,
                    addr as CuDevicePtr,
                )
            }
        };
        let mut r = ask(&mut v);
        if r == CUDA_ERROR_INVALID_CONTEXT {
            // A thread that never touched CUDA (a copy thread, a Python thread before torch):
            // UVA answers for every context once any is current, so device 0's will do. Were
            // this answered "host", the CPU would dereference a device address.
            let prev = self.bind_thread(0)?;
            r = ask(&mut v);
            self.restore_thread(prev);
        }
        match r {
            CUDA_SUCCESS => Ok(Some(v)),
            CUDA_ERROR_INVALID_VALUE => Ok(None),
            r => Err(DeviceError::Driver {
                call: "cuPointerGetAttribute",
                error: self.error_name(r),
            }),
        }
    }
}

impl DeviceLayer for Cuda {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn classify(&self, addr: usize) -> Result<MemKind, DeviceError> {
        let Some(t) = self.attribute(CU_POINTER_ATTRIBUTE_MEMORY_TYPE, addr)? else {
            return Ok(MemKind::Host);
        };
        match t {
            CU_MEMORYTYPE_HOST => Ok(MemKind::HostRegistered),
            // Managed (unified) memory is copied by DMA too: always correct, and never a CPU
            // touch of pages that may live on the GPU.
            CU_MEMORYTYPE_DEVICE | CU_MEMORYTYPE_ARRAY | CU_MEMORYTYPE_UNIFIED => {
                let ordinal = self
                    .attribute(CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, addr)?
                    .unwrap_or(0);
                Ok(MemKind::Device { ordinal })
            }
            _ => Ok(MemKind::Host),
        }
    }

    fn bind_thread(&self, ordinal: u32) -> Result<u64, DeviceError> {
        let ctx = self.context(ordinal)?;
        let mut prev: CuContext = std::ptr::null_mut();
        // SAFETY: valid out pointer; null (no context) is a valid answer.
        self.check("cuCtxGetCurrent", unsafe {
            (self.api.ctx_get_current)(&mut prev)
        })?;
        if prev != ctx {
            // SAFETY: a retained primary context.
            self.check("cuCtxSetCurrent", unsafe {
                (self.api.ctx_set_current)(ctx)
            })?;
        }
        Ok(prev as usize as u64)
    }

    fn restore_thread(&self, previous: u64) {
        // SAFETY: a context that was current on this thread (or null); ours stay retained, and
        // one torch made current is kept alive by torch.
        let _ = unsafe { (self.api.ctx_set_current)(previous as usize as CuContext) };
    }

    fn stream_create(&self, ordinal: u32) -> Result<StreamId, DeviceError> {
        let _ = ordinal; // bound by the caller (Copier::stream)
        let mut s: CuStream = std::ptr::null_mut();
        // SAFETY: valid out pointer; the device's context is current on this thread.
        self.check("cuStreamCreate", unsafe {
            (self.api.stream_create)(&mut s, CU_STREAM_DEFAULT)
        })?;
        Ok(s as usize as StreamId)
    }

    fn stream_destroy(&self, stream: StreamId) {
        // SAFETY: a stream from stream_create that no copier holds any more.
        let _ = unsafe { (self.api.stream_destroy)(stream as usize as CuStream) };
    }

    unsafe fn copy_async(
        &self,
        stream: StreamId,
        dir: CopyDir,
        dst: usize,
        src: usize,
        len: usize,
    ) -> Result<(), DeviceError> {
        let s = stream as usize as CuStream;
        match dir {
            // SAFETY: the caller's contract (valid host side until synchronize; device side
            // live device memory of the stream's device, whose context is current).
            CopyDir::DeviceToHost => self.check("cuMemcpyDtoHAsync", unsafe {
                (self.api.memcpy_dtoh_async)(dst as *mut c_void, src as CuDevicePtr, len, s)
            }),
            // SAFETY: as above.
            CopyDir::HostToDevice => self.check("cuMemcpyHtoDAsync", unsafe {
                (self.api.memcpy_htod_async)(dst as CuDevicePtr, src as *const c_void, len, s)
            }),
        }
    }

    unsafe fn copy_2d_async(
        &self,
        stream: StreamId,
        dir: CopyDir,
        rect: super::Rect,
    ) -> Result<(), DeviceError> {
        let super::Rect {
            dst,
            dst_pitch,
            src,
            src_pitch,
            width,
            height,
        } = rect;
        let (src_type, dst_type) = match dir {
            CopyDir::DeviceToHost => (CU_MEMORYTYPE_DEVICE, CU_MEMORYTYPE_HOST),
            CopyDir::HostToDevice => (CU_MEMORYTYPE_HOST, CU_MEMORYTYPE_DEVICE),
        };
        let host = |a: usize| a as *mut c_void;
        let dev = |a: usize| a as CuDevicePtr;
        let m = Memcpy2D {
            src_x_in_bytes: 0,
            src_y: 0,
            src_memory_type: src_type,
            src_host: if src_type == CU_MEMORYTYPE_HOST {
                host(src)
            } else {
                std::ptr::null_mut()
            },
            src_device: if src_type == CU_MEMORYTYPE_DEVICE {
                dev(src)
            } else {
                0
            },
            src_array: std::ptr::null_mut(),
            src_pitch,
            dst_x_in_bytes: 0,
            dst_y: 0,
            dst_memory_type: dst_type,
            dst_host: if dst_type == CU_MEMORYTYPE_HOST {
                host(dst)
            } else {
                std::ptr::null_mut()
            },
            dst_device: if dst_type == CU_MEMORYTYPE_DEVICE {
                dev(dst)
            } else {
                0
            },
            dst_array: std::ptr::null_mut(),
            dst_pitch,
            width_in_bytes: width,
            height,
        };
        // SAFETY: `m` describes rows the caller vouches for (copy_2d_async's contract); the
        // driver reads the struct during the call only.
        let r = unsafe { (self.api.memcpy_2d_async)(&m, stream as usize as CuStream) };
        if r == CUDA_SUCCESS {
            return Ok(());
        }
        if r == CUDA_ERROR_INVALID_VALUE && height > 1 {
            // Seen on an H200 (driver 580): runs whose device rows span two allocations were
            // refused, and some runs over an embedded owner's segment for a reason not
            // established (docs/GPU.md). Nothing was queued; the caller (`device::copy_2d`)
            // splits the run, with the same code the test double exercises.
            return Err(DeviceError::Refused2d {
                height,
                why: self.error_name(r),
            });
        }
        if height == 1 {
            // SAFETY: one row, as the caller queued it.
            return unsafe { self.copy_async(stream, dir, dst, src, width) };
        }
        // Any other refusal: the same rows one by one, once noted.
        static ONCE: std::sync::Once = std::sync::Once::new();
        let why = self.error_name(r);
        ONCE.call_once(|| {
            tracing::warn!(
                "cuMemcpy2DAsync refused {height} rows of {width} bytes (pitches {src_pitch}/{dst_pitch}): {why}; copying row by row"
            )
        });
        // SAFETY: as above, one row at a time.
        unsafe { super::copy_rows(self, stream, dir, rect) }
    }

    fn synchronize(&self, stream: StreamId) -> Result<(), DeviceError> {
        // SAFETY: a live stream of the context current on this thread.
        self.check("cuStreamSynchronize", unsafe {
            (self.api.stream_synchronize)(stream as usize as CuStream)
        })
    }

    unsafe fn pin(&self, addr: usize, len: usize) -> Result<(), DeviceError> {
        // PORTABLE: the pinning counts for every context, whichever is current here.
        let prev = self.bind_for_pinning()?;
        // SAFETY: the caller's contract (mapped host memory, kept until unpin).
        let r = self.check("cuMemHostRegister", unsafe {
            (self.api.mem_host_register)(addr as *mut c_void, len, CU_MEMHOSTREGISTER_PORTABLE)
        });
        self.restore_thread(prev);
        r
    }

    unsafe fn unpin(&self, addr: usize) -> Result<(), DeviceError> {
        let prev = self.bind_for_pinning()?;
        // SAFETY: the caller's contract (registered by `pin`, no copy in flight).
        let r = self.check("cuMemHostUnregister", unsafe {
            (self.api.mem_host_unregister)(addr as *mut c_void)
        });
        self.restore_thread(prev);
        r
    }
}
