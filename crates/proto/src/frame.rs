//! The fixed frame header and the limits every frame obeys.
//!
//! A frame on the wire is `Header` (32 bytes, little endian), then `args_len` bytes of encoded
//! arguments (see [`crate::codec`]), then `payload_len` bytes of raw payload. The payload is file
//! data: it never passes through the argument codec, so a receiver can place it straight into the
//! buffer it is destined for.

use zerocopy::byteorder::little_endian::{U16, U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

/// `b"KILN"` read as a little-endian u32.
pub const MAGIC: u32 = u32::from_le_bytes(*b"KILN");
/// The protocol version this crate speaks.
pub const VERSION: u8 = 1;
/// Size of [`Header`] on the wire.
pub const HEADER_LEN: usize = 32;
/// Largest encoded argument block a peer may send.
pub const MAX_ARGS_LEN: u32 = 64 * 1024;
/// Largest payload a peer may send in one frame (READ reply or WRITE request).
pub const MAX_PAYLOAD_LEN: u32 = 16 * 1024 * 1024;

/// Flag: on a request, the server records when each of its stages ran. It answers with the
/// ordinary reply, then a second frame with this flag, the same request id and opcode, and a
/// [`crate::ops::TraceBlock`] as its arguments — so the reply itself is received exactly as an
/// unsampled one would be. Only sampled requests carry it.
pub const FLAG_TRACE: u32 = 1;
/// Flag: on a request, the arguments start with a [`crate::cred::Cred`] — who asks (uid, gid,
/// supplementary groups) — and the fop's own arguments follow it. The brick runs the fop's
/// storage calls with those credentials. Requests without it run as the brick itself (root).
pub const FLAG_CRED: u32 = 2;
/// Flag: on a reply over a Unix socket, descriptors came with the frame's first byte
/// (`SCM_RIGHTS`, one batch per frame, in stream order); the fop says how many.
pub const FLAG_FDS: u32 = 4;
/// Flag: a reply frame the server sends unasked (request id 0, opcode [`crate::Op::Watch`]),
/// to a connection that asked for pushes: its arguments are a [`crate::ops::Changes`].
pub const FLAG_PUSH: u32 = 8;
/// Flag: on a request, the arguments start (after any credentials) with a
/// [`crate::stamp::Stamp`]: which change of a replicating writer this is.
pub const FLAG_STAMP: u32 = 16;
/// Flag: on a READ request, the client checks the data against the blocks' checksums itself:
/// a brick that answers from a file (with `sendfile`) puts the checksum entries of the blocks
/// the reply covers in its arguments instead of reading the data to check it (see
/// [`crate::ops::HELLO_SUMS`]). Sent only to a brick whose HELLO offered it.
pub const FLAG_SUMS: u32 = 32;
/// Every flag this version knows.
pub const FLAGS_KNOWN: u32 = FLAG_TRACE | FLAG_CRED | FLAG_FDS | FLAG_PUSH | FLAG_STAMP | FLAG_SUMS;

/// Frame kinds.
pub const KIND_REQUEST: u8 = 0;
/// A reply to the request with the same `request_id`.
pub const KIND_REPLY: u8 = 1;

/// The fixed frame header.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned,
)]
#[repr(C)]
pub struct Header {
    /// Always [`MAGIC`].
    pub magic: U32,
    /// Always [`VERSION`].
    pub version: u8,
    /// [`KIND_REQUEST`] or [`KIND_REPLY`].
    pub kind: u8,
    /// The fop, see [`crate::Op`]. A reply carries its request's opcode.
    pub opcode: U16,
    /// Chosen by the client, echoed by the server; replies may arrive in any order.
    pub request_id: U64,
    /// 0 for success, else a Linux errno. Requests carry 0.
    pub status: U32,
    /// Length of the encoded arguments that follow the header.
    pub args_len: U32,
    /// Length of the raw payload that follows the arguments.
    pub payload_len: U32,
    /// Flags ([`FLAG_TRACE`]); every other bit must be zero.
    pub flags: U32,
}

const _: () = assert!(core::mem::size_of::<Header>() == HEADER_LEN);
const _: () = assert!(MAX_ARGS_LEN as u64 + MAX_PAYLOAD_LEN as u64 <= u32::MAX as u64);

/// Why a header was rejected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeaderError {
    /// Fewer than [`HEADER_LEN`] bytes.
    Short,
    /// Wrong magic: not a Kiln peer, or the stream lost its framing.
    BadMagic(u32),
    /// A version this build does not speak.
    BadVersion(u8),
    /// Neither request nor reply.
    BadKind(u8),
    /// `args_len` above [`MAX_ARGS_LEN`].
    ArgsTooLong(u32),
    /// `payload_len` above [`MAX_PAYLOAD_LEN`].
    PayloadTooLong(u32),
    /// A flag this version does not know was set.
    UnknownFlags(u32),
}

impl core::fmt::Display for HeaderError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            HeaderError::Short => write!(f, "frame header shorter than {HEADER_LEN} bytes"),
            HeaderError::BadMagic(m) => write!(f, "bad frame magic {m:#010x}"),
            HeaderError::BadVersion(v) => write!(f, "unsupported protocol version {v}"),
            HeaderError::BadKind(k) => write!(f, "unknown frame kind {k}"),
            HeaderError::ArgsTooLong(n) => write!(f, "args length {n} above limit {MAX_ARGS_LEN}"),
            HeaderError::PayloadTooLong(n) => {
                write!(f, "payload length {n} above limit {MAX_PAYLOAD_LEN}")
            }
            HeaderError::UnknownFlags(x) => write!(f, "unknown header flags {x:#x}"),
        }
    }
}

impl std::error::Error for HeaderError {}

impl Header {
    /// A request header.
    pub fn request(opcode: u16, request_id: u64, args_len: u32, payload_len: u32) -> Header {
        Header {
            magic: MAGIC.into(),
            version: VERSION,
            kind: KIND_REQUEST,
            opcode: opcode.into(),
            request_id: request_id.into(),
            status: 0.into(),
            args_len: args_len.into(),
            payload_len: payload_len.into(),
            flags: 0.into(),
        }
    }

    /// A reply header for `request`.
    pub fn reply(
        opcode: u16,
        request_id: u64,
        status: u32,
        args_len: u32,
        payload_len: u32,
    ) -> Header {
        Header {
            kind: KIND_REPLY,
            status: status.into(),
            ..Header::request(opcode, request_id, args_len, payload_len)
        }
    }

    /// Parses and validates a header. Never panics, whatever the bytes.
    pub fn parse(bytes: &[u8]) -> Result<Header, HeaderError> {
        let (h, _) = Header::read_from_prefix(bytes).map_err(|_| HeaderError::Short)?;
        h.validate()?;
        Ok(h)
    }

    /// Checks magic, version, kind, the length limits and the flags.
    pub fn validate(&self) -> Result<(), HeaderError> {
        if self.magic.get() != MAGIC {
            return Err(HeaderError::BadMagic(self.magic.get()));
        }
        if self.version != VERSION {
            return Err(HeaderError::BadVersion(self.version));
        }
        if self.kind > KIND_REPLY {
            return Err(HeaderError::BadKind(self.kind));
        }
        if self.args_len.get() > MAX_ARGS_LEN {
            return Err(HeaderError::ArgsTooLong(self.args_len.get()));
        }
        if self.payload_len.get() > MAX_PAYLOAD_LEN {
            return Err(HeaderError::PayloadTooLong(self.payload_len.get()));
        }
        if self.flags.get() & !FLAGS_KNOWN != 0 {
            return Err(HeaderError::UnknownFlags(self.flags.get()));
        }
        Ok(())
    }

    /// True when [`FLAG_TRACE`] is set.
    pub fn traced(&self) -> bool {
        self.flags.get() & FLAG_TRACE != 0
    }

    /// The same header with [`FLAG_TRACE`] set.
    pub fn with_trace(mut self) -> Header {
        self.flags = (self.flags.get() | FLAG_TRACE).into();
        self
    }

    /// True when the arguments start with credentials ([`FLAG_CRED`]).
    pub fn has_cred(&self) -> bool {
        self.flags.get() & FLAG_CRED != 0
    }

    /// True when the arguments carry a stamp ([`FLAG_STAMP`]).
    pub fn has_stamp(&self) -> bool {
        self.flags.get() & FLAG_STAMP != 0
    }

    /// True when the reader checks block checksums itself ([`FLAG_SUMS`]).
    pub fn wants_sums(&self) -> bool {
        self.flags.get() & FLAG_SUMS != 0
    }

    /// The same header with `flags` (of [`FLAG_CRED`], [`FLAG_STAMP`], [`FLAG_SUMS`]) set.
    pub fn with_flags(mut self, flags: u32) -> Header {
        self.flags = (self.flags.get() | flags).into();
        self
    }

    /// True for a push frame ([`FLAG_PUSH`]).
    pub fn is_push(&self) -> bool {
        self.flags.get() & FLAG_PUSH != 0
    }

    /// A push frame's header ([`FLAG_PUSH`]) for `args_len` bytes of [`crate::ops::Changes`].
    pub fn push(args_len: u32) -> Header {
        let h = Header::reply(crate::Op::Watch as u16, 0, 0, args_len, 0);
        Header {
            flags: FLAG_PUSH.into(),
            ..h
        }
    }

    /// True when descriptors came with the frame ([`FLAG_FDS`]).
    pub fn has_fds(&self) -> bool {
        self.flags.get() & FLAG_FDS != 0
    }

    /// The same header with [`FLAG_FDS`] set.
    pub fn with_fds(mut self) -> Header {
        self.flags = (self.flags.get() | FLAG_FDS).into();
        self
    }

    /// The header's 32 wire bytes.
    pub fn to_bytes(&self) -> [u8; HEADER_LEN] {
        let mut out = [0u8; HEADER_LEN];
        out.copy_from_slice(self.as_bytes());
        out
    }
}
