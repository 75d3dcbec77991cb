//! Watching: WATCH requests, what each fop changes, and the push frames that tell watchers
//! (see [`crate::watch`]).

use kiln_layer::requests;
use kiln_proto::ops::{By, Effects};

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
    /// the handle's path: from the fop table's effects ([`Op::effects`]) of the paths the
    /// request names, or of the path a handle was opened by. Arguments that do not decode
    /// change nothing (the fop refuses them).
    pub(super) fn changes_of(&self, op: Op, args: &[u8]) -> Option<Changing> {
        let effects = op.effects();
        // Opens always: a handle keeps its path for changes made through it after a watcher
        // comes.
        let opens = effects.any(Effects::OPENS);
        if effects.is_empty() || (!opens && !self.watchers.any()) {
            return None;
        }
        let paths = match op.by() {
            By::Conn => return None,
            // Every handle fop's arguments start with its handle.
            By::Handle => {
                let fh = HandleReq::from_wire(&args[..args.len().min(8)]).ok()?.fh;
                vec![self.handle_paths.get(&fh)?.clone()]
            }
            By::Path => requests::named_paths(op, args)?,
        };
        let truncates =
            requests::open_flags(op, args).is_some_and(|f| f & libc::O_TRUNC as u32 != 0);
        let kind = effects.pushed(truncates);
        if kind == 0 && !opens {
            return None; // a heal beginning: nothing a watcher caches
        }
        Some(Changing {
            changes: match kind {
                0 => Vec::new(),
                _ => paths.iter().map(|p| (p.clone(), kind)).collect(),
            },
            opened: opens.then(|| paths.into_iter().next()).flatten(),
        })
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
