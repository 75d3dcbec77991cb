//! Decoding never panics on arbitrary bytes; encoding round-trips; and the committed golden
//! vectors pin the wire format (regenerate deliberately with KILN_BLESS=1 after a format change,
//! together with a protocol version bump).

use kiln_proto::codec::{Seq, Wire};
use kiln_proto::frame::Header;
use kiln_proto::ops::*;
use kiln_proto::Op;
use proptest::prelude::*;

/// Tries every argument decoder on `bytes`; none may panic.
fn decode_all(bytes: &[u8]) {
    let _ = Header::parse(bytes);
    let _ = HelloReq::from_wire(bytes);
    let _ = HelloReply::from_wire(bytes);
    let _ = PathReq::from_wire(bytes);
    let _ = HandleReq::from_wire(bytes);
    let _ = SetattrReq::from_wire(bytes);
    let _ = OpenReq::from_wire(bytes);
    let _ = OpenReply::from_wire(bytes);
    let _ = CreateReq::from_wire(bytes);
    let _ = CreateReply::from_wire(bytes);
    let _ = ReadReq::from_wire(bytes);
    let _ = WriteReq::from_wire(bytes);
    let _ = WriteReply::from_wire(bytes);
    let _ = FsyncReq::from_wire(bytes);
    let _ = MkdirReq::from_wire(bytes);
    let _ = RenameReq::from_wire(bytes);
    let _ = ReaddirReq::from_wire(bytes);
    let _ = ReaddirReply::from_wire(bytes);
    let _ = SymlinkReq::from_wire(bytes);
    let _ = ReadlinkReply::from_wire(bytes);
    let _ = LinkReq::from_wire(bytes);
    let _ = StatfsReply::from_wire(bytes);
    let _ = XattrReq::from_wire(bytes);
    let _ = XattrValue::from_wire(bytes);
    let _ = SetxattrReq::from_wire(bytes);
    let _ = XattrNames::from_wire(bytes);
    let _ = FallocateReq::from_wire(bytes);
    let _ = DiscardReq::from_wire(bytes);
    let _ = Attr::from_wire(bytes);
    let _ = FsetattrReq::from_wire(bytes);
    let _ = AuthReq::from_wire(bytes);
    let _ = AuthReply::from_wire(bytes);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4000))]

    #[test]
    fn decoders_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
        decode_all(&bytes);
    }

    #[test]
    fn decoders_never_panic_on_small_numbers(bytes in proptest::collection::vec(0u8..4, 0..120)) {
        // Small bytes make plausible length prefixes and counts, reaching deeper code.
        decode_all(&bytes);
    }

    #[test]
    fn header_roundtrip(op in any::<u16>(), id in any::<u64>(), a in 0u32..=kiln_proto::MAX_ARGS_LEN, p in 0u32..=kiln_proto::MAX_PAYLOAD_LEN) {
        let h = Header::request(op, id, a, p);
        prop_assert_eq!(Header::parse(&h.to_bytes()), Ok(h));
    }

    #[test]
    fn args_roundtrip(path in "[a-z/]{0,100}", to in "\\PC{0,40}", x in any::<u64>(), y in any::<u32>(), v in proptest::collection::vec(any::<u8>(), 0..200)) {
        let r = RenameReq { from: path.clone(), to: to.clone(), flags: y };
        prop_assert_eq!(RenameReq::from_wire(&r.to_wire()), Ok(r));
        let s = SetxattrReq { path, name: to, value: v, flags: y };
        prop_assert_eq!(SetxattrReq::from_wire(&s.to_wire()), Ok(s));
        let rd = ReadReq { fh: x, offset: x ^ 0x55, len: y };
        prop_assert_eq!(ReadReq::from_wire(&rd.to_wire()), Ok(rd));
    }
}

#[test]
fn huge_counts_do_not_allocate() {
    // A readdir reply claiming 4 billion entries in 8 bytes is refused before any allocation.
    let mut b = u32::MAX.to_le_bytes().to_vec();
    b.extend_from_slice(&[0; 4]);
    assert!(ReaddirReply::from_wire(&b).is_err());
    assert!(XattrNames::from_wire(&b).is_err());
}

fn attr() -> Attr {
    Attr {
        ino: 0x0102_0304_0506_0708,
        mode: 0o100644,
        nlink: 1,
        uid: 1000,
        gid: 1001,
        rdev: 0,
        size: 1 << 30,
        blocks: 2 << 20,
        blksize: 4096,
        atime: Time {
            sec: 1_700_000_000,
            nsec: 1,
        },
        mtime: Time {
            sec: -1,
            nsec: 999_999_999,
        },
        ctime: Time { sec: 0, nsec: 0 },
    }
}

/// Named frames whose bytes are committed under tests/vectors/.
fn vectors() -> Vec<(&'static str, Vec<u8>)> {
    let frame = |op: Op, id: u64, args: Vec<u8>, payload: &[u8]| {
        let mut v = Header::request(op as u16, id, args.len() as u32, payload.len() as u32)
            .to_bytes()
            .to_vec();
        v.extend_from_slice(&args);
        v.extend_from_slice(payload);
        v
    };
    let reply = |op: Op, id: u64, status: u32, args: Vec<u8>, payload: &[u8]| {
        let mut v = Header::reply(
            op as u16,
            id,
            status,
            args.len() as u32,
            payload.len() as u32,
        )
        .to_bytes()
        .to_vec();
        v.extend_from_slice(&args);
        v.extend_from_slice(payload);
        v
    };
    vec![
        (
            "hello_request",
            frame(
                Op::Hello,
                1,
                HelloReq {
                    version: 1,
                    client: "kiln-client".into(),
                    metrics: "127.0.0.1:24180".into(),
                }
                .to_wire(),
                &[],
            ),
        ),
        (
            "lookup_request",
            frame(
                Op::Lookup,
                2,
                PathReq {
                    path: "dir/file.img".into(),
                }
                .to_wire(),
                &[],
            ),
        ),
        (
            "lookup_reply",
            reply(Op::Lookup, 2, 0, attr().to_wire(), &[]),
        ),
        (
            "lookup_reply_enoent",
            reply(Op::Lookup, 3, 2, Vec::new(), &[]),
        ),
        (
            "read_request",
            frame(
                Op::Read,
                4,
                ReadReq {
                    fh: 7,
                    offset: 1 << 20,
                    len: 131072,
                }
                .to_wire(),
                &[],
            ),
        ),
        (
            "read_reply",
            reply(Op::Read, 4, 0, Vec::new(), b"payload bytes"),
        ),
        (
            "write_request",
            frame(
                Op::Write,
                5,
                WriteReq {
                    fh: 7,
                    offset: 4096,
                }
                .to_wire(),
                b"\x00\x01\x02\xff",
            ),
        ),
        (
            "write_reply",
            reply(Op::Write, 5, 0, WriteReply { written: 4 }.to_wire(), &[]),
        ),
        (
            "setattr_request",
            frame(
                Op::Setattr,
                6,
                SetattrReq {
                    path: "f".into(),
                    attrs: SetAttrs {
                        valid: SETATTR_MODE | SETATTR_SIZE,
                        mode: 0o600,
                        uid: 0,
                        gid: 0,
                        size: 42,
                        atime: Time::default(),
                        mtime: Time { sec: 5, nsec: 6 },
                    },
                }
                .to_wire(),
                &[],
            ),
        ),
        (
            "readdir_reply",
            reply(
                Op::Readdir,
                8,
                0,
                ReaddirReply {
                    entries: Seq(vec![
                        DirEntry {
                            name: "a".into(),
                            attr: attr(),
                            xattrs: true,
                        },
                        DirEntry {
                            name: "ü".into(),
                            attr: Attr::default(),
                            xattrs: false,
                        },
                    ]),
                    eof: true,
                }
                .to_wire(),
                &[],
            ),
        ),
        (
            "setxattr_request",
            frame(
                Op::Setxattr,
                9,
                SetxattrReq {
                    path: "f".into(),
                    name: "user.k".into(),
                    value: vec![0, 1, 2],
                    flags: 1,
                }
                .to_wire(),
                &[],
            ),
        ),
        (
            "rename_request",
            frame(
                Op::Rename,
                10,
                RenameReq {
                    from: "a".into(),
                    to: "b/c".into(),
                    flags: 0,
                }
                .to_wire(),
                &[],
            ),
        ),
    ]
}

#[test]
fn golden_vectors_match() {
    let dir = std::path::PathBuf::from(
        std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo test sets CARGO_MANIFEST_DIR"),
    )
    .join("tests/vectors");
    let bless = std::env::var_os("KILN_BLESS").is_some();
    for (name, bytes) in vectors() {
        let path = dir.join(format!("{name}.bin"));
        if bless {
            std::fs::write(&path, &bytes).expect("write vector");
            continue;
        }
        let want = std::fs::read(&path)
            .unwrap_or_else(|e| panic!("{}: {e} (run with KILN_BLESS=1 once)", path.display()));
        assert_eq!(
            bytes, want,
            "{name}: encoding differs from the committed vector"
        );
        // And the committed bytes decode: the header parses and the lengths add up.
        let h = Header::parse(&want).expect("vector header");
        assert_eq!(
            want.len(),
            32 + h.args_len.get() as usize + h.payload_len.get() as usize,
            "{name}"
        );
    }
}

#[test]
fn header_layout_is_pinned() {
    let h = Header::reply(0x0102, 0x1122_3344_5566_7788, 0xaabb_ccdd, 0x10, 0x20);
    let b = h.to_bytes();
    assert_eq!(&b[0..4], b"KILN");
    assert_eq!(b[4], 1, "version");
    assert_eq!(b[5], 1, "kind: reply");
    assert_eq!(&b[6..8], &[0x02, 0x01]);
    assert_eq!(&b[8..16], &0x1122_3344_5566_7788u64.to_le_bytes());
    assert_eq!(&b[16..20], &0xaabb_ccddu32.to_le_bytes());
    assert_eq!(&b[20..24], &0x10u32.to_le_bytes());
    assert_eq!(&b[24..28], &0x20u32.to_le_bytes());
    assert_eq!(&b[28..32], &[0, 0, 0, 0]);
}

#[test]
fn every_value_has_one_encoding() {
    // A boolean byte other than 0 or 1 is refused, so decode-then-encode gives back the input.
    let mut b = FsyncReq {
        fh: 7,
        datasync: true,
    }
    .to_wire();
    assert_eq!(
        FsyncReq::from_wire(&b),
        Ok(FsyncReq {
            fh: 7,
            datasync: true
        })
    );
    *b.last_mut().expect("bool byte") = 2;
    assert_eq!(
        FsyncReq::from_wire(&b),
        Err(kiln_proto::DecodeError::BadValue)
    );
}
