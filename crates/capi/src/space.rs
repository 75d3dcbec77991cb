//! Space in an open file: `kiln_fallocate` (allocate, punch holes, zero ranges) and
//! `kiln_discard` (give a range's space back). On a replicated volume every replica's brick
//! does the same, so a discarded range is a hole on each.

use std::ffi::c_int;

use kiln_client::block_on;

use crate::{neg, KilnFd, EINVAL};

/// Allocates, punches or zeroes `len` bytes at `offset`, as Linux `fallocate(2)` with `mode`
/// (`FALLOC_FL_KEEP_SIZE`, `FALLOC_FL_PUNCH_HOLE`, `FALLOC_FL_ZERO_RANGE`, …) does on the
/// bricks' file system. Returns 0 or `-errno` (`-EOPNOTSUPP` where the brick's file system
/// cannot).
///
/// # Safety
/// `fd` live.
#[no_mangle]
pub unsafe extern "C" fn kiln_fallocate(
    fd: *mut KilnFd,
    mode: c_int,
    offset: i64,
    len: i64,
) -> c_int {
    // SAFETY: forwarded contract.
    let Some(f) = (unsafe { fd.as_ref() }) else {
        return -EINVAL;
    };
    let (Ok(offset), Ok(len)) = (u64::try_from(offset), u64::try_from(len)) else {
        return -EINVAL;
    };
    match block_on(f.client.fallocate(&f.fh, mode as u32, offset, len)) {
        Ok(()) => 0,
        Err(e) => neg(e),
    }
}

/// Gives the space of `len` bytes at `offset` back: the range becomes a hole that reads as
/// zeros, and the file keeps its size. Returns 0 or `-errno`.
///
/// # Safety
/// `fd` live.
#[no_mangle]
pub unsafe extern "C" fn kiln_discard(fd: *mut KilnFd, offset: i64, len: i64) -> c_int {
    // SAFETY: forwarded contract.
    let Some(f) = (unsafe { fd.as_ref() }) else {
        return -EINVAL;
    };
    let (Ok(offset), Ok(len)) = (u64::try_from(offset), u64::try_from(len)) else {
        return -EINVAL;
    };
    match block_on(f.client.discard(&f.fh, offset, len)) {
        Ok(()) => 0,
        Err(e) => neg(e),
    }
}
