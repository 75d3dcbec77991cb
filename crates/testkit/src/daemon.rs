//! Starting a kilnd (or `kiln server`) from a test: it says where it listens on its stdout
//! (`kilnd: listening on ADDR`, one line per listener, then `kilnd: metrics on URL` when it
//! serves metrics), and these read that instead of guessing ports.

use std::io::{BufRead, BufReader};
use std::process::{Child, ChildStdout, Command, Stdio};

/// What a kilnd said as it started.
#[derive(Debug, Default)]
pub struct Announced {
    /// Its listening addresses as printed (`tcp:IP:PORT`, `unix:PATH`), in order.
    pub listening: Vec<String>,
    /// Its metrics endpoint (`IP:PORT`), when asked for.
    pub metrics: Option<String>,
}

/// Reads start-up lines from `out` until `listeners` addresses (and, with `metrics`, the
/// metrics endpoint) were said; panics on end of output, with what was read.
pub fn announced(out: &mut impl BufRead, listeners: usize, metrics: bool) -> Announced {
    let mut a = Announced::default();
    let mut seen = Vec::new();
    while a.listening.len() < listeners || (metrics && a.metrics.is_none()) {
        let mut line = String::new();
        let n = out.read_line(&mut line).expect("kilnd output");
        assert!(n > 0, "kilnd ended its output early; it said {seen:?}");
        let l = line.trim();
        if let Some(addr) = l.strip_prefix("kilnd: listening on ") {
            a.listening.push(addr.to_owned());
        } else if let Some(m) = l.strip_prefix("kilnd: metrics on http://") {
            a.metrics = Some(m.trim_end_matches("/metrics").to_owned());
        }
        seen.push(l.to_owned());
    }
    a
}

/// Spawns `cmd` with its stdout piped and returns it with the one address it says it
/// listens on, as printed (`tcp:…` or `unix:…`). Its stdout is then left unread: it prints
/// nothing more unless asked for metrics.
pub fn spawn_listening(cmd: &mut Command) -> (Child, String) {
    let (child, mut out) = spawn_piped(cmd);
    let mut a = announced(&mut out, 1, false);
    (child, a.listening.remove(0))
}

/// Spawns `cmd` with its stdout piped; returns it and a reader of that stdout.
pub fn spawn_piped(cmd: &mut Command) -> (Child, BufReader<ChildStdout>) {
    let mut child = cmd
        .stdout(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {:?}: {e}", cmd.get_program()));
    let out = BufReader::new(child.stdout.take().expect("stdout is piped"));
    (child, out)
}

/// `addr` without its `tcp:` prefix (`IP:PORT`, as brick specs and `--server` take it).
pub fn tcp(addr: &str) -> &str {
    addr.strip_prefix("tcp:").unwrap_or(addr)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_listeners_and_metrics_in_any_order_and_skips_other_lines() {
        let text = "kilnd: metrics on http://127.0.0.1:9/metrics\nsomething else\n\
                    kilnd: listening on tcp:127.0.0.1:7\nkilnd: listening on unix:/s\n";
        let a = announced(&mut text.as_bytes(), 2, true);
        assert_eq!(a.listening, ["tcp:127.0.0.1:7", "unix:/s"]);
        assert_eq!(a.metrics.as_deref(), Some("127.0.0.1:9"));
        assert_eq!(tcp(&a.listening[0]), "127.0.0.1:7");
    }

    #[test]
    #[should_panic(expected = "ended its output early")]
    fn output_that_ends_first_is_a_failure_that_says_what_it_read() {
        announced(
            &mut "kilnd: listening on tcp:1.2.3.4:5\n".as_bytes(),
            2,
            false,
        );
    }
}
