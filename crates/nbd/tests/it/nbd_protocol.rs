//! The NBD protocol at the byte level, with a raw socket client written here: option haggling
//! (unknown options, LIST, INFO, GO, EXPORT_NAME, ABORT), simple and structured replies, errors
//! for bad requests with the connection still usable afterwards, pipelining with out-of-order
//! replies, requests split across Kiln's payload limit, read-only exports, several connections,
//! malformed handshakes, DISC, start-up errors and shutdown.

use crate::common;

use kiln_proto::Kind;
use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use common::{
    create_image, start_brick, start_export, try_start_export, try_start_named_export, Running,
};
use kiln_nbd::proto::{self, cflag, chunk, cmd, err, info, opt, rep, tflag, Request};

const MIB: u64 = 1 << 20;
const SIZE: u64 = 64 * MIB;

struct Nbd {
    s: UnixStream,
    structured: bool,
}

fn be32(b: &[u8]) -> u32 {
    proto::be32(b)
}

impl Nbd {
    /// Connects and reads the greeting; sends `client_flags`.
    fn connect_with(sock: &Path, client_flags: u32) -> Nbd {
        let mut s = UnixStream::connect(sock).expect("connect to export");
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let mut g = [0u8; 18];
        s.read_exact(&mut g).expect("greeting");
        assert_eq!(proto::be64(&g[0..8]), proto::NBDMAGIC);
        assert_eq!(proto::be64(&g[8..16]), proto::IHAVEOPT);
        let hflags = u16::from_be_bytes([g[16], g[17]]);
        assert_eq!(hflags, proto::FLAG_FIXED_NEWSTYLE | proto::FLAG_NO_ZEROES);
        s.write_all(&client_flags.to_be_bytes()).unwrap();
        Nbd {
            s,
            structured: false,
        }
    }

    fn connect(sock: &Path) -> Nbd {
        Nbd::connect_with(sock, proto::CLIENT_FIXED_NEWSTYLE | proto::CLIENT_NO_ZEROES)
    }

    fn send_opt(&mut self, option: u32, data: &[u8]) {
        let mut b = proto::IHAVEOPT.to_be_bytes().to_vec();
        b.extend_from_slice(&option.to_be_bytes());
        b.extend_from_slice(&(data.len() as u32).to_be_bytes());
        b.extend_from_slice(data);
        self.s.write_all(&b).unwrap();
    }

    /// One option reply: (option, type, data).
    fn opt_reply(&mut self) -> (u32, u32, Vec<u8>) {
        let mut h = [0u8; 20];
        self.s.read_exact(&mut h).expect("option reply");
        assert_eq!(proto::be64(&h), proto::OPT_REPLY_MAGIC);
        let mut d = vec![0u8; be32(&h[16..]) as usize];
        self.s.read_exact(&mut d).unwrap();
        (be32(&h[8..]), be32(&h[12..]), d)
    }

    fn info_data(name: &str, reqs: &[u16]) -> Vec<u8> {
        let mut d = (name.len() as u32).to_be_bytes().to_vec();
        d.extend_from_slice(name.as_bytes());
        d.extend_from_slice(&(reqs.len() as u16).to_be_bytes());
        for r in reqs {
            d.extend_from_slice(&r.to_be_bytes());
        }
        d
    }

    /// INFO or GO; returns the replies up to and including the final one.
    fn info(&mut self, option: u32, name: &str, reqs: &[u16]) -> Vec<(u32, Vec<u8>)> {
        self.send_opt(option, &Nbd::info_data(name, reqs));
        let mut out = Vec::new();
        loop {
            let (o, t, d) = self.opt_reply();
            assert_eq!(o, option);
            out.push((t, d));
            if t != rep::INFO {
                return out;
            }
        }
    }

    fn structured_reply(&mut self) {
        self.send_opt(opt::STRUCTURED_REPLY, &[]);
        let (o, t, _) = self.opt_reply();
        assert_eq!((o, t), (opt::STRUCTURED_REPLY, rep::ACK));
        self.structured = true;
    }

    /// GO on `name`; returns (size, transmission flags).
    fn go(&mut self, name: &str) -> (u64, u16) {
        let replies = self.info(opt::GO, name, &[info::BLOCK_SIZE]);
        assert_eq!(
            replies.last().unwrap().0,
            rep::ACK,
            "GO failed: {replies:?}"
        );
        let e = replies
            .iter()
            .find(|(t, d)| *t == rep::INFO && d[..2] == [0, 0])
            .expect("NBD_INFO_EXPORT");
        (
            proto::be64(&e.1[2..10]),
            u16::from_be_bytes([e.1[10], e.1[11]]),
        )
    }

    fn request(&mut self, flags: u16, c: u16, handle: u64, offset: u64, len: u32, payload: &[u8]) {
        let mut b = Request {
            flags,
            cmd: c,
            handle,
            offset,
            len,
        }
        .encode()
        .to_vec();
        b.extend_from_slice(payload);
        self.s.write_all(&b).unwrap();
    }

    /// Any reply. Structured: (handle, error, data) from the chunks up to DONE.
    fn reply(&mut self, read_len: Option<usize>) -> (u64, u32, Vec<u8>) {
        let mut magic = [0u8; 4];
        self.s.read_exact(&mut magic).expect("reply");
        if be32(&magic) == proto::SIMPLE_REPLY_MAGIC {
            let mut h = [0u8; 12];
            self.s.read_exact(&mut h).unwrap();
            let (e, handle) = (be32(&h), proto::be64(&h[4..]));
            let mut data = Vec::new();
            if e == 0 {
                if let Some(n) = read_len {
                    data = vec![0u8; n];
                    self.s.read_exact(&mut data).unwrap();
                }
            }
            return (handle, e, data);
        }
        assert_eq!(be32(&magic), proto::STRUCTURED_REPLY_MAGIC);
        let mut data = Vec::new();
        let mut error = 0;
        let mut first = true;
        loop {
            if !first {
                self.s.read_exact(&mut magic).unwrap();
                assert_eq!(be32(&magic), proto::STRUCTURED_REPLY_MAGIC);
            }
            first = false;
            let mut h = [0u8; 16];
            self.s.read_exact(&mut h).unwrap();
            let flags = u16::from_be_bytes([h[0], h[1]]);
            let kind = u16::from_be_bytes([h[2], h[3]]);
            let handle = proto::be64(&h[4..]);
            let mut p = vec![0u8; be32(&h[12..]) as usize];
            self.s.read_exact(&mut p).unwrap();
            match kind {
                chunk::OFFSET_DATA => data.extend_from_slice(&p[8..]),
                chunk::ERROR => {
                    error = be32(&p);
                    let ml = u16::from_be_bytes([p[4], p[5]]) as usize;
                    assert!(ml > 0, "error chunks carry a message");
                    eprintln!("error chunk: {}", String::from_utf8_lossy(&p[6..6 + ml]));
                }
                chunk::NONE => assert!(p.is_empty()),
                k => panic!("unexpected chunk type {k}"),
            }
            if flags & chunk::FLAG_DONE != 0 {
                return (handle, error, data);
            }
        }
    }

    fn read(&mut self, handle: u64, offset: u64, len: u32) -> (u32, Vec<u8>) {
        self.request(0, cmd::READ, handle, offset, len, &[]);
        let (h, e, d) = self.reply(Some(len as usize));
        assert_eq!(h, handle);
        (e, d)
    }

    fn write(&mut self, flags: u16, handle: u64, offset: u64, data: &[u8]) -> u32 {
        self.request(flags, cmd::WRITE, handle, offset, data.len() as u32, data);
        let (h, e, _) = self.reply(None);
        assert_eq!(h, handle);
        e
    }

    fn simple_cmd(&mut self, flags: u16, c: u16, handle: u64, offset: u64, len: u32) -> u32 {
        self.request(flags, c, handle, offset, len, &[]);
        let (h, e, _) = self.reply(None);
        assert_eq!(h, handle);
        e
    }

    /// True if the server closed the connection (end of stream or reset).
    fn closed(&mut self) -> bool {
        let mut b = [0u8; 1];
        matches!(self.s.read(&mut b), Ok(0) | Err(_))
    }
}

fn setup(dir: &Path, read_only: bool) -> Running {
    let (_brick, bsock) = start_brick(dir);
    create_image(&bsock, "disk.img", SIZE);
    start_export(
        &format!("unix:{}:/vol/disk.img", bsock.display()),
        &dir.join("nbd.sock"),
        read_only,
    )
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 12) as u8)
        .collect()
}

#[test]
fn option_haggling() {
    let dir = tempfile::tempdir().unwrap();
    let exp = setup(dir.path(), false);
    let mut c = Nbd::connect(&exp.sock);

    // Unknown options and TLS: refused, and haggling goes on.
    c.send_opt(0x4242, b"hello");
    let (o, t, msg) = c.opt_reply();
    assert_eq!((o, t), (0x4242, rep::ERR_UNSUP));
    assert!(!msg.is_empty());
    c.send_opt(opt::STARTTLS, &[]);
    assert_eq!(c.opt_reply().1, rep::ERR_UNSUP);

    // LIST: one export, then ACK; with data: invalid.
    c.send_opt(opt::LIST, &[]);
    let (_, t, d) = c.opt_reply();
    assert_eq!(t, rep::SERVER);
    let n = be32(&d) as usize;
    assert_eq!(&d[4..4 + n], b"disk.img");
    assert!(String::from_utf8_lossy(&d[4 + n..]).contains("volume vol"));
    assert_eq!(c.opt_reply().1, rep::ACK);
    c.send_opt(opt::LIST, b"x");
    assert_eq!(c.opt_reply().1, rep::ERR_INVALID);

    // INFO: unknown name, malformed data, then the real thing with every item.
    let r = c.info(opt::INFO, "nope.img", &[]);
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].0, rep::ERR_UNKNOWN);
    assert!(String::from_utf8_lossy(&r[0].1).contains("disk.img"));
    c.send_opt(opt::INFO, &[0, 0, 0, 200, 0]);
    assert_eq!(c.opt_reply().1, rep::ERR_INVALID);
    let r = c.info(
        opt::INFO,
        "disk.img",
        &[info::NAME, info::DESCRIPTION, info::BLOCK_SIZE],
    );
    assert_eq!(r.last().unwrap().0, rep::ACK);
    let mut seen = HashMap::new();
    for (t, d) in &r[..r.len() - 1] {
        assert_eq!(*t, rep::INFO);
        seen.insert(u16::from_be_bytes([d[0], d[1]]), d[2..].to_vec());
    }
    let e = &seen[&info::EXPORT];
    assert_eq!(proto::be64(e), SIZE);
    let flags = u16::from_be_bytes([e[8], e[9]]);
    for f in [
        tflag::HAS_FLAGS,
        tflag::SEND_FLUSH,
        tflag::SEND_FUA,
        tflag::SEND_TRIM,
        tflag::SEND_WRITE_ZEROES,
        tflag::CAN_MULTI_CONN,
    ] {
        assert_ne!(flags & f, 0, "flag {f:#x} missing from {flags:#x}");
    }
    assert_eq!(flags & tflag::READ_ONLY, 0);
    let bs = &seen[&info::BLOCK_SIZE];
    assert_eq!(
        (be32(bs), be32(&bs[4..]), be32(&bs[8..])),
        (1, 4096, 32 << 20)
    );
    assert_eq!(seen[&info::NAME], b"disk.img");
    assert!(String::from_utf8_lossy(&seen[&info::DESCRIPTION]).contains("Kiln image disk.img"));

    // STRUCTURED_REPLY with data is invalid; ABORT gets an ACK and the server closes.
    c.send_opt(opt::STRUCTURED_REPLY, b"x");
    assert_eq!(c.opt_reply().1, rep::ERR_INVALID);
    c.send_opt(opt::ABORT, &[]);
    assert_eq!(c.opt_reply().1, rep::ACK);
    assert!(c.closed());

    // GO with the default (empty) name and with a leading slash both reach the export.
    let mut c = Nbd::connect(&exp.sock);
    assert_eq!(c.go("").0, SIZE);
    assert_eq!(c.read(1, 0, 512).0, 0);
    let mut c = Nbd::connect(&exp.sock);
    assert_eq!(c.go("/disk.img").0, SIZE);
    c.request(0, cmd::DISC, 2, 0, 0, &[]);
    assert!(c.closed());
}

#[test]
fn simple_replies_and_errors_keep_the_connection_usable() {
    let dir = tempfile::tempdir().unwrap();
    let exp = setup(dir.path(), false);
    let mut c = Nbd::connect(&exp.sock);
    let (size, flags) = c.go("disk.img");
    assert_eq!(size, SIZE);
    assert_eq!(flags & tflag::SEND_DF, 0, "DF without structured replies");

    let data = pattern(8192, 1);
    assert_eq!(c.write(cflag::FUA, 1, 4096, &data), 0);
    assert_eq!(c.read(2, 4096, 8192), (0, data.clone()));

    // Reads beyond the end: EINVAL and no payload; the next request works.
    assert_eq!(c.read(3, SIZE - 512, 1024), (err::EINVAL, vec![]));
    assert_eq!(c.read(4, u64::MAX - 10, 100), (err::EINVAL, vec![]));
    assert_eq!(c.read(5, SIZE - 512, 512).0, 0);
    // Too large: EINVAL.
    assert_eq!(c.read(6, 0, (32 << 20) + 1), (err::EINVAL, vec![]));
    // A write beyond the end: ENOSPC, its payload skipped; a too-large one: EINVAL, skipped.
    assert_eq!(c.write(0, 7, SIZE - 100, &[1u8; 200]), err::ENOSPC);
    assert_eq!(c.write(0, 8, 0, &vec![2u8; (32 << 20) + 4096]), err::EINVAL);
    assert_eq!(c.read(9, 4096, 8192), (0, data.clone()));
    // Unknown command and unknown flags: EINVAL.
    assert_eq!(c.simple_cmd(0, 42, 10, 0, 0), err::EINVAL);
    assert_eq!(c.simple_cmd(1 << 9, cmd::READ, 11, 0, 0), err::EINVAL);
    assert_eq!(c.simple_cmd(cflag::DF, cmd::READ, 12, 0, 0), err::EINVAL);

    assert_eq!(c.simple_cmd(0, cmd::FLUSH, 13, 0, 0), 0);
    assert_eq!(c.simple_cmd(0, cmd::TRIM, 14, 4096, 4096), 0);
    assert_eq!(c.read(15, 4096, 4096), (0, vec![0u8; 4096]));
    assert_eq!(c.read(16, 8192, 4096), (0, data[4096..].to_vec()));
    assert_eq!(
        c.simple_cmd(
            cflag::NO_HOLE | cflag::FUA,
            cmd::WRITE_ZEROES,
            17,
            8192 + 100,
            1000
        ),
        0
    );
    let mut want = data[4096..].to_vec();
    want[100..1100].fill(0);
    assert_eq!(c.read(18, 8192, 4096), (0, want));
    assert_eq!(
        c.simple_cmd(0, cmd::WRITE_ZEROES, 19, SIZE - 10, 20),
        err::ENOSPC
    );
    assert_eq!(c.read(20, 0, 0), (0, vec![]));

    c.request(0, cmd::DISC, 21, 0, 0, &[]);
    assert!(c.closed());
}

#[test]
fn structured_replies_pipelined_out_of_order_and_split() {
    let dir = tempfile::tempdir().unwrap();
    let exp = setup(dir.path(), false);
    let mut c = Nbd::connect(&exp.sock);
    c.structured_reply();
    let (_, flags) = c.go("disk.img");
    assert_ne!(flags & tflag::SEND_DF, 0);

    // 32 MiB, the maximum, written and read in one request each (two Kiln requests apiece).
    let big = pattern(32 << 20, 7);
    assert_eq!(c.write(0, 1, 16 << 20, &big), 0);
    let (e, got) = c.read(2, 16 << 20, 32 << 20);
    assert_eq!(e, 0);
    assert!(got == big, "32 MiB read back differs");

    // 200 requests in flight: writes of 4 KiB blocks, each followed by a read of an earlier one.
    let mut expect: HashMap<u64, Option<Vec<u8>>> = HashMap::new();
    let mut batch = Vec::new();
    for i in 0..100u64 {
        let d = pattern(4096, i as u8);
        let mut r = Request {
            flags: 0,
            cmd: cmd::WRITE,
            handle: 1000 + i,
            offset: i * 4096,
            len: 4096,
        }
        .encode()
        .to_vec();
        r.extend_from_slice(&d);
        batch.extend_from_slice(&r);
        expect.insert(1000 + i, None);
        // Reads of the 32 MiB region, which no write in flight touches.
        let off = (16 << 20) + i * 65536;
        batch.extend_from_slice(
            &Request {
                flags: cflag::DF,
                cmd: cmd::READ,
                handle: 5000 + i,
                offset: off,
                len: 65536,
            }
            .encode(),
        );
        let s = (i * 65536) as usize;
        expect.insert(5000 + i, Some(big[s..s + 65536].to_vec()));
    }
    // A read beyond the end in the middle of it all: an error chunk, nothing else disturbed.
    batch.extend_from_slice(
        &Request {
            flags: 0,
            cmd: cmd::READ,
            handle: 9999,
            offset: SIZE,
            len: 4096,
        }
        .encode(),
    );
    c.s.write_all(&batch).unwrap();
    let mut order = Vec::new();
    for _ in 0..201 {
        let (h, e, d) = c.reply(None);
        order.push(h);
        if h == 9999 {
            assert_eq!(e, err::EINVAL);
            continue;
        }
        assert_eq!(e, 0, "handle {h}");
        match expect
            .remove(&h)
            .unwrap_or_else(|| panic!("unexpected handle {h}"))
        {
            Some(want) => assert!(d == want, "read {h} differs"),
            None => assert!(d.is_empty()),
        }
    }
    assert!(expect.is_empty());
    eprintln!("reply order starts {:?}", &order[..10]);
    for i in 0..100u64 {
        assert_eq!(
            c.read(20_000 + i, i * 4096, 4096),
            (0, pattern(4096, i as u8))
        );
    }
    // A zero-length read is a lone NONE chunk.
    assert_eq!(c.read(3, 0, 0), (0, vec![]));

    // A second connection sees the first one's flushed writes (CAN_MULTI_CONN).
    let mut c2 = Nbd::connect(&exp.sock);
    c2.go("disk.img");
    let fresh = pattern(4096, 99);
    assert_eq!(c.write(cflag::FUA, 4, SIZE - 4096, &fresh), 0);
    assert_eq!(c.simple_cmd(0, cmd::FLUSH, 5, 0, 0), 0);
    assert_eq!(c2.read(1, SIZE - 4096, 4096), (0, fresh));

    c.request(0, cmd::DISC, 6, 0, 0, &[]);
    assert!(c.closed());
    c2.request(0, cmd::DISC, 2, 0, 0, &[]);
    assert!(c2.closed());
}

#[test]
fn read_only_export_refuses_writes() {
    let dir = tempfile::tempdir().unwrap();
    let exp = setup(dir.path(), true);
    let mut c = Nbd::connect(&exp.sock);
    c.structured_reply();
    let (_, flags) = c.go("disk.img");
    assert_ne!(flags & tflag::READ_ONLY, 0);
    assert_eq!(c.write(0, 1, 0, &[1u8; 4096]), err::EPERM);
    assert_eq!(c.simple_cmd(0, cmd::TRIM, 2, 0, 4096), err::EPERM);
    assert_eq!(c.simple_cmd(0, cmd::WRITE_ZEROES, 3, 0, 4096), err::EPERM);
    assert_eq!(c.read(4, 0, 4096), (0, vec![0u8; 4096]));
    assert_eq!(c.simple_cmd(0, cmd::FLUSH, 5, 0, 0), 0);
}

/// The image shrinks under the export (its size was fixed at connect): the part of a read past
/// the new end reads as zeros, never as what the export's memory held before.
#[test]
fn a_read_past_a_shrunk_end_reads_zeros() {
    let dir = tempfile::tempdir().unwrap();
    let exp = setup(dir.path(), false);
    let mut c = Nbd::connect(&exp.sock);
    c.go("disk.img");
    const LEN: u32 = 128 << 10;
    let at = SIZE - LEN as u64;
    let data = pattern(LEN as usize, 9);
    assert_eq!(c.write(cflag::FUA, 1, at, &data), 0);
    // Reads that leave buffers full of the pattern behind in the export's memory.
    for h in 2..10 {
        assert_eq!(c.read(h, at, LEN), (0, data.clone()));
    }
    let half = LEN as usize / 2;
    std::fs::OpenOptions::new()
        .write(true)
        .open(dir.path().join("brick/disk.img"))
        .unwrap()
        .set_len(SIZE - half as u64)
        .unwrap();
    for h in 10..14 {
        let (e, got) = c.read(h, at, LEN);
        assert_eq!(e, 0);
        assert_eq!(got[..half], data[..half], "before the new end");
        assert!(
            got[half..].iter().all(|&b| b == 0),
            "zeros past the new end"
        );
    }
}

#[test]
fn old_style_export_name_and_broken_handshakes() {
    let dir = tempfile::tempdir().unwrap();
    let exp = setup(dir.path(), false);

    // NBD_OPT_EXPORT_NAME, with and without the 124 zero bytes.
    for (cflags, tail) in [
        (proto::CLIENT_FIXED_NEWSTYLE | proto::CLIENT_NO_ZEROES, 0),
        (proto::CLIENT_FIXED_NEWSTYLE, 124),
    ] {
        let mut c = Nbd::connect_with(&exp.sock, cflags);
        c.send_opt(opt::EXPORT_NAME, b"disk.img");
        let mut b = vec![0u8; 10 + tail];
        c.s.read_exact(&mut b).unwrap();
        assert_eq!(proto::be64(&b), SIZE);
        assert!(b[10..].iter().all(|&x| x == 0));
        assert_eq!(c.read(1, 0, 4096), (0, vec![0u8; 4096]));
        c.s.set_read_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        let mut extra = [0u8; 1];
        assert!(
            c.s.read(&mut extra).is_err(),
            "nothing more after the reply"
        );
    }

    // A client that keeps a healthy session while others misbehave.
    let mut good = Nbd::connect(&exp.sock);
    good.go("disk.img");

    // Unknown client flags, bad option magic, an unknown name with EXPORT_NAME, bad request
    // magic: each closes that client only.
    let mut c = Nbd::connect_with(&exp.sock, 1 << 7);
    assert!(c.closed());
    let mut c = Nbd::connect(&exp.sock);
    c.s.write_all(&[0u8; 16]).unwrap();
    assert!(c.closed());
    let mut c = Nbd::connect(&exp.sock);
    c.send_opt(opt::EXPORT_NAME, b"other.img");
    assert!(c.closed());
    let mut c = Nbd::connect(&exp.sock);
    c.go("disk.img");
    c.s.write_all(&[0xffu8; 28]).unwrap();
    assert!(c.closed());
    // A client that vanishes mid-request.
    let mut c = Nbd::connect(&exp.sock);
    c.go("disk.img");
    c.s.write_all(
        &Request {
            flags: 0,
            cmd: cmd::WRITE,
            handle: 1,
            offset: 0,
            len: 1 << 20,
        }
        .encode(),
    )
    .unwrap();
    c.s.write_all(&[1u8; 1000]).unwrap();
    drop(c);

    assert_eq!(good.read(7, 0, 512).0, 0);
    good.request(0, cmd::DISC, 8, 0, 0, &[]);
    assert!(good.closed());
}

#[test]
fn startup_errors_are_clear_and_shutdown_is_clean() {
    let dir = tempfile::tempdir().unwrap();
    let (_brick, bsock) = start_brick(dir.path());
    create_image(&bsock, "disk.img", SIZE);
    let nbd = format!("unix:{}", dir.path().join("nbd.sock").display());

    // Each refusal says what was wrong, and of what kind (what `kiln nbd`'s exit code says).
    let refused = |spec: &str, listen: &str| {
        let e = try_start_export(spec, listen, false)
            .err()
            .expect("refused");
        (e.kind(), e.to_string())
    };
    let (kind, e) = refused(
        &format!("unix:{}:/vol/images/none.img", bsock.display()),
        &nbd,
    );
    assert_eq!(
        e,
        format!(
            "image images/none.img not found on unix:{}",
            bsock.display()
        )
    );
    assert_eq!(kind, Kind::NotFound, "{e}");
    // No socket there: what was named does not exist.
    let (kind, e) = refused("unix:/nonexistent/kilnd.sock:/vol/disk.img", &nbd);
    assert!(
        e.contains("cannot connect") && e.contains("/nonexistent/kilnd.sock"),
        "{e}"
    );
    assert_eq!(kind, Kind::NotFound, "{e}");
    let (kind, e) = refused("127.0.0.1:1:/vol/disk.img", &nbd);
    assert!(e.contains("unreachable"), "{e}");
    assert_eq!(kind, Kind::Unavailable, "{e}");
    let (kind, e) = refused("disk.img", &nbd);
    assert!(e.contains("bad image spec"), "{e}");
    assert_eq!(kind, Kind::Invalid, "{e}");
    let (kind, e) = refused(
        &format!("unix:{}:/vol/disk.img", bsock.display()),
        "tcp:nowhere",
    );
    assert!(e.contains("bad listen address"), "{e}");
    assert_eq!(kind, Kind::Invalid, "{e}");
    let (kind, e) = refused(&format!("unix:{}:/vol/", bsock.display()), &nbd);
    assert!(e.contains("no image path"), "{e}");
    assert_eq!(kind, Kind::Invalid, "{e}");

    // Over TCP on a free loopback port.
    let exp = try_start_export(
        &format!("unix:{}:/vol/disk.img", bsock.display()),
        "tcp:127.0.0.1:0",
        false,
    )
    .unwrap();
    assert!(
        exp.uri.starts_with("nbd://127.0.0.1:") && exp.uri.ends_with("/disk.img"),
        "{}",
        exp.uri
    );
    exp.stop();

    // A custom export name replaces the image path; the default (empty) name still works.
    let exp = try_start_named_export(
        &format!("unix:{}:/vol/disk.img", bsock.display()),
        &nbd,
        false,
        Some("vm0"),
    )
    .unwrap();
    assert!(
        exp.uri.starts_with("nbd+unix:///vm0?socket="),
        "{}",
        exp.uri
    );
    let mut c = Nbd::connect(&exp.sock);
    assert_eq!(
        c.info(opt::INFO, "disk.img", &[]).last().unwrap().0,
        rep::ERR_UNKNOWN
    );
    assert_eq!(c.go("vm0").0, SIZE);
    let mut c = Nbd::connect(&exp.sock);
    assert_eq!(c.go("").0, SIZE);
    exp.stop();

    // Shutdown with a client attached: its connection closes and the socket file goes.
    let exp = try_start_export(
        &format!("unix:{}:/vol/disk.img", bsock.display()),
        &nbd,
        false,
    )
    .unwrap();
    let mut c = Nbd::connect(&exp.sock);
    c.go("disk.img");
    assert_eq!(c.read(1, 0, 4096).0, 0);
    let sock = exp.sock.clone();
    exp.stop();
    assert!(c.closed());
    assert!(!sock.exists(), "socket file left behind");
}
