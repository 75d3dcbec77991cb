//! The fixed-newstyle handshake: greeting, client flags, then option haggling until the client
//! picks the export (`NBD_OPT_GO` or `NBD_OPT_EXPORT_NAME`) or leaves.
//!
//! Supported options: `EXPORT_NAME`, `ABORT`, `LIST`, `INFO`, `GO`, `STRUCTURED_REPLY`,
//! `LIST_META_CONTEXT` and `SET_META_CONTEXT` (see [`crate::status`]); every other option gets
//! `NBD_REP_ERR_UNSUP` and haggling goes on. The image is opened on the brick
//! (over this client's own Kiln connection) the first time an option needs its size, so a
//! client that only lists exports costs the brick nothing. A client that breaks the framing
//! (bad magic, unknown client flags, absurd option length) is disconnected; no one else is
//! affected.

use std::io;

use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};

use crate::backend::{open_backend, Backend, Shared};
use crate::proto::{self, info, opt, rep, tflag, MAX_BLOCK, MIN_BLOCK, PREFERRED_BLOCK};
use crate::reader::Reader;
use crate::status::{self, MetaQuery};
use kiln_proto::Error;

/// Option data larger than this is refused with `NBD_REP_ERR_TOO_BIG` (the largest real option,
/// `NBD_OPT_GO` with a 4096-byte name, is far smaller).
const MAX_OPTION_LEN: u32 = 64 * 1024;
/// Option data larger than this is not even read: the client is disconnected.
const MAX_SKIP_LEN: u32 = 1 << 20;

/// What the handshake agreed on.
pub struct Negotiated {
    /// The open image on the brick.
    pub backend: Backend,
    /// Structured replies were negotiated.
    pub structured: bool,
    /// The metadata contexts selected (`NBD_CMD_BLOCK_STATUS` answers them).
    pub contexts: status::Contexts,
}

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg)
}

/// The transmission flags for this export.
pub fn transmission_flags(structured: bool, read_only: bool) -> u16 {
    let mut f = tflag::HAS_FLAGS
        | tflag::SEND_FLUSH
        | tflag::SEND_FUA
        | tflag::SEND_TRIM
        | tflag::SEND_WRITE_ZEROES
        | tflag::SEND_FAST_ZERO
        // Safe to advertise: every connection reaches the same file on the same brick, with
        // no cache on the way (this export keeps none; the brick's only cache is the kernel
        // page cache, shared by all its handles), and the brick's fdatasync flushes the whole
        // file whoever wrote it. So FLUSH and FUA on one connection cover the writes already
        // answered on any other.
        | tflag::CAN_MULTI_CONN;
    if structured {
        // A READ is always answered with one data chunk, so "don't fragment" costs nothing.
        f |= tflag::SEND_DF;
    }
    if read_only {
        f |= tflag::READ_ONLY;
    }
    f
}

/// Runs the handshake. `Ok(None)`: the client ended it (`NBD_OPT_ABORT` or end of stream).
pub async fn handshake<R, W>(
    rd: &mut Reader<R>,
    w: &mut W,
    sh: &Shared,
) -> io::Result<Option<Negotiated>>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut greet = Vec::with_capacity(18);
    greet.extend_from_slice(&proto::NBDMAGIC.to_be_bytes());
    greet.extend_from_slice(&proto::IHAVEOPT.to_be_bytes());
    greet.extend_from_slice(&(proto::FLAG_FIXED_NEWSTYLE | proto::FLAG_NO_ZEROES).to_be_bytes());
    w.write_all(&greet).await?;

    if !rd.fill_to(4).await? {
        return Ok(None);
    }
    let cflags = proto::be32(rd.buffered());
    rd.consume(4);
    let known = proto::CLIENT_FIXED_NEWSTYLE | proto::CLIENT_NO_ZEROES;
    if cflags & !known != 0 {
        return Err(invalid(format!("unknown client flags {cflags:#x}")));
    }
    let no_zeroes = cflags & proto::CLIENT_NO_ZEROES != 0;

    let mut structured = false;
    let mut contexts = status::Contexts::default();
    let mut backend: Option<Backend> = None;
    loop {
        if !rd.fill_to(16).await? {
            return Ok(None);
        }
        let b = rd.buffered();
        let (magic, option, len) = (proto::be64(b), proto::be32(&b[8..]), proto::be32(&b[12..]));
        rd.consume(16);
        if magic != proto::IHAVEOPT {
            return Err(invalid(format!("bad option magic {magic:#x}")));
        }
        if len > MAX_OPTION_LEN {
            if len > MAX_SKIP_LEN {
                return Err(invalid(format!("option {option} with {len} bytes of data")));
            }
            rd.skip(len as u64).await?;
            let msg = format!("option data of {len} bytes is too big");
            reply(w, option, rep::ERR_TOO_BIG, msg.as_bytes()).await?;
            continue;
        }
        let data = rd.read_vec(len as usize).await?;
        tracing::debug!(option, len, "nbd option");
        let parsed = match parse_option(option, &data) {
            Ok(o) => o,
            Err(msg) => {
                reply(w, option, rep::ERR_INVALID, msg.message().as_bytes()).await?;
                continue;
            }
        };
        match parsed {
            ClientOption::ExportName(name) => {
                if !sh.name_matches(&name) {
                    // This option cannot be refused with an error: the protocol says close.
                    return Err(invalid(format!(
                        "NBD_OPT_EXPORT_NAME for unknown export {name:?}"
                    )));
                }
                let be = match backend.take() {
                    Some(b) => b,
                    None => open_backend(sh).await.map_err(|e| invalid(e.to_string()))?,
                };
                let mut out = Vec::with_capacity(134);
                out.extend_from_slice(&be.size.to_be_bytes());
                out.extend_from_slice(&transmission_flags(structured, sh.read_only).to_be_bytes());
                if !no_zeroes {
                    out.extend_from_slice(&[0u8; 124]);
                }
                w.write_all(&out).await?;
                return Ok(Some(Negotiated {
                    backend: be,
                    structured,
                    contexts,
                }));
            }
            ClientOption::Abort => {
                // The client may already have closed; that is fine.
                let _ = reply(w, option, rep::ACK, &[]).await;
                return Ok(None);
            }
            ClientOption::List => {
                let name = sh.name.as_bytes();
                let mut d = Vec::with_capacity(4 + name.len() + sh.description.len());
                d.extend_from_slice(&(name.len() as u32).to_be_bytes());
                d.extend_from_slice(name);
                d.extend_from_slice(sh.description.as_bytes());
                reply(w, option, rep::SERVER, &d).await?;
                reply(w, option, rep::ACK, &[]).await?;
            }
            ClientOption::StructuredReply => {
                structured = true;
                reply(w, option, rep::ACK, &[]).await?;
            }
            ClientOption::Info { go, name, requests } => {
                if !sh.name_matches(&name) {
                    let msg = format!(
                        "no export named {name:?}; this server exports {:?}",
                        sh.name
                    );
                    reply(w, option, rep::ERR_UNKNOWN, msg.as_bytes()).await?;
                    continue;
                }
                if backend.is_none() {
                    match open_backend(sh).await {
                        Ok(b) => backend = Some(b),
                        Err(msg) => {
                            tracing::warn!("cannot serve export {:?}: {msg}", sh.name);
                            reply(w, option, rep::ERR_UNKNOWN, msg.message().as_bytes()).await?;
                            continue;
                        }
                    }
                }
                let size = backend.as_ref().map_or(0, |b| b.size);
                send_info(w, option, sh, size, structured, &requests).await?;
                reply(w, option, rep::ACK, &[]).await?;
                if go {
                    let backend = backend.take().expect("opened above");
                    return Ok(Some(Negotiated {
                        backend,
                        structured,
                        contexts,
                    }));
                }
            }
            ClientOption::MetaContext { set, query } => {
                if let Some(chosen) = meta_context(w, option, sh, structured, set, &query).await? {
                    contexts = chosen;
                }
            }
            ClientOption::Unsupported(_) => {
                let msg = format!("option {option} is not supported by kiln nbd");
                reply(w, option, rep::ERR_UNSUP, msg.as_bytes()).await?;
            }
        }
    }
}

/// The `NBD_REP_INFO` replies of `NBD_OPT_INFO` / `NBD_OPT_GO` (the ACK is the caller's).
async fn send_info<W: AsyncWrite + Unpin>(
    w: &mut W,
    option: u32,
    sh: &Shared,
    size: u64,
    structured: bool,
    requests: &[u16],
) -> io::Result<()> {
    let mut export = Vec::with_capacity(12);
    export.extend_from_slice(&info::EXPORT.to_be_bytes());
    export.extend_from_slice(&size.to_be_bytes());
    export.extend_from_slice(&transmission_flags(structured, sh.read_only).to_be_bytes());
    reply(w, option, rep::INFO, &export).await?;
    // Block sizes go out whether asked for or not: clients that did not ask ignore them, and
    // the server enforces only the protocol's default maximum anyway.
    let mut bs = Vec::with_capacity(14);
    bs.extend_from_slice(&info::BLOCK_SIZE.to_be_bytes());
    for v in [MIN_BLOCK, PREFERRED_BLOCK, MAX_BLOCK] {
        bs.extend_from_slice(&v.to_be_bytes());
    }
    reply(w, option, rep::INFO, &bs).await?;
    if requests.contains(&info::NAME) {
        let mut d = info::NAME.to_be_bytes().to_vec();
        d.extend_from_slice(sh.name.as_bytes());
        reply(w, option, rep::INFO, &d).await?;
    }
    if requests.contains(&info::DESCRIPTION) {
        let mut d = info::DESCRIPTION.to_be_bytes().to_vec();
        d.extend_from_slice(sh.description.as_bytes());
        reply(w, option, rep::INFO, &d).await?;
    }
    Ok(())
}

/// Answers `NBD_OPT_LIST_META_CONTEXT` / `NBD_OPT_SET_META_CONTEXT` (`set`); for a SET that
/// was accepted, the contexts it selected (each SET replaces the last).
async fn meta_context<W: AsyncWrite + Unpin>(
    w: &mut W,
    option: u32,
    sh: &Shared,
    structured: bool,
    set: bool,
    query: &MetaQuery,
) -> io::Result<Option<status::Contexts>> {
    if set && !structured {
        let msg = "metadata contexts need structured replies first";
        reply(w, option, rep::ERR_INVALID, msg.as_bytes()).await?;
        return Ok(None);
    }
    if !sh.name_matches(&query.name) {
        let msg = format!("no export named {:?}", query.name);
        reply(w, option, rep::ERR_UNKNOWN, msg.as_bytes()).await?;
        return Ok(None);
    }
    let chosen = status::Contexts::select(&query.queries, !set, sh.bitmap.as_deref());
    for d in chosen.replies() {
        reply(w, option, rep::META_CONTEXT, &d).await?;
    }
    reply(w, option, rep::ACK, &[]).await?;
    Ok(set.then_some(chosen))
}

/// One handshake option as the client sent it, decoded from its number and data (what the
/// server makes of it is up to [`handshake`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClientOption {
    /// `NBD_OPT_EXPORT_NAME`: the export name (not UTF-8 is replaced, since this option
    /// allows no error reply).
    ExportName(String),
    /// `NBD_OPT_ABORT` (any data is ignored).
    Abort,
    /// `NBD_OPT_LIST`.
    List,
    /// `NBD_OPT_STRUCTURED_REPLY`.
    StructuredReply,
    /// `NBD_OPT_INFO` (`go` false) or `NBD_OPT_GO` (`go` true).
    Info {
        /// `NBD_OPT_GO`: enter transmission after the reply.
        go: bool,
        /// The export name.
        name: String,
        /// The `NBD_INFO_*` types asked for, in order.
        requests: Vec<u16>,
    },
    /// `NBD_OPT_LIST_META_CONTEXT` (`set` false) or `NBD_OPT_SET_META_CONTEXT` (`set` true).
    MetaContext {
        /// `NBD_OPT_SET_META_CONTEXT`: select what the queries name.
        set: bool,
        /// The export and the queries.
        query: MetaQuery,
    },
    /// An option this server does not support (`NBD_REP_ERR_UNSUP`).
    Unsupported(u32),
}

/// Decodes option `option` with data `data` as the client sent it (pure: no I/O, so it can be
/// tested and fuzzed on its own). `Err` is the message of the `NBD_REP_ERR_INVALID` reply.
pub fn parse_option(option: u32, data: &[u8]) -> Result<ClientOption, Error> {
    match option {
        opt::EXPORT_NAME => Ok(ClientOption::ExportName(
            String::from_utf8_lossy(data).into_owned(),
        )),
        opt::ABORT => Ok(ClientOption::Abort),
        opt::LIST if !data.is_empty() => Err(Error::invalid("NBD_OPT_LIST takes no data")),
        opt::LIST => Ok(ClientOption::List),
        opt::STRUCTURED_REPLY if !data.is_empty() => {
            Err(Error::invalid("NBD_OPT_STRUCTURED_REPLY takes no data"))
        }
        opt::STRUCTURED_REPLY => Ok(ClientOption::StructuredReply),
        opt::INFO | opt::GO => {
            let (name, requests) = parse_info(data)?;
            Ok(ClientOption::Info {
                go: option == opt::GO,
                name,
                requests,
            })
        }
        opt::LIST_META_CONTEXT | opt::SET_META_CONTEXT => Ok(ClientOption::MetaContext {
            set: option == opt::SET_META_CONTEXT,
            query: status::parse_meta(data)?,
        }),
        other => Ok(ClientOption::Unsupported(other)),
    }
}

/// Parses `NBD_OPT_INFO` / `NBD_OPT_GO` data: the export name and the information requests.
fn parse_info(d: &[u8]) -> Result<(String, Vec<u16>), Error> {
    if d.len() < 6 {
        return Err(Error::invalid(format!(
            "option data of {} bytes is too short",
            d.len()
        )));
    }
    let name_len = proto::be32(d) as usize;
    if name_len > d.len() - 6 {
        return Err(Error::invalid(format!(
            "export name length {name_len} overruns the option data"
        )));
    }
    let name = std::str::from_utf8(&d[4..4 + name_len])
        .map_err(|_| Error::invalid("export name is not UTF-8"))?
        .to_owned();
    let rest = &d[4 + name_len..];
    let n = u16::from_be_bytes([rest[0], rest[1]]) as usize;
    if rest.len() != 2 + 2 * n {
        return Err(Error::invalid(format!(
            "{n} information requests do not match {} bytes",
            rest.len() - 2
        )));
    }
    let requests = rest[2..]
        .chunks_exact(2)
        .map(|c| u16::from_be_bytes([c[0], c[1]]))
        .collect();
    Ok((name, requests))
}

async fn reply<W: AsyncWrite + Unpin>(
    w: &mut W,
    option: u32,
    kind: u32,
    data: &[u8],
) -> io::Result<()> {
    w.write_all(&proto::option_reply(option, kind, data)).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn info_data_parses_and_refuses_garbage() {
        let mut d = 3u32.to_be_bytes().to_vec();
        d.extend_from_slice(b"abc");
        d.extend_from_slice(&2u16.to_be_bytes());
        d.extend_from_slice(&info::BLOCK_SIZE.to_be_bytes());
        d.extend_from_slice(&info::NAME.to_be_bytes());
        assert_eq!(parse_info(&d).unwrap(), ("abc".to_owned(), vec![3, 1]));
        assert!(parse_info(&d[..d.len() - 1]).is_err());
        assert!(parse_info(&[0, 0, 0, 9, 0, 0]).is_err());
        assert!(parse_info(&[0, 0]).is_err());
        assert_eq!(
            parse_info(&[0, 0, 0, 0, 0, 0]).unwrap(),
            (String::new(), vec![])
        );
    }

    #[test]
    fn options_decode_as_the_handshake_answers_them() {
        assert_eq!(
            parse_option(opt::EXPORT_NAME, b"a\xffb"),
            Ok(ClientOption::ExportName("a\u{fffd}b".into()))
        );
        assert_eq!(parse_option(opt::ABORT, b"x"), Ok(ClientOption::Abort));
        assert_eq!(parse_option(opt::LIST, b""), Ok(ClientOption::List));
        assert!(parse_option(opt::LIST, b"x").is_err());
        assert_eq!(
            parse_option(opt::STRUCTURED_REPLY, b""),
            Ok(ClientOption::StructuredReply)
        );
        assert!(parse_option(opt::STRUCTURED_REPLY, b"x").is_err());
        assert_eq!(
            parse_option(opt::GO, &[0, 0, 0, 1, b'v', 0, 1, 0, 3]),
            Ok(ClientOption::Info {
                go: true,
                name: "v".into(),
                requests: vec![info::BLOCK_SIZE]
            })
        );
        assert!(parse_option(opt::INFO, &[0, 0, 0, 1]).is_err());
        assert_eq!(
            parse_option(opt::STARTTLS, b""),
            Ok(ClientOption::Unsupported(opt::STARTTLS))
        );
    }

    #[test]
    fn flags() {
        let f = transmission_flags(false, false);
        assert_eq!(f & tflag::READ_ONLY, 0);
        assert_eq!(f & tflag::SEND_DF, 0);
        assert_ne!(f & tflag::CAN_MULTI_CONN, 0);
        let f = transmission_flags(true, true);
        assert_ne!(f & tflag::READ_ONLY, 0);
        assert_ne!(f & tflag::SEND_DF, 0);
    }
}
