//! Small helpers for the state directory: whole-file writes, random bytes, hex.

use kiln_proto::Error;
use std::fs;
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

pub(crate) fn random(buf: &mut [u8]) -> Result<(), Error> {
    rustix::rand::getrandom(buf, rustix::rand::GetRandomFlags::empty())
        .map(|_| ())
        .map_err(|e| Error::failed(format!("cannot get random bytes: {e}")))
}

pub(crate) fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Writes `dir/name` so that a crash leaves the old or the new contents, never a mix.
pub(crate) fn write_atomic(dir: &Path, name: &str, data: &[u8], mode: u32) -> Result<(), Error> {
    let err = |e: io::Error| {
        Error::io(
            format_args!("cannot write {}", dir.join(name).display()),
            &e,
        )
    };
    fs::create_dir_all(dir).map_err(err)?;
    let tmp = dir.join(format!(".{name}.tmp"));
    let _ = fs::remove_file(&tmp);
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(&tmp)
        .map_err(err)?;
    f.write_all(data).map_err(err)?;
    f.sync_all().map_err(err)?;
    drop(f);
    fs::rename(&tmp, dir.join(name)).map_err(err)?;
    if let Ok(d) = fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}
