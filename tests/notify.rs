//! systemd readiness (sd_notify) through the real binary: with `NOTIFY_SOCKET` set, the
//! proxy says `READY=1` once its listeners accept and `STOPPING=1` when the drain begins,
//! which is what lets the unit be `Type=notify`. A socket nobody listens on is a warning,
//! never a failed start.

mod support;

use std::os::fd::OwnedFd;
use std::path::Path;
use std::process::Stdio;

use support::*;
use tokio::io::AsyncReadExt;
use tokio::net::unix::pipe;
use tokio::net::{UnixDatagram, UnixStream};

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
///
/// READY=1 is checked without the "listening" line, which is logged after the binds and
/// would make any connect after it succeed. Instead the proxy's stderr is a pipe the test
/// filled, and only the notify module may log: the proxy's first write is the
/// "sd_notify sent" line right after READY=1, and it blocks until the test reads. So the
/// proxy is held still from READY=1 until both connects are done, and a READY=1 sent
/// before the binds finds no listener, however the two processes are scheduled.
async fn ready_then_stopping(sock: UnixDatagram, target: &str) {
    let dir = tempfile::tempdir().expect("tempdir");
    let listen = dir.path().join("proxy.sock");
    let admin = dir.path().join("admin.sock");
    let (held, stderr) = held_stderr();
    let (mut proxy, _home) = spawn_proxy(
        dir.path(),
        &[
            "--listen",
            &format!("unix:{}", path_str(&listen)),
            "--admin-listen",
            &format!("unix:{}", path_str(&admin)),
        ],
        target,
        held,
    );

    // A proxy that refuses to start says why on the held stderr, so it cannot: it is then
    // this wait that fails.
    assert_eq!(next_state(&sock, "READY=1").await, "READY=1");
    // Ready means accepting: systemd starts the units ordered after this one now.
    let (proxy_conn, admin_conn) = within("connect after READY", async {
        tokio::join!(UnixStream::connect(&listen), UnixStream::connect(&admin))
    })
    .await;
    proxy_conn.expect("the proxy listener accepts once READY=1 is sent");
    admin_conn.expect("the admin listener accepts once READY=1 is sent");
    assert_drained(&sock);

    let stderr = tokio::spawn(read_log(stderr));
    proxy.signal("TERM");
    assert_eq!(next_state(&sock, "STOPPING=1").await, "STOPPING=1");
    let status = proxy.exit("abx-proxy to exit after SIGTERM").await;
    let stderr = within("the proxy's stderr to close", stderr)
        .await
        .expect("the stderr reader panicked")
        .expect("read the proxy's stderr");
    assert!(status.success(), "exit {status}; stderr:\n{stderr}");
    assert_drained(&sock);
    // Without this line nothing held the proxy still, and the check above proved nothing.
    assert!(
        stderr.contains("sd_notify sent state=\"READY=1\""),
        "the line that holds the proxy after READY=1 is missing:\n{stderr}"
    );
    assert!(
        !stderr.contains("sd_notify failed"),
        "no warning expected:\n{stderr}"
    );
}

/// A pipe for the proxy's stderr with no room left, and its read end: the proxy's first
/// log line waits for the test to read.
fn held_stderr() -> (OwnedFd, pipe::Receiver) {
    use rustix::pipe::PipeFlags;
    // Raw writes, not tokio's: its `try_write` says WouldBlock without writing until the
    // runtime has seen the pipe writable, which would leave the pipe empty.
    let (rx, tx) =
        rustix::pipe::pipe_with(PipeFlags::CLOEXEC | PipeFlags::NONBLOCK).expect("a pipe");
    for chunk in [&[b'\n'; 4096][..], &b"\n"[..]] {
        // Small writes after large ones: a page only partly filled would still take a line.
        loop {
            match rustix::io::write(&tx, chunk) {
                Ok(_) => {}
                Err(rustix::io::Errno::AGAIN) => break,
                Err(e) => panic!("filling the stderr pipe: {e}"),
            }
        }
    }
    // A non-blocking stderr would make the proxy drop the line instead of waiting.
    rustix::io::ioctl_fionbio(&tx, false).expect("a blocking write end");
    let rx = pipe::Receiver::from_owned_fd(rx).expect("the read end to tokio");
    (tx, rx)
}

/// Everything the proxy wrote, without the blank lines that filled the pipe.
async fn read_log(mut rx: pipe::Receiver) -> std::io::Result<String> {
    let mut raw = Vec::new();
    rx.read_to_end(&mut raw).await?;
    Ok(strip_ansi(
        String::from_utf8_lossy(&raw).trim_start_matches('\n'),
    ))
}

/// `abx-proxy serve` started directly rather than through `ProxyCmd`, which would need
/// the "listening" line and a stderr it reads all along; killed if the test fails. Its
/// home directory lives as long as the returned one.
fn spawn_proxy(
    dir: &Path,
    listen: &[&str],
    notify_socket: &str,
    stderr: OwnedFd,
) -> (Spawned, tempfile::TempDir) {
    let home = tempfile::tempdir_in(dir).expect("home");
    let abx_home = home.path().join(".abx");
    std::fs::create_dir_all(&abx_home).expect("ABX_HOME");
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_abx-proxy"));
    cmd.env_clear()
        .env("HOME", home.path())
        .env("ABX_HOME", &abx_home)
        .env("ABX_SANDBOX_API_KEY", API_KEY)
        .env("NOTIFY_SOCKET", notify_socket)
        .current_dir(home.path())
        .arg("serve")
        .args(listen)
        .args(["--sandbox-base-url", "https://127.0.0.1:9"])
        .args(["--log-level", "off,abx_proxy::notify=debug"])
        .args(["--shutdown-grace", "10s"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::from(stderr));
    let proxy = Spawned::spawn(&mut cmd, "abx-proxy");
    // The command, and with it the test's copy of the write end, goes now, so the reader
    // sees end of file once the proxy exits.
    drop(cmd);
    (proxy, home)
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
