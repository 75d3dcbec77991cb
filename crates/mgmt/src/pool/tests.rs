//! The pool's store against openraft's own storage test suite, and across a reopen.

use openraft::storage::{RaftLogStorage, RaftStateMachine};
use openraft::testing::{StoreBuilder, Suite};
use openraft::{CommittedLeaderId, Entry, EntryPayload, LogId, RaftLogReader, Vote};
use tempfile::TempDir;

use super::log::FileLog;
use super::sm::Sm;
use super::types::{Cmd, Kiln, Outcome, StorageError};

struct Files;

impl StoreBuilder<Kiln, FileLog, Sm, TempDir> for Files {
    async fn build(&self) -> Result<(TempDir, FileLog, Sm), StorageError> {
        let d = TempDir::new().expect("a temporary directory");
        let log = FileLog::open(d.path()).expect("a new log");
        let sm = Sm::open(d.path()).expect("a new state machine");
        Ok((d, log, sm))
    }
}

#[test]
fn the_store_passes_openraft_s_storage_suite() {
    Suite::test_all(Files).expect("openraft's storage suite");
}

fn put(term: u64, index: u64, key: &str, expect: Option<u64>) -> Entry<Kiln> {
    Entry {
        log_id: LogId::new(CommittedLeaderId::new(term, 1), index),
        payload: EntryPayload::Normal(Cmd::Put {
            key: key.into(),
            value: serde_json::json!({ "at": index }),
            expect,
        }),
    }
}

#[test]
fn the_log_the_vote_and_the_store_survive_a_reopen() {
    let d = TempDir::new().unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut log = FileLog::open(d.path()).unwrap();
        let mut sm = Sm::open(d.path()).unwrap();
        let vote = Vote::new(3, 1);
        log.save_vote(&vote).await.unwrap();
        let entries: Vec<_> = (1..=4).map(|i| put(3, i, "vol/a", None)).collect();
        // The append's flush callback is openraft's; a store written through and read back
        // is what the test checks.
        for e in &entries {
            let d2 = d.path().join("log");
            super::log::write_json(&d2, &format!("{:020}.json", e.log_id.index), e).unwrap();
        }
        log.purge(entries[0].log_id).await.unwrap();
        let out = sm.apply(entries.clone()).await.unwrap();
        assert_eq!(out[3], Outcome::Done { version: 4 });
        // A put that expects a version the key no longer has is refused, and says why.
        let stale = sm.apply([put(3, 5, "vol/a", Some(2))]).await.unwrap();
        assert_eq!(stale, vec![Outcome::Conflict { have: 4 }]);
        let fresh = sm.apply([put(3, 6, "vol/b", Some(0))]).await.unwrap();
        assert_eq!(fresh, vec![Outcome::Done { version: 6 }]);

        let mut log = FileLog::open(d.path()).unwrap();
        assert_eq!(log.read_vote().await.unwrap(), Some(vote));
        let st = log.get_log_state().await.unwrap();
        assert_eq!(st.last_purged_log_id, Some(entries[0].log_id));
        assert_eq!(st.last_log_id, Some(entries[3].log_id));
        let kept = log.try_get_log_entries(0..10).await.unwrap();
        assert_eq!(
            kept.iter().map(|e| e.log_id.index).collect::<Vec<_>>(),
            [2, 3, 4]
        );
        let sm = Sm::open(d.path()).unwrap();
        let data = sm.read();
        assert_eq!(data.version(), 6);
        assert_eq!(data.kv["vol/a"].version, 4);
        assert_eq!(data.kv["vol/b"].version, 6);
    });
}
