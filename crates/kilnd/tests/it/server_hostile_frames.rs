//! Malformed frames get an error reply or a closed connection, never a crash, and the server
//! keeps serving well-behaved clients.

use crate::common;

use common::{seed, snapshot, Kilnd, Raw, Rng};
use kiln_client::{block_on, Client};
use kiln_proto::codec::Wire;
use kiln_proto::frame::{Header, FLAG_STAMP, MAX_PAYLOAD_LEN};
use kiln_proto::ops::*;
use kiln_proto::stamp::Stamp;
use kiln_proto::{errno, Op};

#[test]
fn bad_frames_get_errors_and_the_server_survives() {
    let mut k = Kilnd::start();
    let good = Client::connect(&k.tcp).expect("connect");
    let (fh, _) = block_on(good.create("/keep", libc::O_RDWR, 0o644)).expect("create");
    block_on(good.pwritev(fh, vec![b"steady".to_vec()], 0))
        .0
        .expect("write");

    // Framing intact, content bad: an error reply, and the connection stays usable.
    let mut raw = Raw::connect(&k);
    let (h, _, _) = raw.call(999, 1, &[]);
    assert_eq!(
        (h.request_id.get(), h.status.get()),
        (1, errno::ENOSYS),
        "unknown opcode"
    );
    let (h, _, _) = raw.call(Op::Lookup as u16, 2, &[0xff, 0xff, 0xff, 0x7f]);
    assert_eq!(
        h.status.get(),
        errno::EPROTO,
        "length prefix beyond the args"
    );
    let (h, _, _) = raw.call(Op::Lookup as u16, 3, &[1, 0, 0, 0, 0xc3]);
    assert_eq!(h.status.get(), errno::EPROTO, "invalid UTF-8");
    let mut trailing = PathReq {
        path: "keep".into(),
    }
    .to_wire();
    trailing.push(0);
    let (h, _, _) = raw.call(Op::Lookup as u16, 4, &trailing);
    assert_eq!(h.status.get(), errno::EPROTO, "trailing bytes");
    let (h, _, _) = raw.call(
        Op::Read as u16,
        5,
        &ReadReq {
            fh: 12345,
            offset: 0,
            len: 10,
        }
        .to_wire(),
    );
    assert_eq!(h.status.get(), errno::EBADF, "unknown handle");
    raw.send(&Raw::request(
        Op::Lookup as u16,
        6,
        &PathReq {
            path: "keep".into(),
        }
        .to_wire(),
        b"junk",
    ));
    assert_eq!(
        raw.reply().expect("reply").0.status.get(),
        errno::EPROTO,
        "payload on a lookup"
    );
    // A stamp flag without a whole stamp in front of the arguments: refused.
    let h = Header::request(Op::Discard as u16, 14, 10, 0).with_flags(FLAG_STAMP);
    raw.send(&[&h.to_bytes()[..], &[0u8; 10]].concat());
    assert_eq!(
        raw.reply().expect("reply").0.status.get(),
        errno::EPROTO,
        "a truncated stamp"
    );
    // A stamp on a fop that changes no bytes is read past and ignored.
    let mut args = Stamp {
        writer: 1,
        seq: 1,
        done: 1,
    }
    .to_wire();
    args.extend(
        PathReq {
            path: "keep".into(),
        }
        .to_wire(),
    );
    let h = Header::request(Op::Lookup as u16, 15, args.len() as u32, 0).with_flags(FLAG_STAMP);
    raw.send(&[&h.to_bytes()[..], &args].concat());
    let (h, _, _) = raw.reply().expect("reply");
    assert_eq!(h.status.get(), 0, "a stamped lookup");
    let (h, a, _) = raw.call(
        Op::Lookup as u16,
        7,
        &PathReq {
            path: "keep".into(),
        }
        .to_wire(),
    );
    assert_eq!(h.status.get(), 0, "the connection still works");
    assert_eq!(Attr::from_wire(&a).expect("attr").size, 6);

    // Framing broken: an error reply (id 0) and a closed connection.
    for bad in [
        {
            let mut h = Header::request(Op::Lookup as u16, 8, 0, 0);
            h.magic = 0x1234_5678.into();
            h
        },
        Header::request(Op::Write as u16, 9, 0, MAX_PAYLOAD_LEN + 1),
        Header::request(Op::Lookup as u16, 10, 1 << 30, 0),
        {
            let mut h = Header::request(Op::Lookup as u16, 11, 0, 0);
            h.version = 77;
            h
        },
        Header::reply(Op::Lookup as u16, 12, 0, 0, 0),
    ] {
        let mut raw = Raw::connect(&k);
        raw.send(&bad.to_bytes());
        let (h, _, _) = raw.reply().expect("an error reply before the close");
        assert_eq!((h.request_id.get(), h.status.get()), (0, errno::EPROTO));
        assert!(
            raw.reply().is_none(),
            "connection closed after a framing error"
        );
    }
    // Truncated frame then hang-up.
    let mut raw = Raw::connect(&k);
    raw.send(
        &Raw::request(
            Op::Lookup as u16,
            13,
            &PathReq {
                path: "keep".into(),
            }
            .to_wire(),
            &[],
        )[..20],
    );
    drop(raw);

    assert!(k.alive(), "kilnd survived");
    let (n, b) = block_on(good.preadv(fh, vec![vec![0u8; 6]], 0));
    assert_eq!(
        (n.expect("read"), &b[0][..]),
        (6, &b"steady"[..]),
        "the good client is still served"
    );
}

#[test]
fn ten_thousand_random_frames() {
    let mut k = Kilnd::start();
    let outside = k.dir.path().join("outside");
    std::fs::create_dir(&outside).expect("outside");
    std::fs::write(outside.join("f"), b"x").expect("f");
    let before = snapshot(&outside);
    let good = Client::connect(&k.unix).expect("connect");
    let s = seed("ten_thousand_random_frames");
    let mut rng = Rng(s);
    let mut sent = 0;
    let mut raw = Raw::connect(&k);
    while sent < 10_000 {
        // Mostly valid headers with random opcodes and random argument bytes (so the argument
        // decoders see garbage), sometimes pure noise that breaks the framing.
        let frame = if rng.below(10) == 0 {
            (0..rng.below(64) + 1)
                .map(|_| rng.next() as u8)
                .collect::<Vec<u8>>()
        } else {
            let op = (rng.below(30)) as u16;
            let args: Vec<u8> = (0..rng.below(48))
                .map(|_| {
                    // Bias towards small numbers so length prefixes are sometimes plausible.
                    if rng.below(3) == 0 {
                        rng.below(8) as u8
                    } else {
                        rng.next() as u8
                    }
                })
                .collect();
            let payload: Vec<u8> = if op == Op::Write as u16 {
                vec![0x5a; rng.below(16) as usize]
            } else {
                Vec::new()
            };
            Raw::request(op, sent as u64 + 1, &args, &payload)
        };
        raw.send(&frame);
        sent += 1;
        if frame.len() < 32 || Header::parse(&frame).is_err() {
            // The server answers with EPROTO and closes, or waits for the rest of a header;
            // either way start a new connection.
            raw = Raw::connect(&k);
        } else {
            let r = raw.reply();
            match r {
                Some((h, _, _)) => assert_eq!(
                    h.request_id.get(),
                    sent as u64,
                    "seed {s}: reply matched to its frame"
                ),
                None => raw = Raw::connect(&k),
            }
        }
        if sent % 2000 == 0 {
            assert!(
                block_on(good.lookup("/")).is_ok(),
                "seed {s}: good client served during the storm"
            );
        }
    }
    assert!(k.alive(), "seed {s}: kilnd survived {sent} random frames");
    assert!(block_on(good.statfs("/")).is_ok());
    assert_eq!(
        snapshot(&outside),
        before,
        "seed {s}: something outside the brick changed"
    );
    let _ = block_on(good.lookup("/"));
}
