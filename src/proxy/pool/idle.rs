//! The pool's idle connections: a list per worker thread, by origin; the oldest closed
//! for a request waiting for a slot ([`IdleConnections`]), and a sweep dropping those
//! expired or closed by the upstream.

use std::sync::{Arc, MutexGuard, PoisonError, Weak};
use std::time::Duration;

use bytes::BytesMut;

use super::{Conn, Origin, Pool, FIRST_READ};
use crate::descriptors::IdleConnections;

pub(super) const MAX_IDLE_PER_ORIGIN: usize = 256;
/// How long an idle upstream connection is kept; hyper-util's pool, beside this one, keeps
/// its own as long (`crate::upstream`).
pub(crate) const IDLE_TIMEOUT: Duration = Duration::from_secs(90);
/// How often a worker with idle connections drops those expired or closed by the upstream
/// (see [`sweep`]).
pub(super) const SWEEP_EVERY: Duration = Duration::from_secs(30);

/// Idle connections by origin. There are a handful of origins (the control plane, envd or
/// a few sandboxes), so a list scanned in order beats hashing.
pub(super) struct Idle {
    pub(super) origins: Vec<OriginIdle>,
    /// A [`sweep`] task runs for this list.
    pub(super) sweeping: bool,
}

pub(super) struct OriginIdle {
    pub(super) key: Origin,
    /// Oldest first; taken from the end (the most recently used is the likeliest alive).
    pub(super) conns: Vec<Conn>,
}

impl Pool {
    pub(super) fn lock(&self) -> MutexGuard<'_, Idle> {
        self.idle[crate::workers::index() % self.idle.len()]
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// An idle connection to the origin that still looks open.
    pub(super) fn checkout(&self, tls: bool, host: &str, port: u16) -> Option<Conn> {
        let now = crate::clock::since_boot();
        loop {
            let mut conn = {
                let mut idle = self.lock();
                let list = idle
                    .origins
                    .iter_mut()
                    .find(|o| o.key.is(tls, host, port))?;
                let conn = list.conns.pop()?;
                if now.saturating_sub(conn.idle_since) >= IDLE_TIMEOUT {
                    // The ones below it are older still.
                    let expired = std::mem::take(&mut list.conns);
                    drop(idle);
                    drop((conn, expired));
                    return None;
                }
                conn
            };
            if conn.looks_open() {
                return Some(conn);
            }
        }
    }

    pub(super) fn put(self: &Arc<Self>, mut conn: Conn) {
        conn.idle_since = crate::clock::since_boot();
        // Not a download's buffer for an idle socket: up to 128 KiB each was kept, and a
        // thousand sandboxes' idle connections held 150 MiB. Its reads grew past the first
        // size (`capacity` says only what is left of the buffer past what was split off).
        if conn.read_size > FIRST_READ || conn.rbuf.capacity() > 2 * FIRST_READ {
            conn.rbuf = BytesMut::new();
        }
        conn.read_size = FIRST_READ;
        let mut idle = self.lock();
        if !idle.sweeping {
            // On this worker's runtime, like the connections it looks after.
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                idle.sweeping = true;
                runtime.spawn(sweep(Arc::downgrade(self)));
            }
        }
        let overflow = match idle.origins.iter_mut().find(|o| o.key == conn.origin) {
            Some(o) if o.conns.len() < MAX_IDLE_PER_ORIGIN => {
                o.conns.push(conn);
                None
            }
            Some(_) => Some(conn),
            None => {
                let key = conn.origin.clone();
                idle.origins.push(OriginIdle {
                    key,
                    conns: vec![conn],
                });
                None
            }
        };
        drop(idle);
        // Closing a socket is a syscall: not under the lock.
        drop(overflow);
        // A slot is worth more to a request waiting for one than to an idle connection.
        // Checked after the push (the list's lock taken and released): a request that
        // began to wait before then is counted by now, and one that begins later finds
        // the connection idle.
        if self.slots.wanted() {
            self.close_one();
        }
    }
}

impl Pool {
    /// Where the longest idle connection is: when it went idle, its worker's list and its
    /// origin there.
    fn oldest_at(&self) -> Option<(Duration, usize, usize)> {
        let lists = self.idle.iter().enumerate();
        (lists.filter_map(|(list, idle)| {
            let idle = idle.lock().unwrap_or_else(PoisonError::into_inner);
            let origins = idle.origins.iter().enumerate();
            (origins.filter_map(|(origin, o)| Some((o.conns.first()?.idle_since, list, origin))))
                .min()
        }))
        .min()
    }

    /// Closes an idle connection, the first found in any worker's list: the lists changed
    /// since the oldest was looked for (a request took it).
    fn close_any(&self) -> bool {
        self.idle.iter().any(|list| {
            let mut idle = list.lock().unwrap_or_else(PoisonError::into_inner);
            let found = (idle.origins.iter_mut())
                .find(|o| !o.conns.is_empty())
                .map(|o| o.conns.remove(0));
            drop(idle);
            found.is_some()
        })
    }
}

impl IdleConnections for Pool {
    fn oldest(&self) -> Option<Duration> {
        self.oldest_at().map(|(since, ..)| since)
    }

    /// The longest idle connection of all: the first origin's was closed, however busy
    /// (a sandbox used all along lost its connection to each new one, while hundreds idle
    /// since to sandboxes no longer used stayed open).
    fn close_one(&self) -> bool {
        let Some((_, list, origin)) = self.oldest_at() else {
            return false;
        };
        let mut idle = self.idle[list]
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let oldest = (idle.origins.get_mut(origin))
            .filter(|o| !o.conns.is_empty())
            .map(|o| o.conns.remove(0));
        drop(idle);
        // Closed outside the lock; from any thread, as the sweep's are.
        oldest.is_some() || self.close_any()
    }
}

/// Every [`SWEEP_EVERY`] while this worker keeps idle connections: drops those expired and
/// those the upstream closed or wrote to. Without it a connection the upstream closed stays
/// in CLOSE-WAIT, its descriptor held, until a request for the same origin comes, which
/// for a sandbox's own origin may be never. Ends when the list is empty (an idle proxy
/// wakes for nothing), or with the pool.
async fn sweep(pool: Weak<Pool>) {
    loop {
        tokio::time::sleep(SWEEP_EVERY).await;
        let Some(pool) = pool.upgrade() else { return };
        let now = crate::clock::since_boot();
        let mut gone = Vec::new();
        let mut idle = pool.lock();
        for o in &mut idle.origins {
            for mut c in std::mem::take(&mut o.conns) {
                let fresh = now.saturating_sub(c.idle_since) < IDLE_TIMEOUT;
                if fresh && c.looks_open() {
                    o.conns.push(c);
                } else {
                    gone.push(c);
                }
            }
        }
        idle.origins.retain(|o| !o.conns.is_empty());
        let done = idle.origins.is_empty();
        idle.sweeping = !done;
        drop(idle);
        // Closing sockets is syscalls: not under the lock.
        drop(gone);
        if done {
            return;
        }
    }
}
