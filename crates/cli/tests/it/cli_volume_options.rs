//! Volume options as an operator changes them on a running volume, against a real management
//! kilnd with real brick processes: the clients' allow-list and root squash, and the one table
//! of options that `set`, `get` and `reset` read.

use kiln_client::block_on;
use serde_json::Value;

use crate::common;
use common::{fails, mgmt_ok, ok, online, refused_kilnd, status, wait_for, BrickReaper, Kilnd};

#[test]
fn a_volume_allow_list_refuses_other_addresses_and_can_be_changed() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let _reaper = BrickReaper(state.clone());
    let kd = Kilnd::start(&state, &["--brick-port-base", "24500"]);
    let (a, sd) = (kd.addr.as_str(), state.to_str().unwrap());
    let spec = format!("127.0.0.1:{}", tmp.path().join("ab").display());
    let err = fails(&[
        "volume",
        "create",
        "al",
        &spec,
        "--allow",
        "10.0.0.0/33",
        "--server",
        a,
        "--state-dir",
        sd,
    ]);
    assert!(err.contains("10.0.0.0/33"), "a bad range is refused: {err}");
    ok(&[
        "volume",
        "create",
        "al",
        &spec,
        "--allow",
        "10.9.9.0/24",
        "--server",
        a,
        "--state-dir",
        sd,
    ]);
    ok(&["volume", "start", "al", "--server", a, "--state-dir", sd]);
    let info = ok(&["volume", "info", "al", "--server", a, "--state-dir", sd]);
    assert!(info.contains("Clients allowed from: 10.9.9.0/24"), "{info}");
    let secret = std::fs::read_to_string(state.join("vols/al/secret")).unwrap();
    let port = status(a, sd, "al")["bricks"][0]["port"].as_u64().unwrap();
    let addr = format!("tcp:127.0.0.1:{port}");
    let connect = || kiln_client::Client::connect_opts(&addr, Some(secret.trim().as_bytes()), None);
    let e = connect().err().expect("loopback is not in 10.9.9.0/24");
    assert!(e.to_string().contains("allow-list"), "{e}");

    // Allowing loopback restarts the brick with the new list; now the client gets in.
    ok(&[
        "volume",
        "set",
        "al",
        "allow",
        "10.9.9.0/24,127.0.0.0/8",
        "--server",
        a,
        "--state-dir",
        sd,
    ]);
    let port = status(a, sd, "al")["bricks"][0]["port"].as_u64().unwrap();
    let addr2 = format!("tcp:127.0.0.1:{port}");
    let c = kiln_client::Client::connect_opts(&addr2, Some(secret.trim().as_bytes()), None)
        .expect("allowed now");
    block_on(c.mkdir("in", 0o755)).unwrap();
    let info = ok(&["volume", "info", "al", "--server", a, "--state-dir", sd]);
    assert!(info.contains("10.9.9.0/24, 127.0.0.0/8"), "{info}");
    // `all` clears the list.
    ok(&[
        "volume",
        "set",
        "al",
        "allow",
        "all",
        "--server",
        a,
        "--state-dir",
        sd,
    ]);
    let info = ok(&["volume", "info", "al", "--server", a, "--state-dir", sd]);
    assert!(info.contains("Clients allowed from: anywhere"), "{info}");
    assert!(info.contains("Root squash: off"), "{info}");

    // Root squash: the allow-list stays as it is; a client's root becomes nobody on the
    // brick, and so does a request without credentials from a client that holds only the
    // volume's secret (kilnd's own heal speaks for its internal identity, which holds root).
    ok(&[
        "volume",
        "set",
        "al",
        "root-squash",
        "on",
        "--server",
        a,
        "--state-dir",
        sd,
    ]);
    let info = ok(&["volume", "info", "al", "--server", a, "--state-dir", sd]);
    assert!(info.contains("Root squash: on"), "{info}");
    assert!(info.contains("Clients allowed from: anywhere"), "{info}");
    let port = status(a, sd, "al")["bricks"][0]["port"].as_u64().unwrap();
    let vf = kiln_client::Volume::default_volfile(&format!("tcp:127.0.0.1:{port}"));
    let vol = kiln_client::Volume::from_volfile_with_secret(&vf, Some(secret.trim().as_bytes()))
        .expect("connect");
    let root = vol.on_behalf_of(Some(std::sync::Arc::new(kiln_proto::Cred::default())));
    // A new volume's root is root's, 0755 (kilnd made the brick directory): squashed, a
    // client's root may not write there, as with NFS. The admin opens it up.
    let ab = tmp.path().join("ab");
    let mode = std::fs::metadata(&ab).unwrap().permissions();
    assert_eq!(
        std::os::unix::fs::PermissionsExt::mode(&mode) & 0o777,
        0o755
    );
    block_on(root.mkdir("refused", 0o755)).expect_err("a squashed root in a 0755 root dir");
    std::fs::set_permissions(&ab, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    block_on(root.mkdir("by-root", 0o755)).expect("mkdir as a client's root");
    block_on(vol.mkdir("by-process", 0o755)).expect("mkdir without credentials");
    let owner = |n: &str| {
        let m = std::fs::metadata(tmp.path().join("ab").join(n)).unwrap();
        (
            std::os::unix::fs::MetadataExt::uid(&m),
            std::os::unix::fs::MetadataExt::gid(&m),
        )
    };
    assert_eq!(
        owner("by-root"),
        (65534, 65534),
        "a client's root is squashed"
    );
    assert_eq!(
        owner("by-process"),
        (65534, 65534),
        "no credentials: nobody, not root"
    );
    // Group 0 is root's too: a user in group 0 gets nobody's group instead.
    let user_in_root_group = vol.on_behalf_of(Some(std::sync::Arc::new(kiln_proto::Cred {
        uid: 1000,
        gid: 0,
        groups: vec![0],
    })));
    block_on(user_in_root_group.mkdir("by-1000", 0o755)).expect("mkdir as uid 1000, gid 0");
    assert_eq!(owner("by-1000"), (1000, 65534), "gid 0 is squashed");
    // Root's private file: neither a squashed root nor a raw client without credentials
    // reads it; heal opens are kilnd's own.
    std::fs::write(ab.join("root-only"), b"secret").unwrap();
    std::fs::set_permissions(
        ab.join("root-only"),
        std::os::unix::fs::PermissionsExt::from_mode(0o600),
    )
    .unwrap();
    let raw = kiln_client::Client::connect_with_secret(
        &format!("tcp:127.0.0.1:{port}"),
        Some(secret.trim().as_bytes()),
    )
    .unwrap();
    let e = block_on(raw.open("root-only", libc::O_RDONLY)).expect_err("no credentials, no root");
    assert_eq!(e.raw_os_error(), Some(libc::EACCES));
    let e = block_on(raw.create("ab-setuid", libc::O_RDWR, 0o4755)).map(|(_, a)| a.uid);
    assert_eq!(
        e.unwrap(),
        65534,
        "a file it makes is nobody's, never a set-ID root file"
    );
    let e =
        block_on(root.mkdir("in/x", 0o755)).expect_err("nobody may not write in root's 0755 dir");
    assert_eq!(e.raw_os_error(), Some(libc::EACCES));
    let err = fails(&[
        "volume",
        "set",
        "al",
        "root-squash",
        "maybe",
        "--server",
        a,
        "--state-dir",
        sd,
    ]);
    assert!(err.contains("on or off"), "{err}");
}

#[test]
fn options_are_read_set_and_reset_from_one_table_and_a_state_dir_has_one_kilnd() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let _reaper = BrickReaper(state.clone());
    let kd = Kilnd::start(&state, &["--brick-port-base", "26300"]);
    let b = format!("127.0.0.1:{}", tmp.path().join("b").display());
    mgmt_ok(&kd, &state, &["volume", "create", "ov", &b]);
    let get = |opt: &str| -> Value {
        let s = mgmt_ok(&kd, &state, &["volume", "get", "ov", opt, "--json"]);
        serde_json::from_str(&s).unwrap()
    };
    let all = get("all");
    let names: Vec<&str> = all["options"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o["name"].as_str().unwrap())
        .collect();
    // Every option of the table, in its order, and `set --help` (made from the same table)
    // tells what each does and takes.
    let table: Vec<&str> = kiln_mgmt::options::OPTIONS.iter().map(|s| s.name).collect();
    assert_eq!(names, table, "{all}");
    let help = ok(&["volume", "set", "--help"]);
    let help = help.split_whitespace().collect::<Vec<_>>().join(" ");
    for s in kiln_mgmt::options::OPTIONS {
        let kind = s.kind.split_whitespace().collect::<Vec<_>>().join(" ");
        assert!(
            help.contains(&format!("{}: ", s.name)) && help.contains(&kind),
            "set --help lacks {} ({kind}): {help}",
            s.name
        );
    }
    assert!(all["version"].as_u64().unwrap() > 0, "{all}");
    for o in all["options"].as_array().unwrap() {
        assert_eq!(
            o["value"], o["default"],
            "a new volume has the defaults: {o}"
        );
    }
    mgmt_ok(&kd, &state, &["volume", "set", "ov", "io-timeout", "12"]);
    mgmt_ok(&kd, &state, &["volume", "set", "ov", "root-squash", "on"]);
    mgmt_ok(
        &kd,
        &state,
        &["volume", "set", "ov", "short-circuit", "off"],
    );
    assert_eq!(get("short-circuit")["options"][0]["value"], "off");
    let io = get("io-timeout");
    assert_eq!(io["options"][0]["value"], "12", "{io}");
    assert_eq!(io["options"][0]["restarts_bricks"], false, "{io}");
    assert!(io["version"].as_u64() > all["version"].as_u64(), "{io}");
    let text = mgmt_ok(&kd, &state, &["volume", "get", "ov"]);
    assert!(
        text.contains("root-squash") && text.contains("how long a client"),
        "{text}"
    );
    // Bad names and values are refused before anything is sent, naming what is allowed.
    let e = fails(&[
        "volume",
        "set",
        "ov",
        "io-timeout",
        "forever",
        "--server",
        &kd.addr,
    ]);
    assert!(e.contains("seconds, 0 to 86400"), "{e}");
    let e = fails(&["volume", "get", "ov", "colour", "--server", &kd.addr]);
    assert!(
        e.contains("no volume option") && e.contains("io-timeout"),
        "{e}"
    );
    let sd = state.to_str().unwrap();
    // Values are parsed strictly: an allow-list of empty items is not "allow everyone", and
    // the list set before stays.
    mgmt_ok(
        &kd,
        &state,
        &["volume", "set", "ov", "allow", "10.1.0.0/16"],
    );
    for bad in [",,,", " ", "", "10.0.0.0/8,", ",10.0.0.0/8", "all,"] {
        let e = fails(&[
            "volume",
            "set",
            "ov",
            "allow",
            bad,
            "--server",
            &kd.addr,
            "--state-dir",
            sd,
        ]);
        assert!(e.contains("allow") && e.contains("`all`"), "{bad:?}: {e}");
        assert_eq!(
            get("allow")["options"][0]["value"],
            "10.1.0.0/16",
            "{bad:?}"
        );
    }
    for (opt, bad) in [
        ("io-timeout", "+5"),
        ("io-timeout", " 5"),
        ("io-timeout", ""),
        ("flush-behind", " 8M"),
        ("flush-behind", "+8M"),
        ("root-squash", "On"),
        ("short-circuit", ""),
    ] {
        let e = fails(&[
            "volume",
            "set",
            "ov",
            opt,
            bad,
            "--server",
            &kd.addr,
            "--state-dir",
            sd,
        ]);
        assert!(e.contains(opt), "{opt} {bad:?}: {e}");
    }
    mgmt_ok(&kd, &state, &["volume", "reset", "ov", "allow"]);
    assert_eq!(get("allow")["options"][0]["value"], "all");
    mgmt_ok(&kd, &state, &["volume", "reset", "ov", "io-timeout"]);
    assert_eq!(get("io-timeout")["options"][0]["value"], "30");
    assert_eq!(get("root-squash")["options"][0]["value"], "on");
    // A brick option reaches the bricks' volfile (and a reset takes it out again).
    mgmt_ok(&kd, &state, &["volume", "start", "ov"]);
    let brick_volfile = || std::fs::read_to_string(state.join("vols/ov/bricks/0.toml")).unwrap();
    assert!(
        !brick_volfile().contains("flush_behind"),
        "{}",
        brick_volfile()
    );
    mgmt_ok(&kd, &state, &["volume", "set", "ov", "flush-behind", "64M"]);
    let fb = get("flush-behind");
    assert_eq!(fb["options"][0]["value"], "64M", "{fb}");
    assert_eq!(fb["options"][0]["restarts_bricks"], true, "{fb}");
    assert!(
        brick_volfile().contains("flush_behind = 67108864"),
        "{}",
        brick_volfile()
    );
    let e = fails(&[
        "volume",
        "set",
        "ov",
        "flush-behind",
        "lots",
        "--server",
        &kd.addr,
    ]);
    assert!(e.contains("a size"), "{e}");
    mgmt_ok(&kd, &state, &["volume", "reset", "ov", "all"]);
    assert_eq!(get("root-squash")["options"][0]["value"], "off");
    assert_eq!(get("short-circuit")["options"][0]["value"], "on");
    assert_eq!(get("flush-behind")["options"][0]["value"], "0");
    assert!(
        !brick_volfile().contains("flush_behind"),
        "{}",
        brick_volfile()
    );
    mgmt_ok(&kd, &state, &["volume", "stop", "ov", "--yes"]);

    // A second kilnd on the same state directory refuses to start, and says which holds it.
    let err = refused_kilnd(&[
        "--mgmt".as_ref(),
        "tcp:127.0.0.1:0".as_ref(),
        "--state-dir".as_ref(),
        state.as_os_str(),
    ]);
    assert!(
        err.contains("another kilnd")
            && err.contains(&format!("pid {}", kd.child.id()))
            && err.contains("--state-dir"),
        "{err}"
    );
    // A taken management port gets a hint, not only "address in use".
    let taken = format!("tcp:127.0.0.1:{}", kd.addr.rsplit(':').next().unwrap());
    let other = tmp.path().join("other");
    let err = refused_kilnd(&[
        "--mgmt".as_ref(),
        taken.as_ref(),
        "--state-dir".as_ref(),
        other.as_os_str(),
    ]);
    assert!(
        err.contains("management port") && err.contains("--mgmt"),
        "{err}"
    );
}

/// On a volume that squashes root, a client holding only the volume's secret acts as nobody,
/// so heal (whose opens write past clients' locks, as root) cannot run on that secret:
/// `kiln volume heal` on a pool host speaks for kilnd's internal identity instead, and heals.
#[test]
fn a_cli_heal_on_a_root_squashing_volume_heals_as_kilnd() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let _reaper = BrickReaper(state.clone());
    // The service waits a day between rounds: only the command heals here.
    let kd = Kilnd::start(
        &state,
        &["--heal-interval", "86400", "--brick-port-base", "24650"],
    );
    let (a, sd) = (kd.addr.as_str(), state.to_str().unwrap());
    let dirs: Vec<std::path::PathBuf> = (0..3).map(|i| tmp.path().join(format!("q{i}"))).collect();
    let mut create = vec!["volume", "create", "sq", "replica", "3"];
    let specs: Vec<String> = dirs
        .iter()
        .map(|d| format!("127.0.0.1:{}", d.display()))
        .collect();
    create.extend(specs.iter().map(String::as_str));
    create.extend(["--server", a, "--state-dir", sd]);
    ok(&create);
    ok(&[
        "volume",
        "set",
        "sq",
        "root-squash",
        "on",
        "--server",
        a,
        "--state-dir",
        sd,
    ]);
    ok(&["volume", "start", "sq", "--server", a, "--state-dir", sd]);
    for d in &dirs {
        std::fs::set_permissions(d, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    }
    let secret = std::fs::read_to_string(state.join("vols/sq/secret")).unwrap();
    let key = kiln_client::mgmt::Key::from_file_text(secret.trim().as_bytes());
    let vf = kiln_client::mgmt::fetch_volfile_with(a, "sq", Some(&key)).unwrap();
    let v =
        kiln_client::Volume::from_volfile_with_secret(&vf, Some(secret.trim().as_bytes())).unwrap();
    let (fd, attr) = block_on(v.create("/img", libc::O_RDWR, 0o644)).unwrap();
    assert_eq!(attr.uid, 65534, "the volume's secret acts as nobody here");
    assert_eq!(
        block_on(v.pwritev(&fd, vec![vec![1u8; 1 << 20]], 0))
            .0
            .unwrap(),
        1 << 20
    );
    let pid = status(a, sd, "sq")["bricks"][2]["pid"].as_u64().unwrap();
    // SAFETY: kill(2) with a pid and a signal number has no memory effects.
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    wait_for("the killed brick to show down", 10, || {
        online(&status(a, sd, "sq")) == [true, true, false]
    });
    for k in 0..16u64 {
        let (n, _) = block_on(v.pwritev(&fd, vec![vec![k as u8 | 2; 4096]], k * 65_536));
        assert_eq!(n.unwrap(), 4096, "write {k} with a brick down");
    }
    ok(&[
        "volume",
        "start",
        "sq",
        "force",
        "--server",
        a,
        "--state-dir",
        sd,
    ]);
    wait_for("the brick to come back", 10, || {
        online(&status(a, sd, "sq")) == [true, true, true]
    });
    let out = ok(&["volume", "heal", "sq", "--server", a, "--state-dir", sd]);
    assert!(!out.contains("could not be healed"), "{out}");
    let copies: Vec<Vec<u8>> = dirs
        .iter()
        .map(|d| std::fs::read(d.join("img")).unwrap())
        .collect();
    assert!(
        copies[0] == copies[1] && copies[1] == copies[2],
        "healed copies differ: {out}"
    );
}
