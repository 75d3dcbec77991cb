//! Opening files on the brick: handles, and small files fetched whole with their open.

use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex};

use kiln_layer::{errno, fail, Ctx, Fd, Fut, Layer, Opened};
use kiln_proto::codec::Wire;
use kiln_proto::ops::{OpenReply, OpenReq, OpenWholeReply, OPEN_ATTR};
use kiln_proto::Op;

use super::{check_len, path, ProtocolClient, RemoteFd, Shape};
use crate::shortcut::HandleGrant;

impl ProtocolClient {
    /// A handle for `p` as OPEN, HEAL_OPEN or CREATE answered with `fh`.
    pub(super) fn handle(&self, cx: &Ctx, op: Op, p: &str, flags: u32, fh: u64, gen: u64) -> Fd {
        Fd::new(Arc::new(RemoteFd {
            path: p.to_owned(),
            flags: flags & !((libc::O_CREAT | libc::O_EXCL | libc::O_TRUNC) as u32),
            heal: op == Op::HealOpen,
            cred: cx.cred.clone(),
            at: Mutex::new((fh, gen)),
            direct: HandleGrant::default(),
            pinned: AtomicU64::new(0),
            released: AtomicBool::new(false),
        }))
    }

    /// OPEN or HEAL_OPEN.
    pub(super) fn open_as<'a>(
        &'a self,
        cx: &'a Ctx,
        op: Op,
        p: &'a str,
        flags: u32,
    ) -> Fut<'a, Fd> {
        let req = OpenReq {
            path: try_fut!(path(p)),
            flags,
            peek: 0,
        };
        // Read before sending: a reconnect in between makes the handle look stale (safe: it
        // is reopened), never a stale handle look current.
        let gen = self.gen();
        let f = self.call::<OpenReply>(cx, op, &req);
        Box::pin(async move { Ok(self.handle(cx, op, &req.path, flags, f.await?.fh, gen)) })
    }

    /// OPEN asking for the whole file when it is at most `max` bytes ([`OpenReq::peek`]):
    /// read-only opens only; others, and `max` 0, are plain opens.
    pub(super) fn open_whole<'a>(
        &'a self,
        cx: &'a Ctx,
        p: &'a str,
        flags: u32,
        max: u32,
    ) -> Fut<'a, Opened> {
        let max = try_fut!(check_len(max as usize));
        if max == 0 || flags & libc::O_ACCMODE as u32 != libc::O_RDONLY as u32 {
            let f = self.open(cx, p, flags);
            return Box::pin(async move { f.await.map(Opened::Fd) });
        }
        let req = OpenReq {
            path: try_fut!(path(p)),
            flags: flags | OPEN_ATTR,
            peek: max,
        };
        let gen = self.gen();
        let mut r = self.request(cx, Op::Open, req.to_wire(), None);
        // The payload, if any, lands in the buffer as a read's would.
        r.shape = Shape::ReadAny;
        let f = self.send(
            cx,
            r,
            Some(Box::new(Vec::<u8>::with_capacity(max as usize))),
        );
        Box::pin(async move {
            let mut c = f.await?;
            let got = c.result?;
            // With the attributes, or (a brick that does not know `OPEN_ATTR`) without.
            let (fh, attr) = match OpenWholeReply::from_wire(&got.args) {
                Ok(r) => (r.fh, Some(r.attr)),
                Err(_) => match OpenReply::from_wire(&got.args) {
                    Ok(r) => (r.fh, None),
                    Err(e) => {
                        tracing::warn!("bad OPEN reply arguments: {e}");
                        return Err(errno::EPROTO);
                    }
                },
            };
            if fh != 0 {
                return Ok(Opened::Fd(self.handle(
                    cx,
                    Op::Open,
                    &req.path,
                    flags,
                    fh,
                    gen,
                )));
            }
            let data = super::landed(c.keep.take(), got.payload_len);
            Ok(Opened::Whole(data, attr))
        })
    }
}
