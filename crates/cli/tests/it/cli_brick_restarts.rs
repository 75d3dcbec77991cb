//! No I/O error a guest would see when bricks restart: a managed volume is mounted
//! (`kiln mount`, vm-image mode) and exported (`kiln nbd`), fio writes and verifies through
//! both without pause, and its bricks are killed and brought back again and again. Every fio
//! run must finish with no error and every block verified.
//!
//! Replica 3: 20 restarts — one brick killed (`SIGKILL`) and started again
//! (`kiln volume start VOL force`), or every brick restarted one after another by
//! `kiln volume set VOL allow all`. One brick: 5 restarts, each back within 10 s, while the
//! I/O waits for it (the volume's `io-timeout`, 30 s by default).

use std::path::Path;
use std::time::Duration;

use crate::common;
use common::fio::{need_fio, FioLoop};
use common::managed::Vol;
use common::{kill_brick_pid, BrickReaper};

/// Mounts and exports the volume `v`, runs both fio loops, and calls `restart(k)` for each
/// of `restarts`; every fio run must succeed.
fn survive(tmp: &Path, v: &Vol, restarts: usize, restart: impl Fn(usize)) {
    let mnt = tmp.join("mnt");
    std::fs::create_dir_all(&mnt).unwrap();
    let _mount = v.mount(&mnt);
    // The NBD image is made through the mount: an export needs an existing file.
    let img = std::fs::File::create(mnt.join("nbd.img")).unwrap();
    img.set_len(8 << 20).unwrap();
    drop(img);
    let sock = tmp.join("nbd.sock");
    let (_nbd, uri) = v.nbd("/nbd.img", &sock);
    let work = tmp.join("fio");
    let on_mount = FioLoop::on_mount(&mnt, &work);
    let on_nbd = FioLoop::on_nbd(&uri, &work);
    on_mount.one_more(120);
    on_nbd.one_more(120);
    for k in 0..restarts {
        restart(k);
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while !v.all_online() {
            if std::time::Instant::now() > deadline {
                // What kilnd saw, for the next one to read this.
                let log = v.kd.log_text();
                let tail: Vec<&str> = log.lines().rev().take(40).collect();
                panic!(
                    "restart {k}: bricks not all back in 30 s: {}\nkilnd log (last lines first):\n{}",
                    v.status(),
                    tail.join("\n")
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        // I/O went through the restart: runs in progress then have finished since.
        on_mount.one_more(120);
        on_nbd.one_more(120);
    }
    let (m_runs, m_fail) = on_mount.finish();
    let (n_runs, n_fail) = on_nbd.finish();
    assert!(
        m_fail.is_empty() && n_fail.is_empty(),
        "I/O errors across brick restarts:\n{}\n{}",
        m_fail.join("\n"),
        n_fail.join("\n")
    );
    assert!(m_runs > restarts as u64 && n_runs > restarts as u64);
}

fn kill_brick(v: &Vol, i: usize) {
    kill_brick_pid(v.pid(i));
}

#[test]
fn replica3_mount_and_nbd_see_no_error_over_20_brick_restarts() {
    need_fio();
    let tmp = tempfile::tempdir().unwrap();
    let _reaper = BrickReaper(tmp.path().join("state"));
    let v = Vol::new(tmp.path(), "rr", 3, "24900");
    survive(tmp.path(), &v, 20, |k| {
        if k % 4 == 3 {
            // Every brick, one after another.
            v.mgmt(&["volume", "set", "rr", "allow", "all"]);
        } else {
            kill_brick(&v, k % 3);
            v.mgmt(&["volume", "start", "rr", "force"]);
        }
    });
}

#[test]
fn a_single_brick_volume_waits_for_its_brick_over_5_restarts() {
    need_fio();
    let tmp = tempfile::tempdir().unwrap();
    let _reaper = BrickReaper(tmp.path().join("state"));
    let v = Vol::new(tmp.path(), "one", 1, "24950");
    survive(tmp.path(), &v, 5, |_| {
        kill_brick(&v, 0);
        // Away for 2 s (the outage, not a synchronisation): the I/O in flight waits.
        std::thread::sleep(Duration::from_secs(2));
        v.mgmt(&["volume", "start", "one", "force"]);
    });
}
