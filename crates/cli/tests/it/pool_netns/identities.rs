//! Identities across a pool of three hosts (a stage of `cli_pool_netns`).

use super::*;

/// A key added at one member works at the bricks on every host; removed at another, it is
/// refused by all of them within a second.
pub(super) fn identities_across_the_pool(h: &Hosts, tmp: &Path) {
    let key = tmp.join("hv.key");
    h.ok(
        1,
        &[
            "auth",
            "add",
            "hv",
            "--volume",
            "pv",
            "--root",
            "--key-file",
            key.to_str().unwrap(),
        ],
    );
    let st = h.ok(0, &["volume", "status", "pv"]);
    let bricks: Vec<String> = st["volumes"][0]["bricks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| format!("tcp:{}:{}", b["host"].as_str().unwrap(), b["port"]))
        .collect();
    assert!(bricks.len() >= 3, "{st}");
    // One read through the brick at `addr`, from host `i`'s network, proving the key in `key`.
    let read_from = |i: usize, key: &Path, addr: &str| {
        Command::new("ip")
            .args([
                "netns",
                "exec",
                &h.ns(i),
                env!("CARGO_BIN_EXE_kiln"),
                "bench",
            ])
            .args([
                "--connect",
                addr,
                "--rw",
                "read",
                "--bs",
                "4k",
                "--size",
                "4k",
            ])
            .args(["--runtime", "0.05", "--file", "hv-probe", "--json"])
            .env("KILN_SECRET_FILE", key)
            .env("KILN_TLS_DIR", h.client_tls())
            .output()
            .expect("run kiln bench")
    };
    let read_at = |addr: &str| read_from(0, &key, addr);
    // The pool hosts' own key for the volume (what a mount on a member proves) works from a
    // member at every brick, and is refused from the client host: a copy is no use there.
    let local = h.state(0).join("vols/pv/secret");
    assert!(
        std::fs::read_to_string(&local)
            .unwrap()
            .starts_with("local.pv "),
        "a new volume's hosts prove the local identity"
    );
    for b in &bricks {
        let out = read_from(1, &local, b);
        assert!(
            out.status.success(),
            "the local key from host 1 at {b}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let out = read_from(3, &local, b);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains("refused"),
            "the local key from the client host at {b}: {err}"
        );
    }
    for b in &bricks {
        let out = read_at(b);
        assert!(
            out.status.success(),
            "hv's key at {b}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    h.ok(2, &["auth", "rm", "hv"]);
    // Each brick asked over and over, all at once, until it refuses.
    let t0 = Instant::now();
    let took = std::thread::scope(|sc| {
        let each: Vec<_> = bricks
            .iter()
            .map(|b| {
                let read_at = &read_at;
                sc.spawn(move || loop {
                    let out = read_at(b);
                    if !out.status.success() {
                        let err = String::from_utf8_lossy(&out.stderr);
                        assert!(err.contains("refused"), "{b}: {err}");
                        return t0.elapsed();
                    }
                    assert!(
                        t0.elapsed() < Duration::from_secs(5),
                        "{b} still takes hv's key"
                    );
                })
            })
            .collect();
        each.into_iter().map(|t| t.join().unwrap()).max().unwrap()
    });
    assert!(
        took < Duration::from_secs(1),
        "hv refused everywhere only after {took:?}"
    );
    println!("a removed key was refused by every brick within {took:?}");
}
