//! The pool's Raft log on disk, in plain files under `STATE_DIR/pool/`:
//!
//! ```text
//! vote.json        the vote this member last cast (written before openraft is told so)
//! committed.json   the last log id known committed
//! purged.json      the last log id removed from the front (written before the removal)
//! log/INDEX.json   one entry per file, INDEX zero-padded to 20 digits
//! ```
//!
//! Every file is written whole (temp file, fsync, rename, fsync of the directory), so a crash
//! leaves an entry either there or not. Management changes are few and small: the log is
//! kept in memory too, and read from there.

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::fs;
use std::ops::RangeBounds;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use openraft::storage::{LogFlushed, RaftLogStorage};
use openraft::{ErrorSubject, ErrorVerb, LogId, LogState, RaftLogReader, Vote};
use serde::{de::DeserializeOwned, Serialize};
use tokio::sync::Mutex;

use super::types::{Kiln, NodeId, StorageError};
use crate::files::write_atomic;
use kiln_proto::error::Context as _;
use kiln_proto::Error;

type Entry = openraft::Entry<Kiln>;

/// The log store: cheap to clone (openraft reads through a clone).
#[derive(Clone)]
pub struct FileLog {
    inner: Arc<Mutex<Inner>>,
}

struct Inner {
    dir: PathBuf,
    vote: Option<Vote<NodeId>>,
    committed: Option<LogId<NodeId>>,
    purged: Option<LogId<NodeId>>,
    log: BTreeMap<u64, Entry>,
}

fn io_err(subject: ErrorSubject<NodeId>, verb: ErrorVerb, e: impl ToString) -> StorageError {
    let e = std::io::Error::other(e.to_string());
    StorageError::from_io_error(subject, verb, e)
}

fn entry_name(index: u64) -> String {
    format!("{index:020}.json")
}

/// Reads `dir/name` as JSON; a missing file is `None`.
pub(super) fn read_json<T: DeserializeOwned>(dir: &Path, name: &str) -> Result<Option<T>, Error> {
    let p = dir.join(name);
    match fs::read(&p) {
        Ok(b) => serde_json::from_slice(&b)
            .map(Some)
            .map_err(|e| Error::failed(format!("{}: {e}", p.display()))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::failed(format!("cannot read {}: {e}", p.display()))),
    }
}

/// Writes `dir/name` as JSON, whole, readable by root only.
pub(super) fn write_json<T: Serialize>(dir: &Path, name: &str, v: &T) -> Result<(), Error> {
    let bytes = serde_json::to_vec(v).expect("raft state serialises");
    write_atomic(dir, name, &bytes, 0o600)
}

impl FileLog {
    /// Opens the log in `dir` (created if missing). Entries at or before the purge point are
    /// removed (a purge that a crash cut short).
    pub fn open(dir: &Path) -> Result<FileLog, Error> {
        let logdir = dir.join("log");
        fs::create_dir_all(&logdir)
            .with_context(|| format!("cannot create {}", logdir.display()))?;
        let vote = read_json(dir, "vote.json")?;
        let committed = read_json(dir, "committed.json")?;
        let purged: Option<LogId<NodeId>> = read_json(dir, "purged.json")?;
        let mut log = BTreeMap::new();
        let names = fs::read_dir(&logdir).with_context(|| format!("{}", logdir.display()))?;
        for n in names.flatten() {
            let name = n.file_name().to_string_lossy().into_owned();
            let Some(index) = name
                .strip_suffix(".json")
                .and_then(|i| i.parse::<u64>().ok())
            else {
                continue;
            };
            if purged.is_some_and(|p| index <= p.index) {
                let _ = fs::remove_file(n.path());
                continue;
            }
            let e: Entry = read_json(&logdir, &name)?.expect("listed just now");
            log.insert(index, e);
        }
        Ok(FileLog {
            inner: Arc::new(Mutex::new(Inner {
                dir: dir.to_owned(),
                vote,
                committed,
                purged,
                log,
            })),
        })
    }
}

impl RaftLogReader<Kiln> for FileLog {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + Send>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry>, StorageError> {
        let i = self.inner.lock().await;
        Ok(i.log.range(range).map(|(_, e)| e.clone()).collect())
    }
}

impl RaftLogStorage<Kiln> for FileLog {
    type LogReader = Self;

    async fn get_log_state(&mut self) -> Result<LogState<Kiln>, StorageError> {
        let i = self.inner.lock().await;
        let last = i.log.values().next_back().map(|e| e.log_id).or(i.purged);
        Ok(LogState {
            last_purged_log_id: i.purged,
            last_log_id: last,
        })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote<NodeId>) -> Result<(), StorageError> {
        let mut i = self.inner.lock().await;
        write_json(&i.dir, "vote.json", vote)
            .map_err(|e| io_err(ErrorSubject::Vote, ErrorVerb::Write, e))?;
        i.vote = Some(*vote);
        Ok(())
    }

    async fn read_vote(&mut self) -> Result<Option<Vote<NodeId>>, StorageError> {
        Ok(self.inner.lock().await.vote)
    }

    async fn save_committed(&mut self, c: Option<LogId<NodeId>>) -> Result<(), StorageError> {
        let mut i = self.inner.lock().await;
        write_json(&i.dir, "committed.json", &c)
            .map_err(|e| io_err(ErrorSubject::Store, ErrorVerb::Write, e))?;
        i.committed = c;
        Ok(())
    }

    async fn read_committed(&mut self) -> Result<Option<LogId<NodeId>>, StorageError> {
        Ok(self.inner.lock().await.committed)
    }

    async fn append<I>(
        &mut self,
        entries: I,
        callback: LogFlushed<Kiln>,
    ) -> Result<(), StorageError>
    where
        I: IntoIterator<Item = Entry> + Send,
        I::IntoIter: Send,
    {
        let mut i = self.inner.lock().await;
        let logdir = i.dir.join("log");
        for e in entries {
            let r = write_json(&logdir, &entry_name(e.log_id.index), &e);
            if let Err(msg) = r {
                let err = std::io::Error::other(msg.clone());
                callback.log_io_completed(Err(err));
                return Err(io_err(ErrorSubject::Logs, ErrorVerb::Write, msg));
            }
            i.log.insert(e.log_id.index, e);
        }
        // Each entry was synced with its directory as it was written.
        callback.log_io_completed(Ok(()));
        Ok(())
    }

    async fn truncate(&mut self, log_id: LogId<NodeId>) -> Result<(), StorageError> {
        let mut i = self.inner.lock().await;
        let doomed: Vec<u64> = i.log.range(log_id.index..).map(|(k, _)| *k).collect();
        // From the end backwards: a crash leaves a shorter log, never one with a hole.
        for k in doomed.into_iter().rev() {
            let p = i.dir.join("log").join(entry_name(k));
            match fs::remove_file(&p) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(io_err(ErrorSubject::Logs, ErrorVerb::Delete, e)),
            }
            i.log.remove(&k);
        }
        Ok(())
    }

    async fn purge(&mut self, log_id: LogId<NodeId>) -> Result<(), StorageError> {
        let mut i = self.inner.lock().await;
        // The purge point first: entries at or before it are dropped at the next open even if
        // a crash interrupts the removal below.
        write_json(&i.dir, "purged.json", &log_id)
            .map_err(|e| io_err(ErrorSubject::Logs, ErrorVerb::Write, e))?;
        i.purged = Some(log_id);
        let doomed: Vec<u64> = i.log.range(..=log_id.index).map(|(k, _)| *k).collect();
        for k in doomed {
            let _ = fs::remove_file(i.dir.join("log").join(entry_name(k)));
            i.log.remove(&k);
        }
        Ok(())
    }
}
