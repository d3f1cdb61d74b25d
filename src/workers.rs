//! Worker threads: one single-threaded tokio runtime per core, each accepting from its own
//! descriptor of the one listening socket and serving its connections start to finish —
//! nginx's worker model. A connection, its request, its upstream exchange and the pooled
//! upstream connection it uses all live on one thread: no work stealing, no cross-thread
//! wake-ups on the request path. (tokio's multi-thread scheduler spent more on moving
//! work between two threads than the second thread added.)
//!
//! The main thread keeps its own runtime for what is not per-connection: signals, the
//! admin listener, the credential refresher, reloads, and the drain.

use std::cell::Cell;
use std::sync::Arc;
use std::thread;

use tokio::sync::{mpsc, watch, Semaphore};

use crate::error::Error;
use crate::proxy::listener::{self, Listener, ServeConfig};
use crate::proxy::Proxy;

thread_local! {
    static INDEX: Cell<usize> = const { Cell::new(0) };
}

/// This thread's worker number, 1-based; 0 on any other thread. Per-thread state (the
/// upstream connection pools) is sharded by it.
pub fn index() -> usize {
    INDEX.with(Cell::get)
}

/// How many workers: `TOKIO_WORKER_THREADS` when set (tokio's own knob), else the CPUs this
/// process may use (cgroup quotas included).
pub fn count() -> usize {
    std::env::var("TOKIO_WORKER_THREADS")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|n| *n > 0)
        .unwrap_or_else(|| thread::available_parallelism().map_or(1, |n| n.get()))
}

/// The running workers; [`Workers::closed`] resolves once every one has stopped accepting.
pub struct Workers {
    closed: mpsc::Receiver<()>,
    count: usize,
}

/// Starts `n` workers accepting from `listener` until `stop` turns true.
pub fn start(
    n: usize,
    listener: &Listener,
    proxy: &Arc<Proxy>,
    config: ServeConfig,
    stop: &watch::Receiver<bool>,
) -> Result<Workers, Error> {
    let config = Arc::new(config);
    // One limit for the process, not one per worker.
    let limit = Arc::new(Semaphore::new(config.max_connections.max(1)));
    let (closed_tx, closed) = mpsc::channel(n);
    for i in 1..=n {
        let fail = |reason: String| Error::Bind {
            addr: listener.local_addr(),
            reason,
        };
        let shared = listener.share().map_err(|e| fail(e.to_string()))?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| fail(format!("cannot start a worker runtime: {e}")))?;
        let (proxy, config, limit, stop) =
            (proxy.clone(), config.clone(), limit.clone(), stop.clone());
        let closed_tx = closed_tx.clone();
        thread::Builder::new()
            .name(format!("abx-worker-{i}"))
            .spawn(move || {
                INDEX.with(|c| c.set(i));
                runtime.block_on(async move {
                    match shared.into_tokio() {
                        Ok(l) => listener::accept_loop(l, proxy, config, limit, stop).await,
                        Err(e) => tracing::error!(error = %e, "worker cannot listen"),
                    }
                    let _ = closed_tx.send(()).await;
                    // The connections still open finish here; the main thread decides
                    // when the process ends (drain done, or the grace period over).
                    std::future::pending::<()>().await
                })
            })
            .map_err(|e| fail(format!("cannot start a worker thread: {e}")))?;
    }
    Ok(Workers { closed, count: n })
}

impl Workers {
    /// Waits until every worker has dropped its listener.
    pub async fn closed(mut self) {
        for _ in 0..self.count {
            if self.closed.recv().await.is_none() {
                return;
            }
        }
    }
}
