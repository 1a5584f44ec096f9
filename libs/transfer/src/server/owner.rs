//! The calls only the master's owner tag opens: FREE, OFFLOAD, LOAD and PROMOTE, whose bodies
//! are read in bounded chunks, and the cold tier's side of them.

use std::io::{self, Read};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::conn::{Conn, End, Stream};
use super::state::{BODY_STEP, LOAD_BUF_KEEP, OVERWRITE_PIN_WAIT, PAIRS_PER_CHUNK, Shared};
use crate::cap::RIGHT_READ;
use crate::table::{Freed, Pinned};
use crate::wire::{self, Request, Status};
use crate::{ColdDropped, ColdItem};

impl<S: Stream> Conn<'_, S> {
    pub(super) fn free(&mut self, req: &Request) -> Result<(), End> {
        let shared = self.shared;
        let count = Self::item_count(req, "FREE")?;
        let deadline = Instant::now() + Duration::from_millis(u64::from(req.aux));
        let mut pinned = Vec::new();
        let mut writing = Vec::new();
        let Some(buffered) = self.owner_body(req, count)? else {
            return Ok(());
        };
        let mut body = Body::of(&mut self.rd, buffered);
        for_each_chunk(&mut body, &mut self.free_buf, count, |items| {
            let disk: Vec<u64> = items
                .iter()
                .filter(|(_, o)| *o == wire::DISK_OFFSET)
                .map(|(g, _)| *g)
                .collect();
            if !disk.is_empty()
                && let Some(cold) = shared.cold.get()
            {
                cold.remove(&disk);
            }
            let freed = shared.table.free_items(items);
            pinned.extend(freed.pinned);
            writing.extend(freed.writing);
        })?;
        // OK promises the master the ranges are unused: no reader holds a pin and no write of
        // a freed generation is still copying (it could land in the range's next owner).
        let freed = Freed { pinned, writing };
        if shared.table.wait_freed(&freed, deadline) {
            self.reply(Status::Ok, 0, "")?;
        } else {
            let why = if freed.writing.is_empty() {
                "entries dropped but readers still hold pins"
            } else {
                "entries dropped but writes of them are still in flight"
            };
            self.reply(Status::Timeout, 0, why)?;
        }
        Ok(())
    }

    /// The body of a FREE or OFFLOAD of `count` pairs, to be read from: the socket itself when
    /// the owner requires no capabilities (pairs are applied as they arrive), else the whole
    /// body read first so that the master's tag is checked before any pair is applied.
    /// `Ok(None)`: refused (answered); `Ok(Some(None))`: read the socket.
    ///
    /// Before a single body byte is buffered the header must pass the master's header-only tag
    /// ([`Capability::verify_owner_header`]): anyone else's body is discarded as it arrives, so
    /// a stranger's FREE costs the owner its header, however large a body it claims. A tagged
    /// header's body is then buffered as it arrives, [`BODY_STEP`] bytes at a time, against
    /// [`UNVERIFIED_BODY_BUDGET`] shared by every such body until its whole tag is checked.
    #[allow(clippy::option_option)]
    fn owner_body(&mut self, req: &Request, count: usize) -> Result<Option<Option<Vec<u8>>>, End> {
        let Some((secret, _)) = self.shared.secret.get() else {
            return Ok(Some(None));
        };
        let total = count * 16;
        let header = match &self.cap {
            None => Err(crate::CapError::Missing),
            Some(c) => c.verify_owner_header(secret, &req.encode()),
        };
        if let Err(why) = header {
            self.refuse(
                req,
                &format!("{} not from the master: {why}", req.op.name()),
            )?;
            // Consumed without keeping a byte, so the stream stays in step (as after a refused
            // WRITE); the request's deadline bounds how long a peer may take to send it.
            crate::vio::discard(&mut self.rd, total as u64)?;
            return Ok(None);
        }
        let mut lease = self.shared.unverified.lease();
        let until = Instant::now() + self.shared.request_timeout;
        let mut all: Vec<u8> = Vec::new();
        while all.len() < total {
            let n = (total - all.len()).min(BODY_STEP);
            if all.capacity() < all.len() + n {
                // Doubling, so a big body costs few copies; the budget counts what is reserved.
                let cap = (all.capacity() * 2).clamp(all.len() + n, total);
                if !lease.grow(cap as u64, until) {
                    return Err(End::Busy);
                }
                all.reserve_exact(cap - all.len());
            }
            let at = all.len();
            all.resize(at + n, 0);
            self.rd.read_exact(&mut all[at..])?;
        }
        if !self.owner_allowed(req, &all)? {
            return Ok(None);
        }
        Ok(Some(Some(all)))
    }

    /// `report`: the master asked for the disk tier's drops in the answer ([`wire::FLAG_DROPS`]).
    pub(super) fn offload(&mut self, req: &Request, report: bool) -> Result<(), End> {
        let shared = self.shared;
        let count = Self::item_count(req, "OFFLOAD")?;
        let deadline = Instant::now() + Duration::from_millis(u64::from(req.aux));
        let mut pinned = Vec::new();
        let mut stored = 0u64;
        // Grow only with pairs actually received (failed: at most one per pair).
        let mut failed: Vec<u64> = Vec::new();
        let mut dropped: Vec<ColdDropped> = Vec::new();
        let Some(buffered) = self.owner_body(req, count)? else {
            return Ok(());
        };
        let mut pairs = Body::of(&mut self.rd, buffered);
        let read = for_each_chunk(&mut pairs, &mut self.free_buf, count, |items| {
            let (s, f, d) = offload(shared, items, report);
            stored += s;
            failed.extend(f);
            dropped.extend(d);
            // Durable (or failed): now the DRAM entries go, exactly as FREE.
            pinned.extend(shared.table.retire_items(items));
        });
        let cold = shared.cold.get();
        // Drops that no answer will carry go back to the tier's own reporting (the Ping), or
        // the master would keep calling those objects present.
        let report_later = |d: Vec<ColdDropped>| {
            if let Some(cold) = cold
                && !d.is_empty()
            {
                cold.report_later(d);
            }
        };
        if let Err(e) = read {
            report_later(dropped);
            return Err(e.into());
        }
        shared.table.wait_unpinned(&pinned, deadline);
        if !report {
            let body: Vec<u8> = failed.iter().flat_map(|g| g.to_le_bytes()).collect();
            self.reply_body(stored, &body)?;
            return Ok(());
        }
        // What one answer may carry (the requester's bounds); the rest goes on the Ping.
        let (mut fit, mut rest) = (Vec::new(), Vec::new());
        let mut bytes = 0usize;
        for d in dropped {
            let len = wire::offload_drop_len(d.key.len());
            if d.key.len() <= wire::MAX_KEY_LEN
                && fit.len() < wire::MAX_OFFLOAD_DROPS
                && bytes + len <= wire::MAX_OFFLOAD_DROP_BYTES
            {
                bytes += len;
                fit.push(d);
            } else {
                rest.push(d);
            }
        }
        report_later(rest);
        let listed: Vec<wire::DroppedObject> = fit
            .iter()
            .map(|d| wire::DroppedObject {
                generation: d.generation,
                key: d.key.clone(),
            })
            .collect();
        let body = wire::encode_offload_answer(&failed, &listed);
        if let Err(e) = self.reply_body(stored, &body) {
            report_later(fit);
            return Err(e.into());
        }
        Ok(())
    }

    pub(super) fn load(&mut self, req: &Request) -> Result<(), End> {
        let shared = self.shared;
        if req.len == 0 || req.len > self.size.max(1 << 30) {
            self.reply(Status::BadRequest, 0, "bad load length")?;
            return Ok(());
        }
        if !self.allowed(req, RIGHT_READ)? {
            return Ok(());
        }
        // DRAM first: an offload in flight drops the DRAM entry only after the disk
        // copy is indexed, so checking DRAM then disk never misses the object.
        if let Some((pin, off)) = shared.table.pin_gen(req.generation, req.len) {
            let r = match shared.mem.check(off, req.len) {
                Some((o, l)) => {
                    // SAFETY: bounds-checked and pinned, as for READ.
                    let body = unsafe { std::slice::from_raw_parts(shared.mem.ptr_at(o), l) };
                    self.reply_body(0, body)
                }
                None => self.reply(Status::Stale, 0, ""),
            };
            shared.table.unpin(pin);
            r?;
            return Ok(());
        }
        let Some(cold) = shared.cold.get() else {
            self.reply(Status::Stale, 0, "")?;
            return Ok(());
        };
        if cold.size_of(req.generation) != Some(req.len) {
            self.reply(Status::Stale, 0, "")?;
            return Ok(());
        }
        // Only a real object of this length gets here; the budget bounds how many
        // such buffers all connections hold at once.
        let taken = shared.load_budget.take(req.len);
        self.load_buf.resize(req.len as usize, 0);
        let r = match cold.load(req.generation, &mut self.load_buf) {
            Ok(true) => {
                shared.counters.reads.fetch_add(1, Ordering::Relaxed);
                shared
                    .counters
                    .bytes_read
                    .fetch_add(req.len, Ordering::Relaxed);
                {
                    let buf = std::mem::take(&mut self.load_buf);
                    let r = self.reply_body(0, &buf);
                    self.load_buf = buf;
                    r
                }
            }
            Ok(false) => self.reply(Status::Stale, 0, ""),
            Err(msg) => {
                tracing::warn!(generation = req.generation, error = %msg, "disk load failed");
                self.reply(Status::Stale, 0, "")
            }
        };
        // Keep the buffer for the next load only while small: idle connections must
        // not sit on big buffers outside the budget.
        if self.load_buf.capacity() > LOAD_BUF_KEEP {
            self.load_buf = Vec::new();
        }
        shared.load_budget.give(taken);
        r?;
        Ok(())
    }

    pub(super) fn promote(&mut self, req: &Request) -> Result<(), End> {
        let shared = self.shared;
        self.read_key(req)?;
        let key = std::mem::take(&mut self.key_buf);
        let ok = self.owner_allowed(req, &key)?;
        self.key_buf = key;
        if !ok {
            return Ok(());
        }
        if self.unix {
            self.reply(
                Status::BadRequest,
                0,
                "PROMOTE is only valid on the tcp listener",
            )?;
            return Ok(());
        }
        if req.len == 0 {
            self.reply(Status::BadRequest, 0, "zero-length object")?;
            return Ok(());
        }
        let Ok(key) = std::str::from_utf8(&self.key_buf) else {
            self.reply(Status::BadRequest, 0, "key is not UTF-8")?;
            return Ok(());
        };
        let key = key.to_owned();
        let Some((off, len)) = self.range(req)? else {
            return Ok(());
        };
        let Some(cold) = shared.cold.get() else {
            self.reply(Status::Stale, 0, "")?;
            return Ok(());
        };
        if cold.size_of(req.generation) != Some(req.len) {
            self.reply(Status::Stale, 0, "")?;
            return Ok(());
        }
        // The master reserved this range for the promotion; retire anything stale
        // there and wait for its readers, as WRITE does.
        shared
            .table
            .invalidate_range(req.offset, req.len, OVERWRITE_PIN_WAIT);
        // SAFETY: [off, off+len) was bounds-checked against the mapping, and the
        // entries there were just retired and their readers waited for, so nothing
        // reads this range through a reference while the disk tier fills it. The
        // slice lives only for this load.
        let dst = unsafe { std::slice::from_raw_parts_mut(shared.mem.ptr_at(off), len) };
        match cold.load(req.generation, dst) {
            Ok(true) => {
                let proof = cold.proof_of(req.generation);
                shared
                    .table
                    .commit(req.generation, key, req.offset, req.len, proof);
                self.reply(Status::Ok, 0, "")?;
            }
            Ok(false) => self.reply(Status::Stale, 0, "")?,
            Err(msg) => {
                tracing::warn!(generation = req.generation, error = %msg, "promotion from disk failed");
                self.reply(Status::Stale, 0, "")?
            }
        }
        Ok(())
    }
}

/// Where a FREE/OFFLOAD body is read from (see [`Conn::owner_body`]).
enum Body<'a, R: Read> {
    Stream(&'a mut R),
    Buffered(std::io::Cursor<Vec<u8>>),
}

impl<'a, R: Read> Body<'a, R> {
    pub(super) fn of(rd: &'a mut R, buffered: Option<Vec<u8>>) -> Body<'a, R> {
        match buffered {
            Some(b) => Body::Buffered(std::io::Cursor::new(b)),
            None => Body::Stream(rd),
        }
    }
}

impl<R: Read> Read for Body<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Body::Stream(r) => r.read(buf),
            Body::Buffered(c) => c.read(buf),
        }
    }
}

/// Reads a FREE/OFFLOAD body of `count` pairs [`PAIRS_PER_CHUNK`] at a time into `buf`, and
/// hands each chunk to `f` as it arrives.
fn for_each_chunk<R: Read>(
    rd: &mut R,
    buf: &mut Vec<u8>,
    count: usize,
    mut f: impl FnMut(&[(u64, u64)]),
) -> io::Result<()> {
    let mut left = count;
    while left > 0 {
        let n = left.min(PAIRS_PER_CHUNK);
        buf.resize(n * 16, 0);
        rd.read_exact(buf)?;
        f(&parse_pairs(buf));
        left -= n;
    }
    Ok(())
}

fn parse_pairs(buf: &[u8]) -> Vec<(u64, u64)> {
    buf.chunks_exact(16)
        .map(|c| {
            let (g, o) = c.split_at(8);
            (
                u64::from_le_bytes(g.try_into().unwrap_or_default()),
                u64::from_le_bytes(o.try_into().unwrap_or_default()),
            )
        })
        .collect()
}

/// Writes the pinned entries to the disk tier. Returns (objects now on disk, generations that
/// could not be stored). Entries the owner no longer has count as stored if the disk tier holds
/// them (a retried OFFLOAD) and as failed otherwise.
/// With `report`, also the objects the tier dropped to make room for these (see
/// [`ColdTier::store_reporting`]); without, the tier reports its drops itself.
pub(super) fn offload(
    shared: &Shared,
    items: &[(u64, u64)],
    report: bool,
) -> (u64, Vec<u64>, Vec<ColdDropped>) {
    let Some(cold) = shared.cold.get() else {
        return (0, items.iter().map(|(g, _)| *g).collect(), Vec::new());
    };
    let mut pinned = Vec::with_capacity(items.len());
    let mut failed = Vec::new();
    let mut stored = 0u64;
    for &(generation, offset) in items {
        match shared.table.pin_at(generation, offset) {
            Some(p) => pinned.push(p),
            None if cold.size_of(generation).is_some() => stored += 1,
            None => failed.push(generation),
        }
    }
    let batch = cold_items(shared, &pinned, |g| failed.push(g));
    let mut dropped = Vec::new();
    let r = if report {
        cold.store_reporting(&batch).map(|s| {
            dropped = s.dropped;
            s.stored
        })
    } else {
        cold.store(&batch)
    };
    match r {
        Ok(done) => {
            // A shutdown drain keeps these disk copies: they are the master's replicas now.
            shared.table.note_offloaded(&done);
            stored += done.len() as u64;
            let done: std::collections::HashSet<u64> = done.into_iter().collect();
            failed.extend(
                batch
                    .iter()
                    .map(|b| b.generation)
                    .filter(|g| !done.contains(g)),
            );
        }
        Err(msg) => {
            tracing::error!(objects = batch.len(), error = %msg, "offload to disk failed; the objects are dropped from DRAM as a plain eviction");
            failed.extend(batch.iter().map(|b| b.generation));
        }
    }
    drop(batch);
    for p in pinned {
        shared.table.unpin(p.pin);
    }
    (stored, failed, dropped)
}

/// The disk tier's items for pinned entries: their bytes in the mapping, with key and proof.
/// An entry whose range is outside the mapping (cannot happen for a committed one) goes to
/// `outside`.
pub(crate) fn cold_items<'a>(
    shared: &'a Shared,
    pinned: &'a [Pinned],
    mut outside: impl FnMut(u64),
) -> Vec<ColdItem<'a>> {
    let mut batch = Vec::with_capacity(pinned.len());
    for p in pinned {
        let Some((o, l)) = shared.mem.check(p.offset, p.len) else {
            outside(p.generation);
            continue;
        };
        // SAFETY: bounds-checked and pinned: no WRITE or FREE reuses the range until the
        // caller unpins, after the disk tier is done with the slice.
        let bytes = unsafe { std::slice::from_raw_parts(shared.mem.ptr_at(o), l) };
        batch.push(ColdItem {
            key: &p.key,
            generation: p.generation,
            bytes,
            proof: p.proof,
        });
    }
    batch
}
