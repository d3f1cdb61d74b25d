//! The admin listener: `/metrics` (Prometheus text), `/healthz` (the process runs) and
//! `/readyz` (a credential can be attached, and we are not draining). It stays up while the
//! proxy drains, answering 503 on `/readyz` until exit.

use std::convert::Infallible;
use std::io;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::sync::Notify;
use tokio::task::AbortHandle;
use tokio::time::Instant;

use crate::proxy::body;
use crate::proxy::listener::{AcceptFailures, Io, Listener};
use crate::proxy::Proxy;
use crate::upstream::ProxyBody;

/// Connections served at once. Scrapers and probes need a few; the deployments bind the
/// admin listener beyond loopback, where anyone on the network could otherwise hold
/// connections (and memory, and descriptors the proxy needs) without end.
const MAX_CONNECTIONS: usize = 64;

/// A connection lives for `--header-timeout` (its head) and this (its answer) at most: a
/// client that reads the answer slowly, or not at all, holds its slot no longer (nginx's
/// `send_timeout`, for the same reason). The largest answer, `/metrics`, is tens of KiB.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a connection keeps its slot, from its accept or its head, before a new one may
/// close it. Without it a burst of 65 probes and scrapes closed one of its own at once (a
/// slot would have come back within milliseconds), and a probe that sent its head a few
/// milliseconds late was closed by the next client in.
///
/// Short, since it paces the accepts while every slot is that young: at most 64 a grace
/// (timers fire on whole milliseconds: about 3 000 a second), so a probe behind a full
/// accept queue (1024) of clients that send nothing waits about 17 of them, 350 ms as
/// measured, within the kubelet's 1 s. At 250 ms, a few hundred such connections from
/// anywhere on the pod network timed every probe out. The other side of it: under such a
/// load, a client whose head comes more than 20 ms after its accept may be closed (the
/// kubelet and Prometheus send theirs with the connect).
const GRACE: Duration = Duration::from_millis(20);

/// The most a request head may buffer (hyper's least; its default is ~400 KiB). A probe's
/// or a scrape's head is under 1 KiB; 64 connections each holding a large unfinished head
/// raised the resident memory by 25 MiB, for good, in a sidecar with a 128 MiB limit.
const MAX_HEAD_BUFFER: usize = 8 * 1024;

/// Serves until the process exits, on TCP or a unix socket (`curl --unix-socket`).
///
/// One request per connection, as the kubelet's probes ask anyway (they turn keep-alive
/// off). Prometheus would keep its connection between scrapes; it dials once per scrape
/// interval instead, a connection every 15 s or more. A kept-alive connection holds its
/// slot between requests: 64 clients sending a request now and then held every slot for
/// good.
///
/// When all slots are taken, a new connection closes the one that has waited longest for
/// its request head (nginx reuses its connections likewise), or, when every one has its
/// request, the one that has been answering longest, of those that have had their grace
/// (20 ms): the probe that just came in is served, not left in the kernel's accept queue
/// for longer than that.
pub async fn serve(listener: Listener, proxy: Arc<Proxy>, header_timeout: Duration) {
    let table = Arc::new(Table::new());
    let mut builder = hyper::server::conn::http1::Builder::new();
    // Without a timer hyper turns its header timeout off.
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(header_timeout)
        .max_buf_size(MAX_HEAD_BUFFER)
        .keep_alive(false);
    let builder = Arc::new(builder);
    let lifetime = header_timeout + ANSWER_TIMEOUT;
    let mut failing = AcceptFailures::new("admin");
    loop {
        let stream = match accept(&listener).await {
            Ok(s) => {
                failing.recovered();
                s
            }
            Err(e) => {
                // Backing off: this thread also runs the signals and the drain.
                failing.failed(&e).await;
                continue;
            }
        };
        let slot = table.claim().await;
        let index = slot.index;
        let proxy = proxy.clone();
        let builder = builder.clone();
        let task = tokio::spawn(async move {
            let slot = &slot;
            let service = service_fn(move |req| {
                slot.answering();
                let mut resp = answer(&req, &proxy);
                // A server that keeps no connection must say so (RFC 9112 §9.6); hyper
                // only closes it.
                resp.headers_mut()
                    .insert(header::CONNECTION, HeaderValue::from_static("close"));
                std::future::ready(Ok::<_, Infallible>(resp))
            });
            let connection = builder.serve_connection(TokioIo::new(stream), service);
            let _ = tokio::time::timeout(lifetime, connection).await;
        });
        table.attach(index, task.abort_handle());
    }
}

async fn accept(listener: &Listener) -> io::Result<Box<dyn Io>> {
    Ok(match listener {
        Listener::Tcp(l) => Box::new(l.accept().await?.0),
        Listener::Unix(l, _) => Box::new(l.accept().await?.0),
    })
}

/// The open connections, one entry per slot: what it takes to choose one to close.
struct Table {
    slots: Mutex<[Option<Entry>; MAX_CONNECTIONS]>,
    /// Woken when a slot is given back.
    freed: Notify,
}

struct Entry {
    /// When the connection was accepted, or its request head arrived.
    since: Instant,
    /// Its head has arrived: the answer is being made or written.
    answering: bool,
    /// Its task, to end it (none once told to, or before it runs).
    task: Option<AbortHandle>,
}

/// A connection's slot, given back when the connection's task ends or is aborted.
struct Slot {
    table: Arc<Table>,
    index: usize,
}

impl Table {
    fn new() -> Self {
        Table {
            slots: Mutex::new(std::array::from_fn(|_| None)),
            freed: Notify::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, [Option<Entry>; MAX_CONNECTIONS]> {
        self.slots
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// A free slot, once there is one: while all are taken, one connection is told to
    /// close (see [`Table::evict`]).
    async fn claim(self: &Arc<Self>) -> Slot {
        let mut yielded = false;
        loop {
            // Registered before the look: a slot given back in between still wakes it.
            let freed = self.freed.notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            if let Some(index) = self.take_free() {
                return Slot {
                    table: self.clone(),
                    index,
                };
            }
            // Once, before choosing: connections whose heads have come in read them (tokio
            // polls the sockets before a yielded task runs again), and are then answering,
            // not waiting the longest.
            if !yielded {
                yielded = true;
                tokio::task::yield_now().await;
                continue;
            }
            match self.evict() {
                Some(look_again) => {
                    tokio::select! {
                        _ = &mut freed => {}
                        _ = tokio::time::sleep_until(look_again) => {}
                    }
                }
                None => freed.await,
            }
        }
    }

    fn take_free(&self) -> Option<usize> {
        let mut slots = self.lock();
        let index = slots.iter().position(Option::is_none)?;
        slots[index] = Some(Entry {
            since: Instant::now(),
            answering: false,
            task: None,
        });
        Some(index)
    }

    fn attach(&self, index: usize, task: AbortHandle) {
        if let Some(entry) = self.lock()[index].as_mut() {
            entry.task = Some(task);
        }
    }

    /// Of the connections past their [`GRACE`], ends the one still waiting for its head
    /// the longest, else the one answering the longest. When none is past it yet, says
    /// when the first will be. One already told to end is not told again: its slot is on
    /// its way.
    fn evict(&self) -> Option<Instant> {
        let now = Instant::now();
        let mut slots = self.lock();
        let (past, within): (Vec<_>, Vec<_>) = slots
            .iter_mut()
            .flatten()
            .filter(|e| e.task.is_some())
            .partition(|e| e.since + GRACE <= now);
        let victim = past
            .into_iter()
            .min_by_key(|e| (e.answering, e.since))
            .and_then(|e| e.task.take());
        let Some(task) = victim else {
            return within.iter().map(|e| e.since + GRACE).min();
        };
        drop(slots);
        tracing::debug!(
            connections = MAX_CONNECTIONS,
            "admin listener full: closing the connection waiting or answering longest for a new one"
        );
        task.abort();
        None
    }
}

impl Slot {
    fn answering(&self) {
        if let Some(entry) = self.table.lock()[self.index].as_mut() {
            entry.answering = true;
            entry.since = Instant::now();
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.table.lock()[self.index] = None;
        self.table.freed.notify_waiters();
    }
}

fn answer(req: &Request<Incoming>, proxy: &Proxy) -> Response<ProxyBody> {
    let text = |status: StatusCode, body: &'static str| {
        let mut r = Response::new(body::full(body));
        *r.status_mut() = status;
        r.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; charset=utf-8"),
        );
        r
    };
    if req.method() != Method::GET && req.method() != Method::HEAD {
        let mut r = text(StatusCode::METHOD_NOT_ALLOWED, "GET only\n");
        // A 405 must name the methods that would do (RFC 9110 §15.5.6).
        r.headers_mut()
            .insert(header::ALLOW, HeaderValue::from_static("GET, HEAD"));
        return r;
    }
    match req.uri().path() {
        "/metrics" => {
            // Read at scrape time: set after each change, two concurrent changes could
            // leave the count of the one that read the store first.
            proxy
                .metrics
                .envd_tokens
                .set(proxy.tokens.with_token() as i64);
            (proxy.metrics.upstream_connections).set(proxy.slots.in_use() as i64);
            let dropped = &proxy.metrics.log_lines_dropped;
            dropped.inc_by(crate::log_writer::dropped().saturating_sub(dropped.get()));
            let mut r = Response::new(body::full(proxy.metrics.render()));
            r.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
            );
            r
        }
        "/healthz" => text(StatusCode::OK, "ok\n"),
        "/readyz" if proxy.ready() => text(StatusCode::OK, "ready\n"),
        // Which of the two: a drain is expected, a missing credential is not.
        "/readyz" if proxy.draining() => text(StatusCode::SERVICE_UNAVAILABLE, "draining\n"),
        "/readyz" => text(StatusCode::SERVICE_UNAVAILABLE, "not ready\n"),
        _ => text(StatusCode::NOT_FOUND, "not found\n"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::task::JoinHandle;

    /// Between two connections [`fill`] makes: all 64 within one grace.
    const STEP: Duration = Duration::from_micros(100);

    /// Takes every slot of `table` for connections that never end on their own, a
    /// [`STEP`] apart, the `i`th one answering when `answering(i)`.
    async fn fill(table: &Arc<Table>, answering: impl Fn(usize) -> bool) -> Vec<JoinHandle<()>> {
        let mut tasks = Vec::new();
        for i in 0..MAX_CONNECTIONS {
            tokio::time::advance(STEP).await;
            let slot = table.claim().await;
            if answering(i) {
                slot.answering();
            }
            let index = slot.index;
            let task = tokio::spawn(async move {
                let _held = slot;
                std::future::pending::<()>().await
            });
            table.attach(index, task.abort_handle());
            tasks.push(task);
        }
        tasks
    }

    /// A new connection on the full `table` gets the slot of the connection at `index`,
    /// which is closed, and of no other.
    async fn one_more_closes(table: &Arc<Table>, mut tasks: Vec<JoinHandle<()>>, index: usize) {
        let slot = tokio::time::timeout(Duration::from_secs(10), table.claim())
            .await
            .expect("a slot for a new connection");
        assert_eq!(slot.index, index);
        let closed = tasks.swap_remove(index).await;
        assert!(
            closed.as_ref().is_err_and(|e| e.is_cancelled()),
            "{closed:?}"
        );
        assert!(
            tasks.iter().all(|t| !t.is_finished()),
            "one closed, no more"
        );
    }

    // The clock is tokio's, paused: it moves on only when every task waits.

    #[tokio::test(start_paused = true)]
    async fn a_new_connection_beyond_the_limit_closes_the_one_waiting_longest_for_its_head() {
        let table = Arc::new(Table::new());
        // The first (oldest) is answering: it is not the one to go.
        let tasks = fill(&table, |i| i % 2 == 0).await;
        tokio::time::advance(GRACE).await;
        one_more_closes(&table, tasks, 1).await;
    }

    #[tokio::test(start_paused = true)]
    async fn a_connection_being_answered_is_closed_only_when_every_one_is() {
        let table = Arc::new(Table::new());
        let tasks = fill(&table, |_| true).await;
        tokio::time::advance(GRACE).await;
        one_more_closes(&table, tasks, 0).await;
    }

    /// A connection within its grace is not closed: the new one waits until the oldest
    /// has had it (a burst of probes closed one of its own).
    #[tokio::test(start_paused = true)]
    async fn a_connection_is_closed_for_a_new_one_only_once_past_its_grace() {
        let table = Arc::new(Table::new());
        let tasks = fill(&table, |_| false).await;
        // The first was accepted 63 steps before the last.
        let oldest_past_grace = Instant::now() + GRACE - STEP * 63;
        one_more_closes(&table, tasks, 0).await;
        // Timers fire on whole milliseconds of the clock: up to two late.
        let late = Instant::now().checked_duration_since(oldest_past_grace);
        assert!(
            late.is_some_and(|l| l < Duration::from_millis(2)),
            "{late:?}"
        );
    }

    /// A slot given back within the grace goes to the new connection, and no connection
    /// is closed for it.
    #[tokio::test(start_paused = true)]
    async fn a_slot_given_back_within_the_grace_is_taken_and_none_closed() {
        let table = Arc::new(Table::new());
        let mut tasks = fill(&table, |_| false).await;
        let claim = tokio::spawn({
            let table = table.clone();
            async move { (table.claim().await.index, Instant::now()) }
        });
        tokio::time::advance(GRACE / 2).await;
        // Connection 5 ends on its own.
        tasks.swap_remove(5).abort();
        let ended = Instant::now();
        assert_eq!(claim.await.expect("claim"), (5, ended), "taken at once");
        assert!(tasks.iter().all(|t| !t.is_finished()), "none closed");
    }

    /// A head that has come in is read before a connection is chosen: the one it came on
    /// is answering then, not the longest waiting (a probe that had sent its request was
    /// closed as silent when its task had not run yet).
    #[tokio::test(start_paused = true)]
    async fn a_head_that_came_in_is_read_before_a_connection_is_chosen() {
        let table = Arc::new(Table::new());
        let (mut heads, mut tasks) = (Vec::new(), Vec::new());
        for _ in 0..MAX_CONNECTIONS {
            tokio::time::advance(STEP).await;
            let slot = table.claim().await;
            let index = slot.index;
            let (head, arrives) = tokio::sync::oneshot::channel::<()>();
            let task = tokio::spawn(async move {
                if arrives.await.is_ok() {
                    slot.answering();
                }
                std::future::pending::<()>().await;
                drop(slot)
            });
            table.attach(index, task.abort_handle());
            heads.push(head);
            tasks.push(task);
        }
        tokio::time::advance(GRACE).await;
        // The oldest's head comes in; its task has not run since.
        let _ = heads.swap_remove(0).send(());
        one_more_closes(&table, tasks, 1).await;
    }
}
