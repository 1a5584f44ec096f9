//! Layer-wise sessions, upstream's `batch_put_session_*` / `batch_get_session_*`: an engine
//! saves (or loads) an object one layer at a time, in several range calls between a start and
//! an end.
//!
//! lunakv's data plane moves whole objects: an owner's write grant and its pin cover exactly one
//! object's `(generation, offset, len)`, and a generation is committed once, when its bytes
//! land. A range written straight into the owner would therefore be refused (the capability
//! names the whole object) or commit a partial object. So the session stages in this process:
//! - put: the start reserves the object at the master (BatchPutStart, as a put), each range call
//!   copies the caller's bytes into the session's buffer, and the end writes the object in one
//!   transfer and publishes it (BatchPutEnd). A revoke is BatchPutRevoke.
//! - get: the start reads each object once, whole, into the session's buffer (one master lookup,
//!   one transfer batch); range calls copy out of it, so every range of one session comes from
//!   the same generation, and the end drops the buffer.
//!
//! The staged bytes are bounded ([`crate::ClientOptions::session_max_keys`],
//! `session_max_bytes`), and a session left idle for `session_idle_timeout` is dropped when the
//! next one starts: an engine that never ends its sessions does not grow this process. The
//! master discards the reservation of an unended put on its own (put_start_discard_timeout).
//!
//! Staging buffers of closed sessions are kept for the next ones ([`Pool`], at most
//! [`POOL_MAX_BYTES`]): a fresh buffer's pages fault in on first write (about 7 us per 4 KiB
//! page in a VM), which costs more than copying the bytes. So a put session's ranges never
//! written hold whatever the buffer held before, as upstream's hold whatever the segment did.

use std::collections::{HashMap, HashSet};
use std::time::Instant;

use super::*;

/// One key's ranges for [`StoreClient::batch_put_ranges`]: `(offset in the object, bytes)`.
pub type PutRanges<'a> = (&'a str, Vec<(u64, &'a [u8])>);
/// One key's ranges for [`StoreClient::batch_get_ranges`]: `(offset in the object, destination)`.
pub type GetRanges<'a> = (&'a str, Vec<(u64, &'a mut [u8])>);

/// A put session taken out of its slot by an end or a revoke.
struct Taken {
    /// The key's index in the call.
    index: usize,
    slot: Arc<Mutex<PutState>>,
    loc: Location,
    data: Vec<u8>,
}

/// The most bytes of closed sessions' buffers kept for reuse (vLLM's batch of 32 objects of
/// 32 layers x 16 KiB is 16 MiB).
const POOL_MAX_BYTES: u64 = 256 << 20;

/// Staging buffers of closed sessions, for the next sessions of the same size.
#[derive(Default)]
struct Pool {
    bufs: Vec<Vec<u8>>,
    bytes: u64,
}

impl Pool {
    /// A buffer of exactly `size` bytes: a kept one (its old bytes still in it), else a zeroed
    /// one whose pages the allocator has not touched yet.
    fn take(&mut self, size: usize) -> Vec<u8> {
        match self.bufs.iter().rposition(|b| b.len() == size) {
            Some(i) => {
                self.bytes -= size as u64;
                self.bufs.swap_remove(i)
            }
            None => vec![0u8; size],
        }
    }

    /// Keeps `buf` unless the pool is full; the oldest buffers go first when sizes change.
    fn give(&mut self, buf: Vec<u8>) {
        let n = buf.len() as u64;
        if n == 0 || n > POOL_MAX_BYTES {
            return;
        }
        while self.bytes + n > POOL_MAX_BYTES && !self.bufs.is_empty() {
            let old = self.bufs.remove(0);
            self.bytes -= old.len() as u64;
        }
        self.bytes += n;
        self.bufs.push(buf);
    }
}

/// What a session of each kind is called in errors.
const PUT: &str = "put";
const GET: &str = "get";

/// Where a put session stands.
enum PutState {
    /// BatchPutStart is in flight; the slot only holds the key's place under the bounds.
    Reserving,
    /// Reserved and writable by range calls.
    Open { loc: Location, data: Vec<u8> },
    /// An end or a revoke is working on it (its bytes are out of the slot).
    Busy,
    /// Its end failed: only another end or a revoke may follow (upstream keeps the session
    /// for that retry).
    Sealed { loc: Location, data: Vec<u8> },
}

/// Where a get session stands.
#[derive(Clone)]
enum GetState {
    /// The object is being read.
    Loading,
    Ready(Arc<Vec<u8>>),
}

struct Slot<T> {
    state: Arc<Mutex<T>>,
    /// The bytes this slot counts against `session_max_bytes`.
    size: u64,
    touched: Instant,
}

impl<T> Slot<T> {
    fn new(state: T, size: u64) -> Slot<T> {
        Slot {
            state: Arc::new(Mutex::new(state)),
            size,
            touched: Instant::now(),
        }
    }
}

#[derive(Default)]
struct Table {
    puts: HashMap<String, Slot<PutState>>,
    gets: HashMap<String, Slot<GetState>>,
    bytes: u64,
}

impl Table {
    fn keys(&self) -> usize {
        self.puts.len() + self.gets.len()
    }

    /// Drops the sessions idle for longer than `idle`.
    fn sweep(&mut self, idle: Duration) {
        let now = Instant::now();
        let fresh = |touched: Instant| now.duration_since(touched) < idle;
        let before = (self.puts.len(), self.gets.len());
        let mut freed = 0;
        self.puts.retain(|_, s| {
            let keep = fresh(s.touched);
            if !keep {
                freed += s.size;
            }
            keep
        });
        self.gets.retain(|_, s| {
            let keep = fresh(s.touched);
            if !keep {
                freed += s.size;
            }
            keep
        });
        self.bytes -= freed;
        let dropped = (before.0 - self.puts.len(), before.1 - self.gets.len());
        if dropped != (0, 0) {
            tracing::warn!(
                put_sessions = dropped.0,
                get_sessions = dropped.1,
                bytes = freed,
                "dropped sessions idle for more than {} s (never ended); the master discards their unended puts",
                idle.as_secs()
            );
        }
    }

    fn remove_put(&mut self, key: &str) {
        if let Some(s) = self.puts.remove(key) {
            self.bytes -= s.size;
        }
    }

    fn remove_get(&mut self, key: &str) -> Option<Slot<GetState>> {
        let s = self.gets.remove(key)?;
        self.bytes -= s.size;
        Some(s)
    }
}

/// The open sessions of one client.
pub(crate) struct Sessions {
    table: Mutex<Table>,
    pool: Mutex<Pool>,
    max_keys: usize,
    max_bytes: u64,
    idle: Duration,
}

impl Sessions {
    pub(crate) fn new(opts: &ClientOptions) -> Sessions {
        Sessions {
            table: Mutex::new(Table::default()),
            pool: Mutex::new(Pool::default()),
            max_keys: opts.session_max_keys,
            max_bytes: opts.session_max_bytes,
            idle: opts.session_idle_timeout,
        }
    }

    /// Whether one more session of `size` bytes fits, `replacing` a slot of that many bytes
    /// that it takes the place of (a get session started again).
    fn admit(&self, t: &Table, key: &str, size: u64, replacing: Option<u64>) -> Result<()> {
        let keys = t.keys() + usize::from(replacing.is_none());
        if keys > self.max_keys {
            return Err(ClientError::SessionLimit {
                key: key.to_owned(),
                limit: format!(
                    "{} sessions are open, at most {} (session_max_keys, LUNAKV_SESSION_MAX_KEYS)",
                    t.keys(),
                    self.max_keys
                ),
            });
        }
        let bytes = t.bytes - replacing.unwrap_or(0) + size;
        if bytes > self.max_bytes {
            return Err(ClientError::SessionLimit {
                key: key.to_owned(),
                limit: format!(
                    "{} bytes are staged in open sessions and this one needs {size}, at most {} \
                     (session_max_bytes, LUNAKV_SESSION_MAX_BYTES)",
                    t.bytes, self.max_bytes
                ),
            });
        }
        Ok(())
    }

    /// Drops every session (the client closes).
    pub(crate) fn clear(&self) {
        *self.table.lock() = Table::default();
        *self.pool.lock() = Pool::default();
    }

    /// A staging buffer of `size` bytes ([`Pool::take`]).
    fn buffer(&self, size: u64) -> Vec<u8> {
        self.pool.lock().take(size as usize)
    }

    /// Keeps the buffers of closed put sessions for reuse.
    fn recycle(&self, bufs: impl IntoIterator<Item = Vec<u8>>) {
        let mut p = self.pool.lock();
        for b in bufs {
            p.give(b);
        }
    }

    /// Keeps the buffers of closed get sessions for reuse, those no range call still reads.
    fn recycle_gets(&self, slots: Vec<Slot<GetState>>) {
        let bufs = slots.into_iter().filter_map(|s| {
            let state = Arc::try_unwrap(s.state).ok()?.into_inner();
            match state {
                GetState::Ready(d) => Arc::try_unwrap(d).ok(),
                GetState::Loading => None,
            }
        });
        self.recycle(bufs);
    }

    /// The put session of `key`, marked used.
    fn put_slot(&self, key: &str) -> Result<Arc<Mutex<PutState>>> {
        let mut t = self.table.lock();
        let s = t.puts.get_mut(key).ok_or_else(|| no_session(PUT, key))?;
        s.touched = Instant::now();
        Ok(s.state.clone())
    }

    /// The object of `key`'s get session, marked used.
    fn get_data(&self, key: &str) -> Result<Arc<Vec<u8>>> {
        let state = {
            let mut t = self.table.lock();
            let s = t.gets.get_mut(key).ok_or_else(|| no_session(GET, key))?;
            s.touched = Instant::now();
            s.state.clone()
        };
        let st = state.lock().clone();
        match st {
            GetState::Ready(d) => Ok(d),
            GetState::Loading => Err(no_session(GET, key)),
        }
    }
}

impl Taken {
    /// Closes the session when its end or revoke succeeded (its buffer is returned, for the
    /// pool); otherwise puts its bytes back, sealed, for another end or a revoke.
    fn settle(self, t: &mut Table, key: &str, done: bool) -> Option<Vec<u8>> {
        if done {
            t.remove_put(key);
            Some(self.data)
        } else {
            *self.slot.lock() = PutState::Sealed {
                loc: self.loc,
                data: self.data,
            };
            None
        }
    }
}

fn no_session(kind: &'static str, key: &str) -> ClientError {
    ClientError::NoSession {
        kind,
        key: key.to_owned(),
    }
}

/// Checks every `(offset, len)` against an object of `size` bytes.
fn check_ranges(key: &str, size: u64, ranges: impl Iterator<Item = (u64, u64)>) -> Result<u64> {
    let mut total = 0u64;
    for (offset, len) in ranges {
        if len > size || offset > size - len {
            return Err(ClientError::RangeOutOfBounds {
                key: key.to_owned(),
                offset,
                len,
                size,
            });
        }
        total += len;
    }
    Ok(total)
}

/// Session ranges are copied by the CPU; device pieces would be dereferenced, so they are
/// refused up front.
fn host_only(key: &str, device: bool) -> Result<()> {
    if device {
        return Err(ClientError::InvalidParams(format!(
            "session ranges of '{key}' name device memory: layer-wise sessions take host \
             buffers only (use batch_put_from_multi_buffers / batch_get_into_multi_buffers \
             for device memory)"
        )));
    }
    Ok(())
}

impl StoreClient {
    // === put sessions ===

    /// Reserves each object (one BatchPutStart, as a put) without moving bytes; the ranges
    /// follow with [`StoreClient::batch_put_ranges`]. A key that already has a put session is
    /// refused ([`ClientError::SessionExists`]), as is one past the session bounds.
    pub fn batch_put_session_start(
        &self,
        items: &[(&str, u64)],
        cfg: &ReplicateConfig,
    ) -> Vec<Result<()>> {
        let _span = op_span("put_session_start", items.len()).entered();
        if self.check_open().is_err() {
            return items.iter().map(|_| Err(ClientError::Closed)).collect();
        }
        if let Some(why) = cfg.group_ids_mismatch(items.len()) {
            return items
                .iter()
                .map(|_| Err(ClientError::InvalidParams(why.clone())))
                .collect();
        }
        let mut results: Vec<Option<Result<()>>> = (0..items.len()).map(|_| None).collect();
        let mut started = Vec::new();
        {
            let mut t = self.sessions.table.lock();
            t.sweep(self.sessions.idle);
            for (i, &(key, size)) in items.iter().enumerate() {
                let admitted = validate_key(key).map_err(ClientError::from).and_then(|()| {
                    if size == 0 {
                        return Err(ClientError::InvalidParams(format!(
                            "object '{key}' has size 0: store at least one byte"
                        )));
                    }
                    if t.puts.contains_key(key) {
                        return Err(ClientError::SessionExists(key.to_owned()));
                    }
                    self.sessions.admit(&t, key, size, None)
                });
                match admitted {
                    Ok(()) => {
                        t.puts
                            .insert(key.to_owned(), Slot::new(PutState::Reserving, size));
                        t.bytes += size;
                        started.push(i);
                    }
                    Err(e) => results[i] = Some(Err(e)),
                }
            }
        }
        if started.is_empty() {
            return finish(results);
        }
        let pb_items = started
            .iter()
            .map(|&i| pb::PutStartItem {
                key: self.scoped(items[i].0).into_owned(),
                size: items[i].1,
                group_id: cfg.group_of(i),
            })
            .collect();
        let placements = self.put_start(pb_items, cfg);
        // Parsed, and buffers found, before the table is locked again.
        let opened: Vec<Result<PutState>> = started
            .iter()
            .enumerate()
            .map(|(j, &i)| {
                let (key, size) = items[i];
                let p = match &placements {
                    Err(e) => {
                        return Err(ClientError::Rpc {
                            addr: self.opts.master_server_address.clone(),
                            message: e.to_string(),
                        });
                    }
                    Ok(p) => p
                        .results
                        .get(j)
                        .ok_or_else(|| self.short_answer(SHORT_ANSWER_ITEMS))?,
                };
                let segments = placements.as_ref().map_or(&[][..], |p| &p.segments);
                if p.code != 0 {
                    return Err(ClientError::from_item(key, size, p.code, &p.message));
                }
                let loc =
                    Location::try_from((p, size, segments)).map_err(|m| ClientError::Rpc {
                        addr: self.opts.master_server_address.clone(),
                        message: format!("bad placement for '{key}': {m}"),
                    })?;
                Ok(PutState::Open {
                    loc,
                    data: self.sessions.buffer(size),
                })
            })
            .collect();
        let mut t = self.sessions.table.lock();
        for (&i, open) in started.iter().zip(opened) {
            let key = items[i].0;
            results[i] = Some(match open {
                Ok(open) => match t.puts.get(key) {
                    Some(s) => {
                        *s.state.lock() = open;
                        Ok(())
                    }
                    // Swept while the master answered (an idle timeout shorter than the call);
                    // the master discards the reservation.
                    None => Err(no_session(PUT, key)),
                },
                Err(e) => {
                    t.remove_put(key);
                    Err(e)
                }
            });
        }
        drop(t);
        finish(results)
    }

    /// Writes ranges into objects with an open put session: for each key, `(dst_offset,
    /// bytes)` pieces. Returns the bytes written per key. A key whose ranges do not all fit in
    /// its object is refused whole ([`ClientError::RangeOutOfBounds`]): nothing of it is
    /// written.
    pub fn batch_put_ranges(&self, items: &[PutRanges<'_>]) -> Vec<Result<u64>> {
        if self.check_open().is_err() {
            return items.iter().map(|_| Err(ClientError::Closed)).collect();
        }
        items
            .iter()
            .map(|(key, ranges)| {
                let pieces: Vec<&[u8]> = ranges.iter().map(|(_, p)| *p).collect();
                host_only(key, lunakv_transfer::device::any_device(&pieces))?;
                let slot = self.sessions.put_slot(key)?;
                // Held while copying: an end or revoke of this key waits for the copy.
                let mut st = slot.lock();
                let data = match &mut *st {
                    PutState::Open { data, .. } => data,
                    PutState::Reserving => return Err(no_session(PUT, key)),
                    PutState::Busy | PutState::Sealed { .. } => {
                        return Err(ClientError::SessionSealed((*key).to_owned()));
                    }
                };
                let total = check_ranges(
                    key,
                    data.len() as u64,
                    ranges.iter().map(|(o, p)| (*o, p.len() as u64)),
                )?;
                for (offset, piece) in ranges {
                    let at = *offset as usize;
                    lunakv_transfer::copy_slice(&mut data[at..at + piece.len()], piece);
                }
                Ok(total)
            })
            .collect()
    }

    /// Writes each session's object to its replicas and publishes it (one transfer batch, one
    /// BatchPutEnd); the session closes. A key whose end fails keeps its session, sealed: end
    /// it again or revoke it.
    pub fn batch_put_session_end(&self, keys: &[&str]) -> Vec<Result<()>> {
        let _span = op_span("put_session_end", keys.len()).entered();
        if self.check_open().is_err() {
            return keys.iter().map(|_| Err(ClientError::Closed)).collect();
        }
        let (mut results, taken) = self.take_puts(keys);
        if taken.is_empty() {
            return finish(results);
        }
        // What the master and the owners know the keys as (this client's tenant's).
        let scoped: Vec<Cow<'_, str>> = taken.iter().map(|t| self.scoped(keys[t.index])).collect();
        let end_keys: Vec<&str> = scoped.iter().map(|k| k.as_ref()).collect();
        let pieces: Vec<[&[u8]; 1]> = taken.iter().map(|t| [t.data.as_slice()]).collect();
        let parts: Vec<&[&[u8]]> = pieces.iter().map(|p| p.as_slice()).collect();
        let mut locs: Vec<Option<Location>> = taken.iter().map(|t| Some(t.loc.clone())).collect();
        let ended = self.write_and_publish(&end_keys, &parts, &mut locs);
        drop(parts);
        drop(pieces);
        let mut t = self.sessions.table.lock();
        let mut freed = Vec::new();
        for (tk, r) in taken.into_iter().zip(ended) {
            let r = r.unwrap_or(Err(ClientError::Closed));
            let index = tk.index;
            freed.extend(tk.settle(&mut t, keys[index], r.is_ok()));
            results[index] = Some(r);
        }
        drop(t);
        self.sessions.recycle(freed);
        finish(results)
    }

    /// Abandons each open put session (BatchPutRevoke): the reservation is freed and the key
    /// can be put again. A key the master no longer knows is revoked already (0); any other
    /// failure keeps the session for another revoke.
    pub fn batch_put_session_revoke(&self, keys: &[&str]) -> Vec<Result<()>> {
        if self.check_open().is_err() {
            return keys.iter().map(|_| Err(ClientError::Closed)).collect();
        }
        let (mut results, taken) = self.take_puts(keys);
        if taken.is_empty() {
            return finish(results);
        }
        let req = pb::BatchKeysRequest {
            client_id: self.client_id.clone(),
            keys: taken
                .iter()
                .map(|t| self.scoped(keys[t.index]).into_owned())
                .collect(),
        };
        let answer = self.rpc(|mut m| {
            let req = req.clone();
            async move { m.batch_put_revoke(req).await }
        });
        let mut t = self.sessions.table.lock();
        let mut freed = Vec::new();
        for (n, tk) in taken.into_iter().enumerate() {
            let key = keys[tk.index];
            let r = match &answer {
                Err(e) => Err(ClientError::Rpc {
                    addr: self.opts.master_server_address.clone(),
                    message: e.to_string(),
                }),
                Ok(a) => match a.results.get(n) {
                    None => Err(self.short_answer(SHORT_ANSWER_KEYS)),
                    Some(r) => match ErrorCode::from_i32(r.code) {
                        ErrorCode::Ok | ErrorCode::ObjectNotFound => Ok(()),
                        _ => Err(ClientError::from_item(key, tk.loc.size, r.code, &r.message)),
                    },
                },
            };
            let index = tk.index;
            freed.extend(tk.settle(&mut t, key, r.is_ok()));
            results[index] = Some(r);
        }
        drop(t);
        self.sessions.recycle(freed);
        finish(results)
    }

    /// Marks the put sessions of `keys` busy and takes their bytes out (waiting for range
    /// copies in progress). Keys without a session, busy ones and repeats fail in `results`.
    fn take_puts(&self, keys: &[&str]) -> (Vec<Option<Result<()>>>, Vec<Taken>) {
        let mut results: Vec<Option<Result<()>>> = (0..keys.len()).map(|_| None).collect();
        let mut taken = Vec::new();
        let mut seen = HashSet::new();
        for (i, key) in keys.iter().enumerate() {
            if !seen.insert(*key) {
                results[i] = Some(Err(ClientError::InvalidParams(format!(
                    "'{key}' is listed twice"
                ))));
                continue;
            }
            let slot = match self.sessions.put_slot(key) {
                Ok(s) => s,
                Err(e) => {
                    results[i] = Some(Err(e));
                    continue;
                }
            };
            let mut st = slot.lock();
            match std::mem::replace(&mut *st, PutState::Busy) {
                PutState::Open { loc, data } | PutState::Sealed { loc, data } => {
                    drop(st);
                    taken.push(Taken {
                        index: i,
                        slot,
                        loc,
                        data,
                    });
                }
                other => {
                    *st = other;
                    results[i] = Some(Err(ClientError::SessionSealed((*key).to_owned())));
                }
            }
        }
        (results, taken)
    }

    // === get sessions ===

    /// Reads each object once into this client (one master lookup for the keys not cached,
    /// one transfer batch); ranges are then served by [`StoreClient::batch_get_ranges`]
    /// without the master or the owner. Starting a key's session again replaces it.
    pub fn batch_get_session_start(&self, keys: &[&str]) -> Vec<Result<()>> {
        let _span = op_span("get_session_start", keys.len()).entered();
        if self.check_open().is_err() {
            return keys.iter().map(|_| Err(ClientError::Closed)).collect();
        }
        let mut results: Vec<Option<Result<u64>>> = (0..keys.len()).map(|_| None).collect();
        let mut locs: Vec<Option<Arc<Location>>> = vec![None; keys.len()];
        let mut misses = Vec::new();
        let mut seen = HashSet::new();
        // Locations are known by the keys as the master holds them (this client's tenant's);
        // the session table and the read below take the caller's keys.
        let scoped: Vec<Cow<'_, str>> = keys.iter().map(|k| self.scoped(k)).collect();
        let scoped: Vec<&str> = scoped.iter().map(|k| k.as_ref()).collect();
        for (i, key) in keys.iter().enumerate() {
            if let Err(e) = validate_key(key) {
                results[i] = Some(Err(e.into()));
            } else if !seen.insert(*key) {
                results[i] = Some(Err(ClientError::InvalidParams(format!(
                    "'{key}' is listed twice"
                ))));
            } else {
                match self.cache.get(scoped[i]) {
                    Some(l) => locs[i] = Some(l),
                    None => misses.push(i),
                }
            }
        }
        self.lookup_many(&scoped, &misses, &mut locs, &mut results);

        let mut admitted = Vec::new();
        let mut replaced = Vec::new();
        {
            let mut t = self.sessions.table.lock();
            t.sweep(self.sessions.idle);
            for (i, key) in keys.iter().enumerate() {
                let Some(loc) = &locs[i] else { continue };
                if results[i].is_some() {
                    continue;
                }
                let replacing = t.gets.get(*key).map(|s| s.size);
                if let Err(e) = self.sessions.admit(&t, key, loc.size, replacing) {
                    results[i] = Some(Err(e));
                    continue;
                }
                replaced.extend(t.remove_get(key));
                t.gets
                    .insert((*key).to_owned(), Slot::new(GetState::Loading, loc.size));
                t.bytes += loc.size;
                admitted.push(i);
            }
        }
        self.sessions.recycle_gets(replaced);
        if admitted.is_empty() {
            return finish_unit(results);
        }
        let mut bufs: Vec<Vec<u8>> = admitted
            .iter()
            .map(|&i| self.sessions.buffer(locs[i].as_ref().map_or(0, |l| l.size)))
            .collect();
        let read_keys: Vec<&str> = admitted.iter().map(|&i| keys[i]).collect();
        let got = {
            let mut dsts: Vec<Vec<&mut [u8]>> =
                bufs.iter_mut().map(|b| vec![b.as_mut_slice()]).collect();
            self.batch_get_into(&read_keys, &mut dsts)
        };
        let mut t = self.sessions.table.lock();
        let mut failed = Vec::new();
        for ((&i, mut buf), r) in admitted.iter().zip(bufs).zip(got) {
            let key = keys[i];
            match r {
                Ok(n) => {
                    // The object was replaced by a smaller one between lookup and read.
                    buf.truncate(n as usize);
                    match t.gets.get_mut(key) {
                        Some(s) => {
                            let old = std::mem::replace(&mut s.size, n);
                            *s.state.lock() = GetState::Ready(Arc::new(buf));
                            t.bytes = t.bytes - old + n;
                            results[i] = Some(Ok(n));
                        }
                        None => results[i] = Some(Err(no_session(GET, key))),
                    }
                }
                Err(e) => {
                    t.remove_get(key);
                    failed.push(buf);
                    results[i] = Some(Err(e));
                }
            }
        }
        drop(t);
        self.sessions.recycle(failed);
        finish_unit(results)
    }

    /// Reads ranges of objects with an open get session: for each key, `(src_offset, dst)`
    /// pieces. Returns the bytes read per key; a key with a range outside its object is refused
    /// whole ([`ClientError::RangeOutOfBounds`]) before anything is copied.
    pub fn batch_get_ranges(&self, items: &mut [GetRanges<'_>]) -> Vec<Result<u64>> {
        if self.check_open().is_err() {
            return items.iter().map(|_| Err(ClientError::Closed)).collect();
        }
        items
            .iter_mut()
            .map(|(key, ranges)| {
                let pieces: Vec<&[u8]> = ranges.iter().map(|(_, p)| &**p).collect();
                host_only(key, lunakv_transfer::device::any_device(&pieces))?;
                let data = self.sessions.get_data(key)?;
                let total = check_ranges(
                    key,
                    data.len() as u64,
                    ranges.iter().map(|(o, p)| (*o, p.len() as u64)),
                )?;
                for (offset, dst) in ranges.iter_mut() {
                    let at = *offset as usize;
                    let n = dst.len();
                    lunakv_transfer::copy_slice(dst, &data[at..at + n]);
                }
                Ok(total)
            })
            .collect()
    }

    /// Drops the get sessions of `keys` (keys without one are ignored, as upstream).
    pub fn batch_get_session_end(&self, keys: &[&str]) {
        let mut t = self.sessions.table.lock();
        let ended: Vec<_> = keys.iter().filter_map(|k| t.remove_get(k)).collect();
        drop(t);
        self.sessions.recycle_gets(ended);
    }

    /// How many sessions are open and the bytes they hold (put, get, bytes).
    pub fn session_counts(&self) -> (usize, usize, u64) {
        let t = self.sessions.table.lock();
        (t.puts.len(), t.gets.len(), t.bytes)
    }
}

fn finish(results: Vec<Option<Result<()>>>) -> Vec<Result<()>> {
    results
        .into_iter()
        .map(|r| r.unwrap_or(Err(ClientError::Closed)))
        .collect()
}

fn finish_unit(results: Vec<Option<Result<u64>>>) -> Vec<Result<()>> {
    results
        .into_iter()
        .map(|r| r.unwrap_or(Err(ClientError::Closed)).map(|_| ()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sessions(max_keys: usize, max_bytes: u64) -> Sessions {
        Sessions::new(&ClientOptions {
            session_max_keys: max_keys,
            session_max_bytes: max_bytes,
            session_idle_timeout: Duration::from_millis(50),
            ..ClientOptions::default()
        })
    }

    #[test]
    fn ranges_past_the_object_are_refused() {
        assert_eq!(
            check_ranges("k", 8, [(0, 4), (4, 4)].into_iter()).ok(),
            Some(8)
        );
        for bad in [(5, 4), (0, 9), (u64::MAX, 1), (8, 1)] {
            assert!(matches!(
                check_ranges("k", 8, [(0, 1), bad].into_iter()),
                Err(ClientError::RangeOutOfBounds { .. })
            ));
        }
        assert_eq!(check_ranges("k", 8, [(8, 0)].into_iter()).ok(), Some(0));
    }

    #[test]
    fn admission_names_the_bound_it_hit() {
        let s = sessions(1, 100);
        let mut t = Table::default();
        assert!(s.admit(&t, "a", 100, None).is_ok());
        let e = s.admit(&t, "a", 101, None).unwrap_err();
        assert!(e.to_string().contains("session_max_bytes"), "{e}");
        assert_eq!(e.code(), ErrorCode::NoAvailableHandle);
        t.gets.insert("a".into(), Slot::new(GetState::Loading, 60));
        t.bytes = 60;
        let e = s.admit(&t, "b", 1, None).unwrap_err();
        assert!(e.to_string().contains("session_max_keys"), "{e}");
        // Starting "a" again takes its own place, and its own bytes.
        assert!(s.admit(&t, "a", 100, Some(60)).is_ok());
    }

    #[test]
    fn the_pool_reuses_buffers_of_the_same_size_within_its_cap() {
        let mut p = Pool::default();
        let mut b = p.take(4096);
        assert_eq!(b.len(), 4096);
        b[0] = 7;
        p.give(b);
        assert_eq!(p.bytes, 4096);
        // Same size: the kept buffer, old bytes included; another size: a fresh one.
        assert_eq!(p.take(4096)[0], 7);
        assert_eq!(p.bytes, 0);
        assert_eq!(p.take(100), vec![0u8; 100]);
        let half = (POOL_MAX_BYTES / 2) as usize;
        for _ in 0..3 {
            p.give(vec![1u8; half]);
        }
        assert_eq!((p.bufs.len(), p.bytes), (2, POOL_MAX_BYTES));
        p.give(vec![1u8; 16]);
        assert_eq!((p.bufs.len(), p.bytes), (2, POOL_MAX_BYTES / 2 + 16));
        p.give(Vec::new());
        assert_eq!(p.bufs.len(), 2);
    }

    #[test]
    fn idle_sessions_are_swept_with_their_bytes() {
        let s = sessions(10, 1000);
        let mut t = Table::default();
        t.puts
            .insert("p".into(), Slot::new(PutState::Reserving, 10));
        t.gets.insert("g".into(), Slot::new(GetState::Loading, 20));
        t.bytes = 30;
        t.sweep(s.idle);
        assert_eq!(t.keys(), 2);
        std::thread::sleep(Duration::from_millis(60));
        t.gets.get_mut("g").expect("g").touched = Instant::now();
        t.sweep(s.idle);
        assert_eq!((t.puts.len(), t.gets.len(), t.bytes), (0, 1, 20));
    }
}
