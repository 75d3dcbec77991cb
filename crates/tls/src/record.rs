//! The TLS 1.3 record layer (RFC 8446 §5), after rustls has done the handshake and handed
//! over the traffic keys.
//!
//! Keeping the records to ourselves is what makes TLS affordable on Kiln's data path: each
//! direction has its own key and state, so the heavy direction runs in the connection's own
//! thread or task ([`RecordReader`], [`RecordWriter`]) and the light one in a helper thread
//! ([`send_loop`], [`receive_loop`]) with no lock between them; records are sealed and opened
//! in place, and plaintext moves in and out with one vectored system call per batch — no
//! per-record allocation and no copy between buffers in user space.
//!
//! What the peer may send after the handshake is limited to what a Kiln peer sends: application
//! data and a `close_notify` alert. Session tickets are turned off on both sides and ignored if
//! they come anyway; key updates are refused, so a connection ends (and Kiln clients reconnect)
//! before a key has protected AES-GCM's limit of records.

use std::io::{self, IoSlice, IoSliceMut, Read};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;

use std::os::fd::AsFd;

use rustix::event::{poll, PollFd, PollFlags};

use aws_lc_rs::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_128_GCM, AES_256_GCM};
use rustls::ConnectionTrafficSecrets;

/// Bytes in a record header: type, legacy version (2), length (2).
pub const HEADER: usize = 5;
/// Most plaintext bytes in one record.
const MAX_PLAIN: usize = 1 << 14;
/// Most bytes after the header that a peer may send (plaintext, content type, padding, tag).
const MAX_BODY: usize = MAX_PLAIN + 256;
/// The largest record, header included.
pub const MAX_RECORD: usize = HEADER + MAX_BODY;
const TAG: usize = 16;
const NONCE: usize = 12;

const ALERT: u8 = 21;
const HANDSHAKE: u8 = 22;
const APPLICATION_DATA: u8 = 23;
/// The handshake message a server may send after the handshake that we accept and drop.
const NEW_SESSION_TICKET: u8 = 4;

/// Records one key may protect: under AES-GCM's limit of 2^24.5 for TLS 1.3 (RFC 8446 §5.5).
const RECORD_LIMIT: u64 = 1 << 24;

/// Full records gathered per batch on the sending side.
const SLOTS: usize = 64;
/// One record's room: header, plaintext, content type, tag.
const SLOT: usize = HEADER + MAX_PLAIN + 1 + TAG;
/// The receiving side's buffer: room for many records per read.
const RECV_BUF: usize = 32 * MAX_RECORD;

fn proto(what: impl std::fmt::Display) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("TLS: {what}"))
}

/// One direction's key, IV and record sequence number.
pub struct Cipher {
    key: LessSafeKey,
    iv: [u8; NONCE],
    seq: u64,
}

impl Cipher {
    /// The cipher for one direction, from the secrets rustls extracted.
    pub fn new((seq, secrets): (u64, ConnectionTrafficSecrets)) -> io::Result<Cipher> {
        let (alg, key, iv) = match secrets {
            ConnectionTrafficSecrets::Aes128Gcm { key, iv } => (&AES_128_GCM, key, iv),
            ConnectionTrafficSecrets::Aes256Gcm { key, iv } => (&AES_256_GCM, key, iv),
            _ => return Err(proto("negotiated a cipher suite Kiln does not implement")),
        };
        let key = UnboundKey::new(alg, key.as_ref()).map_err(|_| proto("bad traffic key"))?;
        let iv: [u8; NONCE] = iv
            .as_ref()
            .try_into()
            .map_err(|_| proto("bad traffic IV"))?;
        Ok(Cipher {
            key: LessSafeKey::new(key),
            iv,
            seq,
        })
    }

    /// The next record's nonce: the IV with the sequence number folded into its low bytes.
    fn nonce(&mut self) -> io::Result<Nonce> {
        if self.seq >= RECORD_LIMIT {
            return Err(proto(
                "this connection's key has protected as many records as it safely can; reconnect",
            ));
        }
        let mut n = self.iv;
        for (b, s) in n[NONCE - 8..].iter_mut().zip(self.seq.to_be_bytes()) {
            *b ^= s;
        }
        self.seq += 1;
        Ok(Nonce::assume_unique_for_key(n))
    }

    /// Seals the record in `rec` whose inner plaintext (data and content type) fills
    /// `rec[HEADER..HEADER + inner]`: writes the header in front and the tag behind, and
    /// returns the record's length.
    fn seal(&mut self, rec: &mut [u8], inner: usize) -> io::Result<usize> {
        let body = inner + TAG;
        let [hi, lo] = (body as u16).to_be_bytes();
        let hdr = [APPLICATION_DATA, 3, 3, hi, lo];
        rec[..HEADER].copy_from_slice(&hdr);
        let nonce = self.nonce()?;
        let tag = self
            .key
            .seal_in_place_separate_tag(nonce, Aad::from(hdr), &mut rec[HEADER..HEADER + inner])
            .map_err(|_| proto("sealing a record failed"))?;
        rec[HEADER + inner..HEADER + body].copy_from_slice(tag.as_ref());
        Ok(HEADER + body)
    }

    /// Opens the whole record in `rec` in place; returns its content type and the length of
    /// its plaintext, which now starts at `rec[HEADER]`.
    fn open(&mut self, rec: &mut [u8]) -> io::Result<(u8, usize)> {
        let hdr: [u8; HEADER] = rec[..HEADER].try_into().expect("header length");
        let nonce = self.nonce()?;
        let plain = self
            .key
            .open_in_place(nonce, Aad::from(hdr), &mut rec[HEADER..])
            .map_err(|_| proto("a record failed authentication"))?;
        // The content type is the last non-zero byte; zeros after it are padding.
        let Some(at) = plain.iter().rposition(|&b| b != 0) else {
            return Err(proto("a record without a content type"));
        };
        Ok((plain[at], at))
    }
}

/// Waits until `fd` is ready for `what`.
fn wait(fd: &impl AsFd, what: PollFlags) -> io::Result<()> {
    let mut p = [PollFd::new(fd, what)];
    match poll(&mut p, None) {
        Ok(_) | Err(rustix::io::Errno::INTR) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Writes every byte of `parts` (ranges of `buf`) to socket `out` with as few system calls as
/// it takes. `sendmsg` with `MSG_NOSIGNAL`, not `writev`: a peer that reset the connection is
/// an error here, never a SIGPIPE that ends the process (one-shot commands such as `kiln
/// volume heal` keep SIGPIPE's default action for their output).
fn write_all(out: &mut impl AsFd, buf: &[u8], parts: &[(usize, usize)]) -> io::Result<()> {
    let mut slices: Vec<IoSlice<'_>> = parts
        .iter()
        .map(|&(at, len)| IoSlice::new(&buf[at..at + len]))
        .collect();
    let mut rest = &mut slices[..];
    while !rest.is_empty() {
        let sent = rustix::net::sendmsg(
            out.as_fd(),
            rest,
            &mut rustix::net::SendAncillaryBuffer::default(),
            rustix::net::SendFlags::NOSIGNAL,
        );
        match sent.map_err(io::Error::from) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut rest, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => wait(out, PollFlags::OUT)?,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Plaintext from the application end, sealed into records onto the network, until the
/// application closes (then a `close_notify` goes out) or either side fails.
pub fn send_loop(mut tx: Cipher, mut app: UnixStream, mut net: TcpStream) {
    let r = send(&mut tx, &mut app, &mut net);
    if let Err(e) = &r {
        tracing::debug!("TLS sending thread: {e}");
        let _ = net.shutdown(std::net::Shutdown::Both);
        let _ = app.shutdown(std::net::Shutdown::Both);
    } else {
        let _ = net.shutdown(std::net::Shutdown::Write);
        // The receiving side waits for the peer to close too, but not for ever.
        let _ = net.set_read_timeout(Some(std::time::Duration::from_secs(10)));
    }
}

fn send(tx: &mut Cipher, app: &mut UnixStream, net: &mut TcpStream) -> io::Result<()> {
    let mut buf = vec![0u8; SLOTS * SLOT];
    let mut parts = Vec::with_capacity(SLOTS);
    loop {
        // Receive straight into the plaintext room of each record slot.
        let n = {
            let mut iov: Vec<IoSliceMut<'_>> = buf
                .chunks_mut(SLOT)
                .map(|s| IoSliceMut::new(&mut s[HEADER..HEADER + MAX_PLAIN]))
                .collect();
            match app.read_vectored(&mut iov) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        };
        if n == 0 {
            let rec = &mut buf[..SLOT];
            rec[HEADER..HEADER + 3].copy_from_slice(&[1, 0, ALERT]); // warning, close_notify
            let len = tx.seal(rec, 3)?;
            return write_all(net, &buf, &[(0, len)]);
        }
        parts.clear();
        let mut left = n;
        for (i, rec) in buf.chunks_mut(SLOT).enumerate() {
            if left == 0 {
                break;
            }
            let len = left.min(MAX_PLAIN);
            rec[HEADER + len] = APPLICATION_DATA;
            parts.push((i * SLOT, tx.seal(rec, len + 1)?));
            left -= len;
        }
        write_all(net, &buf, &parts)?;
    }
}

/// Records from the network, opened in place, their plaintext onto the application end, until
/// the peer closes or either side fails.
pub fn receive_loop(mut rx: Cipher, mut net: TcpStream, mut app: UnixStream) {
    match receive(&mut rx, &mut net, &mut app) {
        Ok(()) => {
            let _ = app.shutdown(std::net::Shutdown::Write);
        }
        Err(e) => {
            tracing::debug!("TLS receiving thread: {e}");
            let _ = net.shutdown(std::net::Shutdown::Both);
            let _ = app.shutdown(std::net::Shutdown::Both);
        }
    }
}

fn receive(rx: &mut Cipher, net: &mut TcpStream, app: &mut UnixStream) -> io::Result<()> {
    let mut buf = vec![0u8; RECV_BUF];
    let (mut start, mut end) = (0usize, 0usize);
    let mut parts = Vec::with_capacity(64);
    loop {
        parts.clear();
        let mut closed = false;
        while let Some(body) = body_len(&buf[start..end])? {
            if end - start < HEADER + body {
                break;
            }
            let (kind, len) = rx.open(&mut buf[start..start + HEADER + body])?;
            let plain = start + HEADER;
            start += HEADER + body;
            closed = settle(kind, &buf[plain..plain + len])?;
            if kind == APPLICATION_DATA && len > 0 {
                parts.push((plain, len));
            }
            if closed {
                break;
            }
        }
        write_all(app, &buf, &parts)?;
        if closed {
            return Ok(());
        }
        if start == end {
            (start, end) = (0, 0);
        } else if buf.len() - end < MAX_RECORD {
            buf.copy_within(start..end, 0);
            (start, end) = (0, end - start);
        }
        match net.read(&mut buf[end..]) {
            // Closed without close_notify: nothing more will come either way.
            Ok(0) => return Ok(()),
            Ok(n) => end += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            // The owner of the other direction may have made the shared socket non-blocking.
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => wait(net, PollFlags::IN)?,
            Err(e) => return Err(e),
        }
    }
}

/// The receiving side of a connection whose owner reads records itself, on its own thread,
/// and wants plaintext in its own buffers: the client's receive thread (one copy, from the
/// opened record into the request's buffers).
pub struct RecordReader {
    rx: Cipher,
    buf: Vec<u8>,
    /// Ciphertext not yet opened: `buf[start..end]`.
    start: usize,
    end: usize,
    /// Plaintext opened but not yet delivered, as ranges of `buf`, in order.
    plain: std::collections::VecDeque<(usize, usize)>,
    closed: bool,
}

impl RecordReader {
    pub(crate) fn new(rx: Cipher) -> RecordReader {
        RecordReader {
            rx,
            buf: vec![0u8; RECV_BUF],
            start: 0,
            end: 0,
            plain: std::collections::VecDeque::new(),
            closed: false,
        }
    }

    /// A reader of records sealed with `secrets`, the first of them with sequence number `seq`
    /// (what rustls hands over after a handshake). For tests and fuzzing, which feed it
    /// ciphertext with [`RecordReader::read_from`]; connections get theirs from
    /// [`crate::connect_split`].
    pub fn from_secrets(seq: u64, secrets: ConnectionTrafficSecrets) -> io::Result<RecordReader> {
        Ok(RecordReader::new(Cipher::new((seq, secrets))?))
    }

    /// Like `recvmsg` on the socket `fd`, but delivering plaintext: fills `iov` in order with
    /// what is ready, reading and opening records when nothing is. Returns 0 at the end of
    /// the stream; with `nonblocking`, `WouldBlock` when nothing is ready.
    ///
    /// # Safety
    /// Every vector must describe memory the caller may write for the duration of the call.
    pub unsafe fn recv(
        &mut self,
        fd: std::os::fd::BorrowedFd<'_>,
        iov: &[kiln_proto::iov::RawIov],
        nonblocking: bool,
    ) -> io::Result<usize> {
        let flags = if nonblocking {
            rustix::net::RecvFlags::DONTWAIT
        } else {
            rustix::net::RecvFlags::empty()
        };
        // SAFETY: our caller makes the same promise about `iov`.
        unsafe {
            self.recv_with(iov, |buf| {
                rustix::net::recv(fd, buf, flags)
                    .map(|(n, _)| n)
                    .map_err(io::Error::from)
            })
        }
    }

    /// Like [`RecordReader::recv`], with the ciphertext read from `src` instead of a socket
    /// and the plaintext delivered into `out` (not empty): tests and fuzzing feed a reader
    /// this way. Returns 0 once `src` ends or the peer's `close_notify` has been opened;
    /// errors from `src` (such as `WouldBlock`) are returned as they are.
    pub fn read_from(&mut self, src: &mut impl Read, out: &mut [u8]) -> io::Result<usize> {
        let iov = [kiln_proto::iov::RawIov {
            base: out.as_mut_ptr() as usize,
            len: out.len(),
        }];
        // SAFETY: the vector describes `out`, which is borrowed mutably for the whole call.
        unsafe { self.recv_with(&iov, |buf| src.read(buf)) }
    }

    /// The loop behind [`RecordReader::recv`]: `read` fills the buffer it is given with
    /// ciphertext and returns how much (0 at the end of the stream).
    ///
    /// # Safety
    /// As for [`RecordReader::recv`]: every vector must describe memory the caller may write.
    unsafe fn recv_with(
        &mut self,
        iov: &[kiln_proto::iov::RawIov],
        mut read: impl FnMut(&mut [u8]) -> io::Result<usize>,
    ) -> io::Result<usize> {
        loop {
            if !self.plain.is_empty() {
                return Ok(self.deliver(iov));
            }
            if self.closed {
                return Ok(0);
            }
            if self.start == self.end {
                (self.start, self.end) = (0, 0);
            } else if self.buf.len() - self.end < MAX_RECORD {
                self.buf.copy_within(self.start..self.end, 0);
                (self.start, self.end) = (0, self.end - self.start);
            }
            match read(&mut self.buf[self.end..]) {
                Ok(0) => self.closed = true,
                Ok(n) => {
                    self.end += n;
                    self.open_ready()?;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }

    /// Opens every complete record in the buffer.
    fn open_ready(&mut self) -> io::Result<()> {
        while self.end - self.start >= HEADER && !self.closed {
            let Some(body) = body_len(&self.buf[self.start..self.start + HEADER])? else {
                unreachable!("the header is complete")
            };
            if self.end - self.start < HEADER + body {
                break;
            }
            let rec = self.start..self.start + HEADER + body;
            let (kind, len) = self.rx.open(&mut self.buf[rec])?;
            let at = self.start + HEADER;
            self.start += HEADER + body;
            self.closed = settle(kind, &self.buf[at..at + len])?;
            if kind == APPLICATION_DATA && len > 0 {
                self.plain.push_back((at, len));
            }
        }
        Ok(())
    }

    /// Copies ready plaintext into `iov`; returns how much.
    fn deliver(&mut self, iov: &[kiln_proto::iov::RawIov]) -> usize {
        let mut done = 0;
        let mut vi = 0;
        let mut voff = 0;
        while let Some(&(at, len)) = self.plain.front() {
            let Some(v) = iov.get(vi) else { break };
            let take = len.min(v.len - voff);
            // SAFETY: the caller promises every vector is writable (see `recv`).
            unsafe {
                std::ptr::copy_nonoverlapping(
                    self.buf[at..].as_ptr(),
                    (v.base + voff) as *mut u8,
                    take,
                );
            }
            done += take;
            voff += take;
            if voff == v.len {
                vi += 1;
                voff = 0;
            }
            if take == len {
                self.plain.pop_front();
            } else {
                self.plain[0] = (at + take, len - take);
            }
        }
        done
    }
}

/// The sending side of a connection whose owner seals records itself (the brick's
/// connection task): plaintext is gathered straight into record slots — file data read from
/// the page cache into them, no intermediate buffer — sealed in place, and written to the
/// socket without blocking; what the socket does not take waits in the writer.
pub struct RecordWriter {
    tx: Cipher,
    buf: Vec<u8>,
    /// Sealed records not yet written: ranges of `buf`, the first `done` bytes of the first
    /// already written.
    sealed: Vec<(usize, usize)>,
    done: usize,
}

impl RecordWriter {
    pub(crate) fn new(tx: Cipher) -> RecordWriter {
        RecordWriter {
            tx,
            buf: vec![0u8; SLOTS * SLOT],
            sealed: Vec::with_capacity(SLOTS),
            done: 0,
        }
    }

    /// True while sealed records wait to be written.
    pub fn pending(&self) -> bool {
        !self.sealed.is_empty()
    }

    /// Most plaintext bytes one batch takes: the batch is laid into the record slots' rooms
    /// as one logical span of this many bytes ([`RecordWriter::put`],
    /// [`RecordWriter::read_file`]), then sealed ([`RecordWriter::seal`]).
    pub const BATCH: usize = SLOTS * MAX_PLAIN;

    /// The rooms covering logical bytes `at..at + len` of the batch.
    fn rooms(&mut self, at: usize, len: usize) -> Vec<&mut [u8]> {
        assert!(
            !self.pending() && at + len <= Self::BATCH,
            "batch span out of place"
        );
        let mut out = Vec::new();
        let (mut at, mut left) = (at, len);
        for (i, rec) in self.buf.chunks_mut(SLOT).enumerate() {
            let room = i * MAX_PLAIN..(i + 1) * MAX_PLAIN;
            if left == 0 {
                break;
            }
            if at >= room.end {
                continue;
            }
            let from = at - room.start;
            let take = (MAX_PLAIN - from).min(left);
            out.push(&mut rec[HEADER + from..HEADER + from + take]);
            at += take;
            left -= take;
        }
        out
    }

    /// Copies `src` to logical bytes `at..` of the batch.
    pub fn put(&mut self, at: usize, src: &[u8]) {
        let mut done = 0;
        for room in self.rooms(at, src.len()) {
            let n = room.len();
            room.copy_from_slice(&src[done..done + n]);
            done += n;
        }
    }

    /// Zeroes logical bytes `at..at + len` of the batch.
    pub fn zero(&mut self, at: usize, len: usize) {
        for room in self.rooms(at, len) {
            room.fill(0);
        }
    }

    /// Reads `len` bytes of `file` from `offset` straight into logical bytes `at..` of the
    /// batch (one `preadv`); returns how many it read (fewer at the end of the file).
    pub fn read_file(
        &mut self,
        at: usize,
        len: usize,
        file: &std::fs::File,
        offset: u64,
    ) -> io::Result<usize> {
        let mut iov: Vec<IoSliceMut<'_>> = self
            .rooms(at, len)
            .into_iter()
            .map(IoSliceMut::new)
            .collect();
        loop {
            match rustix::io::preadv(file, &mut iov, offset) {
                Err(rustix::io::Errno::INTR) => continue,
                r => return r.map_err(io::Error::from),
            }
        }
    }

    /// Seals the first `n` bytes of the batch into records (every record full but the last);
    /// then [`RecordWriter::flush`] writes them.
    pub fn seal(&mut self, n: usize) -> io::Result<()> {
        assert!(!self.pending() && n <= Self::BATCH, "seal out of place");
        let mut left = n;
        for (i, rec) in self.buf.chunks_mut(SLOT).enumerate() {
            if left == 0 {
                break;
            }
            let len = left.min(MAX_PLAIN);
            rec[HEADER + len] = APPLICATION_DATA;
            let sealed = self.tx.seal(rec, len + 1)?;
            self.sealed.push((i * SLOT, sealed));
            left -= len;
        }
        Ok(())
    }

    /// Writes sealed records to `fd` without blocking: true when all have left, false when
    /// the socket is full.
    pub fn flush(&mut self, fd: std::os::fd::BorrowedFd<'_>) -> io::Result<bool> {
        while !self.sealed.is_empty() {
            let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(self.sealed.len());
            for (k, &(at, len)) in self.sealed.iter().enumerate() {
                let skip = if k == 0 { self.done } else { 0 };
                slices.push(IoSlice::new(&self.buf[at + skip..at + len]));
            }
            let n = match rustix::net::sendmsg(
                fd,
                &slices,
                &mut rustix::net::SendAncillaryBuffer::default(),
                rustix::net::SendFlags::DONTWAIT | rustix::net::SendFlags::NOSIGNAL,
            ) {
                Ok(n) => n,
                Err(rustix::io::Errno::INTR) => continue,
                Err(rustix::io::Errno::AGAIN) => return Ok(false),
                Err(e) => return Err(e.into()),
            };
            let mut left = n;
            while left > 0 {
                let (_, len) = self.sealed[0];
                let take = left.min(len - self.done);
                self.done += take;
                left -= take;
                if self.done == len {
                    self.sealed.remove(0);
                    self.done = 0;
                }
            }
        }
        Ok(true)
    }
}

/// A record header's body length, checked; `None` if the header is incomplete.
fn body_len(h: &[u8]) -> io::Result<Option<usize>> {
    if h.len() < HEADER {
        return Ok(None);
    }
    let body = u16::from_be_bytes([h[3], h[4]]) as usize;
    if h[0] != APPLICATION_DATA || h[1] != 3 || !(TAG + 1..=MAX_BODY).contains(&body) {
        return Err(proto(format!(
            "malformed record header {:02x?}",
            &h[..HEADER]
        )));
    }
    Ok(Some(body))
}

/// What an opened record of type `kind` with plaintext `plain` means: data (false), the
/// peer's `close_notify` (true), or an error.
fn settle(kind: u8, plain: &[u8]) -> io::Result<bool> {
    match kind {
        APPLICATION_DATA => Ok(false),
        ALERT if plain == [1, 0] || plain == [2, 0] => Ok(true), // close_notify
        ALERT => Err(proto(format!(
            "the peer sent alert {}",
            plain.get(1).copied().unwrap_or(0)
        ))),
        HANDSHAKE if plain.first() == Some(&NEW_SESSION_TICKET) => Ok(false),
        HANDSHAKE => Err(proto("post-handshake messages are not supported")),
        k => Err(proto(format!("unexpected record type {k}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustls::crypto::cipher::{AeadKey, Iv};

    fn pair() -> (Cipher, Cipher) {
        let make = || {
            Cipher::new((
                7,
                ConnectionTrafficSecrets::Aes256Gcm {
                    key: AeadKey::from([0x42; 32]),
                    iv: Iv::from([9; NONCE]),
                },
            ))
            .expect("cipher")
        };
        (make(), make())
    }

    fn sealed(tx: &mut Cipher, data: &[u8], kind: u8) -> Vec<u8> {
        let mut rec = vec![0u8; SLOT];
        rec[HEADER..HEADER + data.len()].copy_from_slice(data);
        rec[HEADER + data.len()] = kind;
        let n = tx.seal(&mut rec, data.len() + 1).expect("seal");
        rec.truncate(n);
        rec
    }

    #[test]
    fn records_open_to_what_was_sealed_and_nothing_else() {
        let (mut tx, mut rx) = pair();
        let data: Vec<u8> = (0..MAX_PLAIN).map(|i| i as u8).collect();
        let mut rec = sealed(&mut tx, &data, APPLICATION_DATA);
        assert_eq!(rec.len(), HEADER + MAX_PLAIN + 1 + TAG);
        assert_ne!(&rec[HEADER..HEADER + 64], &data[..64], "sealed, not copied");
        let (kind, len) = rx.open(&mut rec).expect("open");
        assert_eq!((kind, len), (APPLICATION_DATA, MAX_PLAIN));
        assert_eq!(&rec[HEADER..HEADER + len], &data[..]);

        // A flipped bit, a replayed record and a record out of order all fail.
        let mut bad = sealed(&mut tx, b"hello", APPLICATION_DATA);
        bad[HEADER + 2] ^= 1;
        assert!(rx.open(&mut bad).is_err(), "tampered record accepted");
        let (mut tx, mut rx) = pair();
        let first = sealed(&mut tx, b"one", APPLICATION_DATA);
        let mut second = sealed(&mut tx, b"two", APPLICATION_DATA);
        assert!(
            rx.open(&mut second).is_err(),
            "record out of order accepted"
        );
        let (_, mut rx) = pair();
        let mut again = first.clone();
        rx.open(&mut again).expect("first");
        let mut replay = first;
        assert!(rx.open(&mut replay).is_err(), "replayed record accepted");
    }

    #[test]
    fn a_reader_fed_from_memory_delivers_data_and_refuses_garbage() {
        let secrets = || ConnectionTrafficSecrets::Aes256Gcm {
            key: AeadKey::from([0x42; 32]),
            iv: Iv::from([9; NONCE]),
        };
        let (mut tx, _) = pair();
        let mut wire = sealed(&mut tx, b"hello ", APPLICATION_DATA);
        wire.extend(sealed(&mut tx, &[4, 0, 0, 1], HANDSHAKE)); // a session ticket: dropped
        wire.extend(sealed(&mut tx, b"world", APPLICATION_DATA));
        wire.extend(sealed(&mut tx, &[1, 0], ALERT));
        wire.extend(sealed(&mut tx, b"after the end", APPLICATION_DATA));
        let mut rd = RecordReader::from_secrets(7, secrets()).expect("reader");
        let (mut src, mut out, mut got) = (&wire[..], [0u8; 4], Vec::new());
        loop {
            match rd.read_from(&mut src, &mut out).expect("read") {
                0 => break,
                n => got.extend_from_slice(&out[..n]),
            }
        }
        assert_eq!(got, b"hello world");

        // A well-formed header over garbage, and a header that is not application data.
        let mut garbage = vec![APPLICATION_DATA, 3, 3, 0, 17];
        garbage.extend([0x5a; 17]);
        for bad in [&garbage[..], &[HANDSHAKE, 3, 3, 0, 17][..]] {
            let mut rd = RecordReader::from_secrets(7, secrets()).expect("reader");
            let e = rd.read_from(&mut &bad[..], &mut out).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{e}");
        }
    }

    #[test]
    fn sequence_numbers_stop_at_the_key_limit() {
        let (mut tx, _) = pair();
        tx.seq = RECORD_LIMIT - 1;
        sealed(&mut tx, b"last", APPLICATION_DATA);
        let mut rec = vec![0u8; SLOT];
        assert!(tx.seal(&mut rec, 1).is_err(), "a key past its limit");
    }

    #[test]
    fn a_peer_gone_is_an_error_not_a_signal() {
        let (mut a, b) = UnixStream::pair().unwrap();
        drop(b);
        // As a one-shot command runs: SIGPIPE's default action ends the process. A write
        // that raised it would end this test binary instead of failing.
        // SAFETY: changes one signal's disposition; restored below.
        let old = unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
        let r = write_all(&mut a, b"sealed record", &[(0, 6), (6, 7)]);
        // SAFETY: as above.
        unsafe { libc::signal(libc::SIGPIPE, old) };
        assert_eq!(r.unwrap_err().kind(), io::ErrorKind::BrokenPipe);
    }
}
