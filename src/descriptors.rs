//! The process's file descriptors: the open-file limit raised at start, the client
//! connections it leaves room for ([`Budget`]), and the share of it that upstream
//! connections may hold ([`Slots`]).
//!
//! A client connection holds its own descriptor and, while a request runs, an upstream
//! one; the limit is raised for two per `--max-connections` plus a reserve. An HTTP/2
//! client breaks that count: each of its streams (up to 100) may hold an upstream
//! connection of its own, and without a bound a few such clients took every descriptor,
//! after which accepts, admin scrapes and the token exchange failed with EMFILE as well.
//! Upstream connections are counted here instead: at most the limit less the reserve and
//! one per client connection. A request that finds none free closes an idle pooled
//! connection if there is one, else waits up to `--connect-timeout` for one and is then
//! answered 502 E5001 (nginx's "worker_connections are not enough" is a 502 too).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::{Duration, Instant};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Descriptors one client connection may hold: its own and a pooled upstream's. (A large
/// download spliced socket to socket holds a pipe's two more while it lasts: see
/// [`Budget::pipes`].)
const PER_CONNECTION: u64 = 2;
/// Listeners, admin connections, the token exchange, log and secret files, the runtime's
/// own (about 20 at rest): never taken by upstream connections. A quarter of a limit
/// under 1 024, and never under [`RESERVED_LEAST`].
const RESERVED: u64 = 256;
/// The admin listener's 64 connections, the ~13 at rest besides the workers' own, the
/// token exchange's and a reload's files, and the name look-ups' sockets (two for each of
/// `resolve::MAX_LOOKUPS`): at 64, a limit of 128 or 256 let clients and
/// upstream connections take descriptors the full admin listener needed, and the probes
/// failed with EMFILE.
const RESERVED_LEAST: u64 = 96;
/// Each worker's runtime holds a few of its own (its poller, its waker, the hand-over of
/// connections), on top of the reserve: 64 workers held 269 at rest, more than a limit of
/// 256 would have left the probes.
const PER_WORKER: u64 = 4;
/// What the process holds at rest besides its workers' own: listeners, stdio, the main
/// runtime's poller and waker, the signal pipe.
const AT_REST: u64 = 13;
/// The least beyond what is held at rest: a client's, its upstream's and a probe's. Under
/// that (a hard limit of 20 with two workers) the proxy started, said it listened, and
/// answered nothing.
const ONE_CONNECTION: u64 = 3;

/// The open-file limit leaves no room for one connection beside what the proxy holds at
/// rest.
#[derive(Debug, thiserror::Error)]
#[error(
    "the open-file limit ({limit}) leaves no room for a connection: the proxy holds about \
     {at_rest} descriptors of its own with {workers} worker thread{s}; raise it to at least \
     {least} (LimitNOFILE=, ulimit -n)",
    s = if *.workers == 1 { "" } else { "s" }
)]
pub struct NoRoom {
    limit: u64,
    at_rest: u64,
    workers: usize,
    least: u64,
}

/// What the open-file limit leaves room for: client connections served at once, upstream
/// connections (see [`Slots`]), and splices' pipes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budget {
    pub clients: usize,
    pub upstream: usize,
    /// Pipes (two descriptors each) out of the reserve beyond [`RESERVED_LEAST`]: 80 with
    /// the whole reserve, none under a limit of about 400, where large downloads are
    /// copied. Not out of the upstream slots: there a pipe held the slot a client let in
    /// needed (502 after `--connect-timeout`), and not out of the reserve's least: 28
    /// pipes at a limit of 128 left the admin listener's accepts failing.
    pub pipes: usize,
}

/// Raises the soft open-file limit towards what `--max-connections` needs, as far as the
/// hard limit allows, and returns what it leaves room for.
/// systemd services (and many container runtimes) start with a soft limit of 1024, which
/// ends every accept and upstream connect with EMFILE at about 500 connections, far below
/// the default 10 000. Go's runtime raises it at start likewise; nginx has
/// `worker_rlimit_nofile`. A limit that leaves no room for one connection is an error.
pub fn raise_open_file_limit(max_connections: usize, workers: usize) -> Result<Budget, NoRoom> {
    let needed = needed(max_connections, workers);
    let limit = match rlimit::increase_nofile_limit(needed) {
        Ok(limit) if limit >= needed => {
            tracing::debug!(limit, "open-file limit");
            limit
        }
        // No warning of what a limit that is refused below would serve.
        Ok(limit) if limit < least(workers) => limit,
        Ok(limit) => {
            let budget = budget(limit, max_connections, workers);
            let serving = budget.clients;
            // Every client served, the upstream connections are what is short.
            let short = if serving >= max_connections {
                format!(
                    "every client connection is served, but upstream connections are held to \
                     {}",
                    budget.upstream
                )
            } else {
                format!(
                    "serving {serving} connection{} at once, the others wait in the kernel's \
                     accept queue",
                    if serving == 1 { "" } else { "s" }
                )
            };
            tracing::warn!(
                limit,
                needed,
                max_connections,
                serving,
                "the open-file limit is below what --max-connections needs (two per \
                 connection, a reserve and four per worker thread): {short}; raise it \
                 (LimitNOFILE=, ulimit -n) or lower --max-connections"
            );
            limit
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot raise the open-file limit");
            match rlimit::getrlimit(rlimit::Resource::NOFILE) {
                Ok((soft, _)) => soft,
                Err(_) => {
                    return Ok(Budget {
                        clients: max_connections,
                        upstream: Slots::UNLIMITED,
                        pipes: Slots::UNLIMITED,
                    })
                }
            }
        }
    };
    room_for_one_under(limit, workers)?;
    Ok(budget(limit, max_connections, workers))
}

/// Whether `limit` leaves room for one connection beside what `workers` hold at rest.
fn room_for_one_under(limit: u64, workers: usize) -> Result<(), NoRoom> {
    match limit < least(workers) {
        true => Err(NoRoom {
            limit,
            at_rest: at_rest(workers),
            workers,
            least: least(workers),
        }),
        false => Ok(()),
    }
}

/// Whether the hard open-file limit leaves room for one connection, as
/// [`raise_open_file_limit`] asks at start, without changing the limit or warning of one
/// short of `--max-connections` (`check`'s question: will serve start?).
pub fn room_for_one(workers: usize) -> Result<(), NoRoom> {
    match rlimit::getrlimit(rlimit::Resource::NOFILE) {
        Ok((_, hard)) => room_for_one_under(hard, workers),
        Err(_) => Ok(()),
    }
}

/// What the process holds at rest with `workers`.
fn at_rest(workers: usize) -> u64 {
    AT_REST.saturating_add(PER_WORKER.saturating_mul(workers as u64))
}

/// The least open-file limit that serves one connection beside what is held at rest.
fn least(workers: usize) -> u64 {
    at_rest(workers).saturating_add(ONE_CONNECTION)
}

/// The limit that serves `max_connections` clients: two descriptors each, the reserve and
/// the workers' own (asked for without the workers', 64 workers were served 272 of 400
/// clients, and no warning said so).
fn needed(max_connections: usize, workers: usize) -> u64 {
    (max_connections as u64)
        .saturating_mul(PER_CONNECTION)
        .saturating_add(RESERVED)
        .saturating_add(PER_WORKER.saturating_mul(workers as u64))
}

/// What `limit` descriptors leave room for beside the reserve (and `workers`' own):
/// `max_connections` clients
/// and, for upstream connections, the rest less one per client; when the limit is short
/// of that, half of what is not reserved each. Clients beyond that half wait in the
/// kernel's accept queue, as beyond `--max-connections`: accepted, they met EMFILE only
/// once they had taken the reserve, and with it the admin listener's accepts (the
/// probes and scrapes went dark for as long as they stayed) and the token exchange's
/// connects. At least one of each.
pub fn budget(limit: u64, max_connections: usize, workers: usize) -> Budget {
    let reserve = (limit / 4).clamp(RESERVED_LEAST, RESERVED);
    let reserved = reserve + PER_WORKER.saturating_mul(workers as u64);
    let usable = limit.saturating_sub(reserved);
    let clients = (max_connections as u64).min(usable / 2).max(1);
    let upstream = usable.saturating_sub(clients).max(1);
    let fit = |n: u64| usize::try_from(n).unwrap_or(Slots::UNLIMITED);
    Budget {
        clients: fit(clients).min(max_connections.max(1)),
        upstream: fit(upstream).min(Slots::UNLIMITED),
        pipes: fit((reserve - RESERVED_LEAST) / 2),
    }
}

/// Something that holds idle upstream connections and can close one to free its slot.
pub trait IdleConnections: Send + Sync {
    /// When its longest idle connection went idle, in [`crate::clock::since_boot`]; `None`
    /// when it holds none.
    fn oldest(&self) -> Option<Duration>;

    /// Closes its longest idle connection; false when it holds none.
    fn close_one(&self) -> bool;
}

/// The upstream connections the proxy may hold at once, shared by both planes' clients
/// (envd token look-ups, made for requests, included). Each connection holds a [`Slot`]
/// until it closes (idle in a pool included); the token exchange and `check` use the
/// reserve.
pub struct Slots {
    permits: Arc<Semaphore>,
    total: usize,
    /// Requests waiting for a slot: while there are some, a connection given back to a
    /// pool is closed instead, its slot going to one of them.
    waiting: AtomicUsize,
    /// Splices' pipes ([`Budget::pipes`]), apart from the connections' slots.
    pipes: Arc<Semaphore>,
    idle: Mutex<Vec<Weak<dyn IdleConnections>>>,
    warned: Mutex<Option<Instant>>,
}

/// One upstream connection's place in [`Slots`], given back when dropped.
#[derive(Debug)]
pub struct Slot {
    _permit: OwnedSemaphorePermit,
}

/// A splice's pipe's place ([`Budget::pipes`]), given back when dropped.
#[derive(Debug)]
pub struct PipeSlot {
    _permit: OwnedSemaphorePermit,
}

/// No slot came free in time: the proxy's own saturation, not the upstream's failure
/// (not counted in `abx_proxy_upstream_errors_total`).
#[derive(Debug, thiserror::Error)]
#[error(
    "no upstream connection free within {waited:?}: all {total} in use (the open-file \
     limit's share, see --max-connections)"
)]
pub struct NoSlot {
    waited: Duration,
    total: usize,
}

impl Slots {
    /// More than any descriptor limit (tokio's semaphore takes at most `usize::MAX >> 3`).
    pub const UNLIMITED: usize = Semaphore::MAX_PERMITS;
    const WARN_EVERY: Duration = Duration::from_secs(60);

    /// `total` upstream connections and `pipes` splices' pipes at once.
    pub fn new(total: usize, pipes: usize) -> Arc<Slots> {
        let total = total.clamp(1, Self::UNLIMITED);
        Arc::new(Slots {
            permits: Arc::new(Semaphore::new(total)),
            total,
            waiting: AtomicUsize::new(0),
            pipes: Arc::new(Semaphore::new(pipes.min(Self::UNLIMITED))),
            idle: Mutex::new(Vec::new()),
            warned: Mutex::new(None),
        })
    }

    /// For clients outside the proxy's count: the proxy's own calls, `check`, tests.
    pub fn unlimited() -> Arc<Slots> {
        Self::new(Self::UNLIMITED, Self::UNLIMITED)
    }

    /// Adds a pool whose idle connections may be closed to free a slot.
    pub fn register(&self, idle: Weak<dyn IdleConnections>) {
        let mut pools = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        pools.retain(|p| p.strong_count() > 0);
        pools.push(idle);
    }

    /// Upstream connections open now.
    pub fn in_use(&self) -> usize {
        self.total - self.permits.available_permits()
    }

    /// A place for a splice's pipe, never waiting: a splice can do without, the body is
    /// copied as usual.
    pub fn try_take_pipe(&self) -> Option<PipeSlot> {
        let permit = self.pipes.clone().try_acquire_owned().ok()?;
        Some(PipeSlot { _permit: permit })
    }

    /// Whether a request waits for a slot.
    pub fn wanted(&self) -> bool {
        self.waiting.load(Ordering::Relaxed) > 0
    }

    /// A slot for a new connection: a free one, else one an idle connection gave up, else
    /// the first given back within `wait`.
    pub async fn take(&self, wait: Duration) -> Result<Slot, NoSlot> {
        if let Some(slot) = self.try_take() {
            return Ok(slot);
        }
        let _waiting = Waiting::enter(&self.waiting);
        while self.close_idle() {
            if let Some(slot) = self.try_take() {
                return Ok(slot);
            }
        }
        self.warn();
        match tokio::time::timeout(wait, self.permits.clone().acquire_owned()).await {
            Ok(Ok(permit)) => Ok(Slot { _permit: permit }),
            _ => Err(NoSlot {
                waited: wait,
                total: self.total,
            }),
        }
    }

    fn try_take(&self) -> Option<Slot> {
        let permit = self.permits.clone().try_acquire_owned().ok()?;
        Some(Slot { _permit: permit })
    }

    fn close_idle(&self) -> bool {
        let pools: Vec<_> = {
            let pools = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
            pools.iter().filter_map(Weak::upgrade).collect()
        };
        // Outside the lock: closing a socket is a system call. The longest idle of all
        // goes (the control plane's pool is asked first, and lost its connection to every
        // envd request that needed a slot).
        let oldest = (pools.iter())
            .filter_map(|p| Some((p.oldest()?, p)))
            .min_by_key(|(since, _)| *since);
        match oldest {
            Some((_, pool)) => pool.close_one() || pools.iter().any(|p| p.close_one()),
            None => false,
        }
    }

    /// At most once a minute, as the accept loop says its slots are all in use.
    #[cold]
    fn warn(&self) {
        let mut warned = self.warned.lock().unwrap_or_else(PoisonError::into_inner);
        if warned.is_none_or(|w| w.elapsed() >= Self::WARN_EVERY) {
            *warned = Some(Instant::now());
            drop(warned);
            tracing::warn!(
                upstream_connections = self.total,
                "every upstream connection slot is in use (HTTP/2 clients may hold one per \
                 stream): requests wait up to --connect-timeout for one, then get 502; \
                 raise the open-file limit or lower --max-connections"
            );
        }
    }
}

/// Counts a request among [`Slots::waiting`] while it lives.
struct Waiting<'a>(&'a AtomicUsize);

impl<'a> Waiting<'a> {
    fn enter(count: &'a AtomicUsize) -> Self {
        count.fetch_add(1, Ordering::Relaxed);
        Waiting(count)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_budget_leaves_the_reserve_and_one_upstream_per_client() {
        let budget = |limit, max| {
            let b = budget(limit, max, 0);
            (b.clients, b.upstream)
        };
        // The default --max-connections with the limit raised for it.
        assert_eq!(budget(20_256, 10_000), (10_000, 10_000));
        // More room than needed goes to upstream connections.
        assert_eq!(
            budget(1_048_576, 10_000),
            (10_000, 1_048_576 - 256 - 10_000)
        );
        // A limit short of two per client: half of what is not reserved each.
        assert_eq!(budget(1024, 10_000), (384, 384));
        // Under 1 024, a quarter is reserved, at least 96.
        assert_eq!(budget(400, 10_000), (150, 150));
        assert_eq!(budget(200, 10_000), (52, 52));
        assert_eq!(budget(256, 10_000), (80, 80));
        assert_eq!(budget(0, 100), (1, 1));
        assert_eq!(budget(u64::MAX, 0), (1, Slots::UNLIMITED));
        // Each worker's own descriptors come out of what is left: 16 workers take 64.
        let busy = super::budget(256, 10_000, 16);
        assert_eq!((busy.clients, busy.upstream), (48, 48));
        // A full admin listener (64), what two workers' process holds at rest (21) and
        // every name look-up's sockets fit beside every client, upstream connection and
        // pipe the budget allows.
        let lookups = 2 * crate::resolve::MAX_LOOKUPS;
        for limit in [128, 256, 300, 400, 1024, 20_256] {
            let b = super::budget(limit, 10_000, 2);
            let used = 21 + 64 + lookups + b.clients + b.upstream + 2 * b.pipes;
            assert!(used as u64 <= limit, "{limit}: {used}");
        }
        // Pipes come out of the reserve beyond its least: none under a limit of ~400.
        let pipes = |limit| super::budget(limit, 10_000, 2).pipes;
        assert_eq!(
            [pipes(256), pipes(400), pipes(1024), pipes(20_256)],
            [0, 2, 80, 80]
        );
    }

    /// Splices' pipes have places of their own: a pipe takes no connection's slot, and
    /// none is made past [`Budget::pipes`].
    #[test]
    fn pipes_are_held_to_their_own_places() {
        let slots = Slots::new(1, 1);
        let pipe = slots.try_take_pipe().expect("a place");
        assert!(slots.try_take_pipe().is_none(), "one place");
        let conn = slots.try_take().expect("the connection's slot is free");
        assert_eq!(slots.in_use(), 1);
        drop(pipe);
        assert!(slots.try_take_pipe().is_some(), "given back");
        drop(conn);
        assert!(Slots::new(4, 0).try_take_pipe().is_none(), "no places");
    }

    /// The limit raised as asked serves every client `--max-connections` allows, however
    /// many workers: short of it, the warning would have to say so.
    #[test]
    fn the_limit_asked_for_serves_max_connections() {
        for (max, workers) in [
            (400, 64),
            (400, 16),
            (10_000, 2),
            (10_000, 256),
            (1, 1),
            (0, 4),
        ] {
            let b = budget(needed(max, workers), max, workers);
            assert_eq!(b.clients, max.max(1), "{max} clients, {workers} workers");
            assert!(b.upstream >= max, "{max} clients, {workers} workers");
        }
    }

    /// One idle connection's slot, idle since the time given.
    struct OneIdle(Mutex<Option<Slot>>, Duration);

    impl IdleConnections for OneIdle {
        fn oldest(&self) -> Option<Duration> {
            let held = self.0.lock().unwrap_or_else(PoisonError::into_inner);
            held.is_some().then_some(self.1)
        }

        fn close_one(&self) -> bool {
            self.0
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take()
                .is_some()
        }
    }

    /// The slot a request needs is the longest idle connection's, whichever pool holds it:
    /// the pool registered first (the control plane's) lost its connection every time.
    #[tokio::test(start_paused = true)]
    async fn a_full_count_closes_the_longest_idle_connection_of_all_pools() {
        let slots = Slots::new(2, 0);
        let earlier = crate::clock::since_boot();
        let later = earlier + Duration::from_secs(5);
        let mut pools = Vec::new();
        for since in [later, earlier] {
            let slot = slots.take(Duration::ZERO).await.ok();
            pools.push(Arc::new(OneIdle(Mutex::new(slot), since)));
        }
        let (first, second) = (&pools[0], &pools[1]);
        for p in &pools {
            slots.register(Arc::downgrade(p) as Weak<dyn IdleConnections>);
        }
        let taken = slots.take(Duration::from_secs(1)).await;
        assert!(taken.is_ok(), "{taken:?}");
        assert!(first.0.lock().unwrap().is_some(), "the newer one kept");
        assert!(
            second.0.lock().unwrap().is_none(),
            "the longest idle closed"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_full_count_closes_an_idle_connection_else_waits_then_fails() {
        let slots = Slots::new(2, 0);
        let busy = slots.take(Duration::from_secs(1)).await.ok();
        let idle = Arc::new(OneIdle(
            Mutex::new(slots.take(Duration::ZERO).await.ok()),
            crate::clock::since_boot(),
        ));
        assert_eq!(slots.in_use(), 2);
        slots.register(Arc::downgrade(&idle) as Weak<dyn IdleConnections>);

        // The idle connection's slot is taken over.
        let third = slots.take(Duration::from_secs(1)).await;
        assert!(third.is_ok(), "{third:?}");
        assert!(idle.0.lock().unwrap().is_none());
        assert_eq!(slots.in_use(), 2);

        // Nothing idle: the wait ends in an error naming the count.
        let err = slots.take(Duration::from_secs(3)).await.unwrap_err();
        assert_eq!(
            err.to_string(),
            "no upstream connection free within 3s: all 2 in use (the open-file limit's \
             share, see --max-connections)"
        );
        assert!(!slots.wanted());

        // A slot given back while a request waits goes to it.
        let waiter = tokio::spawn({
            let slots = slots.clone();
            async move { slots.take(Duration::from_secs(10)).await.is_ok() }
        });
        while !slots.wanted() {
            tokio::task::yield_now().await;
        }
        drop(busy);
        assert!(waiter.await.unwrap());
    }
}
