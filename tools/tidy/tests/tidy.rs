//! The tree's style rules (see `kiln_tidy`), checked on every test run.

use std::collections::BTreeMap;
use std::path::Path;

use kiln_tidy::{functions, is_test_file, sources, MAX_FILE_LINES, MAX_FN_LINES};

/// The repository this run tests. From the environment cargo gives the test, not from where
/// the binary was compiled: one build cache serves every clone on a machine, and a binary
/// built for another clone would read that clone's files.
fn root() -> &'static Path {
    static ROOT: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    ROOT.get_or_init(|| {
        std::path::PathBuf::from(
            std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo test sets CARGO_MANIFEST_DIR"),
        )
        .join("../..")
    })
}

fn rel(p: &Path) -> String {
    p.strip_prefix(root())
        .unwrap_or(p)
        .to_string_lossy()
        .into_owned()
}

/// `path::name` → recorded length, from the allow-list.
fn allowed() -> BTreeMap<String, usize> {
    let text = std::fs::read_to_string(root().join("tools/tidy/long-functions.txt"))
        .expect("tools/tidy/long-functions.txt");
    let mut out = BTreeMap::new();
    for l in text.lines().map(str::trim) {
        if l.is_empty() || l.starts_with('#') {
            continue;
        }
        let mut f = l.split_whitespace();
        let (Some(key), Some(n)) = (f.next(), f.next()) else {
            panic!("long-functions.txt: bad line {l:?}: want PATH::NAME LINES");
        };
        out.insert(key.to_owned(), n.parse().expect("a line count"));
    }
    out
}

#[test]
fn no_source_file_is_over_the_limit() {
    let mut long = Vec::new();
    for p in sources(root()) {
        let n = std::fs::read_to_string(&p)
            .unwrap_or_default()
            .lines()
            .count();
        if n > MAX_FILE_LINES {
            long.push(format!("{} ({n} lines)", rel(&p)));
        }
    }
    assert!(
        long.is_empty(),
        "files over {MAX_FILE_LINES} lines (split them by job): {long:#?}"
    );
}

#[test]
fn no_function_is_over_the_limit_and_the_allow_list_only_shrinks() {
    let allow = allowed();
    let mut seen = BTreeMap::new();
    let mut bad = Vec::new();
    for p in sources(root()) {
        let r = rel(&p);
        if is_test_file(&r) {
            continue;
        }
        let text = std::fs::read_to_string(&p).unwrap_or_default();
        for f in functions(&text).into_iter().filter(|f| !f.test) {
            let key = format!("{r}::{}", f.name);
            if f.lines <= MAX_FN_LINES {
                continue;
            }
            match allow.get(&key) {
                Some(&max) if f.lines == max => {
                    seen.insert(key, f.lines);
                }
                Some(&max) if f.lines < max => {
                    seen.insert(key.clone(), f.lines);
                    bad.push(format!(
                        "{key} shrank to {} lines: record that in tools/tidy/long-functions.txt \
                         (it was {max}) so it cannot grow back",
                        f.lines
                    ));
                }
                Some(&max) => {
                    seen.insert(key.clone(), f.lines);
                    bad.push(format!(
                        "{key} (line {}) grew to {} lines; the allow-list records {max}",
                        f.line, f.lines
                    ));
                }
                None => bad.push(format!("{key} (line {}): {} lines", f.line, f.lines)),
            }
        }
    }
    for key in allow.keys() {
        if !seen.contains_key(key) {
            bad.push(format!(
                "{key} is in tools/tidy/long-functions.txt but is no longer over \
                 {MAX_FN_LINES} lines (or is gone): take it off the list"
            ));
        }
    }
    assert!(
        bad.is_empty(),
        "functions over {MAX_FN_LINES} lines: {bad:#?}"
    );
}

#[test]
fn no_fixme_markers() {
    let marker = ["FIX", "ME"].concat();
    let mut found = Vec::new();
    for p in sources(root()) {
        let text = std::fs::read_to_string(&p).unwrap_or_default();
        for (n, l) in text.lines().enumerate() {
            if l.contains(&marker) {
                found.push(format!("{}:{}", rel(&p), n + 1));
            }
        }
    }
    assert!(found.is_empty(), "{marker} markers: {found:#?}");
}

#[test]
fn a_poisoned_lock_is_taken_one_way() {
    // `kiln_proto::sync` says once why a poisoned lock is taken as it is; nothing else
    // spells it out again.
    let mut found = Vec::new();
    for p in sources(root()) {
        if p.ends_with("crates/proto/src/sync.rs") {
            continue;
        }
        let text = std::fs::read_to_string(&p).unwrap_or_default();
        for (at, _) in text.match_indices("unwrap_or_else(") {
            let before = text[..at].trim_end().trim_end_matches('.');
            if ["lock()", "read()", "write()"]
                .iter()
                .any(|c| before.ends_with(c))
            {
                let line = text[..at].lines().count();
                found.push(format!("{}:{line}", rel(&p)));
            }
        }
        if text.contains(&["fn lock", "<T>("].concat()) {
            found.push(format!("{}: its own lock helper", rel(&p)));
        }
    }
    assert!(
        found.is_empty(),
        "take std locks with kiln_proto::sync's locked(), read_locked(), write_locked(): \
         {found:#?}"
    );
}

#[test]
fn the_scanner_measures_functions_and_skips_tests() {
    let src = "fn a() {\n    let s = \"}\";\n    let c = '}';\n    // }\n}\n\n#[cfg(test)]\nmod tests {\n    fn b() {\n    }\n}\n\ntrait T {\n    fn c(&self);\n    fn d(&self) {\n        x();\n    }\n}\n";
    let f = functions(src);
    let get = |n: &str| f.iter().find(|x| x.name == n).cloned().expect(n);
    assert_eq!(
        (get("a").line, get("a").lines, get("a").test),
        (1, 5, false)
    );
    assert!(get("b").test);
    assert_eq!((get("d").line, get("d").lines), (15, 3));
    assert!(f.iter().all(|x| x.name != "c"));
}

#[test]
fn no_import_cycles_between_modules() {
    let mut found = Vec::new();
    for e in std::fs::read_dir(root().join("crates"))
        .expect("crates/")
        .flatten()
    {
        let src = e.path().join("src");
        if src.is_dir() {
            for c in kiln_tidy::module_cycles(&src) {
                found.push(format!("{}: {}", rel(&e.path()), c.join(" <-> ")));
            }
        }
    }
    assert!(
        found.is_empty(),
        "modules that import each other: {found:#?}"
    );
}

#[test]
fn the_cycle_finder_sees_a_cycle_and_ignores_re_exports() {
    let dir = std::env::temp_dir().join(format!("kiln-tidy-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("m")).unwrap();
    let w = |p: &str, s: &str| std::fs::write(dir.join(p), s).unwrap();
    w("lib.rs", "mod a;\nmod b;\nmod m;\npub use a::A;\n");
    w("a.rs", "use crate::b::B;\npub struct A;\n");
    w(
        "b.rs",
        "pub struct B;\nfn f() { let _ = crate::{a::A, m::x}; }\n",
    );
    w("m/mod.rs", "mod x;\npub use x::X;\n");
    w("m/x.rs", "use super::*;\npub struct X;\n");
    let c = kiln_tidy::module_cycles(&dir);
    assert_eq!(c, vec![vec!["a".to_owned(), "b".to_owned()]], "{c:?}");
    w("b.rs", "pub struct B;\n");
    assert!(kiln_tidy::module_cycles(&dir).is_empty());
    w("m/mod.rs", "mod x;\nuse x::X;\n");
    assert_eq!(
        kiln_tidy::module_cycles(&dir),
        vec![vec!["m".to_owned(), "m::x".to_owned()]]
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
