//! A buffered reader for the NBD client's socket that never buffers what it need not.
//!
//! Request headers are 28 bytes and a client with many requests in flight sends them back to
//! back, so one `read` into a 64 KiB buffer picks up a whole burst (one system call for 32
//! requests instead of 32). WRITE payload is different: the part that already arrived with the
//! headers is copied out of the buffer (and counted), the rest is read from the socket straight
//! into the payload buffer that is then sent to the brick.

use std::io;

use tokio::io::{AsyncRead, AsyncReadExt};

/// Buffer size: a burst of headers, or a small write with its header, in one `read`.
const BUF_LEN: usize = 64 * 1024;

/// The read half of an NBD connection with a small look-ahead buffer.
pub struct Reader<R> {
    inner: R,
    buf: Box<[u8]>,
    start: usize,
    end: usize,
    /// Payload bytes copied out of the look-ahead buffer.
    pub copied: u64,
}

impl<R: AsyncRead + Unpin> Reader<R> {
    /// Wraps the read half of a connection.
    pub fn new(inner: R) -> Reader<R> {
        Reader {
            inner,
            buf: vec![0u8; BUF_LEN].into_boxed_slice(),
            start: 0,
            end: 0,
            copied: 0,
        }
    }

    /// The bytes received and not consumed yet.
    pub fn buffered(&self) -> &[u8] {
        &self.buf[self.start..self.end]
    }

    /// Marks `n` buffered bytes consumed.
    pub fn consume(&mut self, n: usize) {
        debug_assert!(n <= self.end - self.start);
        self.start += n;
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        }
    }

    /// Reads more from the socket into the buffer; returns how many bytes arrived (0 at end of
    /// stream).
    pub async fn fill(&mut self) -> io::Result<usize> {
        if self.end == self.buf.len() {
            // Move the unconsumed tail to the front; it is at most one partial request header
            // or payload, so this is small.
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        let n = self.inner.read(&mut self.buf[self.end..]).await?;
        self.end += n;
        Ok(n)
    }

    /// Fills until at least `n` bytes (≤ 64 KiB) are buffered. `Ok(false)` if the stream ended
    /// cleanly before any byte of them arrived; an error if it ended part-way.
    pub async fn fill_to(&mut self, n: usize) -> io::Result<bool> {
        debug_assert!(n <= BUF_LEN);
        if self.buf.len() - self.start < n {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        while self.end - self.start < n {
            if self.fill().await? == 0 {
                if self.end == self.start {
                    return Ok(false);
                }
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
        }
        Ok(true)
    }

    /// Reads exactly `dst.len()` bytes: buffered ones first (copied and counted), the rest
    /// straight from the socket into `dst`.
    pub async fn read_exact_into(&mut self, dst: &mut [u8]) -> io::Result<()> {
        let have = (self.end - self.start).min(dst.len());
        dst[..have].copy_from_slice(&self.buf[self.start..self.start + have]);
        self.copied += have as u64;
        self.consume(have);
        if have < dst.len() {
            self.inner.read_exact(&mut dst[have..]).await?;
        }
        Ok(())
    }

    /// Reads and throws away `n` bytes (the payload of a refused WRITE, so the stream stays in
    /// step).
    pub async fn skip(&mut self, mut n: u64) -> io::Result<()> {
        while n > 0 {
            if self.start == self.end && self.fill().await? == 0 {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            let k = (self.end - self.start).min(n.min(usize::MAX as u64) as usize);
            self.consume(k);
            n -= k as u64;
        }
        Ok(())
    }

    /// Reads exactly `n` bytes into a new vector (handshake option data; `n` is bounded by the
    /// caller). Not counted as copied: it is protocol data, not payload.
    pub async fn read_vec(&mut self, n: usize) -> io::Result<Vec<u8>> {
        let mut v = vec![0u8; n];
        let before = self.copied;
        self.read_exact_into(&mut v).await?;
        self.copied = before;
        Ok(v)
    }
}
