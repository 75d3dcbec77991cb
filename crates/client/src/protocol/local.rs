//! The protocol-client's local short-circuit reads (see [`crate::shortcut`]).

use std::os::fd::OwnedFd;
use std::sync::Arc;

use kiln_layer::{Ctx, FopResult, ReadDst, ReadOut};
use kiln_proto::codec::Wire;
use kiln_proto::ops::{GrantReply, GrantReq};
use kiln_proto::{errno, Op};

use super::{ProtocolClient, RemoteFd};
use crate::shortcut::{copy, Grant, Plan, Table, LARGE};

impl ProtocolClient {
    /// A read on a brick of this host: straight from its file while a grant holds, else
    /// through the brick.
    pub(super) async fn read_local(
        &self,
        cx: &Ctx,
        rfd: &RemoteFd,
        offset: u64,
        dst: ReadDst,
    ) -> FopResult<ReadOut> {
        super::check_len(dst.len())?;
        let (client, gen) = self.current();
        let grant = match rfd.direct.plan(gen) {
            Plan::Direct(g) => Some(g),
            Plan::Ask => self.ask_grant(rfd, gen).await,
            Plan::Brick => None,
        };
        let dst = match grant.filter(|_| !client.is_dead()) {
            Some(g) => match Self::read_direct(g, offset, dst).await {
                Ok(out) => {
                    self.counted(out.len());
                    return Ok(out);
                }
                Err(dst) => {
                    self.stale(rfd);
                    dst
                }
            },
            None => dst,
        };
        self.read_brick(cx, rfd, offset, dst).await
    }

    /// Reads through `g`: large reads into the caller's buffers on the copy thread, others
    /// here. `Err(dst)`: the grant is stale, and `dst` is given back for a read through the
    /// brick.
    async fn read_direct(g: Arc<Grant>, offset: u64, dst: ReadDst) -> Result<ReadOut, ReadDst> {
        match dst {
            ReadDst::Into(bufs) if bufs.len() >= LARGE => match copy(g, bufs, offset).await {
                (Some(n), bufs) => Ok(ReadOut::Into { n, bufs }),
                (None, bufs) => Err(ReadDst::Into(bufs)),
            },
            // SAFETY: the caller's vectors, writable until the read completes.
            ReadDst::Into(bufs) => match unsafe { g.read(bufs.iov(), offset) } {
                Some(n) => Ok(ReadOut::Into { n, bufs }),
                None => Err(ReadDst::Into(bufs)),
            },
            ReadDst::Any(len) => {
                let mut buf = vec![0u8; len as usize];
                let iov = [kiln_proto::iov::RawIov {
                    base: buf.as_mut_ptr() as usize,
                    len: buf.len(),
                }];
                // SAFETY: `buf` is ours and lives across the call.
                match unsafe { g.read(&iov, offset) } {
                    Some(n) => {
                        buf.truncate(n);
                        Ok(ReadOut::Buf(buf))
                    }
                    None => Err(ReadDst::Any(len)),
                }
            }
        }
    }

    /// A direct read found its grant stale: count it, and back off.
    fn stale(&self, rfd: &RemoteFd) {
        self.shortcut
            .stale
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        rfd.direct.dropped();
    }

    /// Reads made straight from the brick's files, and those found stale (done again
    /// through the brick), since the layer was made.
    pub fn short_circuit_counts(&self) -> (u64, u64) {
        use std::sync::atomic::Ordering::Relaxed;
        (
            self.shortcut.direct.load(Relaxed),
            self.shortcut.stale.load(Relaxed),
        )
    }

    /// Reports direct reads not reported yet (a handle closes: its reads show in the brick's
    /// profile at once).
    pub(super) async fn report_now(&self) {
        let (reads, bytes) = self.shortcut.take_report();
        if reads > 0 {
            let _ = self.current().0.report_local_reads(reads, bytes).await;
        }
    }

    /// Counts a direct read, and reports the reads to the brick once a second.
    fn counted(&self, n: usize) {
        if self.shortcut.count(n) {
            let (reads, bytes) = self.shortcut.take_report();
            let client = self.current().0;
            kiln_layer::exec::spawn(async move {
                let _ = client.report_local_reads(reads, bytes).await;
            });
        }
    }

    /// Asks the brick for a grant of `rfd` on connection `gen`.
    async fn ask_grant(&self, rfd: &RemoteFd, gen: u64) -> Option<std::sync::Arc<Grant>> {
        /// Leaves the handle asking no more if this future is dropped mid-request.
        struct Asking<'a>(&'a crate::shortcut::HandleGrant);
        impl Drop for Asking<'_> {
            fn drop(&mut self) {
                self.0.abandoned();
            }
        }
        let _asking = Asking(&rfd.direct);
        match self.grant_call(rfd, gen, false).await {
            Ok((r, Some(table), file)) => Some(
                rfd.direct
                    .granted(Grant::new(file, table, r.slot, r.gen, gen)),
            ),
            Ok(_) => {
                // The table came with a reply handled after this one: later.
                tracing::debug!(layer = self.name, "a grant came before its table");
                rfd.direct.dropped();
                None
            }
            Err(e) => {
                tracing::debug!(layer = self.name, path = rfd.path, "no grant: errno {e}");
                match e {
                    // Not now (a move or heal under way, a lost connection): later.
                    errno::EMOVED | errno::ENOTCONN | errno::ECONNRESET => rfd.direct.dropped(),
                    _ => rfd.direct.refused(),
                }
                None
            }
        }
    }

    /// A read-only descriptor of the brick's file under `rfd`, pinned there while the handle
    /// is open (FUSE passthrough).
    pub(super) async fn pin_file(&self, rfd: &RemoteFd) -> FopResult<OwnedFd> {
        if !self.local || rfd.heal || !self.shortcut.is_on() {
            return Err(errno::EOPNOTSUPP);
        }
        let gen = self.current().1;
        Ok(self.grant_call(rfd, gen, true).await?.2)
    }

    /// GRANT on connection `gen`: the reply, the connection's table (kept when it came with
    /// this reply), and the file.
    async fn grant_call(
        &self,
        rfd: &RemoteFd,
        gen: u64,
        pin: bool,
    ) -> FopResult<(GrantReply, Option<Arc<Table>>, OwnedFd)> {
        let (reads, bytes) = self.shortcut.take_report();
        let args = GrantReq {
            fh: 0,
            reads,
            bytes,
            pin: pin as u8,
        }
        .to_wire();
        let req = self.request(&Ctx::NONE, Op::Grant, args, Some(rfd));
        let reply = self.send(&Ctx::NONE, req, None).await?.result?;
        let r = GrantReply::from_wire(&reply.args).map_err(|_| errno::EPROTO)?;
        let mut fds = reply.fds.into_iter();
        let table = match r.table {
            true => {
                let t = Table::map(fds.next().ok_or(errno::EPROTO)?).map_err(|e| {
                    tracing::warn!(layer = self.name, "cannot map a grant table: {e}");
                    errno::EPROTO
                })?;
                self.shortcut.set_table(gen, t.clone());
                Some(t)
            }
            false => self.shortcut.table(gen),
        };
        let file = fds.next().ok_or(errno::EPROTO)?;
        Ok((r, table, file))
    }
}
