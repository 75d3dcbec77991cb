//! Gives libkiln.so its SONAME, libkiln.so.0: programs linked against it record that name, so
//! a package can install libkiln.so.0.1.0 beside older majors and upgrade it in place.

fn main() {
    // The major version of the C ABI (kiln.h); bump it with any incompatible change.
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libkiln.so.0");
}
