//! OPEN with `peek` answers a small file whole. With `OPEN_ATTR` the reply carries the file's
//! attributes too (a client's mount answers a lookup from them); without it — a client that
//! does not know the bit — the reply is what it always was.

use crate::common;

use std::os::unix::fs::PermissionsExt;

use common::{Kilnd, Raw};
use kiln_proto::codec::Wire;
use kiln_proto::ops::*;
use kiln_proto::Op;

#[test]
fn a_whole_file_open_carries_the_attributes_when_asked() {
    let k = Kilnd::start();
    let body: Vec<u8> = (0..5000u32).map(|i| (i * 7) as u8).collect();
    let f = k.brick.join("f");
    std::fs::write(&f, &body).unwrap();
    std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o640)).unwrap();
    let mut raw = Raw::connect(&k);
    let open = |flags: u32| {
        OpenReq {
            path: "f".into(),
            flags,
            peek: 64 * 1024,
        }
        .to_wire()
    };

    let (h, args, payload) = raw.call(Op::Open as u16, 1, &open(OPEN_ATTR));
    assert_eq!(h.status.get(), 0);
    let r = OpenWholeReply::from_wire(&args).expect("an open reply with attributes");
    assert_eq!(r.fh, 0, "the whole file, nothing left open");
    assert_eq!(r.attr.size, 5000);
    assert_eq!(r.attr.mode, libc::S_IFREG | 0o640);
    assert_eq!(payload, body);

    let (h, args, payload) = raw.call(Op::Open as u16, 2, &open(0));
    assert_eq!(h.status.get(), 0);
    let r = OpenReply::from_wire(&args).expect("the reply a client without the bit reads");
    assert_eq!(r.fh, 0);
    assert_eq!(payload, body);

    // A file too big for the peek: a handle, with or without the bit.
    let (h, args, payload) = raw.call(
        Op::Open as u16,
        3,
        &OpenReq {
            path: "f".into(),
            flags: OPEN_ATTR,
            peek: 100,
        }
        .to_wire(),
    );
    assert_eq!(h.status.get(), 0);
    assert_ne!(OpenReply::from_wire(&args).expect("a handle").fh, 0);
    assert!(payload.is_empty());
}
