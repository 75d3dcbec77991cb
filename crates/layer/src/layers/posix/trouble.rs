//! Storage errors an operator must hear of: the brick's file system is full (ENOSPC,
//! EDQUOT), failing (EIO) or read-only (EROFS). Each is counted (for `/metrics`) and logged
//! once per file and error per minute, so a full disk is seen in the brick's log without
//! one line per write.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use kiln_proto::sync::MutexExt as _;

/// The errors watched, with their names.
const WATCHED: [(u32, &str); 4] = [
    (libc::ENOSPC as u32, "ENOSPC"),
    (libc::EDQUOT as u32, "EDQUOT"),
    (libc::EIO as u32, "EIO"),
    (libc::EROFS as u32, "EROFS"),
];
/// How often one file's error is logged at most.
const LOG_EVERY: Duration = Duration::from_secs(60);
/// Files remembered for the log limit; the table is emptied past this.
const KEEP: usize = 4096;

static COUNTS: [AtomicU64; 4] = [const { AtomicU64::new(0) }; 4];
static LOGGED: Mutex<Option<HashMap<(String, u32), Instant>>> = Mutex::new(None);

/// Notes that a storage call on `file` failed with `e` (nothing happens for other errors).
pub fn observe(e: u32, file: &str) {
    let Some(i) = WATCHED.iter().position(|(w, _)| *w == e) else {
        return;
    };
    COUNTS[i].fetch_add(1, Relaxed);
    let now = Instant::now();
    let mut logged = LOGGED.locked();
    let map = logged.get_or_insert_with(HashMap::new);
    let key = (file.to_owned(), e);
    if map
        .get(&key)
        .is_some_and(|t| now.duration_since(*t) < LOG_EVERY)
    {
        return;
    }
    if map.len() >= KEEP {
        map.clear();
    }
    map.insert(key, now);
    let name = WATCHED[i].1;
    tracing::error!(
        file,
        errno = name,
        "brick storage error {name} on {file:?} (the brick's file system is full, failing or \
         read-only; logged once a minute per file)"
    );
}

/// True the first time `key` is seen in a minute (and then not again until a minute has
/// passed): for logs that must not repeat once per request.
pub fn first_in_a_minute(key: &str) -> bool {
    let now = Instant::now();
    let mut logged = LOGGED.locked();
    let map = logged.get_or_insert_with(HashMap::new);
    let key = (key.to_owned(), 0);
    if map
        .get(&key)
        .is_some_and(|t| now.duration_since(*t) < LOG_EVERY)
    {
        return false;
    }
    if map.len() >= KEEP {
        map.clear();
    }
    map.insert(key, now);
    true
}

/// Storage errors so far, by name.
pub fn counts() -> Vec<(&'static str, u64)> {
    WATCHED
        .iter()
        .zip(&COUNTS)
        .map(|((_, n), c)| (*n, c.load(Relaxed)))
        .collect()
}

/// Adds the counters to a `/metrics` scrape.
pub fn render(out: &mut crate::metrics::Scrape) {
    let f = out.counter(
        "kiln_brick_storage_errors",
        "Storage calls on the brick that failed with ENOSPC, EDQUOT, EIO or EROFS.",
    );
    for (e, n) in counts() {
        f.count(&[("errno", e)], n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counted_every_time_logged_once_a_minute() {
        let before = counts();
        observe(libc::ENOSPC as u32, "a");
        observe(libc::ENOSPC as u32, "a");
        observe(libc::ENOENT as u32, "a");
        let after = counts();
        assert_eq!(after[0].1 - before[0].1, 2, "ENOSPC counted twice");
        assert_eq!(
            after.iter().map(|c| c.1).sum::<u64>() - before.iter().map(|c| c.1).sum::<u64>(),
            2
        );
        let logged = LOGGED.lock().unwrap();
        assert!(logged
            .as_ref()
            .unwrap()
            .contains_key(&("a".to_owned(), libc::ENOSPC as u32)));
        let mut out = crate::metrics::Scrape::default();
        drop(logged);
        render(&mut out);
        let out = out.encode();
        assert!(out.contains("kiln_brick_storage_errors_total{errno=\"ENOSPC\"}"));
    }
}
