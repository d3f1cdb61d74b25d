//! The envd token store: each sandbox's `envdAccessToken`, learned from control-plane
//! responses, forgotten on delete, looked up from the control plane on a miss — one look-up
//! per sandbox however many requests wait for it.
//!
//! Bounded: most sandboxes end by timing out, not by a `DELETE` through this proxy, so
//! without a bound every sandbox ever created would stay. Each time a token is learned,
//! those older than [`MAX_AGE`] are dropped, and beyond [`MAX_TOKENS`] the oldest go (a
//! 64th of the bound at once, so that a full store is not sorted on every write);
//! [`TokenStore::get`] does not look at the age, so a request naming its sandbox pays no
//! clock read for it (an old token still served is at worst refused by envd, which
//! triggers a fresh look-up). Forgetting costs little: the SDKs send the token themselves,
//! and without it the next request looks it up again.
//!
//! The other way round, [`TokenStore::sandbox_of`] finds the sandbox a token belongs to,
//! for the envd requests of older SDKs that carry a token and name no sandbox: an index by
//! token kept in the same snapshot, and the tokens of the last [`MAX_FORGOTTEN`] sandboxes
//! deleted through the proxy (a `Mutex`, asked only when the index has no answer), so that
//! such an SDK's health check after a kill still reaches envd. Such an SDK names its
//! sandbox by nothing else: a token found by it counts as learned again (once an hour, as
//! a poll's answer does), or a sandbox in use by one would be the first pushed out at the
//! bound, and forgotten a day after its create however busy.
//!
//! A look-up runs in a task of its own, not in the request that started it: a client that
//! gives up waiting (an SDK whose timeout is shorter than a slow control plane's answer,
//! and that asks again) leaves it running for the next request. A look-up all of whose
//! requests have gone is kept only while fewer than [`MAX_ORPHANS`] are: a client that
//! names many sandboxes and hangs up at once cannot make the proxy hold more look-ups
//! (each an upstream request with the key) than requests it holds open itself.

use std::collections::{HashMap, HashSet, VecDeque};
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use tokio::sync::watch;

use crate::error::Error;
use crate::secret::Secret;

type Answer = Option<Result<Option<Secret>, Error>>;

/// Look-ups kept running with no request waiting for them, at most.
pub const MAX_ORPHANS: usize = 16;

/// Sandboxes remembered at most (about 1 MiB of E2B's tokens; 40 MiB at most of tokens
/// at the 4 KiB a learned one may be, see `sniff::MAX_TOKEN_LEN`).
pub const MAX_TOKENS: usize = 10_000;
// Said in thousands in a refusal's words.
const _: () = assert!(MAX_TOKENS.is_multiple_of(1000));
/// Deleted sandboxes' tokens kept for [`TokenStore::sandbox_of`], newest last.
const MAX_FORGOTTEN: usize = 1024;
/// Tokens of the proxy's that envd refused, kept for [`TokenStore::was_refused`].
const MAX_REFUSED: usize = 1024;
/// A deleted sandbox's refused tokens kept among the deleted ones, at most.
const REFUSED_KEPT_ON_DELETE: usize = 4;
/// A token is forgotten this long after it was learned: longer than a sandbox runs
/// without a pause.
pub const MAX_AGE: Duration = Duration::from_secs(24 * 3600);
/// The same token learned again within this long is left as it is: SDKs poll
/// `GET /sandboxes/{id}` and connect again and again, and each write copies the store.
const RELEARN_AFTER: Duration = Duration::from_secs(3600);

pub struct TokenStore {
    // Copy-on-write: reads are a pointer load; writes (one per sandbox created, and one an
    // hour per sandbox still in use) copy.
    tokens: ArcSwap<Snapshot>,
    /// One writer at a time (see [`TokenStore::write`]).
    writing: Mutex<()>,
    inflight: Mutex<Inflight>,
    /// How many look-ups `inflight` holds, for [`TokenStore::supersede`]'s check without
    /// the lock; changed under it.
    running: AtomicUsize,
    max_tokens: usize,
    /// The tokens of sandboxes deleted through the proxy, by sandbox: an envd request
    /// carrying one names its sandbox still (see [`TokenStore::sandbox_of`]). Bounded, and
    /// never attached to a request: the client sent it.
    forgotten: Mutex<VecDeque<(Secret, Arc<str>)>>,
    /// See [`TokenStore::refused`].
    refused: Mutex<Refused>,
    /// Whether `refused` was ever written: until then no request takes its lock (after a
    /// restart every SDK request for a sandbox the proxy has not learned would); a delete
    /// through the proxy takes it always.
    any_refused: AtomicBool,
}

/// One version of the store: each sandbox's token and when it was learned, and the index
/// back from each token to the sandboxes holding it. A write clones both (a table copy
/// and reference counts, no rehashing) and changes the few entries it concerns.
#[derive(Clone, Default)]
struct Snapshot {
    by_id: HashMap<Arc<str>, (Secret, Instant)>,
    /// Non-empty tokens only; two sandboxes hold one only if the control plane said so.
    by_token: HashMap<Secret, Arc<[Arc<str>]>>,
}

impl Snapshot {
    fn insert(&mut self, id: Arc<str>, token: Secret, at: Instant) {
        self.remove(&id);
        if !token.expose().is_empty() {
            let holders = match self.by_token.get(&token) {
                Some(h) => h.iter().cloned().chain([id.clone()]).collect(),
                None => Arc::from([id.clone()]),
            };
            self.by_token.insert(token.clone(), holders);
        }
        self.by_id.insert(id, (token, at));
    }

    fn remove(&mut self, id: &str) {
        let Some((token, _)) = self.by_id.remove(id) else {
            return;
        };
        let Some(holders) = self.by_token.get(&token) else {
            return;
        };
        let rest: Arc<[Arc<str>]> = holders.iter().filter(|h| ***h != *id).cloned().collect();
        if rest.is_empty() {
            self.by_token.remove(&token);
        } else {
            self.by_token.insert(token, rest);
        }
    }
}

/// The tokens of the proxy's own that envd refused (see [`TokenStore::refused`]), by
/// token: a request's look-up is one hash, not a scan. Bounded, the oldest going first.
#[derive(Default)]
struct Refused {
    order: VecDeque<(Secret, Arc<str>)>,
    by_token: HashMap<Secret, Vec<Arc<str>>>,
}

impl Refused {
    fn holds(&self, id: &str, token: &str) -> bool {
        (self.by_token.get(token)).is_some_and(|ids| ids.iter().any(|i| **i == *id))
    }

    fn add(&mut self, id: &str, token: &Secret) {
        if self.holds(id, token.expose()) {
            return;
        }
        if self.order.len() >= MAX_REFUSED {
            if let Some((t, i)) = self.order.pop_front() {
                self.unindex(&t, &i);
            }
        }
        let id: Arc<str> = Arc::from(id);
        self.order.push_back((token.clone(), id.clone()));
        self.by_token.entry(token.clone()).or_default().push(id);
    }

    fn unindex(&mut self, token: &Secret, id: &Arc<str>) {
        if let Some(ids) = self.by_token.get_mut(token) {
            ids.retain(|i| i != id);
            if ids.is_empty() {
                self.by_token.remove(token);
            }
        }
    }

    /// Takes the entries of the sandboxes `of` names out, oldest first.
    fn take(&mut self, of: impl Fn(&str) -> bool) -> Vec<(Secret, Arc<str>)> {
        let mut taken = Vec::new();
        self.order.retain(|(t, i)| {
            let this = of(i);
            if this {
                taken.push((t.clone(), i.clone()));
            }
            !this
        });
        for (t, i) in &taken {
            self.unindex(t, i);
        }
        taken
    }
}

/// The look-ups running, by sandbox, and how many of them no request waits for.
#[derive(Default)]
struct Inflight {
    lookups: HashMap<String, Lookup>,
    orphans: usize,
}

struct Lookup {
    answer: watch::Receiver<Answer>,
    task: tokio::task::AbortHandle,
    waiters: usize,
    /// See [`TokenStore::supersede`].
    superseded: bool,
}

/// A look-up's place in [`Inflight`], closed by its task: with the fetched token, or
/// unwinding from a panic (none is known). Otherwise the entry would outlive its task,
/// and every later request for the sandbox would join a look-up that never answers.
struct Entry<'a> {
    store: &'a TokenStore,
    id: &'a str,
    answer: watch::Receiver<Answer>,
    open: bool,
}

impl Entry<'_> {
    /// Remembers `token` (unless superseded) and removes the entry. Whether a request
    /// still waited; `None` when the entry was not there (ended by the bound on orphans).
    fn close(&mut self, token: Option<Secret>) -> Option<bool> {
        self.open = false;
        let mut inflight = self.store.lock_inflight();
        let lookup =
            (inflight.lookups.get(self.id)).filter(|l| l.answer.same_channel(&self.answer))?;
        let (waited, superseded) = (lookup.waiters > 0, lookup.superseded);
        if let Some(token) = token.filter(|_| !superseded) {
            self.store.insert_at(self.id, token, Instant::now());
        }
        if !waited {
            inflight.orphans -= 1;
        }
        self.store.forget(&mut inflight, self.id);
        Some(waited)
    }
}

impl Drop for Entry<'_> {
    fn drop(&mut self) {
        if self.open {
            self.close(None);
        }
    }
}

impl Default for TokenStore {
    fn default() -> Self {
        Self::with_max(MAX_TOKENS)
    }
}

impl TokenStore {
    pub fn new() -> Self {
        Self::default()
    }

    fn with_max(max_tokens: usize) -> Self {
        TokenStore {
            tokens: ArcSwap::default(),
            writing: Mutex::default(),
            inflight: Mutex::default(),
            running: AtomicUsize::new(0),
            max_tokens,
            forgotten: Mutex::default(),
            refused: Mutex::default(),
            any_refused: AtomicBool::new(false),
        }
    }

    pub fn get(&self, sandbox_id: &str) -> Option<Secret> {
        self.tokens
            .load()
            .by_id
            .get(sandbox_id)
            .map(|(t, _)| t.clone())
    }

    /// A token learned from the control plane's answer to a client.
    pub fn insert(&self, sandbox_id: &str, token: Secret) {
        self.insert_all(&[(sandbox_id, token)]);
    }

    /// The tokens one answer carries (a fork's carries one per fork): one copy of the store
    /// for them all, however many.
    pub fn insert_all<S: AsRef<str>>(&self, learned: &[(S, Secret)]) {
        for (id, _) in learned {
            self.supersede(id.as_ref());
        }
        self.insert_all_at(learned, Instant::now());
    }

    /// Inserts as learned at `now`, dropping what is too old and, beyond the bound, the
    /// oldest.
    fn insert_at(&self, sandbox_id: &str, token: Secret, now: Instant) {
        self.insert_all_at(&[(sandbox_id, token)], now);
    }

    fn insert_all_at<S: AsRef<str>>(&self, learned: &[(S, Secret)], now: Instant) {
        // One token per sandbox, the answer's last for it (as one at a time would leave),
        // in the answer's order; and the bound holds however many it names: its last ones.
        let mut named = HashSet::new();
        let mut learned: Vec<&(S, Secret)> = (learned.iter().rev())
            .filter(|(id, _)| named.insert(id.as_ref()))
            .collect();
        learned.reverse();
        let learned = &learned[learned.len().saturating_sub(self.max_tokens)..];
        // What `snapshot` holds already, learned again lately.
        let fresh_in = |snapshot: &Snapshot| -> Vec<&(S, Secret)> {
            (learned.iter().copied())
                .filter(|(id, token)| {
                    !(snapshot.by_id.get(id.as_ref())).is_some_and(|(t, at)| {
                        t == token && now.saturating_duration_since(*at) < RELEARN_AFTER
                    })
                })
                .collect()
        };
        // Without the lock first: most writes are a poll's answer learned again.
        if fresh_in(&self.tokens.load()).is_empty() {
            return;
        }
        self.write(|snapshot| {
            // Again as it stands now: a writer in between may have changed what was known.
            let fresh = fresh_in(snapshot);
            if fresh.is_empty() {
                return None;
            }
            let mut next = Snapshot::clone(snapshot);
            let aged: Vec<Arc<str>> = (next.by_id.iter())
                .filter(|(_, (_, at))| now.saturating_duration_since(*at) >= MAX_AGE)
                .map(|(id, _)| id.clone())
                .collect();
            for id in &aged {
                next.remove(id);
            }
            let new = (fresh.iter())
                .filter(|(id, _)| !next.by_id.contains_key(id.as_ref()))
                .count();
            let over = (next.by_id.len() + new).saturating_sub(self.max_tokens);
            if over > 0 {
                // A 64th of the bound at least: a store at its bound sorted itself again
                // on every token learned (1.2 ms of CPU each at 10 000).
                let over = over.max(self.max_tokens / 64);
                // Not the answer's own, new or known: those stay (there is room for them:
                // the answer is capped to the bound).
                let answer: HashSet<&str> = learned.iter().map(|(id, _)| id.as_ref()).collect();
                let mut by_age: Vec<(Instant, Arc<str>)> = (next.by_id.iter())
                    .filter(|(id, _)| !answer.contains(&***id))
                    .map(|(id, (_, at))| (*at, id.clone()))
                    .collect();
                // The `over` oldest first, in linear time.
                if over < by_age.len() {
                    by_age.select_nth_unstable_by_key(over, |(at, _)| *at);
                }
                for (_, id) in by_age.iter().take(over) {
                    next.remove(id);
                }
            }
            for (id, token) in &fresh {
                next.insert(Arc::from(id.as_ref()), token.clone(), now);
            }
            Some(next)
        });
    }

    /// `sandbox_id`'s time set to `now`, if it still holds `token` and that time is
    /// `RELEARN_AFTER` old: never an insert. Between the read that found it and this
    /// write, a delete, envd's refusal or a newer token may have come, and must stand
    /// (written back as learned, a deleted sandbox lived on, and a refused token came back).
    fn touch(&self, sandbox_id: &str, token: &str, now: Instant) {
        self.write(|snapshot| {
            let (held, at) = snapshot.by_id.get(sandbox_id)?;
            let due = now.saturating_duration_since(*at) >= RELEARN_AFTER;
            if held.expose() != token || !due {
                return None;
            }
            let mut next = Snapshot::clone(snapshot);
            if let Some((_, at)) = next.by_id.get_mut(sandbox_id) {
                *at = now;
            }
            Some(next)
        });
    }

    /// The sandbox was deleted: its token is dropped, and kept among the last
    /// [`MAX_FORGOTTEN`] deleted ones for [`TokenStore::sandbox_of`] (never sent by the
    /// proxy again).
    pub fn remove(&self, sandbox_id: &str) {
        self.supersede(sandbox_id);
        // Held until the deleted list has them: a refusal landing meanwhile (see
        // [`TokenStore::refused`]) finds the sandbox among the deleted, not in neither list.
        let mut refused = self.lock_refused();
        // Its tokens envd refused too (dropped from the store then): an older SDK may hold
        // one, and its health check after the kill names the sandbox by it.
        // The last few: one sandbox's refusals must not push every other deleted one out.
        let mut gone = refused.take(|id| id == sandbox_id);
        gone.drain(..gone.len().saturating_sub(REFUSED_KEPT_ON_DELETE));
        let known = (self.tokens.load().by_id.get_key_value(sandbox_id))
            .map(|(id, (token, _))| (id.clone(), token.clone()));
        gone.extend(known.clone().map(|(id, token)| (token, id)));
        gone.retain(|(token, _)| !token.expose().is_empty());
        if !gone.is_empty() {
            let mut forgotten = self.lock_forgotten();
            for (token, id) in gone {
                if forgotten.len() >= MAX_FORGOTTEN {
                    forgotten.pop_front();
                }
                forgotten.push_back((token, id));
            }
        }
        drop(refused);
        if known.is_none() {
            return;
        }
        self.write(|snapshot| {
            let mut next = Snapshot::clone(snapshot);
            next.remove(sandbox_id);
            Some(next)
        });
    }

    /// A new version of the store, from the one in place. One writer at a time: each copies
    /// the whole store, and `ArcSwap::rcu` copied it again for every writer that raced it
    /// (two workers learning tokens at the bound made RSS grow 2-4 times over).
    /// `None`: nothing to change.
    fn write(&self, change: impl FnOnce(&Snapshot) -> Option<Snapshot>) {
        let _one = self.writing.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(next) = change(&self.tokens.load()) {
            self.tokens.store(Arc::new(next));
        }
    }

    /// Forgets `sandbox_id`'s token only while it is still `stale` (the one envd refused):
    /// a fresher token, fetched after the same 401 by a concurrent request, is kept.
    pub fn remove_stale(&self, sandbox_id: &str, stale: &Secret) {
        if self.get(sandbox_id).as_ref() == Some(stale) {
            self.write(|snapshot| {
                // Still the stale one: a concurrent look-up may have replaced it.
                let stale = snapshot.by_id.get(sandbox_id).map(|(t, _)| t) == Some(stale);
                stale.then(|| {
                    let mut next = Snapshot::clone(snapshot);
                    next.remove(sandbox_id);
                    next
                })
            });
        }
    }

    /// envd refused `token`, the proxy's own for `sandbox_id` (then dropped, and looked up
    /// again). The SDKs send their copy of it with every request: no token of the client's,
    /// but one known to fail (see [`TokenStore::was_refused`]).
    /// Kept while the sandbox lives (a look-up's new token does not end it: an older SDK
    /// keeps sending the refused one alone, which must still name its sandbox); taken to
    /// the deleted ones when it is deleted through the proxy.
    pub fn refused(&self, sandbox_id: &str, token: &Secret) {
        if token.expose().is_empty() {
            return;
        }
        let mut refused = self.lock_refused();
        // A refusal landing after the sandbox's delete through the proxy (its request was
        // in flight when the delete was answered): deleted, not refused. Refused, the
        // SDK's health check after the kill was looked up (404 E2009, which e2b raises)
        // instead of reaching envd (whose 502 it reads as "not running").
        let deleted =
            (self.lock_forgotten().iter()).any(|(t, id)| t == token && **id == *sandbox_id);
        if !deleted {
            refused.add(sandbox_id, token);
            self.any_refused.store(true, Ordering::Relaxed);
        }
    }

    /// Whether envd refused `token` as the proxy's own for `sandbox_id`. Asked only for a
    /// request that finds no token stored and sends one.
    pub fn was_refused(&self, sandbox_id: &str, token: &Secret) -> bool {
        if !self.any_refused.load(Ordering::Relaxed) {
            return false;
        }
        self.lock_refused().holds(sandbox_id, token.expose())
    }

    /// Holds back every write to the store until dropped, for a test of what a request
    /// finds between two of them (readers still load the snapshot in place).
    #[cfg(test)]
    pub(crate) fn hold_writes(&self) -> std::sync::MutexGuard<'_, ()> {
        self.writing.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Taken before [`TokenStore::lock_forgotten`] when both are held.
    fn lock_refused(&self) -> std::sync::MutexGuard<'_, Refused> {
        self.refused.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn lock_forgotten(&self) -> std::sync::MutexGuard<'_, VecDeque<(Secret, Arc<str>)>> {
        self.forgotten
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn len(&self) -> usize {
        self.tokens.load().by_id.len()
    }

    /// The sandbox whose learned token is `token` (none for an empty one, nor for one
    /// past [`MAX_AGE`]), or a sandbox deleted through the proxy whose token it was: for
    /// the envd requests that name no sandbox but carry its token (see `Proxy::by_token`),
    /// never for those that name one. A deleted one's: an SDK asks envd's `/health` after a
    /// kill, and the control plane's own `/health` said "running". A token two sandboxes
    /// hold names neither: which one a client meant is unknowable.
    pub fn sandbox_of(&self, token: &[u8]) -> Option<TokenOwner> {
        self.sandbox_of_at(token, Instant::now())
    }

    fn sandbox_of_at(&self, token: &[u8], now: Instant) -> Option<TokenOwner> {
        // Tokens are text: bytes that are not match none.
        let token = std::str::from_utf8(token).ok().filter(|t| !t.is_empty())?;
        let snapshot = self.tokens.load();
        let holders = snapshot.by_token.get(token).map_or(&[][..], |h| &h[..]);
        let learned = holders.iter().filter(|id| {
            (snapshot.by_id.get(*id))
                .is_some_and(|(_, at)| now.saturating_duration_since(*at) < MAX_AGE)
        });
        if let Some(id) = only_one(learned) {
            // Two holders name neither.
            let id = id.cloned()?;
            // In use: its time renewed (a write only past `RELEARN_AFTER`, as for a poll).
            let due = (snapshot.by_id.get(&id))
                .is_some_and(|(_, at)| now.saturating_duration_since(*at) >= RELEARN_AFTER);
            if due {
                drop(snapshot);
                self.touch(&id, token, now);
            }
            return Some(TokenOwner { id, deleted: false });
        }
        // Deleted through the proxy first: a refusal that lands after the delete (its
        // request was in flight) must not bring the sandbox back as a live one.
        let forgotten = self.lock_forgotten();
        let deleted = (forgotten.iter()).filter(|(t, _)| t.expose() == token);
        if let Some(id) = only_one(deleted.map(|(_, id)| id)) {
            return id.map(|id| TokenOwner {
                id: id.clone(),
                deleted: true,
            });
        }
        drop(forgotten);
        // A token of the proxy's envd refused (dropped from the index then): its sandbox
        // still, for an older SDK that sends it alone; `Proxy::envd` looks it up again
        // (a failing look-up's error, or the new token once it answers).
        if !self.any_refused.load(Ordering::Relaxed) {
            return None;
        }
        let refused = self.lock_refused();
        let holders = refused.by_token.get(token)?;
        let id = only_one(holders.iter()).flatten()?;
        Some(TokenOwner {
            id: id.clone(),
            deleted: false,
        })
    }

    /// Sandboxes with a token (`abx_proxy_envd_tokens`): not those remembered as having
    /// none (unsecured ones), nor those over [`MAX_AGE`] that only the next token learned
    /// drops (after a quiet day the gauge counted them all). Counted at each scrape, over
    /// at most [`MAX_TOKENS`].
    pub fn with_token(&self) -> usize {
        self.with_token_at(Instant::now())
    }

    fn with_token_at(&self, now: Instant) -> usize {
        let tokens = self.tokens.load();
        (tokens.by_id.values())
            .filter(|(t, at)| {
                !t.expose().is_empty() && now.saturating_duration_since(*at) < MAX_AGE
            })
            .count()
    }

    /// The token for `sandbox_id`, running `fetch` on a miss. Concurrent callers for the same
    /// sandbox share one `fetch`, which runs in a task of its own (see the module's doc).
    /// `Ok(None)`: the sandbox does not exist; `None`: the look-up ended without an answer
    /// (only a panic, none known, or the runtime's end does that while a request waits).
    pub async fn get_or_fetch<F, Fut>(
        self: &Arc<Self>,
        sandbox_id: &str,
        fetch: F,
    ) -> Option<Result<Option<Secret>, Error>>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<Option<Secret>, Error>> + Send + 'static,
    {
        if let Some(t) = self.get(sandbox_id) {
            return Some(Ok(Some(t)));
        }
        let mut answer = {
            let mut inflight = self.lock_inflight();
            match inflight.lookups.get_mut(sandbox_id) {
                Some(lookup) => {
                    lookup.waiters += 1;
                    let rx = lookup.answer.clone();
                    if lookup.waiters == 1 {
                        inflight.orphans -= 1;
                    }
                    rx
                }
                None => {
                    // A token learned while we queued makes the fetch unnecessary.
                    if let Some(t) = self.get(sandbox_id) {
                        return Some(Ok(Some(t)));
                    }
                    let (tx, rx) = watch::channel(None);
                    let task = tokio::spawn(Self::look_up(
                        Arc::clone(self),
                        sandbox_id.to_string(),
                        fetch(),
                        tx,
                    ));
                    let lookup = Lookup {
                        answer: rx.clone(),
                        task: task.abort_handle(),
                        waiters: 1,
                        superseded: false,
                    };
                    inflight.lookups.insert(sandbox_id.to_string(), lookup);
                    self.running.fetch_add(1, Ordering::SeqCst);
                    rx
                }
            }
        };
        let _waiting = Waiting {
            store: self,
            id: sandbox_id,
            answer: answer.clone(),
        };
        let got = answer.wait_for(Option::is_some).await;
        got.ok().and_then(|answer| answer.clone())
    }

    /// One look-up's task: the fetch, the token remembered, the look-up's entry gone, then
    /// the answer for whoever still waits.
    async fn look_up(
        store: Arc<Self>,
        sandbox_id: String,
        fetch: impl Future<Output = Result<Option<Secret>, Error>>,
        answer: watch::Sender<Answer>,
    ) {
        let mut entry = Entry {
            store: &store,
            id: &sandbox_id,
            answer: answer.subscribe(),
            open: true,
        };
        let result = fetch.await;
        let waited = entry.close(result.as_ref().ok().cloned().flatten());
        // Nobody to tell: a failure would otherwise leave no trace but a 499 per client.
        // (`None`: the bound on orphans ended it, and said nothing was waiting.)
        if let (Some(false), Err(e)) = (waited, &result) {
            tracing::warn!(
                sandbox_id = %sandbox_id,
                error = %e.line(),
                "envd token look-up failed after its requests had gone"
            );
        }
        let _ = answer.send(Some(result));
    }

    /// A token learned or a sandbox deleted while its look-up runs: the look-up, asked
    /// before, must not put back an older token or one of a sandbox that is gone.
    fn supersede(&self, sandbox_id: &str) {
        // Most learning happens with no look-up running: no lock then. One registered
        // after this load asked the control plane after this answer was given.
        if self.running.load(Ordering::SeqCst) == 0 {
            return;
        }
        let mut inflight = self.lock_inflight();
        if let Some(lookup) = inflight.lookups.get_mut(sandbox_id) {
            lookup.superseded = true;
        }
    }

    /// Removes a look-up's entry, and its count beside the map.
    fn forget(&self, inflight: &mut Inflight, sandbox_id: &str) {
        if inflight.lookups.remove(sandbox_id).is_some() {
            self.running.fetch_sub(1, Ordering::SeqCst);
        }
    }

    fn lock_inflight(&self) -> std::sync::MutexGuard<'_, Inflight> {
        self.inflight.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Look-ups running, and those of them no request waits for (for tests).
    #[cfg(test)]
    fn running(&self) -> (usize, usize) {
        let inflight = self.lock_inflight();
        let counted = self.running.load(Ordering::SeqCst);
        assert_eq!(counted, inflight.lookups.len(), "look-ups counted");
        (inflight.lookups.len(), inflight.orphans)
    }
}

/// A request waiting for a look-up; dropped when it has its answer or gives up. The last
/// to go leaves the look-up running as an orphan, or ends it when [`MAX_ORPHANS`] run.
struct Waiting<'a> {
    store: &'a TokenStore,
    id: &'a str,
    answer: watch::Receiver<Answer>,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        let mut inflight = self.store.lock_inflight();
        let orphans = inflight.orphans;
        // Only the look-up this request waited for: one that ended and was replaced by a
        // newer one for the same sandbox is not ours to count.
        let Some(lookup) =
            (inflight.lookups.get_mut(self.id)).filter(|l| l.answer.same_channel(&self.answer))
        else {
            return;
        };
        lookup.waiters -= 1;
        if lookup.waiters > 0 {
            return;
        }
        if orphans < MAX_ORPHANS {
            inflight.orphans += 1;
        } else {
            lookup.task.abort();
            self.store.forget(&mut inflight, self.id);
        }
    }
}

/// The sandbox a token names (see [`TokenStore::sandbox_of`]).
#[derive(Debug, PartialEq)]
pub struct TokenOwner {
    pub id: Arc<str>,
    /// Deleted through the proxy: its id may have been given to another sandbox since
    /// (a provider that reuses ids), whose token the proxy must not put in its place.
    pub deleted: bool,
}

/// `None` for no item, `Some(None)` for two or more different ones, else the one.
fn only_one<'a>(mut items: impl Iterator<Item = &'a Arc<str>>) -> Option<Option<&'a Arc<str>>> {
    let first = items.next()?;
    Some(items.all(|other| other == first).then_some(first))
}

impl std::fmt::Debug for TokenStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TokenStore({} sandboxes)", self.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// SDKs poll `GET /sandboxes/{id}` and connect again: the same token learned again is
    /// not a copy of the store each time; after [`RELEARN_AFTER`] it is, so a sandbox in use
    /// keeps its token past [`MAX_AGE`]; a new token is stored at once.
    #[test]
    fn the_same_token_learned_again_leaves_the_store_alone() {
        let store = TokenStore::new();
        let t0 = Instant::now();
        store.insert_at("isb-1", Secret::new("tok"), t0);
        let before = store.tokens.load_full();
        store.insert_at("isb-1", Secret::new("tok"), t0 + Duration::from_secs(60));
        assert!(Arc::ptr_eq(&before, &store.tokens.load_full()), "copied");

        store.insert_at("isb-1", Secret::new("tok"), t0 + RELEARN_AFTER);
        assert!(!Arc::ptr_eq(&before, &store.tokens.load_full()));
        let learned = store.tokens.load().by_id.get("isb-1").map(|(_, at)| *at);
        assert_eq!(learned, Some(t0 + RELEARN_AFTER));

        let before = store.tokens.load_full();
        store.insert_at("isb-1", Secret::new("new"), t0 + RELEARN_AFTER);
        assert!(!Arc::ptr_eq(&before, &store.tokens.load_full()));
        assert_eq!(store.get("isb-1").unwrap().expose(), "new");
    }

    /// An older SDK's sandbox, named by its token alone, counts as learned again when used
    /// so (past [`RELEARN_AFTER`], without a copy of the store before): at the bound the
    /// idle ones go first, and a day after its create it is still found.
    #[test]
    fn a_token_in_use_alone_counts_as_learned_again() {
        let store = TokenStore::with_max(3);
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        store.insert_at("isb-used", Secret::new("tok-used"), t0);
        store.insert_at("isb-idle", Secret::new("tok-idle"), at(1));
        store.insert_at("isb-new", Secret::new("tok-new"), at(2));
        let owner = |now: Instant| (store.sandbox_of_at(b"tok-used", now)).map(|o| o.id);
        let before = store.tokens.load_full();
        assert_eq!(owner(at(60)).as_deref(), Some("isb-used"));
        assert!(Arc::ptr_eq(&before, &store.tokens.load_full()), "copied");

        let used = t0 + RELEARN_AFTER;
        assert_eq!(owner(used).as_deref(), Some("isb-used"));
        store.insert_at(
            "isb-next",
            Secret::new("tok-next"),
            used + Duration::from_secs(1),
        );
        assert!(store.get("isb-idle").is_none(), "the idle one goes first");
        assert!(store.get("isb-used").is_some(), "the one in use stays");
        assert_eq!(owner(used + MAX_AGE / 2).as_deref(), Some("isb-used"));
        assert_eq!(
            owner(used + MAX_AGE / 2 + MAX_AGE - Duration::from_secs(1)).as_deref(),
            Some("isb-used"),
            "a day from its last use"
        );
    }

    /// The renewal of a token in use only renews: read from an older version of the store,
    /// it neither brings back a token deleted or refused since, nor overwrites a newer one.
    #[test]
    fn renewing_a_token_in_use_never_undoes_a_later_write() {
        let store = TokenStore::with_max(10);
        let t0 = Instant::now();
        let due = t0 + RELEARN_AFTER;
        let at = |store: &TokenStore| store.tokens.load().by_id.get("isb-a").map(|(_, at)| *at);
        store.insert_at("isb-a", Secret::new("tok-a"), t0);
        store.remove("isb-a");
        store.touch("isb-a", "tok-a", due);
        assert!(store.get("isb-a").is_none(), "a deleted sandbox came back");
        store.insert_at("isb-a", Secret::new("tok-b"), t0);
        store.touch("isb-a", "tok-a", due);
        assert_eq!(
            store
                .get("isb-a")
                .map(|t| t.expose().to_string())
                .as_deref(),
            Some("tok-b")
        );
        assert_eq!(at(&store), Some(t0), "another token's time renewed");
        store.touch("isb-a", "tok-b", t0 + Duration::from_secs(60));
        assert_eq!(at(&store), Some(t0), "renewed before RELEARN_AFTER");
        store.touch("isb-a", "tok-b", due);
        assert_eq!(at(&store), Some(due));
    }

    #[tokio::test]
    async fn concurrent_misses_fetch_once() {
        let store = Arc::new(TokenStore::new());
        let calls = Arc::new(AtomicUsize::new(0));
        let (release_tx, release_rx) = watch::channel(false);
        let mut tasks = Vec::new();
        for _ in 0..50 {
            let (store, calls, mut release) = (store.clone(), calls.clone(), release_rx.clone());
            tasks.push(tokio::spawn(async move {
                store
                    .get_or_fetch("isb-1", || async move {
                        calls.fetch_add(1, Ordering::SeqCst);
                        let _ = release.wait_for(|r| *r).await;
                        Ok(Some(Secret::new("tok")))
                    })
                    .await
            }));
        }
        tokio::task::yield_now().await;
        let _ = release_tx.send(true);
        for t in tasks {
            let got = t.await.unwrap().unwrap().unwrap().unwrap();
            assert_eq!(got.expose(), "tok");
        }
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        store.remove("isb-1");
        assert!(store.get("isb-1").is_none());
    }

    /// `Debug` says how many, never which sandbox or what token.
    #[test]
    fn debug_shows_the_count_only() {
        let store = TokenStore::new();
        store.insert("isb-debug", Secret::new("envd-token-value"));
        let shown = format!("{store:?}");
        assert_eq!(shown, "TokenStore(1 sandboxes)");
    }

    #[test]
    fn old_tokens_go_and_the_store_stays_bounded() {
        let store = TokenStore::new();
        let t0 = Instant::now();
        store.insert_at("old", Secret::new("a"), t0);
        store.insert_at("young", Secret::new("b"), t0 + MAX_AGE / 2);
        store.insert_at("new", Secret::new("c"), t0 + MAX_AGE);
        assert!(store.get("old").is_none(), "a day-old token stays");
        assert_eq!(store.with_token_at(t0 + MAX_AGE), 2);
        assert_eq!(
            store.with_token_at(t0 + MAX_AGE * 3 / 2),
            1,
            "counted past a day"
        );
        assert!(store.get("young").is_some() && store.get("new").is_some());
        // The README's promise in hours: a sandbox running all day keeps its token.
        let hour = Duration::from_secs(3600);
        let store = TokenStore::new();
        store.insert_at("all-day", Secret::new("a"), t0);
        store.insert_at("other", Secret::new("b"), t0 + 23 * hour);
        assert!(store.get("all-day").is_some(), "gone before 24 hours");
        store.insert_at("other", Secret::new("c"), t0 + 24 * hour);
        assert!(store.get("all-day").is_none(), "kept past 24 hours");

        // The bound at a size a debug build copies quickly, where a 64th of it is 2;
        // MAX_TOKENS works the same way.
        const MAX: usize = 128;
        let store = TokenStore::with_max(MAX);
        for i in 0..=MAX {
            store.insert_at(
                &format!("isb-{i}"),
                Secret::new("t"),
                t0 + Duration::from_millis(i as u64),
            );
        }
        // The oldest go first, a 64th of the bound at once (where one is over it).
        let kept = MAX + 1 - MAX / 64;
        assert_eq!(store.len(), kept);
        assert!(store.get("isb-0").is_none(), "the oldest goes first");
        assert!(store.get("isb-1").is_none(), "a 64th of the bound with it");
        assert!(store.get("isb-2").is_some());
        assert!(store.get(&format!("isb-{MAX}")).is_some());
        // Learning a known sandbox again evicts nothing.
        store.insert_at("isb-2", Secret::new("t2"), t0 + MAX_AGE / 2);
        assert_eq!(store.len(), kept);
        assert_eq!(
            store
                .get("isb-2")
                .map(|t| t.expose().to_string())
                .as_deref(),
            Some("t2")
        );
    }

    /// Polls `fut` once; whether it finished.
    async fn poll_once<F: Future + Unpin>(fut: &mut F) -> bool {
        tokio::select! {
            biased;
            _ = fut => true,
            _ = async {} => false,
        }
    }

    type Fetch = std::pin::Pin<Box<dyn Future<Output = Result<Option<Secret>, Error>> + Send>>;

    /// A fetch that answers `tok` once `release` says so.
    fn gated(release: &watch::Sender<bool>) -> impl FnOnce() -> Fetch {
        let mut release = release.subscribe();
        move || {
            Box::pin(async move {
                let _ = release.wait_for(|r| *r).await;
                Ok(Some(Secret::new("tok")))
            })
        }
    }

    /// The request that started a look-up hangs up mid-fetch: the look-up goes on, and the
    /// request waiting beside it gets its answer (a second fetch would never end).
    #[tokio::test]
    async fn a_look_up_outlives_the_request_that_started_it() {
        let store = Arc::new(TokenStore::new());
        let (release, _) = watch::channel(false);
        let mut leader = Box::pin(store.get_or_fetch("isb-1", gated(&release)));
        assert!(!poll_once(&mut leader).await, "the look-up runs");
        let mut waiter = Box::pin(store.get_or_fetch("isb-1", std::future::pending));
        assert!(!poll_once(&mut waiter).await, "the waiter waits for it");
        drop(leader);
        assert_eq!(store.running(), (1, 0), "one look-up, still waited for");
        release.send_replace(true);
        let got = waiter.await.unwrap().unwrap();
        assert_eq!(got.map(|t| t.expose().to_string()).as_deref(), Some("tok"));
        assert_eq!(store.running(), (0, 0));
    }

    /// With no request left waiting, a look-up still runs and its token is remembered; a
    /// request that comes for it meanwhile joins it instead of starting another.
    #[tokio::test]
    async fn a_look_up_nobody_waits_for_is_kept_and_remembered() {
        let store = Arc::new(TokenStore::new());
        let (release, _) = watch::channel(false);
        let mut gone = Box::pin(store.get_or_fetch("isb-1", gated(&release)));
        assert!(!poll_once(&mut gone).await);
        drop(gone);
        assert_eq!(store.running(), (1, 1), "kept, as an orphan");
        let mut again = Box::pin(store.get_or_fetch("isb-1", std::future::pending));
        assert!(!poll_once(&mut again).await);
        assert_eq!(store.running(), (1, 0), "joined, not started again");
        drop(again);
        assert_eq!(store.running(), (1, 1));
        release.send_replace(true);
        // The look-up's task finishes on its own (this runtime's one thread runs it when
        // the test yields).
        for _ in 0..100 {
            if store.running() == (0, 0) {
                break;
            }
            tokio::task::yield_now().await;
        }
        assert_eq!(store.running(), (0, 0));
        assert_eq!(
            store
                .get("isb-1")
                .map(|t| t.expose().to_string())
                .as_deref(),
            Some("tok")
        );
    }

    /// Clients that name many sandboxes and hang up leave at most [`MAX_ORPHANS`] look-ups
    /// running: each one past that ends with its last request.
    #[tokio::test]
    async fn orphaned_look_ups_are_bounded() {
        let store = Arc::new(TokenStore::new());
        for i in 0..MAX_ORPHANS + 5 {
            let fetch = std::future::pending;
            let id = format!("isb-{i}");
            let mut gone = Box::pin(store.get_or_fetch(&id, fetch));
            assert!(!poll_once(&mut gone).await);
            drop(gone);
        }
        assert_eq!(store.running(), (MAX_ORPHANS, MAX_ORPHANS));
        // The fetches past the bound were ended; the kept ones are what a new request joins.
        let mut again = Box::pin(store.get_or_fetch("isb-0", std::future::pending));
        assert!(!poll_once(&mut again).await);
        assert_eq!(store.running(), (MAX_ORPHANS, MAX_ORPHANS - 1));
    }

    /// A look-up whose fetch panics (no such fetch is known) leaves no entry behind: the
    /// next request for the sandbox looks it up again instead of joining a look-up that
    /// will never answer, and it holds no orphan's place.
    #[tokio::test]
    async fn a_look_up_that_panics_leaves_nothing_behind() {
        let store = Arc::new(TokenStore::new());
        let fetch = || async { panic!("a fetch that panics") };
        assert!(store.get_or_fetch("isb-1", fetch).await.is_none());
        assert_eq!(store.running(), (0, 0));
        let got = store
            .get_or_fetch("isb-1", || async { Ok(Some(Secret::new("tok"))) })
            .await;
        let got = got.unwrap().unwrap().map(|t| t.expose().to_string());
        assert_eq!(got.as_deref(), Some("tok"));
    }

    /// A token learned, or the sandbox deleted, while a look-up runs is newer than what the
    /// look-up brings back: its requests get its answer, the store keeps the newer state.
    #[tokio::test]
    async fn a_look_up_does_not_undo_what_was_learned_meanwhile() {
        for deleted in [false, true] {
            let store = Arc::new(TokenStore::new());
            let (release, _) = watch::channel(false);
            let mut waiting = Box::pin(store.get_or_fetch("isb-1", gated(&release)));
            assert!(!poll_once(&mut waiting).await);
            if deleted {
                store.remove("isb-1");
            } else {
                store.insert("isb-1", Secret::new("fresh"));
            }
            release.send_replace(true);
            let got = waiting
                .await
                .unwrap()
                .unwrap()
                .map(|t| t.expose().to_string());
            assert_eq!(got.as_deref(), Some("tok"), "the look-up's own answer");
            let kept = store.get("isb-1").map(|t| t.expose().to_string());
            let newer = (!deleted).then_some("fresh");
            assert_eq!(kept.as_deref(), newer, "deleted: {deleted}");
        }
    }

    #[test]
    fn a_token_names_its_sandbox() {
        let store = TokenStore::new();
        let owner = |token: &[u8]| (store.sandbox_of(token)).map(|o| (o.id.to_string(), o.deleted));
        let live = |id: &str| Some((id.to_string(), false));
        let deleted = |id: &str| Some((id.to_string(), true));
        store.insert("isb-a", Secret::new("tok-a"));
        store.insert("isb-b", Secret::new("tok-b"));
        store.insert("isb-open", Secret::new(""));
        assert_eq!(owner(b"tok-b"), live("isb-b"));
        assert_eq!(owner(b"tok-"), None);
        assert_eq!(owner(b"tok-bb"), None);
        assert_eq!(owner(b""), None, "an unsecured sandbox's empty token");
        store.remove("isb-b");
        assert_eq!(store.get("isb-b"), None);
        assert_eq!(
            owner(b"tok-b"),
            deleted("isb-b"),
            "a deleted sandbox's, to ask its envd (a kill's health check)"
        );
        store.remove("isb-open");
        assert_eq!(owner(b""), None);
        // Two sandboxes with one token: neither (a deleted one's names it no better).
        store.insert("isb-c", Secret::new("tok-shared"));
        store.insert("isb-d", Secret::new("tok-shared"));
        assert_eq!(owner(b"tok-shared"), None);
        store.remove("isb-c");
        assert_eq!(owner(b"tok-shared"), live("isb-d"));
        store.remove("isb-d");
        assert_eq!(owner(b"tok-shared"), None, "two deleted ones");
        for i in 0..MAX_FORGOTTEN {
            let id = format!("isb-{i}");
            store.insert(&id, Secret::new(format!("tok-{i}")));
            store.remove(&id);
        }
        assert_eq!(owner(b"tok-b"), None, "the oldest deleted ones go");
        let last = MAX_FORGOTTEN - 1;
        let want = format!("isb-{last}");
        assert_eq!(owner(format!("tok-{last}").as_bytes()), deleted(&want));
        let old = Instant::now().checked_sub(MAX_AGE + Duration::from_secs(1));
        if let Some(old) = old {
            store.insert_at("isb-old", Secret::new("tok-old"), old);
            assert_eq!(owner(b"tok-old"), None, "one past its age");
        }
    }

    /// The index by token is kept by each write, not rebuilt: after every kind of write it
    /// says what a rebuild from the tokens by sandbox would.
    #[test]
    fn the_index_by_token_follows_every_write() {
        let store = TokenStore::with_max(3);
        let check = |what: &str| {
            let snapshot = store.tokens.load();
            let mut want: Vec<(String, String)> = (snapshot.by_id.iter())
                .filter(|(_, (t, _))| !t.expose().is_empty())
                .map(|(id, (t, _))| (t.expose().to_string(), id.to_string()))
                .collect();
            let mut got: Vec<(String, String)> = (snapshot.by_token.iter())
                .flat_map(|(t, ids)| {
                    ids.iter()
                        .map(|id| (t.expose().to_string(), id.to_string()))
                })
                .collect();
            want.sort();
            got.sort();
            assert_eq!(got, want, "after {what}");
        };
        let owner = |token: &[u8]| store.sandbox_of(token).map(|o| o.id.to_string());
        store.insert("isb-a", Secret::new("tok-1"));
        store.insert("isb-b", Secret::new("tok-1"));
        check("a shared token");
        store.insert("isb-a", Secret::new("tok-2"));
        check("a token replaced");
        assert_eq!(
            owner(b"tok-1").as_deref(),
            Some("isb-b"),
            "no longer shared"
        );
        assert_eq!(owner(b"tok-2").as_deref(), Some("isb-a"));
        store.insert("isb-c", Secret::new(""));
        store.insert("isb-d", Secret::new("tok-4"));
        check("one over the bound");
        assert_eq!(store.len(), 3);
        assert!(store.get("isb-b").is_none(), "the oldest learned went");
        assert_eq!(owner(b"tok-1"), None);
        store.remove_stale("isb-d", &Secret::new("tok-4"));
        check("a stale token dropped");
        assert_eq!(owner(b"tok-4"), None);
        store.remove("isb-c");
        check("an unsecured sandbox deleted");
        store.insert("isb-b", Secret::new("tok-1"));
        if let Some(old) = Instant::now().checked_sub(MAX_AGE + Duration::from_secs(1)) {
            store.insert_at("isb-old", Secret::new("tok-1"), old);
            check("an old one learned");
            assert_eq!(
                owner(b"tok-1").as_deref(),
                Some("isb-b"),
                "a holder past its age does not make the token shared"
            );
            store.insert("isb-e", Secret::new("tok-5"));
            check("an old one dropped");
            assert!(store.get("isb-old").is_none());
        }
    }

    /// A fork's answer learns many tokens in one write, and the bound holds: the oldest go
    /// first, and of an answer naming more than the bound, its last ones stay.
    #[test]
    fn many_tokens_learned_at_once_keep_the_bound() {
        let store = TokenStore::with_max(3);
        let ids = |store: &TokenStore| {
            let mut ids: Vec<String> = (store.tokens.load().by_id.keys())
                .map(|id| id.to_string())
                .collect();
            ids.sort();
            ids
        };
        let t = |s: &str| Secret::new(s);
        store.insert("isb-a", t("tok-a"));
        store.insert("isb-b", t("tok-b"));
        let before = store.tokens.load_full();
        store.insert_all(&[("isb-a", t("tok-a")), ("isb-b", t("tok-b"))]);
        assert!(
            Arc::ptr_eq(&before, &store.tokens.load_full()),
            "known: no copy"
        );
        store.insert_all(&[("isb-b", t("tok-b")), ("isb-c", t("tok-c"))]);
        assert_eq!(ids(&store), ["isb-a", "isb-b", "isb-c"]);
        store.insert_all(&[("isb-d", t("tok-d")), ("isb-e", t("tok-e"))]);
        assert_eq!(
            ids(&store),
            ["isb-c", "isb-d", "isb-e"],
            "the two oldest went"
        );
        let many: Vec<(String, Secret)> = (0..5)
            .map(|i| (format!("isb-f{i}"), t(&format!("tok-f{i}"))))
            .collect();
        store.insert_all(&many);
        assert_eq!(ids(&store), ["isb-f2", "isb-f3", "isb-f4"]);
        assert_eq!(
            store
                .sandbox_of(b"tok-f4")
                .map(|o| o.id.to_string())
                .as_deref(),
            Some("isb-f4")
        );
        assert_eq!(store.sandbox_of(b"tok-c"), None);
        // An answer naming the oldest stored sandbox anew, and a new one: the stored one
        // stays, with its new token, and the next oldest goes.
        let at = Instant::now();
        let second = |n: u64| at + Duration::from_secs(n);
        let store = TokenStore::with_max(3);
        store.insert_at("isb-f2", t("tok-f2"), second(0));
        store.insert_at("isb-f3", t("tok-f3"), second(1));
        store.insert_at("isb-f4", t("tok-f4"), second(2));
        store.insert_all_at(
            &[("isb-f2", t("tok-f2b")), ("isb-g", t("tok-g"))],
            second(3),
        );
        assert_eq!(ids(&store), ["isb-f2", "isb-f4", "isb-g"]);
        assert_eq!(store.get("isb-f2"), Some(t("tok-f2b")));
        // Named with the token it has (known, nothing to write for it), the oldest stays too.
        store.insert_all_at(&[("isb-f4", t("tok-f4")), ("isb-k", t("tok-k"))], second(4));
        let kept = ids(&store);
        assert_eq!(kept.len(), 3, "{kept:?}");
        assert!(kept.contains(&"isb-f4".to_string()), "{kept:?}");
        assert!(kept.contains(&"isb-k".to_string()), "{kept:?}");
        // A sandbox named twice is one: one goes, and its last token stays.
        let store = TokenStore::with_max(3);
        store.insert_at("isb-a", t("tok-a"), second(0));
        store.insert_at("isb-b", t("tok-b"), second(1));
        store.insert_at("isb-c", t("tok-c"), second(2));
        store.insert_all_at(&[("isb-h", t("tok-h1")), ("isb-h", t("tok-h2"))], second(3));
        assert_eq!(ids(&store), ["isb-b", "isb-c", "isb-h"]);
        assert_eq!(store.get("isb-h"), Some(t("tok-h2")));
        store.insert_all(&[("isb-h", t("tok-h3")), ("isb-h", t("tok-h2"))]);
        assert_eq!(store.get("isb-h"), Some(t("tok-h2")), "the answer's last");
    }

    /// A pair refused twice is kept once: evicting one copy would leave the other out of
    /// the index.
    #[test]
    fn a_pair_refused_twice_is_kept_once() {
        let mut refused = Refused::default();
        refused.add("isb-1", &Secret::new("t"));
        refused.add("isb-1", &Secret::new("t"));
        assert_eq!(refused.order.len(), 1);
        assert_eq!(refused.take(|id| id == "isb-1").len(), 1);
        assert!(refused.by_token.is_empty() && refused.order.is_empty());
    }

    /// Refused tokens are known by sandbox and token, never the empty one, and bounded.
    #[test]
    fn refused_tokens_are_known_by_sandbox_and_bounded() {
        let store = TokenStore::new();
        let t = |s: &str| Secret::new(s);
        store.refused("isb-1", &t("old"));
        store.refused("isb-1", &t(""));
        assert!(store.was_refused("isb-1", &t("old")));
        assert!(!store.was_refused("isb-2", &t("old")), "another sandbox's");
        assert!(!store.was_refused("isb-1", &t("new")));
        assert!(!store.was_refused("isb-1", &t("")), "the empty one");
        for i in 0..MAX_REFUSED {
            store.refused(&format!("isb-x{i}"), &t("x"));
        }
        assert!(!store.was_refused("isb-1", &t("old")), "the oldest went");
        assert!(store.was_refused("isb-x0", &t("x")));
    }

    /// A refused token names its sandbox for token-only requests, and once the sandbox is
    /// deleted through the proxy, names it as deleted.
    #[test]
    fn a_refused_token_names_its_sandbox_until_deleted() {
        let store = TokenStore::new();
        let owner = |token: &[u8]| {
            store
                .sandbox_of(token)
                .map(|o| (o.id.to_string(), o.deleted))
        };
        store.insert("isb-1", Secret::new("old"));
        store.refused("isb-1", &Secret::new("old"));
        store.remove_stale("isb-1", &Secret::new("old"));
        assert_eq!(owner(b"old"), Some(("isb-1".into(), false)));
        store.remove("isb-1");
        assert_eq!(owner(b"old"), Some(("isb-1".into(), true)));
        assert!(
            !store.was_refused("isb-1", &Secret::new("old")),
            "taken out"
        );

        // A refusal that lands after the delete (its request was in flight): still deleted,
        // and the SDK's health check, which names the sandbox, is not looked up.
        store.refused("isb-1", &Secret::new("old"));
        assert_eq!(owner(b"old"), Some(("isb-1".into(), true)));
        assert!(!store.was_refused("isb-1", &Secret::new("old")));

        // A look-up's new token for it: the refused one (an older SDK's, sent alone) still
        // names the sandbox, and the SDK's copy is still known refused.
        store.insert("isb-2", Secret::new("two"));
        store.refused("isb-2", &Secret::new("two"));
        store.remove_stale("isb-2", &Secret::new("two"));
        assert_eq!(owner(b"two"), Some(("isb-2".into(), false)));
        store.insert("isb-2", Secret::new("two-new"));
        assert_eq!(owner(b"two"), Some(("isb-2".into(), false)));
        assert!(store.was_refused("isb-2", &Secret::new("two")));

        // One sandbox's many refusals keep the other deleted sandboxes' tokens.
        store.insert("isb-3", Secret::new("three"));
        store.remove("isb-3");
        for i in 0..MAX_FORGOTTEN {
            store.refused("isb-4", &Secret::new(format!("four-{i}")));
        }
        store.remove("isb-4");
        assert_eq!(owner(b"three"), Some(("isb-3".into(), true)));
        let last = format!("four-{}", MAX_FORGOTTEN - 1);
        assert_eq!(owner(last.as_bytes()), Some(("isb-4".into(), true)));
        assert_eq!(owner(b"four-0"), None, "only the last few");
    }

    #[test]
    fn remove_stale_keeps_a_fresher_token() {
        let store = TokenStore::new();
        store.insert("isb-1", Secret::new("new"));
        store.remove_stale("isb-1", &Secret::new("old"));
        assert_eq!(store.get("isb-1").unwrap().expose(), "new");
        store.remove_stale("isb-1", &Secret::new("new"));
        assert!(store.get("isb-1").is_none());
    }
}
