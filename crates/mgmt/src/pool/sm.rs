//! The pool's state machine: the versioned store every member applies the log to, saved
//! whole after each batch it applies (`STATE_DIR/pool/sm.json`, mode 0600 — it will hold
//! volume secrets), and its snapshots (`snapshot.json`), which openraft sends to a member
//! too far behind for the log.

use std::io::Cursor;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock, RwLockReadGuard};

use kiln_proto::sync::RwLockExt as _;
use openraft::storage::{RaftStateMachine, Snapshot};
use openraft::{
    BasicNode, EntryPayload, ErrorSubject, ErrorVerb, LogId, RaftSnapshotBuilder, SnapshotMeta,
    StoredMembership,
};
use serde::{Deserialize, Serialize};

use super::log::{read_json, write_json};
use super::types::{Cmd, Kiln, Kv, NodeId, Outcome, StorageError, Versioned};
use kiln_proto::Error;

/// What the state machine holds.
#[derive(Serialize, Deserialize, Debug, Default, Clone)]
pub struct Data {
    /// The last log entry applied: its index is the store's version.
    pub last_applied: Option<LogId<NodeId>>,
    /// The pool's members as the log last set them.
    pub membership: StoredMembership<NodeId, BasicNode>,
    /// The store.
    pub kv: Kv,
}

impl Data {
    /// The store's version: the index of the last entry applied (0 before any).
    pub fn version(&self) -> u64 {
        self.last_applied.map_or(0, |l| l.index)
    }

    /// The version `cmd` expects a key at and the version it has, when they differ.
    fn conflict(&self, cmd: &Cmd) -> Option<u64> {
        let have = |key: &str| self.kv.get(key).map_or(0, |v| v.version);
        match cmd {
            Cmd::Put { key, expect, .. } | Cmd::Delete { key, expect } => {
                let now = have(key);
                expect.is_some_and(|e| e != now).then_some(now)
            }
            Cmd::Batch { ops } => ops.iter().find_map(|c| self.conflict(c)),
        }
    }

    fn apply(&mut self, index: u64, cmd: Cmd) -> Outcome {
        let have = |kv: &Kv, key: &str| kv.get(key).map_or(0, |v| v.version);
        match cmd {
            Cmd::Batch { ops } => {
                if let Some(have) = ops.iter().find_map(|c| self.conflict(c)) {
                    return Outcome::Conflict { have };
                }
                for op in ops {
                    self.apply(index, op);
                }
                Outcome::Done { version: index }
            }
            Cmd::Put { key, value, expect } => {
                let now = have(&self.kv, &key);
                if expect.is_some_and(|e| e != now) {
                    return Outcome::Conflict { have: now };
                }
                self.kv.insert(
                    key,
                    Versioned {
                        value,
                        version: index,
                    },
                );
                Outcome::Done { version: index }
            }
            Cmd::Delete { key, expect } => {
                let now = have(&self.kv, &key);
                if expect.is_some_and(|e| e != now) {
                    return Outcome::Conflict { have: now };
                }
                self.kv.remove(&key);
                Outcome::Done { version: 0 }
            }
        }
    }
}

#[derive(Serialize, Deserialize)]
struct Stored {
    meta: SnapshotMeta<NodeId, BasicNode>,
    data: Vec<u8>,
}

/// The state machine: cheap to clone; readers share [`Sm::read`].
#[derive(Clone)]
pub struct Sm {
    dir: PathBuf,
    data: Arc<RwLock<Data>>,
    snapshot: Arc<RwLock<Option<Stored>>>,
}

fn io_err(subject: ErrorSubject<NodeId>, verb: ErrorVerb, e: impl ToString) -> StorageError {
    StorageError::from_io_error(subject, verb, std::io::Error::other(e.to_string()))
}

impl Sm {
    /// Loads the state machine saved in `dir` (empty when there is none).
    pub fn open(dir: &Path) -> Result<Sm, Error> {
        let data = read_json(dir, "sm.json")?.unwrap_or_default();
        let snapshot = read_json(dir, "snapshot.json")?;
        Ok(Sm {
            dir: dir.to_owned(),
            data: Arc::new(RwLock::new(data)),
            snapshot: Arc::new(RwLock::new(snapshot)),
        })
    }

    /// What the store holds now.
    pub fn read(&self) -> RwLockReadGuard<'_, Data> {
        self.data.read_locked()
    }

    // openraft's error type, returned only when the disk fails.
    #[allow(clippy::result_large_err)]
    fn save(&self, d: &Data) -> Result<(), StorageError> {
        write_json(&self.dir, "sm.json", d)
            .map_err(|e| io_err(ErrorSubject::StateMachine, ErrorVerb::Write, e))
    }
}

impl RaftSnapshotBuilder<Kiln> for Sm {
    async fn build_snapshot(&mut self) -> Result<Snapshot<Kiln>, StorageError> {
        let d = self.read().clone();
        let data = serde_json::to_vec(&d).expect("the store serialises");
        let id = d.last_applied.map_or_else(
            || "empty".to_owned(),
            |l| format!("{}-{}", l.leader_id, l.index),
        );
        let meta = SnapshotMeta {
            last_log_id: d.last_applied,
            last_membership: d.membership.clone(),
            snapshot_id: id,
        };
        let stored = Stored {
            meta: meta.clone(),
            data: data.clone(),
        };
        write_json(&self.dir, "snapshot.json", &stored)
            .map_err(|e| io_err(ErrorSubject::Snapshot(None), ErrorVerb::Write, e))?;
        *self.snapshot.write_locked() = Some(stored);
        Ok(Snapshot {
            meta,
            snapshot: Box::new(Cursor::new(data)),
        })
    }
}

impl RaftStateMachine<Kiln> for Sm {
    type SnapshotBuilder = Self;

    async fn applied_state(
        &mut self,
    ) -> Result<(Option<LogId<NodeId>>, StoredMembership<NodeId, BasicNode>), StorageError> {
        let d = self.read();
        Ok((d.last_applied, d.membership.clone()))
    }

    async fn apply<I>(&mut self, entries: I) -> Result<Vec<Outcome>, StorageError>
    where
        I: IntoIterator<Item = openraft::Entry<Kiln>> + Send,
        I::IntoIter: Send,
    {
        let mut next = self.read().clone();
        let mut out = Vec::new();
        for e in entries {
            next.last_applied = Some(e.log_id);
            let index = e.log_id.index;
            out.push(match e.payload {
                EntryPayload::Blank => Outcome::Done { version: index },
                EntryPayload::Normal(cmd) => next.apply(index, cmd),
                EntryPayload::Membership(m) => {
                    next.membership = StoredMembership::new(Some(e.log_id), m);
                    Outcome::Done { version: index }
                }
            });
        }
        // Saved before readers see it: what a reader saw survives a crash.
        self.save(&next)?;
        *self.data.write_locked() = next;
        Ok(out)
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        self.clone()
    }

    async fn begin_receiving_snapshot(&mut self) -> Result<Box<Cursor<Vec<u8>>>, StorageError> {
        Ok(Box::new(Cursor::new(Vec::new())))
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta<NodeId, BasicNode>,
        snapshot: Box<Cursor<Vec<u8>>>,
    ) -> Result<(), StorageError> {
        let bytes = snapshot.into_inner();
        let sig = Some(meta.signature());
        let mut d: Data = serde_json::from_slice(&bytes)
            .map_err(|e| io_err(ErrorSubject::Snapshot(sig.clone()), ErrorVerb::Read, e))?;
        d.last_applied = meta.last_log_id;
        d.membership = meta.last_membership.clone();
        let stored = Stored {
            meta: meta.clone(),
            data: bytes,
        };
        write_json(&self.dir, "snapshot.json", &stored)
            .map_err(|e| io_err(ErrorSubject::Snapshot(sig), ErrorVerb::Write, e))?;
        self.save(&d)?;
        *self.data.write_locked() = d;
        *self.snapshot.write_locked() = Some(stored);
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot<Kiln>>, StorageError> {
        let s = self.snapshot.read_locked();
        Ok(s.as_ref().map(|s| Snapshot {
            meta: s.meta.clone(),
            snapshot: Box::new(Cursor::new(s.data.clone())),
        }))
    }
}
