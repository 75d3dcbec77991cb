//! Unit tests of the FUSE adapter's helpers.

use super::*;
use clap::Parser;
use kiln_client::volume::Source;
use kiln_proto::Error;
use std::path::PathBuf;

#[derive(clap::Parser)]
struct Cli {
    #[command(flatten)]
    mount: MountArgs,
}

fn target(args: &[&str]) -> Result<(Source, String, PathBuf), Error> {
    let cli = Cli::try_parse_from(std::iter::once("mount").chain(args.iter().copied()))
        .map_err(|e| Error::invalid(e.to_string()))?;
    mount_target(&cli.mount)
}

#[test]
fn mount_sources() {
    let (src, label, mnt) = target(&["127.0.0.1:24100:/vol", "/mnt/v"]).unwrap();
    assert_eq!(
        src,
        Source::Server {
            server: "127.0.0.1:24100".into(),
            volume: "vol".into()
        }
    );
    assert_eq!(
        (label.as_str(), mnt),
        ("127.0.0.1:24100:/vol", "/mnt/v".into())
    );
    let (src, _, _) = target(&["node1:/vol/", "/mnt/v"]).unwrap();
    assert_eq!(
        src,
        Source::Server {
            server: "node1".into(),
            volume: "vol".into()
        }
    );
    let (src, label, mnt) = target(&["--volfile", "/etc/kiln/d.toml", "/mnt/d"]).unwrap();
    assert_eq!(src, Source::Volfile("/etc/kiln/d.toml".into()));
    assert_eq!((label.as_str(), mnt), ("/etc/kiln/d.toml", "/mnt/d".into()));
    let (_, label, mnt) = target(&["--volfile", "d.toml", "dist", "/mnt/d"]).unwrap();
    assert_eq!((label.as_str(), mnt), ("dist", "/mnt/d".into()));
    assert!(target(&["/mnt/v"])
        .unwrap_err()
        .message()
        .contains("mount point"));
    assert!(target(&["vol", "/mnt/v"])
        .unwrap_err()
        .message()
        .contains("bad volume"));
}
