//! What a command that prints and ends shows: text for a person, or with `--json` one JSON
//! object per run in the same envelope for every command — `{"ok": true, …the result's
//! fields}` when it succeeded, `{"ok": false, "error": "…", "kind": "…"}` when it did not
//! (printed by `main`, which also sets the exit status from the kind; see [`EXIT_STATUS`]).
//! Progress goes to stderr.

use std::sync::atomic::{AtomicBool, Ordering};

use kiln_proto::{Error, Kind};
use serde::Serialize;

/// The exit statuses, as `kiln --help` and the man page state them.
pub const EXIT_STATUS: &str = "\
Exit status:
  0  the command did what was asked
  1  it failed: the reason is on stderr (and, with --json, in {\"ok\": false, \"error\": …,
     \"kind\": …}); the codes below say why, where that is known
  2  the command line or a value in it was wrong (unknown command or option, a value of the
     wrong type, a volume option's or brick's value refused); --json prints it as an error
     of kind \"invalid\" too
  3  what it names does not exist (a volume, an identity, a pool member)     kind not-found
  4  what it would make exists already                                      kind exists
  5  not in this state: stop, wait for or end something first (a volume not
     started, a rebalance under way), or it changed meanwhile: try again      kind conflict
  6  someone who must answer cannot now (no pool leader, a host unreachable,
     a timeout): the same command may work later                          kind unavailable
  7  the key or identity used may not do this                             kind denied
Servers, mounts and exports (server, mount, nbd, vhost-user-blk) exit 0 when stopped by
SIGTERM or `kiln umount`. When they cannot start, mounts and exports exit with the codes above
and servers with 1; a service that fails later exits 1.

--json is taken by every command that prints a result and ends (volume, peer, pool, image,
tls, generate, umount, bench, demo); servers, mounts and exports write a log instead.";

/// The exit status for a failure of `kind` (see [`EXIT_STATUS`]).
pub fn exit_status(kind: Kind) -> u8 {
    match kind {
        Kind::Failed | Kind::Io => 1,
        Kind::Invalid => 2,
        Kind::NotFound => 3,
        Kind::Exists => 4,
        Kind::Conflict => 5,
        Kind::Unavailable => 6,
        Kind::Denied => 7,
    }
}

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
pub fn show_failed<T: Serialize>(r: &T, error: &Error) {
    envelope(false, Some(error), r);
}

fn envelope<T: Serialize>(ok: bool, error: Option<&Error>, r: &T) {
    let e = kiln_mgmt::response::Envelope {
        ok,
        error: error.map(|e| e.message().to_owned()),
        kind: error.map(|e| e.kind().name().to_owned()),
        reply: Some(r),
    };
    println!(
        "{}",
        serde_json::to_string(&e).expect("a result serialises")
    );
    PRINTED.store(true, Ordering::Relaxed);
}

/// The failure envelope `main` prints for `error` with `--json`.
pub fn failed(error: &Error) -> String {
    let e: kiln_mgmt::response::Envelope<()> = kiln_mgmt::response::Envelope {
        ok: false,
        error: Some(error.message().to_owned()),
        kind: Some(error.kind().name().to_owned()),
        reply: None,
    };
    serde_json::to_string(&e).expect("an error serialises")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each kind has its own status (failures of no particular kind share 1), and the help
    /// text states each status with its kind's wire name.
    #[test]
    fn every_kind_has_a_status_the_help_states() {
        let mut seen = std::collections::HashMap::new();
        for k in Kind::ALL {
            let code = exit_status(k);
            if let Some(other) = seen.insert(code, k) {
                assert!(code == 1, "{k:?} and {other:?} share status {code}");
            }
            let line = format!("\n  {code}  ");
            assert!(
                EXIT_STATUS.contains(&line),
                "status {code} of {k:?} is not stated"
            );
            if code > 2 {
                let named = format!("kind {}", k.name());
                assert!(EXIT_STATUS.contains(&named), "{named} is not stated");
            }
        }
    }
}
