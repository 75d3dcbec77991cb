//! Fuzzes the TLS 1.3 record layer's receiving side (`kiln_tls::RecordReader`) with what a peer
//! may send after the handshake: records sealed with the connection's key (application data of
//! any size, alerts, handshake messages, any content type, padding, too short or too long,
//! sequence numbers at the key's limit), mixed with garbage, tampered records and a stream cut
//! anywhere, arriving in pieces of any size and read out into buffers of any size.
//!
//! The records are sealed here with aws-lc-rs directly (RFC 8446 §5.2-5.3), and a model of the
//! RFC says what the reader must make of them. Nothing panics; the plaintext delivered is
//! exactly the application data of the records before the first bad one (a prefix of it if
//! the stream ends in an error); `close_notify` ends the stream; a bad record is an error,
//! never data.
#![no_main]

use std::io::{self, Read};

use aws_lc_rs::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM};
use kiln_tls::RecordReader;
use libfuzzer_sys::fuzz_target;
use rustls::crypto::cipher::{AeadKey, Iv};
use rustls::ConnectionTrafficSecrets;

const HEADER: usize = 5;
const TAG: usize = 16;
/// The most a record body may hold (RFC 8446 §5.2: 2^14 plaintext + 256).
const MAX_BODY: usize = (1 << 14) + 256;
/// Records one AES-GCM key may protect (RFC 8446 §5.5, rounded down to a power of two).
const RECORD_LIMIT: u64 = 1 << 24;
const ALERT: u8 = 21;
const HANDSHAKE: u8 = 22;
const APPLICATION_DATA: u8 = 23;

/// The fuzzer's bytes, taken from the front; zeros once they run out.
struct Input<'a>(&'a [u8]);

impl Input<'_> {
    fn byte(&mut self) -> u8 {
        let Some((&b, rest)) = self.0.split_first() else {
            return 0;
        };
        self.0 = rest;
        b
    }
    fn u16(&mut self) -> u16 {
        u16::from_be_bytes([self.byte(), self.byte()])
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        let n = n.min(self.0.len());
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        a.to_vec()
    }
}

/// What the reader must make of one piece of the stream.
#[derive(Debug, Clone, PartialEq)]
enum Meaning {
    /// Application data (possibly empty): delivered.
    Data(Vec<u8>),
    /// A session ticket: dropped.
    Ignored,
    /// `close_notify`: the end of the stream.
    Close,
    /// A record the reader must refuse once it is complete.
    Bad,
    /// A record header the reader must refuse as soon as it has its 5 bytes.
    BadHeader,
    /// Garbage or a tampered record: an error, or (if its header claims more than follows)
    /// a wait for more; never data.
    Garbage,
}

/// How a stream ended, as the reader reports it.
#[derive(Debug, Clone, Copy, PartialEq)]
enum End {
    Closed,
    /// Waiting for more ciphertext.
    Pending,
    Error,
}

struct Sealer {
    key: LessSafeKey,
    iv: [u8; 12],
    seq: u64,
}

impl Sealer {
    /// Seals `inner` (the plaintext, content type and padding) under header fields `kind` and
    /// `version`, with the next sequence number.
    fn seal(&mut self, kind: u8, version: [u8; 2], inner: &[u8]) -> Vec<u8> {
        let len = (inner.len() + TAG) as u16;
        let [hi, lo] = len.to_be_bytes();
        let hdr = [kind, version[0], version[1], hi, lo];
        let mut nonce = self.iv;
        for (n, s) in nonce[4..].iter_mut().zip(self.seq.to_be_bytes()) {
            *n ^= s;
        }
        self.seq += 1;
        let mut body = inner.to_vec();
        self.key
            .seal_in_place_append_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(hdr),
                &mut body,
            )
            .expect("seal");
        let mut rec = hdr.to_vec();
        rec.extend_from_slice(&body);
        rec
    }
}

/// RFC 8446 §5.4: the content type is the last non-zero byte of the inner plaintext.
fn meaning(seq: u64, inner: &[u8]) -> Meaning {
    let body = inner.len() + TAG;
    if !(TAG + 1..=MAX_BODY).contains(&body) {
        return Meaning::BadHeader;
    }
    if seq >= RECORD_LIMIT {
        return Meaning::Bad;
    }
    let Some(at) = inner.iter().rposition(|&b| b != 0) else {
        return Meaning::Bad;
    };
    let plain = &inner[..at];
    match inner[at] {
        APPLICATION_DATA => Meaning::Data(plain.to_vec()),
        ALERT if plain == [1, 0] || plain == [2, 0] => Meaning::Close,
        HANDSHAKE if plain.first() == Some(&4) => Meaning::Ignored,
        _ => Meaning::Bad,
    }
}

/// The peer's socket: the stream in pieces of the given sizes, in turn; `WouldBlock` at its end.
struct Pieces<'a> {
    data: &'a [u8],
    sizes: Vec<usize>,
    next: usize,
}

impl Read for Pieces<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.data.is_empty() {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        let size = self.sizes[self.next % self.sizes.len()];
        self.next += 1;
        let n = size.min(buf.len()).min(self.data.len());
        buf[..n].copy_from_slice(&self.data[..n]);
        self.data = &self.data[n..];
        Ok(n)
    }
}

fuzz_target!(|data: &[u8]| {
    let mut u = Input(data);
    let flags = u.byte();
    // The first sequence number: small, or just below the key's limit.
    let seq = if flags & 1 != 0 {
        RECORD_LIMIT - 1 - u64::from(u.byte() % 4)
    } else {
        u64::from(u.u16())
    };
    let key: [u8; 32] = std::array::from_fn(|i| (i as u8).wrapping_mul(flags | 1));
    let iv: [u8; 12] = std::array::from_fn(|_| u.byte());
    let cut = if flags & 2 != 0 {
        1 + usize::from(u.u16() % 4096)
    } else {
        0
    };
    let sizes: Vec<usize> = (0..3)
        .map(|_| match u.byte() {
            b if b & 0x80 != 0 => 1 + usize::from(b & 0x7f) * 997,
            b => 1 + usize::from(b % 32),
        })
        .collect();
    let out_sizes: Vec<usize> = (0..3).map(|_| 1 + usize::from(u.u16() % 20000)).collect();

    let mut sealer = Sealer {
        key: LessSafeKey::new(UnboundKey::new(&AES_256_GCM, &key).unwrap()),
        iv,
        seq,
    };
    let mut wire = Vec::new();
    let mut pieces: Vec<(usize, Meaning)> = Vec::new(); // (end in the wire, meaning)
    while !u.0.is_empty() && pieces.len() < 64 {
        let op = u.byte();
        let s = sealer.seq;
        let piece = match op % 8 {
            0 => {
                let n = usize::from(u.byte());
                wire.extend(u.bytes(n));
                Meaning::Garbage
            }
            1 => {
                let n = usize::from(u.byte());
                let mut rec = sealer.seal(APPLICATION_DATA, [3, 3], &[b'x'; 300][..n.max(1)]);
                let at = usize::from(u.u16()) % rec.len();
                rec[at] ^= u.byte() | 1;
                wire.extend(rec);
                Meaning::Garbage
            }
            2..=4 => {
                // Application data: of any length up to a little past the limit, padded.
                let n = usize::from(u.u16()) % (MAX_BODY + 64);
                let pad = if op & 0x80 != 0 {
                    usize::from(u.byte())
                } else {
                    0
                };
                let mut inner: Vec<u8> = (0..n).map(|i| (i as u64 ^ s) as u8).collect();
                inner.push(APPLICATION_DATA);
                inner.resize(inner.len() + pad, 0);
                wire.extend(sealer.seal(APPLICATION_DATA, [3, 3], &inner));
                meaning(s, &inner)
            }
            5 => {
                // An alert or a handshake message (mostly close_notify and session tickets,
                // which the fuzzer would rarely spell out), padded.
                let kind = if op & 0x80 != 0 { ALERT } else { HANDSHAKE };
                let form = u.byte();
                let mut inner = match (form % 4, kind) {
                    (0, ALERT) => vec![1 + (form >> 7), 0],
                    (0, _) => [vec![4], u.bytes(usize::from(form >> 4))].concat(),
                    _ => u.bytes(usize::from(form >> 5)),
                };
                inner.push(kind);
                inner.resize(inner.len() + usize::from(u.byte() % 4), 0);
                wire.extend(sealer.seal(APPLICATION_DATA, [3, 3], &inner));
                meaning(s, &inner)
            }
            6 => {
                // Any inner plaintext at all: no content type, odd types, empty.
                let n = usize::from(u.byte());
                let inner = u.bytes(n);
                wire.extend(sealer.seal(APPLICATION_DATA, [3, 3], &inner));
                meaning(s, &inner)
            }
            _ => {
                // A properly sealed record under a header that is not TLS 1.3 application data.
                let kind = u.byte();
                let version = [u.byte(), 3];
                let version = if op & 0x80 != 0 {
                    [version[1], version[0]]
                } else {
                    version
                };
                let inner = [b'h', b'i', APPLICATION_DATA];
                wire.extend(sealer.seal(kind, version, &inner));
                match meaning(s, &inner) {
                    m if kind == APPLICATION_DATA && version[0] == 3 => m,
                    _ => Meaning::BadHeader,
                }
            }
        };
        pieces.push((wire.len(), piece));
    }
    if cut > 0 {
        wire.truncate(wire.len().saturating_sub(cut));
    }

    // What the reader must deliver, and how the stream must end.
    let mut want = Vec::new();
    let mut end = End::Pending;
    let mut garbage = false;
    let mut from = 0;
    for (to, m) in pieces {
        let (start, to) = (from, to);
        from = to;
        if start == to {
            continue; // no bytes (garbage of length 0)
        }
        let whole = to <= wire.len();
        let header = start + HEADER <= wire.len();
        match m {
            _ if !header && m != Meaning::Garbage => break,
            Meaning::BadHeader => {
                end = End::Error;
                break;
            }
            Meaning::Garbage => {
                garbage = true;
                break;
            }
            _ if !whole => break,
            Meaning::Data(d) => want.extend(d),
            Meaning::Ignored => {}
            Meaning::Close => {
                end = End::Closed;
                break;
            }
            Meaning::Bad => {
                end = End::Error;
                break;
            }
        }
    }

    let secrets = ConnectionTrafficSecrets::Aes256Gcm {
        key: AeadKey::from(key),
        iv: Iv::from(iv),
    };
    let mut reader = RecordReader::from_secrets(seq, secrets).unwrap();
    let mut src = Pieces {
        data: &wire,
        sizes,
        next: 0,
    };
    let mut got = Vec::new();
    let mut out = vec![0u8; 20000];
    let mut k = 0;
    let got_end = loop {
        let n = out_sizes[k % out_sizes.len()];
        k += 1;
        match reader.read_from(&mut src, &mut out[..n]) {
            Ok(0) => break End::Closed,
            Ok(n) => got.extend_from_slice(&out[..n]),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break End::Pending,
            Err(e) => {
                assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{e}");
                break End::Error;
            }
        }
    };
    if garbage {
        assert_ne!(got_end, End::Closed, "garbage closed the stream");
    } else {
        assert_eq!(got_end, end, "the stream ended otherwise than it must");
    }
    if got_end == End::Error {
        // Plaintext opened in the same read as the bad record is dropped with the connection.
        assert!(
            got.len() <= want.len() && got == want[..got.len()],
            "data differs"
        );
    } else {
        assert!(
            got == want,
            "data differs: got {} bytes, want {}",
            got.len(),
            want.len()
        );
    }
});
