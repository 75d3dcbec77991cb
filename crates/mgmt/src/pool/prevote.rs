//! Elections only when a majority has lost its leader (pre-vote).
//!
//! openraft 0.9 has no pre-vote: a member cut off from the others keeps starting elections,
//! each with a higher term, and when it returns the leader sees that term in its replies and
//! steps down — the pool is leaderless for seconds, and the returning member may even win.
//! So openraft's own election timer is off (`enable_elect: false`) and this module decides
//! when to start one ([`campaign`]):
//!
//! - every member notes when it last heard from a leader ([`Heard`]: an `AppendEntries` or a
//!   snapshot chunk it accepted; the leader itself while a quorum acknowledges it);
//! - a voter that has heard nothing for its timeout (the leader lease plus a random
//!   [`MIN_WAIT`]..[`MAX_WAIT`], drawn anew each time) asks the other voters whether they
//!   would vote for it ([`PreVote`]); each grants only if it has not heard from a leader for
//!   a whole lease either (so openraft's own lease check will not refuse the real vote) and
//!   the asker's log is at least as new as its own;
//! - with a majority of grants (its own included), and still no leader heard meanwhile, it
//!   starts the real election (`trigger().elect()`); without, nothing changes: no term is
//!   spent.
//!
//! A member cut off alone never gets a majority, so it comes back at the term it left with,
//! and the leader's heartbeats carry on. A majority that lost its leader elects within the
//! lease + [`MAX_WAIT`] + the asking (3.5–6.5 s with the pool's settings).
//!
//! A kilnd from before pre-vote answers the question with "unknown variant": that counts as
//! a grant (it decides by openraft's rules alone when the vote comes), so in a pool being
//! upgraded a member cut off from the leader but not from an old member can still unseat the
//! leader when it returns, as before.

use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::{Duration, Instant};

use kiln_proto::sync::{MutexExt as _, RwLockExt as _};
use openraft::LogId;
use serde::{Deserialize, Serialize};

use super::link::{CallError, Link};
use super::types::{Msg, NodeId, Raft, Rpc};

/// How long a member waits, beyond the lease, before it asks: drawn from this range.
pub const MIN_WAIT: Duration = Duration::from_millis(500);
/// See [`MIN_WAIT`].
pub const MAX_WAIT: Duration = Duration::from_millis(2000);
/// How often a member looks whether to ask.
const TICK: Duration = Duration::from_millis(100);
/// How long an asker waits for the answers.
const ASK_PATIENCE: Duration = Duration::from_millis(1000);

/// "Would you vote for me?": the asker's last log entry.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct PreVote {
    /// The asker's id.
    pub from: NodeId,
    /// The id of the asker's last log entry (None: an empty log).
    pub last_log_id: Option<LogId<NodeId>>,
}

/// The answer to a [`PreVote`].
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct PreVoteReply {
    /// Whether this member would vote for the asker now.
    pub granted: bool,
}

/// When this member last heard from a leader (or started).
pub struct Heard(Mutex<Instant>);

impl Default for Heard {
    fn default() -> Heard {
        Heard(Mutex::new(Instant::now()))
    }
}

impl Heard {
    /// A leader was heard from just now.
    pub fn now(&self) {
        *self.0.locked() = Instant::now();
    }

    /// How long ago.
    fn ago(&self) -> Duration {
        self.0.locked().elapsed()
    }
}

/// Whether this member, running `raft` with leader lease `lease`, would vote for the asker
/// of `req` now.
pub fn answer(raft: &Raft, heard: &Heard, lease: Duration, req: &PreVote) -> PreVoteReply {
    let m = raft.metrics().borrow().clone();
    let leads_well = m.current_leader == Some(m.id)
        && m.millis_since_quorum_ack
            .is_some_and(|ms| Duration::from_millis(ms) < lease);
    let last = raft.data_metrics().borrow().last_log;
    let granted = !leads_well && heard.ago() >= lease && req.last_log_id >= last;
    if !granted {
        tracing::debug!(
            "pool: no pre-vote for {:016x} (leads: {leads_well}, heard a leader {:?} ago, \
             its log {:?}, ours {last:?})",
            req.from,
            heard.ago(),
            req.last_log_id
        );
    }
    PreVoteReply { granted }
}

/// This member's side: looks every [`TICK`] whether the leader has been silent for its
/// timeout and, if so, asks the other voters; starts an election when a majority would vote
/// for it. Runs until the pool it serves is gone (`raft` cannot be upgraded).
pub async fn campaign(
    id: NodeId,
    raft: Weak<RwLock<Raft>>,
    link: Arc<dyn Link>,
    heard: Arc<Heard>,
    lease: Duration,
) {
    let mut wait = lease + draw();
    // When this member last asked: its own asking is not a leader heard from (it answers
    // others by `heard` alone), but the next ask is a whole timeout later.
    let mut asked = Instant::now();
    loop {
        tokio::time::sleep(TICK).await;
        let Some(r) = raft.upgrade() else {
            return;
        };
        let raft = r.read_locked().clone();
        drop(r);
        let m = raft.metrics().borrow().clone();
        let membership = m.membership_config.membership().clone();
        let voters: Vec<NodeId> = membership.voter_ids().collect();
        if m.current_leader == Some(id) {
            // Only while a quorum acknowledges it: a leader cut off from its followers (openraft
            // 0.9 never steps down for that) must not refuse the others' pre-votes forever.
            if m.millis_since_quorum_ack
                .is_some_and(|ms| Duration::from_millis(ms) < lease)
            {
                heard.now();
            }
            continue;
        }
        if !voters.contains(&id) || heard.ago().min(asked.elapsed()) < wait {
            continue;
        }
        asked = Instant::now();
        wait = lease + draw();
        if voters.len() > 1 {
            let last_log_id = raft.data_metrics().borrow().last_log;
            let others: Vec<(NodeId, String)> = voters
                .iter()
                .filter(|v| **v != id)
                .filter_map(|v| Some((*v, membership.get_node(v)?.addr.clone())))
                .collect();
            let req = PreVote {
                from: id,
                last_log_id,
            };
            let granted = 1 + ask(&link, &others, &req).await;
            // A leader heard from while asking (another voter won meanwhile) stands: an
            // election now would only unseat it. (Not "a leader named": followers keep naming
            // the lost one until another is elected.)
            if heard.ago() < lease {
                continue;
            }
            if granted * 2 <= voters.len() {
                tracing::debug!(
                    "pool: no leader heard, and only {granted} of {} voters would elect \
                     this kilnd: no election",
                    voters.len()
                );
                continue;
            }
            tracing::info!(
                "pool: no leader heard; {granted} of {} voters would elect this kilnd: \
                 starting an election",
                voters.len()
            );
        }
        let _ = raft.trigger().elect().await;
    }
}

/// A random wait in [`MIN_WAIT`]..[`MAX_WAIT`], so that members that lost their leader
/// together do not all ask at once.
fn draw() -> Duration {
    let mut b = [0u8; 8];
    let r = crate::files::random(&mut b).map_or(0, |_| u64::from_le_bytes(b));
    let span = (MAX_WAIT - MIN_WAIT).as_millis() as u64;
    MIN_WAIT + Duration::from_millis(r % span.max(1))
}

/// Asks each of `others` (id, management address) `req`; how many granted within
/// [`ASK_PATIENCE`]. A member too old to know the question answers by openraft's own rules
/// when the election comes: it counts as granting.
async fn ask(link: &Arc<dyn Link>, others: &[(NodeId, String)], req: &PreVote) -> usize {
    let mut asks = tokio::task::JoinSet::new();
    for (to, addr) in others {
        let msg = Msg::Raft {
            to: *to,
            rpc: Rpc::PreVote,
            body: serde_json::to_value(req).expect("a pre-vote serialises"),
        };
        let (link, addr) = (link.clone(), addr.clone());
        asks.spawn_blocking(move || -> bool {
            let Ok(sa) = addr.parse() else {
                return false;
            };
            let msg = serde_json::to_value(msg).expect("a pre-vote serialises");
            let reply = link
                .connect(sa)
                .and_then(|mut c| c.call(&msg, Some(ASK_PATIENCE)).map_err(CallError::into));
            match reply {
                Ok(v) => granted(v),
                Err(e) => {
                    let e = e.message();
                    e.contains("unknown variant") && e.contains("pre-vote")
                }
            }
        });
    }
    let mut granted = 0;
    let _ = tokio::time::timeout(ASK_PATIENCE, async {
        while let Some(r) = asks.join_next().await {
            granted += usize::from(r.unwrap_or(false));
        }
    })
    .await;
    // Answers still on their way are not waited for (their threads end with their calls).
    asks.detach_all();
    granted
}

/// Whether a `raft` reply to a pre-vote grants it.
fn granted(v: serde_json::Value) -> bool {
    let reply = v.get("reply").cloned().unwrap_or_default();
    serde_json::from_value::<Result<PreVoteReply, String>>(reply)
        .is_ok_and(|r| r.is_ok_and(|r| r.granted))
}
