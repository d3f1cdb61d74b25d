//! Signals: SIGTERM/SIGINT start the drain, and a second one ends it; SIGHUP asks for a
//! reload.

use tokio::signal::unix::{signal, Signal, SignalKind};

/// SIGTERM and SIGINT. The handlers are installed when this is made, not at the first
/// wait: a signal that comes in between is kept rather than left to the default action,
/// which kills the process without a drain.
pub struct Terminate {
    /// `None` when the handlers could not be installed: the process can still be killed.
    signals: Option<(Signal, Signal)>,
}

impl Terminate {
    pub fn install() -> Self {
        let signals = match (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) {
            (Ok(term), Ok(int)) => Some((term, int)),
            _ => None,
        };
        Terminate { signals }
    }

    /// Resolves at the next SIGTERM or SIGINT: the first starts the drain; a second one
    /// (Ctrl-C pressed again) cuts the grace period short.
    pub async fn next(&mut self) {
        let Some((term, int)) = &mut self.signals else {
            return std::future::pending().await;
        };
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
    }
}

/// A stream of SIGHUPs (`None` if the handler could not be installed).
pub fn hangups() -> Option<Signal> {
    signal(SignalKind::hangup()).ok()
}
