//! RDMA: the descriptor a peer needs, transport selection, and (with the `rdma` cargo feature)
//! the transport itself over `sideway`/libibverbs. See docs/RDMA.md.
//!
//! - [`RdmaDescriptor`] and its versioned binary/hex encoding, and [`select_route`], are always
//!   compiled, so every build can decode descriptors and tests run without a device.
//! - With the feature, `verbs.rs` opens the device, registers segments as memory regions, sets
//!   up reliable-connection queue pairs over the tcp transfer connection (wire op
//!   `RDMA_CONNECT`); `requester.rs` maps transfers onto one-sided READ/WRITE with many work
//!   requests in flight. Without it, [`RdmaTransport`] is an uninhabited type and every entry point answers
//!   one line naming the fix.

mod choice;
mod desc;
mod gpudirect;
#[cfg(feature = "rdma")]
mod requester;
mod select;
#[cfg(feature = "rdma")]
mod verbs;

use std::any::Any;
use std::sync::OnceLock;

pub use choice::{ProtocolChoice, WireProtocol, reason_of};
pub use desc::{
    RDMA_DESC_FIXED_LEN, RDMA_DESC_MAGIC, RDMA_DESC_MAX_LEN, RDMA_DESC_VERSION,
    RDMA_DEVICE_NAME_MAX, RdmaDescriptor, RdmaDescriptorError,
};
pub use gpudirect::{GPUDIRECT_ENV, GpuDirect, gpudirect};
pub use select::{PeerRdma, Route, RouteFacts, select_route};

use crate::TransferError;

/// True when this build has the RDMA transport (cargo feature `rdma`).
pub const RDMA_COMPILED: bool = cfg!(feature = "rdma");

/// The refusal of a build without the feature.
pub fn msg_not_built() -> String {
    "protocol \"rdma\": this lunakv build has no RDMA transport (rebuild with the cargo feature `rdma`, see docs/RDMA.md); use \"protocol\": \"tcp\"".to_string()
}

/// The refusal when libibverbs lists no device.
pub fn msg_no_device() -> String {
    "protocol \"rdma\": no RDMA device found (ibv_get_device_list returned none); use \"protocol\": \"tcp\"".to_string()
}

/// The refusal when the kernel has no RDMA support (`ibv_get_device_list` fails with ENOSYS).
pub fn msg_no_kernel_support() -> String {
    "protocol \"rdma\": no RDMA device found (ibv_get_device_list: this kernel has no RDMA support, ENOSYS); use \"protocol\": \"tcp\"".to_string()
}

/// The refusal when the device list cannot be read at all.
pub fn msg_list_failed(why: &str) -> String {
    format!(
        "protocol \"rdma\": no RDMA device found (ibv_get_device_list failed: {why}; is libibverbs1 installed and the RDMA kernel stack loaded?); use \"protocol\": \"tcp\""
    )
}

/// The refusal when `LUNAKV_RDMA_DEVICE` names a device that does not exist.
pub fn msg_named_missing(want: &str, have: &[String]) -> String {
    format!(
        "protocol \"rdma\": RDMA device \"{want}\" (LUNAKV_RDMA_DEVICE) not found, devices here: [{}]; fix LUNAKV_RDMA_DEVICE or use \"protocol\": \"tcp\"",
        have.join(", ")
    )
}

/// Names of the RDMA devices libibverbs lists (`ibv_get_device_list`); an empty list is `Ok`.
pub fn rdma_devices() -> Result<Vec<String>, TransferError> {
    #[cfg(feature = "rdma")]
    {
        verbs::device_names()
    }
    #[cfg(not(feature = "rdma"))]
    {
        Err(TransferError::RdmaUnavailable(msg_not_built()))
    }
}

/// Opens the device `protocol: "rdma"` would use and returns its descriptor (no queue pair,
/// no memory). `Err` is [`TransferError::RdmaUnavailable`] with one line naming the fix: the
/// build lacks the feature, no device exists, or the device cannot be opened.
pub fn rdma_check() -> Result<RdmaDescriptor, TransferError> {
    #[cfg(feature = "rdma")]
    {
        verbs::device().map(|d| d.descriptor())
    }
    #[cfg(not(feature = "rdma"))]
    {
        Err(TransferError::RdmaUnavailable(msg_not_built()))
    }
}

#[cfg(feature = "rdma")]
pub use requester::RdmaTransport;

/// Stand-in of a build without the `rdma` feature: it has no values, so an engine never holds
/// one and every use of it is statically dead.
#[cfg(not(feature = "rdma"))]
pub enum RdmaTransport {}

#[cfg(not(feature = "rdma"))]
impl RdmaTransport {
    pub fn open(
        _conns_per_peer: usize,
        _io_timeout: std::time::Duration,
    ) -> Result<RdmaTransport, TransferError> {
        Err(TransferError::RdmaUnavailable(msg_not_built()))
    }

    pub fn local_descriptor(&self) -> RdmaDescriptor {
        match *self {}
    }

    pub(crate) fn probe(&self, _t: &crate::Target) -> Result<(), TransferError> {
        match *self {}
    }
}

#[cfg(not(feature = "rdma"))]
impl crate::Transport for RdmaTransport {
    fn name(&self) -> &'static str {
        match *self {}
    }
    fn write(
        &self,
        _t: &crate::Target,
        _generation: u64,
        _key: &str,
        _offset: u64,
        _src: &[&[u8]],
    ) -> Result<(), TransferError> {
        match *self {}
    }
    fn read(
        &self,
        _t: &crate::Target,
        _generation: u64,
        _offset: u64,
        _dst: &mut [&mut [u8]],
    ) -> Result<(), TransferError> {
        match *self {}
    }
}

/// A segment server's RDMA state: the segment's memory region once
/// [`crate::SegmentServer::enable_rdma`] registered it.
#[derive(Default)]
pub(crate) struct ServerRdma {
    #[cfg(feature = "rdma")]
    mr: OnceLock<verbs::SegmentMr>,
    #[cfg(not(feature = "rdma"))]
    mr: OnceLock<std::convert::Infallible>,
}

impl ServerRdma {
    /// Registers `[base, base+len)` (once; later calls return the same descriptor).
    ///
    /// # Safety
    /// The range must stay mapped as long as `self` lives.
    #[cfg_attr(not(feature = "rdma"), allow(unused_variables))]
    pub(crate) unsafe fn enable(
        &self,
        base: *mut u8,
        len: usize,
    ) -> Result<RdmaDescriptor, TransferError> {
        #[cfg(feature = "rdma")]
        {
            if let Some(m) = self.mr.get() {
                return Ok(m.descriptor());
            }
            // SAFETY: forwarded to the caller.
            let m = unsafe { verbs::SegmentMr::register(base, len) }?;
            Ok(self.mr.get_or_init(|| m).descriptor())
        }
        #[cfg(not(feature = "rdma"))]
        {
            Err(TransferError::RdmaUnavailable(msg_not_built()))
        }
    }

    /// The published descriptor, if RDMA is enabled.
    pub(crate) fn descriptor(&self) -> Option<RdmaDescriptor> {
        #[cfg(feature = "rdma")]
        {
            self.mr.get().map(|m| m.descriptor())
        }
        #[cfg(not(feature = "rdma"))]
        {
            self.mr.get().map(|n| match *n {})
        }
    }

    /// `RDMA_CONNECT`: a queue pair connected to the requester's (returned boxed: it must live
    /// as long as the tcp connection) and our encoded answer. `Err` is the refusal, sent back
    /// to the requester as the BAD_REQUEST message.
    pub(crate) fn accept(
        &self,
        peer: &[u8],
    ) -> Result<(Box<dyn Any + Send>, Vec<u8>), RdmaAcceptError> {
        let peer = RdmaDescriptor::decode(peer)?;
        #[cfg(feature = "rdma")]
        {
            let m = self.mr.get().ok_or(RdmaAcceptError::NotEnabled)?;
            let (qp, answer) = m.accept(&peer)?;
            Ok((Box::new(qp), answer.encode()))
        }
        #[cfg(not(feature = "rdma"))]
        {
            let _ = peer;
            Err(RdmaAcceptError::NotBuilt)
        }
    }
}

/// Why a segment server refuses an `RDMA_CONNECT`. The requester sees the message and falls
/// back to tcp, so each names what is missing on this side.
#[derive(Debug, thiserror::Error)]
pub(crate) enum RdmaAcceptError {
    #[error("RDMA_CONNECT is only valid on the tcp listener")]
    UnixListener,
    #[error("this segment requires capabilities, which rdma does not carry yet; use tcp")]
    CapabilitiesRequired,
    #[error(transparent)]
    BadDescriptor(#[from] RdmaDescriptorError),
    #[cfg(feature = "rdma")]
    #[error("this segment was not started with protocol \"rdma\"")]
    NotEnabled,
    #[cfg(not(feature = "rdma"))]
    #[error("this lunakv build has no RDMA transport")]
    NotBuilt,
    #[cfg(feature = "rdma")]
    #[error(transparent)]
    Verbs(#[from] verbs::VerbsError),
}
