//! Seeded randomness: a small deterministic generator and the seed a test prints, so a
//! failure reproduces with `KILN_SEED=…`.

/// A small deterministic generator (xorshift64).
pub struct Rng(pub u64);

impl Rng {
    /// The next value. (Not `Iterator::next`: the stream never ends, and tests call it as
    /// they need values, not in loops over it.)
    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    /// A value below `n` (0 when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next() % n
        }
    }
}

/// The seed for a randomized test: `KILN_SEED` if set, else from the clock; printed either
/// way, with the command line that replays it.
pub fn seed(test: &str) -> u64 {
    let s = std::env::var("KILN_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .expect("clock")
                .as_nanos() as u64
                | 1
        });
    eprintln!("{test}: seed {s} (rerun with KILN_SEED={s})");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_seed_gives_one_sequence_and_below_stays_below() {
        let (mut a, mut b) = (Rng(7), Rng(7));
        let xs: Vec<u64> = (0..100).map(|_| a.next()).collect();
        assert_eq!(xs, (0..100).map(|_| b.next()).collect::<Vec<_>>());
        assert!(xs.windows(2).all(|w| w[0] != w[1]));
        assert!((0..1000).all(|_| a.below(10) < 10));
        assert_eq!(a.below(0), 0);
    }
}
