//! Worker threads: one single-threaded tokio runtime per core, each serving the connections
//! handed to it from start to finish — nginx's worker model. A connection, its requests,
//! their upstream exchanges and the pooled upstream connections they use all live on one
//! thread: no work stealing, no cross-thread wake-ups on the request path. (tokio's
//! multi-thread scheduler gave two threads the throughput of one here.)
//!
//! The accept loop runs on the main thread's runtime, with signals, the admin listener,
//! the credential refresher and the drain, and deals connections to the workers in turn,
//! so each gets the same share however the kernel would have woken them.

use std::cell::Cell;
use std::future::Future;
use std::thread;

use tokio::runtime::{Builder, Handle, Runtime};

use crate::error::Error;

thread_local! {
    static INDEX: Cell<usize> = const { Cell::new(0) };
}

/// This thread's worker number, 1-based; 0 on any other thread. Per-thread state (the
/// upstream connection pools) is sharded by it.
pub fn index() -> usize {
    INDEX.with(Cell::get)
}

/// Workers at most, whatever `TOKIO_WORKER_THREADS` says: each is a thread with its own
/// runtime, and a huge number overflowed the allocation for their handles.
const MAX_WORKERS: usize = 1024;

/// How many workers: `TOKIO_WORKER_THREADS` when set (tokio's own knob), else the CPUs this
/// process may use (cgroup quotas included); at most [`MAX_WORKERS`].
pub fn count() -> usize {
    count_from(std::env::var("TOKIO_WORKER_THREADS").ok().as_deref())
}

fn count_from(setting: Option<&str>) -> usize {
    setting
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|n| *n > 0)
        .unwrap_or_else(|| thread::available_parallelism().map_or(1, |n| n.get()))
        .min(MAX_WORKERS)
}

/// The running workers. They run until the process ends: the main thread decides when
/// (the drain is over, or its grace period).
pub struct Workers {
    handles: Vec<Handle>,
}

impl Workers {
    /// `listen` names the listener the workers serve, for the error if one cannot start
    /// (reported like the main runtime's).
    pub fn start(n: usize, listen: &str) -> Result<Self, Error> {
        let fail = |reason: String| Error::Bind {
            addr: listen.to_string(),
            reason,
        };
        let mut handles = Vec::with_capacity(n);
        for i in 1..=n.max(1) {
            let runtime = Builder::new_current_thread()
                .enable_all()
                .on_thread_park(crate::logging::flush_thread)
                .build()
                .map_err(|e| fail(format!("cannot start a worker runtime: {e}")))?;
            handles.push(runtime.handle().clone());
            let runtime = Unstarted(Some(runtime));
            thread::Builder::new()
                .name(format!("abx-worker-{i}"))
                .spawn(move || {
                    INDEX.with(|c| c.set(i));
                    crate::logging::batch_this_thread();
                    if let Some(runtime) = &runtime.0 {
                        runtime.block_on(std::future::pending::<()>());
                    }
                })
                .map_err(|e| {
                    fail(format!(
                        "cannot start a worker thread: {}",
                        thread_error(&e)
                    ))
                })?;
        }
        Ok(Workers { handles })
    }

    /// Runs `task` on worker `n` (modulo their number).
    pub fn spawn<F>(&self, n: usize, task: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        drop(self.handles[n % self.handles.len()].spawn(task));
    }
}

/// Why a thread did not start, in the words an operator acts on: `EAGAIN` from `clone` is
/// the thread limit, which nothing else in the message names.
pub fn thread_error(e: &std::io::Error) -> String {
    if e.kind() == std::io::ErrorKind::WouldBlock {
        format!(
            "the process is at its thread limit (systemd TasksMax=, a pids cgroup, ulimit -u): {e}"
        )
    } else {
        e.to_string()
    }
}

/// A worker's runtime on its way to its thread. Should the thread not start (the process
/// at its thread limit: `TasksMax`, a pids cgroup), the runtime is dropped where it was
/// built, inside the main runtime, where a plain drop panics ("Cannot drop a runtime in a
/// context where blocking is not allowed") instead of the start failing with its error.
struct Unstarted(Option<Runtime>);

impl Drop for Unstarted {
    fn drop(&mut self) {
        if let Some(runtime) = self.0.take() {
            runtime.shutdown_background();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a worker thread that could not start leaves behind is dropped inside the main
    /// runtime without a panic.
    #[tokio::test]
    async fn a_worker_runtime_without_its_thread_drops_quietly() {
        let runtime = Builder::new_current_thread().enable_all().build();
        drop(Unstarted(Some(runtime.expect("runtime"))));
    }

    #[test]
    fn worker_count_is_bounded() {
        assert_eq!(count_from(Some("3")), 3);
        assert_eq!(count_from(Some(" 2 ")), 2);
        assert_eq!(count_from(Some("18446744073709551615")), MAX_WORKERS);
        let cpus = count_from(None);
        assert!((1..=MAX_WORKERS).contains(&cpus));
        assert_eq!(count_from(Some("0")), cpus);
        assert_eq!(count_from(Some("many")), cpus);
    }
}
