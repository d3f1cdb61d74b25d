//! The listener's certificate (`--tls-cert`, `--tls-key`) renewed under a running proxy:
//! re-read on SIGHUP and when its files change, swapped only as a valid pair, and never
//! at the expense of connections already open. Two test CAs stand for the old and the
//! renewed certificate: a client trusting only one of them tells which the proxy serves.

mod support;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use http::StatusCode;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::CertificateDer;
use support::*;
use tokio::net::TcpStream;

type TlsStream = tokio_rustls::client::TlsStream<TcpStream>;

/// `pki`'s server certificate and key, as PEM text.
fn pem_pair(pki: &Pki) -> (String, String) {
    let (cert, key) = pki.server_pem_files();
    let read = |p: &Path| std::fs::read_to_string(p).expect("read a PEM file");
    (read(&cert), read(&key))
}

/// A TLS connection to the proxy, after checking that it served `pki`'s certificate.
async fn served_by(pki: &Pki, addr: SocketAddr) -> TlsStream {
    let tls = pki.tls_connect(addr, &[b"http/1.1"]).await;
    let expected = CertificateDer::from_pem_file(pki.server_pem_files().0).expect("leaf");
    let served = tls.get_ref().1.peer_certificates().expect("a certificate");
    assert_eq!(served.first(), Some(&expected), "another leaf certificate");
    tls
}

/// A proxy whose listener serves the pair in `cert` and `key`.
async fn tls_proxy(upstream: &Upstream, pki: &Pki, cert: &Path, key: &Path) -> ProxyProc {
    ProxyCmd::new(&upstream.url(), pki)
        .args(&["--tls-cert", &cert.display().to_string()])
        .args(&["--tls-key", &key.display().to_string()])
        .spawn()
        .await
}

/// One request on an open connection: its status.
async fn status_on(
    client: &mut hyper::client::conn::http1::SendRequest<TestBody>,
    addr: SocketAddr,
) -> StatusCode {
    within("the connection ready", client.ready())
        .await
        .expect("the connection open");
    let req = request("GET", addr, "/sandboxes")
        .header("x-api-key", "dummy")
        .body(empty())
        .expect("request");
    within("the proxy's answer", client.send_request(req))
        .await
        .expect("an answer")
        .status()
}

/// Neither key's PEM body is in the log, whatever was refused.
fn assert_no_key_bytes(stderr: &str, keys: &[&str]) {
    for key in keys {
        for line in key.lines().filter(|l| !l.starts_with("-----")) {
            assert!(!stderr.contains(line), "key bytes in the log:\n{stderr}");
        }
    }
}

/// An old and a renewed certificate, the files a proxy reads (the old pair at first), and
/// the upstream it forwards to.
struct Renewal {
    old: Pki,
    new: Pki,
    old_key: String,
    new_cert: String,
    new_key: String,
    cert: PathBuf,
    key: PathBuf,
    _dir: tempfile::TempDir,
    _upstream: Upstream,
}

impl Renewal {
    /// The files with the old pair, and a proxy serving it.
    async fn start() -> (Renewal, ProxyProc) {
        let (old, new) = (Pki::new(), Pki::new());
        let upstream =
            Upstream::start(&old, Proto::Http1, |_req| async { response(200, "ok") }).await;
        let dir = tempfile::tempdir().expect("dir");
        let (cert, key) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
        let ((old_cert, old_key), (new_cert, new_key)) = (pem_pair(&old), pem_pair(&new));
        std::fs::write(&cert, &old_cert).expect("cert");
        std::fs::write(&key, &old_key).expect("key");
        let proxy = tls_proxy(&upstream, &old, &cert, &key).await;
        let renewal = Renewal {
            old,
            new,
            old_key,
            new_cert,
            new_key,
            cert,
            key,
            _dir: dir,
            _upstream: upstream,
        };
        (renewal, proxy)
    }
}

/// `systemctl reload` after a renewal: new connections get the new certificate, and a
/// connection opened before it keeps being served (a restart would have cut it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewed_certificate_is_served_after_sighup_and_open_connections_keep_theirs() {
    let (r, mut proxy) = Renewal::start().await;
    let mut before = handshake(served_by(&r.old, proxy.addr()).await).await;
    assert_eq!(status_on(&mut before, proxy.addr()).await, StatusCode::OK);

    std::fs::write(&r.cert, &r.new_cert).expect("renew cert");
    std::fs::write(&r.key, &r.new_key).expect("renew key");
    let line = proxy
        .reload_files(&[], "listener certificate reloaded")
        .await;
    assert!(
        line.contains("tls.crt") && line.contains("tls.key"),
        "{line}"
    );
    let mut after = handshake(served_by(&r.new, proxy.addr()).await).await;
    assert_eq!(status_on(&mut after, proxy.addr()).await, StatusCode::OK);
    assert_eq!(status_on(&mut before, proxy.addr()).await, StatusCode::OK);
    let stderr = proxy.finish().await;
    assert_no_key_bytes(&stderr, &[&r.old_key, &r.new_key]);
}

/// One request over a TLS connection made with `config` (its sessions kept for the next):
/// how the handshake went, and the leaf certificate served.
async fn one_request(
    config: &std::sync::Arc<rustls::ClientConfig>,
    addr: SocketAddr,
) -> (Option<rustls::HandshakeKind>, CertificateDer<'static>) {
    let connector = tokio_rustls::TlsConnector::from(config.clone());
    let tcp = TcpStream::connect(addr).await.expect("connect");
    let name = rustls_pki_types::ServerName::try_from("127.0.0.1").expect("server name");
    let tls = within("the TLS handshake", connector.connect(name, tcp))
        .await
        .expect("a handshake");
    let kind = tls.get_ref().1.handshake_kind();
    let leaf = tls.get_ref().1.peer_certificates().expect("a certificate")[0].clone();
    // The answer read: TLS 1.3 sends the session's ticket after the handshake.
    let mut client = handshake(tls).await;
    assert_eq!(status_on(&mut client, addr).await, StatusCode::OK);
    (kind, leaf)
}

/// A renewed pair begins the listener's TLS sessions afresh: a client that resumed its
/// session with the old certificate gets a full handshake, and the new certificate, after
/// the swap (TLS 1.2 session ids and TLS 1.3 tickets alike). Such sessions were resumed for
/// as long as the cache kept them, TLS 1.2's with no age limit, the rotated key's
/// certificate never shown again (nginx's sessions end with the reload).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewed_certificate_ends_the_resumption_of_older_sessions() {
    use rustls::HandshakeKind::{Full, Resumed};
    for version in [&rustls::version::TLS12, &rustls::version::TLS13] {
        let (r, mut proxy) = Renewal::start().await;
        let addr = proxy.addr();
        let mut roots = rustls::RootCertStore::empty();
        for pki in [&r.old, &r.new] {
            let ca = std::fs::read(&pki.ca_pem).expect("read ca.pem");
            for cert in CertificateDer::pem_slice_iter(&ca) {
                roots.add(cert.expect("CA PEM")).expect("add the CA");
            }
        }
        let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[version])
            .expect("protocol version")
            .with_root_certificates(roots)
            .with_no_client_auth();
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        let config = std::sync::Arc::new(config);
        let leaf = |pki: &Pki| CertificateDer::from_pem_file(pki.server_pem_files().0);
        let old = leaf(&r.old).expect("old leaf");
        assert_eq!(one_request(&config, addr).await, (Some(Full), old.clone()));
        assert_eq!(
            one_request(&config, addr).await.0,
            Some(Resumed),
            "{version:?}"
        );

        std::fs::write(&r.cert, &r.new_cert).expect("renew cert");
        std::fs::write(&r.key, &r.new_key).expect("renew key");
        proxy
            .reload_files(&[], "listener certificate reloaded")
            .await;
        let new = leaf(&r.new).expect("new leaf");
        assert_eq!(
            one_request(&config, addr).await,
            (Some(Full), new.clone()),
            "{version:?}"
        );
        // And the new pair's sessions resume.
        assert_eq!(
            one_request(&config, addr).await,
            (Some(Resumed), new),
            "{version:?}"
        );
        proxy.finish().await;
    }
}

/// cert-manager renews the mounted Secret as the kubelet writes it (a new `..data`
/// directory, swapped in by a link), and nothing in the pod sends a SIGHUP: the file
/// watch picks the pair up once two reads agree.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewed_certificate_is_picked_up_from_its_files_without_a_signal() {
    use std::os::unix::fs::symlink;
    let (old, new) = (Pki::new(), Pki::new());
    let upstream = Upstream::start(&old, Proto::Http1, |_req| async { response(200, "ok") }).await;
    let volume = tempfile::tempdir().expect("volume");
    let version = |name: &str, pki: &Pki| {
        let dir = volume.path().join(name);
        std::fs::create_dir(&dir).expect("version dir");
        let (cert, key) = pem_pair(pki);
        std::fs::write(dir.join("tls.crt"), cert).expect("cert");
        std::fs::write(dir.join("tls.key"), key).expect("key");
        let tmp = volume.path().join("..data_tmp");
        symlink(name, &tmp).expect("link");
        std::fs::rename(&tmp, volume.path().join("..data")).expect("swap ..data");
    };
    version("..v1", &old);
    let link = |file: &str| -> PathBuf {
        let path = volume.path().join(file);
        symlink(format!("..data/{file}"), &path).expect("file link");
        path
    };
    let (cert, key) = (link("tls.crt"), link("tls.key"));
    let mut proxy = tls_proxy(&upstream, &old, &cert, &key).await;
    served_by(&old, proxy.addr()).await;

    version("..v2", &new);
    proxy.wait_for_line("a watched file changed").await;
    proxy.wait_for_line("listener certificate reloaded").await;
    let mut client = handshake(served_by(&new, proxy.addr()).await).await;
    assert_eq!(status_on(&mut client, proxy.addr()).await, StatusCode::OK);
    proxy.finish().await;
}

/// A rotation that writes the certificate before the key, or a key caught half written,
/// is no pair: the certificate in use keeps serving, the warning names the file and why
/// (never the key), and the next reload with a valid pair applies it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pair_that_does_not_fit_keeps_the_certificate_in_use_until_a_valid_one_comes() {
    let (r, mut proxy) = Renewal::start().await;

    // The certificate renewed before its key, then the new key caught half written.
    let half_key = &r.new_key[..r.new_key.len() / 2];
    for (key_pem, reason) in [
        (&r.old_key[..], "does not belong"),
        (half_key, "no readable PEM private key"),
    ] {
        let files = [(r.cert.clone(), &r.new_cert[..]), (r.key.clone(), key_pem)];
        let line = proxy
            .reload_files(&files, "listener certificate reload failed")
            .await;
        assert!(line.contains("tls.key") && line.contains(reason), "{line}");
        served_by(&r.old, proxy.addr()).await;
    }

    let files = [(r.key.clone(), &r.new_key[..])];
    proxy
        .reload_files(&files, "listener certificate reloaded")
        .await;
    served_by(&r.new, proxy.addr()).await;
    let stderr = proxy.finish().await;
    assert_no_key_bytes(&stderr, &[&r.old_key, &r.new_key]);
}

/// A TLS ClientHello naming `sni` (and little else: the handshake fails after it is read).
fn client_hello(sni: &str) -> Vec<u8> {
    let name = sni.as_bytes();
    let len16 = |n: usize| u16::try_from(n).expect("short").to_be_bytes();
    let mut names = len16(3 + name.len()).to_vec();
    names.push(0); // host_name
    names.extend_from_slice(&len16(name.len()));
    names.extend_from_slice(name);
    let mut extensions = vec![0, 0]; // server_name
    extensions.extend_from_slice(&len16(names.len()));
    extensions.extend_from_slice(&names);
    let mut hello = vec![3, 3];
    hello.extend_from_slice(&[7; 32]);
    hello.extend_from_slice(&[0, 0, 2, 0x13, 0x01, 1, 0]);
    hello.extend_from_slice(&len16(extensions.len()));
    hello.extend_from_slice(&extensions);
    let mut handshake = vec![1];
    handshake.extend_from_slice(&u32::try_from(hello.len()).expect("short").to_be_bytes()[1..]);
    handshake.extend_from_slice(&hello);
    let mut record = vec![0x16, 3, 1];
    record.extend_from_slice(&len16(handshake.len()));
    record.extend_from_slice(&handshake);
    record
}

/// rustls warns of a malformed SNI name in a ClientHello: a line per handshake that any
/// client reaching the listener could repeat without end, in the log of a proxy at its
/// default level. Held to errors there, the failures counted; the proxy serves on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clients_malformed_sni_does_not_write_to_the_log() {
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |_r| async { response(200, "ok") }).await;
    // The default level, `info` given, and `info` from RUST_LOG (a container's way).
    for level in ["default", "flag", "RUST_LOG"] {
        let cmd = ProxyCmd::new(&upstream.url(), &pki).tls_listener(&pki);
        let cmd = match level {
            "flag" => cmd.log_level("info"),
            "RUST_LOG" => (cmd.omit(&["--log-level"])).env("RUST_LOG", Some("info")),
            _ => cmd.omit(&["--log-level"]),
        };
        sni_refused_quietly(&pki, cmd.spawn().await).await;
    }
}

async fn sni_refused_quietly(pki: &Pki, proxy: ProxyProc) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    for _ in 0..3 {
        let mut s = TcpStream::connect(proxy.addr()).await.expect("connect");
        s.write_all(&client_hello("x-.example"))
            .await
            .expect("hello");
        // The alert, then the end: the hello was read and refused.
        let mut answer = Vec::new();
        let _ = tokio::time::timeout(GUARD, s.read_to_end(&mut answer)).await;
        assert_eq!(answer.first(), Some(&0x15), "{answer:?}");
    }
    let mut served = handshake(served_by(pki, proxy.addr()).await).await;
    assert_eq!(status_on(&mut served, proxy.addr()).await, StatusCode::OK);
    // Counted instead, for the operator: a count that climbs after a renewal says that
    // clients refuse the certificate.
    // Waited for: the count follows the connection's close, which the client may see
    // first.
    let failures = "abx_proxy_tls_handshake_failures_total";
    let failed = wait_metric_at_least(proxy.admin_addr(), failures, 3.0).await;
    assert_eq!(failed, 3.0);
    let stderr = proxy.finish().await;
    assert!(!stderr.contains("SNI"), "{stderr}");
    assert!(!stderr.contains("rustls"), "{stderr}");
}

/// `check --offline` with this listener pair, in a cleared environment in `dir`.
fn check(
    dir: &std::path::Path,
    cert: &std::path::Path,
    key: &std::path::Path,
) -> std::process::Command {
    let mut check = std::process::Command::new(env!("CARGO_BIN_EXE_abx-proxy"));
    check
        .env_clear()
        .env("ABX_HOME", dir.join("home"))
        .env("ABX_SANDBOX_API_KEY", "sk-check-0123456789abcdef")
        .current_dir(dir)
        .args(["check", "--offline", "--tls-cert"])
        .arg(cert)
        .arg("--tls-key")
        .arg(key);
    check
}

/// A new self-signed pair for `localhost`, valid from 2020 to `not_after`, written to
/// `tls.crt` and `tls.key` in `dir`; their paths.
fn dated_pair(dir: &Path, not_after: time::OffsetDateTime) -> (PathBuf, PathBuf) {
    let key = rcgen::KeyPair::generate().expect("key");
    let mut params = rcgen::CertificateParams::new(vec!["localhost".into()]).expect("params");
    params.not_before = rcgen::date_time_ymd(2020, 1, 1);
    params.not_after = not_after;
    let cert = params.self_signed(&key).expect("certificate");
    let (cert_path, key_path) = (dir.join("tls.crt"), dir.join("tls.key"));
    std::fs::write(&cert_path, cert.pem()).expect("cert");
    std::fs::write(&key_path, key.serialize_pem()).expect("key");
    (cert_path, key_path)
}

/// A listener certificate that expired loads (as nginx serves one), but `check`, the start
/// and a reload that swaps one in say so with the date: every client that checks it
/// refuses the handshake, and the proxy sees no request to log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_listener_certificate_is_said_at_check_and_start() {
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |_r| async { response(200, "ok") }).await;
    let dir = tempfile::tempdir().expect("dir");
    let (cert_path, key_path) = dated_pair(dir.path(), rcgen::date_time_ymd(2021, 1, 1));
    let said = "the listener certificate (";
    let when = "expired at 2021-01-01T00:00:00Z";

    let out = output_within(check(dir.path(), &cert_path, &key_path), "check").await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(stderr.contains(said) && stderr.contains(when), "{stderr}");

    let mut proxy = tls_proxy(&upstream, &pki, &cert_path, &key_path).await;
    let started = proxy.stderr();
    assert!(
        started.contains(said) && started.contains(when),
        "{started}"
    );
    // Another expired pair swapped in: said again, after the swap.
    dated_pair(dir.path(), rcgen::date_time_ymd(2021, 1, 1));
    proxy.signal("HUP");
    proxy.wait_for_line("listener certificate reloaded").await;
    let line = proxy.wait_for_line(when).await;
    assert!(line.contains(said), "{line}");
    proxy.finish().await;
}

/// A certificate within a week of its end is said by `check`, and by a running proxy's
/// log as no scrape may (a proxy nobody scrapes had no word of it before handshakes
/// failed): that it nears its end, then that it passed it, each once, on the proxy's own
/// clock, with no signal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_near_its_end_is_said_and_so_is_its_passing() {
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |_r| async { response(200, "ok") }).await;
    let dir = tempfile::tempdir().expect("dir");
    // In whole seconds, as X.509 writes them; far enough ahead for the proxy to start
    // before it.
    let now = time::OffsetDateTime::now_utc();
    let end = now.replace_nanosecond(0).expect("a time") + time::Duration::seconds(10);
    let (cert_path, key_path) = dated_pair(dir.path(), end);
    let when = end
        .format(&time::format_description::well_known::Rfc3339)
        .expect("a date");
    let said = "the listener certificate (";

    let out = output_within(check(dir.path(), &cert_path, &key_path), "check").await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    let soon = format!("expires at {when} (in ");
    assert!(stderr.contains(said) && stderr.contains(&soon), "{stderr}");
    // With an expired certificate after it (a cross-sign left in the file): both said.
    let mut params = rcgen::CertificateParams::new(vec![]).expect("params");
    (params.distinguished_name).push(rcgen::DnType::CommonName, "old cross-sign");
    params.not_before = rcgen::date_time_ymd(2020, 1, 1);
    params.not_after = rcgen::date_time_ymd(2021, 1, 1);
    let key = rcgen::KeyPair::generate().expect("key");
    let expired = params.self_signed(&key).expect("certificate").pem();
    let both = tempfile::tempdir().expect("dir");
    let chain = both.path().join("tls.crt");
    let leaf = std::fs::read_to_string(&cert_path).expect("read");
    std::fs::write(&chain, leaf + &expired).expect("chain");
    let out = output_within(check(both.path(), &chain, &key_path), "check").await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    let cross = "certificate #2 of the listener's chain (";
    assert!(stderr.contains(cross) && stderr.contains(&soon), "{stderr}");

    let mut proxy = tls_proxy(&upstream, &pki, &cert_path, &key_path).await;
    let line = proxy.wait_for_line(&soon).await;
    assert!(line.contains(said) && line.contains("renew it"), "{line}");
    let line = proxy.wait_for_line(&format!("expired at {when}")).await;
    assert!(line.contains(said), "{line}");
    let stderr = proxy.finish().await;
    assert_eq!(stderr.matches(&soon).count(), 1, "{stderr}");
}

/// The listener certificate's expiry, or its issuer's before it when the file sends that
/// next (every client's path goes through it), is
/// `abx_proxy_listener_certificate_expiry_timestamp_seconds`, for an alert before
/// handshakes fail, set again by a reload that swaps a pair in; not another's in the file
/// (an expired cross-sign many clients never use). The chain is read whole for the
/// warning: a certificate after the leaf that expired is said, where only the leaf was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_expiry_metric_is_the_leafs_or_its_issuers_and_expired_chain_certificates_are_said() {
    const EXPIRY: &str = "abx_proxy_listener_certificate_expiry_timestamp_seconds";
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair};
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |_r| async { response(200, "ok") }).await;
    let dir = tempfile::tempdir().expect("dir");
    let (cert_path, key_path) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
    let params = |name: &str, until: (i32, u8, u8), ca: bool| {
        let sans = if ca {
            vec![]
        } else {
            vec!["localhost".to_string()]
        };
        let mut params = CertificateParams::new(sans).expect("params");
        params.distinguished_name.push(DnType::CommonName, name);
        if ca {
            params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        }
        params.not_before = rcgen::date_time_ymd(2020, 1, 1);
        params.not_after = rcgen::date_time_ymd(until.0, until.1, until.2);
        params
    };
    let key = KeyPair::generate().expect("key");
    let cert = (params("leaf", (2031, 5, 1), false).self_signed(&key)).expect("certificate");
    std::fs::write(&cert_path, cert.pem()).expect("cert");
    std::fs::write(&key_path, key.serialize_pem()).expect("key");
    let mut proxy = tls_proxy(&upstream, &pki, &cert_path, &key_path).await;
    let text = scrape(proxy.admin_addr()).await;
    // 2031-05-01T00:00:00Z
    assert_eq!(metric(&text, EXPIRY), Some(1_935_360_000.0), "{text}");

    let ca_key = KeyPair::generate().expect("key");
    let ca = (params("root", (2040, 1, 1), true).self_signed(&ca_key)).expect("CA");
    // A leaf good until 2030 under an intermediate good until `until`, with what else the
    // file sends between them; swapped in.
    let swap = |until: (i32, u8, u8), between: String| {
        let inter_key = KeyPair::generate().expect("key");
        let inter = params("intermediate", until, true)
            .signed_by(&inter_key, &ca, &ca_key)
            .expect("intermediate");
        let key = KeyPair::generate().expect("key");
        let cert = params("leaf", (2030, 6, 1), false)
            .signed_by(&key, &inter, &inter_key)
            .expect("leaf");
        let chain = format!("{}{between}{}", cert.pem(), inter.pem());
        std::fs::write(&cert_path, chain).expect("cert");
        std::fs::write(&key_path, key.serialize_pem()).expect("key");
    };
    // Its issuer ran out in 2021: on every client's path.
    swap((2021, 1, 1), String::new());
    proxy.signal("HUP");
    proxy.wait_for_line("listener certificate reloaded").await;
    let line = proxy.wait_for_line("expired at 2021-01-01T00:00:00Z").await;
    let said = [
        "certificate #2 of the listener's chain (",
        "goes through it",
    ];
    assert!(said.iter().all(|s| line.contains(s)), "{line}");
    let text = scrape(proxy.admin_addr()).await;
    assert_eq!(metric(&text, EXPIRY), Some(1_609_459_200.0), "{text}");

    // Its issuer good until 2029, after a cross-sign of another root that expired in 2021:
    // the one next to the leaf is not its issuer, and counts for nothing.
    let other_key = KeyPair::generate().expect("key");
    let other =
        (params("old cross-sign", (2021, 1, 1), true).self_signed(&other_key)).expect("another");
    swap((2029, 6, 1), other.pem());
    proxy.signal("HUP");
    proxy.wait_for_line("listener certificate reloaded").await;
    let line = proxy.wait_for_line("expired at 2021-01-01T00:00:00Z").await;
    assert!(line.contains("certificate #2 of"), "{line}");
    let text = scrape(proxy.admin_addr()).await;
    // 2030-06-01T00:00:00Z, the leaf's: not the cross-sign's 2021.
    assert_eq!(metric(&text, EXPIRY), Some(1_906_502_400.0), "{text}");
    proxy.finish().await;

    // No `--tls-cert` listener, no series.
    let plain = ProxyCmd::new(&upstream.url(), &pki).spawn().await;
    let text = scrape(plain.admin_addr()).await;
    assert!(!text.contains(EXPIRY), "{text}");
    plain.finish().await;
}

/// A TLS listener beyond loopback is taken without `--allow-remote` (SPEC §7), but TLS
/// checks no client: `check` says whoever reaches the port spends the key, until
/// `--allow-remote` says that is meant.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remote_tls_listener_without_consent_is_warned_about() {
    let dir = tempfile::tempdir().expect("dir");
    let key = rcgen::KeyPair::generate().expect("key");
    let params = rcgen::CertificateParams::new(vec!["proxy.example".into()]).expect("params");
    let cert = params.self_signed(&key).expect("certificate");
    let (cert_path, key_path) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
    std::fs::write(&cert_path, cert.pem()).expect("cert");
    std::fs::write(&key_path, key.serialize_pem()).expect("key");
    let said = "listening on 0.0.0.0:0, beyond this machine, with TLS: TLS encrypts the \
                connections but checks no client, and whoever reaches the port spends the key";
    for (consent, warned) in [(None, true), (Some("--allow-remote"), false)] {
        let mut check = check(dir.path(), &cert_path, &key_path);
        check.args(["--listen", "0.0.0.0:0"]).args(consent);
        let out = output_within(check, "check").await;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "{stderr}");
        assert_eq!(stderr.contains(said), warned, "{consent:?}: {stderr}");
    }
}

/// A keep-alive connection over TLS that goes idle is closed with TLS's close_notify, as
/// nginx's `keepalive_timeout` closes one: a bare end reads as a truncation to a client
/// that checks (rustls' does, below). Also when the idle timeout is the longer one, as
/// by default: hyper's own header timer, set to it, ran out on the same tick and ended
/// most such connections bare.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_tls_connection_is_closed_with_close_notify() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    // Several at once: which timer went first was a matter of a tick.
    const CONNECTIONS: usize = 4;
    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |_r| async { response(200, "ok") }).await;
    for args in [
        &["--idle-timeout", "1s"][..],
        &["--idle-timeout", "2s", "--header-timeout", "1s"],
    ] {
        let proxy = ProxyCmd::new(&upstream.url(), &pki)
            .tls_listener(&pki)
            .args(args)
            .spawn()
            .await;
        let ended = (0..CONNECTIONS).map(|_| async {
            let mut tls = served_by(&pki, proxy.addr()).await;
            let head = "GET /sandboxes HTTP/1.1\r\nHost: localhost\r\nX-API-Key: dummy\r\n\r\n";
            tls.write_all(head.as_bytes()).await.expect("request");
            // The answer, then, once the connection has been idle, its end.
            let mut seen = Vec::new();
            let end = tokio::time::timeout(GUARD, tls.read_to_end(&mut seen))
                .await
                .expect("closed within the guard");
            let text = String::from_utf8_lossy(&seen);
            assert!(text.starts_with("HTTP/1.1 200"), "{text}");
            end.map(|_| ()).map_err(|e| e.to_string())
        });
        for end in futures_util::future::join_all(ended).await {
            assert!(
                end.is_ok(),
                "{args:?}: closed without close_notify: {end:?}"
            );
        }
        proxy.finish().await;
    }
}
