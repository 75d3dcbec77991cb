//! Requests of a connection the client reset are never run late: a brick that was stopped
//! (SIGSTOP, as a brick stuck in a storage call holds its connection's requests) while a
//! WRITE waited in its socket, and whose client gave it up meanwhile (its watchdog: the
//! brick's host acknowledges, the brick answers nothing) and reset the connection, drops that
//! WRITE when it runs again. The client has counted it as missed
//! (in a replicated volume: marked, and perhaps overwritten through a new connection since);
//! running it late would put old bytes over newer ones with nothing marking it.

use crate::replica::{wait_for, Brick};

use std::io::{IoSlice, IoSliceMut};
use std::sync::Arc;
use std::time::Duration;

use kiln_client::Client;
use kiln_layer::exec::block_on;
use kiln_testkit::net::tcp_sockets;

#[test]
fn a_write_waiting_in_a_stopped_brick_is_dropped_once_its_client_reset_the_connection() {
    // A client gives a silent brick up after several ping timeouts (8 x 1 s here): time
    // enough to see the WRITE wait in the brick's socket on a loaded machine, before the
    // reset takes the socket away.
    kiln_client::conn::set_ping_timeout(Some(Duration::from_secs(1)));
    let root = tempfile::tempdir().unwrap();
    let brick = Brick::new(root.path(), 0);
    let pid = brick.child.as_ref().expect("running").id() as i32;
    let at = brick.addr.trim_start_matches("tcp:").to_owned();
    let client = Arc::new(Client::connect(&brick.addr).expect("connect"));
    let (fh, _) = block_on(client.create("f", libc::O_RDWR, 0o644)).expect("create");
    let old = [0x11u8; 4096];
    assert_eq!(
        client
            .pwritev_blocking(fh, &[IoSlice::new(&old)], 0)
            .unwrap(),
        4096
    );
    let mine: Vec<String> = tcp_sockets(None)
        .unwrap()
        .into_iter()
        .filter(|s| s.remote == at && s.state == "ESTABLISHED")
        .map(|s| s.local)
        .collect();
    assert!(!mine.is_empty(), "no connection to {at}");
    // The brick's end of them: where a request waits unread while the brick is stopped.
    let waiting = || -> u64 {
        tcp_sockets(None)
            .unwrap()
            .iter()
            .filter(|s| s.local == at && mine.contains(&s.remote))
            .map(|s| s.rx_queue)
            .sum()
    };

    // SAFETY: kill(2) on the brick this test started; no memory is involved.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    // kill returns once the signal is sent, not once every thread has stopped: a brick thread
    // still running could take the WRITE in and run it (seen once in CI, under load).
    wait_for("every thread of the brick to stop", 30, || stopped(pid));
    let c = client.clone();
    let writer = std::thread::spawn(move || {
        let new = [0x22u8; 4096];
        c.pwritev_blocking(fh, &[IoSlice::new(&new)], 0)
    });
    wait_for(
        "the WRITE to wait in the stopped brick's socket",
        30,
        || waiting() > 4096,
    );
    let r = writer.join().expect("writer");
    assert!(r.is_err(), "a write to a stopped brick succeeded: {r:?}");
    assert!(
        client.away().is_some(),
        "the client did not give the brick up: {r:?}"
    );
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
    wait_for("the brick to end the reset connection", 30, || {
        !tcp_sockets(None)
            .unwrap()
            .iter()
            .any(|s| s.local == at && mine.contains(&s.remote))
    });

    let fresh = Client::connect(&brick.addr).expect("reconnect");
    let fh = block_on(fresh.open("f", libc::O_RDONLY)).expect("open");
    let mut got = [0u8; 4096];
    let n = fresh
        .preadv_blocking(fh, &mut [IoSliceMut::new(&mut got)], 0)
        .expect("read");
    assert_eq!(n, 4096);
    assert!(
        got == old,
        "the brick ran a write its client had reset the connection of (first byte {:#x})",
        got[0]
    );
}

/// True when every thread of process `pid` is stopped (state `T` in its `stat`).
fn stopped(pid: i32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    tasks.flatten().all(|t| {
        std::fs::read_to_string(t.path().join("stat")).is_ok_and(|st| {
            // The state follows the command name, which is in parentheses.
            st.rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().next())
                .is_some_and(|state| state == "T" || state == "t")
        })
    })
}
