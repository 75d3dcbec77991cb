//! GRANT and what makes grants stale (see [`crate::grants`]).

use kiln_layer::requests;
use kiln_layer::Ctx;
use kiln_proto::codec::Wire;
use kiln_proto::marks::{HealReq, SESSION_FREEZE, SESSION_MIGRATE};
use kiln_proto::ops::{By, Effects, GrantReply, GrantReq, HandleReq, GRANT_PIN, GRANT_SUMS};
use kiln_proto::{errno, Op};

use crate::grants::{self, Table};

use super::*;

impl Conn {
    /// GRANT: counts the client's direct reads, then (for a handle) answers with a read-only
    /// descriptor of its file, and the table with the first grant.
    pub(super) fn grant(&mut self, args: &[u8], cx: &Ctx) -> Result<Step, Fail> {
        let req = GrantReq::from_wire(args)?;
        if req.reads > 0 {
            self.count_local_reads(req.reads, req.bytes);
        }
        if req.fh == 0 {
            return Ok(Step::Now(Vec::new(), Body::None));
        }
        if !self.local {
            return Err(Fail::Errno(errno::EOPNOTSUPP));
        }
        let fd = self.handle(req.fh)?;
        let file = self.stack.backing(cx, &fd)?;
        // A write-only handle gives no right to read.
        let mode =
            rustix::fs::fcntl_getfl(file).map_err(|e| Fail::Errno(e.raw_os_error() as u32))?;
        if mode & rustix::fs::OFlags::RWMODE == rustix::fs::OFlags::WRONLY {
            return Err(Fail::Errno(errno::EBADF));
        }
        let io = |e: io::Error| Fail::Errno(e.raw_os_error().unwrap_or(libc::EIO) as u32);
        let ino = grants::inode_of(file).map_err(io)?;
        let copy = grants::reopen_read_only(file).map_err(io)?;
        let first = self.mine.table.is_none();
        if first {
            self.mine.table = Some(Table::new().map_err(|e| {
                tracing::warn!("cannot make a grant table: {e}");
                io(e)
            })?);
        }
        let (table, slot) = self
            .mine
            .slot_for(req.fh, ino)
            .ok_or(Fail::Errno(libc::ENOSPC as u32))?;
        if req.pin & GRANT_PIN != 0 && self.mine.pinned.insert(req.fh, ino).is_none() {
            self.grants.pin(ino);
        }
        self.grants.add(ino, self.conn_id, &table, slot);
        // Read after the grant is recorded: a change that begins from now on bumps past it.
        let gen = table.value(slot);
        let mut fds = Vec::with_capacity(2);
        if first {
            fds.push(table.memfd().try_clone().map_err(io)?);
        }
        fds.push(copy);
        if req.pin & GRANT_SUMS != 0 {
            // Without them the reader reads unchecked, as from a brick that keeps none.
            if let Ok(Some(sums)) = self.stack.backing_sums(cx, &fd) {
                fds.push(sums.into());
            }
        }
        let reply = GrantReply {
            slot,
            gen,
            table: first,
        };
        Ok(Step::Now(reply.to_wire(), Body::Fds(fds)))
    }

    fn count_local_reads(&self, reads: u64, bytes: u64) {
        let mut found = false;
        let mut f = |l: &dyn kiln_layer::Layer| {
            if found {
                return;
            }
            if let Some(s) = l
                .as_any()
                .and_then(|a| a.downcast_ref::<kiln_layer::layers::iostats::IoStats>())
            {
                s.data().record_untimed(Op::LocalRead, reads, bytes);
                found = true;
            }
        };
        f(&*self.stack);
        self.stack.visit(&mut f);
    }

    /// Before a fop runs: bumps the grants it could make stale, from the fop table's effects
    /// ([`Op::effects`]). Writes and size changes through a handle bump other connections'
    /// grants of that file; a size change, removal or replacement by name, a truncating open,
    /// or a heal or migration session beginning bumps every grant (which file a name is would
    /// take a lookup). One relaxed load when no grant is alive.
    pub(super) fn before_change(&mut self, op: Op, args: &[u8]) {
        if !self.grants.any() {
            return;
        }
        let effects = op.effects();
        if op.by() == By::Handle && effects.any(Effects::DATA) {
            // Every handle fop's arguments start with its handle.
            let Ok(req) = HandleReq::from_wire(&args[..args.len().min(8)]) else {
                return;
            };
            match self.inode_of_handle(req.fh) {
                Some(ino) => self.grants.changing(ino, self.conn_id),
                None => self.grants.changing_all(),
            }
        } else if effects.any(Effects::DATA.and(Effects::REMOVES).and(Effects::HEAL))
            || (effects.any(Effects::TRUNC)
                && requests::open_flags(op, args).is_none_or(|f| f & libc::O_TRUNC as u32 != 0))
        {
            self.grants.changing_all();
        }
    }

    /// A migration may not begin, nor freeze, a pinned file (its passthrough readers could not
    /// follow it): `EBUSY`, and the rebalance leaves the file where it is. (A pin taken between
    /// the two is refused by the marks layer: no grant while a migration session lives.)
    pub(super) fn refuse_pinned(&self, args: &[u8]) -> Result<(), Fail> {
        let Ok((path, req)) = <(String, HealReq)>::from_wire(args) else {
            return Ok(()); // the fop itself reports bad arguments
        };
        let moving = req.begin == SESSION_MIGRATE || req.begin == SESSION_FREEZE;
        if !moving || !self.grants.any_pins() {
            return Ok(());
        }
        let attr = kiln_layer::exec::block_on(self.stack.lookup(&Ctx::NONE, &path));
        match attr {
            Ok(a) if self.grants.pinned(a.ino) => {
                tracing::info!(path, "not moved: a local reader has it open past the brick");
                Err(Fail::Errno(libc::EBUSY as u32))
            }
            _ => Ok(()),
        }
    }

    /// The file a handle has open: a granted handle's is known; others are learned once.
    fn inode_of_handle(&mut self, fh: u64) -> Option<grants::Inode> {
        if let Some(&(_, i)) = self.mine.by_fh.get(&fh) {
            return Some(i);
        }
        if let Some(i) = self.mine.inodes.get(&fh) {
            return Some(*i);
        }
        let fd = self.handles.get(&fh)?;
        let file = self
            .stack
            .backing(&Ctx::NONE.with_owner(self.conn_id), fd)
            .ok()?;
        let ino = grants::inode_of(file).ok()?;
        self.mine.inodes.insert(fh, ino);
        Some(ino)
    }

    /// A handle was released: its grant ends.
    pub(super) fn released(&mut self, fh: u64) {
        self.mine.release(&self.grants, self.conn_id, fh);
    }
}
