//! Streams whose first bytes were read to tell protocols apart.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};

/// The first byte of a TLS connection (a handshake record); plaintext protocols lunakv's ports
/// speak (HTTP/2's preface, quick calls' magic, coro_rpc, HTTP/1) never start with it.
pub const TLS_HANDSHAKE: u8 = 0x16;

/// `inner` with `prefix` (bytes already read from it) served first.
#[derive(Debug)]
pub struct Prefixed<S> {
    prefix: Vec<u8>,
    at: usize,
    inner: S,
}

impl<S> Prefixed<S> {
    pub fn new(prefix: Vec<u8>, inner: S) -> Prefixed<S> {
        Prefixed {
            prefix,
            at: 0,
            inner,
        }
    }

    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

/// Reads up to `n` bytes from `s` within `wait`: fewer when the peer closed or fell silent.
/// `Err` only for a broken connection.
pub async fn read_head<S: AsyncRead + Unpin>(
    s: &mut S,
    n: usize,
    wait: Duration,
) -> io::Result<Vec<u8>> {
    let mut head = vec![0u8; n];
    let mut got = 0;
    let read = tokio::time::timeout(wait, async {
        while got < n {
            match s.read(&mut head[got..]).await {
                Ok(0) => break,
                Ok(k) => got += k,
                Err(e) => return Err(e),
            }
        }
        Ok(())
    })
    .await;
    // Silent for `wait`: what came so far.
    read.unwrap_or(Ok(()))?;
    head.truncate(got);
    Ok(head)
}

impl<S: AsyncRead + Unpin> AsyncRead for Prefixed<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.at < self.prefix.len() {
            let rest = &self.prefix[self.at..];
            let n = rest.len().min(buf.remaining());
            buf.put_slice(&rest[..n]);
            self.at += n;
            if self.at == self.prefix.len() {
                self.prefix = Vec::new();
                self.at = 0;
            }
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Prefixed<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    #[tokio::test]
    async fn the_head_is_read_again_before_the_rest() {
        let (mut a, mut b) = tokio::io::duplex(64);
        a.write_all(b"LKVQUIK1 and the rest").await.unwrap();
        drop(a);
        let head = read_head(&mut b, 8, Duration::from_secs(1)).await.unwrap();
        assert_eq!(head, b"LKVQUIK1");
        let mut all = Vec::new();
        Prefixed::new(head, b).read_to_end(&mut all).await.unwrap();
        assert_eq!(all, b"LKVQUIK1 and the rest");
    }
}
