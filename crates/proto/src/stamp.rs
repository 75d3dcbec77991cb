//! Which writes a replica ran: the stamp a replicating client puts on each change of a file's
//! bytes when its header has [`crate::frame::FLAG_STAMP`], and what a brick reports of the
//! stamps it ran when a snapshot is taken ([`SnapReply`]).
//!
//! A change sent to every replica carries the same stamp to each: the writer (one per client
//! and file), a sequence number rising with each change, and `done`, below which every change
//! of that writer is settled — ran on every replica, or marked as missed where it did not.
//! A brick keeps, per file and writer, the changes it ran at or above the highest `done` it
//! saw. Comparing what the replicas kept finds a change one replica has not run yet although
//! others have (in transit to it, or queued behind others), which no barrier could see.

use crate::codec::{Dec, DecodeError, Seq, Wire};
use crate::ops::ExtentList;

crate::wire_struct! {
    /// A change's stamp (see the module documentation).
    pub struct Stamp {
        /// The writer: one client's changes to one file.
        pub writer: u64,
        /// This change's number, rising from 1.
        pub seq: u64,
        /// Every change of the writer numbered below it is settled.
        pub done: u64,
    }

    /// A change a brick ran: its sequence number and the bytes it touched (`len` 0: from
    /// `offset` to the end, a size change).
    pub struct Ran {
        /// The change's [`Stamp::seq`].
        pub seq: u64,
        /// Where the bytes it changed start.
        pub offset: u64,
        /// How many (0: to the end).
        pub len: u64,
    }

    /// What a brick kept of one writer's changes to a file: the highest `done` it saw and the
    /// changes it ran at or above it.
    pub struct WriterRan {
        /// The writer's [`Stamp::writer`].
        pub writer: u64,
        /// The highest [`Stamp::done`] the brick saw from it.
        pub done: u64,
        /// Its changes the brick ran, numbered at or above `done`.
        pub ran: Seq<Ran>,
    }

    /// Snap reply. For `SNAP_TAKE`: the ranges changes waited on while the barrier stood (as
    /// an extent list's data runs), the stamped changes the copy holds (`writers`), `lost`,
    /// true when the brick forgot some of those (too many writers or changes in flight) or
    /// could not list every range that waited, and `marked`, true when it holds marks on the
    /// file: with either, the copies cannot be compared. Empty for the other commands.
    pub struct SnapReply {
        /// The ranges changes waited on (data runs).
        pub blocked: ExtentList,
        /// The stamped changes the copy holds, by writer.
        pub writers: Seq<WriterRan>,
        /// The brick forgot some.
        pub lost: bool,
        /// The brick holds marks on the file: a replica missed a change of it.
        pub marked: bool,
    }
}

impl Stamp {
    /// Splits a request's arguments (behind any credentials) into the stamp in front and the
    /// fop's own.
    pub fn split(args: &[u8]) -> Result<(Stamp, &[u8]), DecodeError> {
        let mut d = Dec::new(args);
        let s = Stamp::decode(&mut d)?;
        Ok((s, d.rest()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stamp_prefixes_the_arguments() {
        let s = Stamp {
            writer: 7,
            seq: 9,
            done: 3,
        };
        let mut args = s.to_wire();
        args.extend_from_slice(b"rest");
        let (back, rest) = Stamp::split(&args).unwrap();
        assert_eq!((back, rest), (s, &b"rest"[..]));
        assert!(Stamp::split(&[1, 2, 3]).is_err());
    }
}
