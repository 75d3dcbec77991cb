//! What a command that prints and ends shows: text for a person, or with `--json` one JSON
//! object per run in the same envelope for every command — `{"ok": true, …the result's
//! fields}` when it succeeded, `{"ok": false, "error": "…"}` when it did not (printed by
//! `main`, which also sets the exit status; see [`EXIT_STATUS`]). Progress goes to stderr.

use std::sync::atomic::{AtomicBool, Ordering};

use serde::Serialize;

/// The exit statuses, as `kiln --help` and the man page state them.
pub const EXIT_STATUS: &str = "\
Exit status:
  0  the command did what was asked
  1  it failed: the reason is on stderr (and, with --json, in {\"ok\": false, \"error\": …});
     a value refused after parsing (a volume option's, a brick's path) is such a failure
  2  the command line was wrong (unknown command or option, a value of the wrong type);
     with --json the usage error is printed as {\"ok\": false, \"error\": …} too
Servers, mounts and exports (server, mount, nbd, vhost-user-blk) exit 0 when stopped by
SIGTERM or `kiln umount`, 1 when they cannot start or their service fails.

--json is taken by every command that prints a result and ends (volume, peer, pool, image,
tls, generate, umount, bench, demo); servers, mounts and exports write a log instead.";

/// Whether this run printed its envelope already (`main` then prints no second one).
static PRINTED: AtomicBool = AtomicBool::new(false);

/// True once [`show`] (with `json`) or [`show_failed`] printed an envelope.
pub fn printed() -> bool {
    PRINTED.load(Ordering::Relaxed)
}

/// Prints `r`: with `json`, as `{"ok": true, …}` with `r`'s fields beside `ok` (so `r` must
/// serialise as an object), else as `text` renders it.
pub fn show<T: Serialize>(json: bool, r: &T, text: impl FnOnce(&T) -> String) {
    if json {
        envelope(true, None, r);
    } else {
        print!("{}", text(r));
    }
}

/// Prints `{"ok": false, "error": error, …r's fields}`: a failure that still has a result to
/// show (a heal that healed some files and not others).
pub fn show_failed<T: Serialize>(r: &T, error: &str) {
    envelope(false, Some(error), r);
}

fn envelope<T: Serialize>(ok: bool, error: Option<&str>, r: &T) {
    let e = kiln_mgmt::response::Envelope {
        ok,
        error: error.map(str::to_owned),
        reply: Some(r),
    };
    println!(
        "{}",
        serde_json::to_string(&e).expect("a result serialises")
    );
    PRINTED.store(true, Ordering::Relaxed);
}

/// The failure envelope `main` prints for `error` with `--json`.
pub fn failed(error: &str) -> String {
    let e: kiln_mgmt::response::Envelope<()> = kiln_mgmt::response::Envelope {
        ok: false,
        error: Some(error.to_owned()),
        reply: None,
    };
    serde_json::to_string(&e).expect("an error serialises")
}
