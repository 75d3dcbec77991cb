//! The committed kiln.h is exactly what cbindgen generates from the code (no drift).
//! After changing the C ABI, regenerate with: KILN_BLESS=1 cargo test -p kiln-capi --test header

#[test]
fn header_matches_the_code() {
    let crate_dir = &std::path::PathBuf::from(
        std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo test sets CARGO_MANIFEST_DIR"),
    );
    let config =
        cbindgen::Config::from_file(crate_dir.join("cbindgen.toml")).expect("cbindgen.toml");
    let bindings = cbindgen::Builder::new()
        .with_crate(crate_dir)
        .with_config(config)
        .generate()
        .expect("generate the header");
    let mut generated = Vec::new();
    bindings.write(&mut generated);
    let path = crate_dir.join("include/kiln.h");
    if std::env::var_os("KILN_BLESS").is_some() {
        std::fs::write(&path, &generated).expect("write kiln.h");
        return;
    }
    let committed = std::fs::read(&path).expect("include/kiln.h");
    assert!(
        committed == generated,
        "include/kiln.h is out of date with crates/capi/src/lib.rs; regenerate with KILN_BLESS=1 cargo test -p kiln-capi --test header"
    );
}
