//! A seeded random-operation exerciser on a real mount, checked against an in-memory model of
//! what every file must contain; and a tree of 10,000 small files copied in with `cp -a` and
//! read back with `find | xargs`, compared by checksum.

use crate::common;

use std::collections::HashMap;
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::FileExt;
use std::process::Command;

use common::{seed, Mounted, Rng};
use kiln_fuse::Mode;

struct Model {
    /// File contents by identity (an inode, in effect).
    files: HashMap<u64, Vec<u8>>,
    /// Names and the identity they point at.
    names: HashMap<String, u64>,
    next: u64,
}

/// Runs `ops` random operations (or `KILN_EXERCISE_OPS`, for long runs by hand).
fn exercise(mode: Mode, ops: usize, test: &str) {
    let ops = std::env::var("KILN_EXERCISE_OPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(ops);
    let s = seed(test);
    let mut rng = Rng(s);
    let m = Mounted::new(mode);
    let mut model = Model {
        files: HashMap::new(),
        names: HashMap::new(),
        next: 1,
    };
    let mut handles: Vec<(u64, File)> = Vec::new();
    let name_of = |rng: &mut Rng| format!("f{}", rng.below(24));
    for op in 0..ops {
        let ctx = format!("seed {s} op {op}");
        match rng.below(9) {
            0 => {
                // Create (or truncate) a file with fresh content.
                let name = name_of(&mut rng);
                let data: Vec<u8> = (0..rng.below(20_000)).map(|_| rng.next() as u8).collect();
                fs::write(m.path(&name), &data)
                    .unwrap_or_else(|e| panic!("{ctx}: create {name}: {e}"));
                let id = match model.names.get(&name) {
                    Some(&id) => id,
                    None => {
                        model.next += 1;
                        model.names.insert(name.clone(), model.next);
                        model.next
                    }
                };
                model.files.insert(id, data);
            }
            1 | 2 => {
                // Write at an offset through an open handle or a new one.
                let (id, f) = if !handles.is_empty() && rng.below(2) == 0 {
                    let k = rng.below(handles.len() as u64) as usize;
                    (handles[k].0, &handles[k].1)
                } else {
                    let name = name_of(&mut rng);
                    let Some(&id) = model.names.get(&name) else {
                        continue;
                    };
                    let f = OpenOptions::new()
                        .read(true)
                        .write(true)
                        .open(m.path(&name))
                        .unwrap_or_else(|e| panic!("{ctx}: open {name}: {e}"));
                    if handles.len() < 6 {
                        handles.push((id, f));
                        let k = handles.len() - 1;
                        (id, &handles[k].1)
                    } else {
                        handles[0] = (id, f);
                        (id, &handles[0].1)
                    }
                };
                let off = rng.below(30_000) as usize;
                let data: Vec<u8> = (0..1 + rng.below(9_000))
                    .map(|_| rng.next() as u8)
                    .collect();
                f.write_all_at(&data, off as u64)
                    .unwrap_or_else(|e| panic!("{ctx}: write: {e}"));
                let content = model.files.get_mut(&id).expect("model file");
                if content.len() < off + data.len() {
                    content.resize(off + data.len(), 0);
                }
                content[off..off + data.len()].copy_from_slice(&data);
            }
            3 | 4 => {
                // Read a whole file by name, or through an open handle (even if unlinked).
                let (id, got) = if !handles.is_empty() && rng.below(2) == 0 {
                    let k = rng.below(handles.len() as u64) as usize;
                    let mut f = &handles[k].1;
                    let mut v = Vec::new();
                    f.seek(SeekFrom::Start(0)).expect("seek");
                    f.read_to_end(&mut v)
                        .unwrap_or_else(|e| panic!("{ctx}: read handle: {e}"));
                    (handles[k].0, v)
                } else {
                    let name = name_of(&mut rng);
                    match model.names.get(&name) {
                        Some(&id) => (
                            id,
                            fs::read(m.path(&name))
                                .unwrap_or_else(|e| panic!("{ctx}: read {name}: {e}")),
                        ),
                        None => {
                            assert!(
                                fs::metadata(m.path(&name)).is_err(),
                                "{ctx}: {name} should not exist"
                            );
                            continue;
                        }
                    }
                };
                let want = &model.files[&id];
                assert!(
                    got == *want,
                    "{ctx}: content of file {id} differs: got {} bytes, want {}",
                    got.len(),
                    want.len()
                );
            }
            5 => {
                // Truncate.
                let name = name_of(&mut rng);
                let Some(&id) = model.names.get(&name) else {
                    continue;
                };
                let len = rng.below(25_000) as usize;
                OpenOptions::new()
                    .write(true)
                    .open(m.path(&name))
                    .and_then(|f| f.set_len(len as u64))
                    .unwrap_or_else(|e| panic!("{ctx}: truncate {name}: {e}"));
                model.files.get_mut(&id).expect("file").resize(len, 0);
            }
            6 => {
                // Rename, possibly over an existing name.
                let (a, b) = (name_of(&mut rng), name_of(&mut rng));
                let Some(&id) = model.names.get(&a) else {
                    continue;
                };
                if a == b {
                    continue;
                }
                fs::rename(m.path(&a), m.path(&b))
                    .unwrap_or_else(|e| panic!("{ctx}: rename {a} {b}: {e}"));
                model.names.remove(&a);
                model.names.insert(b, id);
            }
            7 => {
                // Unlink (open handles keep the content).
                let name = name_of(&mut rng);
                let Some(id) = model.names.remove(&name) else {
                    continue;
                };
                fs::remove_file(m.path(&name))
                    .unwrap_or_else(|e| panic!("{ctx}: unlink {name}: {e}"));
                let _ = id;
            }
            _ => {
                // fsync an open handle, or drop one.
                if let Some((_, f)) = handles.last() {
                    f.sync_all().unwrap_or_else(|e| panic!("{ctx}: fsync: {e}"));
                }
                if rng.below(3) == 0 && !handles.is_empty() {
                    handles.remove(0);
                }
            }
        }
    }
    drop(handles);
    // Finally every name holds exactly what the model says, on the mount and on the brick.
    for (name, id) in &model.names {
        assert!(
            fs::read(m.path(name)).expect("final read") == model.files[id],
            "seed {s}: final content of {name}"
        );
        assert!(
            fs::read(m.brick().join(name)).expect("brick read") == model.files[id],
            "seed {s}: brick content of {name}"
        );
    }
    let on_mount = fs::read_dir(m.mnt()).expect("readdir").count();
    assert_eq!(
        on_mount,
        model.names.len(),
        "seed {s}: the mount lists exactly the model's names"
    );
}

#[test]
fn random_operations_match_the_model_in_general_mode() {
    exercise(
        Mode::General,
        3000,
        "random_operations_match_the_model_in_general_mode",
    );
}

#[test]
fn random_operations_match_the_model_in_vm_image_mode() {
    exercise(
        Mode::VmImage,
        2000,
        "random_operations_match_the_model_in_vm_image_mode",
    );
}

fn checksums(dir: &std::path::Path) -> String {
    let out = Command::new("sh")
        .arg("-c")
        .arg("find . -type f -print0 | sort -z | xargs -0 cat | sha256sum && find . -type f -print0 | sort -z | xargs -0 sha256sum | sha256sum && find . | sort | wc -l")
        .current_dir(dir)
        .output()
        .expect("run find | xargs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf8")
}

#[test]
fn ten_thousand_small_files_copy_in_and_read_back() {
    let src = tempfile::tempdir().expect("src");
    let mut rng = Rng(seed("ten_thousand_small_files_copy_in_and_read_back"));
    for d in 0..20 {
        let dir = src.path().join(format!("dir{d:02}"));
        fs::create_dir(&dir).expect("mkdir");
        for f in 0..500 {
            let len = rng.below(4096) as usize;
            let data: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
            File::create(dir.join(format!("file{f:03}.txt")))
                .and_then(|mut h| h.write_all(&data))
                .expect("write");
        }
    }
    let m = Mounted::new(Mode::General);
    let st = Command::new("cp")
        .arg("-a")
        .arg(src.path())
        .arg(m.path("tree"))
        .status()
        .expect("cp -a");
    assert!(st.success(), "cp -a into the mount failed");
    let want = checksums(src.path());
    assert!(
        want.trim_end().ends_with("10021"),
        "10,000 files, 20 dirs and the root: {want}"
    );
    assert_eq!(
        checksums(&m.path("tree")),
        want,
        "the tree read back through the mount differs"
    );
    assert_eq!(
        checksums(&m.brick().join("tree")),
        want,
        "the brick's copy differs"
    );
}
