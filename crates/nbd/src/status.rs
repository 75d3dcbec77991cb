//! Block status: which parts of the image hold data and which are holes, so that a copy
//! (`nbdcopy`, `qemu-img convert`) skips the holes and `nbdinfo --map` shows them.
//!
//! The client picks metadata contexts during the handshake (`NBD_OPT_LIST_META_CONTEXT`,
//! `NBD_OPT_SET_META_CONTEXT`, after structured replies) and asks with
//! `NBD_CMD_BLOCK_STATUS`. One context is offered: `base:allocation`, from the brick file
//! system's `SEEK_DATA`/`SEEK_HOLE` through the stack's extents fop (a layer that cannot tell
//! says data, which always reads right). A hole is `NBD_STATE_HOLE | NBD_STATE_ZERO`; data is 0.

use kiln_client::{Extent, Fd, Volume};

use crate::proto::{self, chunk, err, Request};

/// The one context this server offers.
pub const BASE_ALLOCATION: &str = "base:allocation";
/// Its id in `NBD_REP_META_CONTEXT` and block status chunks.
pub const ALLOCATION_ID: u32 = 1;
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
pub fn parse_meta(d: &[u8]) -> Result<MetaQuery, String> {
    let mut rest = d;
    let name = take_string(&mut rest, "export name")?;
    let n = take_u32(&mut rest).ok_or("the query count is missing")?;
    // Each query takes 4 bytes at least: a count past that is a lie, not an allocation.
    if n as usize > rest.len() / 4 {
        return Err(format!("{n} queries cannot fit {} bytes", rest.len()));
    }
    let queries = (0..n)
        .map(|_| take_string(&mut rest, "query"))
        .collect::<Result<Vec<_>, _>>()?;
    if !rest.is_empty() {
        return Err(format!("{} bytes after the last query", rest.len()));
    }
    Ok(MetaQuery { name, queries })
}

fn take_u32(d: &mut &[u8]) -> Option<u32> {
    let (h, t) = d.split_first_chunk::<4>()?;
    *d = t;
    Some(u32::from_be_bytes(*h))
}

fn take_string(d: &mut &[u8], what: &str) -> Result<String, String> {
    let len = take_u32(d).ok_or_else(|| format!("the {what} length is missing"))? as usize;
    if len > d.len() {
        return Err(format!("the {what} length {len} overruns the option data"));
    }
    let (s, t) = d.split_at(len);
    *d = t;
    std::str::from_utf8(s)
        .map(str::to_owned)
        .map_err(|_| format!("the {what} is not UTF-8"))
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

/// The `NBD_REP_META_CONTEXT` data for `base:allocation`: its id and its name.
pub fn meta_context_reply() -> Vec<u8> {
    let mut d = ALLOCATION_ID.to_be_bytes().to_vec();
    d.extend_from_slice(BASE_ALLOCATION.as_bytes());
    d
}

/// Block status descriptors (length, flags) for `runs` from the request's offset: neighbours
/// of the same kind merged, no more than `len` bytes in all, only the first with `one`
/// (`NBD_CMD_FLAG_REQ_ONE`).
pub fn descriptors(runs: &[Extent], len: u32, one: bool) -> Vec<(u32, u32)> {
    let mut out: Vec<(u32, u32)> = Vec::new();
    let mut left = len;
    for r in runs {
        let n = r.len.min(u64::from(left)) as u32;
        if n == 0 {
            break;
        }
        let flags = if r.hole { STATE_HOLE | STATE_ZERO } else { 0 };
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

/// A final `BLOCK_STATUS` chunk of context `id` with `descs`.
pub fn block_status_chunk(handle: u64, id: u32, descs: &[(u32, u32)]) -> Vec<u8> {
    let len = 4 + 8 * descs.len();
    let mut out = vec![0u8; proto::CHUNK_HEADER_LEN];
    proto::chunk_header(
        &mut out,
        chunk::FLAG_DONE,
        chunk::BLOCK_STATUS,
        handle,
        len as u32,
    );
    out.extend_from_slice(&id.to_be_bytes());
    for (n, flags) in descs {
        out.extend_from_slice(&n.to_be_bytes());
        out.extend_from_slice(&flags.to_be_bytes());
    }
    out
}

/// Answers `NBD_CMD_BLOCK_STATUS` (range and flags already checked): the whole reply, or the
/// NBD error and a message.
pub async fn block_status(
    vol: &Volume,
    fd: &Fd,
    allocation: bool,
    req: &Request,
) -> Result<Vec<u8>, (u32, String)> {
    if !allocation {
        return Err((err::EINVAL, "no metadata context was negotiated".into()));
    }
    if req.len == 0 {
        return Err((err::EINVAL, "block status of 0 bytes".into()));
    }
    let runs = vol
        .extents(fd, req.offset, u64::from(req.len))
        .await
        .map_err(|e| {
            let n = e.raw_os_error().unwrap_or(libc::EIO) as u32;
            (
                proto::nbd_error(n),
                format!("extents failed on the brick: {e}"),
            )
        })?;
    let descs = descriptors(&runs, req.len, req.flags & proto::cflag::REQ_ONE != 0);
    if descs.is_empty() {
        return Err((err::EIO, "the brick reported no extents".into()));
    }
    Ok(block_status_chunk(req.handle, ALLOCATION_ID, &descs))
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
    }

    #[test]
    fn descriptors_merge_clamp_and_stop() {
        let e = |len, hole| Extent { len, hole };
        let runs = [e(10, false), e(5, false), e(20, true), e(1 << 40, false)];
        assert_eq!(
            descriptors(&runs, 100, false),
            [(15, 0), (20, STATE_HOLE | STATE_ZERO), (65, 0)]
        );
        assert_eq!(descriptors(&runs, 100, true), [(15, 0)]);
        assert_eq!(descriptors(&runs, 12, false), [(12, 0)]);
        assert!(descriptors(&[], 5, false).is_empty());
        assert!(descriptors(&[e(0, true)], 5, false).is_empty());
    }

    #[test]
    fn a_block_status_chunk_is_laid_out_as_the_protocol_says() {
        let c = block_status_chunk(7, ALLOCATION_ID, &[(4096, 3), (8192, 0)]);
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
