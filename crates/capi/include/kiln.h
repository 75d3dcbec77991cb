#ifndef KILN_H
#define KILN_H

/* Generated from crates/capi/src/lib.rs by cbindgen; do not edit. Regenerate: KILN_BLESS=1 cargo test -p kiln-capi --test header */

#include <stdint.h>
#include <stddef.h>
#include <sys/types.h>
#include <sys/uio.h>

// How `_async` completions are delivered.
enum kiln_completion_mode
#if defined(__cplusplus) || __STDC_VERSION__ >= 202311L
  : uint32_t
#endif // defined(__cplusplus) || __STDC_VERSION__ >= 202311L
 {
  // Callbacks run on a Kiln thread (the connection's receive thread, or the copy thread
  // for large local short-circuit reads) — or on the calling thread, before the call
  // returns, when the result is there at once (a small short-circuit read, a fast reply).
  // The default.
  KILN_COMPLETE_ON_IO_THREAD = 0,
  // Completions are queued; `kiln_completion_fd` (an eventfd) becomes readable and
  // `kiln_poll_completions` runs them on the calling thread.
  KILN_COMPLETE_BY_POLL = 1,
};
#ifndef __cplusplus
#if __STDC_VERSION__ >= 202311L
typedef enum kiln_completion_mode kiln_completion_mode;
#else
typedef uint32_t kiln_completion_mode;
#endif // __STDC_VERSION__ >= 202311L
#endif // __cplusplus

// A connection to a volume (opaque to C).
typedef struct kiln_t kiln_t;

// An open file (opaque to C).
typedef struct kiln_fd_t kiln_fd_t;

// Options for `kiln_set_options`. Set `struct_size` to `sizeof(kiln_options)`: fields past the
// size a caller was compiled with keep their defaults, so the struct can grow without new
// function names.
typedef struct kiln_options {
  // `sizeof(kiln_options)` as the caller knows it.
  uint32_t struct_size;
  // A `kiln_completion_mode` value.
  uint32_t completion_mode;
} kiln_options;

// File attributes.
typedef struct kiln_stat_t {
  uint64_t st_ino;
  uint32_t st_mode;
  uint32_t st_uid;
  uint32_t st_gid;
  uint32_t st_blksize;
  uint64_t st_nlink;
  uint64_t st_rdev;
  uint64_t st_size;
  uint64_t st_blocks;
  int64_t st_atime_sec;
  uint32_t st_atime_nsec;
  uint32_t st_mtime_nsec;
  int64_t st_mtime_sec;
  int64_t st_ctime_sec;
  uint32_t st_ctime_nsec;
  uint32_t reserved;
} kiln_stat_t;

// One directory entry for `kiln_readdir`; return non-zero to stop the listing.
typedef int (*kiln_dirent_cbk)(const char *name, const struct kiln_stat_t *st, void *user_data);

// Completion of an asynchronous call: the file, the result (bytes or `-errno`) and the
// caller's `user_data`.
typedef void (*kiln_io_cbk)(struct kiln_fd_t *fd, ptrdiff_t ret, void *user_data);

#ifdef __cplusplus
extern "C" {
#endif // __cplusplus

// Creates a handle for volume `volname`. Returns 0 and sets `*out`, or `-errno`.
//
// # Safety
// `volname` is a NUL-terminated string; `out` is writable.
int kiln_new(const char *volname, struct kiln_t **out);

// Names the server: `transport` is "tcp" (with `host` and `port`) or "unix" (`host` is the
// socket path, `port` ignored).
//
// # Safety
// `k` is a live handle; strings are NUL-terminated.
int kiln_set_volfile_server(struct kiln_t *k, const char *transport, const char *host, int port);

// Builds the client stack from a volfile (TOML; distribute, replicate, several bricks)
// instead of the server named by `kiln_set_volfile_server`. Call before `kiln_init`.
//
// # Safety
// `k` is a live handle; `path` is NUL-terminated.
int kiln_set_volfile(struct kiln_t *k, const char *path);

// Applies options (see `kiln_options`). Call before `kiln_init`.
//
// # Safety
// `k` is a live handle; `opts` points at least `opts->struct_size` readable bytes.
int kiln_set_options(struct kiln_t *k, const struct kiln_options *opts);

// Connects to the server. Returns 0 or `-errno` (`-ECONNREFUSED`, `-ENOENT`, …).
//
// # Safety
// `k` is a live handle.
int kiln_init(struct kiln_t *k);

// Opens a volume in one call: `source` is `SERVER:/VOL` (a brick or a server that keeps volume
// definitions: `HOST:PORT:/VOL`, `unix:PATH:/VOL`) or, when it contains no `:/`, the path of
// a volfile. `opts` may be NULL (defaults). Returns 0 and sets `*out` to an initialised handle
// (free it with `kiln_fini`), or `-errno` and leaves `*out` alone.
//
// # Safety
// `source` is NUL-terminated; `opts` is NULL or as for `kiln_set_options`; `out` is writable.
int kiln_volume_open(const char *source, const struct kiln_options *opts, struct kiln_t **out);

// Disconnects and frees the handle. With nothing in flight, the bricks are told this client
// is done (waiting up to a second), so that what it changed leaves nothing for heal to
// suspect. Files still open fail from now on; close them to free them.
//
// # Safety
// `k` is a live handle, not used again.
int kiln_fini(struct kiln_t *k);

// The eventfd that becomes readable when completions are queued (`KILN_COMPLETE_BY_POLL`).
//
// # Safety
// `k` is a live handle.
int kiln_completion_fd(const struct kiln_t *k);

// Runs up to `max` queued completions on the calling thread; returns how many ran.
//
// # Safety
// `k` is a live handle.
int kiln_poll_completions(struct kiln_t *k, int max);

// Opens an existing file with `O_*` flags.
//
// # Safety
// `k` is a live, initialised handle; `path` NUL-terminated; `out` writable.
int kiln_open(struct kiln_t *k, const char *path, int flags, struct kiln_fd_t **out);

// Creates (or opens) a file; with `O_EXCL` only creates.
//
// # Safety
// As for `kiln_open`.
int kiln_creat(struct kiln_t *k,
               const char *path,
               int flags,
               uint32_t mode,
               struct kiln_fd_t **out);

// Closes a file and frees its handle (even when the server cannot be reached).
//
// # Safety
// `fd` is a live file handle with no call in flight, not used again.
int kiln_close(struct kiln_fd_t *fd);

// Attributes of `path` (not following a final symlink).
//
// # Safety
// `k` live and initialised; `path` NUL-terminated; `st` writable.
int kiln_stat(struct kiln_t *k, const char *path, struct kiln_stat_t *st);

// Attributes of an open file.
//
// # Safety
// `fd` live; `st` writable.
int kiln_fstat(struct kiln_fd_t *fd, struct kiln_stat_t *st);

// Removes a file.
//
// # Safety
// `k` live and initialised; `path` NUL-terminated.
int kiln_unlink(struct kiln_t *k, const char *path);

// Makes a directory.
//
// # Safety
// `k` live and initialised; `path` NUL-terminated.
int kiln_mkdir(struct kiln_t *k, const char *path, uint32_t mode);

// Removes an empty directory.
//
// # Safety
// `k` live and initialised; `path` NUL-terminated.
int kiln_rmdir(struct kiln_t *k, const char *path);

// Lists a directory: `cb` runs once per entry (not `.`/`..`) on the calling thread; a
// non-zero return stops the listing and is returned.
//
// # Safety
// `k` live and initialised; `path` NUL-terminated; `cb` valid.
int kiln_readdir(struct kiln_t *k, const char *path, kiln_dirent_cbk cb, void *user_data);

// Reads at `offset` into the iovecs, straight from the socket. Returns bytes read (fewer
// only at end of file) or `-errno`.
//
// # Safety
// `fd` live; `iov` points at `iovcnt` iovecs whose buffers are writable.
ptrdiff_t kiln_preadv(struct kiln_fd_t *fd, const struct iovec *iov, int iovcnt, int64_t offset);

// Writes the iovecs at `offset`, straight from them. Returns bytes written or `-errno`.
//
// # Safety
// `fd` live; `iov` points at `iovcnt` iovecs with readable buffers.
ptrdiff_t kiln_pwritev(struct kiln_fd_t *fd, const struct iovec *iov, int iovcnt, int64_t offset);

// Flushes a file to stable storage.
//
// # Safety
// `fd` live.
int kiln_fsync(struct kiln_fd_t *fd);

// Starts a read; `cb(fd, bytes or -errno, user_data)` runs when it completes. Returns 0 once
// submitted, or `-errno` (and `cb` will not run).
//
// # Safety
// `fd` live; the iovec array may be freed on return, but the buffers it points at must stay
// valid and untouched until `cb` runs.
int kiln_preadv_async(struct kiln_fd_t *fd,
                      const struct iovec *iov,
                      int iovcnt,
                      int64_t offset,
                      kiln_io_cbk cb,
                      void *user_data);

// Starts a write; as `kiln_preadv_async`, the buffers must stay valid and unchanged until
// `cb` runs.
//
// # Safety
// As for `kiln_preadv_async`.
int kiln_pwritev_async(struct kiln_fd_t *fd,
                       const struct iovec *iov,
                       int iovcnt,
                       int64_t offset,
                       kiln_io_cbk cb,
                       void *user_data);

// Starts an fsync; `cb(fd, 0 or -errno, user_data)` runs when it completes.
//
// # Safety
// `fd` live.
int kiln_fsync_async(struct kiln_fd_t *fd, kiln_io_cbk cb, void *user_data);

// Allocates, punches or zeroes `len` bytes at `offset`, as Linux `fallocate(2)` with `mode`
// (`FALLOC_FL_KEEP_SIZE`, `FALLOC_FL_PUNCH_HOLE`, `FALLOC_FL_ZERO_RANGE`, …) does on the
// bricks' file system. Returns 0 or `-errno` (`-EOPNOTSUPP` where the brick's file system
// cannot).
//
// # Safety
// `fd` live.
int kiln_fallocate(struct kiln_fd_t *fd, int mode, int64_t offset, int64_t len);

// Gives the space of `len` bytes at `offset` back: the range becomes a hole that reads as
// zeros, and the file keeps its size. Returns 0 or `-errno`.
//
// # Safety
// `fd` live.
int kiln_discard(struct kiln_fd_t *fd, int64_t offset, int64_t len);

// Reads the file at `path` from its start into `buf`, which holds `len` bytes. Returns the
// file's size, or `-errno`.
//
// When the file fits (its size is at most `len`), all of it is in `buf`, and it came in one
// round trip with the open; a file whose size is over `len` has its first `len` bytes in
// `buf` (read through a handle, then closed), and the size returned tells the caller to
// call again with a bigger buffer. A directory is `-EISDIR`.
//
// # Safety
// `k` is live and initialised; `path` is NUL-terminated; `buf` is writable for `len` bytes
// (it may be null when `len` is 0).
int64_t kiln_read_file(struct kiln_t *k, const char *path, void *buf, size_t len);

#ifdef __cplusplus
}  // extern "C"
#endif  // __cplusplus

#endif  /* KILN_H */
