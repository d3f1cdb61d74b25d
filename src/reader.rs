//! The one thread that reads files for reloads ([`crate::reload`]): the watched files'
//! polls, the settings a SIGHUP re-reads, the listener's pair. Off the runtime's threads,
//! which also accept connections and answer the probes: a slow mount or a huge file
//! written over a certificate would hold them up.
//!
//! Started with the proxy and kept, as the log writer's thread is: a thread asked for at
//! each read (tokio's blocking pool, which lets an idle one go) cannot be had once the
//! process is at its thread limit (`TasksMax`, a pids cgroup). Each such read failed, the
//! pool's panic printed a plain-text block into `--log-format json` lines, and the watch
//! saw no rotation until the limit lifted.

use std::io;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc;

type Job = Box<dyn FnOnce() + Send>;

/// Where reads are done: the reading thread, or (should it not start) the caller's.
#[derive(Clone)]
pub struct Reader {
    jobs: Option<mpsc::Sender<Job>>,
}

impl Reader {
    /// Starts the reading thread. Should it not start, reads are done where they are asked
    /// for, as the log writer writes its lines (said once, here).
    pub fn start() -> Reader {
        let (tx, rx) = mpsc::channel::<Job>();
        let started = std::thread::Builder::new()
            .name("abx-read".into())
            .spawn(move || {
                for job in rx {
                    // A read that panics fails its own reload (its answer is dropped), not
                    // every later one.
                    let _ = catch_unwind(AssertUnwindSafe(job));
                }
            });
        match started {
            Ok(_) => Reader { jobs: Some(tx) },
            Err(e) => {
                tracing::warn!(
                    error = %e,
                    "no thread could be started for reloads' reads: they run on the proxy's own"
                );
                Reader::inline()
            }
        }
    }

    /// Reads done on the caller's thread: for tests whose clock is paused (tokio moves a
    /// paused clock on while the runtime waits for another thread), and the fallback.
    pub fn inline() -> Reader {
        Reader { jobs: None }
    }

    /// `work`'s result, done on the reading thread.
    pub async fn run<T: Send + 'static>(
        &self,
        work: impl FnOnce() -> T + Send + 'static,
    ) -> io::Result<T> {
        let Some(jobs) = &self.jobs else {
            // As on the thread: a read that panics fails alone.
            return catch_unwind(AssertUnwindSafe(work))
                .map_err(|_| io::Error::other("the read ended without a result"));
        };
        let (done, result) = tokio::sync::oneshot::channel();
        let job: Job = Box::new(move || drop(done.send(work())));
        jobs.send(job)
            .map_err(|_| io::Error::other("the reading thread has ended"))?;
        result
            .await
            .map_err(|_| io::Error::other("the read ended without a result"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::thread;

    fn name() -> Option<String> {
        thread::current().name().map(str::to_string)
    }

    /// Every read on the one thread started with the reader: none is asked of the system
    /// later, when the process may be at its thread limit.
    #[tokio::test]
    async fn every_read_runs_on_the_one_reading_thread() {
        let reader = Reader::start();
        let first = reader.run(|| (thread::current().id(), name())).await;
        let (id, named) = first.expect("read");
        assert_ne!(id, thread::current().id(), "off the caller's thread");
        assert_eq!(named.as_deref(), Some("abx-read"));
        for _ in 0..3 {
            let again = reader.clone().run(|| thread::current().id()).await;
            assert_eq!(again.expect("read"), id, "the same thread");
        }
    }

    /// A read that panics fails alone: the thread reads on.
    #[tokio::test]
    async fn a_read_that_panics_fails_alone() {
        let reader = Reader::start();
        let id = reader.run(|| thread::current().id()).await.expect("read");
        let failed = reader.run(|| -> u8 { panic!("a read that panics") }).await;
        assert!(failed.is_err());
        let after = reader.run(|| thread::current().id()).await;
        assert_eq!(after.expect("read after the panic"), id);
    }

    #[tokio::test]
    async fn an_inline_reader_reads_on_the_callers_thread() {
        let here = thread::current().id();
        let read = Reader::inline().run(|| thread::current().id()).await;
        assert_eq!(read.expect("read"), here);
        let inline = Reader::inline();
        let failed = inline.run(|| -> u8 { panic!("a read that panics") }).await;
        assert!(failed.is_err());
    }
}
