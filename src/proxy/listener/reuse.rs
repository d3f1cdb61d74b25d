//! Connections that may be closed to make room: when every slot of `--max-connections` is
//! in use, those idle between requests longest are told to close, as nginx reuses its
//! keep-alive connections when it runs short ("worker_connections are not enough,
//! reusing connections"). Without it, clients' pools holding idle connections kept every
//! slot until `--idle-timeout` (300 s) while a new client got no answer at all, and
//! `/readyz` said 200.
//!
//! Each connection's task lists itself here for its life (its [`Activity`] and its
//! task's waker); the accept loop picks, from what each `Activity` says, the ones idle
//! longest and asks them ([`Activity::ask_to_close`]); each one's watchdog decides again
//! on its own task (a request may have begun meanwhile) and closes as an idle connection
//! does: after a GOAWAY or TLS `close_notify`, or over plain HTTP/1 once nothing waits in
//! its socket (a request written just then is answered, with `Connection: close`). One
//! lingering after an early answer, its client's body still arriving, is not idle.
//!
//! As nginx: an eighth of those idle, 1 to 32 a round, and one waiting for its first
//! request counts as idle (nginx's "reusable"; 33 that never sent one held back every
//! keep-alive one, asked first and refusing). Unlike nginx, none idle under
//! [`IDLE_FLOOR`] until a client has waited that long, and then one a round: closed with
//! its next request on the way, a client that does not check a pooled connection before
//! it writes (Python's `http.client`) fails that request (a quarter of them, with slots
//! turning over every few hundred ms); but clients that all reuse theirs within a second
//! must not keep a waiting one out for good.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};
use std::task::Waker;
use std::time::Instant;

use super::Activity;

/// Connections asked at once, at most (nginx's figure): a full proxy frees a few slots a
/// round, not every idle connection of every client at once.
const AT_ONCE: usize = 32;

/// A connection idle for less is not asked: its client may be about to reuse it.
pub(super) const IDLE_FLOOR: std::time::Duration = std::time::Duration::from_secs(1);

/// The connections' tasks, by a number of their own.
#[derive(Default)]
pub(crate) struct Listed {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    next: u64,
    conns: HashMap<u64, (Activity, Waker)>,
}

/// A connection's place in [`Listed`], for its task's life.
pub(super) struct Place<'a> {
    listed: &'a Listed,
    id: u64,
}

impl Drop for Place<'_> {
    fn drop(&mut self) {
        self.listed.lock().conns.remove(&self.id);
    }
}

impl Listed {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Lists a connection until the returned place is dropped; `task` wakes its task.
    pub(super) fn list(&self, activity: &Activity, task: Waker) -> Place<'_> {
        let mut inner = self.lock();
        let id = inner.next;
        inner.next += 1;
        inner.conns.insert(id, (activity.clone(), task));
        Place { listed: self, id }
    }

    /// Asks the connections idle between requests longest (for [`IDLE_FLOOR`] at least,
    /// unless `urgent`: a client has waited that long), an eighth of them, 1 to
    /// [`AT_ONCE`], to close. How many were asked.
    pub(super) fn reclaim(&self, urgent: bool) -> usize {
        let inner = self.lock();
        let now = Instant::now();
        let floor = match urgent {
            true => now,
            false => now.checked_sub(IDLE_FLOOR).unwrap_or(now),
        };
        let mut idle: Vec<(Instant, &(Activity, Waker))> = (inner.conns.values())
            // One asked already and leaving closes by itself: asked again each round, a
            // connection that could not close yet kept every other from being asked.
            .filter(|(activity, _)| activity.between_requests() && !activity.leaving())
            .map(|entry| (entry.0.last_moved(), entry))
            .filter(|(since, _)| *since <= floor)
            .collect();
        // Urgently, one a round: those are pools in use, each close a request's risk.
        let asked = if urgent {
            1
        } else {
            (idle.len() / 8).clamp(1, AT_ONCE)
        };
        if idle.len() > asked {
            idle.select_nth_unstable_by_key(asked, |(since, _)| *since);
            idle.truncate(asked);
        }
        for (_, (activity, task)) in &idle {
            activity.ask_to_close(urgent);
            task.wake_by_ref();
        }
        idle.len()
    }
}
