//! Data fops of a sharded file, split at piece boundaries. One within a piece — nearly every
//! one, with aligned I/O and pieces of a MiB or more — goes to that piece as it came, with the
//! caller's memory; one that spans pieces becomes a request per piece, side by side, each with
//! its part of the caller's memory ([`Shared::slice`]). Only a read that spans pieces and lets
//! the layers below choose the buffer ([`ReadDst::Any`]) is copied, into one buffer.

use std::os::unix::fs::FileExt;
use std::sync::atomic::Ordering::Relaxed;

use super::file::Pieces;
use super::{inner, Shard};
use crate::exec::join_all;
use crate::shared::Shared;
use crate::{errno, Ctx, FopResult, Fut, IoBufs, ReadDst, ReadOut, Written};

/// Pieces worked on at once by a fallocate or discard over many.
const BATCH: usize = 32;

/// Part of an I/O that falls in one piece.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Part {
    /// Where in the file.
    offset: u64,
    /// Where in the I/O.
    skip: usize,
    len: usize,
}

/// The parts of `[offset, offset + len)` in pieces of `block` bytes, one after another.
fn parts(block: u64, offset: u64, len: u64) -> impl Iterator<Item = Part> {
    let end = offset.saturating_add(len);
    let mut at = offset;
    std::iter::from_fn(move || {
        (at < end).then(|| {
            let n = (block - at % block).min(end - at);
            let pt = Part {
                offset: at,
                skip: (at - offset) as usize,
                len: n as usize,
            };
            at += n;
            pt
        })
    })
}

/// The largest sharded file, in pieces: bounds what one fop can make or remove.
const MAX_PIECES: u64 = 1 << 24;

/// Fallocate modes a sharded file takes: those that act on each piece's bytes alone
/// (collapsing or inserting a range would shift bytes between pieces).
const SPLIT_MODES: u32 =
    (libc::FALLOC_FL_KEEP_SIZE | libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_ZERO_RANGE) as u32;

/// Whether `[offset, offset + len)` lies within one piece.
fn within_one(block: u64, offset: u64, len: u64) -> bool {
    len == 0 || offset / block == (offset + len - 1) / block
}

fn empty(dst: ReadDst) -> ReadOut {
    match dst {
        ReadDst::Into(bufs) => ReadOut::Into { n: 0, bufs },
        ReadDst::Any(_) => ReadOut::Buf(Vec::new()),
    }
}

/// `r` made exactly `len` bytes: cut, or filled with zeros (a hole, a short piece).
fn fit(r: ReadOut, len: usize) -> FopResult<ReadOut> {
    Ok(match r {
        ReadOut::Into { n, bufs } => {
            if n < len {
                zero(&bufs, n, len);
            }
            ReadOut::Into { n: len, bufs }
        }
        ReadOut::Buf(mut v) => {
            v.resize(len, 0);
            ReadOut::Buf(v)
        }
        ReadOut::File {
            file,
            offset,
            len: n,
            sums,
        } if n >= len => ReadOut::File {
            file,
            offset,
            len,
            sums: sums.filter(|_| n == len),
        },
        other => {
            let mut v = bytes(other)?;
            v.resize(len, 0);
            ReadOut::Buf(v)
        }
    })
}

/// A read's bytes in a buffer of their own.
fn bytes(r: ReadOut) -> FopResult<Vec<u8>> {
    match r {
        ReadOut::Buf(v) => Ok(v),
        ReadOut::File {
            file, offset, len, ..
        } => {
            let mut v = vec![0; len];
            file.read_exact_at(&mut v, offset).map_err(|_| errno::EIO)?;
            Ok(v)
        }
        ReadOut::Into { .. } => Err(errno::EIO),
    }
}

/// Zeros bytes `[from, to)` of the read memory `bufs`.
fn zero(bufs: &IoBufs, from: usize, to: usize) {
    let mut at = 0;
    for v in bufs.iov() {
        let (s, e) = (from.max(at), to.min(at + v.len));
        if s < e {
            // SAFETY: the vectors are memory lent for this read, writable and not touched by
            // anyone else until it completes (`IoBufs::raw`, or owned by `bufs`); [s, e) lies
            // within this vector.
            unsafe { std::ptr::write_bytes((v.base + (s - at)) as *mut u8, 0, e - s) };
        }
        at += v.len;
    }
}

impl Shard {
    pub(super) async fn read_split(
        &self,
        cx: &Ctx,
        p: &Pieces,
        offset: u64,
        dst: ReadDst,
    ) -> FopResult<ReadOut> {
        let len = dst.len() as u64;
        if within_one(p.mark.block, offset, len) {
            return self.read_piece(cx, p, offset, dst).await;
        }
        let parts: Vec<Part> = parts(p.mark.block, offset, len).collect();
        match dst {
            ReadDst::Any(_) => {
                let futs = parts
                    .iter()
                    .map(|pt| {
                        let f: Fut<'_, ReadOut> = Box::pin(self.read_piece(
                            cx,
                            p,
                            pt.offset,
                            ReadDst::Any(pt.len as u32),
                        ));
                        Some(f)
                    })
                    .collect();
                let mut out = Vec::with_capacity(len as usize);
                for (pt, r) in parts.iter().zip(join_all(futs).await) {
                    let v = bytes(r.unwrap_or(Err(errno::EIO))?)?;
                    let short = v.len() < pt.len;
                    out.extend_from_slice(&v);
                    if short {
                        break;
                    }
                }
                Ok(ReadOut::Buf(out))
            }
            ReadDst::Into(bufs) => {
                let shared = Shared::new(bufs);
                let futs = parts
                    .iter()
                    .map(|pt| {
                        let dst = ReadDst::Into(shared.slice(pt.skip, pt.len));
                        let f: Fut<'_, ReadOut> = Box::pin(self.read_piece(cx, p, pt.offset, dst));
                        Some(f)
                    })
                    .collect();
                let (mut n, mut short, mut err) = (0, false, None);
                for (pt, r) in parts.iter().zip(join_all(futs).await) {
                    match r.unwrap_or(Err(errno::EIO)) {
                        Ok(r) if !short => {
                            n += r.len();
                            short = r.len() < pt.len;
                        }
                        Ok(_) => {}
                        Err(e) => err = err.or(Some(e)),
                    }
                }
                match err {
                    Some(e) => Err(e),
                    None => Ok(ReadOut::Into {
                        n,
                        bufs: shared.into_bufs(),
                    }),
                }
            }
        }
    }

    /// Reads within one piece.
    async fn read_piece(
        &self,
        cx: &Ctx,
        p: &Pieces,
        offset: u64,
        dst: ReadDst,
    ) -> FopResult<ReadOut> {
        let b = p.mark.block;
        let k = offset / b;
        if k == 0 {
            // The base's size is the file's: its own end of file is the file's.
            return self.kid().read(cx, &p.base, offset, dst).await;
        }
        let want = dst.len();
        let end = offset + want as u64;
        let r = match self.piece(cx, p, k, false).await? {
            Some(fd) => {
                self.kid()
                    .read(&inner(cx), &fd, offset - k * b, dst)
                    .await?
            }
            None => empty(dst),
        };
        if r.len() == want && end <= p.known.load(Relaxed) {
            return Ok(r);
        }
        // A hole or a short piece reads as zeros up to the file's end; bytes past it (left
        // by a crash) are not the file's.
        let size = self.size(cx, p).await?;
        fit(r, size.saturating_sub(offset).min(want as u64) as usize)
    }

    pub(super) async fn write_split(
        &self,
        cx: &Ctx,
        p: &Pieces,
        offset: u64,
        data: IoBufs,
    ) -> FopResult<Written> {
        let len = data.len() as u64;
        let end = self.changeable(p, offset, len)?;
        if end > p.mark.block {
            self.grow(cx, p, end).await?;
        }
        if within_one(p.mark.block, offset, len) {
            return self.write_piece(cx, p, offset, data).await;
        }
        let parts: Vec<Part> = parts(p.mark.block, offset, len).collect();
        let shared = Shared::new(data);
        let futs = parts
            .iter()
            .map(|pt| {
                let data = shared.slice(pt.skip, pt.len);
                let f: Fut<'_, Written> = Box::pin(self.write_piece(cx, p, pt.offset, data));
                Some(f)
            })
            .collect();
        let (mut n, mut short, mut err) = (0, false, None);
        for (pt, r) in parts.iter().zip(join_all(futs).await) {
            match r.unwrap_or(Err(errno::EIO)) {
                // Bytes after a short part are not the caller's to count as written.
                Ok(w) if !short => {
                    n += w.n;
                    short = w.n < pt.len;
                }
                Ok(_) => {}
                Err(e) => err = err.or(Some(e)),
            }
        }
        match err {
            Some(e) => Err(e),
            None => Ok(Written {
                n,
                bufs: shared.into_bufs(),
            }),
        }
    }

    /// Writes within one piece, making it if it is a hole.
    async fn write_piece(
        &self,
        cx: &Ctx,
        p: &Pieces,
        offset: u64,
        data: IoBufs,
    ) -> FopResult<Written> {
        let b = p.mark.block;
        let k = offset / b;
        if k == 0 {
            return self.kid().write(cx, &p.base, offset, data).await;
        }
        let fd = self.piece(cx, p, k, true).await?.ok_or(errno::EIO)?;
        self.kid()
            .write(&inner(cx), &fd, offset - k * b, data)
            .await
    }

    pub(super) async fn allocate_split(
        &self,
        cx: &Ctx,
        p: &Pieces,
        mode: u32,
        offset: u64,
        len: u64,
    ) -> FopResult<()> {
        if mode & !SPLIT_MODES != 0 {
            return Err(errno::EOPNOTSUPP);
        }
        let end = self.changeable(p, offset, len)?;
        if mode & libc::FALLOC_FL_KEEP_SIZE as u32 == 0 && end > p.mark.block {
            self.grow(cx, p, end).await?;
        }
        // Freeing a hole's bytes is nothing to do; allocating them makes the piece.
        let frees = mode & (libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_ZERO_RANGE) as u32 != 0;
        // Past the end there are no bytes to free.
        let len = match frees {
            true => len.min(self.size(cx, p).await?.saturating_sub(offset)),
            false => len,
        };
        self.each_part(cx, p, offset, len, !frees, &|fd, at, n| match fd {
            None => self.kid().fallocate(cx, &p.base, mode, at, n),
            Some(fd) => Box::pin(async move {
                let icx = inner(cx);
                self.kid().fallocate(&icx, &fd, mode, at, n).await
            }),
        })
        .await
    }

    pub(super) async fn discard_split(
        &self,
        cx: &Ctx,
        p: &Pieces,
        offset: u64,
        len: u64,
    ) -> FopResult<()> {
        self.changeable(p, offset, len)?;
        let len = len.min(self.size(cx, p).await?.saturating_sub(offset));
        self.each_part(cx, p, offset, len, false, &|fd, at, n| match fd {
            None => self.kid().discard(cx, &p.base, at, n),
            Some(fd) => Box::pin(async move {
                let icx = inner(cx);
                self.kid().discard(&icx, &fd, at, n).await
            }),
        })
        .await
    }

    /// The end of a change of `[offset, offset + len)`, if this handle may make it: open for
    /// writing, and within the largest sharded file.
    fn changeable(&self, p: &Pieces, offset: u64, len: u64) -> FopResult<u64> {
        if !p.writable {
            return Err(errno::EBADF);
        }
        let end = offset.checked_add(len).ok_or(errno::EINVAL)?;
        if end > p.mark.block.saturating_mul(MAX_PIECES) {
            return Err(libc::EFBIG as crate::Errno);
        }
        Ok(end)
    }

    /// Runs `op` on each piece `[offset, offset + len)` spans — `None` for the base, else the
    /// piece's handle (pieces that are holes skipped, or made with `make`) — with the range
    /// within it, [`BATCH`] pieces at a time.
    async fn each_part<'a>(
        &'a self,
        cx: &'a Ctx,
        p: &'a Pieces,
        offset: u64,
        len: u64,
        make: bool,
        op: &(dyn Fn(Option<crate::Fd>, u64, u64) -> Fut<'a, ()> + Sync),
    ) -> FopResult<()> {
        let b = p.mark.block;
        let mut all = parts(b, offset, len).peekable();
        while all.peek().is_some() {
            let chunk: Vec<Part> = all.by_ref().take(BATCH).collect();
            let mut futs = Vec::with_capacity(chunk.len());
            for pt in chunk {
                let (k, at) = (pt.offset / b, pt.offset % b);
                if k == 0 {
                    futs.push(Some(op(None, at, pt.len as u64)));
                } else if let Some(fd) = self.piece(cx, p, k, make).await? {
                    futs.push(Some(op(Some(fd), at, pt.len as u64)));
                }
            }
            for r in join_all(futs).await.into_iter().flatten() {
                r?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_cover_the_range_and_break_at_pieces() {
        let b = 1 << 20;
        assert_eq!(
            parts(b, 5, 10).collect::<Vec<_>>(),
            vec![Part {
                offset: 5,
                skip: 0,
                len: 10
            }]
        );
        let ps: Vec<Part> = parts(b, b - 3, 2 * b + 6).collect();
        assert_eq!(ps.len(), 4);
        assert_eq!(
            ps[0],
            Part {
                offset: b - 3,
                skip: 0,
                len: 3
            }
        );
        assert_eq!(
            ps[1],
            Part {
                offset: b,
                skip: 3,
                len: b as usize
            }
        );
        assert_eq!(
            ps[3],
            Part {
                offset: 3 * b,
                skip: 3 + 2 * b as usize,
                len: 3
            }
        );
        assert_eq!(ps.iter().map(|p| p.len as u64).sum::<u64>(), 2 * b + 6);
        assert!(within_one(b, b - 1, 1) && !within_one(b, b - 1, 2) && within_one(b, 7, 0));
    }
}
