//! Watching: WATCH requests, what each fop changes, and the push frames that tell watchers
//! (see [`crate::watch`]).

use kiln_proto::ops::{CHANGE_ATTR, CHANGE_DATA, CHANGE_NAME};

use super::*;

impl Conn {
    /// WATCH: starts or stops this connection's pushes.
    pub(super) fn watch_req(&mut self, args: &[u8]) -> Result<Step, Fail> {
        let req = WatchReq::from_wire(args)?;
        if req.on {
            self.watch = Some(self.watchers.add(self.conn_id));
        } else {
            self.watchers.remove(self.conn_id);
            self.watch = None;
        }
        tracing::debug!(peer = %self.peer, on = req.on, "watch");
        Ok(Step::Now(Vec::new(), Body::None))
    }

    /// What `op` with `args` (credentials taken off) will change, if anything, and for opens
    /// the handle's path. Arguments that do not decode change nothing (the fop refuses them).
    pub(super) fn changes_of(&self, op: Op, args: &[u8]) -> Option<Changing> {
        // Opens always: a handle keeps its path for changes made through it after a watcher
        // comes.
        if !matches!(op, Op::Open | Op::HealOpen | Op::Create) && !self.watchers.any() {
            return None;
        }
        let one = |path: String, kind: u8| Changing {
            changes: vec![(path, kind)],
            opened: None,
        };
        match op {
            Op::Open | Op::HealOpen => {
                let req = OpenReq::from_wire(args).ok()?;
                let trunc = req.flags & libc::O_TRUNC as u32 != 0;
                Some(Changing {
                    changes: match trunc {
                        true => vec![(req.path.clone(), CHANGE_DATA)],
                        false => Vec::new(),
                    },
                    opened: Some(req.path),
                })
            }
            Op::Create => {
                let req = CreateReq::from_wire(args).ok()?;
                Some(Changing {
                    changes: vec![(req.path.clone(), CHANGE_NAME | CHANGE_DATA)],
                    opened: Some(req.path),
                })
            }
            Op::Write | Op::WriteMarked | Op::Fallocate | Op::Discard | Op::Fsetattr => {
                // Every handle fop's arguments start with its handle.
                let fh = HandleReq::from_wire(&args[..args.len().min(8)]).ok()?.fh;
                Some(one(self.handle_paths.get(&fh)?.clone(), CHANGE_DATA))
            }
            Op::Setattr => Some(one(SetattrReq::from_wire(args).ok()?.path, CHANGE_DATA)),
            Op::Unlink | Op::Rmdir => Some(one(PathReq::from_wire(args).ok()?.path, CHANGE_NAME)),
            Op::Mkdir => Some(one(MkdirReq::from_wire(args).ok()?.path, CHANGE_NAME)),
            Op::Mknod => Some(one(MknodReq::from_wire(args).ok()?.path, CHANGE_NAME)),
            Op::Symlink => Some(one(SymlinkReq::from_wire(args).ok()?.path, CHANGE_NAME)),
            Op::Link => {
                let req = LinkReq::from_wire(args).ok()?;
                Some(Changing {
                    changes: vec![(req.existing, CHANGE_ATTR), (req.path, CHANGE_NAME)],
                    opened: None,
                })
            }
            Op::Rename => {
                let req = RenameReq::from_wire(args).ok()?;
                Some(Changing {
                    changes: vec![(req.from, CHANGE_NAME), (req.to, CHANGE_NAME)],
                    opened: None,
                })
            }
            Op::Setxattr => Some(one(SetxattrReq::from_wire(args).ok()?.path, CHANGE_ATTR)),
            Op::Removexattr => Some(one(XattrReq::from_wire(args).ok()?.path, CHANGE_ATTR)),
            _ => None,
        }
    }

    /// Request `id` is done: its changes go to the watchers; the path its handle (if it
    /// opened one) was opened by.
    pub(super) fn changes_done(&mut self, id: u64) -> Option<String> {
        if self.changing.is_empty() {
            // Most replies: reads and other fops that change nothing.
            return None;
        }
        let c = self.changing.remove(&id)?;
        self.watchers.publish(self.conn_id, &c.changes);
        c.opened
    }

    /// Queues push frames for what waits in this connection's watcher, while replies do not
    /// back up (what cannot go now waits, coalesced, in the watcher).
    pub(super) fn queue_pushes(&mut self) {
        let Some(w) = self.watch.clone() else {
            return;
        };
        while self.out_bytes < OUT_HIGH_WATER {
            let Some(c) = w.take() else {
                return;
            };
            let args = c.to_wire();
            let mut head = Vec::with_capacity(HEADER_LEN + args.len());
            head.extend_from_slice(&Header::push(args.len() as u32).to_bytes());
            head.extend_from_slice(&args);
            // Not a request's reply, but sent like one: `reply_sent` counts it off.
            self.inflight += 1;
            self.push(OutReply {
                head,
                body: Body::None,
                sent: 0,
                stamp_at: None,
                stamps_next: false,
            });
        }
    }
}
