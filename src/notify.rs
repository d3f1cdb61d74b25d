//! systemd's readiness protocol (sd_notify(3)), so the unit can be `Type=notify`: systemd
//! then reports the service started only once the proxy accepts connections, and units
//! ordered after it do not race its bind.
//!
//! The protocol is one datagram per state to the unix socket named by `NOTIFY_SOCKET` (a
//! path, or `@name` for an abstract socket). std speaks it without libsystemd and without
//! `unsafe`. Without `NOTIFY_SOCKET` (a laptop, a container) every call is a no-op. A
//! notification that cannot be sent is never fatal: the proxy serves either way, and a
//! supervisor that misses READY=1 times the start out itself. It is warned about once, not
//! per state.

use std::ffi::OsStr;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::UnixDatagram;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// How long a send may block the main runtime: systemd's socket has a deep queue, so a
/// send that waits longer than this means nobody is reading it.
const SEND_TIMEOUT: Duration = Duration::from_secs(1);

static WARNED: AtomicBool = AtomicBool::new(false);

/// Every listener is bound and accepting.
pub fn ready() {
    notify("READY=1");
}

/// The drain has begun: systemd shows the unit as deactivating rather than running.
pub fn stopping() {
    notify("STOPPING=1");
}

fn notify(state: &str) {
    let Some(target) = std::env::var_os("NOTIFY_SOCKET") else {
        return;
    };
    match send(&target, state) {
        Ok(()) => tracing::debug!(state, "sd_notify sent"),
        Err(e) => {
            if !WARNED.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    state,
                    socket = %crate::providers::manifest::printable(
                        &Path::new(&target).to_string_lossy()
                    ),
                    error = %e,
                    "sd_notify failed; serving anyway (further failures are not logged)"
                );
            }
        }
    }
}

/// Why a notification was not delivered.
#[derive(Debug, thiserror::Error)]
enum NotifyError {
    #[error("NOTIFY_SOCKET is neither an absolute path nor an @abstract name")]
    Unsupported,
    #[error("{0}")]
    Io(#[from] io::Error),
}

/// Sends `state` to `target`, a `NOTIFY_SOCKET` value.
fn send(target: &OsStr, state: &str) -> Result<(), NotifyError> {
    let bytes = target.as_bytes();
    let socket = UnixDatagram::unbound()?;
    socket.set_write_timeout(Some(SEND_TIMEOUT))?;
    if let Some(name) = bytes.strip_prefix(b"@") {
        return send_abstract(&socket, name, state);
    }
    // Relative paths would depend on the working directory, and systemd's newer
    // `vsock:` targets are for VMs: neither is a socket this process can mean.
    if !bytes.starts_with(b"/") {
        return Err(NotifyError::Unsupported);
    }
    socket.send_to(state.as_bytes(), Path::new(target))?;
    Ok(())
}

#[cfg(target_os = "linux")]
fn send_abstract(socket: &UnixDatagram, name: &[u8], state: &str) -> Result<(), NotifyError> {
    use std::os::linux::net::SocketAddrExt;
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(name)?;
    socket.send_to_addr(state.as_bytes(), &addr)?;
    Ok(())
}

/// Abstract sockets are Linux's own; elsewhere an `@name` cannot be reached.
#[cfg(not(target_os = "linux"))]
fn send_abstract(_socket: &UnixDatagram, _name: &[u8], _state: &str) -> Result<(), NotifyError> {
    Err(NotifyError::Unsupported)
}
