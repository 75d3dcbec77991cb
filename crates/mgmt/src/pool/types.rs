//! What the pool's Raft log carries: commands on a small versioned key/value store, and
//! openraft's type configuration for it.

use std::collections::BTreeMap;
use std::io::Cursor;

use serde::{Deserialize, Serialize};

/// A change of the pool's store. Applied in log order on every member, so it must not look
/// at clocks, randomness or anything but the store.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
#[serde(tag = "op", rename_all = "kebab-case")]
pub enum Cmd {
    /// Sets `key` to `value` if its version is still `expect` (`Some(0)`: the key must not
    /// exist; `None`: whatever it is).
    Put {
        /// The key (`vol/NAME`, …).
        key: String,
        /// The new value.
        value: serde_json::Value,
        /// The version the writer read.
        #[serde(default)]
        expect: Option<u64>,
    },
    /// Applies every change in `ops` in order, or none of them if any one's `expect` does not
    /// hold.
    Batch {
        /// The changes.
        ops: Vec<Cmd>,
    },
    /// Removes `key` if its version is still `expect` (`None`: whatever it is).
    Delete {
        /// The key.
        key: String,
        /// The version the writer read.
        #[serde(default)]
        expect: Option<u64>,
    },
}

/// What a [`Cmd`] did.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
#[serde(tag = "outcome", rename_all = "kebab-case")]
pub enum Outcome {
    /// Applied: the key's version now (its log index), 0 for a removed key.
    Done {
        /// The new version.
        version: u64,
    },
    /// Not applied: the key had moved on since the writer read it.
    Conflict {
        /// The key's version now (0: it does not exist).
        have: u64,
    },
}

/// The RPCs, as the `rpc` field of a `raft` request names them.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum Rpc {
    /// `AppendEntries` (and heartbeats).
    Append,
    /// `RequestVote`.
    Vote,
    /// A chunk of a snapshot.
    Snapshot,
    /// Would you vote for me? (see [`super::prevote`]).
    PreVote,
}

/// What members send each other about the pool: the same JSON as the management requests
/// of the same names (`raft`, `pool-write`, `pool-join`), which the management port decodes.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
#[serde(tag = "cmd", rename_all = "kebab-case")]
pub enum Msg {
    /// One Raft RPC for member `to`.
    Raft {
        /// The member it is for.
        to: NodeId,
        /// Which RPC.
        rpc: Rpc,
        /// Its message.
        body: serde_json::Value,
    },
    /// Apply a change (to the leader).
    PoolWrite {
        /// The change.
        change: Cmd,
    },
    /// Who are you, may you join (and, with `prepare`, get ready to).
    PoolJoin {
        /// Forget a pool of one made for itself.
        prepare: bool,
    },
}

/// `raft`: an RPC's result (`{"Ok": …}` or `{"Err": …}`, openraft's types).
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct RaftReply {
    /// The result.
    pub reply: serde_json::Value,
}

/// `pool-write`: what the change did, and the store's version it made.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Written {
    /// What it did.
    pub outcome: Outcome,
    /// The log index of the change.
    pub version: u64,
}

/// `pool-join` and `peer probe`: a kilnd as a pool sees it.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Joined {
    /// Its member id.
    pub id: u64,
    /// Its management address.
    pub addr: String,
    /// Members of the pool it is in (1: alone), after a probe: of the pool it joined.
    pub members: usize,
    /// Keys in its store.
    pub keys: usize,
    /// Alone and holding nothing: it may join another pool.
    pub joinable: bool,
}

/// One member in `pool list` and `peer status`.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct PoolMember {
    /// Its id.
    pub id: u64,
    /// Its management address.
    pub addr: String,
    /// `leader`, `voter`, `learner`, or `alone` (a kilnd in no pool yet).
    pub role: String,
    /// The kilnd that answered.
    pub this: bool,
    /// Whether it answered the kilnd that answered (unknown when not asked).
    pub reachable: Option<bool>,
}

/// `pool list`, `peer status`: the pool as one member sees it.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct PoolView {
    /// The id of the member that answered.
    pub id: u64,
    /// The leader it knows of.
    pub leader: Option<u64>,
    /// Its Raft term.
    pub term: u64,
    /// The version of the store it has applied (a log index).
    pub version: u64,
    /// The members.
    pub members: Vec<PoolMember>,
}

/// A value in the store and the log index of the command that set it: versions only grow.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Versioned {
    /// The value.
    pub value: serde_json::Value,
    /// The log index that set it.
    pub version: u64,
}

/// The store: keys in order.
pub type Kv = BTreeMap<String, Versioned>;

/// A member's identity in the log: a random number chosen when its state directory was new.
pub type NodeId = u64;

openraft::declare_raft_types!(
    /// The pool's Raft type configuration.
    pub Kiln:
        D = Cmd,
        R = Outcome,
        NodeId = NodeId,
        Node = openraft::BasicNode,
        Entry = openraft::Entry<Kiln>,
        SnapshotData = Cursor<Vec<u8>>,
        AsyncRuntime = openraft::TokioRuntime,
);

/// The pool's Raft handle.
pub type Raft = openraft::Raft<Kiln>;
/// A storage failure as openraft wants it.
pub type StorageError = openraft::StorageError<NodeId>;
