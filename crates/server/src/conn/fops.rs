//! One request decoded and run against the brick's stack: the connection's fop dispatcher.

use kiln_layer::{Ctx, IoBufs, ReadDst, ReadOut};
use kiln_proto::codec::{Seq, Wire};
use kiln_proto::ops::*;
use kiln_proto::sync::MutexExt as _;
use kiln_proto::{errno, Op};

use kiln_layer::Errno;

use super::*;

impl Conn {
    /// Decodes a request and starts it: protocol fops (HELLO, AUTH, PROFILE, RELEASE's handle
    /// bookkeeping) are answered here, file fops go down the stack.
    pub(super) fn fop(
        &mut self,
        op: Op,
        args: &[u8],
        payload: Vec<u8>,
        cx: Ctx,
    ) -> Result<Step, Fail> {
        let stack = self.stack.clone();
        cx.stamp(|| "brick: dispatch".into());
        fn reply(v: &impl Wire) -> Result<Done, Errno> {
            Ok(Done::Reply(v.to_wire(), Body::None))
        }
        fn empty() -> Result<Done, Errno> {
            Ok(Done::Reply(Vec::new(), Body::None))
        }
        macro_rules! stack {
            ($body:expr) => {
                Ok(Step::Stack(Box::pin(async move { $body })))
            };
        }
        match op {
            Op::Hello => self.hello(args),
            Op::Auth => self.auth(args),
            Op::Profile => self.profile(args),
            Op::Mgmt => self.mgmt(args),
            Op::Grant => self.grant(args, &cx),
            Op::LocalRead => Err(Fail::Errno(errno::ENOSYS)),
            Op::Watch => self.watch_req(args),
            Op::Ping => Ok(Step::Now(Vec::new(), Body::None)),
            Op::Bye => self.bye(),
            Op::Open => self.open(stack, args, cx),
            Op::Create => {
                let req = CreateReq::from_wire(args)?;
                stack!({
                    let (fd, attr) = stack.create(&cx, &req.path, req.flags, req.mode).await?;
                    Ok(Done::Create(fd, attr))
                })
            }
            Op::Read => self.read(stack, args, cx),
            Op::Write | Op::WriteMarked => self.write(stack, op, args, payload, cx),
            Op::Release => {
                let fh = HandleReq::from_wire(args)?.fh;
                let fd = self.handles.remove(&fh).ok_or(Fail::Errno(errno::EBADF))?;
                self.released(fh);
                self.handle_paths.remove(&fh);
                stack!({
                    stack.release(&cx, fd).await?;
                    empty()
                })
            }
            Op::Readdir => {
                let req = ReaddirReq::from_wire(args)?;
                // The brick keeps the reply under the argument limit (brick::READDIR_BYTES).
                let max = req.max.min(4096);
                stack!(reply(
                    &stack.readdir(&cx, &req.path, req.offset, max).await?
                ))
            }
            Op::Setxattr => {
                let req = SetxattrReq::from_wire(args)?;
                self.refuse_reserved(&req.path, &req.name)?;
                stack!({
                    stack
                        .setxattr(&cx, &req.path, &req.name, &req.value, req.flags)
                        .await?;
                    empty()
                })
            }
            Op::Listxattr => {
                let req = PathReq::from_wire(args)?;
                stack!(reply(&XattrNames {
                    names: Seq(stack.listxattr(&cx, &req.path).await?),
                }))
            }
            Op::Removexattr => {
                let req = XattrReq::from_wire(args)?;
                self.refuse_reserved(&req.path, &req.name)?;
                stack!({
                    stack.removexattr(&cx, &req.path, &req.name).await?;
                    empty()
                })
            }
            kiln_layer::for_each_control_fop!(control_ops) => {
                if op == Op::HealSession {
                    self.refuse_pinned(args)?;
                }
                control(stack, op, args, cx)
            }
            kiln_layer::for_each_path_fop!(path_ops) => self.path_fop(stack, op, args, cx),
            Op::HealOpen => {
                let req = OpenReq::from_wire(args)?;
                stack!(Ok(Done::Open(
                    stack.heal_open(&cx, &req.path, req.flags).await?
                )))
            }
        }
    }

    /// OPEN; with `peek`, a small file's whole content instead of a handle (see [`OpenReq`]):
    /// open, fstat, one read and close on the brick, one reply, which carries the attributes
    /// too when asked ([`OPEN_ATTR`]). Where the file is not small, or reading it fails, the
    /// reply is the handle, as for a plain OPEN.
    fn open(&self, stack: LayerRef, args: &[u8], cx: Ctx) -> Result<Step, Fail> {
        let mut req = OpenReq::from_wire(args)?;
        let with_attr = req.flags & OPEN_ATTR != 0;
        req.flags &= !OPEN_ATTR;
        let peek = req.peek.min(kiln_proto::MAX_PAYLOAD_LEN);
        let read_only = req.flags & libc::O_ACCMODE as u32 == libc::O_RDONLY as u32;
        let stats = self.stats.clone();
        Ok(Step::Stack(Box::pin(async move {
            let fd = stack.open(&cx, &req.path, req.flags).await?;
            if peek == 0 || !read_only {
                return Ok(Done::Open(fd));
            }
            let Some((body, attr)) = whole(&stack, &cx, &fd, peek).await else {
                return Ok(Done::Open(fd));
            };
            if let Err(e) = stack.release(&cx, fd).await {
                // The content is read; only closing the brick's file failed.
                tracing::warn!(path = req.path, "closing a file read whole failed: {e}");
            }
            stats.add_read(body.len());
            let args = match with_attr {
                true => OpenWholeReply { fh: 0, attr }.to_wire(),
                false => OpenReply { fh: 0 }.to_wire(),
            };
            Ok(Done::Reply(args, body))
        })))
    }

    /// READ: the data comes back as a buffer or as a file region the reply sends with
    /// `sendfile`.
    fn read(&self, stack: LayerRef, args: &[u8], cx: Ctx) -> Result<Step, Fail> {
        let req = ReadReq::from_wire(args)?;
        let fd = self.handle(req.fh)?;
        let len = req.len.min(kiln_proto::MAX_PAYLOAD_LEN);
        let stats = self.stats.clone();
        Ok(Step::Stack(Box::pin(async move {
            let body = match stack.read(&cx, &fd, req.offset, ReadDst::Any(len)).await? {
                ReadOut::Buf(b) => Body::Buf(b),
                ReadOut::File {
                    file,
                    offset,
                    len,
                    sums,
                } => {
                    // Shipped for the reader to check (a READ with FLAG_SUMS): the entries
                    // are the reply's arguments.
                    let args = sums.map_or_else(Vec::new, |s| {
                        s.iter().flat_map(|e| e.to_le_bytes()).collect()
                    });
                    stats.add_read(len);
                    return Ok(Done::Reply(args, Body::File { file, offset, len }));
                }
                ReadOut::Into { .. } => return Err(errno::EIO),
            };
            stats.add_read(body.len());
            Ok(Done::Reply(Vec::new(), body))
        })))
    }

    /// WRITE and WRITE_MARKED: the payload was received straight into the buffer written
    /// from.
    fn write(
        &self,
        stack: LayerRef,
        op: Op,
        args: &[u8],
        payload: Vec<u8>,
        cx: Ctx,
    ) -> Result<Step, Fail> {
        let req = if op == Op::WriteMarked {
            WriteMarkedReq::from_wire(args)?
        } else {
            let w = WriteReq::from_wire(args)?;
            WriteMarkedReq {
                fh: w.fh,
                offset: w.offset,
                missed: 0,
            }
        };
        let fd = self.handle(req.fh)?;
        let stats = self.stats.clone();
        Ok(Step::Stack(Box::pin(async move {
            let data = IoBufs::owned(vec![payload]);
            let w = if op == Op::WriteMarked {
                stack
                    .write_marked(&cx, &fd, req.offset, data, req.missed)
                    .await?
            } else {
                stack.write(&cx, &fd, req.offset, data).await?
            };
            stats.add_written(w.n);
            let r = WriteReply {
                written: w.n as u32,
            };
            Ok(Done::Reply(r.to_wire(), Body::None))
        })))
    }

    /// BYE: the client ends cleanly. Frames run in order, and a client says goodbye with
    /// nothing in flight: no change of this connection is still running here.
    fn bye(&mut self) -> Result<Step, Fail> {
        tracing::debug!(peer = %self.peer, "the client said goodbye");
        self.stack.goodbye(self.conn_id);
        Ok(Step::Now(Vec::new(), Body::None))
    }

    /// PROFILE: this process's io-stats as JSON, with the clients that reported endpoints.
    fn profile(&mut self, args: &[u8]) -> Result<Step, Fail> {
        let req = ProfileReq::from_wire(args)?;
        let points = kiln_layer::iostats::points();
        if req.cmd == PROFILE_START {
            points.iter().for_each(|p| p.start_interval());
        }
        let mut report = kiln_layer::metrics::profile_json("kilnd");
        let clients: Vec<String> = {
            let c = self.clients.locked();
            let mut v: Vec<String> = c.values().cloned().collect();
            v.sort();
            v.dedup();
            v
        };
        report["clients"] = clients.into();
        if req.cmd == PROFILE_STOP {
            points.iter().for_each(|p| p.stop_interval());
        }
        Ok(Step::Now(
            Vec::new(),
            Body::Buf(report.to_string().into_bytes()),
        ))
    }

    /// MGMT: served only by a kilnd that keeps volume definitions (see `control`). Commands
    /// may spawn processes and talk to other hosts: they run on the blocking pool, and the
    /// reply is a JSON payload like PROFILE's.
    fn mgmt(&mut self, args: &[u8]) -> Result<Step, Fail> {
        let req = MgmtReq::from_wire(args)?;
        let Some(handler) = self.mgmt.clone() else {
            return Err(Fail::Errno(errno::ENOSYS));
        };
        let caller = crate::control::Caller {
            peer: self.peer.clone(),
            authenticated: (self.who.authed || !self.who.required()) && self.caps.admin,
            identity: self.identity_name().to_owned(),
        };
        Ok(Step::Stack(Box::pin(async move {
            let json = tokio::task::spawn_blocking(move || handler.handle(&req.json, &caller))
                .await
                .map_err(|_| errno::EIO)?;
            Ok(Done::Reply(Vec::new(), Body::Buf(json)))
        })))
    }

    /// Refuses a client's change of an xattr Kiln reserves (see
    /// [`kiln_layer::reserved_xattr`]), with a log line naming the peer.
    fn refuse_reserved(&self, path: &str, name: &str) -> Result<(), Fail> {
        match kiln_layer::reserved_xattr(name) {
            Some(e) => {
                tracing::warn!(peer = %self.peer, path, name, "refused a change of a reserved xattr");
                Err(Fail::Errno(e))
            }
            None => Ok(()),
        }
    }
}

/// The ops of [`kiln_layer::for_each_control_fop`], as a pattern.
macro_rules! control_ops {
    (() $( ($name:ident, $op:ident, $arg:ty, $ret:ty) )*) => {
        $( Op::$op )|*
    };
}
use control_ops;

/// Runs a control fop: its request is `(path, argument)`, its reply one value.
macro_rules! control_fn {
    (() $( ($name:ident, $op:ident, $arg:ty, $ret:ty) )*) => {
        fn control(stack: LayerRef, op: Op, args: &[u8], cx: Ctx) -> Result<Step, Fail> {
            match op {
                $(
                    Op::$op => {
                        let (path, arg) = <(String, $arg)>::from_wire(args)?;
                        Ok(Step::Stack(Box::pin(async move {
                            let r: $ret = stack.$name(&cx, &path, &arg).await?;
                            Ok(Done::Reply(r.to_wire(), Body::None))
                        })))
                    }
                )*
                _ => Err(Fail::Errno(errno::ENOSYS)),
            }
        }
    };
}
kiln_layer::for_each_control_fop!(control_fn);

/// The ops of [`kiln_layer::for_each_path_fop`], as a pattern.
macro_rules! path_ops {
    (() $( ($name:ident, $op:ident, $($rest:tt)*) )*) => {
        $( Op::$op )|*
    };
}
use path_ops;

/// A path fop's request field, taken out before the fop runs: a handle number becomes the
/// open file it names (or the request fails with EBADF).
macro_rules! take_arg {
    (handle, $conn:expr, $e:expr) => {
        $conn.handle($e)?
    };
    ($kind:ident, $conn:expr, $e:expr) => {
        $e
    };
}

/// A path fop's argument as the stack takes it.
macro_rules! stack_arg {
    (val, $e:expr) => {
        $e
    };
    ($kind:ident, $e:expr) => {
        &$e
    };
}

/// Runs a path fop: decodes its request, calls the stack, encodes its reply.
macro_rules! path_fn {
    (() $( ($name:ident, $op:ident, $req:path { $( $f:ident : $ty:ty => $kind:ident ),* },
            $ret:ty, $wire:ty, $to_ret:tt, $to_wire:tt) )*) => {
        impl Conn {
            fn path_fop(&self, stack: LayerRef, op: Op, args: &[u8], cx: Ctx) -> Result<Step, Fail> {
                match op {
                    $(
                        Op::$op => {
                            let req = <$req>::from_wire(args)?;
                            $( let $f = take_arg!($kind, self, req.$f); )*
                            Ok(Step::Stack(Box::pin(async move {
                                let r: $ret = stack.$name(&cx, $( stack_arg!($kind, $f) ),*).await?;
                                let w: $wire = $to_wire(r);
                                Ok(Done::Reply(w.to_wire(), Body::None))
                            })))
                        }
                    )*
                    _ => Err(Fail::Errno(errno::ENOSYS)),
                }
            }
        }
    };
}
kiln_layer::for_each_path_fop!(path_fn);

/// The whole of open regular file `fd` if it holds at most `max` bytes, and its attributes
/// before the read; None if it is larger, not a regular file, grew while being read, or could
/// not be read.
async fn whole(stack: &LayerRef, cx: &Ctx, fd: &kiln_layer::Fd, max: u32) -> Option<(Body, Attr)> {
    let a = stack.fstat(cx, fd).await.ok()?;
    if a.mode & libc::S_IFMT != libc::S_IFREG || a.size > max as u64 {
        return None;
    }
    // A byte more than the file holds: getting it means the file grew meanwhile.
    let want = (a.size + 1).min(kiln_proto::MAX_PAYLOAD_LEN as u64) as u32;
    let body = match stack.read(cx, fd, 0, ReadDst::Any(want)).await.ok()? {
        ReadOut::Buf(b) => Body::Buf(b),
        ReadOut::File {
            file, offset, len, ..
        } => Body::File { file, offset, len },
        ReadOut::Into { .. } => return None,
    };
    if body.len() as u64 > a.size {
        return None;
    }
    // Shrunk while being read: the attributes tell the size of what is sent.
    let a = Attr {
        size: body.len() as u64,
        ..a
    };
    Some((body, a))
}
