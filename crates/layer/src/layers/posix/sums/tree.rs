//! A brick's files checked or sealed whole, from outside the brick's own I/O: by tests and
//! tools that look at a brick directory (and, later, its scrub).

use std::fs::File;

use rustix::fs::{self as rfs, Mode, OFlags};

use super::Registry;

/// What checking a whole brick found.
#[derive(Debug, Default)]
pub struct TreeCheck {
    /// Regular files checked.
    pub files: u64,
    /// Damaged blocks: the file (relative to the brick) and the block's number.
    pub damaged: Vec<(std::path::PathBuf, u64)>,
}

/// Checks every block of every regular file of the brick directory `dir` against its sum
/// (its state directory aside), as the brick would on a read.
pub fn check_tree(dir: &std::path::Path) -> std::io::Result<TreeCheck> {
    let registry = registry_at(dir)?;
    let mut out = TreeCheck::default();
    let mut todo = vec![std::path::PathBuf::new()];
    while let Some(rel) = todo.pop() {
        for e in std::fs::read_dir(dir.join(&rel))? {
            let e = e?;
            let name = rel.join(e.file_name());
            let t = e.file_type()?;
            if rel.as_os_str().is_empty() && e.file_name() == crate::layers::posix::brick::STATE_DIR
            {
                continue;
            }
            if t.is_dir() {
                todo.push(name);
            } else if t.is_file() {
                let f = File::open(dir.join(&name))?;
                out.files += 1;
                if let Some(s) = registry.of(&f) {
                    let bad = s
                        .scrub(&f)
                        .map_err(|e| std::io::Error::from_raw_os_error(e as i32))?;
                    out.damaged
                        .extend(bad.into_iter().map(|b| (name.clone(), b)));
                }
            }
        }
    }
    Ok(out)
}

/// Seals every block of the file at `rel` in the brick directory `dir` as its bytes are now
/// ([`Sums::rebuild`]): for a tool that changed a brick's file in place, knowing the bytes
/// right. Returns the blocks sealed (0: the brick keeps no sums for it).
pub fn rebuild_at(dir: &std::path::Path, rel: &str) -> std::io::Result<u64> {
    let registry = registry_at(dir)?;
    let f = File::open(dir.join(rel))?;
    match registry.of(&f) {
        Some(s) => s
            .rebuild(&f)
            .map_err(|e| std::io::Error::from_raw_os_error(e as i32)),
        None => Ok(0),
    }
}

/// The sums of the brick directory `dir`, looked at from outside the brick.
fn registry_at(dir: &std::path::Path) -> std::io::Result<Registry> {
    let flags = OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC;
    Registry::new(&rfs::open(dir, flags, Mode::empty())?)
}
