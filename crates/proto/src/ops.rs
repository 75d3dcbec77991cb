//! Fops: opcodes and the arguments of every request and reply.
//!
//! Paths on the wire are relative to the brick root, `/`-separated, with no `.` or `..`
//! components and no leading `/`; the server refuses anything else. A reply whose header status is
//! not zero carries no arguments.

#![allow(missing_docs)] // fields are named after the POSIX fields they carry

use crate::codec::Seq;
use crate::errno;
use crate::wire_struct;

macro_rules! ops {
    ($( $(#[$m:meta])* $name:ident = $val:expr => ($by:ident, $effects:expr, $replay:expr, $acts:ident) ),* $(,)?) => {
        /// A fop's opcode.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[repr(u16)]
        pub enum Op { $( $(#[$m])* $name = $val ),* }

        impl Op {
            /// Every opcode, in wire order.
            pub const ALL: &'static [Op] = &[$(Op::$name),*];

            /// The opcode for a wire value, if known.
            pub fn from_u16(v: u16) -> Option<Op> {
                match v { $( $val => Some(Op::$name), )* _ => None }
            }

            /// Lower-case name, as shown in logs and profiles.
            pub fn name(self) -> &'static str {
                match self { $( Op::$name => stringify!($name), )* }
            }

            /// What the fop's arguments name (the table's first column).
            pub fn by(self) -> By {
                match self { $( Op::$name => By::$by, )* }
            }

            /// What the fop may change of what it names (the second column).
            pub fn effects(self) -> Effects {
                match self { $( Op::$name => { use effects_consts::*; $effects } )* }
            }

            /// How a client repeats the fop when its connection was lost with the request in
            /// flight (the third column).
            pub fn replay(self) -> Replay {
                #[allow(unused_imports)]
                use Replay::*;
                match self { $( Op::$name => $replay, )* }
            }

            /// Whom the brick acts as when it runs the fop (the fourth column).
            pub fn acts_as(self) -> ActsAs {
                match self { $( Op::$name => ActsAs::$acts, )* }
            }
        }
    };
}

/// What a fop's arguments name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum By {
    /// The connection itself (handshake, management, profiling, watching, liveness).
    Conn,
    /// A path (or two): the request's `path`-like fields, relative to the brick root.
    Path,
    /// An open file: the arguments begin with the brick's handle number, little-endian
    /// (a protocol-client patches it there when it reopens the handle on a new connection).
    Handle,
}

/// What a fop may change of what it names: a set of the constants below. The brick derives
/// from it what it tells watchers ([`CHANGE_DATA`] and the others), which local readers'
/// grants it makes stale, and a replicating client which fops it stamps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Effects(u8);

impl Effects {
    /// Changes nothing a cache or a grant holds.
    pub const NONE: Effects = Effects(0);
    /// The file's bytes or size.
    pub const DATA: Effects = Effects(1);
    /// Makes a name.
    pub const ADDS: Effects = Effects(2);
    /// Removes or replaces a name.
    pub const REMOVES: Effects = Effects(4);
    /// Extended attributes or the link count.
    pub const ATTR: Effects = Effects(8);
    /// The bytes, when the request's open flags have `O_TRUNC`.
    pub const TRUNC: Effects = Effects(16);
    /// Opens a handle (the brick keeps its path for what is changed through it).
    pub const OPENS: Effects = Effects(32);
    /// Begins heal or migration of the file (its bytes may be replaced under readers).
    pub const HEAL: Effects = Effects(64);

    /// Both sets.
    pub const fn and(self, o: Effects) -> Effects {
        Effects(self.0 | o.0)
    }

    /// True when any of `o` is in this set.
    pub fn any(self, o: Effects) -> bool {
        self.0 & o.0 != 0
    }

    /// True when nothing is.
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// What watchers are told of each path the request names (`CHANGE_*` bits), given
    /// whether its open flags truncate.
    pub fn pushed(self, truncates: bool) -> u8 {
        let mut k = 0;
        if self.any(Effects::DATA) || (truncates && self.any(Effects::TRUNC)) {
            k |= CHANGE_DATA;
        }
        if self.any(Effects::ADDS.and(Effects::REMOVES)) {
            k |= CHANGE_NAME;
        }
        if self.any(Effects::ATTR) {
            k |= CHANGE_ATTR;
        }
        k
    }
}

/// The table's names for [`Effects`].
mod effects_consts {
    pub use super::Effects;
    pub const NONE: Effects = Effects::NONE;
    pub const DATA: Effects = Effects::DATA;
    pub const ADDS: Effects = Effects::ADDS;
    pub const REMOVES: Effects = Effects::REMOVES;
    pub const ATTR: Effects = Effects::ATTR;
    pub const TRUNC: Effects = Effects::TRUNC;
    pub const OPENS: Effects = Effects::OPENS;
    pub const HEAL: Effects = Effects::HEAL;
}

/// How a fop is repeated after its connection was lost with the request in flight, so that
/// the brick's second answer means what the first would have (see `kiln_client`'s replay).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Replay {
    /// Idempotent: the same request.
    Same,
    /// The same request; this errno in the second answer means the first one took effect.
    DoneIf(crate::Errno),
    /// The same request; `EEXIST` means the first one made the name: answer with its lookup.
    Made,
    /// A create: again without `O_EXCL` and `O_TRUNC`.
    Create,
    /// Not repeatable: bound to the connection that was lost.
    Never,
}

/// Whom the brick acts as when it runs a fop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ActsAs {
    /// The caller: with the credentials the request carries ([`crate::frame::FLAG_CRED`]).
    Caller,
    /// The brick itself: the fop ignores credentials.
    Brick,
}

// The fop table. Each row: opcode, then what the fop's arguments name ([`By`]), what it may
// change ([`Effects`]), how a client repeats it after a lost connection ([`Replay`]), and
// whom the brick acts as ([`ActsAs`]). Whatever depends on these is derived from the row.
ops! {
    /// Version and limits exchange; the first request on a connection.
    Hello = 1 => (Conn, NONE, Never, Brick),
    /// Attributes of a path, not following a final symlink.
    Lookup = 2 => (Path, NONE, Same, Caller),
    /// Attributes of an open file.
    Fstat = 3 => (Handle, NONE, Same, Caller),
    /// Change mode, owner, times or size of a path.
    Setattr = 4 => (Path, DATA, Same, Caller),
    /// Open an existing file; returns a handle.
    Open = 5 => (Path, OPENS.and(TRUNC), Same, Caller),
    /// Create (or open) a file; returns a handle and attributes.
    Create = 6 => (Path, OPENS.and(ADDS).and(TRUNC), Create, Caller),
    /// Read from a handle; the data is the reply's payload.
    Read = 7 => (Handle, NONE, Same, Brick),
    /// Write the request's payload to a handle.
    Write = 8 => (Handle, DATA, Same, Caller),
    /// Flush a handle to stable storage.
    Fsync = 9 => (Handle, NONE, Same, Brick),
    /// Close a handle.
    Release = 10 => (Handle, NONE, Same, Brick),
    /// Remove a file.
    Unlink = 11 => (Path, REMOVES, DoneIf(errno::ENOENT), Caller),
    /// Make a directory.
    Mkdir = 12 => (Path, ADDS, Made, Caller),
    /// Remove an empty directory.
    Rmdir = 13 => (Path, REMOVES, DoneIf(errno::ENOENT), Caller),
    /// Rename a path.
    Rename = 14 => (Path, REMOVES.and(ADDS), DoneIf(errno::ENOENT), Caller),
    /// List a directory with attributes.
    Readdir = 15 => (Path, NONE, Same, Caller),
    /// Make a symbolic link.
    Symlink = 16 => (Path, ADDS, Made, Caller),
    /// Read a symbolic link's target.
    Readlink = 17 => (Path, NONE, Same, Caller),
    /// Make a hard link.
    Link = 18 => (Path, ADDS.and(ATTR), Made, Caller),
    /// File system statistics.
    Statfs = 19 => (Path, NONE, Same, Caller),
    /// Read an extended attribute.
    Getxattr = 20 => (Path, NONE, Same, Caller),
    /// Set an extended attribute.
    Setxattr = 21 => (Path, ATTR, DoneIf(errno::EEXIST), Caller),
    /// List extended attribute names.
    Listxattr = 22 => (Path, NONE, Same, Caller),
    /// Remove an extended attribute.
    Removexattr = 23 => (Path, ATTR, DoneIf(errno::ENODATA), Caller),
    /// Allocate (or punch, with mode flags) file space.
    Fallocate = 24 => (Handle, DATA, Same, Caller),
    /// Discard a range: punch a hole, keeping the size.
    Discard = 25 => (Handle, DATA, Same, Caller),
    /// Change mode, owner, times or size of an open file.
    Fsetattr = 26 => (Handle, DATA, Same, Caller),
    /// Prove the shared secret (challenge-response after HELLO).
    Auth = 27 => (Conn, NONE, Never, Brick),
    /// Profiling control and data: the reply's payload is JSON (see [`ProfileReq`]).
    Profile = 28 => (Conn, NONE, Never, Brick),
    /// Volume management (create, start, volfile, heal, …): the request and the reply's
    /// payload are JSON (see [`MgmtReq`]). Served by a kilnd that keeps volume definitions.
    Mgmt = 29 => (Conn, NONE, Never, Brick),
    /// Replication control (`crate::marks`): replica `target` missed a byte range of a file.
    MarkAdd = 30 => (Path, NONE, Same, Brick),
    /// Replication control: `target` has that range now.
    MarkClear = 31 => (Path, NONE, Same, Brick),
    /// Replication control: the same, unless a mark was added since a generation (`EAGAIN`).
    MarkClearIf = 32 => (Path, NONE, Never, Brick),
    /// Replication control: `target` missed an entry or metadata change of a path.
    FlagAdd = 33 => (Path, NONE, Same, Brick),
    /// Replication control: those flags are healed, unless a mark was added since a generation.
    FlagClearIf = 34 => (Path, NONE, Never, Brick),
    /// Replication control: take or drop heal's range lock on a file.
    HealLock = 35 => (Path, HEAL, Never, Brick),
    /// Replication control: begin or end the caller's heal session on a file.
    HealSession = 36 => (Path, HEAL, Never, Brick),
    /// Replication control: a file's marks (a page of them).
    Pending = 37 => (Path, NONE, Same, Brick),
    /// Replication control: the brick's index of files with marks (a page of it).
    PendingIndex = 38 => (Path, NONE, Same, Brick),
    /// Replication control: the caller's heal session on a file, and what its writes skipped.
    HealInfo = 39 => (Path, NONE, Never, Brick),
    /// Open a file for heal: writes through the handle skip what clients changed since the
    /// caller's heal session began.
    HealOpen = 40 => (Path, OPENS.and(TRUNC).and(HEAL), Never, Brick),
    /// Read a directory's distribute layout (empty when it has none).
    LayoutGet = 41 => (Path, NONE, Same, Brick),
    /// Store a directory's distribute layout (checked to be one before it is stored).
    LayoutSet = 42 => (Path, NONE, Same, Brick),
    /// Make a FIFO, socket, character or block device node (or an empty regular file).
    Mknod = 43 => (Path, ADDS, Made, Caller),
    /// Replication control: whether the brick is new to its volume (not yet rebuilt), and
    /// heal's word that a rebuild finished (or that a brick must be rebuilt).
    Member = 44 => (Path, NONE, Same, Brick),
    /// Write the request's payload to a handle, then record on this brick that the replicas
    /// in `missed` lack the bytes written (a replica's miss recorded in the same step as the
    /// write, not in a round trip after it).
    WriteMarked = 45 => (Handle, DATA, Same, Caller),
    /// Local short-circuit (Unix-socket connections only): a read-only descriptor of the file
    /// a handle has open, passed with `SCM_RIGHTS` ([`crate::frame::FLAG_FDS`]), and the slot
    /// of the brick's generation table that says while reads through it are current (see
    /// [`GrantReq`], [`GrantReply`]). With `fh` 0 it only reports the caller's direct reads.
    Grant = 46 => (Handle, NONE, Never, Brick),
    /// Never sent: the io-stats row that counts reads clients made straight from the brick's
    /// files with a grant (reported with [`Op::Grant`]).
    LocalRead = 47 => (Conn, NONE, Never, Brick),
    /// Ask the brick to tell this connection when other connections change files and names
    /// ([`WatchReq`]): it then sends [`crate::frame::FLAG_PUSH`] frames, unasked, each a
    /// [`Changes`]. Caches of what others may change (a mount's names, attributes and small
    /// files) are dropped on them instead of on a timeout.
    Watch = 48 => (Conn, NONE, Same, Brick),
    /// Where an open file's data lies in a range ([`ExtentsReq`]): runs of data and of holes,
    /// from the brick file system's `SEEK_DATA`/`SEEK_HOLE` ([`ExtentList`]).
    Extents = 49 => (Handle, NONE, Same, Brick),
    /// An image's exclusive lock ([`LeaseReq`]): one holder at a time writes the file; a
    /// holder that stops renewing loses it to the next one that asks ([`LeaseState`]).
    Lease = 50 => (Handle, NONE, Same, Brick),
    /// Changed-block tracking ([`DirtyReq`]): start or stop recording which ranges of a file
    /// are written under a name, or ask which were since it started ([`ExtentList`]).
    Dirty = 51 => (Handle, NONE, Same, Brick),
    /// Snapshots of an image ([`SnapReq`]): a write barrier on the file, a copy of it taken
    /// under the barrier by the brick file system's reflink, and clones of such copies.
    Snap = 52 => (Handle, NONE, Same, Brick),
    /// A client that ends cleanly says so (no arguments, an empty reply): every change it sent
    /// on this connection was answered, and so were their siblings on the other replicas, so
    /// the brick forgets what it changed lately instead of leaving it as suspect marks when
    /// the connection closes. Sent only with nothing in flight.
    Bye = 53 => (Conn, NONE, Same, Brick),
    /// Are you there? (no arguments, an empty reply). A client sends it on a connection with
    /// requests waiting that has heard nothing for a while; the brick answers on the
    /// connection's own thread, before any storage call (see [`HELLO_PING`]).
    Ping = 54 => (Conn, NONE, Same, Brick),
    /// Make a directory's entries durable: fsync(2) of the directory on the brick's file
    /// system (a name created, renamed or removed in it survives a crash of the brick's host).
    Syncdir = 55 => (Path, NONE, Same, Caller),
}

impl Op {
    /// True for the POSIX fops a brick runs with the caller's credentials when the request
    /// carries them ([`crate::frame::FLAG_CRED`]): every name and metadata fop, and writes.
    /// A write was checked at open; it carries credentials only when the writer lacks
    /// `CAP_FSETID`, so that the brick's kernel drops the file's set-user-ID and set-group-ID
    /// bits as for a local write (a mount leaves that to the bricks). Other data fops on an
    /// open file (read, fsync, release) and replication control are the brick's own
    /// business: those run as the brick and ignore credentials.
    pub fn acts_for_caller(self) -> bool {
        self.acts_as() == ActsAs::Caller
    }

    /// True for the fops that may change a file's bytes or size: the ones a replicating
    /// client stamps ([`crate::stamp::Stamp`]).
    pub fn changes_bytes(self) -> bool {
        self.effects().any(Effects::DATA)
    }
}

wire_struct! {
    /// A timestamp: seconds and nanoseconds since the epoch.
    pub struct Time { pub sec: i64, pub nsec: u32 }

    /// File attributes, as `stat` gives them.
    pub struct Attr {
        pub ino: u64,
        pub mode: u32,
        pub nlink: u64,
        pub uid: u32,
        pub gid: u32,
        pub rdev: u64,
        pub size: u64,
        pub blocks: u64,
        pub blksize: u32,
        pub atime: Time,
        pub mtime: Time,
        pub ctime: Time,
    }

    /// Hello request. `metrics` is the client's `/metrics` and profile endpoint (`IP:PORT`), or
    /// empty: `kiln volume profile` learns from the brick where its clients report.
    pub struct HelloReq { pub version: u32, pub client: String, pub metrics: String }
    /// Hello reply. With `auth_required`, every fop but HELLO and AUTH is refused until the
    /// client has proved the secret over `nonce` (see [`crate::auth`]).
    pub struct HelloReply {
        pub version: u32,
        pub server: String,
        pub max_payload: u32,
        pub auth_required: bool,
        pub nonce: Vec<u8>,
        /// [`HELLO_NEW_BRICK`] when the brick is new to its volume: it holds no data yet
        /// that a reader may trust, until a full rebuild makes it a member.
        pub flags: u32,
    }
    /// Auth request: the client's nonce, its proof, and the identity whose key it proves
    /// (empty: the compatibility identity, a shared secret).
    pub struct AuthReq { pub client_nonce: Vec<u8>, pub proof: Vec<u8>, pub identity: String }
    /// Auth reply: the server's proof, so the client knows the server holds the secret too.
    pub struct AuthReply { pub proof: Vec<u8> }

    /// A request naming one path.
    pub struct PathReq { pub path: String }
    /// A request naming one open handle.
    pub struct HandleReq { pub fh: u64 }

    /// GRANT: a descriptor for handle `fh` (0: none), and the reads (`reads` calls, `bytes`
    /// bytes) the client made straight from this brick's files since its last GRANT.
    /// With [`GRANT_PIN`] in `pin` the file may not move while the handle is open (its reader
    /// bypasses every check: FUSE passthrough), and a migration of it is refused with `EBUSY`.
    /// With [`GRANT_SUMS`] (sent only to a brick whose HELLO has [`HELLO_SUMS`]) a file that
    /// keeps block checksums comes with a read-only descriptor of them (after the file's).
    pub struct GrantReq { pub fh: u64, pub reads: u64, pub bytes: u64, pub pin: u8 }
    /// GRANT's reply: the handle's slot in the connection's generation table and the value it
    /// holds now. Reads through the descriptor are current while the slot keeps that value.
    /// With `table` set, the reply carries two descriptors: the table (a sealed memfd of
    /// little-endian `u64` slots, sent once per connection), then the file.
    pub struct GrantReply { pub slot: u32, pub gen: u64, pub table: bool }

    /// Attributes to change; `valid` says which fields apply (`SETATTR_*`).
    pub struct SetAttrs {
        pub valid: u32,
        pub mode: u32,
        pub uid: u32,
        pub gid: u32,
        pub size: u64,
        pub atime: Time,
        pub mtime: Time,
    }

    /// Setattr request: change `attrs` of a path.
    pub struct SetattrReq { pub path: String, pub attrs: SetAttrs }

    /// Fsetattr request: change `attrs` of an open handle (works after unlink).
    pub struct FsetattrReq { pub fh: u64, pub attrs: SetAttrs }

    /// Open request; `flags` are Linux `O_*` flags (the server filters them). With `peek`
    /// above 0 (OPEN only, read-only opens of regular files): when the file holds
    /// `peek` bytes or fewer, the reply carries them all as
    /// its payload, `fh` is 0 and nothing stays open on the brick — a small file read in one
    /// round trip, and no release to send.
    pub struct OpenReq { pub path: String, pub flags: u32, pub peek: u32 }
    /// Open reply: the handle, or 0 when the payload is the whole file (see [`OpenReq`]).
    pub struct OpenReply { pub fh: u64 }
    /// Open reply to a request with [`OPEN_ATTR`] whose payload is the whole file: `fh` 0 and
    /// the file's attributes as it was read.
    pub struct OpenWholeReply { pub fh: u64, pub attr: Attr }
    /// Create request.
    pub struct CreateReq { pub path: String, pub flags: u32, pub mode: u32 }
    /// Create reply.
    pub struct CreateReply { pub fh: u64, pub attr: Attr }

    /// Read request: up to `len` bytes at `offset`. The reply payload holds the data; fewer
    /// bytes than asked means end of file.
    pub struct ReadReq { pub fh: u64, pub offset: u64, pub len: u32 }
    /// Write request: the payload is written at `offset`.
    pub struct WriteReq { pub fh: u64, pub offset: u64 }
    /// Write reply.
    pub struct WriteReply { pub written: u32 }
    /// Write-marked request: a write, and the replicas (a bit each, by index in their set)
    /// that miss it. The reply is a [`WriteReply`].
    pub struct WriteMarkedReq { pub fh: u64, pub offset: u64, pub missed: u32 }
    /// Fsync request.
    pub struct FsyncReq { pub fh: u64, pub datasync: bool }

    /// Mkdir request.
    pub struct MkdirReq { pub path: String, pub mode: u32 }
    /// Rename request; `flags` are `RENAME_*` flags.
    pub struct RenameReq { pub from: String, pub to: String, pub flags: u32 }

    /// Readdir request: up to `max` entries starting at index `offset`.
    pub struct ReaddirReq { pub path: String, pub offset: u64, pub max: u32 }
    /// One directory entry. `xattrs`: it has extended attributes a client may see (false lets a
    /// client that listed it answer "none" itself, for a while).
    pub struct DirEntry { pub name: String, pub attr: Attr, pub xattrs: bool }
    /// Readdir reply; `eof` when no entries follow.
    pub struct ReaddirReply { pub entries: Seq<DirEntry>, pub eof: bool }

    /// Symlink request: make `path` point at `target`.
    pub struct SymlinkReq { pub target: String, pub path: String }

    /// Mknod request: make `path` a node of type and permissions `mode` (`S_IFIFO`, `S_IFSOCK`,
    /// `S_IFCHR`, `S_IFBLK` or `S_IFREG`), device number `rdev` for devices.
    pub struct MknodReq { pub path: String, pub mode: u32, pub rdev: u64 }
    /// Readlink reply.
    pub struct ReadlinkReply { pub target: String }
    /// Link request: make `path` another name for `existing`.
    pub struct LinkReq { pub existing: String, pub path: String }

    /// Statfs reply.
    pub struct StatfsReply {
        pub bsize: u64,
        pub frsize: u64,
        pub blocks: u64,
        pub bfree: u64,
        pub bavail: u64,
        pub files: u64,
        pub ffree: u64,
        pub namemax: u64,
    }

    /// Getxattr / Removexattr request.
    pub struct XattrReq { pub path: String, pub name: String }
    /// Getxattr reply.
    pub struct XattrValue { pub value: Vec<u8> }
    /// Setxattr request; `flags` are `XATTR_CREATE` / `XATTR_REPLACE`.
    pub struct SetxattrReq { pub path: String, pub name: String, pub value: Vec<u8>, pub flags: u32 }
    /// Listxattr reply.
    pub struct XattrNames { pub names: Seq<String> }

    /// Watch request: `on` starts the pushes ([`Op::Watch`]), off stops them.
    pub struct WatchReq { pub on: bool }
    /// One change another connection made: `kind` is a set of `CHANGE_*` bits, `path` as on
    /// the wire.
    pub struct Change { pub kind: u8, pub path: String }
    /// A push frame's arguments: what changed since the last push. With `all`, more changed
    /// than the brick kept track of (or the list is incomplete): drop everything cached.
    pub struct Changes { pub all: bool, pub changes: Seq<Change> }

    /// Fallocate request; `mode` is Linux `FALLOC_FL_*`.
    pub struct FallocateReq { pub fh: u64, pub mode: u32, pub offset: u64, pub len: u64 }
    /// Discard request.
    pub struct DiscardReq { pub fh: u64, pub offset: u64, pub len: u64 }

    /// Extents request: the runs of data and holes of `[offset, offset + len)`, at most
    /// [`EXTENTS_MAX`] of them.
    pub struct ExtentsReq { pub fh: u64, pub offset: u64, pub len: u64 }
    /// One run of an open file: `len` bytes, data or a hole (reads as zeros, takes no space).
    pub struct Extent { pub len: u64, pub hole: bool }
    /// Extents reply: consecutive runs from the request's offset. They may end before the
    /// range does (more runs than fit, or a layer that knows no more); the caller asks again
    /// from where they end. Past the end of the file is one hole; `size` is the file's size
    /// when asked (`u64::MAX`: not known).
    pub struct ExtentList { pub size: u64, pub runs: Seq<Extent> }

    /// Lease request on the file an open handle names: `cmd` is one of the `LEASE_*` values,
    /// `holder` names the asker (unique per process and image), `ttl_ms` how long a grant
    /// lasts unless renewed.
    pub struct LeaseReq { pub fh: u64, pub cmd: u32, pub ttl_ms: u32, pub holder: String }
    /// Lease reply: whether the asker holds the lease now (or, for a release, no longer
    /// does); otherwise who does (the name up to its last `#`) and for how much longer.
    /// `token` rises with each new holder; `fresh`: granted by this very request (not a
    /// renewal), so an asker that cannot use it gives it back.
    pub struct LeaseState { pub granted: bool, pub holder: String, pub remaining_ms: u32, pub token: u64, pub fresh: bool }

    /// Dirty request on the file an open handle names: `cmd` is one of the `DIRTY_*` values;
    /// `name` the record's; `[offset, offset + len)` the range asked about (`DIRTY_GET`). The
    /// reply is an [`ExtentList`] whose holes are the ranges not written since the start.
    pub struct DirtyReq { pub fh: u64, pub cmd: u32, pub name: String, pub offset: u64, pub len: u64 }

    /// Snap request on the file an open handle names: `cmd` is one of the `SNAP_*` values;
    /// `name` the snapshot's; `to` a clone's path; `ttl_ms` how long a barrier lasts unless
    /// lifted. The reply is a [`crate::stamp::SnapReply`].
    pub struct SnapReq { pub fh: u64, pub cmd: u32, pub name: String, pub to: String, pub ttl_ms: u32 }

    /// Profile request: `cmd` is one of the `PROFILE_*` values. The reply carries no arguments
    /// and a JSON payload: the server's io-stats (cumulative and since the last start).
    pub struct ProfileReq { pub cmd: u32 }

    /// Management request: a JSON document naming the command and its arguments. The reply
    /// carries no arguments and a JSON payload.
    pub struct MgmtReq { pub json: Vec<u8> }

    /// One timestamped event of a traced request: nanoseconds on the sender's monotonic clock.
    pub struct TraceEvent { pub t_ns: u64, pub label: String }
    /// The server's part of a traced request's timeline. `clock` names the clock the times were
    /// taken on (equal values: the same host's monotonic clock, directly comparable).
    pub struct TraceBlock { pub clock: u64, pub events: Seq<TraceEvent> }
}

/// [`GrantReq::pin`] bit: pin the file (see [`GrantReq`]).
pub const GRANT_PIN: u8 = 1;
/// [`GrantReq::pin`] bit: send the file's block checksums too: a descriptor of a 4096-byte
/// header followed by one little-endian `u32` entry per 4 KiB block (the form of
/// [`HELLO_SUMS`]'s entries, and `u32::MAX` for a block mid-change), which the brick keeps
/// current: a direct reader checks the blocks it reads against them.
pub const GRANT_SUMS: u8 = 2;

/// [`HelloReply::flags`]: the brick is new to its volume (see `kiln_layer::marks`).
pub const HELLO_NEW_BRICK: u32 = 1;
/// [`HelloReply::flags`]: the brick answers [`Op::Ping`].
pub const HELLO_PING: u32 = 2;
/// [`HelloReply::flags`]: the brick keeps block checksums and ships them with a READ that asks
/// ([`crate::frame::FLAG_SUMS`]): the reply's arguments are one little-endian `u32` entry per
/// 4 KiB block the data touches, in order — the block's crc32c (Castagnoli) sealed away
/// from 0 and `u32::MAX` (a sum of 0 is sent as 1, of `u32::MAX` as `u32::MAX - 1`), or 0 where
/// the reader has nothing to check (no sum; or a block the data covers only in part, which
/// the brick checked itself). A block's sum covers its 4096 bytes with the file's end read as
/// zeros. Arguments are empty when the brick checked every block itself.
pub const HELLO_SUMS: u32 = 4;

/// [`OpenReq::flags`] bit (no Linux `O_*` flag uses it): a reply carrying the whole file
/// is an [`OpenWholeReply`], with its attributes. A brick that does not know the bit drops it
/// with the flags it does not pass on, and answers an [`OpenReply`].
pub const OPEN_ATTR: u32 = 1 << 31;

/// The most runs an [`ExtentList`] carries (a brick stops there; the caller asks again).
pub const EXTENTS_MAX: usize = 1024;

/// Lease: who holds it (grants nothing).
pub const LEASE_QUERY: u32 = 0;
/// Lease: take it if nobody holds it, it lapsed, or the asker holds it (a renewal).
pub const LEASE_ACQUIRE: u32 = 1;
/// Lease: give it up (granted: the asker does not hold it now).
pub const LEASE_RELEASE: u32 = 2;
/// The longest lease a brick grants, in milliseconds.
pub const LEASE_TTL_MAX: u32 = 300_000;

/// Dirty: start recording writes under the name (from now: anything recorded is dropped).
pub const DIRTY_START: u32 = 1;
/// Dirty: the ranges written since the record started (`ENOENT`: no such record).
pub const DIRTY_GET: u32 = 2;
/// Dirty: stop recording and drop the record.
pub const DIRTY_STOP: u32 = 3;
/// The most dirty records one file keeps.
pub const DIRTY_MAX: usize = 8;

/// Snap: before the barrier, copy the file to its snapshot `name` (reflink) and start
/// recording the ranges changed from then on (changes in flight included): the barrier then
/// only has those to copy again, so writers wait for little.
pub const SNAP_PREPARE: u32 = 5;
/// Snap: raise a write barrier on the file: changes from other connections wait until it
/// is lifted (or lapses); answered once the changes in flight have finished.
pub const SNAP_FREEZE: u32 = 1;
/// Snap: under the asker's barrier, bring snapshot `name` up to the file (after
/// `SNAP_PREPARE`: the ranges changed since; else the whole file), by reflink (`EOPNOTSUPP`
/// where the file system cannot); answers the ranges that waited. With `to`, the copy is put
/// there (its directory must exist) with the file's mode and owner, instead of beside the
/// file: a file of a directory tree's snapshot.
pub const SNAP_TAKE: u32 = 2;
/// Snap: lift the asker's barrier.
pub const SNAP_THAW: u32 = 3;
/// Snap: make `to` a new file sharing the blocks of snapshot `name` (reflink).
pub const SNAP_CLONE: u32 = 4;

/// The longest write barrier a brick keeps, in milliseconds.
pub const SNAP_TTL_MAX: u32 = 30_000;

/// Where snapshot `name` of the file at `path` lives: a hidden sibling, `DIR/.BASE@NAME`.
pub fn snapshot_path(path: &str, name: &str) -> String {
    match path.rsplit_once('/') {
        Some((dir, base)) => format!("{dir}/.{base}@{name}"),
        None => format!(".{path}@{name}"),
    }
}

/// True for a snapshot name: 1 to 64 of `A-Z a-z 0-9 . _ -`, not starting with a dot.
pub fn snapshot_name_ok(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// Profile: report only.
pub const PROFILE_INFO: u32 = 0;
/// Profile: start a new interval (and keep counting).
pub const PROFILE_START: u32 = 1;
/// Profile: end the interval.
pub const PROFILE_STOP: u32 = 2;

impl SetAttrs {
    /// The change that gives a file `attr`'s permission bits and owner.
    pub fn mode_and_owner(attr: &Attr) -> SetAttrs {
        SetAttrs {
            valid: SETATTR_MODE | SETATTR_UID | SETATTR_GID,
            mode: attr.mode & 0o7777,
            uid: attr.uid,
            gid: attr.gid,
            ..Default::default()
        }
    }
}

/// Setattr: apply `mode`.
pub const SETATTR_MODE: u32 = 1 << 0;
/// Setattr: apply `uid`.
pub const SETATTR_UID: u32 = 1 << 1;
/// Setattr: apply `gid`.
pub const SETATTR_GID: u32 = 1 << 2;
/// Setattr: apply `size` (truncate).
pub const SETATTR_SIZE: u32 = 1 << 3;
/// Setattr: apply `atime`.
pub const SETATTR_ATIME: u32 = 1 << 4;
/// Setattr: apply `mtime`.
pub const SETATTR_MTIME: u32 = 1 << 5;
/// Setattr: set atime to the server's now.
pub const SETATTR_ATIME_NOW: u32 = 1 << 6;
/// Setattr: set mtime to the server's now.
pub const SETATTR_MTIME_NOW: u32 = 1 << 7;

/// [`Change::kind`] is a set of these bits. The file's content (and so its size and times)
/// changed.
pub const CHANGE_DATA: u8 = 1;
/// [`Change::kind`]: the file's attributes changed (mode, owner, times, extended attributes).
pub const CHANGE_ATTR: u8 = 2;
/// [`Change::kind`]: the name now leads to another file, or to none (created, removed,
/// renamed from or to, linked).
pub const CHANGE_NAME: u8 = 4;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fuzzer_can_name_every_wire_type_with_one_byte() {
        let lists = [
            WIRE_TYPES,
            crate::marks::WIRE_TYPES,
            crate::stamp::WIRE_TYPES,
        ];
        let names: Vec<&str> = lists
            .iter()
            .flat_map(|l| l.iter().map(|(n, _)| *n))
            .collect();
        assert!(names.len() <= 256, "{} wire types", names.len());
        let mut unique = names.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), names.len());
        assert!(names.contains(&"WriteReq") && names.contains(&"Mark"));
    }

    #[test]
    fn effects_give_what_watchers_are_told() {
        assert_eq!(Op::Write.effects().pushed(false), CHANGE_DATA);
        assert_eq!(Op::Open.effects().pushed(false), 0);
        assert_eq!(Op::Open.effects().pushed(true), CHANGE_DATA);
        assert_eq!(Op::Create.effects().pushed(false), CHANGE_NAME);
        assert_eq!(Op::Rename.effects().pushed(false), CHANGE_NAME);
        assert_eq!(Op::Setxattr.effects().pushed(false), CHANGE_ATTR);
        assert_eq!(Op::HealSession.effects().pushed(true), 0);
        let stamped: Vec<Op> = Op::ALL
            .iter()
            .copied()
            .filter(|o| o.changes_bytes())
            .collect();
        use Op::*;
        assert_eq!(
            stamped,
            [Setattr, Write, Fallocate, Discard, Fsetattr, WriteMarked]
        );
    }

    #[test]
    fn handle_fops_act_on_a_handle_and_connection_fops_are_never_repeated_blindly() {
        for &op in Op::ALL {
            if op.by() == By::Conn {
                assert!(
                    matches!(op.replay(), Replay::Never | Replay::Same),
                    "{op:?}"
                );
                assert_eq!(op.acts_as(), ActsAs::Brick, "{op:?}");
            }
            if op.effects().any(Effects::OPENS) {
                assert_eq!(op.by(), By::Path, "{op:?}");
            }
        }
    }
}
