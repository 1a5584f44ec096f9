//! Allocation-free vectored I/O helpers: gather a header and many caller pieces into one
//! `writev`, scatter a payload straight into caller pieces with `readv`.

use std::io::{self, IoSlice, IoSliceMut, Read, Write};

/// How many iovecs one syscall carries; objects with more pieces take more syscalls.
const IOV_BATCH: usize = 64;

/// Writes `head` pieces then `body` pieces, all of them, with as few `writev` calls as possible.
pub(crate) fn write_all_gather<W: Write>(
    w: &mut W,
    head: &[&[u8]],
    body: &[&[u8]],
) -> io::Result<()> {
    // Cursor: index into the virtual concatenation head ++ body, and bytes already sent of it.
    let total = head.len() + body.len();
    let piece = |i: usize| -> &[u8] {
        if i < head.len() {
            head[i]
        } else {
            body[i - head.len()]
        }
    };
    let mut idx = 0usize;
    let mut done_in_piece = 0usize;
    loop {
        while idx < total && piece(idx).len() == done_in_piece {
            idx += 1;
            done_in_piece = 0;
        }
        if idx >= total {
            return Ok(());
        }
        let mut iov: [IoSlice<'_>; IOV_BATCH] = [IoSlice::new(&[]); IOV_BATCH];
        let mut n = 0;
        let mut j = idx;
        while j < total && n < IOV_BATCH {
            let p = if j == idx {
                &piece(j)[done_in_piece..]
            } else {
                piece(j)
            };
            if !p.is_empty() {
                iov[n] = IoSlice::new(p);
                n += 1;
            }
            j += 1;
        }
        let mut wrote = match w.write_vectored(&iov[..n]) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(k) => k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        // Advance the cursor by `wrote` bytes.
        while wrote > 0 {
            let left = piece(idx).len() - done_in_piece;
            if wrote >= left {
                wrote -= left;
                idx += 1;
                done_in_piece = 0;
            } else {
                done_in_piece += wrote;
                wrote = 0;
            }
        }
    }
}

/// Fills every `dst` piece in order, with as few `readv` calls as possible.
pub(crate) fn read_exact_scatter<R: Read>(r: &mut R, dst: &mut [&mut [u8]]) -> io::Result<()> {
    let mut idx = 0usize;
    let mut done_in_piece = 0usize;
    loop {
        while idx < dst.len() && dst[idx].len() == done_in_piece {
            idx += 1;
            done_in_piece = 0;
        }
        if idx >= dst.len() {
            return Ok(());
        }
        let got = {
            let (first, rest) = dst[idx..].split_at_mut(1);
            let mut iov: [IoSliceMut<'_>; IOV_BATCH] =
                std::array::from_fn(|_| IoSliceMut::new(&mut []));
            iov[0] = IoSliceMut::new(&mut first[0][done_in_piece..]);
            let mut n = 1;
            for p in rest.iter_mut() {
                if n == IOV_BATCH {
                    break;
                }
                if !p.is_empty() {
                    iov[n] = IoSliceMut::new(p);
                    n += 1;
                }
            }
            match r.read_vectored(&mut iov[..n]) {
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(k) => k,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        };
        let mut got = got;
        while got > 0 {
            let left = dst[idx].len() - done_in_piece;
            if got >= left {
                got -= left;
                idx += 1;
                done_in_piece = 0;
            } else {
                done_in_piece += got;
                got = 0;
            }
        }
    }
}

/// Reads and discards `n` bytes (the payload of a refused WRITE), keeping the stream in sync.
pub(crate) fn discard<R: Read>(r: &mut R, mut n: u64) -> io::Result<()> {
    let mut buf = [0u8; 8192];
    while n > 0 {
        let want = n.min(buf.len() as u64) as usize;
        r.read_exact(&mut buf[..want])?;
        n -= want as u64;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gather_then_scatter_many_pieces() {
        let head = [b"hd".as_slice()];
        let data: Vec<Vec<u8>> = (0..150).map(|i| vec![i as u8; (i % 7) + 1]).collect();
        let body: Vec<&[u8]> = data.iter().map(|v| v.as_slice()).collect();
        let mut out = Vec::new();
        write_all_gather(&mut out, &head, &body).unwrap();
        let expect: Vec<u8> = std::iter::once(b"hd".to_vec())
            .chain(data.clone())
            .flatten()
            .collect();
        assert_eq!(out, expect);

        let mut bufs: Vec<Vec<u8>> = data.iter().map(|v| vec![0u8; v.len()]).collect();
        let mut dst: Vec<&mut [u8]> = bufs.iter_mut().map(|v| v.as_mut_slice()).collect();
        let mut src = &expect[2..];
        read_exact_scatter(&mut src, &mut dst).unwrap();
        assert_eq!(bufs, data);
    }
}
