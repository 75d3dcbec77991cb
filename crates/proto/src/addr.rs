//! How a listening address is written on command lines and in volfiles: `tcp:IP:PORT` (or a
//! bare `IP:PORT`) and `unix:PATH`.

use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::str::FromStr;

/// Where a server listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Listen {
    /// A TCP address; port 0 picks a free port.
    Tcp(SocketAddr),
    /// A Unix socket path (a stale socket file there is replaced by the server).
    Unix(PathBuf),
}

impl FromStr for Listen {
    type Err = crate::Error;

    fn from_str(s: &str) -> Result<Listen, crate::Error> {
        if let Some(p) = s.strip_prefix("unix:") {
            if p.is_empty() {
                return Err(crate::Error::invalid(format!(
                    "bad listen address {s:?}: empty socket path"
                )));
            }
            return Ok(Listen::Unix(PathBuf::from(p)));
        }
        let a = s.strip_prefix("tcp:").unwrap_or(s);
        a.parse().map(Listen::Tcp).map_err(|e| {
            crate::Error::invalid(format!("bad listen address {s:?}: {e} (want tcp:IP:PORT or unix:PATH, e.g. tcp:127.0.0.1:24100)"))
        })
    }
}

impl fmt::Display for Listen {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Listen::Tcp(a) => write!(f, "tcp:{a}"),
            Listen::Unix(p) => write!(f, "unix:{}", p.display()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forms_parse_and_print_back() {
        for s in [
            "tcp:127.0.0.1:24100",
            "unix:/run/kiln/b.sock",
            "tcp:[::1]:0",
        ] {
            assert_eq!(s.parse::<Listen>().unwrap().to_string(), s);
        }
        assert_eq!(
            "10.0.0.1:7".parse::<Listen>().unwrap(),
            Listen::Tcp("10.0.0.1:7".parse().unwrap())
        );
        for bad in ["unix:", "tcp:nohost", "", "127.0.0.1"] {
            let e = bad.parse::<Listen>().unwrap_err();
            assert!(e.message().contains("bad listen address"), "{e}");
        }
    }
}
