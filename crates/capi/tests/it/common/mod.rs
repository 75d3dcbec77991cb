//! What the libkiln tests share: a handle connected to a brick over its Unix socket.

use std::ffi::{c_char, CString};
use std::path::Path;
use std::ptr::null_mut;

use kiln::{kiln_init, kiln_new, kiln_set_volfile_server, Kiln};

/// A `kiln_t` for volume "vol" on the brick at Unix socket `sock`, initialised; the caller
/// ends it with `kiln_fini`.
pub fn connect(sock: &Path) -> *mut Kiln {
    let mut k: *mut Kiln = null_mut();
    let sock = CString::new(sock.to_str().unwrap()).unwrap();
    // SAFETY: NUL-terminated strings; `k` is written by kiln_new and live until kiln_fini.
    unsafe {
        assert_eq!(kiln_new(c"vol".as_ptr() as *const c_char, &mut k), 0);
        assert_eq!(
            kiln_set_volfile_server(k, c"unix".as_ptr(), sock.as_ptr(), 0),
            0
        );
        assert_eq!(kiln_init(k), 0);
    }
    k
}
