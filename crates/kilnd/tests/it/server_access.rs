//! The TCP allow-list: clients outside it get a clear refusal (EACCES on their first frame) and
//! a log line on the server; clients inside it are served.

use crate::common;

use std::net::TcpStream;
use std::os::fd::FromRawFd;

use common::Raw;
use kiln_client::Client;
use kiln_proto::codec::Wire;
use kiln_proto::ops::HelloReq;
use kiln_proto::{errno, Op};

/// A TCP connection to `to` from the loopback source address `from`.
fn connect_from(from: [u8; 4], to: std::net::SocketAddrV4) -> TcpStream {
    let sin = |a: [u8; 4], port: u16| libc::sockaddr_in {
        sin_family: libc::AF_INET as u16,
        sin_port: port.to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from_ne_bytes(a),
        },
        sin_zero: [0; 8],
    };
    // SAFETY: plain socket calls on a new descriptor with valid sockaddr_in structs; the fd is
    // handed to TcpStream, which owns it from then on.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        assert!(fd >= 0);
        let src = sin(from, 0);
        assert_eq!(
            libc::bind(
                fd,
                (&src as *const libc::sockaddr_in).cast(),
                std::mem::size_of::<libc::sockaddr_in>() as u32
            ),
            0,
            "bind source"
        );
        let dst = sin(to.ip().octets(), to.port());
        assert_eq!(
            libc::connect(
                fd,
                (&dst as *const libc::sockaddr_in).cast(),
                std::mem::size_of::<libc::sockaddr_in>() as u32
            ),
            0,
            "connect"
        );
        TcpStream::from_raw_fd(fd)
    }
}

#[test]
fn clients_outside_the_allow_list_are_refused_with_a_reason() {
    let dir = tempfile::tempdir().expect("tempdir");
    let log = dir.path().join("kilnd.log");
    let (mut child, addr) = common::spawn_tcp_kilnd(
        dir.path(),
        &[
            std::ffi::OsStr::new("--allow"),
            std::ffi::OsStr::new("127.0.0.2/32"),
        ],
        Some(&log),
    );
    let addr: std::net::SocketAddrV4 = addr.parse().expect("addr");

    // From 127.0.0.1: refused, and the client says why.
    let err = Client::connect(&format!("tcp:{addr}"))
        .err()
        .expect("a client outside the allow-list is refused");
    assert!(err.to_string().contains("refused this client"), "{err}");

    // From 127.0.0.2: served.
    let mut ok = Raw(connect_from([127, 0, 0, 2], addr));
    let hello = HelloReq {
        version: 1,
        client: "test".into(),
        metrics: String::new(),
    }
    .to_wire();
    let (h, _, _) = ok.call(Op::Hello as u16, 1, &hello);
    assert_eq!(
        h.status.get(),
        0,
        "a client inside the allow-list is served"
    );

    // And from 127.0.0.3 at the raw level: EACCES to its first frame, then a close.
    let mut no = Raw(connect_from([127, 0, 0, 3], addr));
    let (h, _, _) = no.call(Op::Hello as u16, 9, &hello);
    assert_eq!((h.request_id.get(), h.status.get()), (9, errno::EACCES));
    assert!(no.reply().is_none(), "closed after the refusal");

    let _ = child.kill();
    let _ = child.wait();
    let text = std::fs::read_to_string(&log).expect("log");
    assert!(
        text.contains("refused a connection") && text.contains("127.0.0.3"),
        "the server logs who was refused: {text}"
    );
}
