//! Storage calls as the caller: the brick (root) switches the calling thread's filesystem
//! identity — `setfsuid`, `setfsgid` and the supplementary groups — for the span of one fop's
//! synchronous system calls, and back before anything else runs on the thread. The kernel
//! then checks access and assigns ownership exactly as it would for the caller: new files
//! belong to the caller (group from the caller or a setgid parent) from the moment they exist.
//!
//! All three calls are per-thread on Linux when made as raw system calls (glibc's `setgroups`
//! wrapper would change every thread of the process, so it is not used).

use std::sync::OnceLock;

use kiln_proto::Cred;

use crate::{errno, FopResult};

/// The process's own identity, read once: what every switch returns to.
struct Own {
    root: bool,
    groups: Vec<libc::gid_t>,
}

fn own() -> &'static Own {
    static OWN: OnceLock<Own> = OnceLock::new();
    OWN.get_or_init(|| {
        // SAFETY: geteuid has no preconditions.
        let root = unsafe { libc::geteuid() } == 0;
        let mut groups = vec![0 as libc::gid_t; 1024];
        // SAFETY: `groups` has room for the 1024 entries the call is told about.
        let n = unsafe { libc::getgroups(groups.len() as i32, groups.as_mut_ptr()) };
        groups.truncate(n.max(0) as usize);
        Own { root, groups }
    })
}

/// Sets this thread's supplementary groups.
fn set_groups(groups: &[libc::gid_t]) -> bool {
    // SAFETY: the pointer and length describe `groups`, which outlives the call; the raw
    // system call changes only this thread's credentials.
    unsafe { libc::syscall(libc::SYS_setgroups, groups.len(), groups.as_ptr()) == 0 }
}

/// Sets this thread's filesystem ids; true when the kernel took them.
fn set_fs_ids(uid: u32, gid: u32) -> bool {
    // SAFETY: setfsgid/setfsuid take plain ids and change only this thread; each returns the
    // previous id, so a second call with an invalid id (-1) reads back what is in force.
    unsafe {
        libc::setfsgid(gid);
        libc::setfsuid(uid);
        libc::setfsuid(u32::MAX) as u32 == uid && libc::setfsgid(u32::MAX) as u32 == gid
    }
}

/// Who root becomes under root squash: nobody, in no group but nogroup.
pub(super) fn nobody() -> Cred {
    Cred {
        uid: 65534,
        gid: 65534,
        groups: Vec::new(),
    }
}

/// The caller's identity on this thread until dropped.
pub(super) struct AsCaller {
    switched: bool,
}

impl AsCaller {
    /// Takes on `cred` (nothing to do for none or root). A brick that does not run as root
    /// cannot take on another user's identity and refuses such a request with EPERM.
    pub(super) fn new(cred: Option<&Cred>) -> FopResult<AsCaller> {
        let Some(c) = cred.filter(|c| !c.is_root()) else {
            return Ok(AsCaller { switched: false });
        };
        if !own().root {
            tracing::warn!(
                uid = c.uid,
                "a request on behalf of uid {} refused: the brick does not run as root",
                c.uid
            );
            return Err(errno::EPERM);
        }
        let me = AsCaller { switched: true };
        if !set_groups(&c.groups) || !set_fs_ids(c.uid, c.gid) {
            tracing::warn!(
                uid = c.uid,
                gid = c.gid,
                "cannot take on a caller's credentials"
            );
            return Err(errno::EPERM);
        }
        Ok(me)
    }
}

impl Drop for AsCaller {
    fn drop(&mut self) {
        if self.switched && !(set_fs_ids(0, 0) && set_groups(&own().groups)) {
            // Going on with a user's identity on a thread that serves everyone would be
            // worse than stopping.
            tracing::error!("cannot return a brick thread to its own credentials; aborting");
            std::process::abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fs_ids() -> (u32, u32) {
        // SAFETY: an invalid id (-1) changes nothing and returns the id in force.
        unsafe {
            (
                libc::setfsuid(u32::MAX) as u32,
                libc::setfsgid(u32::MAX) as u32,
            )
        }
    }

    #[test]
    fn files_made_as_a_caller_are_theirs_and_the_thread_returns_to_root() {
        if !own().root {
            eprintln!("skipped: needs root");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(
            dir.path(),
            std::os::unix::fs::PermissionsExt::from_mode(0o777),
        )
        .unwrap();
        let cred = Cred {
            uid: 4242,
            gid: 4343,
            groups: vec![4444],
        };
        {
            let _as = AsCaller::new(Some(&cred)).unwrap();
            assert_eq!(fs_ids(), (4242, 4343));
            std::fs::write(dir.path().join("mine"), b"x").unwrap();
            // Root's file with mode 0600 is out of reach now.
            assert!(std::fs::read("/etc/shadow").is_err());
        }
        assert_eq!(fs_ids(), (0, 0));
        let m = std::os::unix::fs::MetadataExt::uid(
            &std::fs::metadata(dir.path().join("mine")).unwrap(),
        );
        assert_eq!(m, 4242);
        assert!(std::fs::read("/etc/shadow").is_ok());
        // Root and no credentials switch nothing.
        drop(AsCaller::new(None).unwrap());
        drop(AsCaller::new(Some(&Cred::default())).unwrap());
        assert_eq!(fs_ids(), (0, 0));
    }
}
