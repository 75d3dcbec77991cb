//! libkiln: the C ABI of the Kiln client.
//!
//! Every call goes through the client layer stack ([`kiln_client::Volume`]): the default stack
//! (io-stats over one protocol-client) for a brick named with `kiln_set_volfile_server`, or a
//! volfile's graph (distribute and replicate over several bricks) with `kiln_set_volfile` or
//! `kiln_volume_open`.
//!
//! Handles are opaque (`kiln_t`, `kiln_fd_t`); every call returns 0 (or a byte count) on
//! success and `-errno` on failure; callbacks carry the caller's `user_data`. The payload of a
//! read goes from the socket straight into the caller's iovecs, as in the Rust API.
//!
//! Completions of the `_async` calls run, by default, on a Kiln thread: the connection's
//! receive thread, or for a read of 64 KiB or more served straight from the file of a brick on
//! this host (a local short-circuit read), the process's copy thread. Keep callbacks short.
//! A smaller short-circuit read completes at once, and so may any call whose reply is back
//! before the call has finished: such a callback runs on the calling thread before the call
//! returns. Never hold a lock across a submission that the callback takes (or use
//! `KILN_COMPLETE_BY_POLL`). A program with its own event loop (QEMU, say) sets
//! `KILN_COMPLETE_BY_POLL` in `kiln_options`: completions are then queued, `kiln_completion_fd`
//! becomes readable, and `kiln_poll_completions` runs the callbacks on the caller's thread.
//!
//! `kiln.h` is generated from this file by cbindgen; a test fails when the committed header
//! and the code disagree.
#![allow(non_camel_case_types)]
#![deny(unsafe_op_in_unsafe_fn)]

use std::collections::VecDeque;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::path::PathBuf;
use std::sync::{mpsc, Arc, Mutex};

mod space;
mod whole;
pub use space::{kiln_discard, kiln_fallocate};
pub use whole::kiln_read_file;

use kiln_client::volume::Source;
use kiln_client::{block_on, Fd, RawIov, Volume};
use kiln_proto::sync::MutexExt as _;

/// Status returned for a bad argument.
const EINVAL: c_int = libc::EINVAL;

/// How `_async` completions are delivered.
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum kiln_completion_mode {
    /// Callbacks run on a Kiln thread (the connection's receive thread, or the copy thread
    /// for large local short-circuit reads) — or on the calling thread, before the call
    /// returns, when the result is there at once (a small short-circuit read, a fast reply).
    /// The default.
    KILN_COMPLETE_ON_IO_THREAD = 0,
    /// Completions are queued; `kiln_completion_fd` (an eventfd) becomes readable and
    /// `kiln_poll_completions` runs them on the calling thread.
    KILN_COMPLETE_BY_POLL = 1,
}

/// Options for `kiln_set_options`. Set `struct_size` to `sizeof(kiln_options)`: fields past the
/// size a caller was compiled with keep their defaults, so the struct can grow without new
/// function names.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct kiln_options {
    /// `sizeof(kiln_options)` as the caller knows it.
    pub struct_size: u32,
    /// A `kiln_completion_mode` value.
    pub completion_mode: u32,
}

/// File attributes.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
#[allow(missing_docs)] // fields are named after the POSIX `struct stat` fields they carry
pub struct kiln_stat_t {
    pub st_ino: u64,
    pub st_mode: u32,
    pub st_uid: u32,
    pub st_gid: u32,
    pub st_blksize: u32,
    pub st_nlink: u64,
    pub st_rdev: u64,
    pub st_size: u64,
    pub st_blocks: u64,
    pub st_atime_sec: i64,
    pub st_atime_nsec: u32,
    pub st_mtime_nsec: u32,
    pub st_mtime_sec: i64,
    pub st_ctime_sec: i64,
    pub st_ctime_nsec: u32,
    pub reserved: u32,
}

/// Completion of an asynchronous call: the file, the result (bytes or `-errno`) and the
/// caller's `user_data`.
pub type kiln_io_cbk =
    Option<unsafe extern "C" fn(fd: *mut KilnFd, ret: isize, user_data: *mut c_void)>;

/// One directory entry for `kiln_readdir`; return non-zero to stop the listing.
pub type kiln_dirent_cbk = Option<
    unsafe extern "C" fn(
        name: *const c_char,
        st: *const kiln_stat_t,
        user_data: *mut c_void,
    ) -> c_int,
>;

struct Queued {
    cb: unsafe extern "C" fn(*mut KilnFd, isize, *mut c_void),
    fd: usize,
    ret: isize,
    user_data: usize,
}

/// Completions waiting for `kiln_poll_completions`.
struct CompletionQueue {
    items: Mutex<VecDeque<Queued>>,
    eventfd: std::os::fd::OwnedFd,
}

/// A connection to a volume (opaque to C).
pub struct Kiln {
    volname: String,
    server: Option<String>,
    volfile: Option<PathBuf>,
    mode: kiln_completion_mode,
    client: Option<Arc<Volume>>,
    queue: Arc<CompletionQueue>,
}

/// An open file (opaque to C).
pub struct KilnFd {
    client: Arc<Volume>,
    fh: Fd,
    mode: kiln_completion_mode,
    queue: Arc<CompletionQueue>,
}

/// `-errno` for an error. Errors that carry a message instead of an errno (connection set-up
/// adds the address to them) are mapped back by kind.
fn neg(e: std::io::Error) -> c_int {
    use std::io::ErrorKind as K;
    // An error that passed through Kiln's typed errors keeps its errno inside.
    let inner = e
        .get_ref()
        .and_then(|r| r.downcast_ref::<kiln_proto::Error>())
        .and_then(kiln_proto::Error::raw_os_error);
    -e.raw_os_error().or(inner).unwrap_or(match e.kind() {
        K::ConnectionRefused => libc::ECONNREFUSED,
        K::ConnectionReset => libc::ECONNRESET,
        K::NotFound => libc::ENOENT,
        K::PermissionDenied => libc::EACCES,
        K::TimedOut => libc::ETIMEDOUT,
        K::AddrNotAvailable => libc::EADDRNOTAVAIL,
        K::InvalidInput => libc::EINVAL,
        _ => libc::EIO,
    })
}

/// # Safety
/// `p` must be NULL or a NUL-terminated string.
unsafe fn str_arg<'a>(p: *const c_char) -> Result<&'a str, c_int> {
    if p.is_null() {
        return Err(-EINVAL);
    }
    // SAFETY: non-null and NUL-terminated per the caller's contract.
    unsafe { CStr::from_ptr(p) }.to_str().map_err(|_| -EINVAL)
}

/// # Safety
/// `iov` must point at `iovcnt` valid `struct iovec`s.
unsafe fn iov_arg(iov: *const libc::iovec, iovcnt: c_int) -> Result<Vec<RawIov>, c_int> {
    if iovcnt < 0 || iovcnt as usize > kiln_proto::iov::IOV_MAX || (iov.is_null() && iovcnt > 0) {
        return Err(-EINVAL);
    }
    if iovcnt == 0 {
        return Ok(Vec::new());
    }
    // SAFETY: checked non-null; the caller promises `iovcnt` elements.
    let v = unsafe { std::slice::from_raw_parts(iov, iovcnt as usize) };
    Ok(v.iter()
        .map(|v| RawIov {
            base: v.iov_base as usize,
            len: v.iov_len,
        })
        .collect())
}

fn client(k: &Kiln) -> Result<&Arc<Volume>, c_int> {
    k.client.as_ref().ok_or(-libc::ENOTCONN)
}

fn to_stat(a: &kiln_client::Attr) -> kiln_stat_t {
    kiln_stat_t {
        st_ino: a.ino,
        st_mode: a.mode,
        st_uid: a.uid,
        st_gid: a.gid,
        st_blksize: a.blksize,
        st_nlink: a.nlink,
        st_rdev: a.rdev,
        st_size: a.size,
        st_blocks: a.blocks,
        st_atime_sec: a.atime.sec,
        st_atime_nsec: a.atime.nsec,
        st_mtime_sec: a.mtime.sec,
        st_mtime_nsec: a.mtime.nsec,
        st_ctime_sec: a.ctime.sec,
        st_ctime_nsec: a.ctime.nsec,
        reserved: 0,
    }
}

macro_rules! try_c {
    ($e:expr) => {
        match $e {
            Ok(v) => v,
            Err(e) => return e,
        }
    };
}

/// Creates a handle for volume `volname`. Returns 0 and sets `*out`, or `-errno`.
///
/// # Safety
/// `volname` is a NUL-terminated string; `out` is writable.
#[no_mangle]
pub unsafe extern "C" fn kiln_new(volname: *const c_char, out: *mut *mut Kiln) -> c_int {
    // SAFETY: forwarded contract.
    let volname = try_c!(unsafe { str_arg(volname) });
    if out.is_null() || volname.is_empty() {
        return -EINVAL;
    }
    let eventfd = match rustix_eventfd() {
        Ok(fd) => fd,
        Err(e) => return e,
    };
    let k = Box::new(Kiln {
        volname: volname.to_owned(),
        server: None,
        volfile: None,
        mode: kiln_completion_mode::KILN_COMPLETE_ON_IO_THREAD,
        client: None,
        queue: Arc::new(CompletionQueue {
            items: Mutex::new(VecDeque::new()),
            eventfd,
        }),
    });
    // SAFETY: `out` is writable per the contract.
    unsafe { *out = Box::into_raw(k) };
    0
}

fn rustix_eventfd() -> Result<std::os::fd::OwnedFd, c_int> {
    // SAFETY: eventfd has no memory-safety preconditions; a non-negative result is a new fd.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    if fd < 0 {
        return Err(-std::io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EIO));
    }
    // SAFETY: `fd` was just created and is owned by no one else.
    Ok(unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) })
}

/// Names the server: `transport` is "tcp" (with `host` and `port`) or "unix" (`host` is the
/// socket path, `port` ignored).
///
/// # Safety
/// `k` is a live handle; strings are NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn kiln_set_volfile_server(
    k: *mut Kiln,
    transport: *const c_char,
    host: *const c_char,
    port: c_int,
) -> c_int {
    // SAFETY: forwarded contract.
    let (Some(k), transport, host) = (
        unsafe { k.as_mut() },
        unsafe { str_arg(transport) },
        unsafe { str_arg(host) },
    ) else {
        return -EINVAL;
    };
    let (transport, host) = (try_c!(transport), try_c!(host));
    k.server = Some(match transport {
        "tcp" if (1..=65535).contains(&port) => format!("tcp:{host}:{port}"),
        "unix" => format!("unix:{host}"),
        _ => return -EINVAL,
    });
    0
}

/// Builds the client stack from a volfile (TOML; distribute, replicate, several bricks)
/// instead of the server named by `kiln_set_volfile_server`. Call before `kiln_init`.
///
/// # Safety
/// `k` is a live handle; `path` is NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn kiln_set_volfile(k: *mut Kiln, path: *const c_char) -> c_int {
    // SAFETY: forwarded contract.
    let (Some(k), path) = (unsafe { k.as_mut() }, unsafe { str_arg(path) }) else {
        return -EINVAL;
    };
    let path = try_c!(path);
    if path.is_empty() || k.client.is_some() {
        return -EINVAL;
    }
    k.volfile = Some(PathBuf::from(path));
    0
}

/// Applies options (see `kiln_options`). Call before `kiln_init`.
///
/// # Safety
/// `k` is a live handle; `opts` points at least `opts->struct_size` readable bytes.
#[no_mangle]
pub unsafe extern "C" fn kiln_set_options(k: *mut Kiln, opts: *const kiln_options) -> c_int {
    // SAFETY: forwarded contract.
    let Some(k) = (unsafe { k.as_mut() }) else {
        return -EINVAL;
    };
    if opts.is_null() || k.client.is_some() {
        return -EINVAL;
    }
    // SAFETY: the first field is always present.
    let size = unsafe { (*opts).struct_size } as usize;
    if size < std::mem::size_of::<u32>() {
        return -EINVAL;
    }
    if size >= std::mem::offset_of!(kiln_options, completion_mode) + 4 {
        // SAFETY: the caller's struct is large enough to hold this field.
        k.mode = match unsafe { (*opts).completion_mode } {
            0 => kiln_completion_mode::KILN_COMPLETE_ON_IO_THREAD,
            1 => kiln_completion_mode::KILN_COMPLETE_BY_POLL,
            _ => return -EINVAL,
        };
    }
    0
}

/// Connects to the server. Returns 0 or `-errno` (`-ECONNREFUSED`, `-ENOENT`, …).
///
/// # Safety
/// `k` is a live handle.
#[no_mangle]
pub unsafe extern "C" fn kiln_init(k: *mut Kiln) -> c_int {
    // SAFETY: forwarded contract.
    let Some(k) = (unsafe { k.as_mut() }) else {
        return -EINVAL;
    };
    let src = match (&k.volfile, &k.server) {
        (Some(v), _) => Source::Volfile(v.clone()),
        (None, Some(server)) => Source::Server {
            server: server.clone(),
            volume: k.volname.clone(),
        },
        (None, None) => return -EINVAL,
    };
    if k.client.is_some() {
        return -libc::EISCONN;
    }
    match Volume::from_source(&src) {
        Ok(v) => {
            k.client = Some(Arc::new(v));
            0
        }
        Err(e) => neg(e),
    }
}

/// Opens a volume in one call: `source` is `SERVER:/VOL` (a brick or a server that keeps volume
/// definitions: `HOST:PORT:/VOL`, `unix:PATH:/VOL`) or, when it contains no `:/`, the path of
/// a volfile. `opts` may be NULL (defaults). Returns 0 and sets `*out` to an initialised handle
/// (free it with `kiln_fini`), or `-errno` and leaves `*out` alone.
///
/// # Safety
/// `source` is NUL-terminated; `opts` is NULL or as for `kiln_set_options`; `out` is writable.
#[no_mangle]
pub unsafe extern "C" fn kiln_volume_open(
    source: *const c_char,
    opts: *const kiln_options,
    out: *mut *mut Kiln,
) -> c_int {
    // SAFETY: forwarded contract.
    let source = try_c!(unsafe { str_arg(source) });
    if out.is_null() || source.is_empty() {
        return -EINVAL;
    }
    let (volname, volfile, server) = if source.contains(":/") {
        match Source::parse(source) {
            Ok(Source::Server { server, volume }) if !volume.is_empty() => (volume, None, server),
            _ => return -EINVAL,
        }
    } else {
        let p = PathBuf::from(source);
        let name = p
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| "volume".into());
        (name, Some(p), String::new())
    };
    let Ok(name) = std::ffi::CString::new(volname) else {
        return -EINVAL;
    };
    let mut k: *mut Kiln = std::ptr::null_mut();
    // SAFETY: a valid name and a writable out pointer.
    let r = unsafe { kiln_new(name.as_ptr(), &mut k) };
    if r != 0 {
        return r;
    }
    // SAFETY: `k` was just created by `kiln_new` and is ours alone.
    let kr = unsafe { &mut *k };
    kr.volfile = volfile;
    if kr.volfile.is_none() {
        kr.server = Some(server);
    }
    let mut r = 0;
    if !opts.is_null() {
        // SAFETY: forwarded contract.
        r = unsafe { kiln_set_options(k, opts) };
    }
    if r == 0 {
        // SAFETY: a live handle.
        r = unsafe { kiln_init(k) };
    }
    if r != 0 {
        // SAFETY: a live handle, not used again.
        unsafe { kiln_fini(k) };
        return r;
    }
    // SAFETY: `out` is writable per the contract.
    unsafe { *out = k };
    0
}

/// Disconnects and frees the handle. With nothing in flight, the bricks are told this client
/// is done (waiting up to a second), so that what it changed leaves nothing for heal to
/// suspect. Files still open fail from now on; close them to free them.
///
/// # Safety
/// `k` is a live handle, not used again.
#[no_mangle]
pub unsafe extern "C" fn kiln_fini(k: *mut Kiln) -> c_int {
    if k.is_null() {
        return -EINVAL;
    }
    // SAFETY: created by `kiln_new`, given back exactly once.
    let k = unsafe { Box::from_raw(k) };
    if let Some(c) = &k.client {
        c.end();
    }
    let _ = &k.volname;
    0
}

/// The eventfd that becomes readable when completions are queued (`KILN_COMPLETE_BY_POLL`).
///
/// # Safety
/// `k` is a live handle.
#[no_mangle]
pub unsafe extern "C" fn kiln_completion_fd(k: *const Kiln) -> c_int {
    // SAFETY: forwarded contract.
    let Some(k) = (unsafe { k.as_ref() }) else {
        return -EINVAL;
    };
    std::os::fd::AsRawFd::as_raw_fd(&k.queue.eventfd)
}

/// Runs up to `max` queued completions on the calling thread; returns how many ran.
///
/// # Safety
/// `k` is a live handle.
#[no_mangle]
pub unsafe extern "C" fn kiln_poll_completions(k: *mut Kiln, max: c_int) -> c_int {
    // SAFETY: forwarded contract.
    let Some(k) = (unsafe { k.as_ref() }) else {
        return -EINVAL;
    };
    let mut buf = 0u64;
    // SAFETY: reading 8 bytes into a u64 from our own non-blocking eventfd.
    unsafe {
        libc::read(
            std::os::fd::AsRawFd::as_raw_fd(&k.queue.eventfd),
            (&mut buf as *mut u64).cast(),
            8,
        )
    };
    let mut ran = 0;
    while ran < max.max(0) {
        let Some(q) = k.queue.items.locked().pop_front() else {
            break;
        };
        // SAFETY: the callback and its arguments are exactly what the caller registered.
        unsafe { (q.cb)(q.fd as *mut KilnFd, q.ret, q.user_data as *mut c_void) };
        ran += 1;
    }
    if !k.queue.items.locked().is_empty() {
        signal(&k.queue);
    }
    ran
}

fn signal(q: &CompletionQueue) {
    let one = 1u64;
    // SAFETY: writing 8 bytes to our own eventfd.
    unsafe {
        libc::write(
            std::os::fd::AsRawFd::as_raw_fd(&q.eventfd),
            (&one as *const u64).cast(),
            8,
        )
    };
}

fn new_fd(k: &Kiln, client: &Arc<Volume>, fh: Fd, out: *mut *mut KilnFd) -> c_int {
    let fd = Box::new(KilnFd {
        client: client.clone(),
        fh,
        mode: k.mode,
        queue: k.queue.clone(),
    });
    // SAFETY: the caller checked `out` is non-null and writable.
    unsafe { *out = Box::into_raw(fd) };
    0
}

/// Opens an existing file with `O_*` flags.
///
/// # Safety
/// `k` is a live, initialised handle; `path` NUL-terminated; `out` writable.
#[no_mangle]
pub unsafe extern "C" fn kiln_open(
    k: *mut Kiln,
    path: *const c_char,
    flags: c_int,
    out: *mut *mut KilnFd,
) -> c_int {
    // SAFETY: forwarded contract.
    let (Some(k), path) = (unsafe { k.as_ref() }, unsafe { str_arg(path) }) else {
        return -EINVAL;
    };
    let path = try_c!(path);
    if out.is_null() {
        return -EINVAL;
    }
    let c = try_c!(client(k));
    match block_on(c.open(path, flags)) {
        Ok(fh) => new_fd(k, c, fh, out),
        Err(e) => neg(e),
    }
}

/// Creates (or opens) a file; with `O_EXCL` only creates.
///
/// # Safety
/// As for `kiln_open`.
#[no_mangle]
pub unsafe extern "C" fn kiln_creat(
    k: *mut Kiln,
    path: *const c_char,
    flags: c_int,
    mode: u32,
    out: *mut *mut KilnFd,
) -> c_int {
    // SAFETY: forwarded contract.
    let (Some(k), path) = (unsafe { k.as_ref() }, unsafe { str_arg(path) }) else {
        return -EINVAL;
    };
    let path = try_c!(path);
    if out.is_null() {
        return -EINVAL;
    }
    let c = try_c!(client(k));
    match block_on(c.create(path, flags, mode)) {
        Ok((fh, _)) => new_fd(k, c, fh, out),
        Err(e) => neg(e),
    }
}

/// Closes a file and frees its handle (even when the server cannot be reached).
///
/// # Safety
/// `fd` is a live file handle with no call in flight, not used again.
#[no_mangle]
pub unsafe extern "C" fn kiln_close(fd: *mut KilnFd) -> c_int {
    if fd.is_null() {
        return -EINVAL;
    }
    // SAFETY: created by `new_fd`, given back exactly once.
    let fd = unsafe { Box::from_raw(fd) };
    match block_on(fd.client.close(fd.fh.clone())) {
        Ok(()) => 0,
        Err(e) => neg(e),
    }
}

/// Attributes of `path` (not following a final symlink).
///
/// # Safety
/// `k` live and initialised; `path` NUL-terminated; `st` writable.
#[no_mangle]
pub unsafe extern "C" fn kiln_stat(
    k: *mut Kiln,
    path: *const c_char,
    st: *mut kiln_stat_t,
) -> c_int {
    // SAFETY: forwarded contract.
    let (Some(k), path) = (unsafe { k.as_ref() }, unsafe { str_arg(path) }) else {
        return -EINVAL;
    };
    let path = try_c!(path);
    if st.is_null() {
        return -EINVAL;
    }
    match block_on(try_c!(client(k)).lookup(path)) {
        Ok(a) => {
            // SAFETY: checked non-null, writable per the contract.
            unsafe { *st = to_stat(&a) };
            0
        }
        Err(e) => neg(e),
    }
}

/// Attributes of an open file.
///
/// # Safety
/// `fd` live; `st` writable.
#[no_mangle]
pub unsafe extern "C" fn kiln_fstat(fd: *mut KilnFd, st: *mut kiln_stat_t) -> c_int {
    // SAFETY: forwarded contract.
    let Some(fd) = (unsafe { fd.as_ref() }) else {
        return -EINVAL;
    };
    if st.is_null() {
        return -EINVAL;
    }
    match block_on(fd.client.fstat(&fd.fh)) {
        Ok(a) => {
            // SAFETY: checked non-null, writable per the contract.
            unsafe { *st = to_stat(&a) };
            0
        }
        Err(e) => neg(e),
    }
}

/// Removes a file.
///
/// # Safety
/// `k` live and initialised; `path` NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn kiln_unlink(k: *mut Kiln, path: *const c_char) -> c_int {
    // SAFETY: forwarded contract.
    let (Some(k), path) = (unsafe { k.as_ref() }, unsafe { str_arg(path) }) else {
        return -EINVAL;
    };
    match block_on(try_c!(client(k)).unlink(try_c!(path))) {
        Ok(()) => 0,
        Err(e) => neg(e),
    }
}

/// Makes a directory.
///
/// # Safety
/// `k` live and initialised; `path` NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn kiln_mkdir(k: *mut Kiln, path: *const c_char, mode: u32) -> c_int {
    // SAFETY: forwarded contract.
    let (Some(k), path) = (unsafe { k.as_ref() }, unsafe { str_arg(path) }) else {
        return -EINVAL;
    };
    match block_on(try_c!(client(k)).mkdir(try_c!(path), mode)) {
        Ok(_) => 0,
        Err(e) => neg(e),
    }
}

/// Removes an empty directory.
///
/// # Safety
/// `k` live and initialised; `path` NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn kiln_rmdir(k: *mut Kiln, path: *const c_char) -> c_int {
    // SAFETY: forwarded contract.
    let (Some(k), path) = (unsafe { k.as_ref() }, unsafe { str_arg(path) }) else {
        return -EINVAL;
    };
    match block_on(try_c!(client(k)).rmdir(try_c!(path))) {
        Ok(()) => 0,
        Err(e) => neg(e),
    }
}

/// Lists a directory: `cb` runs once per entry (not `.`/`..`) on the calling thread; a
/// non-zero return stops the listing and is returned.
///
/// # Safety
/// `k` live and initialised; `path` NUL-terminated; `cb` valid.
#[no_mangle]
pub unsafe extern "C" fn kiln_readdir(
    k: *mut Kiln,
    path: *const c_char,
    cb: kiln_dirent_cbk,
    user_data: *mut c_void,
) -> c_int {
    // SAFETY: forwarded contract.
    let (Some(k), path, Some(cb)) = (unsafe { k.as_ref() }, unsafe { str_arg(path) }, cb) else {
        return -EINVAL;
    };
    let entries = match block_on(try_c!(client(k)).readdir(try_c!(path))) {
        Ok(e) => e,
        Err(e) => return neg(e),
    };
    for e in entries {
        let Ok(name) = std::ffi::CString::new(e.name) else {
            continue;
        };
        let st = to_stat(&e.attr);
        // SAFETY: valid NUL-terminated name and stat for the duration of the call.
        let r = unsafe { cb(name.as_ptr(), &st, user_data) };
        if r != 0 {
            return r;
        }
    }
    0
}

/// Reads at `offset` into the iovecs, straight from the socket. Returns bytes read (fewer
/// only at end of file) or `-errno`.
///
/// # Safety
/// `fd` live; `iov` points at `iovcnt` iovecs whose buffers are writable.
#[no_mangle]
pub unsafe extern "C" fn kiln_preadv(
    fd: *mut KilnFd,
    iov: *const libc::iovec,
    iovcnt: c_int,
    offset: i64,
) -> isize {
    // SAFETY: forwarded contract; the call waits for completion before returning.
    unsafe { sync_io(fd, iov, iovcnt, offset, false) }
}

/// Writes the iovecs at `offset`, straight from them. Returns bytes written or `-errno`.
///
/// # Safety
/// `fd` live; `iov` points at `iovcnt` iovecs with readable buffers.
#[no_mangle]
pub unsafe extern "C" fn kiln_pwritev(
    fd: *mut KilnFd,
    iov: *const libc::iovec,
    iovcnt: c_int,
    offset: i64,
) -> isize {
    // SAFETY: forwarded contract; the call waits for completion before returning.
    unsafe { sync_io(fd, iov, iovcnt, offset, true) }
}

/// # Safety
/// As for `kiln_preadv` / `kiln_pwritev`.
unsafe fn sync_io(
    fd: *mut KilnFd,
    iov: *const libc::iovec,
    iovcnt: c_int,
    offset: i64,
    write: bool,
) -> isize {
    // SAFETY: forwarded contract.
    let Some(f) = (unsafe { fd.as_ref() }) else {
        return -EINVAL as isize;
    };
    // SAFETY: forwarded contract.
    let v = match unsafe { iov_arg(iov, iovcnt) } {
        Ok(v) => v,
        Err(e) => return e as isize,
    };
    if offset < 0 {
        return -EINVAL as isize;
    }
    let (tx, rx) = mpsc::sync_channel(1);
    let cb = Box::new(move |r: Result<usize, u32>| {
        let _ = tx.send(r);
    });
    // SAFETY: the buffers stay valid: we wait for the completion below.
    unsafe {
        if write {
            f.client.pwritev_raw(&f.fh, &v, offset as u64, cb)
        } else {
            f.client.preadv_raw(&f.fh, &v, offset as u64, cb)
        }
    };
    match rx.recv() {
        Ok(Ok(n)) => n as isize,
        Ok(Err(e)) => -(e as isize),
        Err(_) => -libc::EIO as isize,
    }
}

/// Flushes a file to stable storage.
///
/// # Safety
/// `fd` live.
#[no_mangle]
pub unsafe extern "C" fn kiln_fsync(fd: *mut KilnFd) -> c_int {
    // SAFETY: forwarded contract.
    let Some(f) = (unsafe { fd.as_ref() }) else {
        return -EINVAL;
    };
    match block_on(f.client.fsync(&f.fh, false)) {
        Ok(()) => 0,
        Err(e) => neg(e),
    }
}

/// Builds the completion for an async call: runs `cb` on the receive thread, or queues it.
fn completion(
    f: &KilnFd,
    fd: *mut KilnFd,
    cb: unsafe extern "C" fn(*mut KilnFd, isize, *mut c_void),
    user_data: *mut c_void,
) -> impl FnOnce(isize) + Send + 'static {
    let (fd, ud) = (fd as usize, user_data as usize);
    let mode = f.mode;
    let queue = f.queue.clone();
    move |ret: isize| match mode {
        kiln_completion_mode::KILN_COMPLETE_ON_IO_THREAD => {
            // SAFETY: the caller registered this callback with these arguments.
            unsafe { cb(fd as *mut KilnFd, ret, ud as *mut c_void) }
        }
        kiln_completion_mode::KILN_COMPLETE_BY_POLL => {
            queue.items.locked().push_back(Queued {
                cb,
                fd,
                ret,
                user_data: ud,
            });
            signal(&queue);
        }
    }
}

/// # Safety
/// As for `kiln_preadv_async` / `kiln_pwritev_async`.
unsafe fn async_io(
    fd: *mut KilnFd,
    iov: *const libc::iovec,
    iovcnt: c_int,
    offset: i64,
    cb: kiln_io_cbk,
    user_data: *mut c_void,
    write: bool,
) -> c_int {
    // SAFETY: forwarded contract.
    let (Some(f), Some(cb)) = (unsafe { fd.as_ref() }, cb) else {
        return -EINVAL;
    };
    // SAFETY: forwarded contract.
    let v = try_c!(unsafe { iov_arg(iov, iovcnt) });
    if offset < 0 {
        return -EINVAL;
    }
    let done = completion(f, fd, cb, user_data);
    let cb = Box::new(move |r: Result<usize, u32>| {
        done(r.map(|n| n as isize).unwrap_or_else(|e| -(e as isize)))
    });
    // SAFETY: the caller keeps the buffers valid until the callback (the contract).
    unsafe {
        if write {
            f.client.pwritev_raw(&f.fh, &v, offset as u64, cb)
        } else {
            f.client.preadv_raw(&f.fh, &v, offset as u64, cb)
        }
    };
    0
}

/// Starts a read; `cb(fd, bytes or -errno, user_data)` runs when it completes. Returns 0 once
/// submitted, or `-errno` (and `cb` will not run).
///
/// # Safety
/// `fd` live; the iovec array may be freed on return, but the buffers it points at must stay
/// valid and untouched until `cb` runs.
#[no_mangle]
pub unsafe extern "C" fn kiln_preadv_async(
    fd: *mut KilnFd,
    iov: *const libc::iovec,
    iovcnt: c_int,
    offset: i64,
    cb: kiln_io_cbk,
    user_data: *mut c_void,
) -> c_int {
    // SAFETY: forwarded contract.
    unsafe { async_io(fd, iov, iovcnt, offset, cb, user_data, false) }
}

/// Starts a write; as `kiln_preadv_async`, the buffers must stay valid and unchanged until
/// `cb` runs.
///
/// # Safety
/// As for `kiln_preadv_async`.
#[no_mangle]
pub unsafe extern "C" fn kiln_pwritev_async(
    fd: *mut KilnFd,
    iov: *const libc::iovec,
    iovcnt: c_int,
    offset: i64,
    cb: kiln_io_cbk,
    user_data: *mut c_void,
) -> c_int {
    // SAFETY: forwarded contract.
    unsafe { async_io(fd, iov, iovcnt, offset, cb, user_data, true) }
}

/// Starts an fsync; `cb(fd, 0 or -errno, user_data)` runs when it completes.
///
/// # Safety
/// `fd` live.
#[no_mangle]
pub unsafe extern "C" fn kiln_fsync_async(
    fd: *mut KilnFd,
    cb: kiln_io_cbk,
    user_data: *mut c_void,
) -> c_int {
    // SAFETY: forwarded contract.
    let (Some(f), Some(cb)) = (unsafe { fd.as_ref() }, cb) else {
        return -EINVAL;
    };
    let done = completion(f, fd, cb, user_data);
    f.client.fsync_raw(
        &f.fh,
        false,
        Box::new(move |r| done(r.map(|()| 0).unwrap_or_else(|e| -(e as isize)))),
    );
    0
}
