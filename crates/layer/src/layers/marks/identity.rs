//! Brick identity: the volume a brick belongs to and its place there, in `.kiln/identity`.
//!
//! A brick whose directory lacks the file is *new* (a fresh disk, a wiped directory, the
//! target of `replace-brick`): it says so in HELLO, replicate neither reads from it nor counts
//! it toward a quorum, and heal rebuilds it in full from its replicas; only then does heal
//! tell it to write the file (MEMBER join), after which it is a member like the others. A
//! directory that holds another volume's identity, or another place's, does not start at all:
//! serving it would mix two volumes' files.
//!
//! The very first start of a volume's bricks *adopts*: each writes its identity at once (the
//! bricks are all empty together, there is nothing to rebuild from). The file is read and
//! written relative to `.kiln`'s descriptor, never following a symlink, like the marks log.

use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::path::Path;

use rustix::fs::{self as rfs, AtFlags, FileType, Mode, OFlags};
use rustix::io::Errno;

use super::log::{open_state_dir, refused};
use super::STATE_DIR;

const FILE: &str = "identity";
const FILE_NEW: &str = "identity.new";
/// Longest identity file read (it holds two short lines).
const MAX_LEN: u64 = 4096;

/// Who a brick is: its volume's id and its index among the volume's bricks.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Identity {
    /// The volume's id (random, fixed at create).
    pub volume_id: String,
    /// The brick's index in the volume definition (its place in the graph).
    pub brick: u32,
}

impl Identity {
    fn text(&self) -> String {
        format!(
            "kiln brick identity 1\nvolume-id {}\nbrick {}\n",
            self.volume_id, self.brick
        )
    }

    fn parse(text: &str) -> Option<Identity> {
        let mut lines = text.lines();
        if lines.next()? != "kiln brick identity 1" {
            return None;
        }
        let volume_id = lines.next()?.strip_prefix("volume-id ")?.to_owned();
        let brick = lines.next()?.strip_prefix("brick ")?.parse().ok()?;
        Some(Identity { volume_id, brick })
    }
}

/// The identity the brick directory holds (`None`: none, the brick is new).
pub(super) fn read(root: &OwnedFd) -> std::io::Result<Option<Identity>> {
    let Some(state) = open_state_dir(root, false)? else {
        return Ok(None);
    };
    let name = format!("{STATE_DIR}/{FILE}");
    let flags = OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC | OFlags::NONBLOCK;
    let fd = match rfs::openat(&state, FILE, flags, Mode::empty()) {
        Ok(fd) => fd,
        Err(Errno::NOENT) => return Ok(None),
        Err(Errno::LOOP) => return Err(refused(&name, "is a symbolic link")),
        Err(e) => return Err(e.into()),
    };
    let st = rfs::fstat(&fd)?;
    if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile {
        return Err(refused(&name, "is not a regular file"));
    }
    let mut text = String::new();
    std::fs::File::from(fd)
        .take(MAX_LEN)
        .read_to_string(&mut text)?;
    Identity::parse(&text)
        .map(Some)
        .ok_or_else(|| refused(&name, "is not a brick identity (damaged?)"))
}

/// Records `id` in the brick directory (a new file renamed over the old one, synced).
pub(super) fn write(root: &OwnedFd, id: &Identity) -> std::io::Result<()> {
    let state = open_state_dir(root, true)?.expect("made when missing");
    match rfs::unlinkat(&state, FILE_NEW, AtFlags::empty()) {
        Ok(()) | Err(Errno::NOENT) => {}
        Err(e) => return Err(e.into()),
    }
    let flags = OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let fd = rfs::openat(&state, FILE_NEW, flags, Mode::from_raw_mode(0o644))?;
    let mut f = std::fs::File::from(fd);
    f.write_all(id.text().as_bytes())?;
    f.sync_all()?;
    rfs::renameat(&state, FILE_NEW, &state, FILE)?;
    rfs::fsync(&state)?;
    Ok(())
}

/// Forgets the brick's identity: it is new again.
pub(super) fn remove(root: &OwnedFd) -> std::io::Result<()> {
    let Some(state) = open_state_dir(root, false)? else {
        return Ok(());
    };
    match rfs::unlinkat(&state, FILE, AtFlags::empty()) {
        Ok(()) | Err(Errno::NOENT) => Ok(rfs::fsync(&state)?),
        Err(e) => Err(e.into()),
    }
}

/// Checks the brick directory `dir` against the identity it should carry when it starts;
/// true when the brick is new (holds none). With `adopt` (the volume's first start) a
/// directory without one takes `want` at once.
pub(super) fn check(
    dir: &Path,
    root: &OwnedFd,
    want: &Identity,
    adopt: bool,
) -> std::io::Result<bool> {
    match read(root)? {
        Some(have) if have == *want => Ok(false),
        Some(have) => Err(std::io::Error::other(format!(
            "{} holds brick {} of volume id {}, not brick {} of volume id {}: refusing to \
             serve it (give the brick an empty directory, or remove {STATE_DIR}/{FILE} if \
             this data is to be replaced by a rebuild)",
            dir.display(),
            have.brick,
            have.volume_id,
            want.brick,
            want.volume_id
        ))),
        None if adopt => {
            write(root, want)?;
            Ok(false)
        }
        None => {
            tracing::warn!(
                "{}: no brick identity: a new brick; it serves no reads and counts for no \
                 quorum until heal has rebuilt it from its replicas",
                dir.display()
            );
            Ok(true)
        }
    }
}
