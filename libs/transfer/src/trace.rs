//! Trace context on the transfer wire (the [`wire::FLAG_TRACE`] extension): what requesters
//! send, and the span an owner opens for a request that carries one. With traces off
//! (`lunakv_telemetry::enabled()` false) requesters send nothing and owners open nothing; the
//! only cost left is reading the flag byte.

use std::io::{self, Read};

use lunakv_telemetry::propagate::TraceParent;
use tracing::Span;

use crate::wire::{self, Request, TRACE_LEN};

/// The calling thread's span context, encoded for the wire; `None` when traces are off.
pub(crate) fn current() -> Option<[u8; TRACE_LEN]> {
    TraceParent::current().map(|t| wire::encode_trace(&t))
}

/// Reads the trace context that follows a [`wire::FLAG_TRACE`] header (always, to stay in step
/// with the stream); `None` for an unflagged header.
pub(crate) fn read_context<R: Read>(
    hdr: &[u8; wire::REQ_LEN],
    rd: &mut R,
) -> io::Result<Option<[u8; TRACE_LEN]>> {
    if !wire::is_traced(hdr) {
        return Ok(None);
    }
    let mut tc = [0u8; TRACE_LEN];
    rd.read_exact(&mut tc)?;
    Ok(Some(tc))
}

/// The owner's span of one traced request (`transfer WRITE`), child of the requester's span.
/// `None` when this process does not export traces or the context has an unknown version.
pub(crate) fn server_span(req: &Request, tc: &[u8; TRACE_LEN]) -> Option<Span> {
    if !lunakv_telemetry::enabled() {
        return None;
    }
    let parent = wire::decode_trace(tc)?;
    let span = tracing::info_span!(
        "transfer.server",
        otel.name = %format_args!("transfer {}", req.op.name()),
        otel.kind = "server",
        lunakv.generation = req.generation,
        lunakv.offset = req.offset,
        lunakv.len = req.len,
    );
    parent.set_parent_of(&span);
    Some(span)
}

/// The caller's span, carried into the threads a batch fans out to so that their requests
/// carry the caller's context; nothing when traces are off.
pub(crate) struct Carry(Option<Span>);

impl Carry {
    pub(crate) fn current() -> Carry {
        Carry(lunakv_telemetry::enabled().then(Span::current))
    }

    /// Runs `f` inside the carried span.
    pub(crate) fn run<R>(&self, f: impl FnOnce() -> R) -> R {
        match &self.0 {
            Some(s) => s.in_scope(f),
            None => f(),
        }
    }
}
