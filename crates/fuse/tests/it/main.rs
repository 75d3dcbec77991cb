//! The fuse crate's integration tests, one program (one link, not one per file).

mod common;

mod fuse_direct_io;
mod fuse_distribute;
mod fuse_exerciser;
mod fuse_listing;
mod fuse_passthrough;
mod fuse_posix;
mod fuse_small_files;
mod fuse_two_mounts;
mod fuse_users;
mod fuse_volume;
mod fuse_write_behind;
mod fuse_xattr;
