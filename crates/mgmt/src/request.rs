//! The MGMT commands as one typed request: what `kiln volume` and other kilnds send, decoded
//! once at the edge. On the wire a request is a JSON object whose `"cmd"` names the variant
//! (kebab-case) and whose other fields are the variant's; a missing optional field takes its
//! default, and an unknown command or a field of the wrong type is refused with serde's
//! message naming it.

use serde::{Deserialize, Serialize};

use crate::VolumeDef;

/// The commands an unauthenticated connection may send (see the module documentation).
pub const OPEN_COMMANDS: &[&str] = &["volfile"];

/// One MGMT request.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
#[serde(tag = "cmd", rename_all = "kebab-case")]
pub enum Request {
    /// Manage named identities: their keys and capabilities.
    Auth {
        /// What to do.
        op: AuthOp,
        /// The identity (all but `list`).
        #[serde(default)]
        name: Option<String>,
        /// Its capabilities (`add`, `caps`).
        #[serde(default)]
        caps: Option<kiln_server::identity::Caps>,
    },
    /// Define a volume: `bricks` are `HOST:/DIR` or `HOST:PORT:/DIR`, in replica-set order.
    Create {
        /// The volume's name.
        name: String,
        /// Copies of each file (default 1).
        #[serde(default)]
        replica: Option<u64>,
        /// The bricks.
        #[serde(default)]
        bricks: Vec<String>,
        /// Address ranges (ADDR/PREFIX) clients may connect from; empty: anyone.
        #[serde(default)]
        allow: Vec<String>,
        /// Store files in pieces of this many bytes over the replica sets; None: whole.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        shard: Option<u64>,
        /// Accept bricks in system directories (`/`, `/etc`, `/usr`, ...).
        #[serde(default)]
        force: bool,
    },
    /// Run the volume's bricks; `force` also restarts bricks that died.
    Start {
        /// The volume.
        name: String,
        /// Revive dead bricks of a started volume.
        #[serde(default)]
        force: bool,
    },
    /// Stop the volume's bricks.
    Stop {
        /// The volume.
        name: String,
    },
    /// Change volume options (restarting a started volume's bricks for their own options).
    Set {
        /// The volume.
        name: String,
        /// (option, value) pairs as `volume set` takes them, applied in order by
        /// [`crate::options::apply`]; the others stay.
        #[serde(default)]
        options: Vec<(String, String)>,
    },
    /// Append whole replica sets of new, empty bricks to a volume (running them if it is
    /// started): new files land on them at once.
    AddBrick {
        /// The volume.
        name: String,
        /// The volume's replica count, if given (it must match: raising it is not supported).
        #[serde(default)]
        replica: Option<u64>,
        /// The new bricks (HOST:/DIR or HOST:MGMTPORT:/DIR), in replica-set order.
        #[serde(default)]
        bricks: Vec<String>,
    },
    /// Put a new, empty brick in the place of one (dead, or to be retired): the new one is
    /// rebuilt in full from its replicas by the heal service.
    ReplaceBrick {
        /// The volume.
        name: String,
        /// The brick replaced (HOST:/DIR as `info` shows it).
        old: String,
        /// The new brick (HOST:/DIR or HOST:MGMTPORT:/DIR).
        new: String,
    },
    /// Start, stop or show the volume's rebalance (run by the pool's leader).
    Rebalance {
        /// The volume.
        name: String,
        /// `start`, `stop` or `status`.
        action: String,
        /// With `start`: MiB per second at most (default 64; 0: no limit).
        #[serde(default)]
        rate_mib: Option<u64>,
    },
    /// Take whole replica sets out of a volume: `start` drains them (a rebalance moves their
    /// files off), `status`, `stop`, and `commit` once nothing is left on them.
    RemoveBrick {
        /// The volume.
        name: String,
        /// The bricks (HOST:/DIR as `info` shows them), whole replica sets.
        bricks: Vec<String>,
        /// `start`, `status`, `stop` or `commit`.
        action: String,
        /// With `start`: the rebalance's MiB per second at most (default 64; 0: no limit).
        #[serde(default)]
        rate_mib: Option<u64>,
    },
    /// Remove a stopped volume's definition (the brick directories stay).
    Delete {
        /// The volume.
        name: String,
    },
    /// Definitions: one volume, or every one.
    Info {
        /// The volume, or none for all.
        #[serde(default)]
        name: Option<String>,
    },
    /// Volume names.
    List,
    /// Brick processes, ports and heal state: one volume, or every one.
    Status {
        /// The volume, or none for all.
        #[serde(default)]
        name: Option<String>,
    },
    /// The client graph of a started volume: the one command open without the secret.
    Volfile {
        /// The volume.
        name: String,
    },
    /// Kilnd to kilnd: cache `def` (and its secret) and run brick `index` here.
    BrickStart {
        /// The definition.
        def: VolumeDef,
        /// The brick to run.
        index: usize,
        /// The volume secret (64 hex digits).
        #[serde(default)]
        secret: Option<String>,
    },
    /// Kilnd to kilnd: stop brick `index` of `name` here.
    BrickStop {
        /// The volume.
        name: String,
        /// The brick to stop.
        index: usize,
    },
    /// Leader to a member with bricks of a new volume: make the brick directories there.
    PeerSync {
        /// The definition.
        def: VolumeDef,
        /// The volume secret (64 hex digits).
        #[serde(default)]
        secret: Option<String>,
    },
    /// Add the kilnd at `host` (`HOST` or `HOST:PORT`) to the pool.
    PeerProbe {
        /// Its management address.
        host: String,
    },
    /// Remove the member at `host` (`HOST` or `HOST:PORT`, or its id in hex) from the pool.
    PeerDetach {
        /// Its management address or id.
        host: String,
    },
    /// The pool's members as the kilnd asked sees them (`peer status`, `pool list`).
    PoolList,
    /// Member to member: one Raft RPC for member `to`.
    Raft {
        /// The member it is for.
        to: u64,
        /// Which RPC.
        rpc: crate::pool::types::Rpc,
        /// Its message.
        body: serde_json::Value,
    },
    /// Member to leader: apply a change of the store.
    PoolWrite {
        /// The change.
        change: crate::pool::types::Cmd,
    },
    /// Leader to a member it removed: forget the pool.
    PoolLeave {
        /// The member removed (a kilnd whose id differs ignores it).
        id: u64,
    },
    /// Prober to a kilnd: who are you, may you join (and, with `prepare`, get ready to).
    PoolJoin {
        /// Forget a pool of one made for itself.
        #[serde(default)]
        prepare: bool,
    },
}

impl Request {
    /// The command's wire name, for logs and refusals.
    pub fn cmd(&self) -> &'static str {
        match self {
            Request::Create { .. } => "create",
            Request::Start { .. } => "start",
            Request::Stop { .. } => "stop",
            Request::Set { .. } => "set",
            Request::Auth { .. } => "auth",
            Request::AddBrick { .. } => "add-brick",
            Request::ReplaceBrick { .. } => "replace-brick",
            Request::Rebalance { .. } => "rebalance",
            Request::RemoveBrick { .. } => "remove-brick",
            Request::Delete { .. } => "delete",
            Request::Info { .. } => "info",
            Request::List => "list",
            Request::Status { .. } => "status",
            Request::Volfile { .. } => "volfile",
            Request::BrickStart { .. } => "brick-start",
            Request::BrickStop { .. } => "brick-stop",
            Request::PeerSync { .. } => "peer-sync",
            Request::PeerProbe { .. } => "peer-probe",
            Request::PeerDetach { .. } => "peer-detach",
            Request::PoolList => "pool-list",
            Request::Raft { .. } => "raft",
            Request::PoolWrite { .. } => "pool-write",
            Request::PoolJoin { .. } => "pool-join",
            Request::PoolLeave { .. } => "pool-leave",
        }
    }

    /// True for the commands an unauthenticated connection may send
    /// ([`OPEN_COMMANDS`], checked by name before a request is decoded).
    pub fn is_open(&self) -> bool {
        OPEN_COMMANDS.contains(&self.cmd())
    }

    /// The volume a change names: the commands a member that is not the pool's leader
    /// forwards to it.
    pub fn forwarded_volume(&self) -> Option<&str> {
        match self {
            Request::Create { name, .. }
            | Request::Start { name, .. }
            | Request::Stop { name }
            | Request::Set { name, .. }
            | Request::AddBrick { name, .. }
            | Request::ReplaceBrick { name, .. }
            | Request::Rebalance { name, .. }
            | Request::RemoveBrick { name, .. }
            | Request::Delete { name } => Some(name),
            _ => None,
        }
    }

    /// The request as JSON, for clients that speak JSON.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(self).expect("a request serialises")
    }
}

/// What the `auth` command does.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum AuthOp {
    /// Make a new identity with a new key and the capabilities given.
    Add,
    /// Every identity and its capabilities (no keys).
    List,
    /// One identity with its key.
    Get,
    /// Replace an identity's capabilities.
    Caps,
    /// Give an identity a new key (its connections with the old one are closed).
    Rotate,
    /// Remove an identity (its connections are closed).
    Rm,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_wire_form_is_what_clients_send() {
        let r: Request = serde_json::from_value(json!({ "cmd": "volfile", "name": "v" })).unwrap();
        assert_eq!(r, Request::Volfile { name: "v".into() });
        assert!(r.is_open());
        assert!(!Request::List.is_open());
        let r: Request = serde_json::from_value(json!({ "cmd": "list" })).unwrap();
        assert_eq!(r, Request::List);
        let r: Request =
            serde_json::from_value(json!({ "cmd": "start", "name": "v", "force": true })).unwrap();
        assert_eq!(r.forwarded_volume(), Some("v"));
        assert_eq!(r.to_json()["cmd"], "start");
        let r: Request = serde_json::from_value(json!({ "cmd": "info" })).unwrap();
        assert_eq!(r, Request::Info { name: None });
    }

    #[test]
    fn the_pool_s_messages_are_the_requests_of_the_same_names() {
        use crate::pool::types::{Cmd, Msg, Rpc};
        let change = Cmd::Delete {
            key: "vol/v".into(),
            expect: Some(3),
        };
        let pairs = [
            (
                Msg::PoolJoin { prepare: true },
                Request::PoolJoin { prepare: true },
            ),
            (
                Msg::PoolWrite {
                    change: change.clone(),
                },
                Request::PoolWrite { change },
            ),
            (
                Msg::Raft {
                    to: 7,
                    rpc: Rpc::Vote,
                    body: json!({ "x": 1 }),
                },
                Request::Raft {
                    to: 7,
                    rpc: Rpc::Vote,
                    body: json!({ "x": 1 }),
                },
            ),
        ];
        for (msg, req) in pairs {
            let v = serde_json::to_value(&msg).unwrap();
            assert_eq!(serde_json::from_value::<Request>(v).unwrap(), req);
        }
    }

    #[test]
    fn unknown_commands_and_wrong_types_are_named() {
        let e = serde_json::from_value::<Request>(json!({ "cmd": "explode" })).unwrap_err();
        assert!(e.to_string().contains("explode"), "{e}");
        let e =
            serde_json::from_value::<Request>(json!({ "cmd": "create", "name": 3 })).unwrap_err();
        assert!(e.to_string().contains("invalid type"), "{e}");
        let e = serde_json::from_value::<Request>(json!({ "name": "v" })).unwrap_err();
        assert!(e.to_string().contains("cmd"), "{e}");
    }
}
