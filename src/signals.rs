//! Signals: SIGTERM/SIGINT start the drain; SIGHUP asks for a reload.

use std::future::Future;

use tokio::signal::unix::{signal, SignalKind};

/// Resolves at the first SIGTERM or SIGINT. The handlers are installed by this call, not
/// at the first poll: a signal that comes in between is kept rather than left to the
/// default action, which kills the process without a drain.
pub fn terminate() -> impl Future<Output = ()> {
    let handlers = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    );
    async move {
        let (Ok(mut term), Ok(mut int)) = handlers else {
            // Without signal handlers the process can still be killed; never resolve.
            return std::future::pending().await;
        };
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
    }
}

/// A stream of SIGHUPs (`None` if the handler could not be installed).
pub fn hangups() -> Option<tokio::signal::unix::Signal> {
    signal(SignalKind::hangup()).ok()
}
