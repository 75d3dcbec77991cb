//! Who is asking: the credentials of a FUSE request's caller — uid and gid from the request,
//! supplementary groups from `/proc/PID/status` — so the bricks act as that user.
//!
//! The kernel does not pass supplementary groups to FUSE. They are read from the caller's
//! process and kept for [`GROUPS_TTL`] per (pid, uid, gid), so a burst of requests from one
//! process reads `/proc` once; a process that changes its groups is seen within that time
//! (as with GlusterFS's `gid-timeout`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fuser::Request;
use kiln_client::Volume;
use kiln_proto::sync::MutexExt as _;
use kiln_proto::Cred;

use crate::KilnFs;

/// How long a process's supplementary groups are trusted before `/proc` is read again.
pub const GROUPS_TTL: Duration = Duration::from_secs(1);
/// Processes remembered at most; the table is emptied when it grows past this.
const KEEP: usize = 4096;

/// A caller: process, user and primary group.
type Key = (u32, u32, u32);

/// Recent callers' credentials, and when their groups were read.
#[derive(Default)]
pub struct Callers {
    seen: Mutex<HashMap<Key, (Instant, Arc<Cred>)>>,
}

impl Callers {
    /// The credentials of a request from `pid` as `uid`/`gid`. Root's are sent too (a brick
    /// may squash root), without supplementary groups: root needs none to pass a check, and
    /// a squashed root has none.
    pub fn cred(&self, pid: u32, uid: u32, gid: u32) -> Arc<Cred> {
        if uid == 0 {
            static ROOT: std::sync::OnceLock<Arc<Cred>> = std::sync::OnceLock::new();
            if gid == 0 {
                return ROOT.get_or_init(|| Arc::new(Cred::default())).clone();
            }
            return Arc::new(Cred {
                uid,
                gid,
                groups: Vec::new(),
            });
        }
        let key = (pid, uid, gid);
        let now = Instant::now();
        let mut seen = self.seen.locked();
        if let Some((at, c)) = seen.get(&key) {
            if now.duration_since(*at) < GROUPS_TTL {
                return c.clone();
            }
        }
        let c = Arc::new(Cred {
            uid,
            gid,
            groups: proc_groups(pid).unwrap_or_default(),
        });
        if seen.len() >= KEEP {
            seen.clear();
        }
        seen.insert(key, (now, c.clone()));
        c
    }
}

/// True when `a` and `b` are the same caller to a brick: same uid, gid and groups (what one
/// was answered, the other may not be).
pub(crate) fn same_caller(a: &Cred, b: &Cred) -> bool {
    std::ptr::eq(a, b) || a == b
}

impl KilnFs {
    /// The request's caller: the volume on their behalf (name and metadata fops run on the
    /// bricks with their uid, gid and groups), and their credentials — what the mount answers
    /// from what it fetched ahead must have been fetched with the same ones.
    pub(crate) fn asking(&self, req: &Request) -> (Volume, Arc<Cred>) {
        let who = self.callers.cred(req.pid(), req.uid(), req.gid());
        let vol = self.vol.on_behalf_of(Some(who.clone()));
        (vol, who)
    }
}

/// The supplementary groups of process `pid` (the `Groups:` line of its status), or None when
/// it is gone or unreadable — then the request goes with its primary group only.
fn proc_groups(pid: u32) -> Option<Vec<u32>> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    parse_groups(&status)
}

fn parse_groups(status: &str) -> Option<Vec<u32>> {
    let line = status.lines().find_map(|l| l.strip_prefix("Groups:"))?;
    Some(
        line.split_whitespace()
            .filter_map(|g| g.parse().ok())
            .take(kiln_proto::cred::MAX_GROUPS)
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_come_from_the_callers_status() {
        assert_eq!(
            parse_groups("Name:\tx\nGroups:\t4 24 27 \nNSpid:\t1\n"),
            Some(vec![4, 24, 27])
        );
        assert_eq!(parse_groups("Groups:\n"), Some(vec![]));
        assert_eq!(parse_groups("Name:\tx\n"), None);
        let me = std::process::id();
        let callers = Callers::default();
        assert_eq!(*callers.cred(me, 0, 0), Cred::default(), "root, no groups");
        let c = callers.cred(me, 1000, 100);
        assert_eq!((c.uid, c.gid), (1000, 100));
        // Within the TTL the same process gets the same credentials without reading /proc.
        assert!(Arc::ptr_eq(&c, &callers.cred(me, 1000, 100)));
        // A process that is gone: primary group only.
        assert_eq!(callers.cred(u32::MAX, 5, 6).groups, Vec::<u32>::new());
    }
}
