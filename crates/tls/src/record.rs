//! The TLS 1.3 record layer of an established tunnel (RFC 8446 §5), after rustls has done the
//! handshake and handed over the traffic keys.
//!
//! Keeping the records to ourselves is what makes the tunnel cheap: each direction has its own
//! thread and key, records are sealed and opened in place in one buffer per direction, and
//! plaintext moves in and out with one vectored system call per batch — no per-record
//! allocation and no copy between buffers in user space.
//!
//! What the peer may send after the handshake is limited to what a Kiln peer sends: application
//! data and a `close_notify` alert. Session tickets are turned off on both sides and ignored if
//! they come anyway; key updates are refused, so a connection ends (and Kiln clients reconnect)
//! before a key has protected AES-GCM's limit of records.

use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;

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
const SLOTS: usize = 16;
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
            _ => {
                return Err(proto(
                    "negotiated a cipher suite the tunnel does not implement",
                ))
            }
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

/// Writes every byte of `parts` (ranges of `buf`) with as few system calls as it takes.
fn write_all(out: &mut impl Write, buf: &[u8], parts: &[(usize, usize)]) -> io::Result<()> {
    let mut slices: Vec<IoSlice<'_>> = parts
        .iter()
        .map(|&(at, len)| IoSlice::new(&buf[at..at + len]))
        .collect();
    let mut rest = &mut slices[..];
    while !rest.is_empty() {
        match out.write_vectored(rest) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut rest, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
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
        tracing::debug!("TLS tunnel, sending side: {e}");
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
            tracing::debug!("TLS tunnel, receiving side: {e}");
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
        while end - start >= HEADER {
            let h = &buf[start..start + HEADER];
            let body = u16::from_be_bytes([h[3], h[4]]) as usize;
            if h[0] != APPLICATION_DATA || h[1] != 3 || !(TAG + 1..=MAX_BODY).contains(&body) {
                return Err(proto(format!(
                    "malformed record header {:02x?}",
                    &buf[start..start + HEADER]
                )));
            }
            if end - start < HEADER + body {
                break;
            }
            let (kind, len) = rx.open(&mut buf[start..start + HEADER + body])?;
            let plain = start + HEADER;
            match kind {
                APPLICATION_DATA if len > 0 => parts.push((plain, len)),
                APPLICATION_DATA => {}
                ALERT if len == 2 && buf[plain + 1] == 0 => closed = true, // close_notify
                ALERT => return Err(proto(format!("the peer sent alert {}", buf[plain + 1]))),
                HANDSHAKE if len > 0 && buf[plain] == NEW_SESSION_TICKET => {}
                HANDSHAKE => return Err(proto("post-handshake messages are not supported")),
                k => return Err(proto(format!("unexpected record type {k}"))),
            }
            start += HEADER + body;
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
            Err(e) => return Err(e),
        }
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
    fn sequence_numbers_stop_at_the_key_limit() {
        let (mut tx, _) = pair();
        tx.seq = RECORD_LIMIT - 1;
        sealed(&mut tx, b"last", APPLICATION_DATA);
        let mut rec = vec![0u8; SLOT];
        assert!(tx.seal(&mut rec, 1).is_err(), "a key past its limit");
    }
}
