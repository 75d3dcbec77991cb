//! Who may connect over TCP: an allow-list of address ranges.
//!
//! A refused client is not just dropped: the server answers its first frame with `EACCES`, so
//! the client can say why it failed, logs who was refused, and closes the connection. Unix
//! socket clients are local and governed by the socket file's permissions.

use std::net::IpAddr;
use std::time::Duration;

use kiln_proto::errno;
use kiln_proto::frame::{Header, HEADER_LEN};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// An address range, `ADDR/PREFIX` (a bare address is a single host).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cidr {
    addr: IpAddr,
    prefix: u8,
}

impl std::str::FromStr for Cidr {
    type Err = kiln_proto::Error;
    fn from_str(s: &str) -> Result<Cidr, kiln_proto::Error> {
        let bad = |why: &str| {
            kiln_proto::Error::invalid(format!(
                "bad address range {s:?}: {why} (want e.g. 127.0.0.0/8 or ::1)"
            ))
        };
        let (a, p) = match s.split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (s, None),
        };
        let addr: IpAddr = a.parse().map_err(|_| bad("not an IP address"))?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = match p {
            Some(p) => p
                .parse::<u8>()
                .ok()
                .filter(|_| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
                .filter(|p| *p <= max)
                .ok_or_else(|| bad("bad prefix length"))?,
            None => max,
        };
        Ok(Cidr { addr, prefix })
    }
}

impl std::fmt::Display for Cidr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

impl Cidr {
    /// True if `ip` is in this range. IPv4 clients seen as IPv4-mapped IPv6 addresses match
    /// IPv4 ranges.
    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(ip),
            v4 => v4,
        };
        match (self.addr, ip) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                let mask = u32::MAX.checked_shl(32 - self.prefix as u32).unwrap_or(0);
                u32::from(net) & mask == u32::from(ip) & mask
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                let mask = u128::MAX.checked_shl(128 - self.prefix as u32).unwrap_or(0);
                u128::from(net) & mask == u128::from(ip) & mask
            }
            _ => false,
        }
    }
}

/// True if `ip` may connect: an empty list allows everyone.
pub fn allowed(allow: &[Cidr], ip: IpAddr) -> bool {
    allow.is_empty() || allow.iter().any(|c| c.contains(ip))
}

/// Answers the refused client's first frame with `EACCES` and closes (bounded in time).
pub async fn refuse(s: tokio::net::TcpStream, peer: std::net::SocketAddr) {
    tracing::warn!(%peer, "refused a connection: address not in the allow-list");
    answer_first_frame(s, errno::EACCES).await;
}

/// Answers the first frame of a plaintext client on a TLS-only listener with
/// `EPROTONOSUPPORT` (the client says "requires TLS") and closes.
pub async fn refuse_plaintext(s: tokio::net::TcpStream, peer: std::net::SocketAddr) {
    tracing::warn!(%peer, "refused a connection: plaintext client, this brick requires TLS");
    answer_first_frame(s, errno::EPROTONOSUPPORT).await;
}

async fn answer_first_frame(mut s: tokio::net::TcpStream, status: u32) {
    let mut h = [0u8; HEADER_LEN];
    let answer = async {
        s.read_exact(&mut h).await?;
        let (op, id) = match Header::parse(&h) {
            Ok(hdr) => (hdr.opcode.get(), hdr.request_id.get()),
            Err(_) => (0, 0),
        };
        s.write_all(&Header::reply(op, id, status, 0, 0).to_bytes())
            .await
    };
    let _ = tokio::time::timeout(Duration::from_secs(2), answer).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_match_what_they_should() {
        let c: Cidr = "10.1.0.0/16".parse().unwrap();
        assert!(c.contains("10.1.200.3".parse().unwrap()));
        assert!(!c.contains("10.2.0.1".parse().unwrap()));
        assert!(
            c.contains("::ffff:10.1.0.9".parse().unwrap()),
            "IPv4-mapped"
        );
        let host: Cidr = "127.0.0.2".parse().unwrap();
        assert!(host.contains("127.0.0.2".parse().unwrap()));
        assert!(!host.contains("127.0.0.1".parse().unwrap()));
        let all: Cidr = "0.0.0.0/0".parse().unwrap();
        assert!(all.contains("8.8.8.8".parse().unwrap()));
        let v6: Cidr = "fd00::/8".parse().unwrap();
        assert!(
            v6.contains("fd12::1".parse().unwrap()) && !v6.contains("fe80::1".parse().unwrap())
        );
        assert!("10.0.0.0/33".parse::<Cidr>().is_err());
        assert!("bogus".parse::<Cidr>().is_err());
        assert!(allowed(&[], "1.2.3.4".parse().unwrap()));
    }
}
