//! Block status: which parts of the image hold data and which are holes, so that a copy
//! (`nbdcopy`, `qemu-img convert`) skips the holes and `nbdinfo --map` shows them.
//!
//! The client picks metadata contexts during the handshake (`NBD_OPT_LIST_META_CONTEXT`,
//! `NBD_OPT_SET_META_CONTEXT`, after structured replies) and asks with
//! `NBD_CMD_BLOCK_STATUS`. Two contexts are offered: `base:allocation`, from the brick file
//! system's `SEEK_DATA`/`SEEK_HOLE` through the stack's extents fop (a layer that cannot tell
//! says data, which always reads right; a hole is `NBD_STATE_HOLE | NBD_STATE_ZERO`, data 0),
//! and, when the export names one (`--bitmap NAME`), `qemu:dirty-bitmap:NAME`: the ranges
//! written since the bricks' dirty record `NAME` started (`NBD_STATE_DIRTY`), so that an
//! incremental backup reads only those.

use kiln_client::{Extent, Fd, Volume};
use kiln_proto::ops::DIRTY_GET;

use crate::proto::{self, chunk, err, Request};
use kiln_proto::Error;

/// The allocation context.
pub const BASE_ALLOCATION: &str = "base:allocation";
/// Its id in `NBD_REP_META_CONTEXT` and block status chunks.
pub const ALLOCATION_ID: u32 = 1;
/// The dirty bitmap contexts' prefix (the record's name follows).
pub const DIRTY_BITMAP: &str = "qemu:dirty-bitmap:";
/// The dirty bitmap context's id.
pub const DIRTY_ID: u32 = 2;
/// `NBD_STATE_DIRTY` (in a dirty bitmap context): written since the record started.
pub const STATE_DIRTY: u32 = 1;

/// The contexts a client selected.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Contexts {
    /// `base:allocation`.
    pub allocation: bool,
    /// `qemu:dirty-bitmap:NAME`: the record's name.
    pub dirty: Option<String>,
}

impl Contexts {
    /// What `queries` select among this export's contexts (`bitmap`: the dirty record it
    /// offers). When listing (`list`): everything for no query, a whole namespace for
    /// `base:` or `qemu:`, or the prefix `qemu:dirty-bitmap:`; when setting, exact names.
    pub fn select(queries: &[String], list: bool, bitmap: Option<&str>) -> Contexts {
        let dirty = bitmap.filter(|b| {
            let name = format!("{DIRTY_BITMAP}{b}");
            (list && queries.is_empty())
                || queries
                    .iter()
                    .any(|q| *q == name || (list && (q == "qemu:" || q == DIRTY_BITMAP)))
        });
        Contexts {
            allocation: selects_allocation(queries, list),
            dirty: dirty.map(str::to_owned),
        }
    }

    /// Nothing selected.
    pub fn is_empty(&self) -> bool {
        !self.allocation && self.dirty.is_none()
    }

    /// The `NBD_REP_META_CONTEXT` data of each selected context: its id and its name.
    pub fn replies(&self) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        if self.allocation {
            out.push(context_reply(ALLOCATION_ID, BASE_ALLOCATION));
        }
        if let Some(b) = &self.dirty {
            out.push(context_reply(DIRTY_ID, &format!("{DIRTY_BITMAP}{b}")));
        }
        out
    }
}
/// `NBD_STATE_HOLE`: the range takes no space.
pub const STATE_HOLE: u32 = 1;
/// `NBD_STATE_ZERO`: the range reads as zeros.
pub const STATE_ZERO: u32 = 2;

/// The data of `NBD_OPT_LIST_META_CONTEXT` / `NBD_OPT_SET_META_CONTEXT`: an export name and
/// the queries, each a `namespace:name` string (or a namespace alone, `base:`, when listing).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetaQuery {
    /// The export the contexts are for.
    pub name: String,
    /// The queries, in order.
    pub queries: Vec<String>,
}

/// Decodes meta-context option data: a 32-bit name length and the name, a 32-bit query count,
/// then each query as a 32-bit length and the string; nothing more. `Err` is the message of an
/// `NBD_REP_ERR_INVALID` reply.
pub fn parse_meta(d: &[u8]) -> Result<MetaQuery, Error> {
    let mut rest = d;
    let name = take_string(&mut rest, "export name")?;
    let n = take_u32(&mut rest).ok_or(Error::invalid("the query count is missing"))?;
    // Each query takes 4 bytes at least: a count past that is a lie, not an allocation.
    if n as usize > rest.len() / 4 {
        return Err(Error::invalid(format!(
            "{n} queries cannot fit {} bytes",
            rest.len()
        )));
    }
    let queries = (0..n)
        .map(|_| take_string(&mut rest, "query"))
        .collect::<Result<Vec<_>, _>>()?;
    if !rest.is_empty() {
        return Err(Error::invalid(format!(
            "{} bytes after the last query",
            rest.len()
        )));
    }
    Ok(MetaQuery { name, queries })
}

fn take_u32(d: &mut &[u8]) -> Option<u32> {
    let (h, t) = d.split_first_chunk::<4>()?;
    *d = t;
    Some(u32::from_be_bytes(*h))
}

fn take_string(d: &mut &[u8], what: &str) -> Result<String, Error> {
    let len = take_u32(d).ok_or_else(|| Error::invalid(format!("the {what} length is missing")))?
        as usize;
    if len > d.len() {
        return Err(Error::invalid(format!(
            "the {what} length {len} overruns the option data"
        )));
    }
    let (s, t) = d.split_at(len);
    *d = t;
    std::str::from_utf8(s)
        .map(str::to_owned)
        .map_err(|_| Error::invalid(format!("the {what} is not UTF-8")))
}

/// True if `queries` select `base:allocation`: when listing (`list`), no query at all, the
/// `base:` namespace or the name itself; when setting, the name itself.
pub fn selects_allocation(queries: &[String], list: bool) -> bool {
    if list && queries.is_empty() {
        return true;
    }
    queries
        .iter()
        .any(|q| q == BASE_ALLOCATION || (list && q == "base:"))
}

fn context_reply(id: u32, name: &str) -> Vec<u8> {
    let mut d = id.to_be_bytes().to_vec();
    d.extend_from_slice(name.as_bytes());
    d
}

/// Block status descriptors (length, flags) for `runs` from the request's offset: neighbours
/// of the same kind merged, no more than `len` bytes in all, only the first with `one`
/// (`NBD_CMD_FLAG_REQ_ONE`); `(data, hole)` are the flags of each kind of run.
pub fn descriptors(
    runs: &[Extent],
    len: u32,
    one: bool,
    (data, hole): (u32, u32),
) -> Vec<(u32, u32)> {
    let mut out: Vec<(u32, u32)> = Vec::new();
    let mut left = len;
    for r in runs {
        let n = r.len.min(u64::from(left)) as u32;
        if n == 0 {
            break;
        }
        let flags = if r.hole { hole } else { data };
        match out.last_mut() {
            Some(last) if last.1 == flags => last.0 += n,
            _ => out.push((n, flags)),
        }
        left -= n;
    }
    if one {
        out.truncate(1);
    }
    out
}

/// A `BLOCK_STATUS` chunk of context `id` with `descs`, the reply's last with `done`.
pub fn block_status_chunk(handle: u64, id: u32, descs: &[(u32, u32)], done: bool) -> Vec<u8> {
    let len = 4 + 8 * descs.len();
    let mut out = vec![0u8; proto::CHUNK_HEADER_LEN];
    let flags = if done { chunk::FLAG_DONE } else { 0 };
    proto::chunk_header(&mut out, flags, chunk::BLOCK_STATUS, handle, len as u32);
    out.extend_from_slice(&id.to_be_bytes());
    for (n, flags) in descs {
        out.extend_from_slice(&n.to_be_bytes());
        out.extend_from_slice(&flags.to_be_bytes());
    }
    out
}

/// Answers `NBD_CMD_BLOCK_STATUS` (range and flags already checked): the whole reply (one
/// chunk per selected context), or the NBD error and a message.
pub async fn block_status(
    vol: &Volume,
    fd: &Fd,
    contexts: &Contexts,
    req: &Request,
) -> Result<Vec<u8>, (u32, String)> {
    if contexts.is_empty() {
        return Err((err::EINVAL, "no metadata context was negotiated".into()));
    }
    if req.len == 0 {
        return Err((err::EINVAL, "block status of 0 bytes".into()));
    }
    let one = req.flags & proto::cflag::REQ_ONE != 0;
    let failed = |what: &str, e: std::io::Error| {
        let n = e.raw_os_error().unwrap_or(libc::EIO) as u32;
        (
            proto::nbd_error(n),
            format!("{what} failed on the brick: {e}"),
        )
    };
    let mut parts: Vec<(u32, Vec<(u32, u32)>)> = Vec::new();
    if contexts.allocation {
        let runs = vol
            .extents(fd, req.offset, u64::from(req.len))
            .await
            .map_err(|e| failed("extents", e))?;
        let kinds = (0, STATE_HOLE | STATE_ZERO);
        parts.push((ALLOCATION_ID, descriptors(&runs, req.len, one, kinds)));
    }
    if let Some(name) = &contexts.dirty {
        let runs = vol
            .dirty(fd, DIRTY_GET, name, req.offset, u64::from(req.len))
            .await
            .map_err(|e| match e.raw_os_error() {
                Some(libc::ENOENT) => (
                    err::EIO,
                    format!(
                        "the bricks do not know dirty record {name:?} (restarted?): \
                         copy everything"
                    ),
                ),
                _ => failed("dirty", e),
            })?;
        // A dirty run is the record's data; clean runs are its holes.
        parts.push((DIRTY_ID, descriptors(&runs, req.len, one, (STATE_DIRTY, 0))));
    }
    if parts.iter().any(|(_, d)| d.is_empty()) {
        return Err((err::EIO, "the brick reported no extents".into()));
    }
    let last = parts.len() - 1;
    let mut out = Vec::new();
    for (i, (id, descs)) in parts.iter().enumerate() {
        out.extend(block_status_chunk(req.handle, *id, descs, i == last));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(name: &str, queries: &[&str]) -> Vec<u8> {
        let mut d = (name.len() as u32).to_be_bytes().to_vec();
        d.extend_from_slice(name.as_bytes());
        d.extend_from_slice(&(queries.len() as u32).to_be_bytes());
        for q in queries {
            d.extend_from_slice(&(q.len() as u32).to_be_bytes());
            d.extend_from_slice(q.as_bytes());
        }
        d
    }

    #[test]
    fn meta_queries_parse_and_refuse_garbage() {
        let d = meta("img", &["base:allocation", "qemu:dirty-bitmap:b"]);
        let q = parse_meta(&d).unwrap();
        assert_eq!(q.name, "img");
        assert_eq!(q.queries, ["base:allocation", "qemu:dirty-bitmap:b"]);
        for cut in 0..d.len() {
            assert!(parse_meta(&d[..cut]).is_err(), "{cut} bytes accepted");
        }
        let mut long = d.clone();
        long.push(0);
        assert!(parse_meta(&long).is_err());
        // A huge count with no data behind it.
        let mut lie = meta("", &[]);
        lie[4..8].copy_from_slice(&u32::MAX.to_be_bytes());
        assert!(parse_meta(&lie).is_err());
        assert_eq!(parse_meta(&meta("", &[])).unwrap().queries.len(), 0);
    }

    #[test]
    fn what_a_query_selects() {
        let q = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert!(selects_allocation(&q(&[]), true));
        assert!(!selects_allocation(&q(&[]), false));
        assert!(selects_allocation(&q(&["base:"]), true));
        assert!(!selects_allocation(&q(&["base:"]), false));
        assert!(selects_allocation(&q(&["x:y", BASE_ALLOCATION]), false));
        assert!(!selects_allocation(&q(&["base:allocations"]), true));
        let sel = |v: &[&str], list| Contexts::select(&q(v), list, Some("b"));
        assert_eq!(sel(&[], true).dirty.as_deref(), Some("b"));
        assert_eq!(sel(&["qemu:"], true).dirty.as_deref(), Some("b"));
        assert_eq!(sel(&["qemu:"], false).dirty, None);
        assert_eq!(
            sel(&["qemu:dirty-bitmap:b"], false).dirty.as_deref(),
            Some("b")
        );
        assert_eq!(sel(&["qemu:dirty-bitmap:c"], false).dirty, None);
        assert!(Contexts::select(&q(&["qemu:dirty-bitmap:b"]), false, None).is_empty());
        assert_eq!(
            sel(&[BASE_ALLOCATION, "qemu:dirty-bitmap:b"], false)
                .replies()
                .len(),
            2
        );
    }

    #[test]
    fn descriptors_merge_clamp_and_stop() {
        let e = |len, hole| Extent { len, hole };
        let runs = [e(10, false), e(5, false), e(20, true), e(1 << 40, false)];
        assert_eq!(
            descriptors(&runs, 100, false, (0, 3)),
            [(15, 0), (20, STATE_HOLE | STATE_ZERO), (65, 0)]
        );
        assert_eq!(descriptors(&runs, 100, true, (0, 3)), [(15, 0)]);
        assert_eq!(descriptors(&runs, 12, false, (0, 3)), [(12, 0)]);
        assert!(descriptors(&[], 5, false, (0, 3)).is_empty());
        assert!(descriptors(&[e(0, true)], 5, false, (0, 3)).is_empty());
        assert_eq!(
            descriptors(&[e(4, true), e(4, false)], 8, false, (1, 0)),
            [(4, 0), (4, 1)]
        );
    }

    #[test]
    fn a_block_status_chunk_is_laid_out_as_the_protocol_says() {
        let c = block_status_chunk(7, ALLOCATION_ID, &[(4096, 3), (8192, 0)], true);
        let not_last = block_status_chunk(7, DIRTY_ID, &[(1, 1)], false);
        assert_eq!(u16::from_be_bytes([not_last[4], not_last[5]]), 0);
        assert_eq!(proto::be32(&c), proto::STRUCTURED_REPLY_MAGIC);
        assert_eq!(u16::from_be_bytes([c[4], c[5]]), chunk::FLAG_DONE);
        assert_eq!(u16::from_be_bytes([c[6], c[7]]), chunk::BLOCK_STATUS);
        assert_eq!(proto::be64(&c[8..]), 7);
        assert_eq!(proto::be32(&c[16..]), 4 + 16);
        assert_eq!(proto::be32(&c[20..]), ALLOCATION_ID);
        assert_eq!((proto::be32(&c[24..]), proto::be32(&c[28..])), (4096, 3));
        assert_eq!((proto::be32(&c[32..]), proto::be32(&c[36..])), (8192, 0));
        assert_eq!(c.len(), 40);
    }
}
