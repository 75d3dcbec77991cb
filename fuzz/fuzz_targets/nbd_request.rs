//! Fuzzes what an NBD client sends in the transmission phase: a byte stream of 28-byte request
//! headers (any magic, flags, command, offset, length) and WRITE payloads, arriving in pieces
//! of any size. It goes through kiln-nbd's socket reader and is framed the way the server
//! frames it (header, then the payload read or, for a refused WRITE, skipped); every header
//! goes through the decoder and the server's checks. Nothing panics; a decoded header
//! re-encodes to the same bytes; what the checks accept is within the protocol's and the
//! export's bounds; the in-flight cost never exceeds the budget; and every byte the reader
//! hands out is the byte at that place in the stream.
#![no_main]

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use kiln_nbd::proto::{cflag, cmd, err, Request, MAX_BLOCK, REQUEST_LEN, REQUEST_MAGIC};
use kiln_nbd::reader::Reader;
use kiln_nbd::transmission::{check_request, cost, IN_FLIGHT_BYTES, PERMIT_UNIT};
use libfuzzer_sys::fuzz_target;
use tokio::io::{AsyncRead, ReadBuf};

/// The client's socket: the stream, handed out in pieces of the given sizes, in turn.
struct Pieces<'a> {
    data: &'a [u8],
    sizes: Vec<usize>,
    next: usize,
}

impl AsyncRead for Pieces<'_> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let size = self.sizes[self.next % self.sizes.len()];
        self.next += 1;
        let n = size.min(buf.remaining()).min(self.data.len());
        buf.put_slice(&self.data[..n]);
        self.data = &self.data[n..];
        Poll::Ready(Ok(()))
    }
}

/// Runs a future that never has to wait (the socket above is always ready).
fn now<F: Future>(f: F) -> F::Output {
    let mut f = std::pin::pin!(f);
    match f.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(v) => v,
        Poll::Pending => panic!("the reader waited on a socket that is always ready"),
    }
}

/// What `check_request` accepts must be something the server can safely carry out.
fn check_invariants(req: &Request, size: u64, structured: bool, read_only: bool) {
    let budget = (IN_FLIGHT_BYTES / PERMIT_UNIT) as u32;
    let c = cost(req);
    assert!((1..=budget).contains(&c), "cost {c} of {req:?}");
    match check_request(req, size, structured, read_only) {
        Ok(()) => {
            let allowed = match req.cmd {
                cmd::READ if structured => cflag::FUA | cflag::DF,
                cmd::READ | cmd::WRITE | cmd::FLUSH | cmd::TRIM => cflag::FUA,
                cmd::WRITE_ZEROES => cflag::FUA | cflag::NO_HOLE | cflag::FAST_ZERO,
                cmd::BLOCK_STATUS if structured => cflag::REQ_ONE,
                c => panic!("accepted command {c}"),
            };
            assert_eq!(req.flags & !allowed, 0, "accepted flags of {req:?}");
            let writes = matches!(req.cmd, cmd::WRITE | cmd::TRIM | cmd::WRITE_ZEROES);
            assert!(
                !(writes && read_only),
                "accepted a write to a read-only export"
            );
            if matches!(req.cmd, cmd::READ | cmd::WRITE) {
                assert!(req.len <= MAX_BLOCK, "accepted {} bytes", req.len);
            }
            if req.cmd != cmd::FLUSH {
                let end = req.offset.checked_add(u64::from(req.len));
                assert!(
                    end.is_some_and(|e| e <= size),
                    "accepted {req:?} on {size} bytes"
                );
            }
        }
        Err((e, msg)) => {
            assert!(
                [err::EINVAL, err::EPERM, err::ENOSPC].contains(&e),
                "error {e}"
            );
            assert!(!msg.is_empty());
        }
    }
}

fuzz_target!(|data: &[u8]| {
    if data.len() < 12 {
        return;
    }
    let (head, stream) = data.split_at(12);
    // The export: a size that is sometimes tiny, sometimes near the end of the u64 range.
    let size = u64::from_be_bytes(head[..8].try_into().unwrap());
    let size = if head[8] & 1 == 0 {
        size >> (head[8] >> 2)
    } else {
        size
    };
    let structured = head[8] & 2 != 0;
    let read_only = head[9] & 1 != 0;
    // Stream pieces of 1 to 64 bytes, or of up to 64 KiB.
    let sizes: Vec<usize> = head[10..12]
        .iter()
        .map(|&b| {
            if b & 0x80 != 0 {
                1 + (b as usize & 0x7f) * 512
            } else {
                1 + b as usize % 64
            }
        })
        .collect();
    let (raw, stream) = match stream.split_first() {
        Some((&0xff, rest)) => (true, rest),
        _ => (false, stream),
    };
    // Repeated up to 128 times, so that streams outgrow the reader's 64 KiB buffer.
    let mut stream = stream.repeat(1 + usize::from(head[9] >> 1));
    // A valid magic at each header is what the fuzzer would rarely guess: put it there unless
    // the stream says otherwise (a first byte of 0xff keeps the stream as it is).
    let mut at = 0;
    while !raw && at + REQUEST_LEN <= stream.len() {
        stream[at..at + 4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        let h: &[u8; REQUEST_LEN] = stream[at..at + REQUEST_LEN].try_into().unwrap();
        let req = Request::parse(h).expect("magic set");
        at += REQUEST_LEN;
        if req.cmd == cmd::WRITE {
            at = at.saturating_add(req.len as usize);
        }
    }
    let stream = &stream[..];

    let src = Pieces {
        data: stream,
        sizes,
        next: 0,
    };
    let mut rd = Reader::new(src);
    let mut pos = 0usize; // where in the stream the reader must be
    let mut payload_bytes = 0u64;
    loop {
        if rd.buffered().len() < REQUEST_LEN {
            match now(rd.fill_to(REQUEST_LEN)) {
                Ok(true) => {}
                Ok(false) => {
                    assert_eq!(pos, stream.len(), "clean end in the middle of the stream");
                    break;
                }
                Err(e) => {
                    assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
                    assert!(stream.len() - pos < REQUEST_LEN, "EOF with a header left");
                    break;
                }
            }
        }
        let hdr: [u8; REQUEST_LEN] = rd.buffered()[..REQUEST_LEN].try_into().unwrap();
        assert_eq!(
            hdr,
            stream[pos..pos + REQUEST_LEN],
            "the reader's bytes are not the stream's"
        );
        let Some(req) = Request::parse(&hdr) else {
            assert_ne!(hdr[..4], REQUEST_MAGIC.to_be_bytes(), "good magic refused");
            break;
        };
        assert_eq!(req.encode(), hdr, "re-encoding differs");
        rd.consume(REQUEST_LEN);
        pos += REQUEST_LEN;
        if req.cmd == cmd::DISC {
            break;
        }
        check_invariants(&req, size, structured, read_only);
        if req.cmd != cmd::WRITE {
            continue;
        }
        let len = req.len as usize;
        let left = stream.len() - pos;
        if check_request(&req, size, structured, read_only).is_err() {
            // Refused: the payload is skipped so the stream stays in step.
            match now(rd.skip(u64::from(req.len))) {
                Ok(()) => pos += len,
                Err(_) => {
                    assert!(left < len, "skip failed with the payload there");
                    break;
                }
            }
        } else if rd.buffered().len() >= len && hdr[8] & 1 != 0 {
            // The server's fast path: the whole payload came with the header.
            assert_eq!(&rd.buffered()[..len], &stream[pos..pos + len]);
            rd.consume(len);
            pos += len;
        } else {
            let mut payload = vec![0u8; len];
            payload_bytes += len as u64;
            match now(rd.read_exact_into(&mut payload)) {
                Ok(()) => {
                    assert_eq!(payload, &stream[pos..pos + len], "payload differs");
                    pos += len;
                }
                Err(_) => {
                    assert!(left < len, "read failed with the payload there");
                    break;
                }
            }
        }
    }
    assert!(
        rd.copied <= payload_bytes,
        "copied {} of {payload_bytes} payload bytes",
        rd.copied
    );
});
