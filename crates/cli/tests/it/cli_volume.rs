//! `kiln volume create|start|stop|delete|info|status|list` against a real management kilnd:
//! bricks are real processes on real sockets, data goes through the volfile the server hands
//! out, and the daemon is killed and restarted on the same state directory.

use std::path::PathBuf;
use std::process::Stdio;

use kiln_client::{block_on, mgmt, Volume};
use kiln_layer::volfile::{LayerKind, ProtocolClientConfig};
use serde_json::Value;

use crate::common;
use common::{fails, kiln, ok, online, refused_kilnd, run, status, wait_for, BrickReaper, Kilnd};

fn pid_alive(pid: u64) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            !s.rsplit_once(')')
                .map(|(_, r)| r.trim_start().starts_with('Z'))
                .unwrap_or(true)
        })
        .unwrap_or(false)
}

#[test]
fn replica3_volume_lifecycle_survives_a_kilnd_restart() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let _reaper = BrickReaper(state.clone());
    let dirs: Vec<PathBuf> = (1..=3).map(|i| tmp.path().join(format!("b{i}"))).collect();
    std::fs::create_dir(&dirs[0]).unwrap(); // the others are created by `create`
    let bricks: Vec<String> = dirs
        .iter()
        .map(|d| format!("127.0.0.1:{}", d.display()))
        .collect();

    let kd = Kilnd::start(&state, &["--brick-port-base", "24100"]);
    let addr = kd.addr.clone();
    let a = addr.as_str();
    // The CLI proves the management secret kilnd created in its state directory.
    let sd = state.to_str().unwrap();

    let mut create = vec!["volume", "create", "vol", "replica", "3"];
    create.extend(bricks.iter().map(String::as_str));
    create.extend(["--server", a, "--state-dir", sd]);
    let out = ok(&create);
    assert!(out.contains("volume create: vol: success"), "{out}");
    assert!(dirs.iter().all(|d| d.is_dir()), "brick directories created");
    let secret = state.join("vols/vol/secret");
    let mode =
        std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&secret).unwrap().permissions());
    assert_eq!(mode & 0o777, 0o600, "the key is private");
    // This host's clients prove the pool hosts' identity for the volume.
    let key = std::fs::read_to_string(&secret).unwrap();
    let (name, hex) = key.trim().split_once(' ').expect("NAME KEY");
    assert_eq!((name, hex.len()), ("local.vol", 64), "{key}");

    // Not started: no volfile yet, status says so.
    assert!(
        fails(&["volume", "volfile", "vol", "--server", a, "--state-dir", sd])
            .contains("not started")
    );
    assert!(
        ok(&["volume", "status", "vol", "--server", a, "--state-dir", sd]).contains("not started")
    );

    let out = ok(&["volume", "start", "vol", "--server", a, "--state-dir", sd]);
    assert!(out.contains("volume start: vol: success"), "{out}");
    assert!(
        fails(&["volume", "start", "vol", "--server", a, "--state-dir", sd])
            .contains("already started")
    );
    let st = status(a, sd, "vol");
    assert_eq!(online(&st), [true, true, true], "{st}");
    let ports: Vec<u64> = st["bricks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["port"].as_u64().unwrap())
        .collect();
    let pids: Vec<u64> = st["bricks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["pid"].as_u64().unwrap())
        .collect();
    let table = ok(&["volume", "status", "vol", "--server", a, "--state-dir", sd]);
    assert!(
        table.contains("Online") && table.contains(&ports[0].to_string()),
        "{table}"
    );
    let info = ok(&["volume", "info", "vol", "--server", a, "--state-dir", sd]);
    assert!(info.contains("Type: Replicate"), "{info}");
    assert!(info.contains("Number of Bricks: 1 x 3 = 3"), "{info}");
    assert!(info.contains(&format!("Brick3: {}", bricks[2])), "{info}");
    assert_eq!(
        ok(&["volume", "list", "--server", a, "--state-dir", sd]).trim(),
        "vol"
    );

    // The volfile: io-stats → replicate → three protocol-clients on the bricks' ports.
    let vf = fetch_with_secret(a, &state, "vol");
    let kinds: Vec<&str> = vf.layers.iter().map(|l| l.kind.type_name()).collect();
    assert_eq!(
        kinds,
        [
            "io-stats",
            "replicate",
            "protocol-client",
            "protocol-client",
            "protocol-client"
        ]
    );
    assert_eq!(vf.layers[0].name, "vol");
    assert_eq!(vf.layers[1].name, "vol-replicate-0");
    assert_eq!(vf.layers[1].subvolumes.len(), 3);
    for (l, port) in vf.layers[2..].iter().zip(&ports) {
        match &l.kind {
            LayerKind::ProtocolClient(ProtocolClientConfig { remote, .. }) => {
                // Local bricks: their Unix socket first, then TCP.
                let (sock, tcp) = remote.split_once(',').expect("two addresses");
                assert!(
                    sock.starts_with(&format!("unix:{}/run/vol-", state.display())),
                    "{remote}"
                );
                assert_eq!(tcp, format!("tcp:127.0.0.1:{port}"));
            }
            other => panic!("{other:?}"),
        }
    }

    // Bricks want the volume's secret; with it, data goes through the volume's graph.
    assert!(
        kiln_client::Client::connect_with_secret(&format!("127.0.0.1:{}", ports[0]), None).is_err()
    );
    let sf = mgmt::secret_file_in("vol", None, &state).expect("the local secret");
    // SAFETY (edition 2021: safe fn): this test's only thread that reads the environment.
    std::env::set_var("KILN_SECRET_FILE", &sf);
    {
        let v = Volume::from_volfile(&vf).unwrap();
        // Every brick is on this host: reached through its Unix socket.
        for c in v.clients() {
            assert!(c.server().starts_with("unix:"), "{}", c.server());
        }
        let data: Vec<u8> = (0..256 * 1024).map(|i| (i * 7 % 251) as u8).collect();
        let (fd, _) = block_on(v.create("/hello.img", libc::O_RDWR, 0o644)).unwrap();
        let (n, _) = block_on(v.pwritev(&fd, vec![data.clone()], 0));
        assert_eq!(n.unwrap(), data.len());
        let (n, bufs) = block_on(v.preadv(&fd, vec![vec![0u8; 128 * 1024]; 2], 0));
        assert_eq!(n.unwrap(), data.len());
        assert_eq!(bufs.concat(), data);
        // Read again: now straight from the local replica's file (short-circuit).
        for _ in 0..2 {
            let (n, bufs) = block_on(v.preadv(&fd, vec![vec![0u8; 4096]], 8192));
            assert_eq!(n.unwrap(), 4096);
            assert_eq!(bufs.concat(), data[8192..8192 + 4096]);
        }
        let mut direct = 0;
        let mut count = |l: &dyn kiln_layer::Layer| {
            let pc = l
                .as_any()
                .and_then(|a| a.downcast_ref::<kiln_client::protocol::ProtocolClient>());
            direct += pc.map_or(0, |p| p.short_circuit_counts().0);
        };
        v.top().visit(&mut count);
        assert!(
            direct > 0,
            "local replicas are read straight from their files"
        );
        block_on(v.close(fd)).unwrap();
    }
    assert_eq!(
        std::fs::metadata(dirs[0].join("hello.img")).unwrap().len(),
        256 * 1024,
        "the file is in the first brick"
    );

    // kilnd dies; its bricks do not. A new kilnd on the same state adopts them.
    kd.kill();
    assert!(pids.iter().all(|p| pid_alive(*p)), "bricks outlive kilnd");
    let kd = Kilnd::start(&state, &["--brick-port-base", "24100"]);
    let a = kd.addr.as_str();
    let info = ok(&["volume", "info", "vol", "--server", a, "--state-dir", sd]);
    assert!(info.contains("Status: Started"), "{info}");
    let st = status(a, sd, "vol");
    assert_eq!(online(&st), [true, true, true], "{st}");
    let pids2: Vec<u64> = st["bricks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["pid"].as_u64().unwrap())
        .collect();
    assert_eq!(pids2, pids, "running bricks are adopted, not restarted");

    // A killed brick shows down; `start force` brings it back.
    // SAFETY: kill(2) with a pid and a signal number has no memory effects.
    unsafe { libc::kill(pids[1] as i32, libc::SIGKILL) };
    wait_for("the killed brick to show down", 10, || {
        online(&status(a, sd, "vol")) == [true, false, true]
    });
    ok(&[
        "volume",
        "start",
        "vol",
        "force",
        "--server",
        a,
        "--state-dir",
        sd,
    ]);
    let st = status(a, sd, "vol");
    assert_eq!(online(&st), [true, true, true], "{st}");
    assert_ne!(st["bricks"][1]["pid"].as_u64().unwrap(), pids[1]);
    assert_eq!(st["bricks"][0]["pid"].as_u64().unwrap(), pids[0]);

    // Delete needs a stopped volume; stop ends every brick.
    assert!(fails(&[
        "volume",
        "delete",
        "vol",
        "--yes",
        "--server",
        a,
        "--state-dir",
        sd
    ])
    .contains("stop it first"));
    let running: Vec<u64> = st["bricks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["pid"].as_u64().unwrap())
        .collect();
    // Not at a terminal and without --yes: refused, and the bricks keep running.
    let e = fails(&["volume", "stop", "vol", "--server", a, "--state-dir", sd]);
    assert!(e.contains("--yes"), "{e}");
    assert!(
        running.iter().all(|p| pid_alive(*p)),
        "a refused stop stops nothing"
    );
    ok(&[
        "volume",
        "stop",
        "vol",
        "--yes",
        "--server",
        a,
        "--state-dir",
        sd,
    ]);
    assert!(
        running.iter().all(|p| !pid_alive(*p)),
        "stop ends the bricks"
    );
    let st = status(a, sd, "vol");
    assert_eq!(st["state"], "stopped");
    assert_eq!(online(&st), [false, false, false], "{st}");
    assert!(fails(&[
        "volume",
        "stop",
        "vol",
        "--yes",
        "--server",
        a,
        "--state-dir",
        sd
    ])
    .contains("not started"));
    let e = fails(&["volume", "delete", "vol", "--server", a, "--state-dir", sd]);
    assert!(e.contains("--yes"), "{e}");
    assert!(ok(&["volume", "info", "vol", "--server", a, "--state-dir", sd]).contains("vol"));
    ok(&[
        "volume",
        "delete",
        "vol",
        "--yes",
        "--server",
        a,
        "--state-dir",
        sd,
    ]);
    assert!(
        fails(&["volume", "info", "vol", "--server", a, "--state-dir", sd])
            .contains("does not exist")
    );
    assert!(ok(&["volume", "list", "--server", a, "--state-dir", sd]).contains("No volumes"));
    assert!(dirs[0].join("hello.img").exists(), "delete leaves the data");
    drop(kd);
}

#[test]
fn bricks_in_the_state_dir_in_other_bricks_or_in_system_and_home_dirs_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let _reaper = BrickReaper(state.clone());
    // Bricks of this test are never started: no ports are taken.
    let kd = Kilnd::start(&state, &["--brick-port-base", "26700"]);
    let (a, sd) = (kd.addr.as_str(), state.to_str().unwrap());
    let create = |name: &str, brick: &str, force: bool| {
        let mut args = vec!["volume", "create", name, brick];
        if force {
            args.push("force");
        }
        args.extend(["--server", a, "--state-dir", sd]);
        args.into_iter().map(String::from).collect::<Vec<_>>()
    };
    let refused = |name: &str, brick: &str, force: bool, want: &str| {
        let args = create(name, brick, force);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let err = fails(&args);
        assert!(
            err.contains(want),
            "{brick} (force {force}): want {want:?} in {err}"
        );
        err
    };
    let at = |p: &std::path::Path| format!("127.0.0.1:{}", p.display());
    // kilnd's state directory, inside it, around it, and through a symlink: never, not even
    // with `force` (its clients would read mgmt.secret and every volume's secret).
    let link = tmp.path().join("to-state");
    std::os::unix::fs::symlink(&state, &link).unwrap();
    for force in [false, true] {
        for (dir, how) in [
            (state.clone(), "is inside"),
            (state.join("vols"), "is inside"),
            (tmp.path().to_owned(), "contains"),
            (link.clone(), "is inside"),
            (link.join("new/brick"), "is inside"),
        ] {
            let err = refused("s", &at(&dir), force, "kilnd's state directory");
            assert!(
                err.contains(how) && err.contains("even with `force`"),
                "{err}"
            );
        }
    }
    // System and home directories, unless `force`.
    for (dir, what) in [
        ("/var/lib", "a system directory"),
        ("/var", "a system directory"),
        ("/srv", "a system directory"),
        ("/mnt", "a system directory"),
        ("/home", "a system directory"),
        ("/run/kiln-brick", "a system directory"),
        ("/root", "a home directory"),
        ("/home/someone", "a home directory"),
    ] {
        let err = refused("s", &format!("127.0.0.1:{dir}"), false, what);
        assert!(err.contains("add `force`"), "{err}");
    }
    // Another volume's brick, inside it or around it: never, not even with `force`.
    let b1 = tmp.path().join("b1");
    let args = create("one", &at(&b1), false);
    ok(&args.iter().map(String::as_str).collect::<Vec<_>>());
    for dir in [b1.clone(), b1.join("inner")] {
        let err = refused("two", &at(&dir), true, "overlaps brick");
        assert!(err.contains("even with `force`"), "{err}");
    }
    // `force` takes a system directory; a plain directory needs nothing.
    let args = create("sys", "127.0.0.1:/var/lib", true);
    ok(&args.iter().map(String::as_str).collect::<Vec<_>>());
    ok(&[
        "volume",
        "delete",
        "sys",
        "--yes",
        "--server",
        a,
        "--state-dir",
        sd,
    ]);
    let args = create("two", &at(&tmp.path().join("b2")), false);
    ok(&args.iter().map(String::as_str).collect::<Vec<_>>());
}

#[test]
fn bad_volume_definitions_are_refused_with_reasons() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let _reaper = BrickReaper(state.clone());
    let kd = Kilnd::start(&state, &["--brick-port-base", "24200"]);
    let a = kd.addr.as_str();
    let sd = state.to_str().unwrap();
    let b = |n: &str| format!("127.0.0.1:{}", tmp.path().join(n).display());
    let (b1, b2, b3) = (b("b1"), b("b2"), b("b3"));
    let nested = b("b1/inner");

    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["vol", &b1, &b1], "given twice"),
        (vec!["bad/name", &b1], "bad volume name"),
        (vec!["x.y", &b1], "bad volume name"),
        (vec!["vol", "replica", "3", &b1, &b2], "multiple of 3"),
        (vec!["vol", "replica", "0", &b1], "replica count"),
        (vec!["vol", &b1, &nested], "nest"),
        (vec!["vol", "127.0.0.1:relative/dir"], "absolute directory"),
        (vec!["vol", "127.0.0.1:/a/../b"], "'..'"),
        (vec!["vol", "127.0.0.1:/etc"], "system directory"),
        (
            vec!["vol", "127.0.0.1:/usr/share/kiln-brick"],
            "system directory",
        ),
        (vec!["vol", "127.0.0.1:/"], "root directory"),
        // No terminal to ask at: replica 2 needs --yes.
        (vec!["vol", "replica", "2", &b1, &b2], "split-brain"),
    ];
    for (args, want) in cases {
        let mut full = vec!["volume", "create"];
        full.extend(&args);
        full.extend(["--server", a, "--state-dir", sd]);
        let err = fails(&full);
        assert!(err.contains(want), "{args:?}: want {want:?} in {err:?}");
    }
    assert!(ok(&["volume", "list", "--server", a, "--state-dir", sd]).contains("No volumes"));

    // One good volume, then overlaps with it and a duplicate name are refused.
    ok(&[
        "volume",
        "create",
        "one",
        &b1,
        &b2,
        "--server",
        a,
        "--state-dir",
        sd,
    ]);
    let err = fails(&[
        "volume",
        "create",
        "two",
        &nested,
        "--server",
        a,
        "--state-dir",
        sd,
    ]);
    assert!(
        err.contains("overlaps") && err.contains("volume one"),
        "{err}"
    );
    // The same directory through a symlink is the same directory.
    let link = tmp.path().join("link");
    std::os::unix::fs::symlink(tmp.path().join("b1"), &link).unwrap();
    let via_link = format!("127.0.0.1:{}/inner", link.display());
    let err = fails(&[
        "volume",
        "create",
        "two",
        &via_link,
        "--server",
        a,
        "--state-dir",
        sd,
    ]);
    assert!(err.contains("overlaps"), "{err}");
    // `force` takes a system directory past that check (this one then holds kilnd's state
    // directory, which `force` does not override).
    let err = fails(&[
        "volume",
        "create",
        "two",
        "127.0.0.1:/tmp",
        "force",
        "--server",
        a,
        "--state-dir",
        sd,
    ]);
    assert!(
        err.contains("state directory") && !err.contains("system"),
        "{err}"
    );
    // The kilnd's kind of failure reaches the exit status: 4, exists already.
    let out = run(
        &[
            "volume",
            "create",
            "one",
            &b3,
            "--server",
            a,
            "--state-dir",
            sd,
        ],
        &[],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("already exists"), "{err}");
    assert_eq!(out.status.code(), Some(4), "{out:?}");
    // An error with --json is a JSON envelope too, and still a failure.
    let out = run(
        &[
            "volume",
            "info",
            "nope",
            "--json",
            "--server",
            a,
            "--state-dir",
            sd,
        ],
        &[],
    );
    assert_eq!(out.status.code(), Some(3), "not found: {out:?}");
    let v: Value = serde_json::from_slice(&out.stdout).expect("a JSON error on stdout");
    assert_eq!(
        (&v["ok"], &v["kind"]),
        (&Value::Bool(false), &Value::from("not-found")),
        "{v}"
    );
    assert!(
        v["error"].as_str().unwrap_or_default().contains("nope"),
        "{v}"
    );
    let err = fails(&["volume", "start", "nope", "--server", a, "--state-dir", sd]);
    assert!(err.contains("does not exist"), "{err}");
    // --json carries the server's reply.
    let v: Value = serde_json::from_str(&ok(&[
        "volume",
        "info",
        "--server",
        a,
        "--state-dir",
        sd,
        "--json",
    ]))
    .unwrap();
    assert_eq!(v["volumes"][0]["type"], "Distribute");
    // Output nobody reads any more (`kiln volume list | head -1`): a quiet end by SIGPIPE,
    // as `ls` has, not a panic.
    {
        use std::os::fd::FromRawFd;
        use std::os::unix::process::ExitStatusExt;
        let mut fds = [0; 2];
        // SAFETY: `fds` has room for the two descriptors; the read end is closed at once and
        // the write end is owned by the OwnedFd handed to the child.
        let w = unsafe {
            assert_eq!(libc::pipe(fds.as_mut_ptr()), 0);
            libc::close(fds[0]);
            std::os::fd::OwnedFd::from_raw_fd(fds[1])
        };
        let out = kiln()
            .args(["volume", "list", "--server", a, "--state-dir", sd])
            .stdout(Stdio::from(w))
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!err.contains("panicked"), "{err}");
        assert_eq!(
            out.status.signal(),
            Some(libc::SIGPIPE),
            "{:?}: {err}",
            out.status
        );
    }
    // replica 2 with --yes: made, with the warning.
    let out = run(
        &[
            "volume",
            "create",
            "pair",
            "replica",
            "2",
            &b3,
            &b("b4"),
            "--yes",
            "--server",
            a,
            "--state-dir",
            sd,
        ],
        &[],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("warning") && err.contains("split-brain"),
        "{err}"
    );
    // A brick server is not a management server: a clear message, not a hang.
    let brick = tmp.path().join("plain");
    std::fs::create_dir(&brick).unwrap();
    let (mut plain, paddr) = kiln_testkit::daemon::spawn_listening(
        kiln()
            .args([
                "server",
                "--listen",
                "tcp:127.0.0.1:0",
                "--metrics",
                "off",
                "--brick",
            ])
            .arg(&brick),
    );
    let err = fails(&["volume", "list", "--server", &paddr]);
    let _ = plain.kill();
    let _ = plain.wait();
    assert!(err.contains("does not manage volumes"), "{err}");
}

#[test]
fn tls_volumes_bricks_take_only_clients_with_certificates() {
    let tmp = tempfile::tempdir().unwrap();
    let (state, pki) = (tmp.path().join("state"), tmp.path().join("pki"));
    let _reaper = BrickReaper(state.clone());
    let p = |n: &str| pki.join(n).to_str().unwrap().to_owned();
    ok(&["tls", "init", &p("ca")]);
    ok(&[
        "tls",
        "issue",
        "--ca",
        &p("ca"),
        "--out",
        &p("host"),
        "host",
        "--san",
        "127.0.0.1",
    ]);
    ok(&[
        "tls",
        "issue",
        "--ca",
        &p("ca"),
        "--out",
        &p("client"),
        "client",
    ]);
    let err = fails(&["tls", "init", &p("ca")]);
    assert!(
        err.contains("exists"),
        "an existing CA is never overwritten: {err}"
    );

    let host = pki.join("host");
    let kd = Kilnd::start(
        &state,
        &[
            "--tls",
            host.to_str().unwrap(),
            "--brick-port-base",
            "24300",
        ],
    );
    let (a, sd) = (kd.addr.as_str(), state.to_str().unwrap());
    let brick = tmp.path().join("b1");
    let spec = format!("127.0.0.1:{}", brick.display());
    // The management port takes TLS clients only too, and says so to others.
    let create = [
        "volume",
        "create",
        "sec",
        &spec,
        "--server",
        a,
        "--state-dir",
        sd,
    ];
    let err = fails(&create);
    assert!(
        err.contains("requires TLS") && err.contains("KILN_TLS_DIR"),
        "{err}"
    );
    let client = pki.join("client");
    let with_tls = |args: &[&str]| -> String {
        let out = run(args, &[("KILN_TLS_DIR", &client)]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "kiln {args:?}: {err}");
        String::from_utf8(out.stdout).unwrap()
    };
    with_tls(&create);
    with_tls(&["volume", "start", "sec", "--server", a, "--state-dir", sd]);
    let st = with_tls(&[
        "volume",
        "status",
        "sec",
        "--server",
        a,
        "--state-dir",
        sd,
        "--json",
    ]);
    let st = serde_json::from_str::<Value>(&st).unwrap()["volumes"][0].clone();
    assert_eq!(online(&st), [true], "{st}");
    let port = st["bricks"][0]["port"].as_u64().unwrap();
    let addr = format!("tcp:127.0.0.1:{port}");
    // Read from the state directory itself: another test sets KILN_SECRET_FILE meanwhile.
    let secret = std::fs::read_to_string(state.join("vols/sec/secret"))
        .unwrap()
        .trim()
        .to_owned();

    // The secret alone is not enough: the brick wants TLS.
    let e = kiln_client::Client::connect_opts(&addr, Some(secret.as_bytes()), None)
        .err()
        .expect("a plaintext client is refused");
    assert!(e.to_string().contains("requires TLS"), "{e}");
    // With a certificate from the CA (and the secret), data goes through.
    let tls = kiln_tls::client_config(&pki.join("client")).unwrap();
    let c = kiln_client::Client::connect_opts(&addr, Some(secret.as_bytes()), Some(tls))
        .expect("a TLS client with the secret");
    let (fh, _) = block_on(c.create("t.bin", libc::O_RDWR, 0o644)).unwrap();
    let data: Vec<u8> = (0..300_000).map(|i| (i % 253) as u8).collect();
    assert_eq!(
        c.pwritev_blocking(fh, &[std::io::IoSlice::new(&data)], 0)
            .unwrap(),
        data.len()
    );
    assert_eq!(std::fs::read(brick.join("t.bin")).unwrap(), data);
    // And a bad identity directory stops kilnd at once, with the reason.
    drop(kd);
    let nowhere = tmp.path().join("nowhere");
    let err = refused_kilnd(&[
        "--mgmt".as_ref(),
        "tcp:127.0.0.1:0".as_ref(),
        "--state-dir".as_ref(),
        state.as_os_str(),
        "--tls".as_ref(),
        nowhere.as_os_str(),
    ]);
    assert!(err.contains("--tls"), "{err}");
}

#[test]
fn the_heal_service_heals_a_returning_brick_by_itself() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let _reaper = BrickReaper(state.clone());
    let dirs: Vec<PathBuf> = (1..=3).map(|i| tmp.path().join(format!("h{i}"))).collect();
    let kd = Kilnd::start(
        &state,
        &["--heal-interval", "0.2", "--brick-port-base", "24400"],
    );
    let (a, sd) = (kd.addr.as_str(), state.to_str().unwrap());
    let mut create = vec!["volume", "create", "hv", "replica", "3"];
    let specs: Vec<String> = dirs
        .iter()
        .map(|d| format!("127.0.0.1:{}", d.display()))
        .collect();
    create.extend(specs.iter().map(String::as_str));
    create.extend(["--server", a, "--state-dir", sd]);
    ok(&create);
    ok(&["volume", "start", "hv", "--server", a, "--state-dir", sd]);
    let vf = fetch_with_secret(a, &state, "hv");
    // Read from the state directory itself: another test sets KILN_SECRET_FILE meanwhile.
    let secret = std::fs::read_to_string(state.join("vols/hv/secret"))
        .unwrap()
        .trim()
        .to_owned();
    let v = Volume::from_volfile_with_secret(&vf, Some(secret.as_bytes())).unwrap();
    let (fd, _) = block_on(v.create("/img", libc::O_RDWR, 0o644)).unwrap();
    let base = vec![0x11u8; 4 << 20];
    assert_eq!(block_on(v.pwritev(&fd, vec![base], 0)).0.unwrap(), 4 << 20);
    wait_for("the service to have looked once", 20, || {
        status(a, sd, "hv")["heal"]["last_round"]
            .as_u64()
            .unwrap_or(0)
            > 0
    });

    // A brick dies; writes go on (2 of 3 is a majority) and are marked for it.
    let pid = status(a, sd, "hv")["bricks"][2]["pid"].as_u64().unwrap();
    // SAFETY: kill(2) with a pid and a signal number has no memory effects.
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    wait_for("the killed brick to show down", 10, || {
        online(&status(a, sd, "hv")) == [true, true, false]
    });
    let mut written = 0u64;
    for k in 0..64u64 {
        let off = (k * 61_441) % ((4 << 20) - 8192);
        let data = vec![(k as u8).wrapping_mul(7) | 1; 8192];
        let (n, _) = block_on(v.pwritev(&fd, vec![data], off));
        assert_eq!(n.unwrap(), 8192, "write {k} with a brick down");
        written += 8192;
    }
    wait_for("the service to see the backlog", 20, || {
        status(a, sd, "hv")["heal"]["backlog"].as_u64() == Some(1)
    });
    assert_ne!(
        std::fs::read(dirs[0].join("img")).unwrap(),
        std::fs::read(dirs[2].join("img")).unwrap(),
        "the dead brick missed the writes"
    );
    // heal info works with the brick down: from the bricks that answer, naming the one not
    // asked.
    let info = ok(&[
        "volume",
        "heal",
        "hv",
        "info",
        "--server",
        a,
        "--state-dir",
        sd,
    ]);
    assert!(info.contains("1 file(s)"), "{info}");
    assert!(info.contains("img"), "{info}");
    assert!(
        info.contains("Not asked") && info.contains("hv-client-2"),
        "{info}"
    );
    let json = ok(&[
        "volume",
        "heal",
        "hv",
        "info",
        "--json",
        "--server",
        a,
        "--state-dir",
        sd,
    ]);
    let j: serde_json::Value = serde_json::from_str(json.trim()).expect("heal info JSON");
    assert_eq!(j["needs"].as_array().map(Vec::len), Some(1), "{j}");
    assert_eq!(j["unasked"], serde_json::json!(["hv-client-2"]), "{j}");

    // It comes back; nobody runs `kiln volume heal`: the service does.
    ok(&[
        "volume",
        "start",
        "hv",
        "force",
        "--server",
        a,
        "--state-dir",
        sd,
    ]);
    wait_for("the service to heal the returning brick", 30, || {
        let h = status(a, sd, "hv")["heal"].clone();
        h["backlog"].as_u64() == Some(0) && h["healed_files"].as_u64().unwrap_or(0) >= 1
    });
    let h = status(a, sd, "hv")["heal"].clone();
    let moved = h["healed_bytes"].as_u64().unwrap();
    assert!(
        moved >= written / 2 && moved <= 2 * written,
        "healed {moved} bytes for {written} written while down"
    );
    let first = std::fs::read(dirs[0].join("img")).unwrap();
    for d in &dirs[1..] {
        assert!(
            std::fs::read(d.join("img")).unwrap() == first,
            "{} differs after the service healed",
            d.display()
        );
    }
    let table = ok(&["volume", "status", "hv", "--server", a, "--state-dir", sd]);
    assert!(table.contains("Heal"), "{table}");
}

/// The client graph of `vol`, fetched proving the volume's secret from `state`.
fn fetch_with_secret(
    addr: &str,
    state: &std::path::Path,
    vol: &str,
) -> kiln_layer::volfile::Volfile {
    let secret = std::fs::read_to_string(state.join("vols").join(vol).join("secret")).unwrap();
    let key = mgmt::Key::from_file_text(secret.trim().as_bytes());
    mgmt::fetch_volfile_with(addr, vol, Some(&key)).unwrap()
}
