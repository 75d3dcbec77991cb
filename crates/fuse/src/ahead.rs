//! Fetching ahead of the application: directory listings ahead of a walk, small files'
//! content ahead of a reader (see [`Listings`] and [`Contents`]).
//!
//! The kernel asks for one thing at a time: an `ls -lR`, `find` or `du` waits for each listing
//! in turn, and `cat` of a tree for each file's open. So the mount fetches the listings of the
//! subdirectories a walk opens next in the background (see [`crate::walks`]), a few at a
//! time, and when a reader opens a small file it fetches the next small files the walk
//! reaches; the application finds them waiting when it gets there.
//!
//! What was fetched ahead is used once, by the next `opendir` or `open` of its path by the same
//! caller it was fetched for (same uid, gid and supplementary groups: the brick checked access
//! for that caller only, so another — root on a volume that squashes root, a user an ACL on
//! the brick refuses — is sent to the brick), and only while younger than the attribute
//! timeout. That `opendir` or `open` waits for a fetch of its
//! path already running, and takes one still queued off the queue to make it itself. A change
//! to it spoils it: made through this mount (spoiled when the change is done) or by another
//! client (when the brick's push arrives, see [`crate::changes`]). A fetch still running when
//! its path is spoiled is thrown away when it ends; one that ended before is dropped. So
//! nothing fetched ahead shows a file or directory as it was before a change that completed
//! before it is used.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kiln_proto::ops::DirEntry;
use kiln_proto::sync::MutexExt as _;
use kiln_proto::Cred;

use crate::callers::same_caller;
use crate::xattr::Seen;

/// A directory listing fetched ahead, and what it may tell of extended attributes.
pub(crate) type Listing = (Vec<DirEntry>, Seen);
/// Listings fetched ahead, by directory path: 4 at a time, 256 Ki entries held at most.
pub(crate) type Listings = Ahead<Listing>;
/// A small file fetched ahead.
pub(crate) struct Content {
    /// Its FUSE inode, as listed when the fetch began.
    pub ino: u64,
    /// All of it.
    pub data: Vec<u8>,
    /// Whether it was put into the kernel's page cache as it came.
    pub stored: Option<crate::files::Stored>,
    /// Its attributes as it was read, where the brick gave them: a lookup of its path is
    /// answered from them ([`Ahead::peek`]).
    pub attr: Option<kiln_proto::ops::Attr>,
}
/// Small files fetched ahead, by path: 8 at a time, 32 MiB held at most.
pub(crate) type Contents = Ahead<Content>;

/// One fetch: its result and what holding it costs (entries, bytes), or nothing.
pub(crate) type Job<T> =
    Box<dyn FnOnce() -> Pin<Box<dyn Future<Output = Option<(T, usize)>> + Send>> + Send>;

/// The caller a fetch was made for: what it brought is theirs only.
pub(crate) type Who = Arc<Cred>;

/// Things fetched ahead by path, and those being fetched.
pub(crate) struct Ahead<T> {
    state: Mutex<State<T>>,
    /// Signalled each time a fetch ends (see [`Ahead::wait`]).
    ended: Condvar,
    /// Things held plus fetches running or queued: spoiling costs nothing when all are none.
    busy: AtomicUsize,
    ttl: Duration,
    /// Fetches running at once; cost held (past it, no fetch starts: those running may end
    /// past it, by at most what they hold); jobs queued at most.
    running_max: usize,
    cost_max: usize,
    queue_max: usize,
    /// Called each time a fetch is kept, ready to be taken.
    kept: Option<Box<dyn Fn() + Send + Sync>>,
}

struct State<T> {
    ready: HashMap<String, (T, usize, Instant, Who)>,
    /// Paths fetching now: whether spoiled meanwhile (then thrown away when they end), since
    /// when, and for whom.
    running: HashMap<String, (bool, Instant, Who)>,
    queue: VecDeque<(String, Job<T>, Who)>,
    /// Paths queued, and for whom.
    queued: HashMap<String, Who>,
    cost: usize,
    /// The last [`TAKEN_KEPT`] paths taken, oldest first, and when: a walk that reaches one
    /// again within the time things are kept (while another thread is using it) does not
    /// fetch it a second time.
    taken: VecDeque<String>,
    taken_at: HashMap<String, Instant>,
}

impl<T> State<T> {
    /// True when `path` is held, being fetched, waiting to be, or was taken within `ttl`.
    fn knows(&self, path: &str, ttl: Duration) -> bool {
        self.ready.contains_key(path)
            || self.running.contains_key(path)
            || self.queued.contains_key(path)
            || self.taken_at.get(path).is_some_and(|t| t.elapsed() < ttl)
    }
}

/// Paths taken that are remembered (a few times the files a walk fetches ahead).
const TAKEN_KEPT: usize = 64;

impl Listings {
    /// Listings used within `ttl` of their fetch.
    pub fn listings(ttl: Duration) -> Listings {
        Ahead::new(ttl, 4, 256 * 1024)
    }
}

impl Contents {
    /// Contents used within `ttl` of their fetch.
    pub fn contents(ttl: Duration) -> Contents {
        Ahead::new(ttl, 8, 32 << 20)
    }

    /// [`Contents::contents`], calling `kept` each time a fetched file is ready to be used.
    pub fn contents_noting(ttl: Duration, kept: impl Fn() + Send + Sync + 'static) -> Contents {
        let mut c = Contents::contents(ttl);
        c.kept = Some(Box::new(kept));
        c
    }
}

impl<T: Send + 'static> Ahead<T> {
    fn new(ttl: Duration, running_max: usize, cost_max: usize) -> Ahead<T> {
        Ahead {
            state: Mutex::new(State {
                ready: HashMap::new(),
                running: HashMap::new(),
                queue: VecDeque::new(),
                queued: HashMap::new(),
                cost: 0,
                taken: VecDeque::new(),
                taken_at: HashMap::new(),
            }),
            ended: Condvar::new(),
            busy: AtomicUsize::new(0),
            ttl,
            running_max,
            cost_max,
            queue_max: 4096,
            kept: None,
        }
    }

    fn state(&self) -> MutexGuard<'_, State<T>> {
        self.state.locked()
    }

    fn count(&self, s: &State<T>) {
        self.busy.store(
            s.ready.len() + s.running.len() + s.queue.len(),
            Ordering::Release,
        );
    }

    /// True while things are held or being fetched (else spoiling has nothing to do).
    pub fn holds(&self) -> bool {
        self.busy.load(Ordering::Acquire) > 0
    }

    /// True when `path` is held, being fetched or waiting to be.
    #[cfg(test)]
    pub fn has(&self, path: &str) -> bool {
        if !self.holds() {
            return false;
        }
        let s = self.state();
        s.ready.contains_key(path) || s.running.contains_key(path) || s.queued.contains_key(path)
    }

    /// What was fetched ahead for `path` for caller `who`, if it is ready and fresh. A fetch
    /// of it for `who` still queued is dropped: the caller fetches it itself now. (One running
    /// is left to end; see [`Ahead::fetching`].) What was fetched for another caller stays
    /// theirs: `who` gets nothing.
    pub fn take(self: &Arc<Self>, path: &str, who: &Cred) -> Option<T> {
        if !self.holds() {
            return None;
        }
        let mut s = self.state();
        let mine = |w: &Who| same_caller(w, who);
        let found = match s.ready.get(path) {
            Some((.., w)) if !mine(w) => return None,
            Some(_) => s.ready.remove(path),
            None => None,
        };
        if found.is_none() {
            match s.queued.get(path) {
                Some(w) if mine(w) => s.queued.remove(path),
                _ => return None,
            };
        }
        if s.taken.len() >= TAKEN_KEPT {
            if let Some(old) = s.taken.pop_front() {
                s.taken_at.remove(&old);
            }
        }
        if s.taken_at.insert(path.to_owned(), Instant::now()).is_none() {
            s.taken.push_back(path.to_owned());
        }
        let found = match found {
            Some((t, cost, at, _)) => {
                s.cost -= cost;
                Some((t, at))
            }
            None => {
                s.queue.retain(|(p, ..)| p != path);
                None
            }
        };
        let starts = self.next(&mut s);
        self.count(&s);
        drop(s);
        self.start(starts);
        let (t, at) = found?;
        (at.elapsed() < self.ttl).then_some(t)
    }

    /// `f` of what was fetched ahead for `path` for caller `who`, if it is ready and fresh,
    /// leaving it there; and how much longer it stays fresh.
    pub fn peek<R>(
        &self,
        path: &str,
        who: &Cred,
        f: impl FnOnce(&T) -> R,
    ) -> Option<(R, Duration)> {
        if !self.holds() {
            return None;
        }
        let s = self.state();
        let (t, _, at, w) = s.ready.get(path)?;
        if !same_caller(w, who) {
            return None;
        }
        let left = self
            .ttl
            .checked_sub(at.elapsed())
            .filter(|l| !l.is_zero())?;
        Some((f(t), left))
    }

    /// True when `path` is held, being fetched, waiting to be, or was just taken: a
    /// [`Ahead::want`] of it would do nothing.
    pub fn knows(&self, path: &str) -> bool {
        if !self.holds() {
            return false;
        }
        self.state().knows(path, self.ttl)
    }

    /// True while a fetch of `path` for `who` runs: its end is worth waiting for
    /// ([`Ahead::wait`]) rather than fetching the same thing a second time.
    pub fn fetching(&self, path: &str, who: &Cred) -> bool {
        self.holds() && (self.state().running.get(path)).is_some_and(|(.., w)| same_caller(w, who))
    }

    /// Waits until no fetch of `path` runs, at most until `max` after it began; then
    /// [`Ahead::take`] finds what it fetched, unless it failed or was spoiled.
    pub fn wait(&self, path: &str, max: Duration) {
        let mut s = self.state();
        while let Some(&(_, since, _)) = s.running.get(path) {
            let left = (since + max).saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            s = match self.ended.wait_timeout(s, left) {
                Ok((s, _)) => s,
                Err(e) => e.into_inner().0,
            };
        }
    }

    /// [`Ahead::take`], but a fetch of `path` running now is waited for first, at most until
    /// the time things are kept has passed since it began (what it fetched could not be used
    /// after that), through `waiting`: a FUSE thread gives its place up around the wait.
    pub fn take_waiting(
        self: &Arc<Self>,
        path: &str,
        who: &Cred,
        waiting: impl FnOnce(&dyn Fn()),
    ) -> Option<T> {
        if let Some(t) = self.take(path, who) {
            return Some(t);
        }
        if !self.fetching(path, who) {
            return None;
        }
        waiting(&|| self.wait(path, self.ttl));
        self.take(path, who)
    }

    /// `path` changed: what was fetched of it is dropped, and a fetch of it now running is
    /// thrown away when it ends.
    pub fn spoil(&self, path: &str) {
        if !self.holds() {
            return;
        }
        let mut s = self.state();
        if let Some((_, cost, ..)) = s.ready.remove(path) {
            s.cost -= cost;
        }
        if let Some((spoiled, ..)) = s.running.get_mut(path) {
            *spoiled = true;
        }
        self.count(&s);
    }

    /// `path` was renamed, replaced or removed: it and everything below it is spoiled.
    pub fn spoil_tree(&self, path: &str) {
        if !self.holds() {
            return;
        }
        let below = format!("{path}/");
        let hit = |p: &String| p == path || p.starts_with(&below);
        let mut s = self.state();
        let gone: Vec<String> = s.ready.keys().filter(|p| hit(p)).cloned().collect();
        for p in gone {
            if let Some((_, cost, ..)) = s.ready.remove(&p) {
                s.cost -= cost;
            }
        }
        s.running
            .iter_mut()
            .filter(|(p, _)| hit(p))
            .for_each(|(_, v)| v.0 = true);
        self.count(&s);
    }

    /// Anything may have changed: everything is dropped.
    pub fn spoil_all(&self) {
        let mut s = self.state();
        s.ready.clear();
        s.cost = 0;
        s.running.values_mut().for_each(|v| v.0 = true);
        self.count(&s);
    }

    /// Fetches `wanted` (paths, or things that name one) ahead for caller `who`, in order, as
    /// room allows, each with the job `fetch` makes for it (which must fetch as `who`); paths
    /// already held, fetching, queued or just taken are skipped (and make no job).
    pub fn want<W: AsRef<str>>(
        self: &Arc<Self>,
        wanted: impl IntoIterator<Item = W>,
        who: &Who,
        fetch: impl Fn(&W) -> Job<T>,
    ) {
        if self.ttl.is_zero() {
            // Nothing fetched could be used (`--attr-timeout 0`).
            return;
        }
        let mut s = self.state();
        for w in wanted {
            if s.queue.len() >= self.queue_max {
                break;
            }
            let path = w.as_ref();
            if s.knows(path, self.ttl) {
                continue;
            }
            let job = fetch(&w);
            s.queued.insert(path.to_owned(), who.clone());
            s.queue.push_back((path.to_owned(), job, who.clone()));
        }
        let starts = self.next(&mut s);
        self.count(&s);
        drop(s);
        self.start(starts);
    }

    /// Takes what may start now off the queue.
    fn next(&self, s: &mut State<T>) -> Vec<(String, Job<T>)> {
        if s.cost >= self.cost_max {
            // Full: what is too old to be used goes (never-used fetches would pin the room).
            let ttl = self.ttl;
            let mut freed = 0;
            s.ready.retain(|_, (_, cost, at, _)| {
                let keep = at.elapsed() < ttl;
                if !keep {
                    freed += *cost;
                }
                keep
            });
            s.cost -= freed;
        }
        let mut out = Vec::new();
        while s.running.len() < self.running_max && s.cost < self.cost_max {
            let Some((path, job, who)) = s.queue.pop_front() else {
                break;
            };
            s.queued.remove(&path);
            s.running.insert(path.clone(), (false, Instant::now(), who));
            out.push((path, job));
        }
        out
    }

    fn start(self: &Arc<Self>, jobs: Vec<(String, Job<T>)>) {
        for (path, job) in jobs {
            let at = Instant::now();
            let fut = job();
            let me = self.clone();
            kiln_client::spawn(async move {
                let r = fut.await;
                me.finish(path, r, at);
            });
        }
    }

    /// A fetch of `path` begun `at` ended with `r`: kept unless spoiled meanwhile; the next
    /// fetches start.
    fn finish(self: &Arc<Self>, path: String, r: Option<(T, usize)>, at: Instant) {
        let mut s = self.state();
        let (spoiled, who) = match s.running.remove(&path) {
            Some((spoiled, _, who)) => (spoiled, Some(who)),
            None => (true, None),
        };
        if let (Some((t, cost)), false, Some(who)) = (r, spoiled, who) {
            s.cost += cost;
            s.ready.insert(path, (t, cost, at, who));
            if let Some(k) = &self.kept {
                k();
            }
        }
        let starts = self.next(&mut s);
        self.count(&s);
        drop(s);
        self.ended.notify_all();
        self.start(starts);
    }
}

/// The parent directory's path of `path` (the root's is the root).
pub(crate) fn parent(path: &str) -> &str {
    crate::inodes::split(path).0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parents() {
        assert_eq!(parent("a/b/c"), "a/b");
        assert_eq!(parent("a"), "");
        assert_eq!(parent(""), "");
    }

    /// The caller everything here is fetched for.
    fn who() -> Who {
        Arc::new(Cred {
            uid: 1001,
            gid: 1001,
            groups: vec![4242],
        })
    }

    #[test]
    fn fetched_for_one_caller_is_not_anothers() {
        let a = Arc::new(Ahead::<u32>::new(Duration::from_secs(60), 2, 10));
        a.want(["x".to_owned(), "y".to_owned()], &who(), |_| ready(1));
        let root = Cred::default();
        let other_groups = Cred {
            groups: vec![],
            ..(*who()).clone()
        };
        assert_eq!(
            a.take("x", &root),
            None,
            "root is not the caller it was for"
        );
        assert_eq!(a.take("x", &other_groups), None, "nor are other groups");
        assert!(a.peek("x", &root, |_| ()).is_none());
        assert_eq!(a.take("x", &who()), Some(1), "still there for its caller");
        assert!(a.peek("y", &who(), |_| ()).is_some());
    }

    /// A job that completes at once with `v`.
    fn ready(v: u32) -> Job<u32> {
        Box::new(move || Box::pin(async move { Some((v, 1)) }))
    }

    #[test]
    fn fetched_once_and_spoiled_by_a_change() {
        let a = Arc::new(Ahead::<u32>::new(Duration::from_secs(60), 2, 10));
        a.want(["x".to_owned(), "y".to_owned()], &who(), |p| {
            ready(if p == "x" { 1 } else { 2 })
        });
        assert!(a.has("x"));
        assert_eq!(a.take("x", &who()), Some(1));
        assert_eq!(a.take("x", &who()), None, "used once");
        a.want(["x".to_owned()], &who(), |_| ready(5));
        assert_eq!(a.take("x", &who()), None, "and not fetched again at once");
        a.spoil("y");
        assert_eq!(a.take("y", &who()), None, "spoiled");
        a.want(["d/e".to_owned(), "de".to_owned()], &who(), |_| ready(4));
        a.spoil_tree("d");
        assert_eq!(a.take("d/e", &who()), None, "below a renamed directory");
        assert_eq!(
            a.take("de", &who()),
            Some(4),
            "a sibling whose name starts the same"
        );
        a.want(["z".to_owned()], &who(), |_| ready(3));
        a.spoil_all();
        assert_eq!(a.take("z", &who()), None);
        assert!(!a.holds());
    }

    /// Starts a fetch of `path` on another thread (its `want` runs the job's first poll) that
    /// ends with `v` once the returned sender is sent to; returns when it is running.
    fn slow_fetch(
        a: &Arc<Ahead<u32>>,
        path: &str,
        v: u32,
    ) -> (std::sync::mpsc::Sender<()>, std::thread::JoinHandle<()>) {
        let (go, rx) = std::sync::mpsc::channel::<()>();
        let rx = Mutex::new(Some(rx));
        let slow: Mutex<Option<Job<u32>>> = Mutex::new(Some(Box::new(move || {
            let rx = rx.lock().unwrap().take().unwrap();
            Box::pin(async move {
                let _ = rx.recv();
                Some((v, 1))
            })
        })));
        let (a2, p) = (a.clone(), path.to_owned());
        let t = std::thread::spawn(move || {
            a2.want([p], &who(), |_| slow.lock().unwrap().take().unwrap())
        });
        while !a.fetching(path, &who()) {
            std::thread::yield_now();
        }
        (go, t)
    }

    #[test]
    fn a_fetch_spoiled_while_running_is_thrown_away() {
        let a = Arc::new(Ahead::<u32>::new(Duration::from_secs(60), 2, 10));
        let (go, t) = slow_fetch(&a, "p", 7);
        a.spoil("p");
        go.send(()).unwrap();
        t.join().unwrap();
        assert_eq!(a.take("p", &who()), None);
    }

    #[test]
    fn nothing_starts_past_the_cost_held() {
        // One at a time: the cost of a fetch is known when it ends.
        let a = Arc::new(Ahead::<u32>::new(Duration::from_secs(60), 1, 2));
        a.want((0..5).map(|i| format!("f{i}")), &who(), |p| {
            ready(p[1..].parse().unwrap())
        });
        assert_eq!(a.take("f3", &who()), None, "two held, the rest wait");
        assert_eq!(a.take("f0", &who()), Some(0));
        assert_eq!(
            a.take("f2", &who()),
            Some(2),
            "room made: the next one was fetched"
        );
        assert_eq!(
            a.take("f4", &who()),
            Some(4),
            "f3, taken while queued, was dropped from the queue: f4 came next"
        );
        assert!(!a.has("f3"));
    }

    #[test]
    fn a_fetch_on_its_way_is_waited_for() {
        let a = Arc::new(Ahead::<u32>::new(Duration::from_secs(60), 2, 10));
        // The fetch ends only once the taker waits for it.
        let (go, t) = slow_fetch(&a, "p", 7);
        let got = a.take_waiting("p", &who(), |wait| {
            go.send(()).unwrap();
            wait()
        });
        assert_eq!(got, Some(7));
        t.join().unwrap();
    }
}
