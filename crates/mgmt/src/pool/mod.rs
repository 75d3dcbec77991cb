//! The trusted storage pool: the kilnds that share management state, kept on Raft
//! (openraft, pinned) so that every member holds the same store and any majority of voters
//! can change it.
//!
//! Each member has a random id (`STATE_DIR/pool/node-id`, chosen when the directory was new)
//! and an address (its management port). A kilnd alone is a pool of one: it initialises
//! itself on its first change, with no configuration. `kiln peer probe HOST` on a member adds
//! HOST's kilnd — which must be alone and hold nothing — as a learner, waits for it to catch
//! up, then makes it a voter; `peer detach` removes a member and tells it to forget the pool.
//!
//! Changes are made on the leader: a member that is not forwards them there (one hop, over
//! the same authenticated management connection as every kilnd-to-kilnd call). A change is
//! applied once a majority of voters have it in their logs; without a majority it waits up to
//! [`WRITE_PATIENCE`] and fails with an error that says so. Reads are served from the
//! member's own copy and say which version (log index) they saw.
//!
//! Files (all mode 0600, in `STATE_DIR/pool/`): see [`log`] for the log and vote, [`sm`] for
//! the store and its snapshots.

pub mod link;
pub mod log;
pub mod net;
pub mod prevote;
pub mod sm;
pub mod types;

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use kiln_proto::sync::{MutexExt as _, RwLockExt as _};
use openraft::raft::{AppendEntriesResponse, InstallSnapshotRequest};
use openraft::{BasicNode, ChangeMembers, Config, ServerState};
use serde::de::DeserializeOwned;

use crate::files::random;
use kiln_proto::error::Context as _;
use kiln_proto::Error;
pub use link::{CallError, Channel, Link};
pub use types::{Cmd, Kv, NodeId, Outcome, Raft, Versioned};
use types::{Joined, Msg, PoolMember, PoolView, Written};

/// openraft's leader lease (its `election_timeout_max`).
const LEASE: Duration = Duration::from_millis(3000);

/// How long a change waits for a leader and a majority before it fails.
pub const WRITE_PATIENCE: Duration = Duration::from_secs(10);

/// This kilnd's membership in the pool.
pub struct Pool {
    id: NodeId,
    dir: PathBuf,
    link: Arc<dyn Link>,
    rt: tokio::runtime::Handle,
    /// Shared with the campaign ([`prevote::campaign`]), which ends when the pool is gone.
    raft: Arc<RwLock<Raft>>,
    /// When this member last heard from a leader ([`prevote`]).
    heard: Arc<prevote::Heard>,
    sm: RwLock<sm::Sm>,
    /// This kilnd's management address as other members reach it.
    addr: Mutex<SocketAddr>,
    /// Changes of membership and resets, one at a time.
    changing: Mutex<()>,
    /// Called (on a blocking thread) after this member applies changes.
    on_applied: Mutex<Option<Hook>>,
}

type Hook = Arc<dyn Fn() + Send + Sync>;

fn config() -> Arc<Config> {
    let c = Config {
        cluster_name: "kiln".into(),
        // A heartbeat's reply must come back within the interval (openraft's timeout for
        // AppendEntries): 500 ms leaves room for a follower's fsyncs on a slow disk.
        heartbeat_interval: 500,
        election_timeout_min: 1500,
        // Also openraft's leader lease: a voter that heard from its leader this recently
        // refuses to vote for another.
        election_timeout_max: LEASE.as_millis() as u64,
        // Elections are started by the pre-vote campaign instead (see [`prevote`]).
        enable_elect: false,
        ..Default::default()
    };
    Arc::new(c.validate().expect("the pool's Raft settings are valid"))
}

/// Reads this member's id, choosing one when there is none.
fn node_id(dir: &Path) -> Result<NodeId, Error> {
    if let Some(id) = log::read_json::<NodeId>(dir, "node-id")? {
        return Ok(id);
    }
    let mut b = [0u8; 8];
    random(&mut b)?;
    // Never 0: openraft's initial vote names node 0.
    let id = u64::from_le_bytes(b).max(1);
    log::write_json(dir, "node-id", &id)?;
    tracing::info!("pool: this kilnd is member {id:016x}");
    Ok(id)
}

async fn start(id: NodeId, dir: &Path, link: &Arc<dyn Link>) -> Result<(Raft, sm::Sm), Error> {
    let store = log::FileLog::open(dir)?;
    let sm = sm::Sm::open(dir)?;
    let net = net::Net { link: link.clone() };
    let raft = Raft::new(id, config(), net, store, sm.clone())
        .await
        .map_err(|e| Error::failed(format!("cannot start the pool's Raft: {e}")))?;
    Ok((raft, sm))
}

/// The address a member is named by: its management address, with an unspecified IP taken
/// as loopback.
fn member_addr(a: SocketAddr) -> SocketAddr {
    if a.ip().is_unspecified() {
        SocketAddr::new(std::net::Ipv4Addr::LOCALHOST.into(), a.port())
    } else {
        a
    }
}

impl Pool {
    /// Opens (or creates) this kilnd's pool state in `state/pool` and starts its Raft on the
    /// current Tokio runtime; `addr` is the management address it serves on.
    pub async fn open(state: &Path, link: Arc<dyn Link>, addr: SocketAddr) -> Result<Pool, Error> {
        let dir = state.join("pool");
        fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
        let id = node_id(&dir)?;
        let (raft, sm) = start(id, &dir, &link).await?;
        // The only voter of its pool (a restart of a pool of one) elects itself at once.
        let m = raft.metrics().borrow().clone();
        let voters: Vec<NodeId> = m.membership_config.membership().voter_ids().collect();
        if voters == [id] {
            let _ = raft.trigger().elect().await;
        }
        let raft = Arc::new(RwLock::new(raft));
        let heard = Arc::new(prevote::Heard::default());
        let campaign = prevote::campaign(
            id,
            Arc::downgrade(&raft),
            link.clone(),
            heard.clone(),
            LEASE,
        );
        tokio::spawn(campaign);
        Ok(Pool {
            id,
            dir,
            link,
            rt: tokio::runtime::Handle::current(),
            raft,
            heard,
            sm: RwLock::new(sm),
            addr: Mutex::new(member_addr(addr)),
            changing: Mutex::new(()),
            on_applied: Mutex::new(None),
        })
    }

    /// Calls `f` after each batch of changes this member applies, and logs changes of
    /// leader (openraft's own logs are off by default: `KILN_LOG=openraft=info`).
    pub fn on_applied(&self, f: impl Fn() + Send + Sync + 'static) {
        *self.on_applied.locked() = Some(Arc::new(f));
        self.watch();
    }

    /// Follows the current Raft's metrics until it shuts down (a reset starts another).
    fn watch(&self) {
        let hook = self.on_applied.locked().clone();
        let mut rx = self.raft().metrics();
        let me = self.id;
        self.rt.spawn(async move {
            let (mut applied, mut leader) = (None, None);
            loop {
                let m = rx.borrow_and_update().clone();
                // Leadership of this member counts once a quorum acknowledged it: a restarted
                // ex-leader that Raft restores as leader of its old term, and whose followers
                // moved on, is never said to lead.
                let unconfirmed =
                    m.current_leader == Some(me) && m.millis_since_quorum_ack.is_none();
                if m.current_leader != leader && !unconfirmed {
                    leader = m.current_leader;
                    match leader {
                        Some(l) if l == me => {
                            tracing::info!("pool: this kilnd leads (term {})", m.current_term)
                        }
                        Some(l) => {
                            tracing::info!("pool: leader {l:016x} (term {})", m.current_term)
                        }
                        None => tracing::info!("pool: no leader (term {})", m.current_term),
                    }
                }
                if m.last_applied != applied {
                    applied = m.last_applied;
                    if let Some(h) = &hook {
                        let h = h.clone();
                        let _ = tokio::task::spawn_blocking(move || h()).await;
                    }
                }
                if rx.changed().await.is_err() {
                    return;
                }
            }
        });
    }

    /// Waits up to `t` for this member to apply another change.
    pub fn wait_applied(&self, t: Duration) {
        let raft = self.raft();
        let mut rx = raft.metrics();
        let now = rx.borrow_and_update().last_applied;
        let _ = self.within(t, async {
            while rx.changed().await.is_ok() {
                if rx.borrow_and_update().last_applied != now {
                    return;
                }
            }
        });
    }

    /// This member's id.
    pub fn id(&self) -> NodeId {
        self.id
    }

    fn raft(&self) -> Raft {
        self.raft.read_locked().clone()
    }

    fn sm(&self) -> sm::Sm {
        self.sm.read_locked().clone()
    }

    fn my_addr(&self) -> SocketAddr {
        *self.addr.locked()
    }

    /// Runs `f` on the runtime from a blocking thread (MGMT requests are answered on those).
    fn block_on<F: std::future::Future>(&self, f: F) -> F::Output {
        self.rt.block_on(f)
    }

    /// Runs `f` on the pool's runtime for at most `t`. The timeout is made inside the runtime's
    /// context: callers include service threads outside any runtime.
    fn within<F: std::future::Future>(
        &self,
        t: std::time::Duration,
        f: F,
    ) -> Result<F::Output, tokio::time::error::Elapsed> {
        let _in = self.rt.enter();
        self.rt.block_on(tokio::time::timeout(t, f))
    }

    /// The value of `key` and its version, as this member last applied it, with the store's
    /// version.
    pub fn get(&self, key: &str) -> (Option<Versioned>, u64) {
        let sm = self.sm();
        let d = sm.read();
        (d.kv.get(key).cloned(), d.version())
    }

    /// The version of the store this member has applied (a log index).
    pub fn version(&self) -> u64 {
        self.sm().read().version()
    }

    /// Every key under `prefix`, with the store's version.
    pub fn scan(&self, prefix: &str) -> (Vec<(String, Versioned)>, u64) {
        let sm = self.sm();
        let d = sm.read();
        let kv =
            d.kv.range(prefix.to_owned()..)
                .take_while(|(k, _)| k.starts_with(prefix))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
        (kv, d.version())
    }

    /// Whether this kilnd has been part of a pool (its own, or one that added it).
    fn initialized(&self) -> bool {
        self.block_on(self.raft().is_initialized()).unwrap_or(false)
    }

    /// Makes this kilnd a pool of one if it belongs to none.
    fn ensure_initialized(&self) -> Result<(), Error> {
        if self.initialized() {
            return Ok(());
        }
        let _one = self.changing.locked();
        if self.initialized() {
            return Ok(());
        }
        let me = BTreeMap::from([(self.id, BasicNode::new(self.my_addr().to_string()))]);
        let raft = self.raft();
        self.block_on(async {
            raft.initialize(me)
                .await
                .map_err(|e| Error::failed(format!("cannot start a pool of one: {e}")))?;
            // Alone, it need not wait out an election timeout.
            let _ = raft.trigger().elect().await;
            raft.wait(Some(WRITE_PATIENCE))
                .state(ServerState::Leader, "a pool of one elects itself")
                .await
                .map_err(|e| {
                    Error::failed(format!("this kilnd did not become its pool's leader: {e}"))
                })?;
            tracing::info!("pool: started a pool of one (member {:016x})", self.id);
            Ok(())
        })
    }

    /// The leader's id and address, if this member knows one.
    pub fn leader(&self) -> Option<(NodeId, String)> {
        let m = self.raft().metrics().borrow().clone();
        let id = m.current_leader?;
        let node = m.membership_config.membership().get_node(&id)?.addr.clone();
        Some((id, node))
    }

    /// Where a change must be made: `None` when this member is the leader (it makes it), or
    /// the leader's address. A pool of none becomes a pool of one first; without a leader,
    /// waits for one (up to [`WRITE_PATIENCE`]).
    pub fn change_at(&self) -> Result<Option<SocketAddr>, Error> {
        self.change_at_until(Instant::now() + WRITE_PATIENCE)
    }

    /// [`Pool::change_at`], waiting for a leader until `deadline`.
    fn change_at_until(&self, deadline: Instant) -> Result<Option<SocketAddr>, Error> {
        self.ensure_initialized()?;
        loop {
            if let Some((id, addr)) = self.leader() {
                if id == self.id {
                    return Ok(None);
                }
                return addr
                    .parse()
                    .map(Some)
                    .map_err(|e| Error::failed(format!("leader address {addr}: {e}")));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(self.no_majority());
            }
            let mut rx = self.raft().metrics();
            let _ = self.within(left, rx.changed());
        }
    }

    fn no_majority(&self) -> Error {
        let m = self.raft().metrics().borrow().clone();
        let voters = m.membership_config.membership().voter_ids().count();
        Error::unavailable(format!(
            "the pool has no leader: fewer than a majority of its {voters} voters can reach \
             each other (changes wait until a majority is back; volumes keep serving)"
        ))
    }

    /// Runs `send` on a channel to the leader and returns its result, or `None` when this
    /// member is the leader (the caller makes the change). A leader that cannot be reached (it
    /// died, and the others have not elected another yet) is tried again once there is a new
    /// one, up to [`WRITE_PATIENCE`]; a channel that was open is never used twice, so a
    /// request the leader took is not sent again.
    pub fn via_leader<R>(
        &self,
        send: impl Fn(&mut dyn Channel) -> Result<R, CallError>,
    ) -> Result<Option<R>, Error> {
        self.via_leader_until(send, Instant::now() + WRITE_PATIENCE)
    }

    /// [`Pool::via_leader`] with one deadline for finding the leader and reaching it: past
    /// it, whatever stood in the way (no leader, a leader this member cannot reach), the
    /// answer is the same — there is no majority here ([`Pool::no_majority`]).
    fn via_leader_until<R>(
        &self,
        send: impl Fn(&mut dyn Channel) -> Result<R, CallError>,
        deadline: Instant,
    ) -> Result<Option<R>, Error> {
        loop {
            let Some(leader) = self.change_at_until(deadline)? else {
                return Ok(None);
            };
            match self.link.connect(leader) {
                Ok(mut c) => {
                    return send(&mut *c).map(Some).map_err(|e| match e {
                        // The leader's own refusal, as it said it.
                        CallError::Refused(e) => e,
                        CallError::Broken(e) => Error::unavailable(format!(
                            "the pool's leader at {leader} failed during the command ({e}): \
                             it was made or not — `info` on any member shows which"
                        )),
                    });
                }
                Err(e) => {
                    tracing::debug!(%leader, "cannot reach the pool's leader: {e}");
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(self.no_majority());
                    }
                    // Wait for the members to notice and elect another.
                    let mut rx = self.raft().metrics();
                    let step = left.min(Duration::from_millis(300));
                    let _ = self.within(step, rx.changed());
                }
            }
        }
    }

    /// [`Pool::via_leader`] for one request whose reply is `R`.
    pub fn forward<R: DeserializeOwned>(
        &self,
        req: &impl serde::Serialize,
    ) -> Result<Option<R>, Error> {
        let req = serde_json::to_value(req).expect("a request serialises");
        self.via_leader(|c| {
            let v = c.call(&req, None)?;
            serde_json::from_value(v).map_err(|e| CallError::Broken(format!("bad reply: {e}")))
        })
    }

    /// Applies `cmd`, on the leader (forwarded there when this member is not it), within one
    /// [`WRITE_PATIENCE`] for all of it.
    pub fn write(&self, cmd: Cmd) -> Result<Written, Error> {
        let deadline = Instant::now() + WRITE_PATIENCE;
        loop {
            let req = serde_json::to_value(Msg::PoolWrite {
                change: cmd.clone(),
            })
            .expect("a request serialises");
            let forwarded = self.via_leader_until(
                |c| {
                    // The leader takes its own patience for the change: a reply cut short
                    // would say "made or not" of a change it goes on to make.
                    let v = c.call(&req, Some(WRITE_PATIENCE + Duration::from_secs(2)))?;
                    serde_json::from_value::<Written>(v)
                        .map_err(|e| CallError::Broken(format!("bad reply: {e}")))
                },
                deadline,
            )?;
            match forwarded {
                Some(w) => return Ok(w),
                None => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    let r = self.within(left, self.raft().client_write(cmd.clone()));
                    match r {
                        Ok(Ok(resp)) => {
                            return Ok(Written {
                                outcome: resp.data,
                                version: resp.log_id.index,
                            })
                        }
                        // Leadership moved while the change waited: ask again where to make it.
                        Ok(Err(e)) if e.forward_to_leader().is_some() => {
                            if Instant::now() >= deadline {
                                return Err(self.no_majority());
                            }
                        }
                        Ok(Err(e)) => {
                            return Err(Error::failed(format!("the pool refused the change: {e}")))
                        }
                        Err(_) => {
                            return Err(Error::unavailable(format!(
                                "{}; the change may still be made if the majority returns",
                                self.no_majority()
                            )))
                        }
                    }
                }
            }
        }
    }

    /// One request to the member at `addr` and its reply.
    pub fn call<R: DeserializeOwned>(
        &self,
        addr: SocketAddr,
        req: &impl serde::Serialize,
    ) -> Result<R, Error> {
        let req = serde_json::to_value(req).expect("a request serialises");
        let v = self.link.connect(addr)?.call(&req, None)?;
        serde_json::from_value(v).map_err(|e| Error::failed(format!("{addr}: bad reply: {e}")))
    }

    /// Answers a Raft RPC from another member.
    pub fn serve_rpc(
        &self,
        to: NodeId,
        rpc: types::Rpc,
        body: serde_json::Value,
    ) -> Result<serde_json::Value, Error> {
        if to != self.id {
            return Err(Error::failed(format!(
                "this kilnd is pool member {:016x}, not {to:016x} (its state directory was \
                 replaced?)",
                self.id
            )));
        }
        let raft = self.raft();
        let bad = |e: serde_json::Error| Error::invalid(format!("bad raft {rpc:?} message: {e}"));
        Ok(match rpc {
            types::Rpc::Append => {
                let r =
                    self.block_on(raft.append_entries(serde_json::from_value(body).map_err(bad)?));
                // Accepted from a leader of this term or newer (else it says ours is higher).
                if matches!(&r, Ok(a) if !matches!(a, AppendEntriesResponse::HigherVote(_))) {
                    self.heard.now();
                }
                to_json(&r)
            }
            types::Rpc::PreVote => {
                let req = serde_json::from_value(body).map_err(bad)?;
                let r: Result<_, String> = Ok(prevote::answer(&raft, &self.heard, LEASE, &req));
                to_json(&r)
            }
            types::Rpc::Vote => {
                let r = self.block_on(raft.vote(serde_json::from_value(body).map_err(bad)?));
                to_json(&r)
            }
            types::Rpc::Snapshot => {
                let req: InstallSnapshotRequest<types::Kiln> =
                    serde_json::from_value(body).map_err(bad)?;
                let theirs = req.vote;
                let r = self.block_on(raft.install_snapshot(req));
                // A chunk accepted from a leader (our vote is now its) renews openraft's lease
                // as a heartbeat does.
                if r.as_ref().is_ok_and(|s| s.vote == theirs) {
                    self.heard.now();
                }
                to_json(&r)
            }
        })
    }

    /// What a prober needs to know of this kilnd: its id and whether it may join a pool
    /// (alone, holding nothing). With `prepare`, a kilnd that may join forgets the pool of one
    /// it made for itself so that the prober's can take it in.
    pub fn join_info(&self, prepare: bool) -> Result<Joined, Error> {
        let view = self.view(false);
        let keys = self.sm().read().kv.len();
        let others = view.members.iter().filter(|m| m.id != self.id).count();
        let joinable = others == 0 && keys == 0;
        if prepare && joinable && self.initialized() {
            self.reset()?;
        }
        Ok(Joined {
            id: self.id,
            addr: self.my_addr().to_string(),
            members: view.members.len(),
            keys,
            joinable,
        })
    }

    /// Forgets the pool: stops Raft, removes its log and store, and starts again as a kilnd
    /// in no pool (the node id stays).
    pub fn reset(&self) -> Result<(), Error> {
        let _one = self.changing.locked();
        let old = self.raft();
        let _ = self.block_on(old.shutdown());
        for f in [
            "vote.json",
            "committed.json",
            "purged.json",
            "sm.json",
            "snapshot.json",
        ] {
            let _ = fs::remove_file(self.dir.join(f));
        }
        let _ = fs::remove_dir_all(self.dir.join("log"));
        let (raft, sm) = self.block_on(start(self.id, &self.dir, &self.link))?;
        *self.raft.write_locked() = raft;
        *self.sm.write_locked() = sm;
        self.heard.now();
        self.watch();
        tracing::info!("pool: left the pool; this kilnd is in none now");
        Ok(())
    }

    /// Adds the kilnd at `addr` (on the leader): it must be alone and hold nothing. Returns
    /// its id.
    pub fn probe(&self, addr: SocketAddr) -> Result<Joined, Error> {
        let joined: Joined = self.call(addr, &Msg::PoolJoin { prepare: false })?;
        if joined.id == self.id {
            return Err(Error::conflict(format!("{addr} is this kilnd")));
        }
        let members = self.view(false).members;
        if let Some(m) = members.iter().find(|m| m.id == joined.id) {
            return Err(Error::exists(format!(
                "{addr} is already in the pool (as {})",
                m.addr
            )));
        }
        if !joined.joinable {
            return Err(Error::conflict(format!(
                "the kilnd at {addr} is in another pool ({} members, {} keys): detach it \
                 there first (or start it on an empty state directory)",
                joined.members, joined.keys
            )));
        }
        let _: Joined = self.call(addr, &Msg::PoolJoin { prepare: true })?;
        let _one = self.changing.locked();
        let raft = self.raft();
        // Alone with a loopback address, this member names itself by the address the new one
        // reaches it on, or the new one could not reach it back.
        if members.len() <= 1 && self.my_addr().ip().is_loopback() && !addr.ip().is_loopback() {
            let ip = self.link.connect(addr)?.local_ip()?;
            let me = SocketAddr::new(ip, self.my_addr().port());
            let set = BTreeMap::from([(self.id, BasicNode::new(me.to_string()))]);
            self.block_on(raft.change_membership(ChangeMembers::SetNodes(set), false))
                .map_err(|e| Error::failed(format!("cannot rename this member to {me}: {e}")))?;
            *self.addr.locked() = me;
        }
        let node = BasicNode::new(addr.to_string());
        self.block_on(async {
            let t = Duration::from_secs(30);
            tokio::time::timeout(t, raft.add_learner(joined.id, node, true))
                .await
                .map_err(|_| {
                    Error::unavailable(format!("{addr} did not catch up with the pool in 30 s"))
                })?
                .map_err(|e| Error::failed(format!("cannot add {addr}: {e}")))?;
            let voters = BTreeSet::from([joined.id]);
            tokio::time::timeout(t, raft.change_membership(voters_add(voters), false))
                .await
                .map_err(|_| Error::unavailable(format!("{addr} did not become a voter in 30 s")))?
                .map_err(|e| Error::failed(format!("cannot make {addr} a voter: {e}")))
        })?;
        tracing::info!("pool: added member {:016x} at {addr}", joined.id);
        Ok(Joined {
            addr: addr.to_string(),
            members: members.len() + 1,
            ..joined
        })
    }

    /// Removes the member `id` (on the leader) and tells it to forget the pool.
    pub fn detach(&self, id: NodeId) -> Result<String, Error> {
        let _one = self.changing.locked();
        let members = self.view(false).members;
        let Some(m) = members.iter().find(|m| m.id == id) else {
            return Err(Error::not_found(format!("no member {id:016x} in the pool")));
        };
        if members.len() == 1 {
            return Err(Error::conflict("the pool's only member cannot be detached"));
        }
        let raft = self.raft();
        let change = if m.role == "learner" {
            ChangeMembers::RemoveNodes(BTreeSet::from([id]))
        } else {
            ChangeMembers::RemoveVoters(BTreeSet::from([id]))
        };
        self.within(WRITE_PATIENCE, raft.change_membership(change, false))
            .map_err(|_| self.no_majority())?
            .map_err(|e| Error::failed(format!("cannot detach {}: {e}", m.addr)))?;
        tracing::info!("pool: detached member {id:016x} at {}", m.addr);
        Ok(m.addr.clone())
    }

    /// The pool as this member sees it; with `ping`, each other member is asked whether it
    /// answers.
    pub fn view(&self, ping: bool) -> PoolView {
        let m = self.raft().metrics().borrow().clone();
        let membership = m.membership_config.membership().clone();
        let voters: BTreeSet<NodeId> = membership.voter_ids().collect();
        let mut members: Vec<PoolMember> = membership
            .nodes()
            .map(|(id, n)| PoolMember {
                id: *id,
                addr: n.addr.clone(),
                role: if m.current_leader == Some(*id) {
                    "leader"
                } else if voters.contains(id) {
                    "voter"
                } else {
                    "learner"
                }
                .into(),
                this: *id == self.id,
                reachable: (*id == self.id).then_some(true),
            })
            .collect();
        if members.is_empty() {
            // In no pool yet: a pool of one to be.
            members.push(PoolMember {
                id: self.id,
                addr: self.my_addr().to_string(),
                role: "alone".into(),
                this: true,
                reachable: Some(true),
            });
        }
        if ping {
            std::thread::scope(|s| {
                for member in members.iter_mut().filter(|x| !x.this) {
                    s.spawn(move || {
                        let ok = member.addr.parse().is_ok_and(|a| {
                            self.call::<Joined>(a, &Msg::PoolJoin { prepare: false })
                                .is_ok_and(|j| j.id == member.id)
                        });
                        member.reachable = Some(ok);
                    });
                }
            });
        }
        PoolView {
            id: self.id,
            leader: m.current_leader,
            term: m.current_term,
            version: self.sm().read().version(),
            members,
        }
    }
}

fn voters_add(ids: BTreeSet<NodeId>) -> ChangeMembers<NodeId, BasicNode> {
    ChangeMembers::AddVoterIds(ids)
}

fn to_json(v: &impl serde::Serialize) -> serde_json::Value {
    serde_json::to_value(v).expect("raft replies serialise")
}

#[cfg(test)]
mod tests;
