//! Client side of raw registered-memory transfers: [`TransferEngine::write_raw`],
//! [`TransferEngine::read_raw`] and [`TransferEngine::batch_raw`]. They ride the engine's pooled
//! tcp connections (the same pool and framing as segment transfers) and address a peer's
//! [`crate::RegionServer`] by absolute address, as upstream's `transfer_sync_write` does.

use crate::tcp::{
    PIPELINE_DEPTH, TcpConn, breaks_conn, io_err, read_into, recv_status, total_len, write_from,
};
use crate::vio::write_all_gather;
use crate::wire::{Op, Request, TRACE_LEN};
use crate::{TransferEngine, TransferError};

/// One request of [`TransferEngine::batch_raw`].
#[derive(Debug)]
pub enum RawRequest<'a> {
    /// Writes the concatenation of `src` at absolute address `remote_addr` of `endpoint`.
    Write {
        endpoint: &'a str,
        remote_addr: u64,
        src: Vec<&'a [u8]>,
    },
    /// Fills `dst` in order from absolute address `remote_addr` of `endpoint`.
    Read {
        endpoint: &'a str,
        remote_addr: u64,
        dst: Vec<&'a mut [u8]>,
    },
}

impl RawRequest<'_> {
    fn endpoint(&self) -> &str {
        match self {
            RawRequest::Write { endpoint, .. } | RawRequest::Read { endpoint, .. } => endpoint,
        }
    }

    /// Payload bytes of this request.
    pub fn len(&self) -> u64 {
        match self {
            RawRequest::Write { src, .. } => total_len(src.iter().map(|s| s.len())),
            RawRequest::Read { dst, .. } => total_len(dst.iter().map(|s| s.len())),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

fn header(
    op: Op,
    remote_addr: u64,
    len: u64,
    trace: Option<&[u8; TRACE_LEN]>,
) -> ([u8; crate::wire::REQ_LEN], &[u8]) {
    Request {
        op,
        generation: 0,
        offset: remote_addr,
        len,
        key_len: 0,
        aux: 0,
    }
    .encode_with(trace)
}

fn check(remote_addr: u64, len: u64) -> Result<(), TransferError> {
    if len == 0 {
        return Err(TransferError::InvalidArgument(
            "zero-length raw transfer".into(),
        ));
    }
    if remote_addr.checked_add(len).is_none() {
        return Err(TransferError::OutOfBounds {
            offset: remote_addr,
            len,
            size: u64::MAX,
        });
    }
    Ok(())
}

fn send(
    conn: &mut TcpConn,
    ep: &str,
    r: &RawRequest<'_>,
    trace: Option<&[u8; TRACE_LEN]>,
) -> Result<(), TransferError> {
    let len = r.len();
    match r {
        RawRequest::Write {
            remote_addr, src, ..
        } => {
            check(*remote_addr, len)?;
            let (hdr, tc) = header(Op::RawWrite, *remote_addr, len, trace);
            write_from(&mut conn.stream, &[&hdr, tc], src).map_err(|e| io_err(ep, e))
        }
        RawRequest::Read { remote_addr, .. } => {
            check(*remote_addr, len)?;
            let (hdr, tc) = header(Op::RawRead, *remote_addr, len, trace);
            write_all_gather(&mut conn.stream, &[&hdr, tc], &[]).map_err(|e| io_err(ep, e))
        }
    }
}

fn recv(conn: &mut TcpConn, ep: &str, r: &mut RawRequest<'_>) -> Result<(), TransferError> {
    let len = r.len();
    match r {
        RawRequest::Write { remote_addr, .. } => {
            recv_status(&mut conn.stream, ep, 0, *remote_addr, len).map(|_| ())
        }
        RawRequest::Read {
            remote_addr, dst, ..
        } => {
            let got = recv_status(&mut conn.stream, ep, 0, *remote_addr, len)?;
            if got != len {
                return Err(TransferError::Protocol(format!(
                    "{ep} answered {got} bytes for a {len} byte raw read"
                )));
            }
            read_into(&mut conn.stream, dst).map_err(|e| io_err(ep, e))
        }
    }
}

impl TransferEngine {
    /// Writes the concatenation of `src` at absolute address `remote_addr` in memory that the
    /// peer at `endpoint` registered with its [`crate::RegionServer`].
    pub fn write_raw(
        &self,
        endpoint: &str,
        remote_addr: u64,
        src: &[&[u8]],
    ) -> Result<(), TransferError> {
        let mut r = [RawRequest::Write {
            endpoint,
            remote_addr,
            src: src.to_vec(),
        }];
        self.raw_one(&mut r[0])
    }

    /// Reads `dst` (in order) from absolute address `remote_addr` of the peer at `endpoint`.
    pub fn read_raw(
        &self,
        endpoint: &str,
        remote_addr: u64,
        dst: &mut [&mut [u8]],
    ) -> Result<(), TransferError> {
        let mut r = RawRequest::Read {
            endpoint,
            remote_addr,
            dst: dst.iter_mut().map(|d| &mut **d).collect(),
        };
        self.raw_one(&mut r)
    }

    fn raw_one(&self, r: &mut RawRequest<'_>) -> Result<(), TransferError> {
        let ep = r.endpoint().to_string();
        check(0, r.len())?;
        // A reused connection that fails with an I/O error is retried once on a fresh one:
        // a raw write or read of the same bytes is idempotent.
        self.tcp.with_conn(&ep, |c| {
            let trace = c.trace_context(&ep, Op::RawRead)?;
            send(c, &ep, r, trace.as_ref())?;
            recv(c, &ep, r)
        })
    }

    /// Runs many raw requests; results in request order. Requests are grouped per endpoint,
    /// each group split over up to `conns_per_peer` connections and pipelined on each.
    pub fn batch_raw(&self, reqs: &mut [RawRequest<'_>]) -> Vec<Result<(), TransferError>> {
        if reqs.len() == 1 {
            return vec![self.raw_one(&mut reqs[0])];
        }
        let mut groups: Vec<(String, Vec<(usize, &mut RawRequest<'_>)>)> = Vec::new();
        for (i, r) in reqs.iter_mut().enumerate() {
            let ep = r.endpoint().to_string();
            match groups.iter_mut().find(|(g, _)| *g == ep) {
                Some((_, v)) => v.push((i, r)),
                None => groups.push((ep, vec![(i, r)])),
            }
        }
        let mut units: Vec<(String, Vec<(usize, &mut RawRequest<'_>)>)> = Vec::new();
        for (ep, mut v) in groups {
            let bytes: u64 = v.iter().map(|(_, r)| r.len()).sum();
            let n = (self.tcp.conns_per_peer() as u64)
                .min(bytes.div_ceil(crate::engine::MIN_UNIT_BYTES))
                .min(v.len() as u64)
                .max(1) as usize;
            let per = v.len().div_ceil(n);
            while v.len() > per {
                let rest = v.split_off(per);
                units.push((ep.clone(), v));
                v = rest;
            }
            units.push((ep, v));
        }
        let mut out: Vec<Option<Result<(), TransferError>>> =
            (0..reqs_len(&units)).map(|_| None).collect();
        // Each unit's thread sends the caller's trace context.
        let carry = crate::trace::Carry::current();
        let carry = &carry;
        let results: Vec<Vec<(usize, Result<(), TransferError>)>> = std::thread::scope(|s| {
            let handles: Vec<_> = units
                .into_iter()
                .map(|(ep, mut v)| s.spawn(move || carry.run(|| self.raw_pipeline(&ep, &mut v))))
                .collect();
            handles
                .into_iter()
                .map(|h| match h.join() {
                    Ok(r) => r,
                    Err(p) => std::panic::resume_unwind(p),
                })
                .collect()
        });
        for (i, r) in results.into_iter().flatten() {
            out[i] = Some(r);
        }
        out.into_iter()
            .map(|r| {
                r.unwrap_or_else(|| {
                    Err(TransferError::Protocol(
                        "a raw request got no result".into(),
                    ))
                })
            })
            .collect()
    }

    /// Requests to one endpoint pipelined on one pooled connection, `PIPELINE_DEPTH` at a time.
    fn raw_pipeline(
        &self,
        ep: &str,
        v: &mut [(usize, &mut RawRequest<'_>)],
    ) -> Vec<(usize, Result<(), TransferError>)> {
        let mut out = Vec::with_capacity(v.len());
        let pool = self.tcp.pool(ep);
        let mut conn = match self.tcp.checkout(&pool, ep) {
            Ok((c, _)) => c,
            Err(e) => return v.iter().map(|(i, _)| (*i, Err(e.duplicate()))).collect(),
        };
        let trace = match conn.trace_context(ep, Op::RawRead) {
            Ok(t) => t,
            Err(e) => return v.iter().map(|(i, _)| (*i, Err(e.duplicate()))).collect(),
        };
        let mut broken: Option<TransferError> = None;
        for run in v.chunks_mut(PIPELINE_DEPTH) {
            if let Some(e) = &broken {
                out.extend(run.iter().map(|(i, _)| (*i, Err(e.duplicate()))));
                continue;
            }
            // Reads and writes may share a run: each answer is read in order, and a read's bytes
            // follow its own header, so mixing is safe; bounded depth keeps answers in the buffers.
            let mut sent = [false; PIPELINE_DEPTH];
            let mut answered = [false; PIPELINE_DEPTH];
            for (k, (i, r)) in run.iter().enumerate() {
                match send(&mut conn, ep, r, trace.as_ref()) {
                    Ok(()) => sent[k] = true,
                    Err(e) if breaks_conn(&e) => {
                        broken = Some(e);
                        break;
                    }
                    Err(e) => {
                        answered[k] = true;
                        out.push((*i, Err(e)));
                    }
                }
            }
            for (k, (i, r)) in run.iter_mut().enumerate() {
                if answered[k] {
                    continue;
                }
                if let Some(e) = &broken {
                    out.push((*i, Err(e.duplicate())));
                    continue;
                }
                if !sent[k] {
                    continue;
                }
                let r = recv(&mut conn, ep, r);
                if let Err(e) = &r
                    && breaks_conn(e)
                {
                    broken = Some(e.duplicate());
                }
                out.push((*i, r));
            }
        }
        if broken.is_none() {
            self.tcp.checkin(&pool, conn);
        }
        out
    }
}

fn reqs_len(units: &[(String, Vec<(usize, &mut RawRequest<'_>)>)]) -> usize {
    units
        .iter()
        .flat_map(|(_, v)| v.iter().map(|(i, _)| i + 1))
        .max()
        .unwrap_or(0)
}
