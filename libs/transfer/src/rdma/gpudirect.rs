//! GPUDirect RDMA: whether device (GPU) pieces on an rdma route go to the NIC directly.
//!
//! With GPUDirect (the `nvidia-peermem` kernel module), `ibv_reg_mr` accepts a CUDA device
//! address and the NIC reads or writes GPU memory with no host copy, as upstream Mooncake does.
//! Without it the registration fails. Which of the two a machine has is only known by trying,
//! so the first device piece on an rdma route tries; a refusal is remembered for the process,
//! logged once, and that piece and every later one go over tcp through pinned staging buffers
//! (docs/GPU.md). `LUNAKV_GPUDIRECT=0` skips the attempt.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Mutex, OnceLock};

const UNTRIED: u8 = 0;
const WORKS: u8 = 1;
const REFUSED: u8 = 2;

/// The environment variable that turns the GPUDirect attempt off (`0`, `off`, `false`, `no`).
pub const GPUDIRECT_ENV: &str = "LUNAKV_GPUDIRECT";

/// This process's GPUDirect state: whether the NIC takes device memory is a property of the
/// machine (driver, kernel module), the same for every engine of the process.
pub fn gpudirect() -> &'static GpuDirect {
    static G: OnceLock<GpuDirect> = OnceLock::new();
    G.get_or_init(|| GpuDirect::from_env(&lunakv_config::process_env))
}

/// A GPUDirect state: untried, works, or refused with a reason.
#[derive(Debug)]
pub struct GpuDirect {
    state: AtomicU8,
    why: Mutex<String>,
}

impl GpuDirect {
    /// Untried, unless `LUNAKV_GPUDIRECT` in `env` ([`lunakv_config::process_env`] outside
    /// tests) turns it off.
    pub fn from_env(env: &dyn Fn(&str) -> Option<String>) -> GpuDirect {
        let g = GpuDirect {
            state: AtomicU8::new(UNTRIED),
            why: Mutex::new(String::new()),
        };
        if let Some(v) = env(GPUDIRECT_ENV)
            && matches!(
                v.trim().to_ascii_lowercase().as_str(),
                "0" | "off" | "false" | "no"
            )
        {
            g.state.store(REFUSED, Ordering::Relaxed);
            *g.why.lock().unwrap_or_else(|p| p.into_inner()) = format!("{GPUDIRECT_ENV}={v}");
        }
        g
    }

    /// False once a registration was refused (or the env var said so): device pieces then
    /// skip the rdma transport.
    pub fn allowed(&self) -> bool {
        self.state.load(Ordering::Relaxed) != REFUSED
    }

    /// A device piece was registered with the NIC.
    pub fn worked(&self) {
        let _ = self
            .state
            .compare_exchange(UNTRIED, WORKS, Ordering::Relaxed, Ordering::Relaxed);
    }

    /// Remembers a refused registration. Returns true for the call that turned it off, which
    /// logs the one WARN line: the reason and what serves device pieces instead.
    pub fn refuse(&self, why: &str) -> bool {
        let was = self.state.swap(REFUSED, Ordering::Relaxed);
        if was == REFUSED {
            return false;
        }
        *self.why.lock().unwrap_or_else(|p| p.into_inner()) = why.to_string();
        tracing::warn!(
            %why,
            "GPUDirect RDMA unavailable: device (GPU) memory goes over tcp through pinned staging buffers; load nvidia-peermem for GPUDirect, or set {GPUDIRECT_ENV}=0 to skip the attempt"
        );
        true
    }

    /// `untried`, `on`, or `off (<why>)`, for status lines and logs.
    pub fn describe(&self) -> String {
        match self.state.load(Ordering::Relaxed) {
            UNTRIED => "untried".into(),
            WORKS => "on".into(),
            _ => format!(
                "off ({})",
                self.why.lock().unwrap_or_else(|p| p.into_inner())
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_is_remembered_and_reported_once() {
        let g = GpuDirect {
            state: AtomicU8::new(UNTRIED),
            why: Mutex::new(String::new()),
        };
        assert!(g.allowed());
        assert_eq!(g.describe(), "untried");
        assert!(g.refuse("ibv_reg_mr: Bad address"));
        assert!(!g.refuse("again"), "the second refusal must not log again");
        assert!(!g.allowed());
        assert_eq!(g.describe(), "off (ibv_reg_mr: Bad address)");
        g.worked();
        assert!(!g.allowed(), "a refusal is final for the process");
    }

    #[test]
    fn success_turns_it_on() {
        let g = GpuDirect {
            state: AtomicU8::new(UNTRIED),
            why: Mutex::new(String::new()),
        };
        g.worked();
        assert!(g.allowed());
        assert_eq!(g.describe(), "on");
    }
}
