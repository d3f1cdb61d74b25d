//! Host names to addresses for the upstream connectors ([`LocalResolver`]).
//!
//! `localhost` and every `*.localhost` name are loopback without asking DNS (RFC 6761
//! §6.3; many system resolvers do not answer `foo.localhost`), so `sandbox_domain =
//! localhost:PORT` reaches a local envd as `https://{port}-{id}.localhost:PORT`. Every other
//! name goes to getaddrinfo on a thread of its own (hyper-util's `GaiResolver` uses tokio's
//! blocking pool: a pool at its thread limit never ran them), with two bounds it lacks
//! ([`Lookups`]): a few look-ups at once for each kind of name ([`Names`]), and one
//! look-up for callers asking for the same name at once.
//!
//! getaddrinfo cannot be cancelled. A look-up whose connect gave up at `--connect-timeout`
//! ran on in its thread, with its socket, until the resolver gave up (5 s a server and try
//! in glibc; a minute with Kubernetes' `ndots:5` and search domains). With a DNS server
//! that stopped answering, every abandoned connect left a thread and a socket outside the
//! descriptor budget: a few bursts, and accepts and connects failed with EMFILE, requests
//! that need no DNS included.

use std::future::Future;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};

use hyper_util::client::legacy::connect::dns::Name;
use tokio::sync::{watch, Semaphore};

/// Whose host names a connector looks up. Each kind has look-up places of its own: a
/// sandbox domain whose DNS stopped answering, its look-ups holding every place for the
/// resolver's timeouts, left the control plane's and the token exchange's connects waiting
/// behind them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Names {
    /// The control plane, the token exchange, `check`: one or two names, their
    /// connections pooled.
    Own,
    /// envd: a host per sandbox (`PORT-ID.DOMAIN`), new names all the time.
    Sandboxes,
}

const OWN_LOOKUPS: usize = 2;
const SANDBOX_LOOKUPS: usize = 6;
/// Look-ups through getaddrinfo running at once, process-wide. From a working resolver
/// they answer hundreds of names a second; their sockets (two each at most) are in the
/// descriptor budget's reserve (`crate::descriptors`).
pub const MAX_LOOKUPS: usize = OWN_LOOKUPS + SANDBOX_LOOKUPS;

static OWN: Lookups = Lookups::new(OWN_LOOKUPS, system_lookup, thread);
static SANDBOXES: Lookups = Lookups::new(SANDBOX_LOOKUPS, system_lookup, thread);

fn system_lookup(host: &str) -> io::Result<Vec<SocketAddr>> {
    use std::net::ToSocketAddrs as _;
    Ok((host, 0).to_socket_addrs()?.collect())
}

/// A look-up's work, run on a thread of its own.
type Job = Box<dyn FnOnce() + Send>;

/// A thread of its own for each look-up, not tokio's blocking pool: a pool that could not
/// start a thread (the process at its thread limit) kept the look-up queued and panicked,
/// and every later caller of that name joined a look-up that never ran, until a restart.
/// A thread that cannot start drops its job here: its place, its name on the list.
fn thread(job: Job) -> io::Result<()> {
    std::thread::Builder::new()
        .name("abx-lookup".into())
        .spawn(job)
        .map(drop)
}

/// DNS for the upstream connectors: `localhost` and `*.localhost` (any case, with or without
/// the root dot) are 127.0.0.1 then ::1, answered here; every other name is asked of the
/// system through the [`Lookups`] of its [`Names`].
#[derive(Clone, Debug)]
pub struct LocalResolver {
    lookups: &'static Lookups,
}

impl LocalResolver {
    pub fn new(names: Names) -> Self {
        let lookups = match names {
            Names::Own => &OWN,
            Names::Sandboxes => &SANDBOXES,
        };
        LocalResolver { lookups }
    }
}

/// Whether RFC 6761 §6.3 makes `host` a loopback name.
pub fn is_localhost_name(host: &str) -> bool {
    let h = host.strip_suffix('.').unwrap_or(host);
    let suffix = ".localhost";
    h.eq_ignore_ascii_case("localhost")
        || (h.len() > suffix.len()
            && h.is_char_boundary(h.len() - suffix.len())
            && h[h.len() - suffix.len()..].eq_ignore_ascii_case(suffix))
}

/// The addresses [`LocalResolver`] answers. The port is filled in by the connector.
pub type ResolvedAddrs = std::vec::IntoIter<SocketAddr>;

impl tower_service::Service<Name> for LocalResolver {
    type Response = ResolvedAddrs;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = Result<ResolvedAddrs, io::Error>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, name: Name) -> Self::Future {
        if is_localhost_name(name.as_str()) {
            let addrs = vec![
                SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0),
                SocketAddr::new(IpAddr::V6(Ipv6Addr::LOCALHOST), 0),
            ];
            return Box::pin(std::future::ready(Ok(addrs.into_iter())));
        }
        let lookup = self.lookups.resolve(name.as_str().to_owned());
        let looking = LOOKING_UP.try_with(|l| l.0.clone()).ok();
        let set = move |now: bool| {
            if let Some(l) = &looking {
                l.store(now, Ordering::Relaxed);
            }
        };
        set(true);
        Box::pin(async move {
            let found = lookup.await;
            set(false);
            Ok(found?.into_iter())
        })
    }
}

/// A resolver whose look-ups hang, as getaddrinfo does when the DNS server has stopped
/// answering (each holds its thread for good; the test process does not wait for it).
#[cfg(test)]
pub(crate) fn stalled() -> LocalResolver {
    fn stalls(_: &str) -> io::Result<Vec<SocketAddr>> {
        loop {
            std::thread::park();
        }
    }
    static STALLED: Lookups = Lookups::new(8, stalls, thread);
    LocalResolver { lookups: &STALLED }
}

/// A resolver that answers every name at once, with 127.0.0.1, through a look-up.
#[cfg(test)]
pub(crate) fn answering() -> LocalResolver {
    fn answers(_: &str) -> io::Result<Vec<SocketAddr>> {
        Ok(vec![SocketAddr::from((Ipv4Addr::LOCALHOST, 0))])
    }
    static ANSWERING: Lookups = Lookups::new(8, answers, thread);
    LocalResolver {
        lookups: &ANSWERING,
    }
}

tokio::task_local! {
    static LOOKING_UP: LookingUp;
}

/// Whether a connect is waiting for its name (a look-up, or a place for one): a connect
/// that runs out of time then says "name look-up timed out", as nginx says "could not be
/// resolved", not "connect timed out", which sent operators to the upstream's network
/// while the DNS server had stopped answering.
#[derive(Clone, Default)]
pub struct LookingUp(Arc<AtomicBool>);

impl LookingUp {
    /// `connect`, with the look-ups of its [`LocalResolver`]s told here.
    pub async fn watch<F: Future>(&self, connect: F) -> F::Output {
        LOOKING_UP.scope(self.clone(), connect).await
    }

    /// Whether the connect is waiting for its name now.
    pub fn now(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

/// A look-up's outcome, for every caller that waited on it (`io::Error` is not `Clone`:
/// its kind and words).
type Outcome = Result<Arc<[SocketAddr]>, (io::ErrorKind, String)>;

/// Where a look-up's outcome is told, and heard: `None` until it is in.
type Tell = watch::Sender<Option<Outcome>>;
type Heard = watch::Receiver<Option<Outcome>>;

/// The look-ups running, by name.
type Running = Vec<(String, Heard)>;

/// Blocking look-ups, held to a number at once, one per name. A look-up's place is taken
/// before its thread starts and given back when the look-up returns, not when its callers
/// give up: the places count what runs, threads and sockets. Callers asking for a name
/// being looked up wait for that look-up (an SDK opens several connections to a new
/// sandbox at once; a cold control plane's waiting requests each open one).
pub struct Lookups {
    places: Semaphore,
    running: Mutex<Running>,
    lookup: fn(&str) -> io::Result<Vec<SocketAddr>>,
    start: fn(Job) -> io::Result<()>,
}

impl std::fmt::Debug for Lookups {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lookups")
            .field("free", &self.places.available_permits())
            .finish()
    }
}

impl Lookups {
    pub const fn new(
        at_once: usize,
        lookup: fn(&str) -> io::Result<Vec<SocketAddr>>,
        start: fn(Job) -> io::Result<()>,
    ) -> Self {
        Lookups {
            places: Semaphore::const_new(at_once),
            running: Mutex::new(Vec::new()),
            lookup,
            start,
        }
    }

    fn running(&self) -> std::sync::MutexGuard<'_, Running> {
        self.running.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// `host`'s addresses: the outcome of the look-up of `host` under way, or of a new one
    /// once a place is free. Dropping the future while it waits takes no place.
    pub async fn resolve(&'static self, host: String) -> io::Result<Vec<SocketAddr>> {
        loop {
            let mut outcome = match self.join_or_list(&host) {
                Ok(outcome) => outcome,
                Err((tell, listed)) => {
                    let outcome = listed.outcome.clone();
                    self.run(host.clone(), tell, listed).await?;
                    outcome
                }
            };
            // Closed without an outcome: whoever started it gave up before it ran. Anew.
            let Ok(done) = outcome.wait_for(Option::is_some).await else {
                tokio::task::yield_now().await;
                continue;
            };
            return match done.as_ref() {
                Some(Ok(addrs)) => Ok(addrs.to_vec()),
                Some(Err((kind, words))) => Err(io::Error::new(*kind, words.clone())),
                None => continue,
            };
        }
    }

    /// The outcome of the look-up of `host` under way; or, when there is none, a new one
    /// listed, for the caller to run. Found and listed under one lock: two callers never
    /// start the same name at once.
    fn join_or_list(&'static self, host: &str) -> Result<Heard, (Tell, Listed)> {
        let mut running = self.running();
        if let Some((_, outcome)) = running.iter().find(|(name, _)| name == host) {
            return Ok(outcome.clone());
        }
        let (tell, outcome) = watch::channel(None);
        running.push((host.to_owned(), outcome.clone()));
        Err((
            tell,
            Listed {
                lookups: self,
                outcome,
            },
        ))
    }

    /// Runs the listed look-up of `host` once a place is free; its outcome is told on
    /// `tell`. Dropped while it waits for a place, or failing to start its thread, it
    /// takes its name off the list, and those who joined it start anew.
    async fn run(&'static self, host: String, tell: Tell, listed: Listed) -> io::Result<()> {
        let place = self.places.acquire().await.map_err(io::Error::other)?;
        let lookup = self.lookup;
        (self.start)(Box::new(move || {
            let _place = place;
            let found = lookup(&host)
                .map(Arc::from)
                .map_err(|e| (e.kind(), e.to_string()));
            // Off the list before the outcome is told: a caller that comes after it
            // starts a new look-up, not one that has ended.
            drop(listed);
            let _ = tell.send(Some(found));
        }))
        .map_err(|e| {
            io::Error::new(
                e.kind(),
                format!(
                    "could not start a name look-up: {}",
                    crate::workers::thread_error(&e)
                ),
            )
        })
    }
}

/// A running look-up's entry in [`Lookups::running`], taken off when dropped.
struct Listed {
    lookups: &'static Lookups,
    outcome: Heard,
}

impl Drop for Listed {
    fn drop(&mut self) {
        let mut running = self.lookups.running();
        running.retain(|(_, outcome)| !outcome.same_channel(&self.outcome));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
    use std::time::Duration;
    use tower_service::Service;

    #[test]
    fn localhost_names() {
        for yes in [
            "localhost",
            "LocalHost",
            "localhost.",
            "49983-isb-1.localhost",
            "a.b.LOCALHOST.",
        ] {
            assert!(is_localhost_name(yes), "{yes}");
        }
        for no in [
            "",
            ".localhost",
            "localhost.example.com",
            "evillocalhost",
            "127.0.0.1",
            "localhost..",
            // The place where the suffix would start falls inside a character: no.
            "a\u{e9}123456789",
        ] {
            assert!(!is_localhost_name(no), "{no}");
        }
    }

    #[tokio::test]
    async fn localhost_resolves_to_loopback_without_dns() {
        let name: Name = "49983-isb-1.localhost".parse().unwrap();
        let addrs: Vec<SocketAddr> = (LocalResolver::new(Names::Sandboxes).call(name).await)
            .unwrap()
            .collect();
        assert_eq!(
            addrs,
            vec![
                SocketAddr::from((Ipv4Addr::LOCALHOST, 0)),
                SocketAddr::from((Ipv6Addr::LOCALHOST, 0)),
            ]
        );
    }

    /// What [`held_lookup`] waits for, and how many of it run, and ran.
    static GATE: (Mutex<bool>, std::sync::Condvar) = (Mutex::new(false), std::sync::Condvar::new());
    static RUNNING: AtomicUsize = AtomicUsize::new(0);
    static PEAK: AtomicUsize = AtomicUsize::new(0);
    static RAN: AtomicUsize = AtomicUsize::new(0);

    /// A look-up that hangs, as getaddrinfo does when the DNS server stops answering,
    /// until [`GATE`] opens; then it answers 127.0.0.1, or fails for `fails.example`.
    fn held_lookup(host: &str) -> io::Result<Vec<SocketAddr>> {
        RAN.fetch_add(1, SeqCst);
        let now = RUNNING.fetch_add(1, SeqCst) + 1;
        PEAK.fetch_max(now, SeqCst);
        let (open, opened) = &GATE;
        let mut open = open.lock().unwrap();
        while !*open {
            open = opened.wait(open).unwrap();
        }
        RUNNING.fetch_sub(1, SeqCst);
        if host == "fails.example" {
            return Err(io::Error::other("failed to lookup address information"));
        }
        Ok(vec![SocketAddr::from((Ipv4Addr::LOCALHOST, 0))])
    }

    static HELD: Lookups = Lookups::new(2, held_lookup, thread);

    /// Opens [`GATE`] when dropped: a failed assertion ends the test instead of leaving
    /// the runtime waiting for its blocked look-ups.
    struct Opens;

    impl Drop for Opens {
        fn drop(&mut self) {
            *GATE.0.lock().unwrap_or_else(PoisonError::into_inner) = true;
            GATE.1.notify_all();
        }
    }

    fn until(what: &str, done: &dyn Fn() -> bool) {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !done() {
            assert!(std::time::Instant::now() < deadline, "{what}");
            std::thread::yield_now();
        }
    }

    /// Look-ups whose callers gave up (a connect timed out) keep their places until they
    /// return, and no more than the bound run at once: each is a thread and a socket.
    /// Callers of a name being looked up share its look-up, its failure too. Through a
    /// [`LocalResolver`], as the connectors ask.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn lookups_are_bounded_shared_and_keep_their_places_until_they_return() {
        let opens = Opens;
        let resolve = |host: &str| {
            let name: Name = host.parse().unwrap();
            let mut resolver = LocalResolver { lookups: &HELD };
            tokio::spawn(async move { resolver.call(name).await.map(Vec::from_iter) })
        };
        let first = [resolve("hangs.example"), resolve("fails.example")];
        until("two look-ups running", &|| RUNNING.load(SeqCst) == 2);
        // The same names, asked again: no third look-up, though none has a place.
        let shared = resolve("hangs.example");
        let failed = resolve("fails.example");
        for caller in &first {
            caller.abort();
        }
        for caller in first {
            assert!(caller.await.unwrap_err().is_cancelled());
        }
        // The callers are gone; their look-ups are not, and hold both places.
        assert_eq!(HELD.places.available_permits(), 0);
        let third = resolve("after.example");
        // One whose caller gives up while it waits for a place is taken off the list, and
        // whoever joined it starts anew.
        let leader = resolve("queued.example");
        let listed = || {
            HELD.running()
                .iter()
                .any(|(name, _)| name == "queued.example")
        };
        until("the queued look-up listed", &listed);
        let joiner = resolve("queued.example");
        leader.abort();
        assert!(leader.await.unwrap_err().is_cancelled());
        assert_eq!(RUNNING.load(SeqCst), 2);
        drop(opens);
        let addrs = |joined: tokio::task::JoinHandle<io::Result<Vec<SocketAddr>>>| async {
            tokio::time::timeout(Duration::from_secs(10), joined)
                .await
                .expect("answered once the gate opens")
                .unwrap()
        };
        let localhost = vec![SocketAddr::from((Ipv4Addr::LOCALHOST, 0))];
        assert_eq!(addrs(shared).await.unwrap(), localhost);
        assert_eq!(addrs(third).await.unwrap(), localhost);
        assert_eq!(addrs(joiner).await.unwrap(), localhost);
        let e = addrs(failed).await.unwrap_err();
        assert!(e.to_string().contains("failed to lookup"), "{e}");
        until("every look-up returned", &|| RUNNING.load(SeqCst) == 0);
        until("every place given back", &|| {
            HELD.places.available_permits() == 2
        });
        assert_eq!(PEAK.load(SeqCst), 2);
        assert_eq!(RAN.load(SeqCst), 4, "two shared, two after");
        assert!(HELD.running().is_empty());
    }

    static REFUSED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

    /// Refuses to start the first look-up's thread, as a process at its thread limit does.
    fn refuses_once(job: Job) -> io::Result<()> {
        if !REFUSED.swap(true, SeqCst) {
            return Err(io::Error::from(io::ErrorKind::WouldBlock));
        }
        thread(job)
    }

    fn answers(_: &str) -> io::Result<Vec<SocketAddr>> {
        Ok(vec![SocketAddr::from((Ipv4Addr::LOCALHOST, 0))])
    }

    static REFUSING: Lookups = Lookups::new(1, answers, refuses_once);

    /// A look-up whose thread cannot start fails its caller, and the name is looked up
    /// again by the next one: queued in tokio's blocking pool, it never ran, and every
    /// later caller of the name joined it.
    #[tokio::test]
    async fn a_lookup_whose_thread_cannot_start_leaves_the_name_free() {
        let e = REFUSING.resolve("vm".into()).await.unwrap_err();
        assert!(
            e.to_string().contains("could not start a name look-up"),
            "{e}"
        );
        assert!(REFUSING.running().is_empty());
        assert_eq!(REFUSING.places.available_permits(), 1);
        let addrs = tokio::time::timeout(Duration::from_secs(10), REFUSING.resolve("vm".into()))
            .await
            .expect("looked up again")
            .unwrap();
        assert_eq!(addrs, vec![SocketAddr::from((Ipv4Addr::LOCALHOST, 0))]);
    }
}
