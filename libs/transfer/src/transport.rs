//! [`Transport`], the three calls every way of moving bytes implements (tcp, shm, rdma), which
//! the engine routes requests to.

use crate::{Target, TransferError, TransferRequest};

/// A way to move bytes to and from a segment. tcp and shm implement it; an RDMA transport
/// implements the same three calls.
pub trait Transport: Send + Sync {
    /// Short name for logs and metrics ("tcp", "shm").
    fn name(&self) -> &'static str;
    /// Stores the concatenation of `src` at `offset` as entry `generation` named `key`.
    fn write(
        &self,
        t: &Target,
        generation: u64,
        key: &str,
        offset: u64,
        src: &[&[u8]],
    ) -> Result<(), TransferError>;
    /// Fills `dst` in order from entry `(generation, offset, total dst len)`.
    fn read(
        &self,
        t: &Target,
        generation: u64,
        offset: u64,
        dst: &mut [&mut [u8]],
    ) -> Result<(), TransferError>;
    /// Runs requests that all go to `t`, results in order. The default runs them one by one;
    /// transports that can pipeline override it.
    fn submit(
        &self,
        t: &Target,
        reqs: &mut [&mut TransferRequest<'_>],
    ) -> Vec<Result<(), TransferError>> {
        reqs.iter_mut().map(|r| self.execute(t, r)).collect()
    }

    /// One request through [`Transport::write`] or [`Transport::read`].
    fn execute(&self, t: &Target, req: &mut TransferRequest<'_>) -> Result<(), TransferError> {
        req.dispatch(
            |_, generation, key, offset, src| self.write(t, generation, key, offset, src),
            |_, generation, offset, dst| self.read(t, generation, offset, dst),
        )
    }
}
