//! What a command that prints and ends shows: text for a person, or with `--json` one JSON
//! object per run in the same envelope for every command — `{"ok": true, …the result's
//! fields}` when it succeeded, `{"ok": false, "error": "…"}` when it did not (printed by
//! `main`, which also sets the exit status; see [`EXIT_STATUS`]).

use serde::Serialize;

/// The exit statuses, as `kiln --help` and the man page state them.
pub const EXIT_STATUS: &str = "\
Exit status:
  0  the command did what was asked
  1  it failed: the reason is on stderr (and, with --json, in {\"ok\": false, \"error\": …})
  2  the command line was wrong (unknown command or option, bad value); with --json the
     usage error is printed as {\"ok\": false, \"error\": …} too
Servers, mounts and exports (server, mount, nbd, vhost-user-blk) exit 0 when stopped by
SIGTERM or `kiln umount`, 1 when they cannot start or their service fails.

--json is taken by every command that prints a result and ends (volume, peer, pool, image,
tls, generate, umount, bench, demo); servers, mounts and exports write a log instead.";

/// Prints `r`: with `json`, as `{"ok": true, …}` with `r`'s fields beside `ok` (so `r` must
/// serialise as an object), else as `text` renders it.
pub fn show<T: Serialize>(json: bool, r: &T, text: impl FnOnce(&T) -> String) {
    if json {
        let e = kiln_mgmt::response::Envelope {
            ok: true,
            error: None,
            reply: Some(r),
        };
        println!(
            "{}",
            serde_json::to_string(&e).expect("a result serialises")
        );
    } else {
        print!("{}", text(r));
    }
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
