//! The arguments of the replication control fops (MARK_ADD … HEAL_OPEN): what replicas
//! missed, heal locks and heal sessions. `kiln_layer::marks` says what they mean; these are
//! only their wire forms, so that every decoder a peer can reach lives here and is fuzzed.

#![allow(missing_docs)] // fields are described in kiln_layer::marks

use crate::codec::Seq;
use crate::wire_struct;

wire_struct! {
    /// One pending mark: replica `target` (its index in the replicate layer) missed a range.
    pub struct Mark { pub target: u32, pub offset: u64, pub len: u64 }
    /// One range.
    pub struct Range { pub offset: u64, pub len: u64 }
    /// The ranges a replica missed. `gen` changes whenever a mark for `target` is added on
    /// this brick (0: none held); `cut` is where the listing stops (`WHOLE` (`u64::MAX`): it is complete;
    /// else marks from `cut` on may be missing from it); `flags` are its entry/metadata (`ENTRY`/`META` in `kiln_layer::marks`)
    /// marks.
    pub struct TargetRanges {
        pub target: u32,
        pub ranges: Seq<Range>,
        pub gen: u64,
        pub cut: u64,
        pub flags: u32,
    }
    /// A file's marks (possibly the first page of them).
    pub struct PendingPage { pub targets: Seq<TargetRanges>, pub more: bool }
    /// One file with marks, and the bytes it needs, per target; `flags` its entry/metadata
    /// marks.
    pub struct IndexEntry {
        pub path: String,
        pub target: u32,
        pub ranges: u64,
        pub bytes: u64,
        pub flags: u32,
    }
    /// Files with marks (possibly the first page).
    pub struct IndexPage { pub entries: Seq<IndexEntry>, pub more: bool }
    /// A heal lock request: `lock` 1 takes `[offset, offset+len)`, 0 drops it.
    pub struct LockReq { pub offset: u64, pub len: u64, pub lock: u32 }
    /// A conditional clear: `target` has `[offset, offset+len)` now, unless a mark for it was
    /// added since the brick reported `gen`.
    pub struct CondMark { pub target: u32, pub offset: u64, pub len: u64, pub gen: u64 }
    /// Flags (`ENTRY`, `META`) that `target` missed on this path.
    pub struct FlagMark { pub target: u32, pub flags: u32 }
    /// `target` has `flags` healed now, unless a mark for it was added since `gen`; with
    /// `data` 1 the same record marks the whole file's bytes for `target` (heal made the
    /// name a new, empty file there: its bytes are copied next) and keeps `META` flagged
    /// (copying the bytes changes the times: they are copied after).
    pub struct CondFlag { pub target: u32, pub flags: u32, pub gen: u64, pub data: u32 }
    /// What to do with the caller's session on the file: [`SESSION_END`],
    /// [`SESSION_HEAL`], [`SESSION_MIGRATE`], [`SESSION_DIRTY`], [`SESSION_FREEZE`] or
    /// [`SESSION_MOVED`] (the field's name is older than all but the first two).
    pub struct HealReq { pub begin: u32 }
    /// The caller's heal session: `live` 0 when there is none; `busy` 1 when clients had the
    /// file open or were changing it as the session began; the ranges heal writes skipped
    /// since the last ask (asking empties the list; more than a page's worth come merged).
    pub struct HealInfo { pub live: u32, pub busy: u32, pub skipped: Seq<Range> }
    /// `op`: [`MEMBER_ASK`], [`MEMBER_JOIN`] or [`MEMBER_LEAVE`].
    pub struct MemberReq { pub op: u32 }
    /// `joining` 1 while the brick is new to its volume (no identity yet).
    pub struct MemberState { pub joining: u32 }
}

/// HEAL_SESSION: ends the caller's session on the file (a freeze with it).
pub const SESSION_END: u32 = 0;
/// HEAL_SESSION: begins (afresh) a heal session: heal writes skip what clients change.
pub const SESSION_HEAL: u32 = 1;
/// HEAL_SESSION: begins (afresh) a migration session on the file a rebalance moves: the
/// brick records the ranges clients change, for the mover to copy again.
pub const SESSION_MIGRATE: u32 = 2;
/// HEAL_SESSION: hands the ranges clients changed since the last hand-over to the session's
/// list that HEAL_INFO returns (as `skipped`).
pub const SESSION_DIRTY: u32 = 3;
/// HEAL_SESSION: freezes the file for the cut-over: waits for other connections' changes in
/// flight, then refuses every fop on it but the caller's with `EMOVED`, until the session
/// ends or lapses.
pub const SESSION_FREEZE: u32 = 4;
/// HEAL_SESSION: the file moved for good: handles open on it fail with `EMOVED` from now on,
/// whatever happens to the session.
pub const SESSION_MOVED: u32 = 5;

/// MEMBER: only say whether the brick is new.
pub const MEMBER_ASK: u32 = 0;
/// MEMBER: a full rebuild finished: the brick records its identity and is a member.
pub const MEMBER_JOIN: u32 = 1;
/// MEMBER: the brick forgets its identity and is new again (a rebuild of it starts).
pub const MEMBER_LEAVE: u32 = 2;
