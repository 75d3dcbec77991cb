//! The shard layer: a big file's bytes in fixed-size pieces spread over the replica sets, so
//! that one image's I/O uses every set, a rebalance moves pieces rather than whole images, and
//! heal copies only the pieces a replica missed.
//!
//! # On storage
//!
//! A sharded file is marked by the xattr [`SHARD_XATTR`] on its own name (the *base*): its piece
//! size ("block") and a random id. The base holds the bytes of piece 0, `[0, block)`, and its
//! size is the size of the whole file — so lookup, readdir and stat show the right size with no
//! extra work, and a file that never grows past one block is exactly an unsharded file. Piece
//! `k ≥ 1` holds bytes `[k·block, (k+1)·block)` in the file [`piece_path`]`(id, k)` under the
//! hidden directory [`SHARD_DIR`]; a piece that does not exist is a hole. Pieces are keyed by
//! the id, not the name, so rename moves nothing. Distribute places piece `k` of a file on the
//! set after the one piece `k−1` is on ([`piece_of`]): consecutive pieces are striped over the
//! sets, whatever the names hash to.
//!
//! Files are marked when they are created while the volume shards; a file without the mark is
//! read and written whole, as before. The layer therefore stays in a volume's graph for good.
//!
//! # Sizes
//!
//! A write past the end that reaches beyond piece 0 first sets the base's size (one `fsetattr`
//! for all the writes waiting, in order, never shrinking what this handle set), then writes the
//! pieces: a crash between leaves zeros, never a size that hides written bytes. Truncating
//! changes the base first (the brick checks the caller's right to), then removes the pieces
//! past the new end and cuts the one it falls in. Pieces left past the end by a crash between
//! are removed before the file grows over them again.
//!
//! # Credentials
//!
//! Pieces are made, read and removed with no caller credentials (as the bricks' own user):
//! the base's permissions, checked when it is opened, changed or removed, guard them.
//!
//! # Limits
//!
//! A file's mtime changes with writes to piece 0 and with size changes, not with writes to later
//! pieces; `st_blocks` counts piece 0 only. Two clients growing or truncating one file at once
//! may leave a size one of them did not ask for (single-writer images are the use). A piece
//! handle stays open while its file is open.

mod file;
mod io;
mod ops;
#[cfg(test)]
mod tests;

use std::sync::atomic::AtomicBool;

use crate::{Attr, Ctx, Errno, FopResult, LayerRef};
use kiln_proto::Error;

/// The hidden directory, at the volume's root, that holds every piece past the first.
pub const SHARD_DIR: &str = ".shards";
/// The xattr that marks a file as sharded: [`Mark`].
pub const SHARD_XATTR: &str = "user.kiln.shard";
/// The smallest piece size.
pub const MIN_BLOCK: u64 = 1 << 20;
/// The largest piece size.
pub const MAX_BLOCK: u64 = 1 << 40;

const MAGIC: &[u8; 4] = b"KSH1";
const ENODATA: Errno = libc::ENODATA as Errno;
const ENOENT: Errno = libc::ENOENT as Errno;
const EEXIST: Errno = libc::EEXIST as Errno;
const EPERM: Errno = libc::EPERM as Errno;
const O_TRUNC: u32 = libc::O_TRUNC as u32;
const O_EXCL: u32 = libc::O_EXCL as u32;

/// A sharded file's mark: its piece size and its id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mark {
    /// Bytes per piece.
    pub block: u64,
    /// 32 hex digits naming its pieces.
    pub id: String,
}

impl Mark {
    /// A new mark with a random id.
    fn new(block: u64) -> FopResult<Mark> {
        let mut raw = [0u8; 16];
        // SAFETY: getrandom writes at most `raw.len()` bytes into `raw`, which we own.
        let n = unsafe { libc::getrandom(raw.as_mut_ptr().cast(), raw.len(), 0) };
        if n != raw.len() as isize {
            return Err(libc::EIO as Errno);
        }
        let id = raw.iter().map(|b| format!("{b:02x}")).collect();
        Ok(Mark { block, id })
    }

    /// As stored in [`SHARD_XATTR`]: magic, block (u64 LE), id.
    pub fn encode(&self) -> Vec<u8> {
        let mut v = MAGIC.to_vec();
        v.extend_from_slice(&self.block.to_le_bytes());
        v.extend_from_slice(self.id.as_bytes());
        v
    }

    /// The mark stored in `v`, or None if it is not one.
    pub fn decode(v: &[u8]) -> Option<Mark> {
        let rest = v.strip_prefix(MAGIC)?;
        let block = u64::from_le_bytes(rest.get(..8)?.try_into().ok()?);
        let id = std::str::from_utf8(rest.get(8..)?).ok()?;
        (valid_block(block) && is_id(id)).then(|| Mark {
            block,
            id: id.to_owned(),
        })
    }
}

/// Whether `block` may be a piece size: a power of two from [`MIN_BLOCK`] to [`MAX_BLOCK`].
pub fn valid_block(block: u64) -> bool {
    block.is_power_of_two() && (MIN_BLOCK..=MAX_BLOCK).contains(&block)
}

fn is_id(s: &str) -> bool {
    s.len() == 32
        && s.bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
}

/// Where piece `k` of the file with id `id` lives.
pub fn piece_path(id: &str, k: u64) -> String {
    format!("{SHARD_DIR}/{id}.{k}")
}

/// The file id and piece number of a piece's path; None for any other path. [`Pieces`]
/// stripes pieces by these.
pub fn piece_of(path: &str) -> Option<(&str, u64)> {
    let rest = path.strip_prefix(SHARD_DIR)?.strip_prefix('/')?;
    let (id, k) = rest.split_once('.')?;
    if !is_id(id) || k.is_empty() || !k.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some((id, k.parse().ok()?))
}

/// Shard's placement for the distribute layers of a volume: piece `k` of a file goes to the
/// subvolume after the one piece `k−1` is on (from the hash of the file's id), so consecutive
/// pieces land on different sets; every other name by its own hash.
pub struct Pieces;

impl crate::distribute::Placement for Pieces {
    fn place(&self, path: &str, layout: &crate::distribute::Layout) -> Option<usize> {
        let (id, k) = piece_of(path)?;
        Some(layout.stripe(crate::distribute::name_hash(id), k))
    }
}

/// Whether `path` is the shard directory or in it: not the caller's to see or change.
fn hidden(path: &str) -> bool {
    path == SHARD_DIR
        || path
            .strip_prefix(SHARD_DIR)
            .is_some_and(|r| r.starts_with('/'))
}

fn is_reg(a: &Attr) -> bool {
    a.mode & libc::S_IFMT == libc::S_IFREG
}

/// The context for work on pieces: the caller's trace, no credentials (see the module
/// documentation).
fn inner(cx: &Ctx) -> Ctx {
    Ctx {
        trace: cx.trace.clone(),
        owner: cx.owner,
        cred: None,
        change: cx.change.clone(),
        devices: cx.devices,
        subtree: None,
        ship_sums: cx.ship_sums,
    }
}

/// Splits big files into pieces over the layer below (see the module documentation).
pub struct Shard {
    name: String,
    kids: Vec<LayerRef>,
    block: u64,
    dir_made: AtomicBool,
}

crate::layer_options! {
    /// The options of a shard layer: big files in pieces over the replica sets (client side).
    pub struct ShardConfig {
        /// Bytes per piece of files created from now on: a power of two, 1 MiB to 1 TiB.
        #[option(ty = "bytes", default = "required")]
        pub block_size: u64,
    }
}

impl Shard {
    /// Shards files created from now on into pieces of `block` bytes.
    pub fn new(name: &str, child: LayerRef, block: u64) -> Result<Shard, Error> {
        if !valid_block(block) {
            return Err(Error::invalid(format!(
                "{name}: block size {block} is not a power of two from {MIN_BLOCK} to {MAX_BLOCK}"
            )));
        }
        Ok(Shard {
            name: name.to_owned(),
            kids: vec![child],
            block,
            dir_made: AtomicBool::new(false),
        })
    }

    fn kid(&self) -> &LayerRef {
        &self.kids[0]
    }

    /// The mark of `path`, if it is sharded.
    async fn mark_of(&self, cx: &Ctx, path: &str) -> FopResult<Option<Mark>> {
        match self.kid().getxattr(&inner(cx), path, SHARD_XATTR).await {
            Ok(v) => match Mark::decode(&v) {
                Some(m) => Ok(Some(m)),
                None => {
                    tracing::warn!(path, "a file's shard mark is malformed: refusing its I/O");
                    Err(libc::EIO as Errno)
                }
            },
            Err(ENODATA) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// The mark and size of `path` if it is a sharded file with pieces past the first — and,
    /// for `removing` (unlink, rename over it), no other name, whose file keeps the pieces;
    /// None otherwise, and for a name that does not exist.
    async fn with_pieces(
        &self,
        cx: &Ctx,
        path: &str,
        removing: bool,
    ) -> FopResult<Option<(Mark, u64)>> {
        let a = match self.kid().lookup(cx, path).await {
            Ok(a) => a,
            Err(ENOENT) => return Ok(None),
            Err(e) => return Err(e),
        };
        if !is_reg(&a) || (removing && a.nlink != 1) || a.size <= MIN_BLOCK {
            return Ok(None);
        }
        Ok(self
            .mark_of(cx, path)
            .await?
            .filter(|m| a.size > m.block)
            .map(|m| (m, a.size)))
    }

    /// Removes what `pieces` had past `size`, logging (not failing) what it could not: the
    /// base already says what the file holds, and leftovers are cut before it grows again.
    async fn drop_past(&self, cx: &Ctx, pieces: Option<(Mark, u64)>, size: u64) {
        if let Some((m, old)) = pieces {
            if let Err(e) = self.cut(cx, None, &m, size, old).await {
                tracing::warn!(id = m.id, err = e, "pieces past a file's end were left");
            }
        }
    }
}
