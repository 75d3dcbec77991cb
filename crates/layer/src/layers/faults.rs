//! Fault injection layers: error-gen fails chosen fops with an errno, delay-gen holds them back.
//!
//! Both pick fops by name and fire with a probability, from a seeded generator so that a test
//! run can be repeated. They are shipped layers — an operator can place one in a volume graph to
//! reproduce a problem — and tests use them to drive the production code under faults.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use crate::{Ctx, Errno, FopOutput, Fut, Interpose, LayerRef, Op};
use kiln_proto::Error;

/// Which fops a fault applies to, and how often.
pub struct Trigger {
    fops: Option<HashSet<Op>>,
    /// Probability scaled to 2^32.
    threshold: u64,
    rng: AtomicU64,
}

impl Trigger {
    /// Fops named in `fops` (all when empty), each with probability `p` (0..=1), seeded.
    pub fn new(fops: &[String], p: f64, seed: u64) -> Result<Trigger, Error> {
        if !(0.0..=1.0).contains(&p) {
            return Err(Error::invalid(format!(
                "probability {p} is not between 0 and 1"
            )));
        }
        let fops = if fops.is_empty() {
            None
        } else {
            let mut set = HashSet::new();
            for name in fops {
                let op = Op::ALL
                    .iter()
                    .find(|o| o.name().eq_ignore_ascii_case(name))
                    .ok_or_else(|| Error::invalid(format!("unknown fop {name:?}")))?;
                set.insert(*op);
            }
            Some(set)
        };
        Ok(Trigger {
            fops,
            threshold: (p * (1u64 << 32) as f64) as u64,
            rng: AtomicU64::new(seed | 1),
        })
    }

    /// [`Trigger::new`] for the layer named `name` (its errors say which).
    fn named(name: &str, fops: &[String], p: f64, seed: u64) -> Result<Trigger, Error> {
        Trigger::new(fops, p, seed).map_err(|e| e.context(name))
    }

    /// Decides for one call of `op`.
    pub fn fires(&self, op: Op) -> bool {
        if self.fops.as_ref().is_some_and(|s| !s.contains(&op)) {
            return false;
        }
        if self.threshold >= 1 << 32 {
            return true;
        }
        // xorshift64*: one relaxed read-modify-write; concurrent callers may share a draw,
        // which only makes the sequence less varied, never wrong.
        let mut x = self.rng.load(Relaxed);
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.rng.store(x, Relaxed);
        (x.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 32) < self.threshold
    }
}

/// Errno names error-gen accepts.
const ERRNOS: &[(&str, u32)] = &[
    ("EPERM", 1),
    ("ENOENT", 2),
    ("EIO", 5),
    ("EBADF", 9),
    ("EAGAIN", 11),
    ("ENOMEM", 12),
    ("EACCES", 13),
    ("EBUSY", 16),
    ("EEXIST", 17),
    ("EINVAL", 22),
    ("ENOSPC", 28),
    ("EROFS", 30),
    ("ENOTCONN", 107),
    ("ETIMEDOUT", 110),
    ("ESTALE", 116),
    ("EDQUOT", 122),
];

/// Parses an errno given by name or number.
pub fn parse_errno(s: &str) -> Result<u32, Error> {
    if let Ok(n) = s.parse::<u32>() {
        if (1..4096).contains(&n) {
            return Ok(n);
        }
    }
    ERRNOS
        .iter()
        .find(|(n, _)| n.eq_ignore_ascii_case(s))
        .map(|(_, v)| *v)
        .ok_or_else(|| Error::invalid(format!("unknown errno {s:?}")))
}

/// What a fault does to a fop it fires on.
#[derive(Debug, Clone, Copy)]
pub enum Effect {
    /// error-gen: fail with this errno, without calling the child.
    Fail(Errno),
    /// delay-gen: hold the fop back this long, then call the child.
    ///
    /// The delay holds the calling thread, as a slow disk would (on the brick: that
    /// connection's task). A delay up to [`SPIN_UP_TO`] spins, as a driver polling a fast
    /// device does: on a virtual machine a sleeping CPU can take a millisecond to wake, which
    /// would turn a 100 µs delay into ten times that. Longer delays sleep, with timer slack
    /// set to 1 ns on the sleeping thread so they end when asked, not 50 µs later.
    Delay(Duration),
}

/// A fault layer (error-gen or delay-gen): when its trigger fires on a fop, the effect
/// happens; otherwise the fop goes to the child untouched.
pub struct Fault {
    name: String,
    children: [LayerRef; 1],
    trigger: Trigger,
    effect: Effect,
    /// Faults injected so far.
    pub injected: AtomicU64,
}

crate::layer_options! {
    /// The options of an error-gen layer: fails chosen fops with an errno, without calling
    /// below (client or brick side).
    pub struct ErrorGenConfig {
        /// Fop names it applies to, e.g. `["read", "write"]`; empty: all.
        #[option(ty = "list of fop names", default = "[] (all fops)")]
        #[serde(default)]
        pub fops: Vec<String>,
        /// The errno returned, by name (`EIO`, `ENOSPC`, …) or number.
        #[option(ty = "errno name or number", default = "EIO")]
        #[serde(default = "default_errno")]
        pub error: String,
        /// Chance that a matching fop fails, 0..=1.
        #[option(ty = "number 0..=1", default = "1.0")]
        #[serde(default = "one")]
        pub probability: f64,
        /// Seed of the generator that decides (runs repeat).
        #[option(ty = "integer", default = "fixed")]
        #[serde(default = "default_seed")]
        pub seed: u64,
    }
}

crate::layer_options! {
    /// The options of a delay-gen layer: holds chosen fops back, holding the calling thread
    /// as a slow device would (client or brick side).
    pub struct DelayGenConfig {
        /// Fop names it applies to, e.g. `["read", "write"]`; empty: all.
        #[option(ty = "list of fop names", default = "[] (all fops)")]
        #[serde(default)]
        pub fops: Vec<String>,
        /// The delay, microseconds.
        #[option(ty = "integer (µs)", default = "required")]
        pub delay_us: u64,
        /// Chance that a matching fop is delayed, 0..=1.
        #[option(ty = "number 0..=1", default = "1.0")]
        #[serde(default = "one")]
        pub probability: f64,
        /// Seed of the generator that decides (runs repeat).
        #[option(ty = "integer", default = "fixed")]
        #[serde(default = "default_seed")]
        pub seed: u64,
    }
}

fn default_errno() -> String {
    "EIO".into()
}
fn one() -> f64 {
    1.0
}
fn default_seed() -> u64 {
    0x6b69_6c6e
}

impl Fault {
    /// The error-gen layer named `name` above `child`, configured by `config`.
    pub fn error_gen(name: &str, child: LayerRef, config: &ErrorGenConfig) -> Result<Fault, Error> {
        let c = config;
        let errno = parse_errno(&c.error).map_err(|e| e.context(name))?;
        let trigger = Trigger::named(name, &c.fops, c.probability, c.seed)?;
        Ok(Fault::new(name, child, trigger, Effect::Fail(errno)))
    }

    /// The delay-gen layer named `name` above `child`, configured by `config`.
    pub fn delay_gen(name: &str, child: LayerRef, config: &DelayGenConfig) -> Result<Fault, Error> {
        let c = config;
        let trigger = Trigger::named(name, &c.fops, c.probability, c.seed)?;
        let delay = Effect::Delay(Duration::from_micros(c.delay_us));
        Ok(Fault::new(name, child, trigger, delay))
    }

    /// A fault layer named `name` above `child`.
    pub fn new(name: &str, child: LayerRef, trigger: Trigger, effect: Effect) -> Fault {
        Fault {
            name: name.into(),
            children: [child],
            trigger,
            effect,
            injected: AtomicU64::new(0),
        }
    }
}

impl Interpose for Fault {
    fn name(&self) -> &str {
        &self.name
    }

    fn children(&self) -> &[LayerRef] {
        &self.children
    }

    fn around<'a, T: FopOutput + Send + 'a>(
        &'a self,
        _cx: &'a Ctx,
        op: Op,
        call: Box<dyn FnOnce() -> Fut<'a, T> + Send + 'a>,
    ) -> Fut<'a, T> {
        if self.trigger.fires(op) {
            self.injected.fetch_add(1, Relaxed);
            match self.effect {
                Effect::Fail(errno) => {
                    tracing::debug!(layer = %self.name, op = op.name(), errno, "injecting error");
                    return crate::fail(errno);
                }
                Effect::Delay(d) => precise_sleep(d),
            }
        }
        call()
    }
}

crate::interpose_all!(Fault);

/// Delays up to this long spin instead of sleeping (see [`Effect::Delay`]).
const SPIN_UP_TO: Duration = Duration::from_micros(500);

/// Holds this thread for `d`: spinning when short, else sleeping with 1 ns timer slack.
fn precise_sleep(d: Duration) {
    let end = Instant::now() + d;
    if d <= SPIN_UP_TO {
        while Instant::now() < end {
            std::hint::spin_loop();
        }
        return;
    }
    thread_local! {
        static SLACK_SET: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }
    SLACK_SET.with(|s| {
        if !s.get() {
            // SAFETY: PR_SET_TIMERSLACK takes an integer argument and affects only this thread.
            unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong, 0, 0, 0) };
            s.set(true);
        }
    });
    while let Some(left) = end.checked_duration_since(Instant::now()) {
        if left.is_zero() {
            break;
        }
        std::thread::sleep(left);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trigger_probability_and_filter() {
        let t = Trigger::new(&["read".into()], 0.25, 42).unwrap();
        let hits = (0..40_000).filter(|_| t.fires(Op::Read)).count();
        assert!((8_000..12_000).contains(&hits), "{hits}");
        assert!(!(0..1000).any(|_| t.fires(Op::Write)));
        assert!(Trigger::new(&["nope".into()], 0.5, 1).is_err());
        assert!(Trigger::new(&[], 1.5, 1).is_err());
        let always = Trigger::new(&[], 1.0, 1).unwrap();
        assert!((0..100).all(|_| always.fires(Op::Lookup)));
    }

    #[test]
    fn precise_sleep_is_close() {
        for us in [100, 2_000] {
            let t = Instant::now();
            precise_sleep(Duration::from_micros(us));
            assert!(t.elapsed() >= Duration::from_micros(us), "{us} µs");
        }
    }
}
