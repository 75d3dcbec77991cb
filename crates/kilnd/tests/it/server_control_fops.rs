//! Replication control and directory layouts travel as typed fops, and Kiln's own xattrs are
//! not a client's to change: against a kilnd running a replica brick's stack (io-stats → marks
//! → dispatch → posix).

use std::path::Path;
use std::process::Child;
use std::sync::Arc;

use kiln_client::protocol::ProtocolClient;
use kiln_client::{block_on, Client};
use kiln_layer::distribute::{Layout, LAYOUT_XATTR};
use kiln_layer::marks::{HealReq, LockReq, Mark, WHOLE};
use kiln_layer::{Ctx, Layer};
use kiln_proto::ops::PROFILE_INFO;

use crate::common;

struct Brick {
    child: Child,
    addr: String,
    log: std::path::PathBuf,
    dir: tempfile::TempDir,
}

impl Drop for Brick {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Brick {
    fn start() -> Brick {
        let dir = tempfile::tempdir().unwrap();
        let brick = dir.path().join("brick");
        std::fs::create_dir(&brick).unwrap();
        let vf = dir.path().join("brick.vol");
        std::fs::write(&vf, kiln_server::replica_volfile(&brick, "brick").to_toml()).unwrap();
        let log = dir.path().join("kilnd.log");
        let args = [
            "--volfile".as_ref(),
            vf.as_os_str(),
            "--metrics".as_ref(),
            "off".as_ref(),
        ];
        let (child, addr) = common::spawn_kilnd(&args, Some(&log));
        Brick {
            child,
            addr,
            log,
            dir,
        }
    }

    fn dir(&self) -> std::path::PathBuf {
        self.dir.path().join("brick")
    }
}

/// The raw value of xattr `name` on `p`, or the errno.
fn xattr(p: &Path, name: &str) -> Result<Vec<u8>, i32> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(p.as_os_str().as_bytes()).unwrap();
    let name = std::ffi::CString::new(name).unwrap();
    let mut buf = vec![0u8; 4096];
    // SAFETY: valid C strings and a buffer of the length given, all alive for the call.
    let n = unsafe {
        libc::lgetxattr(
            path.as_ptr(),
            name.as_ptr(),
            buf.as_mut_ptr().cast(),
            buf.len(),
        )
    };
    if n < 0 {
        return Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(0));
    }
    buf.truncate(n as usize);
    Ok(buf)
}

fn errno<T: std::fmt::Debug>(r: std::io::Result<T>) -> i32 {
    r.expect_err("refused").raw_os_error().unwrap_or(0)
}

#[test]
fn reserved_xattrs_are_refused_at_the_brick_and_logged() {
    let b = Brick::start();
    let c = Client::connect(&b.addr).unwrap();
    block_on(c.mkdir("d", 0o755)).unwrap();
    let forged = Layout::equal(1).encode();
    assert_eq!(
        errno(block_on(c.setxattr("", LAYOUT_XATTR, &forged, 0))),
        libc::EPERM,
        "the brick root's layout"
    );
    assert_eq!(
        errno(block_on(c.setxattr("d", "trusted.kiln.anything", b"x", 0))),
        libc::EPERM
    );
    assert_eq!(
        errno(block_on(c.removexattr("d", LAYOUT_XATTR))),
        libc::EPERM
    );
    assert_eq!(
        errno(block_on(c.setxattr("d", "security.selinux", b"x", 0))),
        libc::EOPNOTSUPP
    );
    // The old untyped side channel is gone: a `kiln.` name is just a name, which the file
    // system refuses (no such namespace).
    let old = Mark {
        target: 1,
        offset: 0,
        len: 4096,
    };
    use kiln_proto::codec::Wire;
    assert!(block_on(c.setxattr("d", "kiln.pending.add", &old.to_wire(), 0)).is_err());
    // Ordinary xattrs still work.
    block_on(c.setxattr("d", "user.note", b"kept", 0)).unwrap();
    assert_eq!(xattr(&b.dir().join("d"), "user.note"), Ok(b"kept".to_vec()));
    // Nothing reached the brick directory.
    assert_eq!(xattr(&b.dir(), LAYOUT_XATTR), Err(libc::ENODATA));
    assert_eq!(xattr(&b.dir().join("d"), LAYOUT_XATTR), Err(libc::ENODATA));
    let pc = ProtocolClient::new("b", Arc::new(c));
    let idx = block_on(pc.pending_index(&Ctx::NONE, "", &())).unwrap();
    assert!(idx.entries.0.is_empty(), "no mark was made: {idx:?}");
    drop(pc);
    let log = std::fs::read_to_string(&b.log).unwrap();
    assert!(
        log.matches("refused a change of a reserved xattr").count() >= 4,
        "every refusal is logged:\n{log}"
    );
}

#[test]
fn control_fops_are_typed_checked_and_counted() {
    let b = Brick::start();
    let c = Arc::new(Client::connect(&b.addr).unwrap());
    let (fh, _) = block_on(c.create("f", libc::O_RDWR, 0o644)).unwrap();
    block_on(c.close(fh)).unwrap();
    block_on(c.mkdir("d", 0o755)).unwrap();
    let pc = ProtocolClient::new("b", c.clone());
    let cx = Ctx::NONE;

    // Marks: added, listed per file and in the index, cleared.
    let m = Mark {
        target: 2,
        offset: 4096,
        len: 8192,
    };
    block_on(pc.mark_add(&cx, "f", &m)).unwrap();
    let page = block_on(pc.pending(&cx, "f", &())).unwrap();
    let t = &page.targets.0[0];
    assert_eq!((t.target, t.ranges.0.len()), (2, 1));
    assert_eq!((t.ranges.0[0].offset, t.ranges.0[0].len), (4096, 8192));
    let idx = block_on(pc.pending_index(&cx, "", &())).unwrap();
    assert_eq!(idx.entries.0.len(), 1);
    assert_eq!(
        (idx.entries.0[0].path.as_str(), idx.entries.0[0].bytes),
        ("f", 8192)
    );
    let all = Mark {
        offset: 0,
        len: WHOLE,
        ..m
    };
    block_on(pc.mark_clear(&cx, "f", &all)).unwrap();
    assert!(block_on(pc.pending(&cx, "f", &()))
        .unwrap()
        .targets
        .0
        .is_empty());

    // Heal sessions and locks answer for the caller.
    block_on(pc.heal_session(&cx, "f", &HealReq { begin: 1 })).unwrap();
    assert_eq!(block_on(pc.heal_info(&cx, "f", &())).unwrap().live, 1);
    let lock = LockReq {
        offset: 0,
        len: 4096,
        lock: 1,
    };
    block_on(pc.heal_lock(&cx, "f", &lock)).unwrap();
    block_on(pc.heal_lock(&cx, "f", &LockReq { lock: 0, ..lock })).unwrap();
    block_on(pc.heal_session(&cx, "f", &HealReq { begin: 0 })).unwrap();
    assert_eq!(block_on(pc.heal_info(&cx, "f", &())).unwrap().live, 0);
    let hfd = block_on(pc.heal_open(&cx, "f", libc::O_WRONLY as u32)).unwrap();
    block_on(pc.release(&cx, hfd)).unwrap();

    // Paths are checked like any fop's.
    assert!(block_on(pc.mark_add(&cx, "../outside", &m)).is_err());
    assert!(block_on(pc.mark_add(&cx, ".kiln/pending.log", &m)).is_err());

    // Layouts: only a well-formed one is stored, and it reads back.
    assert_eq!(
        block_on(pc.layout_set(&cx, "d", &b"not a layout".to_vec())),
        Err(libc::EINVAL as u32)
    );
    assert_eq!(xattr(&b.dir().join("d"), LAYOUT_XATTR), Err(libc::ENODATA));
    let good = Layout::equal(3).encode();
    block_on(pc.layout_set(&cx, "d", &good)).unwrap();
    assert_eq!(block_on(pc.layout_get(&cx, "d", &())), Ok(good.clone()));
    assert_eq!(xattr(&b.dir().join("d"), LAYOUT_XATTR), Ok(good));

    // io-stats names and counts them like any fop.
    let report = c.profile(PROFILE_INFO).unwrap();
    let text = report.to_string();
    for (fop, calls) in [
        ("markadd", 3),
        ("markclear", 1),
        ("pending", 2),
        ("pendingindex", 1),
        ("healsession", 2),
        ("healinfo", 2),
        ("heallock", 2),
        ("healopen", 1),
        ("layoutset", 2),
        ("layoutget", 1),
    ] {
        let found = report["points"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|p| p["cumulative"]["fops"].as_array())
            .flatten()
            .find(|r| r["fop"] == fop)
            .unwrap_or_else(|| panic!("{fop} is not in the brick's profile: {text}"));
        assert_eq!(found["calls"], calls, "{fop}: {found}");
    }
}
