//! Clients follow their volume's graph: a mount, an NBD export and a library client of a
//! managed volume move to each new version of its graph while fio writes and verifies through
//! them, with no I/O error, and close the connections the old graph used once no open file
//! needs them.
//!
//! The graph changes by `kiln volume set VOL io-timeout S`: on a volume without replicas each
//! brick's protocol-client carries the timeout, so every connection is replaced; on a replica-3
//! volume only the replicate layer does, so the connections are kept.

use std::path::Path;
use std::sync::Arc;

use kiln_client::volume::Source;
use kiln_client::{block_on, Volume};

use crate::common;
use common::fio::{need_fio, FioLoop};
use common::managed::Vol;
use common::{wait_for, BrickReaper};

/// How many lines of the log at `p` contain `what`.
fn count(p: &Path, what: &str) -> usize {
    std::fs::read_to_string(p)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains(what))
        .count()
}

fn block(k: usize) -> Vec<u8> {
    (0..4096).map(|i| (i * 7 + k * 13) as u8).collect()
}

/// Writes block `k` of the held file, then reads blocks `0..=k` back and checks them.
fn write_and_check(lib: &Volume, fd: &kiln_client::Fd, k: usize) {
    let (n, _) = block_on(lib.pwritev(fd, vec![block(k)], (k * 4096) as u64));
    assert_eq!(n.expect("write through the held file"), 4096);
    for j in 0..=k {
        let (n, bufs) = block_on(lib.preadv(fd, vec![vec![0u8; 4096]], (j * 4096) as u64));
        assert_eq!(n.expect("read through the held file"), 4096);
        assert_eq!(bufs[0], block(j), "block {j} after switch {k}");
    }
}

/// One test: the library clients of both cases read the volume's secret from the
/// environment, which the two cases set differently.
#[test]
fn clients_follow_new_graphs() {
    need_fio();
    mount_nbd_and_library_follow_new_graphs_under_io();
    a_replica_graph_change_keeps_the_connections();
}

fn mount_nbd_and_library_follow_new_graphs_under_io() {
    let tmp = tempfile::tempdir().unwrap();
    let _reaper = BrickReaper(tmp.path().join("state"));
    let v = Vol::with_bricks(tmp.path(), "gs", 1, 2, &["--brick-port-base", "25100"]);
    // The library client in this process asks every 100 ms too, with the volume's secret.
    std::env::set_var("KILN_GRAPH_POLL_MS", "100");
    std::env::set_var("KILN_SECRET_FILE", &v.secret);

    let (mlog, nlog) = (tmp.path().join("mount.log"), tmp.path().join("nbd.log"));
    let (mlog_s, nlog_s) = (mlog.display().to_string(), nlog.display().to_string());
    fn env(log: &str) -> [(&'static str, &str); 3] {
        [
            ("KILN_LOG", "warn,kiln_client::graph=debug"),
            ("KILN_GRAPH_POLL_MS", "100"),
            ("KILN_TEST_STDERR", log),
        ]
    }
    let (menv, nenv) = (env(&mlog_s), env(&nlog_s));
    let mnt = tmp.path().join("mnt");
    std::fs::create_dir_all(&mnt).unwrap();
    let _mount = v.mount_env(&mnt, &menv);
    let img = std::fs::File::create(mnt.join("nbd.img")).unwrap();
    img.set_len(8 << 20).unwrap();
    drop(img);
    let (_nbd, uri) = v.nbd_env("/nbd.img", &tmp.path().join("nbd.sock"), &nenv);
    let work = tmp.path().join("fio");
    let on_mount = FioLoop::on_mount(&mnt, &work);
    let on_nbd = FioLoop::on_nbd(&uri, &work);

    let lib = Volume::from_source(&Source::parse(&v.source("")).unwrap()).unwrap();
    assert!(
        lib.graph_version() > 0,
        "a managed volume's graph has a version"
    );
    let (fd, _) = block_on(lib.create("held-0", libc::O_RDWR | libc::O_CREAT, 0o644)).unwrap();
    write_and_check(&lib, &fd, 0);
    on_mount.one_more(120);
    on_nbd.one_more(120);

    let switches = 4;
    for k in 1..=switches {
        let was = lib.graph_version();
        let old: Vec<Arc<kiln_client::Client>> = lib.clients();
        v.mgmt(&["volume", "set", "gs", "io-timeout", &(20 + k).to_string()]);
        wait_for("the library to switch", 30, || lib.graph_version() > was);
        // New connections (the protocol-clients' timeout changed) …
        let new = lib.clients();
        assert!(new.iter().all(|c| old.iter().all(|o| !Arc::ptr_eq(c, o))));
        // … the held file moved to them (under the name it was renamed to) …
        write_and_check(&lib, &fd, k);
        // … and the old ones closed, as nothing uses them any more.
        wait_for("the old graph's connections to close", 30, || {
            old.iter().all(|c| c.is_dead())
        });
        block_on(lib.rename(&format!("held-{}", k - 1), &format!("held-{k}"), 0)).unwrap();
        // The mount and the export switched too, and let their old connections go.
        for (who, log) in [("mount", &mlog), ("export", &nlog)] {
            wait_for(&format!("the {who} to switch"), 60, || {
                count(log, "graph version") >= k
                    && count(log, "not in the volume's graph any more") >= 2 * k
            });
        }
        on_mount.one_more(120);
        on_nbd.one_more(120);
    }
    let (m_runs, m_fail) = on_mount.finish();
    let (n_runs, n_fail) = on_nbd.finish();
    assert!(
        m_fail.is_empty() && n_fail.is_empty(),
        "I/O errors across graph switches:\n{}\n{}",
        m_fail.join("\n"),
        n_fail.join("\n")
    );
    assert!(m_runs > switches as u64 && n_runs > switches as u64);
    // What the held file holds, seen through the mount under its last name.
    block_on(lib.close(fd)).unwrap();
    let data = std::fs::read(mnt.join(format!("held-{switches}"))).unwrap();
    let want: Vec<u8> = (0..=switches).flat_map(block).collect();
    assert!(data == want, "the held file's blocks differ");
}

fn a_replica_graph_change_keeps_the_connections() {
    let tmp = tempfile::tempdir().unwrap();
    let _reaper = BrickReaper(tmp.path().join("state"));
    let v = Vol::with_bricks(tmp.path(), "gr", 3, 3, &["--brick-port-base", "25150"]);
    std::env::set_var("KILN_GRAPH_POLL_MS", "100");
    let lib = {
        std::env::set_var("KILN_SECRET_FILE", &v.secret);
        Volume::from_source(&Source::parse(&v.source("")).unwrap()).unwrap()
    };
    let (fd, _) = block_on(lib.create("f", libc::O_RDWR | libc::O_CREAT, 0o644)).unwrap();
    write_and_check(&lib, &fd, 0);
    let was = lib.graph_version();
    let old = lib.clients();
    v.mgmt(&["volume", "set", "gr", "io-timeout", "9"]);
    wait_for("the library to switch", 30, || lib.graph_version() > was);
    let new = lib.clients();
    assert_eq!(old.len(), 3);
    assert!(
        new.iter().zip(&old).all(|(n, o)| Arc::ptr_eq(n, o)),
        "a replica set's connections were replaced"
    );
    write_and_check(&lib, &fd, 1);
    assert!(old.iter().all(|c| !c.is_dead()));
}
