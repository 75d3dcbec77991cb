//! Kiln's layer stack.
//!
//! A volume is a graph of layers. Every fop is an async method of [`Layer`] whose default
//! forwards to the layer's first child, so a layer overrides only what it changes. The same trait
//! is used on both sides of the wire: the client stack ends in a protocol-client layer, the brick
//! server's stack begins at its protocol server and ends in posix storage.
//!
//! Data moves through the stack without copies: a read carries the caller's memory down to the
//! layer that fills it ([`ReadDst::Into`]), or lets the bottom layer choose a buffer or a file
//! region to send with `sendfile` ([`ReadDst::Any`]); a write carries the caller's memory down
//! to the layer that writes it out.
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

pub mod config;
pub mod exec;
pub mod layers;
pub mod metrics;
pub mod requests;
pub mod shared;
pub mod timer;
pub mod trace;
pub mod volfile;

pub use layers::replicate::{heal, marks};
pub use layers::{distribute, faults, iostats, replicate, shard};

use std::any::Any;
use std::fs::File;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

pub use kiln_proto::iov::RawIov;
pub use kiln_proto::ops::{
    Attr, Extent, ExtentList, LeaseState, ReaddirReply, SetAttrs, StatfsReply,
};
pub use kiln_proto::stamp::SnapReply;
pub use kiln_proto::{errno, Op};
pub use trace::{Ctx, Trace};

pub use kiln_proto::Errno;
/// The result of a fop.
pub type FopResult<T> = Result<T, Errno>;
/// The future a fop returns.
pub type Fut<'a, T> = Pin<Box<dyn Future<Output = FopResult<T>> + Send + 'a>>;

/// An open file as the layer that opened it sees it: each layer may wrap its children's handles
/// in its own. Dropping the last clone closes what the handle holds; [`Layer::release`] tells the
/// layers below (and the brick) that the caller is done with it.
#[derive(Clone)]
pub struct Fd(Arc<dyn Any + Send + Sync>);

impl Fd {
    /// Wraps a layer's own handle state.
    pub fn new<T: Any + Send + Sync>(inner: T) -> Fd {
        Fd(Arc::new(inner))
    }

    /// How many clones of this handle exist: a layer that keeps handles open for reuse closes
    /// only those no fop holds.
    pub fn holders(&self) -> usize {
        Arc::strong_count(&self.0)
    }

    /// The state a layer stored, or `EBADF` for a handle that some other layer made.
    pub fn get<T: Any>(&self) -> FopResult<&T> {
        self.0.downcast_ref::<T>().ok_or(errno::EBADF)
    }
}

impl std::fmt::Debug for Fd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Fd({:p})", Arc::as_ptr(&self.0))
    }
}

/// Memory a read fills or a write sends, kept alive by the fop until it completes — even if the
/// future that started it is dropped, the layer that does the I/O holds `IoBufs` until the data
/// has moved, so the memory cannot be freed under the kernel.
pub struct IoBufs {
    iov: Vec<RawIov>,
    keep: Option<Box<dyn Any + Send>>,
    /// For a read: where its payload may go instead (see [`SpliceOut`]).
    out: Option<Arc<SpliceOut>>,
}

/// A read's other way out: its payload may go from the brick's socket straight on to a file
/// descriptor — a FUSE mount's device — behind a header made for its length, through a pipe
/// (`splice`), instead of landing in the read's memory and being written from there: one copy
/// fewer. Only the bottom layer's connection can do that, and only while nothing above it
/// needs the bytes, so the layers that pass a read's memory through unchanged carry this with
/// it and the others drop it; whoever made the read then finds out from
/// [`SpliceOut::was_sent`] whether the payload went out (and its memory holds nothing) or
/// landed in the memory as usual.
pub struct SpliceOut {
    /// Where the payload goes: the descriptor stays open while this lives.
    pub fd: Arc<std::os::fd::OwnedFd>,
    /// The bytes that go in front of a payload of the given length.
    pub head: Box<dyn Fn(usize) -> Vec<u8> + Send + Sync>,
    sent: std::sync::atomic::AtomicBool,
}

impl SpliceOut {
    /// A way out to `fd`, each payload behind `head(len)`.
    pub fn new(
        fd: Arc<std::os::fd::OwnedFd>,
        head: impl Fn(usize) -> Vec<u8> + Send + Sync + 'static,
    ) -> SpliceOut {
        SpliceOut {
            fd,
            head: Box::new(head),
            sent: Default::default(),
        }
    }

    /// The payload went out to the descriptor, behind its head (set by the connection).
    pub fn set_sent(&self) {
        self.sent.store(true, std::sync::atomic::Ordering::Release);
    }

    /// True once the payload went out to the descriptor: the read's memory holds none of it.
    pub fn was_sent(&self) -> bool {
        self.sent.load(std::sync::atomic::Ordering::Acquire)
    }
}

impl IoBufs {
    /// Owned buffers; they come back from [`IoBufs::into_owned`].
    pub fn owned<B: AsMut<[u8]> + Send + 'static>(mut bufs: Vec<B>) -> IoBufs {
        let iov = bufs
            .iter_mut()
            .map(|b| {
                let s = b.as_mut();
                RawIov {
                    base: s.as_mut_ptr() as usize,
                    len: s.len(),
                }
            })
            .collect();
        // Moving the Vec into the box does not move its elements' heap memory.
        IoBufs {
            iov,
            keep: Some(Box::new(bufs)),
            out: None,
        }
    }

    /// Borrowed memory described by raw vectors.
    ///
    /// # Safety
    /// Every vector must stay valid until the fop it is given to has completed (its future
    /// resolved, or — if the future is dropped — its completion delivered), and, for a read, must
    /// not be read or written by anyone else meanwhile.
    pub unsafe fn raw(iov: Vec<RawIov>) -> IoBufs {
        IoBufs {
            iov,
            keep: None,
            out: None,
        }
    }

    /// The vectors.
    pub fn iov(&self) -> &[RawIov] {
        &self.iov
    }

    /// Total bytes.
    pub fn len(&self) -> usize {
        self.iov.iter().map(|v| v.len).sum()
    }

    /// True when there are no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Splits into vectors and the owner of their memory, for a layer that hands both to the
    /// kernel or to a connection that holds the owner until completion.
    pub fn into_parts(self) -> (Vec<RawIov>, Option<Box<dyn Any + Send>>) {
        (self.iov, self.keep)
    }

    /// Rebuilds from [`IoBufs::into_parts`].
    ///
    /// # Safety
    /// `iov` must point into memory owned by `keep` (or satisfy [`IoBufs::raw`]).
    pub unsafe fn from_parts(iov: Vec<RawIov>, keep: Option<Box<dyn Any + Send>>) -> IoBufs {
        IoBufs {
            iov,
            keep,
            out: None,
        }
    }

    /// These buffers, whose payload may go out through `out` instead (a read's).
    pub fn with_splice_out(mut self, out: Arc<SpliceOut>) -> IoBufs {
        self.out = Some(out);
        self
    }

    /// Where a read's payload may go instead of these buffers ([`SpliceOut`]).
    pub fn splice_out(&self) -> Option<&Arc<SpliceOut>> {
        self.out.as_ref()
    }

    /// The owned buffers given to [`IoBufs::owned`], if they were of type `B`.
    pub fn into_owned<B: 'static>(self) -> Option<Vec<B>> {
        self.keep?.downcast::<Vec<B>>().ok().map(|b| *b)
    }
}

/// Where a read's data goes.
pub enum ReadDst {
    /// Into the caller's memory; its length is the most that is read.
    Into(IoBufs),
    /// Anywhere the bottom layer likes: a buffer, or a file region to send without a copy.
    /// The value is the most that is read.
    Any(u32),
}

impl ReadDst {
    /// The most bytes the read may return.
    pub fn len(&self) -> usize {
        match self {
            ReadDst::Into(b) => b.len(),
            ReadDst::Any(n) => *n as usize,
        }
    }

    /// True for a zero-length read.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A read's data. Fewer bytes than asked for means end of file.
pub enum ReadOut {
    /// `n` bytes landed in the caller's memory, handed back.
    Into {
        /// Bytes read.
        n: usize,
        /// The memory from [`ReadDst::Into`].
        bufs: IoBufs,
    },
    /// The bytes, in a buffer.
    Buf(Vec<u8>),
    /// `len` bytes of `file` from `offset`: the sender moves them with `sendfile`.
    File {
        /// The open file.
        file: Arc<File>,
        /// Where the bytes start.
        offset: u64,
        /// How many (already clamped to the file's size).
        len: usize,
        /// The checksum entries of the blocks the bytes touch, for a reader that checks them
        /// itself ([`Ctx::ship_sums`]; the wire form is [`kiln_proto::ops::HELLO_SUMS`]'s);
        /// `None` when the layer checked them, or keeps none.
        sums: Option<Vec<u32>>,
    },
}

impl ReadOut {
    /// Bytes read.
    pub fn len(&self) -> usize {
        match self {
            ReadOut::Into { n, .. } => *n,
            ReadOut::Buf(b) => b.len(),
            ReadOut::File { len, .. } => *len,
        }
    }

    /// True at end of file.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A write's result: bytes written and the caller's memory, handed back.
pub struct Written {
    /// Bytes written.
    pub n: usize,
    /// The memory the write was sent from.
    pub bufs: IoBufs,
}

/// The errno with which a brick refuses a client's setxattr or removexattr of `name`, if Kiln
/// reserves it: `trusted.kiln.*` is Kiln's own (a directory's layout travels as LAYOUT_SET,
/// replication state as the control fops), and `security.*` belongs to the brick host's
/// security modules, not to clients.
pub fn reserved_xattr(name: &str) -> Option<Errno> {
    if name.starts_with("trusted.kiln.") {
        Some(errno::EPERM)
    } else if name.starts_with("security.") {
        Some(errno::EOPNOTSUPP)
    } else {
        None
    }
}

/// A fop a layer does not take: fails at once with `EOPNOTSUPP` (the fan-out layers' answer
/// to fops addressed to one brick).
pub fn refused<'a, T: Send + 'a>() -> Fut<'a, T> {
    fail(errno::EOPNOTSUPP)
}

/// A fop future that fails at once.
pub fn fail<'a, T: Send + 'a>(e: Errno) -> Fut<'a, T> {
    Box::pin(std::future::ready(Err(e)))
}

/// Calls `$m!` with the list of every fop: name, opcode, arguments (beyond the context) and
/// result type. One list drives the trait and every layer that wraps all fops alike.
///
/// The fops written here are the ones whose wire form is handled by hand (handles opened and
/// released, payload, clamped or checked arguments); the rest are derived from
/// [`for_each_path_fop`] and [`for_each_control_fop`], so each fop is listed exactly once.
#[macro_export]
macro_rules! for_each_fop {
    ($m:ident $(, $extra:tt)*) => {
        $crate::for_each_path_fop!($crate::__fops_with_path, $m, ($($extra)*));
    };
}

/// Step 1 of [`for_each_fop`]: the path fops, turned into trait entries; then the control fops.
#[doc(hidden)]
#[macro_export]
macro_rules! __fops_with_path {
    (($m:ident ($($extra:tt)*))
     $( ($name:ident, $op:ident, $req:path { $( $f:ident : $ty:ty => $kind:ident ),* },
         $ret:ty, $wire:ty, $to_ret:tt, $to_wire:tt) )*) => {
        $crate::for_each_control_fop!(
            $crate::__fops_with_control, $m, ($($extra)*), ($( ($name, $op, ($($f: $ty),*), $ret) )*)
        );
    };
}

/// Step 2 of [`for_each_fop`]: the control fops turned into trait entries, with the path fops
/// and the fops written by hand, handed to `$m`.
#[doc(hidden)]
#[macro_export]
macro_rules! __fops_with_control {
    (($m:ident ($($extra:tt)*) ($($path:tt)*))
     $( ($name:ident, $op:ident, $arg:ty, $ret:ty) )*) => {
        $m! {
            ($($extra)*)
            (open, Open, (path: &'a str, flags: u32), $crate::Fd)
            (create, Create, (path: &'a str, flags: u32, mode: u32), ($crate::Fd, $crate::Attr))
            (heal_open, HealOpen, (path: &'a str, flags: u32), $crate::Fd)
            (release, Release, (fd: $crate::Fd), ())
            (read, Read, (fd: &'a $crate::Fd, offset: u64, dst: $crate::ReadDst), $crate::ReadOut)
            (write, Write, (fd: &'a $crate::Fd, offset: u64, data: $crate::IoBufs), $crate::Written)
            (write_marked, WriteMarked,
                (fd: &'a $crate::Fd, offset: u64, data: $crate::IoBufs, missed: u32), $crate::Written)
            (readdir, Readdir, (path: &'a str, offset: u64, max: u32), $crate::ReaddirReply)
            (setxattr, Setxattr, (path: &'a str, name: &'a str, value: &'a [u8], flags: u32), ())
            (listxattr, Listxattr, (path: &'a str), Vec<String>)
            (removexattr, Removexattr, (path: &'a str, name: &'a str), ())
            $($path)*
            $( ($name, $op, (path: &'a str, arg: &'a $arg), $ret) )*
        }
    };
}

/// Calls `$m!` with the path fops whose request is one argument struct and whose reply is one
/// value: name, opcode, the request type with each field's Layer argument (`field: type =>
/// kind`, where kind says how it crosses the wire: `path` is normalised by the client, `text`
/// is sent as given, `val` is copied, `refd` is borrowed from the request on the brick,
/// `handle` is an open file, sent as the brick's handle number `fh`), the
/// fop's result type, the reply's wire type, and the two conversions between them. The brick's
/// dispatch and the protocol client's encoding of these fops are generated from this list, and
/// [`for_each_fop`] includes them (a fop also written by hand on either side does not compile).
#[macro_export]
macro_rules! for_each_path_fop {
    ($m:path $(, $extra:tt)*) => {
        $m! {
            ($($extra)*)
            (lookup, Lookup, $crate::__wire::PathReq { path: &'a str => path },
                $crate::Attr, $crate::Attr, (|r| r), (|v| v))
            (fstat, Fstat, $crate::__wire::HandleReq { fh: &'a $crate::Fd => handle },
                $crate::Attr, $crate::Attr, (|r| r), (|v| v))
            (fsetattr, Fsetattr,
                $crate::__wire::FsetattrReq { fh: &'a $crate::Fd => handle, attrs: &'a $crate::SetAttrs => refd },
                $crate::Attr, $crate::Attr, (|r| r), (|v| v))
            (fsync, Fsync,
                $crate::__wire::FsyncReq { fh: &'a $crate::Fd => handle, datasync: bool => val },
                (), (), (|r| r), (|v| v))
            (fallocate, Fallocate,
                $crate::__wire::FallocateReq {
                    fh: &'a $crate::Fd => handle, mode: u32 => val, offset: u64 => val, len: u64 => val
                },
                (), (), (|r| r), (|v| v))
            (discard, Discard,
                $crate::__wire::DiscardReq { fh: &'a $crate::Fd => handle, offset: u64 => val, len: u64 => val },
                (), (), (|r| r), (|v| v))
            (extents, Extents,
                $crate::__wire::ExtentsReq { fh: &'a $crate::Fd => handle, offset: u64 => val, len: u64 => val },
                $crate::ExtentList, $crate::ExtentList, (|r| r), (|v| v))
            (lease, Lease,
                $crate::__wire::LeaseReq {
                    fh: &'a $crate::Fd => handle, cmd: u32 => val, ttl_ms: u32 => val, holder: &'a str => text
                },
                $crate::LeaseState, $crate::LeaseState, (|r| r), (|v| v))
            (snap, Snap,
                $crate::__wire::SnapReq {
                    fh: &'a $crate::Fd => handle, cmd: u32 => val, name: &'a str => text, to: &'a str => text, ttl_ms: u32 => val
                },
                $crate::SnapReply, $crate::SnapReply, (|r| r), (|v| v))
            (dirty, Dirty,
                $crate::__wire::DirtyReq {
                    fh: &'a $crate::Fd => handle, cmd: u32 => val, name: &'a str => text, offset: u64 => val, len: u64 => val
                },
                $crate::ExtentList, $crate::ExtentList, (|r| r), (|v| v))
            (setattr, Setattr,
                $crate::__wire::SetattrReq { path: &'a str => path, attrs: &'a $crate::SetAttrs => refd },
                $crate::Attr, $crate::Attr, (|r| r), (|v| v))
            (unlink, Unlink, $crate::__wire::PathReq { path: &'a str => path },
                (), (), (|r| r), (|v| v))
            (mkdir, Mkdir, $crate::__wire::MkdirReq { path: &'a str => path, mode: u32 => val },
                $crate::Attr, $crate::Attr, (|r| r), (|v| v))
            (rmdir, Rmdir, $crate::__wire::PathReq { path: &'a str => path },
                (), (), (|r| r), (|v| v))
            (rename, Rename,
                $crate::__wire::RenameReq { from: &'a str => path, to: &'a str => path, flags: u32 => val },
                (), (), (|r| r), (|v| v))
            (symlink, Symlink,
                $crate::__wire::SymlinkReq { target: &'a str => text, path: &'a str => path },
                $crate::Attr, $crate::Attr, (|r| r), (|v| v))
            (mknod, Mknod,
                $crate::__wire::MknodReq { path: &'a str => path, mode: u32 => val, rdev: u64 => val },
                $crate::Attr, $crate::Attr, (|r| r), (|v| v))
            (syncdir, Syncdir, $crate::__wire::PathReq { path: &'a str => path },
                (), (), (|r| r), (|v| v))
            (readlink, Readlink, $crate::__wire::PathReq { path: &'a str => path },
                String, $crate::__wire::ReadlinkReply,
                (|r: $crate::__wire::ReadlinkReply| r.target),
                (|v| $crate::__wire::ReadlinkReply { target: v }))
            (link, Link,
                $crate::__wire::LinkReq { existing: &'a str => path, path: &'a str => path },
                $crate::Attr, $crate::Attr, (|r| r), (|v| v))
            (statfs, Statfs, $crate::__wire::PathReq { path: &'a str => path },
                $crate::StatfsReply, $crate::StatfsReply, (|r| r), (|v| v))
            (getxattr, Getxattr,
                $crate::__wire::XattrReq { path: &'a str => path, name: &'a str => text },
                Vec<u8>, $crate::__wire::XattrValue,
                (|r: $crate::__wire::XattrValue| r.value),
                (|v| $crate::__wire::XattrValue { value: v }))
        }
    };
}

#[doc(hidden)]
pub use kiln_proto::ops as __wire;

/// Calls `$m!` with the control fops: the fops whose request is `(path, argument)` and whose
/// reply is one value, both encoded with the argument codec — the replication control fops
/// (what replicas missed, heal locks and sessions) and the distribute layout. The protocol
/// server's dispatch and the protocol client's encoding are generated from this list, and
/// [`for_each_fop`] includes it (so a layer, io-stats and the fuzzer see each like any fop).
#[macro_export]
macro_rules! for_each_control_fop {
    ($m:path $(, $extra:tt)*) => {
        $m! {
            ($($extra)*)
            (mark_add, MarkAdd, $crate::marks::Mark, ())
            (mark_clear, MarkClear, $crate::marks::Mark, ())
            (mark_clear_if, MarkClearIf, $crate::marks::CondMark, ())
            (flag_add, FlagAdd, $crate::marks::FlagMark, ())
            (flag_clear_if, FlagClearIf, $crate::marks::CondFlag, ())
            (heal_lock, HealLock, $crate::marks::LockReq, ())
            (heal_session, HealSession, $crate::marks::HealReq, ())
            (pending, Pending, (), $crate::marks::PendingPage)
            (pending_index, PendingIndex, (), $crate::marks::IndexPage)
            (heal_info, HealInfo, (), $crate::marks::HealInfo)
            (member, Member, $crate::marks::MemberReq, $crate::marks::MemberState)
            (layout_get, LayoutGet, (), Vec<u8>)
            (layout_set, LayoutSet, Vec<u8>, ())
        }
    };
}

macro_rules! declare_layer {
    (() $( ($name:ident, $op:ident, ($($arg:ident : $ty:ty),*), $ret:ty) )*) => {
        /// One layer of a volume graph. Every fop defaults to forwarding to the first child
        /// (failing with `ENOSYS` in a layer without children).
        ///
        /// Contracts shared by all fops: paths are relative to the volume root, `/`-separated,
        /// without `.`/`..` components (the brick refuses anything else); errors are Linux
        /// errno values; a read returns fewer bytes than asked only at end of file, and after
        /// an error the contents of the read's memory are unspecified.
        pub trait Layer: Send + Sync + 'static {
            /// The layer's name in the volume graph (unique within it).
            fn name(&self) -> &str;

            /// The layer's children, in graph order.
            fn children(&self) -> &[Arc<dyn Layer>] {
                &[]
            }

            /// The children as they are now: [`Layer::children`], except in a layer that
            /// switches between graphs (a client following its volume's graph versions),
            /// which cannot lend its current graph out. Tools that walk a stack use this.
            fn graph_children(&self) -> Vec<Arc<dyn Layer>> {
                self.children().to_vec()
            }

            /// Runs an operator command against this layer and its subtree (see
            /// [`iostats`]): the default visits the children.
            fn visit(&self, f: &mut dyn FnMut(&dyn Layer)) {
                for c in self.children() {
                    f(&**c);
                    c.visit(f);
                }
            }

            /// False while this layer cannot reach its storage (a protocol-client whose
            /// connection is down); the default asks the first child.
            fn up(&self) -> bool {
                self.children().first().is_none_or(|c| c.up())
            }

            /// True when this layer's storage is on this host (a protocol-client over a Unix
            /// socket or to an address of this host); the default asks the first child.
            /// Replicate prefers such replicas for reads.
            fn local(&self) -> bool {
                self.children().first().is_some_and(|c| c.local())
            }

            /// True while this layer's storage is a brick new to its volume — wiped, replaced,
            /// or being rebuilt — whose data no reader may trust until a full rebuild from
            /// its replicas makes it a member (see [`marks`]). The default asks the only
            /// child; a layer over several says false.
            fn joining(&self) -> bool {
                match self.children() {
                    [only] => only.joining(),
                    _ => false,
                }
            }

            /// The brick file under a handle this layer opened, for a local client to read
            /// straight from (the brick's grants, [`kiln_proto::Op::Grant`]), or why not
            /// (`EOPNOTSUPP` where there is no such file; `EMOVED` for a file moving away).
            /// The default asks the first child with the same handle: layers that wrap
            /// handles say so themselves.
            fn backing<'f>(&self, cx: &Ctx, fd: &'f Fd) -> FopResult<&'f std::fs::File> {
                match self.children().first() {
                    Some(c) => c.backing(cx, fd),
                    None => Err(errno::EOPNOTSUPP),
                }
            }

            /// A read-only descriptor of the block checksums of the file behind `fd` (see
            /// [`kiln_proto::ops::GRANT_SUMS`]), for a reader that reads [`Layer::backing`]'s
            /// file directly; `None` where it keeps none. The default asks the first child
            /// with the same handle, like `backing`.
            fn backing_sums(&self, cx: &Ctx, fd: &Fd) -> FopResult<Option<std::fs::File>> {
                match self.children().first() {
                    Some(c) => c.backing_sums(cx, fd),
                    None => Ok(None),
                }
            }

            /// OPEN, and for a read-only open of a file of at most `max` bytes the file's
            /// whole content instead of a handle, in the same round trip (`O_RDONLY` opens
            /// only; `max` at most [`kiln_proto::MAX_PAYLOAD_LEN`]). A layer may always answer
            /// with a handle: the default is this layer's own [`Layer::open`]. Layers that
            /// route an open to one child pass it on; those that open on several (replicas,
            /// shards) keep the default.
            fn open_small<'a>(
                &'a self,
                cx: &'a Ctx,
                path: &'a str,
                flags: u32,
                max: u32,
            ) -> Fut<'a, Opened> {
                let _ = max;
                let f = self.open(cx, path, flags);
                Box::pin(async move { f.await.map(Opened::Fd) })
            }

            /// A read-only descriptor of the brick file behind a handle this layer opened, for
            /// a reader on the brick's host to read with no further check (FUSE passthrough).
            /// Given only where nothing can make such reads differ from reads through the
            /// stack while the handle is open: the file whole on one brick of this host, no
            /// replicas, and the brick keeps it from moving while the descriptor is out
            /// ([`kiln_proto::Op::Grant`] with `pin`). `EOPNOTSUPP` elsewhere. The default
            /// asks the first child with the same handle.
            fn pin_local<'a>(&'a self, cx: &'a Ctx, fd: &'a Fd) -> Fut<'a, std::os::fd::OwnedFd> {
                match self.children().first() {
                    Some(c) => c.pin_local(cx, fd),
                    None => fail(errno::EOPNOTSUPP),
                }
            }

            /// This layer as `Any`, for operator tools that look for a layer type.
            fn as_any(&self) -> Option<&dyn Any> {
                None
            }

            /// The client connection `owner` (a brick's [`Ctx::owner`]) ended, with or without
            /// releasing its handles: a layer that keeps per-connection state may keep what
            /// the connection left half done ([`marks`]: suspect ranges). Called before its
            /// leftover handles are released; the default tells the children.
            fn hangup(&self, owner: u64) {
                for c in self.children() {
                    c.hangup(owner);
                }
            }

            /// The client connection `owner` said goodbye ([`kiln_proto::Op::Bye`]): every
            /// change it sent was answered, on every replica, so what it changed lately is in
            /// doubt nowhere and its [`Self::hangup`] leaves no suspects. The default tells
            /// the children.
            fn goodbye(&self, owner: u64) {
                for c in self.children() {
                    c.goodbye(owner);
                }
            }

            $(
                #[doc = concat!("The `", stringify!($name), "` fop.")]
                fn $name<'a>(&'a self, cx: &'a Ctx, $($arg: $ty),*) -> Fut<'a, $ret> {
                    match self.children().first() {
                        Some(c) => c.$name(cx, $($arg),*),
                        None => fail(errno::ENOSYS),
                    }
                }
            )*
        }
    };
}

for_each_fop!(declare_layer);

macro_rules! declare_fan_out {
    (() $( ($name:ident, $op:ident, ($($arg:ident : $ty:ty),*), $ret:ty) )*) => {
        /// Every fop, none with a default: what a layer over several children (replicate,
        /// distribute, shard) does with each. Its [`Layer`] impl takes its fops from here with
        /// [`fan_out_fops`], so a fop added to [`for_each_fop`] does not compile until each
        /// such layer says where it goes (a [`Layer`] default would send it to the first
        /// child only).
        pub trait FanOut: Send + Sync + 'static {
            $(
                #[doc = concat!("The `", stringify!($name), "` fop.")]
                #[allow(clippy::ptr_arg)] // the fop list's types, as the wire gives them
                fn $name<'a>(&'a self, cx: &'a Ctx, $($arg: $ty),*) -> Fut<'a, $ret>;
            )*
        }
    };
}

for_each_fop!(declare_fan_out);

/// Every fop of a [`FanOut`] layer's [`Layer`] impl, taken from its [`FanOut`] impl: with
/// `use kiln_layer::fan_out_fops;` in the module, `for_each_fop!(fan_out_fops);` inside
/// `impl Layer for T`.
#[macro_export]
macro_rules! fan_out_fops {
    (() $( ($name:ident, $op:ident, ($($arg:ident : $ty:ty),*), $ret:ty) )*) => {
        $(
            fn $name<'a>(&'a self, cx: &'a $crate::Ctx, $($arg: $ty),*) -> $crate::Fut<'a, $ret> {
                <Self as $crate::FanOut>::$name(self, cx, $($arg),*)
            }
        )*
    };
}

/// The shared handle to a layer.
pub type LayerRef = Arc<dyn Layer>;

/// What a fop's result says about the data it moved, for io-stats.
pub trait FopOutput {
    /// Bytes of file data moved (reads and writes), else 0.
    fn data_bytes(&self) -> usize {
        0
    }
}

impl FopOutput for ReadOut {
    fn data_bytes(&self) -> usize {
        self.len()
    }
}

/// What [`Layer::open_small`] gives: a handle, or a small file's whole content with nothing
/// left open.
pub enum Opened {
    /// The file is open.
    Fd(Fd),
    /// The file's content as of the open, all of it, and its attributes when the brick gave
    /// them; no handle to release.
    Whole(Vec<u8>, Option<Attr>),
}

impl Opened {
    /// The same answer with the handle (if it is one) wrapped by `f`.
    pub fn map_fd(self, f: impl FnOnce(Fd) -> Fd) -> Opened {
        match self {
            Opened::Fd(fd) => Opened::Fd(f(fd)),
            whole => whole,
        }
    }
}

impl FopOutput for Opened {
    fn data_bytes(&self) -> usize {
        match self {
            Opened::Fd(_) => 0,
            Opened::Whole(v, _) => v.len(),
        }
    }
}

impl FopOutput for Written {
    fn data_bytes(&self) -> usize {
        self.n
    }
}

macro_rules! no_data {
    ($($t:ty),*) => { $(impl FopOutput for $t {})* };
}
no_data!(
    marks::PendingPage,
    marks::IndexPage,
    marks::HealInfo,
    marks::MemberState,
    Attr,
    Fd,
    (Fd, Attr),
    (),
    ExtentList,
    SnapReply,
    LeaseState,
    ReaddirReply,
    String,
    StatfsReply,
    Vec<u8>,
    Vec<String>
);

/// A layer that treats every fop alike — it acts around the call to its only child (io-stats
/// times it, error-gen may fail it, delay-gen holds it back). [`interpose_all!`] turns one into
/// a [`Layer`].
pub trait Interpose: Send + Sync + 'static {
    /// The layer's name.
    fn name(&self) -> &str;
    /// The one child, first of the slice.
    fn children(&self) -> &[LayerRef];
    /// Runs `call` (the fop on the child) with whatever this layer adds around it.
    fn around<'a, T: FopOutput + Send + 'a>(
        &'a self,
        cx: &'a Ctx,
        op: Op,
        call: Box<dyn FnOnce() -> Fut<'a, T> + Send + 'a>,
    ) -> Fut<'a, T>;
    /// See [`Layer::as_any`].
    fn as_any(&self) -> Option<&dyn Any> {
        None
    }
}

/// Implements [`Layer`] for an [`Interpose`] type: every fop goes through its `around`.
#[macro_export]
macro_rules! interpose_all {
    ($t:ty) => {
        const _: () = {
            use $crate::__interpose_impl;
            $crate::for_each_fop!(__interpose_impl, $t);
        };
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __interpose_impl {
    (($t:ty) $( ($name:ident, $op:ident, ($($arg:ident : $ty:ty),*), $ret:ty) )*) => {
        impl $crate::Layer for $t {
            fn name(&self) -> &str {
                $crate::Interpose::name(self)
            }
            fn children(&self) -> &[$crate::LayerRef] {
                $crate::Interpose::children(self)
            }
            fn as_any(&self) -> Option<&dyn std::any::Any> {
                $crate::Interpose::as_any(self)
            }
            fn open_small<'a>(
                &'a self,
                cx: &'a $crate::Ctx,
                path: &'a str,
                flags: u32,
                max: u32,
            ) -> $crate::Fut<'a, $crate::Opened> {
                let child = &$crate::Interpose::children(self)[0];
                $crate::Interpose::around(
                    self,
                    cx,
                    $crate::Op::Open,
                    Box::new(move || child.open_small(cx, path, flags, max)),
                )
            }
            $(
                fn $name<'a>(&'a self, cx: &'a $crate::Ctx, $($arg: $ty),*) -> $crate::Fut<'a, $ret> {
                    let child = &$crate::Interpose::children(self)[0];
                    $crate::Interpose::around(
                        self,
                        cx,
                        $crate::Op::$op,
                        Box::new(move || child.$name(cx, $($arg),*)),
                    )
                }
            )*
        }
    };
}
