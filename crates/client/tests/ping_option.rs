//! A graph's `ping_timeout` (the volume option `ping-timeout`) sets the process's ping
//! timeout when the graph is built, and a graph without it the default: a test binary of its
//! own, since the value is per process.

use std::time::Duration;

use kiln_client::conn::{ping_timeout, DEFAULT_PING_TIMEOUT};
use kiln_client::Volume;
use kiln_layer::volfile::Volfile;

/// A replica-2 graph over two ports nothing listens on (the bricks start away), with `ping`.
fn graph(ping: Option<u32>) -> Volfile {
    let ping = ping.map_or(String::new(), |ms| format!("ping_timeout = {ms}\n"));
    let text = format!(
        r#"
[[layer]]
name = "r"
type = "replicate"
subvolumes = ["c0", "c1"]

[[layer]]
name = "c0"
type = "protocol-client"
remote = "tcp:127.0.0.1:9"
{ping}
[[layer]]
name = "c1"
type = "protocol-client"
remote = "tcp:127.0.0.1:9"
{ping}"#
    );
    Volfile::parse(&text).unwrap()
}

#[test]
fn the_graph_sets_the_ping_timeout_unless_the_host_does() {
    assert!(
        std::env::var("KILN_PING_TIMEOUT_MS").is_err(),
        "run without KILN_PING_TIMEOUT_MS: it overrides the graph"
    );
    // Whether the bricks are reached does not matter: the graph was read.
    let _ = Volume::from_volfile(&graph(Some(4321)));
    assert_eq!(ping_timeout(), Some(Duration::from_millis(4321)));
    let _ = Volume::from_volfile(&graph(Some(0)));
    assert_eq!(ping_timeout(), None, "0: never away");
    // A graph that no longer says (the option reset) brings the default back.
    let _ = Volume::from_volfile(&graph(Some(900)));
    assert_eq!(ping_timeout(), Some(Duration::from_millis(900)));
    let _ = Volume::from_volfile(&graph(None));
    assert_eq!(ping_timeout(), Some(DEFAULT_PING_TIMEOUT));
}
