//! `abx-proxy serve`, as a narrative: settings → credential → listeners → signal → drain.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::cli::{RunArgs, ServeArgs, SettingsArgs};
use crate::commands;
use crate::credentials::ApiCredential;
use crate::descriptors;
use crate::error::Error;
use crate::metrics::Metrics;
use crate::proxy::certs::ListenerCert;
use crate::proxy::listener::{self, Listener, ServeConfig};
use crate::proxy::{Options, Proxy};
use crate::reload::{FileWatch, Running, Started};
use crate::settings::Settings;
use crate::signals;
use crate::workers::{self, Workers};

/// How long connections cut at the end of the drain get to log themselves before exit.
const ABORT_WAIT: Duration = Duration::from_secs(1);
/// Reads and checks everything before any port is bound, then runs until a signal.
pub fn run(args: &ServeArgs) -> Result<(), Error> {
    // The main thread's runtime: signals, admin, refresher, drain. Connections are served by
    // the workers' (see `workers`).
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build();
    // SIGHUP's handler before anything else: one in the milliseconds the start takes
    // (settings, the open-file limit, the trust store) took its default action and ended
    // the process (129), where SIGHUP never stops the proxy. Kept by tokio: the running
    // proxy reloads. SIGTERM and SIGINT keep theirs until just before the listeners: a
    // start can block (a key read from a pipe or the terminal), and Ctrl-C or a stop
    // must end it, as before; there is nothing to drain yet.
    let hangups = runtime.as_ref().ok().and_then(|runtime| {
        let _in = runtime.enter();
        signals::survive_file_size_limit();
        signals::hangups()
    });
    // Before the first read: a secret rotated while the proxy starts is a change to apply.
    // The listener's pair too: cert-manager renews it in place, as the kubelet rotates a
    // Secret, and nothing in the pod can send a SIGHUP.
    let reader = crate::reader::Reader::start();
    let files = FileWatch::new(
        args.settings
            .secret_files()
            .into_iter()
            .map(|(_, p)| p)
            .chain(args.exposure.tls_cert.iter().cloned())
            .chain(args.exposure.tls_key.iter().cloned())
            .collect(),
        reader,
    );
    let (resolved, warned) = commands::resolve_unsaid(&args.settings)?;
    for w in &warned {
        crate::logging::warning(w);
    }
    let settings = resolved.validate()?;
    for w in settings.cleartext_upstreams() {
        tracing::warn!("{w}");
    }
    for w in crate::upstream::unused_forward_proxies() {
        tracing::warn!("{w}");
    }
    let exposure = &args.exposure;
    if let Some(w) =
        crate::proxy::exposure_warning(&settings.listen, exposure.tls(), exposure.allow_remote)
    {
        tracing::warn!("{w}");
    }
    if let Some(w) = short_idle_timeout(&args.run) {
        let idle_timeout_ms = u64::try_from(args.run.idle_timeout.as_millis()).unwrap_or(u64::MAX);
        tracing::warn!(idle_timeout_ms, "{w}");
    }
    let mut options = options(args);
    let budget = descriptors::raise_open_file_limit(options.max_connections, workers::count())
        .map_err(|e| Error::Bind {
            addr: settings.shown(&settings.listen),
            reason: e.to_string(),
        })?;
    options.max_connections = budget.clients;
    options.upstream_slots = budget.upstream;
    options.splice_pipes = budget.pipes;
    let tls = match (&options.tls_cert, &options.tls_key) {
        (Some(cert), Some(key)) => {
            let pair = ListenerCert::load(cert, key)?;
            if let Some(w) = pair.validity_warning(std::time::SystemTime::now()) {
                tracing::warn!("{w}");
            }
            Some(pair)
        }
        _ => None,
    };
    let runtime = runtime.map_err(|e| Error::Bind {
        addr: settings.shown(&settings.listen),
        reason: format!("cannot start the runtime: {e}"),
    })?;
    let served = runtime.block_on(serve(
        settings,
        Started {
            credential: commands::credential_said(&resolved),
            resolved,
            warned,
        },
        options,
        tls,
        args.settings.clone(),
        files,
        hangups,
    ));
    // Dropping the runtime would wait for its blocking threads: none is used now (name
    // look-ups have threads of their own, file reads the reader's), but one that hung (a
    // getaddrinfo cannot be cancelled) would keep the process past the drain, with no
    // signal handled any more.
    runtime.shutdown_background();
    served
}

async fn serve(
    settings: Settings,
    started: Started,
    options: Options,
    tls: Option<ListenerCert>,
    flags: SettingsArgs,
    files: FileWatch,
    hangups: Option<tokio::signal::unix::Signal>,
) -> Result<(), Error> {
    let registry = |e: prometheus::Error| Error::Bind {
        addr: settings.shown(&settings.admin_listen),
        reason: format!("metrics registry: {e}"),
    };
    let metrics = Arc::new(Metrics::new().map_err(registry)?);
    if let Some(tls) = &tls {
        metrics.serve_tls(tls.expires()).map_err(registry)?;
    }
    // Once: a reload swapping in a new pair uses it too, never reading the files again.
    let trust = crate::upstream::tls_config(options.upstream_ca.as_deref())?;
    (metrics.max_connections).set(i64::try_from(options.max_connections).unwrap_or(i64::MAX));
    let credential = ApiCredential::start(&settings, &options, &trust, &metrics)?;
    let proxy = Arc::new(Proxy::new(
        &settings, &options, &trust, credential, metrics,
    )?);

    // Before the listening line: from then on SIGTERM must drain, not end the process.
    let mut terminate = signals::Terminate::install();
    let listener = Listener::bind(&settings.listen, &settings.shown(&settings.listen)).await?;
    // Validation checked the configured port; `--listen 127.0.0.1:0` is known only now.
    if let Ok(bound) = listener.local_addr().parse() {
        settings.refuse_self_loop(bound)?;
        // And at every upstream connect, for the spellings of this host no setting reads.
        crate::upstream::listening_on(bound);
    }
    let admin = Listener::bind(
        &settings.admin_listen,
        &settings.shown(&settings.admin_listen),
    )
    .await?;
    let workers = Workers::start(workers::count(), &settings.shown(&listener.local_addr()))?;
    tracing::info!(
        listen = %settings.shown(&listener.local_addr()),
        admin = %settings.shown(&admin.local_addr()),
        upstream = %settings.shown(&settings.sandbox_base_url),
        // An AccessKey pair exported for Alibaba Cloud's own tools beats an API key in a
        // lower level's `.env`, and the start said nothing of which it took.
        credential = %crate::providers::manifest::printable(&started.credential),
        "abx-proxy listening"
    );
    crate::notify::ready();
    tokio::spawn(crate::admin::serve(
        admin,
        proxy.clone(),
        options.header_timeout,
    ));

    let (stop_tx, stop_rx) = watch::channel(false);
    let config = ServeConfig {
        tls: tls.as_ref().map(ListenerCert::handshakes),
        idle_timeout: options.idle_timeout,
        header_timeout: options.header_timeout,
        max_connections: options.max_connections,
    };
    let accepting = tokio::spawn(listener::accept_loop(
        listener,
        proxy.clone(),
        config,
        workers,
        stop_rx,
    ));
    let running = Running::at_start(
        proxy.clone(),
        flags,
        options.clone(),
        started,
        &settings,
        tls,
        trust,
    );
    tokio::spawn(crate::reload::on_hangup(running, hangups, files));

    let first = terminate.next().await;
    tracing::info!(
        signal = first.name(),
        grace_s = options.shutdown_grace.as_secs_f64(),
        "draining"
    );
    crate::notify::stopping();
    proxy.start_draining();
    let _ = stop_tx.send(true);
    // The accept loop returns after dropping the listener: new connections are refused.
    accepting.await.map_err(|e| Error::Bind {
        addr: settings.shown(&settings.listen),
        reason: e.to_string(),
    })?;
    drain(
        &proxy,
        &stop_tx,
        &mut terminate,
        first,
        options.shutdown_grace,
    )
    .await;
    Ok(())
}

/// The drain, once the listener is closed: what is in flight finishes within `grace`
/// (or the same signal again), then what is left is closed.
async fn drain(
    proxy: &Proxy,
    stop_tx: &watch::Sender<bool>,
    terminate: &mut signals::Terminate,
    first: signals::Stop,
    grace: Duration,
) {
    // From here a connect is refused: operators (and tests) can tell the drain has begun.
    // The gauge, not the drain watch's receivers: a connection holds several of those.
    let open = proxy.metrics.open_connections.get();
    tracing::info!(open, "listener closed");
    let clean = tokio::select! {
        clean = listener::drain(stop_tx, grace) => clean,
        () = terminate.again(first) => {
            tracing::warn!("second signal: closing what is left now");
            false
        }
    };
    // What was open at the end of the drain, and cut; `left` after that, at the exit.
    let mut cut = 0;
    if !clean {
        cut = proxy.metrics.open_connections.get();
        // What is left is closed by its own task, which logs a cut request as 499 and
        // flushes its worker's lines: a moment for that, not another grace period.
        proxy.abort();
        let _ = tokio::time::timeout(ABORT_WAIT, stop_tx.closed()).await;
    }
    // Connections still open now are closed by the exit, without their log lines.
    let left = proxy.metrics.open_connections.get();
    if clean {
        tracing::info!(clean, left, "stopped");
    } else {
        // Requests and tunnels were cut: worth a WARN, as the second signal's is. `cut`
        // beside `left`: a `left=0` alone read as nothing cut.
        tracing::warn!(
            clean,
            cut,
            left,
            "stopped; what was still open at the end of the drain was cut"
        );
    }
}

/// The shortest idle timeout envd's keepalives keep a quiet stream alive under: the proxy
/// asks envd for one every half timeout, in whole seconds and at least one (see
/// `headers::pace_keepalives`).
const ENVD_KEEPALIVE_FLOOR: Duration = Duration::from_secs(2);

/// A warning for an `--idle-timeout` under [`ENVD_KEEPALIVE_FLOOR`], which `check` gives
/// too.
pub(crate) fn short_idle_timeout(run: &RunArgs) -> Option<String> {
    (run.idle_timeout < ENVD_KEEPALIVE_FLOOR).then(|| {
        "--idle-timeout is under 2 s: envd sends keepalives on a quiet command or watch \
         stream at most once a second, so such a stream can be cut, and the SDK reports an \
         error"
            .to_string()
    })
}

fn options(args: &ServeArgs) -> Options {
    // The durations were checked as the command line was parsed.
    Options {
        allow_remote: args.exposure.allow_remote,
        allowed_hosts: (args.exposure.allowed_host.iter())
            .filter(|h| !h.is_empty())
            .cloned()
            .collect(),
        tls_cert: args.exposure.tls_cert.clone(),
        tls_key: args.exposure.tls_key.clone(),
        upstream_ca: args.net.upstream_ca.clone(),
        connect_timeout: args.net.connect_timeout,
        upstream_timeout: args
            .net
            .upstream_timeout
            .unwrap_or(Duration::from_secs(300)),
        idle_timeout: args.run.idle_timeout,
        shutdown_grace: args.run.shutdown_grace,
        header_timeout: args.run.header_timeout,
        max_connections: args.run.max_connections,
        upstream_slots: descriptors::Slots::UNLIMITED,
        splice_pipes: descriptors::Slots::UNLIMITED,
    }
}
