//! Reading a small file whole: `kiln_read_file`, one round trip to the brick when the file
//! fits the caller's buffer (the content comes back with the open, and nothing is left open
//! to close).

use std::ffi::{c_char, c_void};
use std::io::IoSliceMut;

use kiln_client::{block_on, Fd, Opened, Volume};

use crate::{client, neg, str_arg, Kiln, EINVAL};

/// Reads the file at `path` from its start into `buf`, which holds `len` bytes. Returns the
/// file's size, or `-errno`.
///
/// When the file fits (its size is at most `len`), all of it is in `buf`, and it came in one
/// round trip with the open; a file whose size is over `len` has its first `len` bytes in
/// `buf` (read through a handle, then closed), and the size returned tells the caller to
/// call again with a bigger buffer. A directory is `-EISDIR`.
///
/// # Safety
/// `k` is live and initialised; `path` is NUL-terminated; `buf` is writable for `len` bytes
/// (it may be null when `len` is 0).
#[no_mangle]
pub unsafe extern "C" fn kiln_read_file(
    k: *mut Kiln,
    path: *const c_char,
    buf: *mut c_void,
    len: usize,
) -> i64 {
    // SAFETY: forwarded contract.
    let (Some(k), path) = (unsafe { k.as_ref() }, unsafe { str_arg(path) }) else {
        return -EINVAL as i64;
    };
    let (path, c) = match (path, client(k)) {
        (Ok(p), Ok(c)) => (p, c),
        (Err(e), _) | (_, Err(e)) => return e as i64,
    };
    if buf.is_null() && len > 0 {
        return -EINVAL as i64;
    }
    let out: &mut [u8] = match len {
        0 => &mut [],
        // SAFETY: non-null (checked above) and writable for `len` bytes per the contract, and
        // nothing else uses it until this call returns.
        _ => unsafe { std::slice::from_raw_parts_mut(buf.cast::<u8>(), len) },
    };
    let peek = len.min(kiln_proto::MAX_PAYLOAD_LEN as usize) as u32;
    match block_on(c.open_small(path, libc::O_RDONLY, peek)) {
        Ok(Opened::Whole(data, _)) if data.len() <= out.len() => {
            out[..data.len()].copy_from_slice(&data);
            data.len() as i64
        }
        // The stack answered with more than was asked for: what fits, and the whole size.
        Ok(Opened::Whole(data, _)) => {
            let n = out.len();
            out.copy_from_slice(&data[..n]);
            data.len() as i64
        }
        Ok(Opened::Fd(fd)) => {
            let r = read_head(c, &fd, out);
            let closed = block_on(c.close(fd));
            match (r, closed) {
                (Ok(size), Ok(())) => size as i64,
                (Err(e), _) | (_, Err(e)) => neg(e) as i64,
            }
        }
        Err(e) => neg(e) as i64,
    }
}

/// Reads the start of open file `fd` into `out`, straight from the socket, up to its end or
/// `out`'s; returns the file's size.
fn read_head(c: &Volume, fd: &Fd, out: &mut [u8]) -> std::io::Result<u64> {
    let a = block_on(c.fstat(fd))?;
    if a.mode & libc::S_IFMT == libc::S_IFDIR {
        return Err(std::io::Error::from_raw_os_error(libc::EISDIR));
    }
    let size = a.size;
    let want = out.len().min(usize::try_from(size).unwrap_or(usize::MAX));
    let mut at = 0;
    while at < want {
        let n = c.preadv_blocking(fd, &mut [IoSliceMut::new(&mut out[at..want])], at as u64)?;
        if n == 0 {
            break; // shrunk meanwhile
        }
        at += n;
    }
    Ok(size)
}
