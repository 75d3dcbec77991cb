//! `kiln auth` end to end through a management kilnd and its brick (part of `cli_mgmt_auth`).

use super::*;

/// `kiln auth`: identities made, listed, changed, rotated and removed through a management
/// kilnd reach its bricks; each client is held to its capabilities there, and a removed
/// identity's connections close within a second while the others go on.
#[test]
fn identities_reach_the_bricks_and_hold_clients_to_their_capabilities() {
    use kiln_client::{block_on, Client};
    use std::io::{IoSlice, IoSliceMut};
    use std::time::Instant;

    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let _reaper = BrickReaper(state.clone());
    let kd = Kilnd::start(&state, &["--brick-port-base", "26700"]);
    let (a, sd) = (kd.addr.as_str(), state.to_str().unwrap());
    let brick = tmp.path().join("b1");
    let bspec = format!("127.0.0.1:{}", brick.display());
    let with_server = |args: &[&'static str]| {
        let mut v: Vec<&str> = args.to_vec();
        v.extend(["--server", a, "--state-dir", sd]);
        v
    };
    let m = |args: &[&str]| {
        let mut v = args.to_vec();
        v.extend(["--server", a, "--state-dir", sd]);
        ok(&v)
    };
    m(&["volume", "create", "tv", &bspec]);
    m(&["volume", "start", "tv"]);
    let (k1, k2) = (tmp.path().join("t1.key"), tmp.path().join("t2.key"));
    let (k1s, k2s) = (k1.to_str().unwrap(), k2.to_str().unwrap());
    for args in tenants("tv", k1s, k2s) {
        m(&args);
    }
    assert_eq!(mode(&k1), 0o600, "key files are private");
    for (d, id) in [("t1", 1001), ("t2", 1002)] {
        std::fs::create_dir(brick.join(d)).unwrap();
        std::os::unix::fs::chown(brick.join(d), Some(id), Some(id)).unwrap();
    }
    std::fs::write(brick.join("t2/data"), b"two").unwrap();

    // The list shows capabilities, never keys; a name is taken once; bad input is refused.
    let list: Value = serde_json::from_str(&m(&["auth", "list", "--json"])).unwrap();
    let ids = list["identities"].as_array().unwrap();
    assert_eq!(ids.len(), 2, "{list}");
    assert!(ids.iter().all(|i| i.get("key").is_none()), "{list}");
    assert_eq!(ids[1]["caps"]["read_only"], true, "{list}");
    for (args, says) in [
        (&["auth", "add", "t1", "--volume", "tv"][..], "exists"),
        (
            &["auth", "add", "kilnd", "--volume", "tv"][..],
            "kilnd keeps for its own",
        ),
        (
            &[
                "auth",
                "add",
                "t3",
                "--volume",
                "tv",
                "--subtree",
                "/a/../b",
            ][..],
            "bad subtree",
        ),
    ] {
        let err = fails(&with_server(args));
        assert!(err.contains(says), "{args:?}: {err}");
    }

    let port = status(a, sd, "tv")["bricks"][0]["port"].as_u64().unwrap();
    let baddr = format!("tcp:127.0.0.1:{port}");
    let key = |p: &Path| read_secret(p);
    let t1 = Client::connect_with_secret(&baddr, Some(&key(&k1))).expect("t1 at the brick");
    let t2 = Client::connect_with_secret(&baddr, Some(&key(&k2))).expect("t2 at the brick");
    let (fh1, attr) = block_on(t1.create("t1/img", libc::O_RDWR, 0o600)).expect("t1 creates");
    assert_eq!((attr.uid, attr.gid), (1001, 1001), "runs as its user");
    assert_eq!(
        t1.pwritev_blocking(fh1, &[IoSlice::new(b"one")], 0)
            .unwrap(),
        3
    );
    let e = block_on(t1.open("t2/data", libc::O_RDONLY)).unwrap_err();
    assert_eq!(
        e.raw_os_error(),
        Some(libc::EACCES),
        "t1 outside its subtree"
    );
    let fh2 = block_on(t2.open("t2/data", libc::O_RDONLY)).expect("t2 reads");
    let e = block_on(t2.create("t2/new", libc::O_RDWR, 0o644)).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EROFS), "t2 is read-only");

    // An identity with the admin capability runs management commands with its own key; one
    // without it does not, and neither is the management secret.
    let ko = tmp.path().join("ops.key");
    m(&[
        "auth",
        "add",
        "ops",
        "--volume",
        "*",
        "--admin",
        "--key-file",
        ko.to_str().unwrap(),
    ]);
    let empty = tmp.path().join("no-state");
    std::fs::create_dir(&empty).unwrap();
    let as_key = |key: &Path| {
        run(
            &[
                "volume",
                "list",
                "--server",
                a,
                "--state-dir",
                empty.to_str().unwrap(),
                "--mgmt-secret-file",
                key.to_str().unwrap(),
            ],
            &[],
        )
    };
    let out = as_key(&ko);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "tv");
    let out = as_key(&k2);
    assert!(
        !out.status.success(),
        "a key without admin ran a management command"
    );
    m(&["auth", "rm", "ops"]);

    // Capabilities change live: t2 may write now, with its next request.
    m(&[
        "auth",
        "caps",
        "t2",
        "--volume",
        "tv",
        "--subtree",
        "/t2",
        "--as",
        "1002:1002",
    ]);
    let t0 = Instant::now();
    while block_on(t2.create("t2/new", libc::O_RDWR, 0o644)).is_err() {
        assert!(
            t0.elapsed() < Duration::from_secs(2),
            "new capabilities not applied"
        );
        std::thread::yield_now();
    }

    // Removed: t1's handle fails within a second and it cannot come back; t2 goes on.
    let t0 = Instant::now();
    m(&["auth", "rm", "t1"]);
    loop {
        if t1
            .pwritev_blocking(fh1, &[IoSlice::new(b"one")], 0)
            .is_err()
        {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(1),
            "t1 still writes a second after rm"
        );
        std::thread::yield_now();
    }
    assert!(Client::connect_with_secret(&baddr, Some(&key(&k1))).is_err());
    let mut buf = [0u8; 8];
    let n = t2
        .preadv_blocking(fh2, &mut [IoSliceMut::new(&mut buf)], 0)
        .unwrap();
    assert_eq!(&buf[..n], b"two", "t2's I/O goes on");
    assert_eq!(std::fs::read(brick.join("t1/img")).unwrap(), b"one");

    // Rotated: the old key is refused, the new one works.
    m(&["auth", "rotate", "t2", "--key-file", k2s]);
    let new_key = key(&k2);
    let t0 = Instant::now();
    let t2b = loop {
        match Client::connect_with_secret(&baddr, Some(&new_key)) {
            Ok(c) => break c,
            Err(e) => assert!(t0.elapsed() < Duration::from_secs(2), "{e}"),
        }
    };
    block_on(t2b.lookup("t2/data")).unwrap();
    assert!(
        t2.preadv_blocking(fh2, &mut [IoSliceMut::new(&mut buf)], 0)
            .is_err(),
        "old key's connection closed"
    );

    // A new volume's shared secret is off: this host's clients prove the pool hosts' local
    // identity, whose key kilnd keeps where they look for one.
    let got = m(&["volume", "get", "tv", "shared-secret"]);
    let row: Vec<&str> = got
        .lines()
        .nth(1)
        .unwrap_or_default()
        .split_whitespace()
        .collect();
    assert_eq!(row[..3], ["shared-secret", "off", "off"], "{got}");
    let local = read_secret(&state.join("vols/tv/secret"));
    assert!(
        local.starts_with(b"local.tv "),
        "{}",
        String::from_utf8_lossy(&local)
    );
    let lc = Client::connect_with_secret(&baddr, Some(&local)).expect("the local identity");
    block_on(lc.lookup("t2/data")).unwrap();
    assert!(mgmt::fetch_volfile_with(a, "tv", Some(&mgmt::Key::from_file_text(&local))).is_ok());
    let err = fails(&with_server(&["auth", "add", "local.tv", "--volume", "tv"]));
    assert!(err.contains("kilnd keeps for its own"), "{err}");

    // An identity held to other networks is refused here; to this one, admitted.
    let kf = tmp.path().join("far.key");
    let kfs = kf.to_str().unwrap();
    m(&[
        "auth",
        "add",
        "far",
        "--volume",
        "tv",
        "--from",
        "10.9.9.0/24",
        "--key-file",
        kfs,
    ]);
    let e = Client::connect_with_secret(&baddr, Some(&key(&kf)))
        .err()
        .expect("refused");
    assert_eq!(e.kind(), std::io::ErrorKind::PermissionDenied, "{e}");
    let err = fails(&with_server(&[
        "auth",
        "add",
        "bad",
        "--volume",
        "tv",
        "--from",
        "10.0.0.0/33",
    ]));
    assert!(err.contains("10.0.0.0/33"), "{err}");
    m(&[
        "auth",
        "caps",
        "far",
        "--volume",
        "tv",
        "--from",
        "10.9.9.0/24",
        "--from",
        "127.0.0.0/8",
    ]);
    let t0 = Instant::now();
    let far = loop {
        match Client::connect_with_secret(&baddr, Some(&key(&kf))) {
            Ok(c) => break c,
            Err(e) => assert!(t0.elapsed() < Duration::from_secs(2), "{e}"),
        }
    };
    block_on(far.lookup("t2/data")).unwrap();
    let list = m(&["auth", "list"]);
    assert!(list.contains("from 10.9.9.0/24,127.0.0.0/8"), "{list}");

    // The shared secret on: it reaches the bricks and the graph, and it is what this host's
    // clients find; off again: refused at both, while identities still work.
    m(&["volume", "set", "tv", "shared-secret", "on"]);
    let vol_secret = read_secret(&state.join("vols/tv/secret"));
    assert!(
        !vol_secret.contains(&b' '),
        "the shared secret, not a named key"
    );
    let port = status(a, sd, "tv")["bricks"][0]["port"].as_u64().unwrap();
    let baddr = format!("tcp:127.0.0.1:{port}");
    Client::connect_with_secret(&baddr, Some(&vol_secret)).expect("the shared secret");
    m(&["volume", "set", "tv", "shared-secret", "off"]);
    let port = status(a, sd, "tv")["bricks"][0]["port"].as_u64().unwrap();
    let baddr = format!("tcp:127.0.0.1:{port}");
    let e = Client::connect_with_secret(&baddr, Some(&vol_secret))
        .err()
        .expect("refused");
    assert_eq!(e.kind(), std::io::ErrorKind::PermissionDenied, "{e}");
    let shared = mgmt::Key::from_file_text(&vol_secret);
    assert!(mgmt::fetch_volfile_with(a, "tv", Some(&shared)).is_err());
    let t2c = Client::connect_with_secret(&baddr, Some(&new_key)).expect("t2 after the restart");
    block_on(t2c.lookup("t2/data")).unwrap();
    assert!(mgmt::fetch_volfile_with(a, "tv", Some(&mgmt::Key::from_file_text(&new_key))).is_ok());
    assert_eq!(
        read_secret(&state.join("vols/tv/secret")),
        local,
        "the local key again"
    );
    Client::connect_with_secret(&baddr, Some(&local)).expect("the local identity again");
}
