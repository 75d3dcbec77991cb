//! Builds the C tests against libkiln.so and kiln.h and runs them against a live brick server,
//! under AddressSanitizer.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Where cargo put libkiln.so for this test run: target/<profile>/deps (beside this test
/// binary) during `cargo test`, target/<profile> after a plain build.
fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test exe");
    let deps = exe.parent().expect("deps dir").to_owned();
    if deps.join("libkiln.so").exists() {
        return deps;
    }
    deps.parent().expect("target/<profile>").to_owned()
}

/// Starts a brick server in this process on a temporary directory; returns its Unix socket
/// path and TCP port.
fn start_server(dir: &Path) -> (PathBuf, u16) {
    let sock = dir.join("kilnd.sock");
    let brick = dir.join("brick");
    std::fs::create_dir(&brick).expect("brick");
    let listen = [
        kiln_server::Listen::Unix(sock.clone()),
        kiln_server::Listen::Tcp("127.0.0.1:0".parse().expect("addr")),
    ];
    let server = kiln_server::spawn_background(&brick, &listen).expect("brick server");
    let port = server
        .addrs
        .iter()
        .find_map(|a| match a {
            kiln_server::Listen::Tcp(a) => Some(a.port()),
            _ => None,
        })
        .expect("tcp port");
    (sock, port)
}

#[test]
fn c_tests_pass_under_asan() {
    let dir = tempfile::tempdir().expect("tempdir");
    let lib_dir = target_dir();
    assert!(
        lib_dir.join("libkiln.so").exists(),
        "libkiln.so not built in {}",
        lib_dir.display()
    );
    // Laid out as a package installs it: the linker takes libkiln.so, programs then load the
    // library by its SONAME, libkiln.so.0.
    let libs = dir.path().join("lib");
    std::fs::create_dir(&libs).expect("lib dir");
    for name in ["libkiln.so", "libkiln.so.0"] {
        std::os::unix::fs::symlink(lib_dir.join("libkiln.so"), libs.join(name)).expect("link");
    }
    let lib_dir = libs;
    let manifest = &std::path::PathBuf::from(
        std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo test sets CARGO_MANIFEST_DIR"),
    );
    let exe = dir.path().join("kiln_test");
    let out = Command::new("cc")
        .args([
            "-std=c11",
            "-D_GNU_SOURCE",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-g",
            "-fsanitize=address,undefined",
            "-fno-omit-frame-pointer",
        ])
        .arg("-I")
        .arg(manifest.join("include"))
        .arg(manifest.join("tests/c/kiln_test.c"))
        .arg("-o")
        .arg(&exe)
        .arg(format!("-L{}", lib_dir.display()))
        .arg(format!("-Wl,-rpath,{}", lib_dir.display()))
        .args(["-lkiln", "-lpthread"])
        .output()
        .expect("run cc");
    assert!(
        out.status.success(),
        "compiling the C test failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let dynamic = Command::new("readelf")
        .arg("-d")
        .arg(&exe)
        .output()
        .expect("run readelf");
    let dynamic = String::from_utf8_lossy(&dynamic.stdout);
    assert!(
        dynamic.contains("Shared library: [libkiln.so.0]"),
        "the test program should need libkiln by its SONAME:\n{dynamic}"
    );

    let (sock, port) = start_server(dir.path());
    // A second brick, and a volfile that distributes over both (for kiln_volume_open).
    let sock2 = dir.path().join("kilnd2.sock");
    std::fs::create_dir(dir.path().join("brick2")).expect("brick2");
    let _second = kiln_server::spawn_background(
        &dir.path().join("brick2"),
        &[kiln_server::Listen::Unix(sock2.clone())],
    )
    .expect("second brick");
    let volfile = dir.path().join("dist.toml");
    std::fs::write(
        &volfile,
        format!(
            "[[layer]]\nname = \"capi\"\ntype = \"io-stats\"\n\n\
             [[layer]]\nname = \"capi-dist\"\ntype = \"distribute\"\nsubvolumes = [\"capi-b1\", \"capi-b2\"]\n\n\
             [[layer]]\nname = \"capi-b1\"\ntype = \"protocol-client\"\nremote = \"unix:{}\"\n\n\
             [[layer]]\nname = \"capi-b2\"\ntype = \"protocol-client\"\nremote = \"unix:{}\"\n",
            sock.display(),
            sock2.display()
        ),
    )
    .expect("volfile");
    for args in [
        vec![
            "unix".to_owned(),
            sock.display().to_string(),
            "0".to_owned(),
            volfile.display().to_string(),
        ],
        vec!["tcp".into(), "127.0.0.1".into(), port.to_string()],
    ] {
        let out = Command::new(&exe)
            .args(&args)
            // Leak checking included: every handle the test opens it also frees.
            .env("ASAN_OPTIONS", "detect_leaks=1:abort_on_error=0")
            .env("UBSAN_OPTIONS", "halt_on_error=1:print_stacktrace=1")
            .output()
            .expect("run the C test");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "C test over {} failed:\n{stdout}\n{stderr}",
            args[0]
        );
        assert!(
            stdout.contains(" passed, 0 failed"),
            "C test printed {stdout:?}"
        );
        eprintln!("C test over {}: {}", args[0], stdout.trim());
    }
}
