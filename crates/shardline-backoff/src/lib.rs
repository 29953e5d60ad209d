//! Exponential backoff with jitter: the delay before the next try after a run of failures. The
//! Hub client (HTTP retries), the job store (task retries) and the trigger poller (failed
//! checks) use it with their own base, cap and spread.
//!
//! **Owns:** the backoff formula and the jitter source. **Must not depend on:** any workspace
//! crate (and no RNG crate: the jitter comes from std's randomly keyed hasher).

use std::time::Duration;

/// Delays that double from `base` with every failure, up to `cap`, each scaled by a factor
/// between `spread.0` and `spread.1`, so that clients that failed together do not retry together.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Backoff {
    /// The delay after the first failure (before scaling).
    pub base: Duration,
    /// The longest delay.
    pub cap: Duration,
    /// The range of the random factor: `(0.5, 1.0)` waits 50–100 % of the doubled delay,
    /// `(0.8, 1.2)` ± 20 %.
    pub spread: (f64, f64),
}

impl Backoff {
    /// The delay after `failures` failures in a row (1 after the first; 0 counts as 1):
    /// `base · 2^(failures-1)`, at most `cap`, times the factor `unit` picks from the spread
    /// (`unit` in [0, 1]: 0 the lowest factor, 1 the highest), and never more than `cap`.
    pub fn delay(&self, failures: u32, unit: f64) -> Duration {
        let doubled = self.base.saturating_mul(2u32.saturating_pow(failures.saturating_sub(1))).min(self.cap);
        let (low, high) = self.spread;
        let factor = low + (high - low) * unit.clamp(0.0, 1.0);
        Duration::try_from_secs_f64(doubled.as_secs_f64() * factor).map_or(self.cap, |d| d.min(self.cap))
    }

    /// [`Backoff::delay`] with a fresh random `unit`.
    pub fn jittered(&self, failures: u32) -> Duration {
        self.delay(failures, random_unit())
    }
}

/// A number in [0, 1) that differs between calls.
pub fn random_unit() -> f64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64));
    (h.finish() >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_scales_and_caps() {
        let b = Backoff { base: Duration::from_secs(30), cap: Duration::from_secs(3600), spread: (0.5, 1.0) };
        assert_eq!(b.delay(1, 1.0), Duration::from_secs(30));
        assert_eq!(b.delay(0, 1.0), Duration::from_secs(30));
        assert_eq!(b.delay(3, 1.0), Duration::from_secs(120));
        assert_eq!(b.delay(1, 0.0), Duration::from_secs(15));
        assert_eq!(b.delay(200, 1.0), Duration::from_secs(3600));
        let wide = Backoff { base: Duration::from_secs(1), cap: Duration::from_secs(10), spread: (0.8, 1.2) };
        assert_eq!(wide.delay(4, 1.0), Duration::from_millis(9600));
        assert_eq!(wide.delay(5, 1.0), Duration::from_secs(10), "never above the cap");
        assert_eq!(wide.delay(1, 0.0), Duration::from_millis(800));
        let huge = Backoff { base: Duration::MAX, cap: Duration::MAX, spread: (0.8, 1.2) };
        assert_eq!(huge.delay(3, 1.0), Duration::MAX);
        for _ in 0..100 {
            let u = random_unit();
            assert!((0.0..1.0).contains(&u), "{u}");
            let d = wide.jittered(2);
            assert!(d >= Duration::from_millis(1600) && d <= Duration::from_millis(2400), "{d:?}");
        }
    }
}
