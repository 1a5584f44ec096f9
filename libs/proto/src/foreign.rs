//! Telling lunakv's gRPC apart from what else a Mooncake deployment may send to the same port:
//! upstream Mooncake's masters and clients speak coro_rpc (yalantinglibs), not HTTP/2, so an
//! upstream client against lunakv-master, or a lunakv client against `mooncake_master`, would
//! otherwise see only "end of file" or a transport error. Both sides use this to say which
//! implementation is on the other end.

/// What every HTTP/2 (so every gRPC) client sends first (RFC 9113, 3.4).
pub const HTTP2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// An empty HTTP/2 SETTINGS frame, which a client sends right after the preface.
pub const HTTP2_EMPTY_SETTINGS: [u8; 9] = [0, 0, 0, 0x4, 0, 0, 0, 0, 0];

/// The first byte of every coro_rpc request header (yalantinglibs' `magic_number`).
pub const CORO_RPC_MAGIC: u8 = 21;

/// What a connecting client's first bytes say it speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientSpeaks {
    /// The HTTP/2 preface, or a prefix of it: gRPC.
    Http2,
    /// An HTTP/1 request line (`GET /metrics ...`): a browser, curl or a Prometheus scrape.
    Http1,
    /// A coro_rpc header: upstream Mooncake's client library.
    CoroRpc,
    /// lunakv's quick calls ([`crate::quick`]).
    Quick,
    Other,
}

/// Classifies a client's first bytes (at least one).
pub fn client_speaks(first: &[u8]) -> ClientSpeaks {
    let n = first.len().min(HTTP2_PREFACE.len());
    if n > 0 && first[..n] == HTTP2_PREFACE[..n] {
        return ClientSpeaks::Http2;
    }
    let q = first.len().min(crate::quick::MAGIC.len());
    if first[..q] == crate::quick::MAGIC[..q] {
        return ClientSpeaks::Quick;
    }
    if first.first() == Some(&CORO_RPC_MAGIC) {
        return ClientSpeaks::CoroRpc;
    }
    let methods: [&[u8]; 6] = [
        b"GET ",
        b"POST ",
        b"PUT ",
        b"HEAD ",
        b"DELETE ",
        b"OPTIONS ",
    ];
    if methods
        .iter()
        .any(|m| first.starts_with(m) || m.starts_with(first))
    {
        return ClientSpeaks::Http1;
    }
    ClientSpeaks::Other
}

/// True if a server's first bytes are an HTTP/2 frame header of a SETTINGS frame, which every
/// HTTP/2 server sends first.
pub fn server_speaks_http2(first: &[u8]) -> bool {
    first.len() >= 9 && first[3] == 0x4
}

/// The hint in a client's error when the master it was pointed at does not speak gRPC; waiting
/// cannot fix that, so startup does not retry it.
pub const NOT_A_LUNAKV_MASTER: &str = "it is not a lunakv-master";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_bytes_name_the_protocol() {
        assert_eq!(client_speaks(HTTP2_PREFACE), ClientSpeaks::Http2);
        assert_eq!(client_speaks(b"PRI "), ClientSpeaks::Http2);
        assert_eq!(
            client_speaks(&[CORO_RPC_MAGIC, 1, 0, 0]),
            ClientSpeaks::CoroRpc
        );
        assert_eq!(client_speaks(b"GET /metrics HTTP/1.1"), ClientSpeaks::Http1);
        assert_eq!(client_speaks(b"\x16\x03\x01"), ClientSpeaks::Other, "TLS");
        assert_eq!(client_speaks(b"LKVQUIK1\0\0"), ClientSpeaks::Quick);
        assert_eq!(
            client_speaks(b"LKV"),
            ClientSpeaks::Quick,
            "a prefix of the magic"
        );
        assert_eq!(client_speaks(b"LKVX"), ClientSpeaks::Other);
        assert!(server_speaks_http2(&[0, 0, 6, 0x4, 0, 0, 0, 0, 0]));
        assert!(!server_speaks_http2(&[
            CORO_RPC_MAGIC,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0
        ]));
        assert!(!server_speaks_http2(&[0, 0, 6]));
    }
}
