//! Volume management: the volume definitions a kilnd keeps, the brick processes it runs for
//! them, and the MGMT commands (JSON over `Op::Mgmt`) that change them.
//!
//! A kilnd started without `--brick` is a management daemon. It keeps its state in a directory
//! (`--state-dir`, default `/var/lib/kiln`):
//!
//! ```text
//! mgmt.secret              the management secret (64 hex digits, mode 0600), unless
//!                          `--mgmt-secret-file` names another file
//! pool/                    the pool's Raft log, vote and store (see [`pool`]): volume
//!                          definitions and secrets, the same on every member
//! vols/NAME/secret         the volume's shared secret (64 hex digits, mode 0600), kept in
//!                          step with the store
//! vols/NAME/bricks/N.toml  brick N's volfile; N.log is its output
//! mgmt-root/               an empty directory behind the management port's (refused) file fops
//! ```
//!
//! Bricks are separate processes (the same executable, in brick mode), so one can die or be
//! killed without taking the others or the management daemon along; they outlive a restart of
//! kilnd, which adopts them again (pid alive, running this brick's volfile, port answering).
//!
//! Several hosts: the kilnds form a pool ([`pool`]) whose store every member holds; changes
//! are made by its leader (any member forwards them there), which asks each brick host's kilnd
//! to start and stop that host's bricks (`brick-start`, `brick-stop`).
//!
//! A brick is written `HOST:/DIR` or `HOST:PORT:/DIR`, where PORT is the management port of
//! HOST's kilnd (default [`DEFAULT_MGMT_PORT`]). HOST is an IP address or a name that resolves
//! to one; a brick is on "this host" when this host can bind that address.
//!
//! Every reply is a JSON object with `"ok": true` and the fields of the command's [`response`] type, or `"ok": false`
//! and `"error"`: a sentence meant for the operator.
//!
//! **Authentication.** The management port requires the management secret (`mgmt.secret`
//! above, created at first start; the same HMAC challenge-response as bricks, see
//! `kiln_proto::auth`), or the key of an identity with the admin capability (see
//! [`identities`]), for every command but one: `volfile`, the client graph of a started
//! volume, is handed to a connection that proved the volume's own secret (identity
//! `vol.NAME` here) or the key of an identity allowed on the volume, so that `kiln mount
//! HOST:/VOL` works on a client host without handing it the key to create and delete
//! volumes; to anyone else it answers as for a volume that does not exist. What `volfile`
//! returns is layer names and brick addresses, never a secret. Everything else — `create`, `start`, `stop`, `delete`, `info`,
//! `list`, `status` and the kilnd-to-kilnd commands (`peer-sync` and `brick-start`, which
//! carry volume secrets, `brick-stop`, and the pool's `raft`, `pool-write`, `pool-join`,
//! `pool-leave`) — is refused, and the
//! refusal logged with the peer's address, unless the connection proved the secret. An
//! unauthenticated connection can do nothing else either: the connection code refuses every
//! other fop before authentication (see [`Caller`]).
//!
//! Kilnds prove the secret to each other too, and a kilnd sends a command (and with it a
//! volume secret) only to a kilnd that proves the secret back, so every host of a cluster
//! must hold the same one: copy the first host's `STATE_DIR/mgmt.secret` to the others before
//! they first start (or start every kilnd with `--mgmt-secret-file` naming a shared copy).

pub use kiln_server::control::{Caller, Handler, MgmtHandler};

mod bricks;
mod commands;
mod def;
mod dispatch;
mod files;
mod grow;
pub mod healer;
pub mod healing;
pub mod identities;
mod manager;
mod members;
pub mod options;
pub mod orphans;
mod peers;
pub mod pool;
pub mod rebalancer;
pub mod rebalancing;
mod replace;
mod request;
pub mod response;
mod shrink;
mod store;
mod volfiles;

pub use bricks::brick_command;
pub use def::*;
pub use manager::{current_umask, restore_umask, Manager, FIRST_BRICK_PORT, MGMT_SECRET_FILE};
pub use request::{Request, OPEN_COMMANDS};
pub use volfiles::{brick_of_point, brick_volfile, client_volfile, placeholder_volfile};

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use kiln_layer::volfile::Volfile;

    #[test]
    fn brick_specs() {
        let b = parse_brick("10.0.0.1:/srv/b1/").unwrap();
        assert_eq!((b.host.as_str(), b.mgmt_port), ("10.0.0.1", None));
        assert_eq!(b.dir, Path::new("/srv/b1"));
        let b = parse_brick("node2:24008:/srv//b2").unwrap();
        assert_eq!((b.host.as_str(), b.mgmt_port), ("node2", Some(24008)));
        assert_eq!(b.spec(), "node2:24008:/srv/b2");
        for bad in [
            "/srv/b",
            "h:srv/b",
            ":/srv/b",
            "h:/",
            "h:/a/../b",
            "h:x:/a",
            "h:0:/a",
        ] {
            assert!(parse_brick(bad).is_err(), "{bad} accepted");
        }
        assert!(check_name("vol_1-a").is_ok());
        for bad in ["", "-x", "a b", "a/b", "é", &"x".repeat(65)] {
            assert!(check_name(bad).is_err(), "{bad:?} accepted");
        }
    }

    /// A started volume of `n` local bricks in sets of `replica` (for this crate's tests).
    pub(crate) fn def(replica: usize, n: usize) -> VolumeDef {
        VolumeDef {
            name: "v".into(),
            id: "0".into(),
            replica,
            bricks: (0..n)
                .map(|i| BrickDef {
                    host: "127.0.0.1".into(),
                    mgmt_port: None,
                    dir: format!("/b{i}").into(),
                    port: Some(24100 + i as u16),
                    pid: None,
                    metrics_port: None,
                    settled: true,
                    removed: false,
                })
                .collect(),
            state: VolState::Started,
            authority: None,
            shared_secret: Some(false),
            ..VolumeDef::default()
        }
    }

    #[test]
    fn client_volfile_shapes() {
        let types =
            |v: &Volfile| -> Vec<&str> { v.layers.iter().map(|l| l.kind.type_name()).collect() };
        let v = client_volfile(&def(1, 1)).unwrap();
        assert_eq!(types(&v), ["io-stats", "protocol-client"]);
        let v = client_volfile(&def(3, 3)).unwrap();
        assert_eq!(
            types(&v),
            [
                "io-stats",
                "replicate",
                "protocol-client",
                "protocol-client",
                "protocol-client"
            ]
        );
        assert_eq!(v.layers[1].name, "v-replicate-0");
        let v = client_volfile(&def(2, 4)).unwrap();
        assert_eq!(
            types(&v)[..4],
            ["io-stats", "distribute", "replicate", "replicate"]
        );
        assert_eq!(v.layers[1].subvolumes, ["v-replicate-0", "v-replicate-1"]);
        assert_eq!(v.layers[3].subvolumes, ["v-client-2", "v-client-3"]);
        let v = client_volfile(&def(1, 2)).unwrap();
        assert_eq!(
            types(&v),
            [
                "io-stats",
                "distribute",
                "protocol-client",
                "protocol-client"
            ]
        );
        assert_eq!(Volfile::parse(&v.to_toml()).unwrap(), v);
    }

    #[test]
    fn client_volfile_of_a_reshaped_volume() {
        use kiln_layer::volfile::LayerKind;
        // 2 x 1 raised to 2 x 2 (sets listed, new bricks at the end), then set 0 drained.
        let mut d = def(2, 4);
        d.sets = vec![vec![0, 2], vec![1, 3]];
        d.widening = Some(1);
        d.draining = vec![0];
        let v = client_volfile(&d).unwrap();
        let layer = |n: &str| v.layers.iter().find(|l| l.name == n).unwrap();
        assert_eq!(
            layer("v-replicate-0").subvolumes,
            ["v-client-0", "v-client-2"]
        );
        assert_eq!(
            layer("v-replicate-1").subvolumes,
            ["v-client-1", "v-client-3"]
        );
        assert!(matches!(
            layer("v-replicate-1").kind,
            LayerKind::Replicate(kiln_layer::replicate::ReplicateConfig {
                quorum: Some(1),
                ..
            })
        ));
        assert!(matches!(
            &layer("v-dht").kind,
            LayerKind::Distribute(c) if c.draining == ["v-replicate-0"]
        ));
        // Set 0 removed: its bricks are in no graph, the other set keeps its names.
        for i in [0, 2] {
            d.bricks[i].removed = true;
        }
        d.draining.clear();
        d.widening = None;
        let v = client_volfile(&d).unwrap();
        let names: Vec<&str> = v.layers.iter().map(|l| l.name.as_str()).collect();
        assert_eq!(names, ["v", "v-replicate-1", "v-client-1", "v-client-3"]);
        assert_eq!(d.live_sets(), [1]);
    }
}
