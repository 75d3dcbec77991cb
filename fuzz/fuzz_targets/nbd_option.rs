//! Fuzzes the NBD handshake's option decoder (`NBD_OPT_*` number and data, as a client sends
//! them): it never panics, agrees with a reference reading of the protocol on what is
//! well-formed, and what it accepts re-encodes to the same bytes.
#![no_main]

use kiln_nbd::handshake::{parse_option, ClientOption};
use kiln_nbd::proto::opt;
use libfuzzer_sys::fuzz_target;

/// `NBD_OPT_INFO` / `NBD_OPT_GO` data, read straight from the protocol description: a 32-bit
/// name length, the name (UTF-8), a 16-bit count and that many 16-bit information types,
/// nothing more.
fn reference_info(d: &[u8]) -> Option<(String, Vec<u16>)> {
    let len = u32::from_be_bytes(d.get(..4)?.try_into().ok()?) as usize;
    let name = std::str::from_utf8(d.get(4..4usize.checked_add(len)?)?).ok()?;
    let rest = &d[4 + len..];
    let n = u16::from_be_bytes(rest.get(..2)?.try_into().ok()?) as usize;
    let reqs = rest.get(2..)?;
    if reqs.len() != 2 * n {
        return None;
    }
    let reqs = reqs.chunks(2).map(|c| u16::from_be_bytes([c[0], c[1]]));
    Some((name.to_owned(), reqs.collect()))
}

/// Meta-context option data, read straight from the protocol description: a 32-bit name length
/// and the name, a 32-bit query count, then each query as a 32-bit length and the string (all
/// UTF-8), nothing more.
fn reference_meta(d: &[u8]) -> Option<(String, Vec<String>)> {
    fn string(d: &mut &[u8]) -> Option<String> {
        let len = u32::from_be_bytes(d.get(..4)?.try_into().ok()?) as usize;
        let s = std::str::from_utf8(d.get(4..4usize.checked_add(len)?)?).ok()?;
        *d = &d[4 + len..];
        Some(s.to_owned())
    }
    let mut d = d;
    let name = string(&mut d)?;
    let n = u32::from_be_bytes(d.get(..4)?.try_into().ok()?);
    d = &d[4..];
    let mut queries = Vec::new();
    for _ in 0..n {
        queries.push(string(&mut d)?);
    }
    d.is_empty().then_some((name, queries))
}

fn encode_info(name: &str, requests: &[u16]) -> Vec<u8> {
    let mut d = (name.len() as u32).to_be_bytes().to_vec();
    d.extend_from_slice(name.as_bytes());
    d.extend_from_slice(&(requests.len() as u16).to_be_bytes());
    for r in requests {
        d.extend_from_slice(&r.to_be_bytes());
    }
    d
}

fuzz_target!(|data: &[u8]| {
    let Some((&pick, rest)) = data.split_first() else {
        return;
    };
    // Mostly the options the server knows (and a few around them), sometimes any number.
    let (option, d) = if pick < 0xf0 {
        (u32::from(pick % 12), rest)
    } else if rest.len() >= 4 {
        (
            u32::from_be_bytes(rest[..4].try_into().unwrap()),
            &rest[4..],
        )
    } else {
        return;
    };
    let parsed = parse_option(option, d);
    if let Err(e) = &parsed {
        // The message goes back to the client in an NBD_REP_ERR_INVALID reply.
        let msg = e.message();
        assert!(
            !msg.is_empty() && msg.len() < 256,
            "odd error message {msg:?}"
        );
        assert_eq!(e.kind(), kiln_proto::Kind::Invalid, "{e}");
    }
    match option {
        opt::EXPORT_NAME => {
            let want = String::from_utf8_lossy(d).into_owned();
            assert_eq!(parsed, Ok(ClientOption::ExportName(want)));
        }
        opt::ABORT => assert_eq!(parsed, Ok(ClientOption::Abort)),
        opt::LIST => assert_eq!(parsed.is_ok(), d.is_empty(), "LIST with {} bytes", d.len()),
        opt::STRUCTURED_REPLY => assert_eq!(parsed.is_ok(), d.is_empty()),
        opt::INFO | opt::GO => match (parsed, reference_info(d)) {
            (Ok(ClientOption::Info { go, name, requests }), Some(want)) => {
                assert_eq!(go, option == opt::GO);
                assert_eq!((&name, &requests), (&want.0, &want.1));
                assert_eq!(encode_info(&name, &requests), d, "re-encoding differs");
            }
            (Err(_), None) => {}
            (got, want) => panic!("decoder says {got:?}, the protocol says {want:?}"),
        },
        opt::LIST_META_CONTEXT | opt::SET_META_CONTEXT => match (parsed, reference_meta(d)) {
            (Ok(ClientOption::MetaContext { set, query }), Some(want)) => {
                assert_eq!(set, option == opt::SET_META_CONTEXT);
                assert_eq!((query.name, query.queries), want);
            }
            (Err(_), None) => {}
            (got, want) => panic!("decoder says {got:?}, the protocol says {want:?}"),
        },
        other => assert_eq!(parsed, Ok(ClientOption::Unsupported(other))),
    }
});
