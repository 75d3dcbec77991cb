//! How a mount is made: the options `kiln mount` takes, applied to a [`KilnFs`].

use crate::{KilnFs, Mode, MAX_IO};

impl KilnFs {
    /// With `on` false, every read goes through this process even where the kernel could read
    /// the brick's file itself (passthrough is on by default in vm-image mode).
    pub fn with_passthrough(self, on: bool) -> KilnFs {
        if !on {
            self.pass.off("--passthrough off");
        }
        self
    }

    /// With `on` false, every read is received into this process's memory and written to the
    /// kernel from there, even over TCP where it could go by splice (see [`crate::splice`]).
    pub fn with_splice(mut self, on: bool) -> KilnFs {
        if !on {
            self.splice = std::sync::Arc::new(crate::splice::Splice::off());
        }
        self
    }

    /// With `on` (general mode), the kernel gathers writes in its page cache and sends them
    /// later (FUSE writeback caching). It then keeps its own idea of each file's size and
    /// mtime, so other clients' changes to a file it holds are not seen: for a tree only this
    /// mount writes. Off, writes go through at once and close-to-open holds (see
    /// [`crate::fresh`]).
    pub fn with_writeback_cache(mut self, on: bool) -> KilnFs {
        self.writeback = on && self.mode == Mode::General;
        self.write_behind &= !self.writeback;
        self
    }

    /// With `on` (general mode, without the writeback cache), writes that continue a file's
    /// last one are held and sent together (see [`crate::behind`]).
    pub fn with_write_behind(mut self, on: bool) -> KilnFs {
        self.write_behind = on && self.mode == Mode::General && !self.writeback;
        self
    }

    /// With `on`, POSIX ACLs are stored on the bricks and enforced by the kernel; without, the
    /// mount does not support them (see [`crate::xattr`]).
    pub fn with_acl(mut self, on: bool) -> KilnFs {
        self.acl = on;
        self
    }

    /// Read-only opens (general mode) of files of at most `max` bytes fetch them whole with
    /// the open (see [`crate::files`]); 0 turns that off.
    pub fn with_small_file_max(mut self, max: u32) -> KilnFs {
        if self.mode == Mode::General {
            self.small_max = max.min(MAX_IO);
        }
        self
    }
}
