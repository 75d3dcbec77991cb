//! Kiln's wire protocol: the frame header, fop arguments, and the errno values that travel.
//!
//! This crate does no I/O. Both sides of the wire, and the golden test vectors in
//! `tests/vectors/`, are built on it.
#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod addr;
pub mod auth;
pub mod codec;
pub mod cred;
pub mod error;
pub mod frame;
pub mod iov;
pub mod marks;
pub mod ops;
pub mod seconds;
pub mod stamp;
pub mod sync;

pub use addr::Listen;
pub use codec::{DecodeError, Wire};
pub use cred::Cred;
pub use error::{Error, Kind};
pub use frame::{Header, HeaderError, HEADER_LEN, MAX_ARGS_LEN, MAX_PAYLOAD_LEN};
pub use ops::Op;

/// A Linux errno value, as fops return it and the frame header carries it.
pub type Errno = u32;

/// Linux errno values the protocol itself produces (others pass through from the brick).
pub mod errno {
    /// Operation not permitted.
    pub const EPERM: u32 = 1;
    /// No such file or directory.
    pub const ENOENT: u32 = 2;
    /// I/O error.
    pub const EIO: u32 = 5;
    /// The name exists.
    pub const EEXIST: u32 = 17;
    /// Bad file descriptor (unknown handle).
    pub const EBADF: u32 = 9;
    /// Busy: the server has as many clients as it serves.
    pub const EBUSY: u32 = 16;
    /// Permission denied (a path that would leave the brick).
    pub const EACCES: u32 = 13;
    /// Invalid argument.
    pub const EINVAL: u32 = 22;
    /// Too many open files (a connection's handle limit).
    pub const EMFILE: u32 = 24;
    /// Read-only (an identity that may not change anything).
    pub const EROFS: u32 = 30;
    /// Result too large for the caller's buffer.
    pub const ERANGE: u32 = 34;
    /// No such attribute.
    pub const ENODATA: u32 = 61;
    /// A name or path too long.
    pub const ENAMETOOLONG: u32 = 36;
    /// Unknown opcode.
    pub const ENOSYS: u32 = 38;
    /// Operation not supported.
    pub const EOPNOTSUPP: u32 = 95;
    /// Protocol error: a malformed frame or arguments.
    pub const EPROTO: u32 = 71;
    /// Message too long.
    pub const EMSGSIZE: u32 = 90;
    /// The other side speaks another transport (a plaintext client on a TLS-only brick).
    pub const EPROTONOSUPPORT: u32 = 93;
    /// The connection was reset.
    pub const ECONNRESET: u32 = 104;
    /// Not connected.
    pub const ENOTCONN: u32 = 107;
    /// Operation cancelled.
    pub const ECANCELED: u32 = 125;
    /// The file moved to another subvolume (EREMCHG, "remote address changed"): a rebalance
    /// migrated it while this handle was open there. A client that follows its volume's graph
    /// reopens the file where it is now and sends the fop again.
    pub const EMOVED: u32 = 78;
    /// A block's checksum does not match its bytes (EILSEQ, as Linux's dm-integrity reports
    /// it): the brick's copy is damaged. A replicated client reads the block from another
    /// replica and has this one repaired; an application is told `EIO`.
    pub const ECKSUM: u32 = 84;

    /// The errno an application is told for wire errno `e`: Kiln's own codes become the
    /// standard one they stand for ([`ECKSUM`]: `EIO`).
    pub fn for_application(e: u32) -> u32 {
        if e == ECKSUM {
            EIO
        } else {
            e
        }
    }
}
