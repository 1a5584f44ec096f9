//! The in-process path: a [`TransferEngine`](crate::TransferEngine) whose target is a
//! [`SegmentServer`] living in this very process (an engine in embedded mode writing to and
//! reading from its own segment) copies straight against the server's mapping and entry table.
//! No socket, no syscall: a get is pin -> memcpy -> unpin, a put is invalidate -> memcpy ->
//! commit, with exactly the checks, generation rules and counters of the tcp READ/WRITE ops.
//!
//! Servers are attached explicitly ([`TransferEngine::attach_local`](crate::TransferEngine::attach_local));
//! the engine keeps weak references, so a server that is dropped frees its memory, and one that
//! was shut down is skipped (requests then go over the sockets and fail like any stopped owner).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};

use parking_lot::RwLock;

use crate::device::Copier;
use crate::mem::{Mapping, copy_in_any, copy_out_any, queue_in, queue_out};
use crate::server::state::{OVERWRITE_PIN_WAIT, Shared};
use crate::table::PinResult;
use crate::tcp::{check_request, total_len};
use crate::{PlacementProof, SegmentServer, Target, TransferError, TransferRequest};

struct Attached {
    endpoint: String,
    host_id: String,
    shared: Weak<Shared>,
}

/// The servers of this process an engine may reach directly.
#[derive(Default)]
pub(crate) struct LocalSegments {
    list: RwLock<Vec<Attached>>,
}

impl LocalSegments {
    pub(crate) fn attach(&self, server: &SegmentServer) {
        let info = server.info();
        let mut l = self.list.write();
        l.retain(|a| a.shared.strong_count() > 0 && a.endpoint != info.transfer_endpoint);
        l.push(Attached {
            endpoint: info.transfer_endpoint,
            host_id: info.host_id,
            shared: Arc::downgrade(&server.shared),
        });
    }

    pub(crate) fn detach(&self, server: &SegmentServer) {
        let me = Arc::downgrade(&server.shared);
        self.list
            .write()
            .retain(|a| a.shared.strong_count() > 0 && !Weak::ptr_eq(&a.shared, &me));
    }

    /// The live, running server behind `t`, if it is attached.
    pub(crate) fn find(&self, t: &Target) -> Option<Arc<Shared>> {
        let l = self.list.read();
        if l.is_empty() {
            return None;
        }
        let a = l
            .iter()
            .find(|a| a.endpoint == t.endpoint && a.host_id == t.host_id)?;
        let s = a.shared.upgrade()?;
        (!s.stopping.load(Ordering::SeqCst)).then_some(s)
    }
}

fn bounds(m: &Mapping, offset: u64, len: u64) -> Result<usize, TransferError> {
    m.check(offset, len)
        .map(|(off, _)| off)
        .ok_or(TransferError::OutOfBounds {
            offset,
            len,
            size: m.len(),
        })
}

/// The placement proof the master attached to a write target's capability: the in-process
/// owner keeps it, as a WRITE over a socket would.
fn proof_of(t: &Target) -> Option<PlacementProof> {
    t.capability.as_ref().and_then(crate::Capability::proof)
}

/// WRITE against an in-process segment: the tcp WRITE op without the socket.
pub(crate) fn write(
    s: &Shared,
    t: &Target,
    generation: u64,
    key: &str,
    offset: u64,
    src: &[&[u8]],
) -> Result<(), TransferError> {
    let len = total_len(src.iter().map(|p| p.len()));
    check_request(t, Some(key), offset, len)?;
    let off = bounds(&s.mem, offset, len)?;
    // Retire what lives there (new reads answer STALE) and wait for readers still copying it.
    s.table.invalidate_range(offset, len, OVERWRITE_PIN_WAIT);
    // [off, off+len) is inside the mapping (checked above) and its entries were just retired
    // with their readers waited for, so nobody reads the range while we fill it. Device pieces
    // are one DMA each into the (pinned) segment; host pieces a CPU copy that stays correct even
    // if a caller passed bytes of the segment (memmove).
    copy_in_any(&s.mem, off, src)?;
    s.table
        .commit(generation, key.to_owned(), offset, len, proof_of(t));
    s.counters.writes.fetch_add(1, Ordering::Relaxed);
    s.counters.bytes_written.fetch_add(len, Ordering::Relaxed);
    Ok(())
}

/// READ against an in-process segment: pin the exact entry, copy, unpin.
pub(crate) fn read(
    s: &Shared,
    t: &Target,
    generation: u64,
    offset: u64,
    dst: &mut [&mut [u8]],
) -> Result<(), TransferError> {
    let len = total_len(dst.iter().map(|p| p.len()));
    check_request(t, None, offset, len)?;
    let off = bounds(&s.mem, offset, len)?;
    let pin = match s.table.pin(generation, offset, len) {
        PinResult::Pinned(p) => p,
        PinResult::Stale => return Err(TransferError::Stale { generation }),
    };
    s.counters.reads.fetch_add(1, Ordering::Relaxed);
    s.counters.bytes_read.fetch_add(len, Ordering::Relaxed);
    // Bounds-checked and pinned: no WRITE or FREE reuses the range until the unpin.
    let copied = copy_out_any(&s.mem, off, dst);
    s.table.unpin(pin);
    copied
}

/// A request whose device copies are queued on a [`Copier`]: finished by [`Queued::finish`]
/// once the copier synchronized.
pub(crate) enum Queued {
    /// Bytes are in place after the sync: commit the entry.
    Write {
        generation: u64,
        key: String,
        offset: u64,
        len: u64,
        proof: Option<PlacementProof>,
    },
    /// The entry is pinned until the copy out of it finished.
    Read(crate::table::PinId),
}

/// Starts a request of a batch with device pieces: the checks, invalidation or pin, and the
/// copies (host pieces done, device pieces queued on `c`). Several are started, `c` is
/// synchronized once, then each is finished: one synchronize per batch and thread.
pub(crate) fn start(
    s: &Shared,
    req: &mut TransferRequest<'_>,
    c: &mut Copier,
) -> Result<Queued, TransferError> {
    match req {
        TransferRequest::Write {
            target,
            generation,
            key,
            offset,
            src,
        } => {
            let (generation, offset) = (*generation, *offset);
            let len = total_len(src.iter().map(|p| p.len()));
            check_request(target, Some(*key), offset, len)?;
            let off = bounds(&s.mem, offset, len)?;
            s.table.invalidate_range(offset, len, OVERWRITE_PIN_WAIT);
            // Retired and waited for, as in `write`: nobody reads the range until the commit.
            queue_in(&s.mem, off, src, c)?;
            Ok(Queued::Write {
                generation,
                key: (*key).to_owned(),
                offset,
                len,
                proof: proof_of(target),
            })
        }
        TransferRequest::Read {
            target,
            generation,
            offset,
            dst,
        } => {
            let (generation, offset) = (*generation, *offset);
            let len = total_len(dst.iter().map(|p| p.len()));
            check_request(target, None, offset, len)?;
            let off = bounds(&s.mem, offset, len)?;
            let pin = match s.table.pin(generation, offset, len) {
                PinResult::Pinned(p) => p,
                PinResult::Stale => return Err(TransferError::Stale { generation }),
            };
            s.counters.reads.fetch_add(1, Ordering::Relaxed);
            s.counters.bytes_read.fetch_add(len, Ordering::Relaxed);
            // Pinned: not rewritten before `finish` unpins it.
            match queue_out(&s.mem, off, dst, c) {
                Ok(()) => Ok(Queued::Read(pin)),
                Err(e) => {
                    // Copies already queued out of the range must land before it is unpinned.
                    let _ = c.sync();
                    s.table.unpin(pin);
                    Err(e)
                }
            }
        }
    }
}

impl Queued {
    /// Completes a started request once its copier synchronized (`synced`: that sync's result).
    pub(crate) fn finish(
        self,
        s: &Shared,
        synced: &Result<(), TransferError>,
    ) -> Result<(), TransferError> {
        match self {
            Queued::Write {
                generation,
                key,
                offset,
                len,
                proof,
            } => {
                if let Err(e) = synced {
                    return Err(e.duplicate());
                }
                s.table.commit(generation, key, offset, len, proof);
                s.counters.writes.fetch_add(1, Ordering::Relaxed);
                s.counters.bytes_written.fetch_add(len, Ordering::Relaxed);
                Ok(())
            }
            Queued::Read(pin) => {
                s.table.unpin(pin);
                synced
                    .as_ref()
                    .map(|_| ())
                    .map_err(TransferError::duplicate)
            }
        }
    }
}

/// One batch request against an in-process segment.
pub(crate) fn execute(s: &Shared, req: &mut TransferRequest<'_>) -> Result<(), TransferError> {
    req.dispatch(
        |t, generation, key, offset, src| write(s, t, generation, key, offset, src),
        |t, generation, offset, dst| read(s, t, generation, offset, dst),
    )
}

/// Chunk of one MADV_POPULATE_WRITE call: small enough that shutdown is noticed quickly, and
/// that the prefault threads advance one front from offset 0 (where the first puts land).
const PREFAULT_CHUNK: usize = 16 << 20;
/// Threads faulting a segment in. A fresh shmem page costs ~7 us here (allocate, zero, charge,
/// map): one thread populates ~0.6 GB/s, so a 1 GiB head takes ~1.7 s with one thread, time in
/// which an engine's first puts race it and fault pages themselves.
const PREFAULT_THREADS: usize = 2;

impl SegmentServer {
    /// Faults in (allocates) the first `max_bytes` of the segment on background threads (up to
    /// `PREFAULT_THREADS`, never more than the machine's cores), so writes into fresh ranges do
    /// not pay a page fault per 4 KiB. Uses MADV_POPULATE_WRITE (Linux >= 5.14; older kernels: a
    /// no-op). The memory is committed, as if written: size `max_bytes` to what the owner expects
    /// to fill. Stops early on shutdown. Returns the thread that waits for the others, which
    /// callers may join (benchmarks) or drop.
    pub fn prefault_in_background(
        &self,
        max_bytes: u64,
    ) -> std::io::Result<std::thread::JoinHandle<()>> {
        let shared = self.shared.clone();
        let threads = std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .clamp(1, PREFAULT_THREADS);
        std::thread::Builder::new()
            .name("lunakv-seg-prefault".into())
            .spawn(move || {
                let total = max_bytes.min(shared.mem.len()) as usize;
                let next = AtomicUsize::new(0);
                let failed = AtomicBool::new(false);
                let work = || {
                    while !shared.stopping.load(Ordering::Relaxed)
                        && !failed.load(Ordering::Relaxed)
                    {
                        let at = next.fetch_add(PREFAULT_CHUNK, Ordering::Relaxed);
                        if at >= total {
                            return;
                        }
                        let n = PREFAULT_CHUNK.min(total - at);
                        // SAFETY: [at, at+n) lies inside the live mapping (`shared` keeps it
                        // mapped); POPULATE_WRITE only faults pages in, never changes contents.
                        let r = unsafe {
                            rustix::mm::madvise(
                                shared.mem.ptr_at(at).cast(),
                                n,
                                rustix::mm::Advice::LinuxPopulateWrite,
                            )
                        };
                        if let Err(e) = r {
                            // EINVAL: kernel < 5.14. Anything else (ENOMEM...): stop quietly.
                            tracing::debug!(error = %e, "segment prefault stopped");
                            failed.store(true, Ordering::Relaxed);
                        }
                    }
                };
                std::thread::scope(|s| {
                    for _ in 1..threads {
                        let spawned = std::thread::Builder::new()
                            .name("lunakv-seg-prefault".into())
                            .spawn_scoped(s, work);
                        if let Err(e) = spawned {
                            tracing::debug!(error = %e, "a prefault thread did not start");
                        }
                    }
                    work();
                });
            })
    }
}

#[cfg(test)]
mod tests {
    use crate::{SegmentServer, SegmentServerConfig};

    /// Resident 4 KiB pages of `[from, to)` of the server's mapping (mincore).
    fn resident(s: &SegmentServer, from: usize, to: usize) -> usize {
        let mut v = vec![0u8; (to - from) / 4096];
        // SAFETY: the range lies inside the live mapping; mincore only reads page tables.
        let rc =
            unsafe { libc::mincore(s.shared.mem.ptr_at(from).cast(), to - from, v.as_mut_ptr()) };
        assert_eq!(rc, 0, "mincore: {}", std::io::Error::last_os_error());
        v.iter().filter(|&&b| b & 1 == 1).count()
    }

    /// MADV_POPULATE_WRITE exists on this kernel (>= 5.14), tried on a scratch page.
    fn populate_supported() -> bool {
        // SAFETY: a fresh private anonymous page, unmapped below; madvise touches only it.
        unsafe {
            let p = libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            );
            assert_ne!(p, libc::MAP_FAILED);
            let ok = libc::madvise(p, 4096, libc::MADV_POPULATE_WRITE) == 0;
            libc::munmap(p, 4096);
            ok
        }
    }

    #[test]
    fn prefault_populates_exactly_the_head_it_was_asked_for() {
        const MIB: usize = 1 << 20;
        let s = SegmentServer::start(SegmentServerConfig {
            bind: "127.0.0.1:0".parse().unwrap(),
            size: 72 * MIB as u64,
            shm_socket: None,
            advertise_host: None,
            ..Default::default()
        })
        .unwrap();
        assert_eq!(resident(&s, 0, 72 * MIB), 0, "a fresh segment is sparse");
        // 40 MiB: two full chunks and a partial one, spread over the prefault threads.
        s.prefault_in_background(40 * MIB as u64)
            .unwrap()
            .join()
            .unwrap();
        let head = resident(&s, 0, 40 * MIB);
        if populate_supported() {
            assert_eq!(head, 40 * MIB / 4096, "every page of the head is in");
        }
        assert_eq!(resident(&s, 40 * MIB, 72 * MIB), 0, "nothing past the head");
    }
}
