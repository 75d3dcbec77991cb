//! Parsing what the user types: the image spec `ADDR:/VOL/PATH` and the `--listen` address.

use kiln_proto::Error;
use std::fmt;
use std::str::FromStr;

/// Which image to export: a server address, a volume name and a path in the volume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageSpec {
    /// The server: a kilnd that manages volumes (`HOST` for its default management port, or
    /// `HOST:PORT`), or a brick (`tcp:HOST:PORT`, `HOST:PORT` or `unix:PATH`).
    pub server: String,
    /// The volume name: the volume the management server describes; for a plain brick,
    /// recorded and shown only.
    pub volume: String,
    /// The image path inside the volume, without a leading `/` (`images/vm.img`).
    pub path: String,
}

impl FromStr for ImageSpec {
    type Err = Error;

    fn from_str(s: &str) -> Result<ImageSpec, Error> {
        let bad = |why: &str| {
            Error::invalid(format!("bad image spec {s:?}: {why} (want SERVER:/VOL/PATH, e.g. unix:/run/kiln/b1.sock:/vol/images/vm.img or 127.0.0.1:24100:/vol/vm.img)"))
        };
        // The last ":/" separates: a Unix socket path may itself contain ":/", an image path is
        // far less likely to.
        let at = s
            .rfind(":/")
            .ok_or_else(|| bad("no ':/' before the volume"))?;
        let (server, rest) = (&s[..at], &s[at + 2..]);
        if server.is_empty() || server == "unix:" || server == "tcp:" {
            return Err(bad("no server address"));
        }
        let mut parts = rest.split('/').filter(|c| !c.is_empty() && *c != ".");
        let volume = parts
            .next()
            .ok_or_else(|| bad("no volume name"))?
            .to_owned();
        let comps: Vec<&str> = parts.collect();
        if comps.is_empty() {
            return Err(bad("no image path after the volume"));
        }
        if comps.contains(&"..") {
            return Err(bad("'..' is not allowed in the image path"));
        }
        Ok(ImageSpec {
            server: server.to_owned(),
            volume,
            path: comps.join("/"),
        })
    }
}

impl ImageSpec {
    /// IMAGE as a command takes it — SERVER:/VOL/PATH, or with `volfile` the PATH in that
    /// volume — and where its client stack comes from.
    pub fn with_source(
        image: &str,
        volfile: Option<&std::path::Path>,
    ) -> Result<(ImageSpec, kiln_client::volume::Source), Error> {
        use kiln_client::volume::Source;
        Ok(match volfile {
            Some(v) => (
                ImageSpec::in_volfile(image, v)?,
                Source::Volfile(v.to_owned()),
            ),
            None => {
                let spec: ImageSpec = image.parse()?;
                let src = Source::Server {
                    server: spec.server.clone(),
                    volume: spec.volume.clone(),
                };
                (spec, src)
            }
        })
    }
}

impl ImageSpec {
    /// What an export's log lines start with: `volume=V image=PATH` (empty when IMAGE does
    /// not parse: the command then fails with the reason).
    pub fn log_tag(image: &str, volfile: Option<&std::path::Path>) -> String {
        match ImageSpec::with_source(image, volfile) {
            Ok((s, _)) => format!("volume={} image={}", s.volume, s.path),
            Err(_) => String::new(),
        }
    }

    /// An image at `path` in the volume a volfile describes (`kiln nbd --volfile`): no server
    /// to name, the volume is named after the file.
    pub fn in_volfile(path: &str, volfile: &std::path::Path) -> Result<ImageSpec, Error> {
        let comps: Vec<&str> = path
            .split('/')
            .filter(|c| !c.is_empty() && *c != ".")
            .collect();
        if comps.is_empty() {
            return Err(Error::invalid(format!("bad image path {path:?}: empty")));
        }
        if comps.contains(&"..") {
            return Err(Error::invalid(format!(
                "bad image path {path:?}: '..' is not allowed in the image path"
            )));
        }
        Ok(ImageSpec {
            server: String::new(),
            volume: volfile
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default(),
            path: comps.join("/"),
        })
    }
}

impl fmt::Display for ImageSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:/{}/{}", self.server, self.volume, self.path)
    }
}

/// Where the export listens for NBD clients.
pub use kiln_proto::Listen;

/// The NBD URI (as qemu, libnbd and fio take it) of export `name` on `listen`.
pub fn nbd_uri(listen: &Listen, name: &str) -> String {
    let name = uri_escape(name);
    match listen {
        Listen::Unix(p) => format!(
            "nbd+unix:///{name}?socket={}",
            uri_escape(&p.display().to_string())
        ),
        Listen::Tcp(a) => format!("nbd://{a}/{name}"),
    }
}

/// Percent-encodes what is not safe in a URI path or query value (keeps `/`).
fn uri_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"/-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_tags_name_the_volume_and_image() {
        assert_eq!(
            ImageSpec::log_tag("127.0.0.1:/vms/a/disk.img", None),
            "volume=vms image=a/disk.img"
        );
        let vf = std::path::Path::new("/etc/kiln/fast.toml");
        assert_eq!(
            ImageSpec::log_tag("/x.img", Some(vf)),
            "volume=fast image=x.img"
        );
        assert_eq!(ImageSpec::log_tag("no-volume-here", None), "");
    }

    #[test]
    fn image_specs() {
        let s: ImageSpec = "unix:/run/kiln/b1.sock:/vol/images/vm.img".parse().unwrap();
        assert_eq!(s.server, "unix:/run/kiln/b1.sock");
        assert_eq!(s.volume, "vol");
        assert_eq!(s.path, "images/vm.img");
        assert_eq!(s.to_string(), "unix:/run/kiln/b1.sock:/vol/images/vm.img");

        let s: ImageSpec = "tcp:127.0.0.1:24100:/v/a.img".parse().unwrap();
        assert_eq!(
            (s.server.as_str(), s.volume.as_str(), s.path.as_str()),
            ("tcp:127.0.0.1:24100", "v", "a.img")
        );
        let s: ImageSpec = "host:24100://v//x/./a.img".parse().unwrap();
        assert_eq!(
            (s.server.as_str(), s.path.as_str()),
            ("host:24100", "x/a.img")
        );
        // A management server on its default port.
        let s: ImageSpec = "node1:/vol/a.img".parse().unwrap();
        assert_eq!(
            (s.server.as_str(), s.volume.as_str(), s.path.as_str()),
            ("node1", "vol", "a.img")
        );
        // The last ":/" wins, so a socket path may contain one.
        let s: ImageSpec = "unix:/tmp/a:/b.sock:/v/a.img".parse().unwrap();
        assert_eq!(s.server, "unix:/tmp/a:/b.sock");

        for bad in [
            "vm.img",
            "unix:/s.sock:/vol",
            "unix:/s.sock:/vol/",
            ":/vol/a",
            "h:1:/v/../a",
            "unix::/v/a",
        ] {
            let e = bad.parse::<ImageSpec>().unwrap_err();
            assert!(e.message().contains("bad image spec"), "{bad}: {e}");
        }
    }

    #[test]
    fn listen_addresses() {
        assert_eq!(
            "unix:/tmp/n.sock".parse::<Listen>().unwrap(),
            Listen::Unix("/tmp/n.sock".into())
        );
        assert_eq!(
            "tcp:127.0.0.1:10809".parse::<Listen>().unwrap(),
            Listen::Tcp("127.0.0.1:10809".parse().unwrap())
        );
        assert_eq!(
            "[::1]:0".parse::<Listen>().unwrap(),
            Listen::Tcp("[::1]:0".parse().unwrap())
        );
        assert!("tcp:localhost"
            .parse::<Listen>()
            .unwrap_err()
            .message()
            .contains("bad listen address"));
        assert!("unix:".parse::<Listen>().is_err());
    }

    #[test]
    fn uris() {
        let u = nbd_uri(&Listen::Unix("/tmp/x y.sock".into()), "images/vm.img");
        assert_eq!(u, "nbd+unix:///images/vm.img?socket=/tmp/x%20y.sock");
        let u = nbd_uri(&Listen::Tcp("127.0.0.1:10809".parse().unwrap()), "a");
        assert_eq!(u, "nbd://127.0.0.1:10809/a");
    }
}
