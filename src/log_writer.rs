//! The one thread that writes the logs to stderr, so that nothing else waits on it.
//!
//! stderr is often a pipe (a container runtime, journald, `| tee`, a log shipper), and a
//! write to a full pipe blocks until its reader catches up. Written by the threads that
//! log, a reader that stalls stopped every worker within a few hundred requests, and the
//! main thread at its next line: the drain, the admin listener, and SIGTERM's grace with
//! them, so only SIGKILL ended the process. Here the threads that log hand whole lines
//! (a worker's batch, one event) to a bounded queue, never waiting, and this thread writes
//! them in order. When the queue is full the lines are dropped and counted
//! (`abx_proxy_log_lines_dropped_total`, and a warning once writing works again), as
//! tracing-appender's lossy writer and envoy's access log do.
//!
//! Before [`start`] (commands that do not serve, tests) lines are written where they are
//! made, as before.
//!
//! Every event's line is written with the secrets given to [`mask`] as `****`: those a
//! setting's plain value carries, which other crates' debug lines print as resolved; and
//! at debug and trace, where other crates print what an upstream sent (h2 an HTTP/2
//! GOAWAY's debug data, which a server may fill with the header it refused), every
//! resolved secret and the last temporary keys issued ([`mask_when_verbose`],
//! [`mask_issued`]). At info and above no line carries those, and lines are not scanned.

use std::cell::Cell;
use std::collections::VecDeque;
use std::io::Write;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, SyncSender, TryRecvError, TrySendError};
use std::sync::{Mutex, OnceLock, PoisonError, RwLock};
use std::time::Duration;

use tracing::level_filters::LevelFilter;

use crate::secret::Secret;
use crate::settings::shown::secrets_masked;

/// Writes the queue may hold: a batch of a worker (up to 4 KiB), one event, or one long
/// line each; half a second of the busiest load measured here.
const QUEUE: usize = 1024;

/// Bytes the queue may hold, whatever the number of writes: an access line's path may be
/// most of a 64 KiB head, percent-encoded to three times that.
const QUEUE_BYTES: usize = 4 << 20;

/// Once awake, the writer writes what has come, then lets more gather this long before it
/// looks again, and sleeps until woken only when nothing came meanwhile. Waking it is a
/// system call on the logging thread's side: woken for every batch, the workers paid that
/// and this thread's every wake-up on their two cores, about a tenth of the request rate
/// under load. Lines reach stderr at most this much later.
const GATHER: Duration = Duration::from_millis(10);

enum Msg {
    Write(Vec<u8>),
    /// Answered once everything queued before it is written.
    Flush(mpsc::Sender<()>),
}

impl Msg {
    fn lines(&self) -> u64 {
        match self {
            Msg::Write(bytes) => memchr::memchr_iter(b'\n', bytes).count().max(1) as u64,
            Msg::Flush(_) => 0,
        }
    }
}

static QUEUED: OnceLock<SyncSender<Msg>> = OnceLock::new();
/// Bytes in the queue (see [`QUEUE_BYTES`]).
static QUEUED_BYTES: AtomicUsize = AtomicUsize::new(0);
/// Lines dropped because the queue was full.
static DROPPED: AtomicU64 = AtomicU64::new(0);

/// See [`mask`]; `MASKING` says whether it holds any, so that lines are not scanned in the
/// usual case of none.
static MASKED: RwLock<Vec<Secret>> = RwLock::new(Vec::new());
static MASKING: AtomicBool = AtomicBool::new(false);
/// The temporary keys among [`MASKED`], oldest first (see [`mask_issued`]).
static ISSUED: Mutex<VecDeque<Secret>> = Mutex::new(VecDeque::new());
/// Temporary keys masked at once: a key is replaced minutes before it expires, and one
/// older than its successor's successor has expired.
const ISSUED_KEPT: usize = 4;

thread_local! {
    /// This is the writer thread: what it logs itself is written at once, not queued
    /// behind the queue that it is there to say was full.
    static WRITER: Cell<bool> = const { Cell::new(false) };
    /// A line this thread wrote itself ([`direct`]) did not go through.
    static UNWRITTEN: Cell<bool> = const { Cell::new(false) };
}

/// From now on lines go through the writer thread. Idempotent. Should the thread not
/// start, lines are written where they are made.
pub fn start() {
    QUEUED.get_or_init(|| {
        let (tx, rx) = mpsc::sync_channel(QUEUE);
        // Should the thread not start, the receiver goes with the closure: every send
        // then fails, and `write` writes the line itself.
        let _ = std::thread::Builder::new()
            .name("abx-log".into())
            .spawn(move || run(&rx));
        tx
    });
}

fn run(rx: &mpsc::Receiver<Msg>) {
    WRITER.with(|w| w.set(true));
    let mut reported = Reported::default();
    let mut handle = |msg| match msg {
        // A failing stderr is not worth stopping for (tracing-subscriber ignores it too):
        // the next line may go through.
        Msg::Write(bytes) => {
            let written = write_whole(&bytes).is_ok();
            QUEUED_BYTES.fetch_sub(bytes.len(), Ordering::Relaxed);
            if written {
                reported = report_drops(std::mem::take(&mut reported));
            } else {
                // Lost all the same (a full disk, a file at its size limit, a reader
                // gone): counted, and said once writing works again.
                DROPPED.fetch_add(Msg::Write(bytes).lines(), Ordering::Relaxed);
            }
        }
        Msg::Flush(done) => drop(done.send(())),
    };
    while let Ok(first) = rx.recv() {
        handle(first);
        loop {
            loop {
                match rx.try_recv() {
                    Ok(msg) => handle(msg),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => return,
                }
            }
            std::thread::sleep(GATHER);
            match rx.try_recv() {
                Ok(msg) => handle(msg),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => return,
            }
        }
    }
}

/// `bytes` to stderr, whole. A stderr whose open file is non-blocking (one shared with a
/// parent that set `O_NONBLOCK` on it) took part of a line and refused the rest with
/// EAGAIN: `write_all` gave up mid-line, uncounted, and the next line was glued to the
/// torn one. This thread waits for room instead, as it waits on a blocking stderr.
fn write_whole(bytes: &[u8]) -> std::io::Result<()> {
    use std::io::ErrorKind::{Interrupted, WouldBlock, WriteZero};
    let mut stderr = std::io::stderr().lock();
    let mut rest = bytes;
    while !rest.is_empty() {
        match stderr.write(rest) {
            Ok(0) => return Err(WriteZero.into()),
            Ok(n) => rest = &rest[n..],
            Err(e) if e.kind() == Interrupted => {}
            Err(e) if e.kind() == WouldBlock => room(&stderr)?,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Waits until `out` takes a write, or has failed (a reader gone: the write says so).
#[cfg(target_os = "linux")]
fn room(out: &impl std::os::fd::AsFd) -> std::io::Result<()> {
    use rustix::event::{poll, PollFd, PollFlags};
    match poll(&mut [PollFd::new(out, PollFlags::OUT)], None) {
        // A signal this thread took (poll(2) is never restarted): look again. Given up,
        // the line was torn all the same.
        Ok(_) | Err(rustix::io::Errno::INTR) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

#[cfg(not(target_os = "linux"))]
fn room(_: &impl std::os::fd::AsFd) -> std::io::Result<()> {
    std::thread::sleep(Duration::from_millis(1));
    Ok(())
}

/// The drops said so far, and when.
#[derive(Default)]
struct Reported {
    dropped: u64,
    at: Option<std::time::Instant>,
}

/// How often at most the drops are said: a reader slow but not stalled lets a write
/// through between drops all the time.
const REPORT_EVERY: Duration = Duration::from_secs(1);

/// Says that lines were dropped, when more have been since the last time, at most every
/// [`REPORT_EVERY`]. Through `tracing`, so in the format of the other lines; written at
/// once, on this thread (see [`WRITER`]): queued, it would find the queue as full as it
/// just was.
fn report_drops(reported: Reported) -> Reported {
    let dropped = DROPPED.load(Ordering::Relaxed);
    let due = reported.at.is_none_or(|at| at.elapsed() >= REPORT_EVERY);
    if dropped == reported.dropped || !due {
        return reported;
    }
    UNWRITTEN.with(|u| u.set(false));
    tracing::warn!(
        dropped = dropped - reported.dropped,
        "log lines dropped: stderr was not read fast enough, or could not be written \
         (abx_proxy_log_lines_dropped_total)"
    );
    if UNWRITTEN.with(Cell::get) {
        // Not said after all (the file at its size limit again): said with the next line
        // that goes through, its count and all.
        return reported;
    }
    Reported {
        dropped,
        at: Some(std::time::Instant::now()),
    }
}

/// Writes `bytes`, whole lines, in one `write` where they can: queued for the writer
/// thread once it runs, else here.
pub fn write(bytes: Vec<u8>) {
    let Some(queue) = QUEUED.get().filter(|_| !WRITER.with(Cell::get)) else {
        return direct(&bytes);
    };
    let len = bytes.len();
    if QUEUED_BYTES.fetch_add(len, Ordering::Relaxed) + len > QUEUE_BYTES {
        QUEUED_BYTES.fetch_sub(len, Ordering::Relaxed);
        DROPPED.fetch_add(Msg::Write(bytes).lines(), Ordering::Relaxed);
        return;
    }
    let refused = match queue.try_send(Msg::Write(bytes)) {
        Ok(()) => return,
        Err(TrySendError::Full(msg)) => {
            DROPPED.fetch_add(msg.lines(), Ordering::Relaxed);
            None
        }
        // The thread never started.
        Err(TrySendError::Disconnected(msg)) => Some(msg),
    };
    QUEUED_BYTES.fetch_sub(len, Ordering::Relaxed);
    if let Some(Msg::Write(bytes)) = refused {
        direct(&bytes);
    }
}

/// Writes where the line is made, through this thread's own descriptor for stderr.
/// Through `std::io::stderr()` every thread took the same lock for every line; lines go
/// out whole, so the lines of different threads never mix.
fn direct(bytes: &[u8]) {
    use std::cell::OnceCell;
    use std::os::fd::AsFd;
    thread_local! {
        static STDERR: OnceCell<Option<std::fs::File>> = const { OnceCell::new() };
    }
    let _ = STDERR.try_with(|cell| {
        let own = cell.get_or_init(|| {
            let fd = std::io::stderr().as_fd().try_clone_to_owned().ok()?;
            Some(std::fs::File::from(fd))
        });
        // `Write` for `&File`: no `&mut` needed, the descriptor is the thread's own.
        let written = match own {
            Some(file) => (&*file).write_all(bytes),
            None => std::io::stderr().lock().write_all(bytes),
        };
        if written.is_err() {
            UNWRITTEN.with(|u| u.set(true));
        }
    });
}

/// Waits until what was queued so far is written, or `wait` has passed: before the
/// process exits, whose lines would otherwise be lost. A reader that stalled costs the
/// exit no more than `wait`.
pub fn flush(wait: Duration) {
    let Some(queue) = QUEUED.get() else { return };
    let deadline = std::time::Instant::now() + wait;
    let (tx, rx) = mpsc::channel();
    // A full queue's `send` has no timeout: tried again instead, until `wait` has passed.
    // (A thread waiting on `send` could not be started at the process's thread limit, and
    // the line saying why the start failed was lost with the exit.)
    let mut flush = Msg::Flush(tx);
    loop {
        match queue.try_send(flush) {
            Ok(()) => break,
            Err(TrySendError::Full(back)) if std::time::Instant::now() < deadline => {
                flush = back;
                std::thread::sleep(FLUSH_RETRY);
            }
            Err(_) => return,
        }
    }
    let _ = rx.recv_timeout(deadline.saturating_duration_since(std::time::Instant::now()));
}

/// How often [`flush`] tries a full queue again.
const FLUSH_RETRY: Duration = Duration::from_millis(2);

/// Lines dropped so far because the queue was full.
pub fn dropped() -> u64 {
    DROPPED.load(Ordering::Relaxed)
}

/// From now on `secrets` are `****` in every event's line, with those given before: a
/// reload that is then refused leaves the old settings in use.
pub fn mask(secrets: Vec<Secret>) {
    if secrets.is_empty() {
        return;
    }
    let mut masked = MASKED.write().unwrap_or_else(PoisonError::into_inner);
    for secret in secrets {
        if !masked.iter().any(|m| m.expose() == secret.expose()) {
            masked.push(secret);
        }
    }
    MASKING.store(true, Ordering::Release);
}

/// Whether the logs let through other crates' debug lines, which print what an upstream
/// sent. Set by `logging::init` before any setting is read.
fn verbose() -> bool {
    LevelFilter::current() >= LevelFilter::DEBUG
}

/// [`mask`], at debug and trace only: the resolved secrets themselves, which no line of
/// the proxy's own carries.
pub fn mask_when_verbose(secrets: Vec<Secret>) {
    if verbose() {
        mask(secrets);
    }
}

/// A temporary key the exchange issued, masked as [`mask_when_verbose`] masks the
/// settings' secrets: the last [`ISSUED_KEPT`] of them, so that months of hourly keys do
/// not grow the list every line is scanned against.
pub fn mask_issued(key: &Secret) {
    if verbose() {
        remember_issued(key.clone());
    }
}

fn remember_issued(key: Secret) {
    let mut issued = ISSUED.lock().unwrap_or_else(PoisonError::into_inner);
    if issued.iter().any(|k| k.expose() == key.expose()) {
        return;
    }
    let mut masked = MASKED.write().unwrap_or_else(PoisonError::into_inner);
    if issued.len() == ISSUED_KEPT {
        if let Some(old) = issued.pop_front() {
            masked.retain(|m| m.expose() != old.expose());
        }
    }
    if !masked.iter().any(|m| m.expose() == key.expose()) {
        masked.push(key.clone());
    }
    issued.push_back(key);
    MASKING.store(true, Ordering::Release);
}

/// [`write()`], with the secrets given to [`mask`] starred, as in every event's line. For
/// the panic hook: a thread that panicked while holding the secrets' lock (or with a
/// writer waiting for it) must not wait on it; the line is dropped (and counted) then,
/// rather than written unmasked.
pub fn write_masked(bytes: Vec<u8>) {
    if !MASKING.load(Ordering::Acquire) {
        return write(bytes);
    }
    let secrets = match MASKED.try_read() {
        Ok(secrets) => secrets,
        Err(std::sync::TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
        Err(std::sync::TryLockError::WouldBlock) => {
            DROPPED.fetch_add(1, Ordering::Relaxed);
            return;
        }
    };
    let line = starred(bytes, &secrets);
    drop(secrets);
    write(line);
}

/// [`write()`] of lines formatted outside tracing (the access lines' fast path), with the
/// secrets given to [`mask`] starred as in every event's line: a client's path holding a
/// key went out as sent at debug, where the same line through tracing was starred.
pub fn write_starred(bytes: Vec<u8>) {
    write(masked(bytes));
}

/// `line` with the secrets given to [`mask`] starred.
fn masked(line: Vec<u8>) -> Vec<u8> {
    if !MASKING.load(Ordering::Acquire) {
        return line;
    }
    starred(line, &MASKED.read().unwrap_or_else(PoisonError::into_inner))
}

/// `line` through [`secrets_masked`]. tracing's lines are UTF-8 (its formatter writes
/// `str`s); should one not be, it has no secret of a setting's in it either.
fn starred(line: Vec<u8>, secrets: &[Secret]) -> Vec<u8> {
    match String::from_utf8(line) {
        Ok(text) => secrets_masked(&text, secrets).into_bytes(),
        Err(e) => e.into_bytes(),
    }
}

/// tracing-subscriber's writer: each event, formatted whole, is one [`write()`].
pub struct Stderr;

/// One event's bytes, written when the subscriber is done with it.
pub struct Event(Vec<u8>);

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Stderr {
    type Writer = Event;

    fn make_writer(&'a self) -> Event {
        Event(Vec::new())
    }
}

impl Write for Event {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        if !self.0.is_empty() {
            write(masked(std::mem::take(&mut self.0)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every occurrence, the longer secret whole where one contains the other; masking only
    /// grows, so a secret given earlier stays masked.
    #[test]
    fn masked_secrets_are_starred_in_every_line() {
        mask(vec![Secret::new("sk-mask-test-1")]);
        mask(vec![
            Secret::new("sk-mask-test-1-longer"),
            Secret::new("short"),
        ]);
        let line = b"DnsName(\"sk-mask-test-1-longer.example\") sk-mask-test-1 sk-mask-test-1\n";
        assert_eq!(
            String::from_utf8(masked(line.to_vec())).unwrap(),
            "DnsName(\"****.example\") **** ****\n"
        );
        assert_eq!(masked(b"nothing here\n".to_vec()), b"nothing here\n");
    }

    /// The last few temporary keys are masked, the older ones let go.
    #[test]
    fn the_last_issued_keys_are_starred() {
        let key = |n: usize| Secret::new(format!("tmp-issued-key-{n}"));
        for n in 0..ISSUED_KEPT + 2 {
            remember_issued(key(n));
            remember_issued(key(n));
        }
        let line = |n: usize| format!("k={}\n", key(n).expose());
        let starred = |n: usize| String::from_utf8(masked(line(n).into_bytes())).unwrap();
        for n in 0..2 {
            assert_eq!(starred(n), line(n), "key {n} let go");
        }
        for n in 2..ISSUED_KEPT + 2 {
            assert_eq!(starred(n), "k=****\n", "key {n}");
        }
        assert_eq!(ISSUED.lock().unwrap().len(), ISSUED_KEPT);
    }
}
