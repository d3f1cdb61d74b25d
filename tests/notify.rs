//! systemd readiness (sd_notify) through the real binary: with `NOTIFY_SOCKET` set, the
//! proxy says `READY=1` once its listeners accept and `STOPPING=1` when the drain begins,
//! which is what lets the unit be `Type=notify`. A socket nobody listens on is a warning,
//! never a failed start.

mod support;

use std::path::Path;

use support::*;
use tokio::net::UnixDatagram;

/// The next datagram on `sock`, as text.
async fn next_state(sock: &UnixDatagram, what: &str) -> String {
    let mut buf = [0u8; 512];
    let n = within(what, sock.recv(&mut buf))
        .await
        .expect("recv on the notify socket");
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

/// Nothing more is waiting on `sock`: each state is said once.
fn assert_drained(sock: &UnixDatagram) {
    let mut buf = [0u8; 512];
    match sock.try_recv(&mut buf) {
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
        other => panic!(
            "an extra notification: {:?}",
            other.map(|n| String::from_utf8_lossy(&buf[..n]).into_owned())
        ),
    }
}

/// Runs a proxy told to notify `target`, and checks the whole conversation on `sock`:
/// READY=1 only once both listeners accept, STOPPING=1 at SIGTERM, then a clean exit.
async fn ready_then_stopping(sock: UnixDatagram, target: &str) {
    let pki = Pki::new();
    let mut proxy = ProxyCmd::new("https://127.0.0.1:9", &pki)
        .env("NOTIFY_SOCKET", Some(target))
        .spawn()
        .await;

    assert_eq!(next_state(&sock, "READY=1").await, "READY=1");
    // Ready means accepting: systemd starts the units ordered after this one now.
    for addr in [proxy.addr(), proxy.admin_addr()] {
        within("connect after READY", tokio::net::TcpStream::connect(addr))
            .await
            .expect("the listener accepts once READY=1 is sent");
    }
    assert_drained(&sock);

    proxy.signal("TERM");
    assert_eq!(next_state(&sock, "STOPPING=1").await, "STOPPING=1");
    let status = proxy.wait_exit().await;
    assert!(
        status.success(),
        "exit {status}; stderr:\n{}",
        proxy.stderr()
    );
    assert_drained(&sock);
    let stderr = proxy.stderr();
    assert!(
        !stderr.contains("sd_notify failed"),
        "no warning expected:\n{stderr}"
    );
}

/// `NOTIFY_SOCKET` as a path, as systemd sets it (`/run/systemd/notify`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ready_and_stopping_reach_a_path_socket() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("notify.sock");
    let sock = UnixDatagram::bind(&path).expect("bind the notify socket");
    ready_then_stopping(sock, path_str(&path)).await;
}

/// `NOTIFY_SOCKET=@name`: an abstract socket, as systemd uses inside some containers.
#[cfg(target_os = "linux")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ready_and_stopping_reach_an_abstract_socket() {
    use std::os::linux::net::SocketAddrExt;
    let name = format!(
        "abx-proxy-notify-test-{}-{}",
        std::process::id(),
        unique_suffix()
    );
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())
        .expect("an abstract address");
    let std_sock = std::os::unix::net::UnixDatagram::bind_addr(&addr).expect("bind abstract");
    std_sock.set_nonblocking(true).expect("nonblocking");
    let sock = UnixDatagram::from_std(std_sock).expect("to tokio");
    ready_then_stopping(sock, &format!("@{name}")).await;
}

/// A name no other test run picks: abstract names are machine-wide, not per directory.
fn unique_suffix() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0)
}

/// A notify socket that is gone (a stale `NOTIFY_SOCKET` in a shell) costs one warning,
/// not the start and not a warning per state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_notify_socket_nobody_listens_on_is_one_warning_not_a_failure() {
    let dir = tempfile::tempdir().expect("tempdir");
    let gone = dir.path().join("gone.sock");
    let pki = Pki::new();
    let mut proxy = ProxyCmd::new("https://127.0.0.1:9", &pki)
        .env("NOTIFY_SOCKET", Some(path_str(&gone)))
        .spawn()
        .await;
    proxy.wait_for_line("sd_notify failed").await;
    let stderr = proxy.finish().await;
    assert_eq!(
        stderr.matches("sd_notify failed").count(),
        1,
        "one warning for READY=1 and STOPPING=1 together:\n{stderr}"
    );
}

fn path_str(p: &Path) -> &str {
    p.to_str().expect("a UTF-8 temp path")
}
