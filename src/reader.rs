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
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

type Job = Box<dyn FnOnce() + Send>;

/// How long a read may take before a warning says it has not ended: reads are of small
/// local files, done in milliseconds. One that hangs (an NFS or FUSE mount gone away)
/// holds every later reload and the file watch, which said nothing about it.
const SLOW: Duration = Duration::from_secs(10);

/// A read's states, for the lines said of a slow one: running, said slow, ended.
const RUNNING: u8 = 0;
const WARNED: u8 = 1;
const ENDED: u8 = 2;

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

    /// `work`'s result, done on the reading thread; `what` names what it reads, for the
    /// warning should it not end within 10 s (`SLOW`).
    pub async fn run<T: Send + 'static>(
        &self,
        what: &'static str,
        work: impl FnOnce() -> T + Send + 'static,
    ) -> io::Result<T> {
        let Some(jobs) = &self.jobs else {
            // As on the thread: a read that panics fails alone.
            return catch_unwind(AssertUnwindSafe(work))
                .map_err(|_| io::Error::other("the read ended without a result"));
        };
        let (done, mut result) = tokio::sync::oneshot::channel();
        // The end of a read said slow is said by the reading thread: the caller may be
        // gone by then (a SIGHUP drops the watch's poll), and its warning was left open.
        let state = Arc::new(AtomicU8::new(RUNNING));
        let (ending, dispatch) = (
            state.clone(),
            tracing::dispatcher::get_default(Clone::clone),
        );
        let asked = Instant::now();
        let job: Job = Box::new(move || {
            let read = work();
            if ending.swap(ENDED, Ordering::AcqRel) == WARNED {
                tracing::dispatcher::with_default(&dispatch, || {
                    tracing::info!(
                        reading = what,
                        took_s = asked.elapsed().as_secs_f64(),
                        "the slow read has ended"
                    );
                });
            }
            drop(done.send(read));
        });
        jobs.send(job)
            .map_err(|_| io::Error::other("the reading thread has ended"))?;
        let answer = match tokio::time::timeout(SLOW, &mut result).await {
            Ok(answer) => answer,
            Err(_) => {
                let slow =
                    state.compare_exchange(RUNNING, WARNED, Ordering::AcqRel, Ordering::Acquire);
                if slow.is_ok() {
                    tracing::warn!(
                        reading = what,
                        waited_s = SLOW.as_secs(),
                        "a reload's read has not ended (a stalled mount?): this reload, later \
                         ones and the file watch wait for it"
                    );
                }
                result.await
            }
        };
        answer.map_err(|_| io::Error::other("the read ended without a result"))
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
        let first = reader
            .run("a test", || (thread::current().id(), name()))
            .await;
        let (id, named) = first.expect("read");
        assert_ne!(id, thread::current().id(), "off the caller's thread");
        assert_eq!(named.as_deref(), Some("abx-read"));
        for _ in 0..3 {
            let again = reader
                .clone()
                .run("a test", || thread::current().id())
                .await;
            assert_eq!(again.expect("read"), id, "the same thread");
        }
    }

    /// A read that panics fails alone: the thread reads on.
    #[tokio::test]
    async fn a_read_that_panics_fails_alone() {
        let reader = Reader::start();
        let id = reader
            .run("a test", || thread::current().id())
            .await
            .expect("read");
        let failed = reader
            .run("a test", || -> u8 { panic!("a read that panics") })
            .await;
        assert!(failed.is_err());
        let after = reader.run("a test", || thread::current().id()).await;
        assert_eq!(after.expect("read after the panic"), id);
    }

    #[tokio::test]
    async fn an_inline_reader_reads_on_the_callers_thread() {
        let here = thread::current().id();
        let read = Reader::inline()
            .run("a test", || thread::current().id())
            .await;
        assert_eq!(read.expect("read"), here);
        let inline = Reader::inline();
        let failed = inline
            .run("a test", || -> u8 { panic!("a read that panics") })
            .await;
        assert!(failed.is_err());
    }

    /// A read that does not end (a stalled mount) is said once it has taken [`SLOW`], what
    /// it reads named, and its end is said too. (The clock is paused: tokio moves it on
    /// while the runtime waits for the reading thread.)
    #[tokio::test(start_paused = true)]
    async fn a_read_that_does_not_end_is_said() {
        let logs = crate::logging::Captured::default();
        let _logging = tracing::subscriber::set_default(logs.subscriber());
        let reader = Reader::start();
        let (release, held) = mpsc::channel::<()>();
        let read = reader.run("the stalled file", move || held.recv().is_ok());
        tokio::pin!(read);
        tokio::select! {
            _ = &mut read => panic!("the read ended before it was let go"),
            () = tokio::time::sleep(SLOW - Duration::from_millis(1)) => {}
        }
        assert!(!logs.text().contains("WARN"), "{}", logs.text());
        tokio::select! {
            _ = &mut read => panic!("the read ended before it was let go"),
            () = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
        let text = logs.text();
        assert!(
            text.contains("WARN") && text.contains("a reload's read has not ended"),
            "{text}"
        );
        assert!(text.contains("reading=\"the stalled file\""), "{text}");
        release.send(()).expect("the read waits");
        assert!(read.await.expect("read"));
        assert!(
            logs.text().contains("the slow read has ended"),
            "{}",
            logs.text()
        );
    }

    /// A slow read whose caller has gone (a SIGHUP drops the watch's poll) is still said
    /// to end, by the reading thread: the warning was left open.
    #[tokio::test(start_paused = true)]
    async fn a_slow_read_whose_caller_has_gone_is_still_said_to_end() {
        let logs = crate::logging::Captured::default();
        let _logging = tracing::subscriber::set_default(logs.subscriber());
        let reader = Reader::start();
        let (release, held) = mpsc::channel::<()>();
        {
            let read = reader.run("the abandoned file", move || held.recv().is_ok());
            tokio::pin!(read);
            tokio::select! {
                _ = &mut read => panic!("the read ended before it was let go"),
                () = tokio::time::sleep(SLOW + Duration::from_secs(1)) => {}
            }
        }
        assert!(logs.text().contains("has not ended"), "{}", logs.text());
        release.send(()).expect("the read waits");
        // Queued behind it on the one thread: once this is read, that one has ended. (The
        // paused clock may call this one slow too, while the thread finishes the other.)
        reader.run("the next file", || ()).await.expect("read");
        let text = logs.text();
        let ended = (text.lines())
            .filter(|l| l.contains("the slow read has ended"))
            .filter(|l| l.contains("reading=\"the abandoned file\""))
            .count();
        assert_eq!(ended, 1, "{text}");
    }
}
