//! The protocol-client's local short-circuit reads (see [`crate::shortcut`]).

use std::os::fd::OwnedFd;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Weak};

use kiln_layer::{Ctx, FopResult, ReadDst, ReadOut};
use kiln_proto::codec::Wire;
use kiln_proto::ops::{GrantReply, GrantReq, GRANT_PIN, GRANT_SUMS};
use kiln_proto::sync::MutexExt as _;
use kiln_proto::{errno, Op};

use super::{Link, ProtocolClient, RemoteFd};
use crate::client::Client;
use crate::shortcut::{copy, Grant, Plan, Shortcut, Sums, Table, LARGE};
use kiln_layer::exec::block_on;

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
            Ok((r, Some(table), file, sums)) => Some(
                rfd.direct
                    .granted(Grant::new(file, sums, table, r.slot, r.gen, gen)),
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
    pub(super) async fn pin_file(&self, rfd: &Arc<RemoteFd>) -> FopResult<OwnedFd> {
        if !self.local || rfd.heal || !self.shortcut.is_on() {
            return Err(errno::EOPNOTSUPP);
        }
        // Listed before asking, so that a reconnect in between pins it again too.
        {
            let mut pins = self.link.pins.locked();
            pins.retain(|w| w.strong_count() > 0);
            pins.push(Arc::downgrade(rfd));
        }
        let gen = self.current().1;
        match self.grant_call(rfd, gen, true).await {
            Ok((_, _, file, _)) => {
                rfd.pinned.store(inode(&file).unwrap_or(0), Relaxed);
                Ok(file)
            }
            Err(e) => {
                self.link
                    .pins
                    .locked()
                    .retain(|w| !std::ptr::eq(w.as_ptr(), Arc::as_ptr(rfd)));
                Err(e)
            }
        }
    }

    /// GRANT on connection `gen`: the reply, the connection's table (kept when it came with
    /// this reply), the file, and its block checksums if it keeps them (asked for when the
    /// brick offers them; a pinned file's reader is the kernel, which checks none).
    async fn grant_call(
        &self,
        rfd: &RemoteFd,
        gen: u64,
        pin: bool,
    ) -> FopResult<(GrantReply, Option<Arc<Table>>, OwnedFd, Option<Sums>)> {
        let (reads, bytes) = self.shortcut.take_report();
        let sums = !pin && self.current().0.ships_sums();
        let args = GrantReq {
            fh: 0,
            reads,
            bytes,
            pin: if pin { GRANT_PIN } else { 0 } | if sums { GRANT_SUMS } else { 0 },
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
        let sums = match fds.next() {
            Some(fd) if sums => Some(Sums::map(fd).map_err(|e| {
                tracing::warn!(layer = self.name, "cannot map a file's checksums: {e}");
                errno::EPROTO
            })?),
            _ => None,
        };
        Ok((r, table, file, sums))
    }
}

/// The inode number of an open file.
fn inode(f: &OwnedFd) -> std::io::Result<u64> {
    Ok(rustix::fs::fstat(f)?.st_ino)
}

/// After a reconnect, before the new connection (`client`, generation `gen`) is published:
/// pins every pinned handle's file again on it. A brick's pins live with the connection (and
/// a brick that restarted has none), so without this a rebalance could move a file that the
/// kernel reads straight from. Runs on the reconnect thread; gives the new handle numbers,
/// for [`adopt`] once the connection is published.
pub(super) fn repin(
    link: &Link,
    name: &str,
    client: &Client,
    gen: u64,
    shortcut: &Shortcut,
) -> Vec<(Arc<RemoteFd>, u64)> {
    let pins: Vec<Arc<RemoteFd>> = {
        let mut pins = link.pins.locked();
        pins.retain(|w| w.strong_count() > 0);
        pins.iter().filter_map(Weak::upgrade).collect()
    };
    // Bounded: a brick that accepts the connection and then stalls must not hold back every
    // request waiting for the reconnect.
    let deadline = std::time::Instant::now() + REPIN_PATIENCE;
    let mut out = Vec::new();
    for rfd in pins.into_iter().filter(|r| !r.released.load(Relaxed)) {
        let r = block_on(kiln_layer::timer::within(
            deadline,
            repin_one(client, gen, &rfd, shortcut),
        ));
        match r.unwrap_or_else(|| Err(std::io::ErrorKind::TimedOut.into())) {
            Ok(fh) => out.push((rfd, fh)),
            Err(e) => tracing::warn!(
                layer = name,
                path = rfd.path,
                "cannot pin a passthrough file again after a reconnect ({e}): a rebalance may \
                 move it from under its readers until it is closed"
            ),
        }
    }
    out
}

/// How long pinning again after a reconnect may take in all.
const REPIN_PATIENCE: std::time::Duration = std::time::Duration::from_secs(5);

/// The connection of generation `gen` is published: the handles [`repin`] opened on it become
/// theirs, except for handles released meanwhile, whose new handle is closed.
pub(super) fn adopt(repinned: Vec<(Arc<RemoteFd>, u64)>, client: &Client, gen: u64) {
    for (rfd, fh) in repinned {
        let mut at = rfd.at.locked();
        if !rfd.released.load(Relaxed) {
            *at = (fh, gen);
            continue;
        }
        drop(at);
        if let Err(e) = block_on(client.close(crate::client::Fh(fh))) {
            tracing::debug!(path = rfd.path, "closing a pin of a released handle: {e}");
        }
    }
}

/// Opens `rfd`'s file on connection `gen` and pins it; returns the new handle number. Closes
/// what it opened if the pin fails.
async fn repin_one(
    client: &Client,
    gen: u64,
    rfd: &RemoteFd,
    shortcut: &Shortcut,
) -> std::io::Result<u64> {
    let fh = client.open(&rfd.path, rfd.flags as i32).await?;
    let fh_no = fh.0;
    match pin_again(client, fh, gen, rfd, shortcut).await {
        Ok(()) => Ok(fh_no),
        Err(e) => {
            let _ = client.close(crate::client::Fh(fh_no)).await;
            Err(e)
        }
    }
}

async fn pin_again(
    client: &Client,
    fh: crate::client::Fh,
    gen: u64,
    rfd: &RemoteFd,
    shortcut: &Shortcut,
) -> std::io::Result<()> {
    let (r, mut fds) = client.pin(fh).await?;
    let file = fds
        .pop()
        .ok_or_else(|| std::io::Error::from_raw_os_error(errno::EPROTO as i32))?;
    if let (true, Some(t)) = (r.table, fds.pop()) {
        // The connection's table came with this reply: keep it for the grants that follow.
        shortcut.set_table(gen, Table::map(t)?);
    }
    let now = inode(&file)?;
    let was = rfd.pinned.swap(now, Relaxed);
    // 0: pinned while the connection was lost, before the first pin's answer.
    if was != 0 && was != now {
        tracing::warn!(
            path = rfd.path,
            "a passthrough file was replaced while its brick was away: readers that have it \
             open read the old file until they open it again"
        );
    }
    Ok(())
}
