//! Signals: SIGTERM/SIGINT start the drain; SIGHUP asks for a reload.

use tokio::signal::unix::{signal, SignalKind};

/// Resolves at the first SIGTERM or SIGINT.
pub async fn terminate() {
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        // Without signal handlers the process can still be killed; never resolve.
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}

/// A stream of SIGHUPs (`None` if the handler could not be installed).
pub fn hangups() -> Option<tokio::signal::unix::Signal> {
    signal(SignalKind::hangup()).ok()
}
