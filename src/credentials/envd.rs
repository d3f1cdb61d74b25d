//! The envd token store: each sandbox's `envdAccessToken`, learned from control-plane
//! responses, forgotten on delete, looked up from the control plane on a miss — one look-up
//! per sandbox however many requests wait for it.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};

use arc_swap::ArcSwap;
use tokio::sync::watch;

use crate::error::Error;
use crate::secret::Secret;

type Lookup = watch::Receiver<Option<Result<Option<Secret>, Error>>>;

#[derive(Default)]
pub struct TokenStore {
    // Copy-on-write: reads are a pointer load; writes (one per sandbox created) copy.
    tokens: ArcSwap<HashMap<Arc<str>, Secret>>,
    inflight: Mutex<HashMap<String, Lookup>>,
}

impl TokenStore {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn get(&self, sandbox_id: &str) -> Option<Secret> {
        self.tokens.load().get(sandbox_id).cloned()
    }

    pub fn insert(&self, sandbox_id: &str, token: Secret) {
        self.tokens.rcu(|map| {
            let mut next = HashMap::clone(map);
            next.insert(Arc::from(sandbox_id), token.clone());
            next
        });
    }

    pub fn remove(&self, sandbox_id: &str) {
        if self.tokens.load().contains_key(sandbox_id) {
            self.tokens.rcu(|map| {
                let mut next = HashMap::clone(map);
                next.remove(sandbox_id);
                next
            });
        }
    }

    /// Forgets `sandbox_id`'s token only while it is still `stale` (the one envd refused):
    /// a fresher token, fetched after the same 401 by a concurrent request, is kept.
    pub fn remove_stale(&self, sandbox_id: &str, stale: &Secret) {
        if self.tokens.load().get(sandbox_id) == Some(stale) {
            self.tokens.rcu(|map| {
                let mut next = HashMap::clone(map);
                if next.get(sandbox_id) == Some(stale) {
                    next.remove(sandbox_id);
                }
                next
            });
        }
    }

    pub fn len(&self) -> usize {
        self.tokens.load().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The token for `sandbox_id`, running `fetch` on a miss. Concurrent callers for the same
    /// sandbox share one `fetch`. `Ok(None)`: the sandbox does not exist.
    pub async fn get_or_fetch<F, Fut>(
        &self,
        sandbox_id: &str,
        fetch: F,
    ) -> Result<Option<Secret>, Error>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<Option<Secret>, Error>>,
    {
        if let Some(t) = self.get(sandbox_id) {
            return Ok(Some(t));
        }
        let (leader, mut rx) = {
            let mut inflight = self.inflight.lock().unwrap_or_else(|p| p.into_inner());
            match inflight.get(sandbox_id) {
                Some(rx) => (None, rx.clone()),
                None => {
                    let (tx, rx) = watch::channel(None);
                    inflight.insert(sandbox_id.to_string(), rx.clone());
                    (Some(tx), rx)
                }
            }
        };
        match leader {
            Some(tx) => {
                // Removes the in-flight entry even if this future is dropped mid-fetch, so a
                // cancelled leader cannot wedge later callers.
                let _guard = InflightGuard {
                    store: self,
                    id: sandbox_id,
                };
                // A token learned while we queued makes the fetch unnecessary.
                let result = match self.get(sandbox_id) {
                    Some(t) => Ok(Some(t)),
                    None => fetch().await,
                };
                if let Ok(Some(t)) = &result {
                    self.insert(sandbox_id, t.clone());
                }
                let _ = tx.send(Some(result.clone()));
                result
            }
            None => loop {
                if let Some(result) = rx.borrow_and_update().clone() {
                    return result;
                }
                if rx.changed().await.is_err() {
                    // The leader was cancelled before finishing; whatever it learned is stored.
                    return Ok(self.get(sandbox_id));
                }
            },
        }
    }
}

struct InflightGuard<'a> {
    store: &'a TokenStore,
    id: &'a str,
}

impl Drop for InflightGuard<'_> {
    fn drop(&mut self) {
        let mut inflight = self
            .store
            .inflight
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        inflight.remove(self.id);
    }
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
            assert_eq!(t.await.unwrap().unwrap().unwrap().expose(), "tok");
        }
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        store.remove("isb-1");
        assert!(store.get("isb-1").is_none());
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
