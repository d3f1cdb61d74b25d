//! Time that goes on while the machine sleeps, for the ages of idle upstream connections.
//!
//! std's `Instant` and tokio's clock are CLOCK_MONOTONIC, which stops while a laptop
//! sleeps. A connection left idle ten seconds before a night's sleep was ten seconds idle on
//! waking, so it was reused, though the upstream (or the NAT on the way) had dropped it long
//! before and its close could not reach a sleeping machine: the first request on it, a
//! sandbox's create or an envd command, was written into a dead connection, reset, and
//! answered 502 (a request not safe to send again is not sent again). Measured by
//! CLOCK_BOOTTIME, which counts the sleep, that connection is past its idle timeout and a new
//! one is opened. Elsewhere than Linux the clock is the monotonic one.

use std::time::{Duration, Instant};

/// The time since the machine booted, sleep included (CLOCK_BOOTTIME, read through the
/// vDSO as `Instant::now()` is: no dearer).
#[cfg(target_os = "linux")]
pub fn since_boot() -> Duration {
    read(rustix::time::ClockId::Boottime)
}

#[cfg(target_os = "linux")]
fn read(clock: rustix::time::ClockId) -> Duration {
    let t = rustix::time::clock_gettime(clock);
    Duration::new(
        u64::try_from(t.tv_sec).unwrap_or(0),
        u32::try_from(t.tv_nsec).unwrap_or(0),
    )
}

/// The monotonic time since this process first asked: no sleep accounted for.
#[cfg(not(target_os = "linux"))]
pub fn since_boot() -> Duration {
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    START.get_or_init(Instant::now).elapsed()
}

/// How long the machine has slept since it booted: CLOCK_BOOTTIME's lead over
/// CLOCK_MONOTONIC.
#[cfg(target_os = "linux")]
fn slept() -> Duration {
    let monotonic = read(rustix::time::ClockId::Monotonic);
    since_boot().saturating_sub(monotonic)
}

#[cfg(not(target_os = "linux"))]
fn slept() -> Duration {
    Duration::ZERO
}

/// hyper-util's pool timer with a clock that counts sleep: its `now` is the monotonic
/// `Instant` moved on by the time slept, so the pool's idle ages (`pool_idle_timeout`)
/// include it; its sleeps are tokio's, their deadlines moved back by the same.
#[derive(Clone, Copy, Debug)]
pub struct AwakeTimer {
    slept: fn() -> Duration,
}

impl Default for AwakeTimer {
    fn default() -> Self {
        AwakeTimer { slept }
    }
}

impl hyper::rt::Timer for AwakeTimer {
    fn sleep(&self, duration: Duration) -> std::pin::Pin<Box<dyn hyper::rt::Sleep>> {
        hyper_util::rt::TokioTimer::new().sleep(duration)
    }

    fn sleep_until(&self, deadline: Instant) -> std::pin::Pin<Box<dyn hyper::rt::Sleep>> {
        let monotonic = deadline.checked_sub((self.slept)()).unwrap_or(deadline);
        hyper_util::rt::TokioTimer::new().sleep_until(monotonic)
    }

    fn now(&self) -> Instant {
        Instant::now() + (self.slept)()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hyper::rt::Timer as _;

    /// The timer's `now` is `Instant::now()` moved by the time slept (a night, here), and
    /// a sleep until a deadline in its time ends then, not a night later.
    #[tokio::test(start_paused = true)]
    async fn the_timer_counts_in_instants_moved_by_the_sleeps() {
        const NIGHT: Duration = Duration::from_secs(8 * 3600);
        let timer = AwakeTimer { slept: || NIGHT };
        let before = Instant::now() + NIGHT;
        let now = timer.now();
        assert!(now >= before && now <= Instant::now() + NIGHT);
        let start = tokio::time::Instant::now();
        timer
            .sleep_until(timer.now() + Duration::from_secs(90))
            .await;
        let waited = start.elapsed();
        assert!(
            waited >= Duration::from_secs(89) && waited <= Duration::from_secs(91),
            "{waited:?}"
        );
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn since_boot_is_the_uptime() {
        let uptime = std::fs::read_to_string("/proc/uptime").expect("/proc/uptime");
        let seconds: f64 = uptime
            .split_whitespace()
            .next()
            .and_then(|s| s.parse().ok())
            .expect("uptime seconds");
        let apart = since_boot().as_secs_f64() - seconds;
        assert!((-0.1..1.0).contains(&apart), "{apart}");
    }
}
