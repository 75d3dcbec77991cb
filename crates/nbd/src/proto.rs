//! The NBD wire protocol as far as this server speaks it: magic numbers, option, reply, command
//! and flag values, and encoders for the few message shapes the server sends. Everything on the
//! NBD wire is big-endian. No I/O happens here.

/// `NBDMAGIC`: the first 8 bytes the server sends.
pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
/// `IHAVEOPT`: the newstyle magic, sent by the server once and by the client before every option.
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
/// Magic of every fixed-newstyle option reply.
pub const OPT_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
/// Magic of a transmission request.
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
/// Magic of a simple reply.
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
/// Magic of a structured reply chunk.
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

/// Handshake flag: the server speaks fixed newstyle.
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
/// Handshake flag: the server can leave out the 124 zero bytes after `NBD_OPT_EXPORT_NAME`.
pub const FLAG_NO_ZEROES: u16 = 1 << 1;
/// Client flag: the client speaks fixed newstyle.
pub const CLIENT_FIXED_NEWSTYLE: u32 = 1 << 0;
/// Client flag: leave out the 124 zero bytes.
pub const CLIENT_NO_ZEROES: u32 = 1 << 1;

/// Transmission flags.
pub mod tflag {
    /// Always set.
    pub const HAS_FLAGS: u16 = 1 << 0;
    /// Writes fail with `EPERM`.
    pub const READ_ONLY: u16 = 1 << 1;
    /// `NBD_CMD_FLUSH` is understood.
    pub const SEND_FLUSH: u16 = 1 << 2;
    /// `NBD_CMD_FLAG_FUA` is understood.
    pub const SEND_FUA: u16 = 1 << 3;
    /// `NBD_CMD_TRIM` is understood.
    pub const SEND_TRIM: u16 = 1 << 5;
    /// `NBD_CMD_WRITE_ZEROES` (and its `NO_HOLE` flag) is understood.
    pub const SEND_WRITE_ZEROES: u16 = 1 << 6;
    /// `NBD_CMD_FLAG_DF` is understood (only with structured replies).
    pub const SEND_DF: u16 = 1 << 7;
    /// Flush and FUA effects are visible on every connection to the export.
    pub const CAN_MULTI_CONN: u16 = 1 << 8;
    /// `NBD_CMD_FLAG_FAST_ZERO` is understood.
    pub const SEND_FAST_ZERO: u16 = 1 << 11;
}

/// Option numbers (`NBD_OPT_*`).
pub mod opt {
    /// Choose an export and enter transmission; no error reply possible.
    pub const EXPORT_NAME: u32 = 1;
    /// End the negotiation.
    pub const ABORT: u32 = 2;
    /// List the exports.
    pub const LIST: u32 = 3;
    /// Start TLS (not supported).
    pub const STARTTLS: u32 = 5;
    /// Describe an export.
    pub const INFO: u32 = 6;
    /// Describe an export and enter transmission.
    pub const GO: u32 = 7;
    /// Use structured replies.
    pub const STRUCTURED_REPLY: u32 = 8;
    /// List the metadata contexts a query matches.
    pub const LIST_META_CONTEXT: u32 = 9;
    /// Select the metadata contexts for `NBD_CMD_BLOCK_STATUS`.
    pub const SET_META_CONTEXT: u32 = 10;
}

/// Option reply types (`NBD_REP_*`).
pub mod rep {
    /// Success / end of a list.
    pub const ACK: u32 = 1;
    /// One export, in reply to `NBD_OPT_LIST`.
    pub const SERVER: u32 = 2;
    /// One piece of information about an export.
    pub const INFO: u32 = 3;
    /// One metadata context: its id and name.
    pub const META_CONTEXT: u32 = 4;
    /// The option is not known.
    pub const ERR_UNSUP: u32 = (1 << 31) + 1;
    /// The option is known but malformed.
    pub const ERR_INVALID: u32 = (1 << 31) + 3;
    /// The export does not exist (or cannot be served now).
    pub const ERR_UNKNOWN: u32 = (1 << 31) + 6;
    /// The server is shutting down.
    pub const ERR_SHUTDOWN: u32 = (1 << 31) + 7;
    /// The option (or its reply) is too big.
    pub const ERR_TOO_BIG: u32 = (1 << 31) + 9;
}

/// Information types in an `NBD_REP_INFO` reply (`NBD_INFO_*`).
pub mod info {
    /// Size and transmission flags (always sent).
    pub const EXPORT: u16 = 0;
    /// The canonical export name.
    pub const NAME: u16 = 1;
    /// A human-readable description.
    pub const DESCRIPTION: u16 = 2;
    /// Minimum, preferred and maximum block size.
    pub const BLOCK_SIZE: u16 = 3;
}

/// Commands (`NBD_CMD_*`).
pub mod cmd {
    /// Read.
    pub const READ: u16 = 0;
    /// Write (payload follows the request).
    pub const WRITE: u16 = 1;
    /// Disconnect after in-flight requests.
    pub const DISC: u16 = 2;
    /// Make completed writes durable.
    pub const FLUSH: u16 = 3;
    /// Discard a range (a hint).
    pub const TRIM: u16 = 4;
    /// Zero a range without payload.
    pub const WRITE_ZEROES: u16 = 6;
    /// Which parts of a range are data and which holes (a structured reply).
    pub const BLOCK_STATUS: u16 = 7;
}

/// Command flags (`NBD_CMD_FLAG_*`).
pub mod cflag {
    /// Reply only once the data is durable.
    pub const FUA: u16 = 1 << 0;
    /// `WRITE_ZEROES` must leave the range allocated.
    pub const NO_HOLE: u16 = 1 << 1;
    /// `READ` must come back in one content chunk.
    pub const DF: u16 = 1 << 2;
    /// `BLOCK_STATUS` needs to describe only the first extent.
    pub const REQ_ONE: u16 = 1 << 3;
    /// `WRITE_ZEROES` must fail fast with `ENOTSUP` rather than be slow.
    pub const FAST_ZERO: u16 = 1 << 4;
}

/// Structured reply chunk types and flags.
pub mod chunk {
    /// This is the last chunk of the reply.
    pub const FLAG_DONE: u16 = 1 << 0;
    /// No payload; ends a reply.
    pub const NONE: u16 = 0;
    /// Data at an offset.
    pub const OFFSET_DATA: u16 = 1;
    /// Block status descriptors of one metadata context.
    pub const BLOCK_STATUS: u16 = 5;
    /// An error with an optional message.
    pub const ERROR: u16 = (1 << 15) + 1;
}

/// Error values on the NBD wire (a fixed subset of Linux errno values).
pub mod err {
    /// Operation not permitted (writes to a read-only export).
    pub const EPERM: u32 = 1;
    /// I/O error.
    pub const EIO: u32 = 5;
    /// Out of memory.
    pub const ENOMEM: u32 = 12;
    /// Invalid argument (bad range, flags, command, size).
    pub const EINVAL: u32 = 22;
    /// No space (writes beyond the end).
    pub const ENOSPC: u32 = 28;
    /// Value too large.
    pub const EOVERFLOW: u32 = 75;
    /// Not supported (fast zero refused).
    pub const ENOTSUP: u32 = 95;
    /// The server is shutting down.
    pub const ESHUTDOWN: u32 = 108;
}

/// Bytes of a transmission request header.
pub const REQUEST_LEN: usize = 28;
/// Bytes of a simple reply header.
pub const SIMPLE_REPLY_LEN: usize = 16;
/// Bytes of a structured reply chunk header.
pub const CHUNK_HEADER_LEN: usize = 20;
/// Bytes in front of the data of an `OFFSET_DATA` chunk: the chunk header and the offset.
pub const OFFSET_DATA_HEAD_LEN: usize = CHUNK_HEADER_LEN + 8;

/// Minimum block size advertised: a regular file on the brick is byte-addressable.
pub const MIN_BLOCK: u32 = 1;
/// Preferred block size advertised: the page size, below which writes cost a read-modify-write
/// in the brick's page cache.
pub const PREFERRED_BLOCK: u32 = 4096;
/// Largest READ or WRITE accepted (and advertised): 32 MiB, the size the protocol says no client
/// needs to exceed for interoperability.
pub const MAX_BLOCK: u32 = 32 << 20;

/// Maps an errno from the brick to the NBD error set.
pub fn nbd_error(errno: u32) -> u32 {
    match errno as i32 {
        libc::EPERM | libc::EACCES | libc::EROFS => err::EPERM,
        libc::ENOMEM => err::ENOMEM,
        libc::EINVAL => err::EINVAL,
        libc::ENOSPC | libc::EDQUOT | libc::EFBIG => err::ENOSPC,
        libc::EOVERFLOW => err::EOVERFLOW,
        libc::EOPNOTSUPP => err::ENOTSUP,
        libc::ESHUTDOWN => err::ESHUTDOWN,
        _ => err::EIO,
    }
}

/// The short name of a command, for logs and metrics.
pub fn cmd_name(c: u16) -> &'static str {
    match c {
        cmd::READ => "read",
        cmd::WRITE => "write",
        cmd::DISC => "disc",
        cmd::FLUSH => "flush",
        cmd::TRIM => "trim",
        5 => "cache",
        cmd::WRITE_ZEROES => "write_zeroes",
        cmd::BLOCK_STATUS => "block_status",
        _ => "unknown",
    }
}

/// A transmission request header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    /// Command flags (`cflag`).
    pub flags: u16,
    /// Command (`cmd`).
    pub cmd: u16,
    /// The client's opaque handle, echoed in the reply.
    pub handle: u64,
    /// Byte offset in the export.
    pub offset: u64,
    /// Byte length.
    pub len: u32,
}

impl Request {
    /// Decodes a request header; `None` if the magic is wrong (the stream is lost).
    pub fn parse(b: &[u8; REQUEST_LEN]) -> Option<Request> {
        if be32(&b[0..4]) != REQUEST_MAGIC {
            return None;
        }
        Some(Request {
            flags: u16::from_be_bytes([b[4], b[5]]),
            cmd: u16::from_be_bytes([b[6], b[7]]),
            handle: be64(&b[8..16]),
            offset: be64(&b[16..24]),
            len: be32(&b[24..28]),
        })
    }

    /// Encodes the header (used by tests and tools).
    pub fn encode(&self) -> [u8; REQUEST_LEN] {
        let mut b = [0u8; REQUEST_LEN];
        b[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        b[4..6].copy_from_slice(&self.flags.to_be_bytes());
        b[6..8].copy_from_slice(&self.cmd.to_be_bytes());
        b[8..16].copy_from_slice(&self.handle.to_be_bytes());
        b[16..24].copy_from_slice(&self.offset.to_be_bytes());
        b[24..28].copy_from_slice(&self.len.to_be_bytes());
        b
    }
}

/// Reads a big-endian u32 from the first 4 bytes.
pub fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}

/// Reads a big-endian u64 from the first 8 bytes.
pub fn be64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_be_bytes(a)
}

/// Writes a simple reply header into `out[..16]`.
pub fn simple_reply(out: &mut [u8], error: u32, handle: u64) {
    out[0..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    out[4..8].copy_from_slice(&error.to_be_bytes());
    out[8..16].copy_from_slice(&handle.to_be_bytes());
}

/// Writes a structured chunk header into `out[..20]`; `len` is the payload length after it.
pub fn chunk_header(out: &mut [u8], flags: u16, kind: u16, handle: u64, len: u32) {
    out[0..4].copy_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
    out[4..6].copy_from_slice(&flags.to_be_bytes());
    out[6..8].copy_from_slice(&kind.to_be_bytes());
    out[8..16].copy_from_slice(&handle.to_be_bytes());
    out[16..20].copy_from_slice(&len.to_be_bytes());
}

/// Writes the head of a final `OFFSET_DATA` chunk carrying `len` data bytes at `offset` into
/// `out[..28]`; the data follows it directly.
pub fn offset_data_head(out: &mut [u8], handle: u64, offset: u64, len: u32) {
    chunk_header(out, chunk::FLAG_DONE, chunk::OFFSET_DATA, handle, len + 8);
    out[20..28].copy_from_slice(&offset.to_be_bytes());
}

/// A complete final `ERROR` chunk with a message (cut to the protocol's 4096-byte limit).
pub fn error_chunk(handle: u64, error: u32, msg: &str) -> Vec<u8> {
    let mut n = msg.len().min(4096);
    while !msg.is_char_boundary(n) {
        n -= 1;
    }
    let msg = &msg.as_bytes()[..n];
    let mut out = vec![0u8; CHUNK_HEADER_LEN + 6 + msg.len()];
    chunk_header(
        &mut out,
        chunk::FLAG_DONE,
        chunk::ERROR,
        handle,
        (6 + msg.len()) as u32,
    );
    out[20..24].copy_from_slice(&error.to_be_bytes());
    out[24..26].copy_from_slice(&(msg.len() as u16).to_be_bytes());
    out[26..].copy_from_slice(msg);
    out
}

/// A complete final `NONE` chunk (success without data).
pub fn none_chunk(handle: u64) -> [u8; CHUNK_HEADER_LEN] {
    let mut out = [0u8; CHUNK_HEADER_LEN];
    chunk_header(&mut out, chunk::FLAG_DONE, chunk::NONE, handle, 0);
    out
}

/// An option reply: header and data.
pub fn option_reply(option: u32, kind: u32, data: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(20 + data.len());
    out.extend_from_slice(&OPT_REPLY_MAGIC.to_be_bytes());
    out.extend_from_slice(&option.to_be_bytes());
    out.extend_from_slice(&kind.to_be_bytes());
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(data);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_round_trips_and_checks_magic() {
        let r = Request {
            flags: cflag::FUA,
            cmd: cmd::WRITE,
            handle: 0x0102_0304_0506_0708,
            offset: 1 << 40,
            len: 4096,
        };
        let b = r.encode();
        assert_eq!(&b[0..4], &[0x25, 0x60, 0x95, 0x13]);
        assert_eq!(Request::parse(&b), Some(r));
        let mut bad = b;
        bad[0] ^= 1;
        assert_eq!(Request::parse(&bad), None);
    }

    #[test]
    fn reply_layouts() {
        let mut s = [0u8; 16];
        simple_reply(&mut s, err::EINVAL, 7);
        assert_eq!(
            s,
            [0x67, 0x44, 0x66, 0x98, 0, 0, 0, 22, 0, 0, 0, 0, 0, 0, 0, 7]
        );

        let mut h = [0u8; OFFSET_DATA_HEAD_LEN];
        offset_data_head(&mut h, 9, 512, 4096);
        assert_eq!(&h[0..4], &[0x66, 0x8e, 0x33, 0xef]);
        assert_eq!(u16::from_be_bytes([h[4], h[5]]), chunk::FLAG_DONE);
        assert_eq!(u16::from_be_bytes([h[6], h[7]]), chunk::OFFSET_DATA);
        assert_eq!(be64(&h[8..16]), 9);
        assert_eq!(be32(&h[16..20]), 4096 + 8);
        assert_eq!(be64(&h[20..28]), 512);

        let e = error_chunk(3, err::EINVAL, "bad");
        assert_eq!(e.len(), 20 + 6 + 3);
        assert_eq!(u16::from_be_bytes([e[6], e[7]]), chunk::ERROR);
        assert_eq!(be32(&e[16..20]), 9);
        assert_eq!(be32(&e[20..24]), 22);
        assert_eq!(&e[26..], b"bad");
        // Long messages are cut to 4096 bytes, on a character boundary.
        let e = error_chunk(3, err::EIO, &"é".repeat(3000));
        assert_eq!(u16::from_be_bytes([e[24], e[25]]), 4096);
        assert!(std::str::from_utf8(&e[26..]).is_ok());

        let o = option_reply(opt::GO, rep::ACK, &[]);
        assert_eq!(be64(&o[0..8]), OPT_REPLY_MAGIC);
        assert_eq!(be32(&o[8..12]), opt::GO);
        assert_eq!(be32(&o[12..16]), rep::ACK);
        assert_eq!(be32(&o[16..20]), 0);
    }

    #[test]
    fn errno_mapping_stays_in_the_nbd_set() {
        assert_eq!(nbd_error(libc::EROFS as u32), err::EPERM);
        assert_eq!(nbd_error(libc::EDQUOT as u32), err::ENOSPC);
        assert_eq!(nbd_error(libc::EOPNOTSUPP as u32), err::ENOTSUP);
        assert_eq!(nbd_error(libc::ECONNRESET as u32), err::EIO);
        assert_eq!(nbd_error(libc::EINVAL as u32), err::EINVAL);
    }
}
