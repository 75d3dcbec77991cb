//! A Unix socket belongs to the server listening on it: a second server started on a live
//! server's socket is refused and the first keeps its clients; a socket file left behind by
//! a server that is gone is taken over.

use std::io::ErrorKind;

use kiln_client::Volume;
use kiln_layer::exec::block_on;
use kiln_server::{spawn_background, Listen};

#[test]
fn a_live_servers_socket_is_refused_and_a_stale_one_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    std::fs::create_dir(&a).unwrap();
    std::fs::create_dir(&b).unwrap();
    std::fs::write(a.join("only-on-a"), b"a").unwrap();
    let sock = dir.path().join("brick.sock");
    let _first = spawn_background(&a, &[Listen::Unix(sock.clone())]).expect("first server");

    let e = spawn_background(&b, &[Listen::Unix(sock.clone())])
        .err()
        .expect("a second server on a live socket is refused");
    assert_eq!(e.kind(), ErrorKind::AddrInUse, "{e}");
    assert!(e.to_string().contains("running server"), "{e}");
    // New clients still reach the first server's brick.
    let vol = Volume::connect(&format!("unix:{}", sock.display())).expect("connect");
    block_on(vol.lookup("only-on-a")).expect("the first server still answers");

    // A socket file nobody listens on (its server is gone) is replaced.
    let stale = dir.path().join("stale.sock");
    drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
    assert!(stale.exists());
    let _second = spawn_background(&b, &[Listen::Unix(stale.clone())]).expect("stale socket");
    let vol = Volume::connect(&format!("unix:{}", stale.display())).expect("connect");
    assert!(
        block_on(vol.lookup("only-on-a")).is_err(),
        "brick b has no such file"
    );
}
