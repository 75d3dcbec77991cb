//! Kiln's tidy checks, run by `cargo test -p kiln-tidy` (and so by `scripts/test.sh`):
//!
//! - no Rust source file over [`MAX_FILE_LINES`] lines;
//! - no function outside test code over [`MAX_FN_LINES`] lines, except those in
//!   `tools/tidy/long-functions.txt`, an allow-list that only shrinks: a listed function must
//!   have exactly its recorded length (a shorter one lowers the record, so it cannot grow
//!   back), and one that is no longer long must leave the list;
//! - no fix-me marker (the word in capitals): write the fix, or an issue, instead.
//!
//! The function scanner is a line-based brace counter that skips comments, strings and
//! character literals: good enough for rustfmt-formatted code, which is all the tree holds.
#![warn(missing_docs)]

use std::path::{Path, PathBuf};

/// The most lines a source file may have.
pub const MAX_FILE_LINES: usize = 1000;
/// The most lines a non-test function may have.
pub const MAX_FN_LINES: usize = 100;

/// A function found in a file: its name, first line (1-based) and length in lines.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Func {
    /// The function's name.
    pub name: String,
    /// The line of its `fn` keyword.
    pub line: usize,
    /// Lines from the `fn` line to the closing brace, inclusive.
    pub lines: usize,
    /// True inside `#[cfg(test)]` code or a `#[test]` function.
    pub test: bool,
}

/// Every `.rs` file beneath `root`'s `crates`, `bench`, `fuzz` and `tools` folders (build
/// output and hidden folders skipped), sorted.
pub fn sources(root: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for top in ["crates", "bench", "fuzz", "tools"] {
        walk(&root.join(top), &mut out);
    }
    out.sort();
    out
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for e in rd.flatten() {
        let p = e.path();
        let name = e.file_name();
        let name = name.to_string_lossy();
        if name.starts_with('.') || name == "target" || name == "artifacts" || name == "corpus" {
            continue;
        }
        if p.is_dir() {
            walk(&p, out);
        } else if name.ends_with(".rs") {
            out.push(p);
        }
    }
}

/// `line` with comments, string and char literal contents blanked, carrying block-comment
/// and string state across lines.
struct Scrubber {
    in_block: usize,
    in_str: bool,
    raw_hashes: Option<usize>,
}

impl Scrubber {
    fn scrub(&mut self, line: &str) -> String {
        let b = line.as_bytes();
        let mut out = String::with_capacity(b.len());
        let mut i = 0;
        while i < b.len() {
            let c = b[i];
            if self.in_block > 0 {
                if b[i..].starts_with(b"*/") {
                    self.in_block -= 1;
                    i += 2;
                } else if b[i..].starts_with(b"/*") {
                    self.in_block += 1;
                    i += 2;
                } else {
                    i += 1;
                }
                continue;
            }
            if let Some(h) = self.raw_hashes {
                if c == b'"' && b[i + 1..].iter().take(h).filter(|&&x| x == b'#').count() == h {
                    self.raw_hashes = None;
                    out.push('"');
                    i += 1 + h;
                } else {
                    i += 1;
                }
                continue;
            }
            if self.in_str {
                if c == b'\\' {
                    i += 2;
                } else {
                    if c == b'"' {
                        self.in_str = false;
                        out.push('"');
                    }
                    i += 1;
                }
                continue;
            }
            if b[i..].starts_with(b"//") {
                break;
            }
            if b[i..].starts_with(b"/*") {
                self.in_block = 1;
                i += 2;
                continue;
            }
            if c == b'r' && (b.get(i + 1) == Some(&b'"') || b.get(i + 1) == Some(&b'#')) {
                let h = b[i + 1..].iter().take_while(|&&x| x == b'#').count();
                if b.get(i + 1 + h) == Some(&b'"') {
                    self.raw_hashes = Some(h);
                    out.push('"');
                    i += 2 + h;
                    continue;
                }
            }
            if c == b'"' {
                self.in_str = true;
                out.push('"');
                i += 1;
                continue;
            }
            if c == b'\'' {
                // A char literal ('x', '\n', '\u{..}') or a lifetime ('a): blank a literal.
                let rest = &b[i + 1..];
                let lit = match rest {
                    [b'\\', ..] => rest.iter().skip(1).position(|&x| x == b'\'').map(|p| p + 2),
                    [_, b'\'', ..] => Some(2),
                    _ => None,
                };
                if let Some(n) = lit {
                    out.push_str("' '");
                    i += 1 + n;
                    continue;
                }
            }
            out.push(c as char);
            i += 1;
        }
        out
    }
}

/// The functions of a Rust source text.
pub fn functions(text: &str) -> Vec<Func> {
    let mut sc = Scrubber {
        in_block: 0,
        in_str: false,
        raw_hashes: None,
    };
    let lines: Vec<String> = text.lines().map(|l| sc.scrub(l)).collect();
    let raw: Vec<&str> = text.lines().collect();
    // Depths at which test code (a #[cfg(test)] item or a #[test] fn) began.
    let mut test_depth: Vec<i64> = Vec::new();
    let mut pending_test_attr = false;
    // Open functions: (name, first line, depth before its body, test).
    let mut open: Vec<(String, usize, i64, bool)> = Vec::new();
    let mut waiting: Option<(String, usize, bool)> = None;
    let mut depth: i64 = 0;
    let mut out = Vec::new();
    for (n, l) in lines.iter().enumerate() {
        let t = raw[n].trim_start();
        if t.starts_with("#[cfg(test)]")
            || t.starts_with("#[test]")
            || t.starts_with("#[tokio::test")
        {
            pending_test_attr = true;
        }
        if let Some(name) = fn_name(l) {
            let test = pending_test_attr || !test_depth.is_empty();
            waiting = Some((name, n + 1, test));
        }
        for ch in l.chars() {
            match ch {
                '{' => {
                    if let Some((name, line, test)) = waiting.take() {
                        open.push((name, line, depth, test));
                    }
                    if pending_test_attr {
                        test_depth.push(depth);
                        pending_test_attr = false;
                    }
                    depth += 1;
                }
                '}' => {
                    depth -= 1;
                    if test_depth.last() == Some(&depth) {
                        test_depth.pop();
                    }
                    if open.last().is_some_and(|o| o.2 == depth) {
                        let (name, line, _, test) = open.pop().expect("checked");
                        out.push(Func {
                            name,
                            line,
                            lines: n + 2 - line,
                            test,
                        });
                    }
                }
                ';' => {
                    // A declaration without a body (a trait method), or an attributed item
                    // that ended: nothing is waiting any more.
                    if waiting.is_some() && !l.contains('{') {
                        waiting = None;
                    }
                    if pending_test_attr && !t.starts_with("#[") {
                        pending_test_attr = false;
                    }
                }
                _ => {}
            }
        }
    }
    out
}

/// The name after `fn ` when the line declares a function.
fn fn_name(scrubbed: &str) -> Option<String> {
    let mut words = scrubbed.split_whitespace().peekable();
    while let Some(w) = words.next() {
        let w = w
            .trim_start_matches("pub(crate)")
            .trim_start_matches("pub(super)");
        if w == "fn" {
            let name: String = words
                .next()?
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            return (!name.is_empty()).then_some(name);
        }
        if !matches!(
            w,
            "" | "pub" | "async" | "const" | "unsafe" | "extern" | "\"C\"" | "\" \"" | "default"
        ) {
            return None;
        }
    }
    None
}

/// True for a file that is test code as a whole (integration tests, test modules).
pub fn is_test_file(rel: &str) -> bool {
    rel.contains("/tests/") || rel.ends_with("/tests.rs")
}

/// The import cycles among the modules of the crate whose sources are under `src`: each
/// strongly connected group of two or more modules (named `a::b`, the root `crate`), where a
/// module imports another when its file names it through a `crate::`, `super::` or
/// `use child::` path. A module root declaring (`mod x;`) and re-exporting (`pub use`) its
/// children does not count; using their items does. Inline `#[cfg(test)] mod tests` blocks
/// (whose `super` is the file itself) are left out.
pub fn module_cycles(src: &Path) -> Vec<Vec<String>> {
    let mut files = Vec::new();
    walk(src, &mut files);
    let module = |p: &Path| -> Vec<String> {
        let rel = p.strip_prefix(src).unwrap_or(p).with_extension("");
        let mut parts: Vec<String> = rel
            .components()
            .map(|c| c.as_os_str().to_string_lossy().into_owned())
            .collect();
        if matches!(
            parts.last().map(String::as_str),
            Some("lib" | "main" | "mod")
        ) {
            parts.pop();
        }
        parts
    };
    let mods: Vec<Vec<String>> = files.iter().map(|f| module(f)).collect();
    let known = |path: &[String]| -> Option<usize> {
        (0..=path.len())
            .rev()
            .find_map(|n| mods.iter().position(|m| m[..] == path[..n]))
    };
    let mut edges: Vec<Vec<usize>> = vec![Vec::new(); files.len()];
    for (i, f) in files.iter().enumerate() {
        let text = std::fs::read_to_string(f).unwrap_or_default();
        let is_root = f
            .file_name()
            .is_some_and(|n| n == "lib.rs" || n == "mod.rs" || n == "main.rs");
        let here = &mods[i];
        let parent: Vec<String> = here[..here.len().saturating_sub(1)].to_vec();
        for path in import_paths(&text) {
            let (start, rest): (Vec<String>, &[String]) = match path.first().map(String::as_str) {
                Some("crate") => (Vec::new(), &path[1..]),
                Some("super") => (parent.clone(), &path[1..]),
                Some(child)
                    if is_root
                        && mods.iter().any(|m| {
                            m.len() == here.len() + 1
                                && m.starts_with(here)
                                && m.last().is_some_and(|l| l == child)
                        }) =>
                {
                    (here.clone(), &path[..])
                }
                _ => continue,
            };
            let mut full = start;
            full.extend(rest.iter().filter(|s| *s != "*").cloned());
            if let Some(j) = known(&full) {
                if j != i && !edges[i].contains(&j) {
                    edges[i].push(j);
                }
            }
        }
    }
    let name = |m: &Vec<String>| {
        if m.is_empty() {
            "crate".to_owned()
        } else {
            m.join("::")
        }
    };
    strongly_connected(&edges)
        .into_iter()
        .filter(|c| c.len() > 1)
        .map(|c| {
            let mut v: Vec<String> = c.iter().map(|&i| name(&mods[i])).collect();
            v.sort();
            v
        })
        .collect()
}

/// The `crate::…`, `super::…` and `use x::…` paths of a file, as segments (a brace group
/// `p::{a, b::c}` gives `p::a` and `p::b::c`); comments, re-exports and the inline test
/// module are left out.
fn import_paths(text: &str) -> Vec<Vec<String>> {
    let body = text
        .split("#[cfg(test)]\nmod tests {")
        .next()
        .unwrap_or(text);
    let mut code = String::new();
    let mut in_pub_use = false;
    for line in body.lines() {
        let line = line.split("//").next().unwrap_or("");
        let t = line.trim_start();
        if t.starts_with("pub use ") || t.starts_with("pub(crate) use ") || in_pub_use {
            in_pub_use = !line.contains(';');
            continue;
        }
        code.push_str(line);
        code.push('\n');
    }
    let mut out = Vec::new();
    let word = |c: char| c.is_alphanumeric() || c == '_';
    let b = code.as_bytes();
    let mut i = 0;
    while i < b.len() {
        let at_start = i == 0 || !word(b[i - 1] as char) && b[i - 1] != b':';
        let rest = &code[i..];
        let lead = ["crate::", "super::"]
            .into_iter()
            .find(|l| rest.starts_with(l));
        let used = rest.strip_prefix("use ").filter(|_| at_start);
        if let (true, Some(l)) = (at_start, lead) {
            out.extend(expand(&l[..l.len() - 2], &rest[l.len()..]));
            i += l.len();
        } else if let Some(u) = used {
            let u = u.trim_start();
            if !u.starts_with("crate::") && !u.starts_with("super::") && !u.starts_with("std") {
                if let Some((first, after)) = u.split_once("::") {
                    if first.chars().all(word) {
                        out.extend(expand(first, after));
                    }
                }
            }
            i += 4;
        } else {
            i += rest.chars().next().map_or(1, char::len_utf8);
        }
    }
    out
}

/// `lead::rest…` as paths: segments up to the first character that is not part of a path, and
/// one level of `{a, b::c}`.
fn expand(lead: &str, rest: &str) -> Vec<Vec<String>> {
    let word = |c: char| c.is_alphanumeric() || c == '_' || c == '*';
    let mut segs = vec![lead.to_owned()];
    let mut r = rest;
    loop {
        if let Some(inner) = r.strip_prefix('{') {
            let group = inner.split('}').next().unwrap_or("");
            return group
                .split(',')
                .filter_map(|item| {
                    let item = item.split(" as ").next().unwrap_or("").trim();
                    let mut v = segs.clone();
                    v.extend(
                        item.split("::")
                            .map(str::trim)
                            .filter(|s| !s.is_empty() && *s != "self")
                            .map(str::to_owned),
                    );
                    (!item.is_empty()).then_some(v)
                })
                .collect();
        }
        let n = r.find(|c: char| !word(c)).unwrap_or(r.len());
        if n == 0 {
            break;
        }
        segs.push(r[..n].to_owned());
        r = &r[n..];
        match r.strip_prefix("::") {
            Some(next) => r = next,
            None => break,
        }
    }
    vec![segs]
}

/// Tarjan's strongly connected components of a graph given as adjacency lists.
fn strongly_connected(edges: &[Vec<usize>]) -> Vec<Vec<usize>> {
    struct T<'a> {
        e: &'a [Vec<usize>],
        index: Vec<Option<usize>>,
        low: Vec<usize>,
        on: Vec<bool>,
        stack: Vec<usize>,
        next: usize,
        out: Vec<Vec<usize>>,
    }
    fn visit(t: &mut T<'_>, v: usize) {
        t.index[v] = Some(t.next);
        t.low[v] = t.next;
        t.next += 1;
        t.stack.push(v);
        t.on[v] = true;
        for &w in &t.e[v] {
            match t.index[w] {
                None => {
                    visit(t, w);
                    t.low[v] = t.low[v].min(t.low[w]);
                }
                Some(iw) if t.on[w] => t.low[v] = t.low[v].min(iw),
                Some(_) => {}
            }
        }
        if Some(t.low[v]) == t.index[v] {
            let mut comp = Vec::new();
            while let Some(w) = t.stack.pop() {
                t.on[w] = false;
                comp.push(w);
                if w == v {
                    break;
                }
            }
            t.out.push(comp);
        }
    }
    let n = edges.len();
    let mut t = T {
        e: edges,
        index: vec![None; n],
        low: vec![0; n],
        on: vec![false; n],
        stack: Vec::new(),
        next: 0,
        out: Vec::new(),
    };
    for v in 0..n {
        if t.index[v].is_none() {
            visit(&mut t, v);
        }
    }
    t.out
}
