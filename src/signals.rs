//! Signals: SIGTERM/SIGINT start the drain, and a second one of the same kind ends it;
//! SIGHUP asks for a reload; SIGXFSZ (a log file at `LimitFSIZE=`) is caught, so that the
//! write fails (EFBIG) and its line is counted as dropped.

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

    /// Resolves at the next SIGTERM or SIGINT, saying which.
    pub async fn next(&mut self) -> Stop {
        let Some((term, int)) = &mut self.signals else {
            return std::future::pending().await;
        };
        tokio::select! {
            _ = term.recv() => Stop::Term,
            _ = int.recv() => Stop::Int,
        }
    }

    /// Resolves at the next signal of the kind that started the drain (`first`): Ctrl-C
    /// pressed again, or a second SIGTERM. The other kind does not count: Ctrl-C reaches a
    /// supervisor's whole process group as SIGINT, and the supervisor then sends its own
    /// SIGTERM, which must not cut the grace period the first one began.
    pub async fn again(&mut self, first: Stop) {
        loop {
            let next = self.next().await;
            if next == first {
                return;
            }
            tracing::info!(
                signal = next.name(),
                "not the signal that started the drain: the drain goes on"
            );
        }
    }
}

/// Which stop signal came.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    Term,
    Int,
}

impl Stop {
    pub fn name(self) -> &'static str {
        match self {
            Stop::Term => "SIGTERM",
            Stop::Int => "SIGINT",
        }
    }
}

/// A stream of SIGHUPs (`None` if the handler could not be installed).
pub fn hangups() -> Option<Signal> {
    signal(SignalKind::hangup()).ok()
}

/// SIGXFSZ, on Linux (every architecture the proxy builds for but the MIPS and SPARC ones).
const SIGXFSZ: i32 = 25;

/// SIGXFSZ handled (and never waited for): stderr written to a file that reaches the
/// file-size limit (`LimitFSIZE=`, `ulimit -f`) killed the process at once, undrained, its
/// last line cut mid-word. The write fails with EFBIG instead, a log line lost and counted
/// as any line stderr did not take. tokio keeps a handler for the process's lifetime.
pub fn survive_file_size_limit() {
    drop(signal(SignalKind::from_raw(SIGXFSZ)));
}
