//! The AK/SK token exchange (SPEC §5) against a fake endpoint that verifies signatures on
//! its own. Time is a manual clock shared by the fake and the credential source: real
//! sockets and a paused Tokio clock do not mix (the paused clock jumps to the next timer,
//! the per-call timeout, whenever the runtime waits on I/O).

mod support;

#[path = "support/fake_exchange.rs"]
mod fake_exchange;

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use abx_proxy::credentials::exchange::{
    BoxFuture, Clock, ExchangeConfig, ExchangeEvent, ExchangedKey, Exchanger, HttpExchanger,
    IssuedKey, RefreshOptions, CALL_TIMEOUT, REFUSAL_GAP,
};
use abx_proxy::proxy::headers::AuthScheme;
use abx_proxy::settings::{ExchangeScheme, UpstreamUrl};
use abx_proxy::upstream::{self, HttpClient, Versions};
use abx_proxy::{Error, Secret};
use fake_exchange::{FakeExchange, ManualClock, Mode, ACCESS_KEY_ID, ACCESS_KEY_SECRET, GUARD};
use tokio::sync::mpsc;

const SCHEMES: [ExchangeScheme; 2] = [ExchangeScheme::RpcV1, ExchangeScheme::Acs3];

fn client() -> HttpClient {
    let tls = upstream::tls_config(None).expect("tls config");
    upstream::client(
        tls,
        Versions::Negotiate,
        Duration::from_secs(5),
        CALL_TIMEOUT,
    )
}

fn config(url: &str, scheme: ExchangeScheme, secret: &str) -> ExchangeConfig {
    let url = UpstreamUrl::parse_named("token_exchange_url", url).expect("fake url");
    ExchangeConfig {
        shown_host: url.authority().to_string(),
        url,
        scheme,
        region: "cn-hangzhou".into(),
        access_key_id: ACCESS_KEY_ID.into(),
        access_key_secret: Secret::new(secret),
        token_ttl: Duration::from_secs(3600),
        refresh_before: Duration::from_secs(300),
        auth: AuthScheme::Bearer,
    }
}

struct Harness {
    clock: Arc<ManualClock>,
    fake: FakeExchange,
    source: Arc<ExchangedKey>,
    events: mpsc::UnboundedReceiver<ExchangeEvent>,
}

/// A fake and a source using it, on one manual clock; `prepare` runs before the source
/// starts its first exchange.
async fn harness(
    scheme: ExchangeScheme,
    refresh_before: Duration,
    prepare: impl FnOnce(&FakeExchange),
) -> Harness {
    let clock = ManualClock::new();
    let fake = FakeExchange::start(clock.clone()).await;
    prepare(&fake);
    let (tx, events) = mpsc::unbounded_channel();
    let options = RefreshOptions::new(refresh_before)
        .with_clock(clock.clone())
        .with_observer(Arc::new(move |e| {
            let _ = tx.send(e);
        }));
    let exchanger = HttpExchanger::new(config(&fake.url, scheme, ACCESS_KEY_SECRET), client());
    let source = Arc::new(ExchangedKey::with_exchanger(Arc::new(exchanger), options));
    Harness {
        clock,
        fake,
        source,
        events,
    }
}

impl Harness {
    /// Each next attempt fails, after a delay in the upper half of its step (in seconds).
    async fn assert_failures_back_off(&mut self, steps: &[u64]) {
        let mut last = self.now();
        for &step in steps {
            self.clock.advance_to_next_sleeper().await;
            assert_eq!(self.next_event().await, ExchangeEvent::Failure);
            let waited = self.now().duration_since(last).expect("forward");
            let step = Duration::from_secs(step);
            assert!(
                waited >= step / 2 && waited <= step,
                "waited {waited:?} for a {step:?} step"
            );
            last = self.now();
        }
    }

    /// The next event, which must be a successful exchange.
    async fn next_success(&mut self) {
        let event = self.next_event().await;
        let ExchangeEvent::Success { .. } = event else {
            panic!("{event:?}; fake rejections: {:?}", self.fake.rejections());
        };
    }

    async fn next_event(&mut self) -> ExchangeEvent {
        match tokio::time::timeout(GUARD, self.events.recv()).await {
            Ok(Some(e)) => e,
            _ => panic!(
                "no exchange event; fake rejections: {:?}",
                self.fake.rejections()
            ),
        }
    }

    fn now(&self) -> SystemTime {
        Clock::now(&*self.clock)
    }

    async fn key(&self) -> String {
        match self.source.current().await {
            Ok(k) => k.expose().to_string(),
            Err(e) => panic!("expected a key, got {}", e.line()),
        }
    }
}

#[tokio::test]
async fn both_schemes_are_accepted_by_the_verifying_fake() {
    for scheme in SCHEMES {
        let clock = ManualClock::new();
        let fake = FakeExchange::start(clock.clone()).await;
        fake.set_ttl(Some(Duration::from_secs(1800)));
        let ex = HttpExchanger::new(config(&fake.url, scheme, ACCESS_KEY_SECRET), client());
        let now = clock.now();
        let issued = ex
            .exchange_at(now)
            .await
            .unwrap_or_else(|e| panic!("{scheme:?}: {} {:?}", e.line(), fake.rejections()));
        assert_eq!(fake.accepted(), 1, "{scheme:?}");
        assert_eq!(fake.rejected(), 0, "{scheme:?}");
        assert_eq!(issued.key.expose(), fake.issued_keys()[0]);
        assert_eq!(issued.expires_at, now + Duration::from_secs(1800));
        let want = if scheme == ExchangeScheme::RpcV1 {
            "rpc-v1"
        } else {
            "acs3"
        };
        assert_eq!(fake.schemes(), vec![want]);

        // A fresh nonce per call: the fake refuses replays.
        ex.exchange_at(now).await.expect("second exchange");
        assert_eq!(fake.accepted(), 2);
    }
}

/// An endpoint below a path (a gateway's): ACS3 signs the whole path the server sees, the
/// prefix once, and an escape in it as the server reads it (it was encoded again).
#[tokio::test]
async fn acs3_below_a_path_prefix() {
    let clock = ManualClock::new();
    let fake = FakeExchange::start(clock.clone()).await;
    for (prefix, written) in [
        ("/gateway/v1", "/gateway/v1"),
        ("/gateway/v1", "/gateway/v1/"),
        ("/pre%20fix", "/pre%20fix"),
    ] {
        fake.set_path_prefix(prefix);
        let url = format!("{}{written}", fake.url);
        let ex = HttpExchanger::new(
            config(&url, ExchangeScheme::Acs3, ACCESS_KEY_SECRET),
            client(),
        );
        ex.exchange_at(clock.now())
            .await
            .unwrap_or_else(|e| panic!("{url}: {} {:?}", e.line(), fake.rejections()));
    }
    assert_eq!(fake.accepted(), 3);
}

#[tokio::test]
async fn no_expiry_in_the_answer_means_token_ttl() {
    let clock = ManualClock::new();
    let fake = FakeExchange::start(clock.clone()).await;
    fake.set_ttl(None);
    for scheme in SCHEMES {
        let ex = HttpExchanger::new(config(&fake.url, scheme, ACCESS_KEY_SECRET), client());
        let issued = ex.exchange_at(clock.now()).await.expect("exchange");
        assert_eq!(issued.expires_at, clock.now() + Duration::from_secs(3600));
    }
}

#[tokio::test]
async fn the_fake_rejects_a_wrong_signature() {
    let clock = ManualClock::new();
    let fake = FakeExchange::start(clock.clone()).await;
    for scheme in SCHEMES {
        let ex = HttpExchanger::new(config(&fake.url, scheme, "not-the-secret"), client());
        let e = ex
            .exchange_at(clock.now())
            .await
            .expect_err("must be refused");
        assert_eq!(e.code(), "E1004", "{scheme:?}: {}", e.line());
        assert!(e.to_string().contains("HTTP 400"), "{}", e.line());
        assert!(
            e.to_string().contains("SignatureDoesNotMatch"),
            "{}",
            e.line()
        );
        assert!(!e.to_string().contains("not-the-secret"));
    }
    assert_eq!(fake.rejected(), 2);
    assert_eq!(fake.accepted(), 0);
}

#[tokio::test]
async fn acs3_over_tls_with_a_custom_ca() {
    let clock = ManualClock::new();
    let fake = FakeExchange::start_tls(clock.clone()).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = dir.path().join("ca.pem");
    std::fs::write(&ca, fake.ca_pem.as_deref().expect("pem")).expect("write ca");
    let tls = upstream::tls_config(Some(&ca)).expect("tls config with CA");
    let client = upstream::client(
        tls,
        Versions::Negotiate,
        Duration::from_secs(5),
        CALL_TIMEOUT,
    );
    for scheme in SCHEMES {
        let ex = HttpExchanger::new(config(&fake.url, scheme, ACCESS_KEY_SECRET), client.clone());
        ex.exchange_at(clock.now())
            .await
            .unwrap_or_else(|e| panic!("{scheme:?}: {}", e.line()));
    }
    assert_eq!(fake.accepted(), 2);

    // Without the CA the certificate is not trusted.
    let ex = HttpExchanger::new(
        config(&fake.url, ExchangeScheme::Acs3, ACCESS_KEY_SECRET),
        self::client(),
    );
    let e = ex.exchange_at(clock.now()).await.expect_err("untrusted");
    assert_eq!(e.code(), "E5001", "{}", e.line());
}

#[tokio::test]
async fn unreachable_endpoint_is_e5001_for_check() {
    let addr = support::refused_addr().await;
    let url = format!("http://{addr}");
    let ex = HttpExchanger::new(
        config(&url, ExchangeScheme::RpcV1, ACCESS_KEY_SECRET),
        client(),
    );
    let e = ex
        .exchange_at(SystemTime::now())
        .await
        .expect_err("refused");
    assert_eq!(e.code(), "E5001", "{}", e.line());
    assert_eq!(e.exit_code(), 69);
    // The port too: the host alone does not say which of a machine's services is down.
    assert!(e.line().contains(&format!("({addr})")), "{}", e.line());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cold_start_with_500_concurrent_callers_makes_one_exchange() {
    for scheme in SCHEMES {
        let mut h = harness(scheme, Duration::from_secs(300), |f| f.hold()).await;
        h.fake.until_calls(1).await;
        let callers: Vec<_> = (0..500)
            .map(|_| {
                let source = Arc::clone(&h.source);
                tokio::spawn(async move { source.current().await })
            })
            .collect();
        // Every caller is parked on the startup wait (plus the refresher's call timeout).
        h.clock.until_sleepers(501).await;
        assert!(!h.source.ready());
        h.fake.release();
        let mut keys = Vec::new();
        for c in callers {
            let key = c.await.expect("join").expect("a key");
            keys.push(key.expose().to_string());
        }
        h.next_success().await;
        keys.dedup();
        assert_eq!(keys, h.fake.issued_keys(), "{scheme:?}");
        assert_eq!(h.fake.calls(), 1, "{scheme:?}");
        assert!(h.source.ready());
        assert_eq!(h.source.successes(), 1);
        assert_eq!(h.source.failures(), 0);
    }
}

/// An endpoint that issues keys of a few seconds (rpc-v1 lets it choose; a local clock
/// ahead of its own shortens them): each key was due for refresh at once, and the proxy
/// minted five a second for good. While keys stay that short, exchanges are spaced as
/// failed ones are, 1 s doubling to 30 s, and a request between keys is told why at once.
#[tokio::test]
async fn keys_issued_for_seconds_are_paced_like_failures() {
    // Due a quarter second after each exchange (half of the half second a key is handed
    // out), as soon as the first pause ends: each wake of the refresher is one exchange.
    let mut h = harness(ExchangeScheme::RpcV1, Duration::from_secs(300), |f| {
        f.set_ttl(Some(Duration::from_millis(5500)))
    })
    .await;
    let mut at = Vec::new();
    while at.len() < 8 {
        assert!(
            matches!(h.next_event().await, ExchangeEvent::Success { .. }),
            "{:?}",
            h.fake.rejections()
        );
        at.push(h.now());
        h.clock.until_sleepers(1).await;
        if at.len() < 8 {
            h.clock.advance_to_next_sleeper().await;
        }
    }
    let gaps: Vec<Duration> = at
        .windows(2)
        .map(|w| w[1].duration_since(w[0]).expect("forward"))
        .collect();
    assert!(gaps[0] <= Duration::from_secs(1), "{gaps:?}");
    // The seventh pause is the cap's: at least half of 30 s.
    assert!(gaps[6] >= Duration::from_secs(15), "{gaps:?}");
    assert_eq!(h.source.failures(), 0);
    // Past the last key's half second, inside the pause: a 503 that says why, not a wait
    // for an exchange the pause holds back.
    h.clock.advance(Duration::from_secs(1));
    let e = tokio::time::timeout(GUARD, h.source.current())
        .await
        .expect("a prompt answer")
        .expect_err("no usable key");
    assert_eq!(e.code(), "E1004", "{}", e.line());
    assert!(e.line().contains("paced"), "{}", e.line());
}

/// A key of 9 s is refreshed every 2 s, half of the 4 s it is handed out: it serves without
/// a gap, and is not paced as a key usable for under a second is.
#[tokio::test]
async fn keys_of_nine_seconds_are_not_paced() {
    let mut h = harness(ExchangeScheme::RpcV1, Duration::from_secs(300), |f| {
        f.set_ttl(Some(Duration::from_secs(9)))
    })
    .await;
    let start = h.now();
    for n in 0..6u32 {
        h.next_success().await;
        assert_eq!(h.now(), start + Duration::from_secs(2) * n);
        h.clock.until_sleepers(1).await;
        h.clock.advance_to_next_sleeper().await;
    }
}

/// A refresh begins with room for its exchange before the key stops being handed out.
/// Begun at that point, a key of 8 s lapsed at every refresh until the exchange answered
/// (503s and `/readyz` down every cycle, with every exchange a success).
#[tokio::test]
async fn a_short_keys_refresh_leaves_room_for_its_exchange() {
    let mut h = harness(ExchangeScheme::RpcV1, Duration::from_secs(300), |f| {
        f.set_ttl(Some(Duration::from_secs(8)))
    })
    .await;
    h.next_success().await;
    let start = h.now();
    let first = h.key().await;
    h.fake.hold();
    h.clock.until_sleepers(1).await;
    h.clock.advance_to_next_sleeper().await;
    h.fake.until_calls(2).await;
    // The exchange takes a second; the key in use serves meanwhile.
    h.clock.advance(Duration::from_secs(1));
    assert_eq!(h.key().await, first);
    h.fake.release();
    h.next_success().await;
    let handed_out_until = start + Duration::from_secs(3);
    assert!(h.now() < handed_out_until, "refreshed with room to spare");
    h.clock.advance_to(handed_out_until);
    assert_ne!(h.key().await, first);
}

#[tokio::test]
async fn refresh_happens_before_expiry_without_errors() {
    let mut h = harness(ExchangeScheme::Acs3, Duration::from_secs(10), |f| {
        f.set_ttl(Some(Duration::from_secs(20)))
    })
    .await;
    let start = h.now();
    let ExchangeEvent::Success { expiry_unix } = h.next_event().await else {
        panic!("first exchange failed: {:?}", h.fake.rejections());
    };
    let first = h.key().await;
    assert_eq!(h.source.expiry_unix(), Some(expiry_unix));

    // Nothing happens before the refresh point: min(10 s, 20 s / 2) before expiry.
    h.clock.advance(Duration::from_secs(9));
    assert_eq!(h.key().await, first);
    assert_eq!(h.fake.calls(), 1);

    h.clock.advance_to_next_sleeper().await;
    assert_eq!(h.now(), start + Duration::from_secs(10));
    // While the refresh is in flight, callers keep getting the current key.
    assert_eq!(h.key().await, first);
    let ExchangeEvent::Success {
        expiry_unix: second_expiry,
    } = h.next_event().await
    else {
        panic!("refresh failed");
    };
    assert_eq!(second_expiry, expiry_unix + 10);
    let second = h.key().await;
    assert_ne!(second, first);
    assert_eq!(h.fake.calls(), 2);
    assert_eq!(h.source.successes(), 2);
    assert_eq!(h.source.expiry_unix(), Some(second_expiry));

    // And again, 10 s later.
    h.clock.advance_to_next_sleeper().await;
    assert_eq!(h.now(), start + Duration::from_secs(20));
    h.next_success().await;
    assert_eq!(h.fake.calls(), 3);
    assert_eq!(h.source.failures(), 0);
}

/// The control plane refusing the key in use (revoked, or judged by a local clock behind
/// the endpoint's, so expired by the server's before ours) brings its refresh forward: the
/// next callers get a new key. A late refusal of a replaced key asks nothing, and a refused
/// new key waits for the gap, so 401s that are not about the key cost one exchange.
#[tokio::test]
async fn a_refused_key_is_replaced_early_at_most_once_per_gap() {
    let mut h = harness(ExchangeScheme::RpcV1, Duration::from_secs(300), |f| {
        f.set_ttl(Some(Duration::from_secs(3600)))
    })
    .await;
    h.next_success().await;
    let first = h.key().await;
    assert!(h.source.refused(&Secret::new(first.as_str())));
    h.next_success().await;
    let second = h.key().await;
    assert_ne!(second, first);
    assert_eq!(h.fake.calls(), 2);

    assert!(
        !h.source.refused(&Secret::new(first.as_str())),
        "a replaced key"
    );
    assert!(
        !h.source.refused(&Secret::new(second.as_str())),
        "within the gap"
    );
    h.clock.advance(REFUSAL_GAP);
    assert!(
        !h.source.refused(&Secret::new(first.as_str())),
        "a replaced key, after the gap too"
    );
    assert!(
        h.source.refused(&Secret::new(second.as_str())),
        "after the gap"
    );
    let ExchangeEvent::Success { expiry_unix } = h.next_event().await else {
        panic!("early refresh failed: {:?}", h.fake.rejections());
    };
    let third = h.key().await;
    assert_ne!(third, second);
    assert_eq!(h.fake.calls(), 3);

    // At its refresh point a key's refresh is due anyway: a refusal asks for nothing more.
    let expiry = UNIX_EPOCH + Duration::from_secs(u64::try_from(expiry_unix).unwrap());
    h.clock.advance_to(expiry - Duration::from_secs(300));
    assert!(
        !h.source.refused(&Secret::new(third.as_str())),
        "at the refresh point"
    );
}

/// A request the control plane refused with a temporary key is sent again with the key
/// that replaces it: the refresh its refusal asked for is waited for; a key replaced
/// already gives its successor at once; a refusal within the gap (not about the key) or an
/// endpoint failing in its backoff gives none, at once, and the 401 is the answer.
#[tokio::test]
async fn a_refused_keys_replacement_is_the_refresh_it_asked_for_or_none() {
    let mut h = harness(ExchangeScheme::RpcV1, Duration::from_secs(300), |f| {
        f.set_ttl(Some(Duration::from_secs(3600)))
    })
    .await;
    h.next_success().await;
    let first = h.key().await;
    assert!(h.source.refused(&Secret::new(first.as_str())));
    let second = replacement_of(&h.source, &first)
        .await
        .expect("the early refresh's key");
    assert_ne!(second, first);
    assert_eq!(h.fake.calls(), 2);
    assert_eq!(
        replacement_of(&h.source, &first).await,
        Some(second.clone()),
        "replaced"
    );
    assert!(!h.source.refused(&Secret::new(second.as_str())));
    assert_eq!(
        replacement_of(&h.source, &second).await,
        None,
        "within the gap"
    );

    h.clock.advance(REFUSAL_GAP);
    h.fake.set_mode(Mode::Fail500);
    assert!(h.source.refused(&Secret::new(second.as_str())));
    assert_eq!(
        replacement_of(&h.source, &second).await,
        None,
        "the refresh failed"
    );
    assert_eq!(h.fake.calls(), 3);
    h.next_success().await;
    assert_eq!(h.next_event().await, ExchangeEvent::Failure);
    assert_eq!(
        replacement_of(&h.source, &second).await,
        None,
        "in the backoff"
    );
    assert_eq!(h.fake.calls(), 3);
}

/// A retired source (a reload replaced the pair) has no refresh coming: a request refused
/// with its key gets no replacement from it, at once, even with a refresh begun (the
/// caller asks the successor), and a refusal asks for none.
#[tokio::test]
async fn a_retired_source_gives_no_replacement() {
    let mut h = harness(ExchangeScheme::RpcV1, Duration::from_secs(300), |f| {
        f.set_ttl(Some(Duration::from_secs(3600)))
    })
    .await;
    h.next_success().await;
    let first = h.key().await;
    h.fake.hold();
    assert!(h.source.refused(&Secret::new(first.as_str())));
    h.fake.until_calls(2).await;
    h.source.retire();
    assert_eq!(replacement_of(&h.source, &first).await, None);
    assert!(!h.source.refused(&Secret::new(first.as_str())));
    h.fake.release();
}

/// `source.replacement(key)`, which must answer without the (manual) clock moving.
async fn replacement_of(source: &ExchangedKey, key: &str) -> Option<String> {
    let found = tokio::time::timeout(GUARD, source.replacement(&Secret::new(key))).await;
    let found = found.expect("answered without time moving");
    found.map(|k| k.expose().to_string())
}

/// A key whose last usable second (5 s before its expiry) has come by the time its answer
/// is read is a failed exchange, never a key handed out.
#[tokio::test]
async fn a_key_that_ran_out_on_the_way_is_a_failed_exchange() {
    let mut h = harness(ExchangeScheme::RpcV1, Duration::from_secs(300), |f| {
        // Fresh enough when asked for (6 s from the request's time), used up on arrival.
        f.set_ttl(Some(Duration::from_secs(5)));
        f.hold();
    })
    .await;
    h.fake.until_calls(1).await;
    h.clock.advance(Duration::from_secs(1));
    h.fake.release();
    assert_eq!(h.next_event().await, ExchangeEvent::Failure);
    assert!(!h.source.ready());
    let e = h.source.current().await.expect_err("no usable key");
    assert!(
        e.line().contains("expired before it could be used"),
        "{}",
        e.line()
    );
}

/// A key that arrives already expired (a clock ahead of the endpoint's) says to look at the
/// clock, not at the AccessKey pair (still E1004). Each such answer created a key: retried
/// 30 s doubling to 2 minutes apart, not with the 1 s backoff of failures (which minted 120
/// to 240 keys an hour for as long as the clock stayed ahead).
#[tokio::test]
async fn a_key_that_arrives_expired_says_to_look_at_the_clock() {
    let mut h = harness(ExchangeScheme::RpcV1, Duration::from_secs(300), |f| {
        // Expiring within the 5 s margin of its issue: never usable.
        f.set_ttl(Some(Duration::from_secs(5)))
    })
    .await;
    assert_eq!(h.next_event().await, ExchangeEvent::Failure);
    h.assert_failures_back_off(&[30, 60, 120, 120, 120]).await;
    let e = h.source.current().await.expect_err("no usable key");
    assert_eq!(e.code(), "E1004", "{}", e.line());
    assert!(e.line().contains("already (nearly) past"), "{}", e.line());
    let said = e.suggestion().unwrap_or_default();
    assert!(said.contains("clock"), "{said}");
}

/// A retired source (a reload replaced the pair) or a dropped one stops refreshing: its
/// refresher is gone, and no exchange is made with the pair however far time moves.
#[tokio::test]
async fn a_retired_or_dropped_source_makes_no_more_exchanges() {
    for retire in [true, false] {
        let mut h = harness(ExchangeScheme::RpcV1, Duration::from_secs(300), |f| {
            f.set_ttl(Some(Duration::from_secs(3600)))
        })
        .await;
        h.next_success().await;
        h.clock.until_sleepers(1).await;
        if retire {
            h.source.retire();
        } else {
            drop(h.source);
        }
        let gone = async {
            while h.clock.live_sleepers() > 0 {
                tokio::task::yield_now().await;
            }
        };
        tokio::time::timeout(GUARD, gone)
            .await
            .unwrap_or_else(|_| panic!("retire {retire}: the refresher still sleeps"));
        // A control beside it, on the same clock and endpoint: its refresh done, the gone
        // one's would have been made too.
        let (tx, mut control_events) = mpsc::unbounded_channel();
        let options = RefreshOptions::new(Duration::from_secs(300))
            .with_clock(h.clock.clone())
            .with_observer(Arc::new(move |e| {
                let _ = tx.send(e);
            }));
        let config = config(&h.fake.url, ExchangeScheme::RpcV1, ACCESS_KEY_SECRET);
        let exchanger = HttpExchanger::new(config, client());
        let _control = ExchangedKey::with_exchanger(Arc::new(exchanger), options);
        for advance in [false, true] {
            if advance {
                h.clock.until_sleepers(1).await;
                h.clock.advance(Duration::from_secs(2 * 3600));
            }
            match tokio::time::timeout(GUARD, control_events.recv()).await {
                Ok(Some(ExchangeEvent::Success { .. })) => {}
                other => panic!("retire {retire}: the control's exchange: {other:?}"),
            }
        }
        assert_eq!(h.fake.calls(), 3, "retire {retire}: the control's two only");
        assert!(h.events.try_recv().is_err(), "retire {retire}: an exchange");
    }
}

/// A request that finds its key's refresh due wakes the refresher: after a suspend the
/// refresher's timer has not fired (it re-reads the clock only every 30 s), and the key
/// still works for a while, so nothing else would ask for the refresh in time.
#[tokio::test]
async fn a_request_past_the_refresh_point_wakes_the_refresher() {
    let mut h = harness(ExchangeScheme::RpcV1, Duration::from_secs(300), |f| {
        f.set_ttl(Some(Duration::from_secs(3600)))
    })
    .await;
    h.next_success().await;
    // No request before the jump: any earlier wake-up could carry the refresher over it.
    let first = h.fake.issued_keys()[0].clone();
    h.clock.until_sleepers(1).await;
    // Past the refresh point (5 min before expiry), still 4 min from the key's end.
    h.clock.jump(Duration::from_secs(3600 - 240));
    assert_eq!(h.key().await, first, "the key still works");
    h.next_success().await;
    assert_ne!(h.key().await, first);
    assert_eq!(h.fake.calls(), 2);
}

impl Harness {
    /// Refuses `key`; when that asks for a refresh, waits for it and returns the new key.
    async fn refuse(&mut self, key: &str) -> Option<String> {
        if !self.source.refused(&Secret::new(key)) {
            return None;
        }
        self.next_success().await;
        let new = self.key().await;
        assert_ne!(new, key);
        Some(new)
    }
}

/// A control plane that refuses every key (a region mismatch, a RAM policy denial) must not
/// have a key minted every 30 s: each exchange is a `CreateApiKey` nobody deletes. Early
/// refreshes in a row wait 30 s, 60 s, … up to an hour; a refresh on the key's own schedule
/// or a non-401 answer to the key in use ends the run.
#[tokio::test]
async fn refusals_in_a_row_back_off_until_a_scheduled_refresh_or_an_accepted_key() {
    const TTL: u64 = 86_400;
    let mut h = harness(ExchangeScheme::RpcV1, Duration::from_secs(300), |f| {
        f.set_ttl(Some(Duration::from_secs(TTL)))
    })
    .await;
    h.next_success().await;
    let first = h.key().await;
    let mut key = h
        .refuse(&first)
        .await
        .expect("the first refusal refreshes at once");
    let mut calls = 2;
    for gap in [30u64, 60, 120, 240, 480, 960, 1920, 3600, 3600] {
        let last = h.now();
        h.clock.advance_to(last + Duration::from_secs(gap - 1));
        assert_eq!(h.refuse(&key).await, None, "refused again within {gap}s");
        h.clock.advance_to(last + Duration::from_secs(gap));
        key = h
            .refuse(&key)
            .await
            .unwrap_or_else(|| panic!("no refresh after {gap}s"));
        calls += 1;
        assert_eq!(h.fake.calls(), calls);
    }

    // The key's own refresh point: the run is over, the next refusals start at 30 s again.
    let issued_at = h.now();
    h.clock
        .advance_to(issued_at + Duration::from_secs(TTL - 300));
    h.next_success().await;
    key = h.key().await;
    key = h
        .refuse(&key)
        .await
        .expect("first refusal after the scheduled refresh");
    h.clock.advance(REFUSAL_GAP);
    let replaced = key.clone();
    key = h
        .refuse(&key)
        .await
        .expect("the gap after a scheduled refresh is 30 s");

    // Two in a row again, so the next gap is 60 s. An answer to a replaced key tells
    // nothing; a non-401 answer to the key in use ends the run.
    h.source.accepted(&Secret::new(replaced.as_str()));
    h.clock.advance(REFUSAL_GAP);
    assert_eq!(
        h.refuse(&key).await,
        None,
        "a replaced key working proves nothing"
    );
    h.source.accepted(&Secret::new(key.as_str()));
    assert!(
        h.refuse(&key).await.is_some(),
        "the key in use worked: the next refusal waits only 30 s"
    );
}

/// A refresh that meets answers with unusable keys waits minutes between them, but tries
/// once more before the key in use runs out: a passing fault must not leave requests 503
/// for most of a 2-minute gap after the endpoint recovered.
#[tokio::test]
async fn unusable_answers_are_tried_again_before_the_key_in_use_runs_out() {
    let mut h = harness(ExchangeScheme::RpcV1, Duration::from_secs(300), |f| {
        f.set_ttl(Some(Duration::from_secs(600)))
    })
    .await;
    let start = h.now();
    h.next_success().await;
    let first = h.key().await;

    h.fake.set_mode(Mode::BadKey);
    h.clock.advance_to(start + Duration::from_secs(300)); // refresh due
    assert_eq!(h.next_event().await, ExchangeEvent::Failure);
    // 30, 60, 120 (each from the upper half of its step), but one try at 590 s, 5 s before
    // the key stops being sent at 595 s, whatever the gap drawn.
    let last_try = start + Duration::from_secs(590);
    while h.now() < last_try {
        h.clock.advance_to_next_sleeper().await;
        assert_eq!(h.next_event().await, ExchangeEvent::Failure);
        assert!(h.now() <= last_try, "{:?} past the key's last try", h.now());
    }
    assert_eq!(h.key().await, first);
    h.assert_failures_back_off(&[120]).await;
    h.fake.set_mode(Mode::Ok);
    h.clock.advance_to_next_sleeper().await;
    h.next_success().await;
    assert_ne!(h.key().await, first);
}

/// An ordinary failure between unusable answers (an endpoint that alternates) does not
/// start their gap again: only a success does.
#[tokio::test]
async fn other_failures_between_unusable_answers_keep_their_gap_growing() {
    let mut h = harness(ExchangeScheme::RpcV1, Duration::from_secs(300), |f| {
        f.set_mode(Mode::BadKey)
    })
    .await;
    assert_eq!(h.next_event().await, ExchangeEvent::Failure);
    h.fake.set_mode(Mode::Fail500);
    h.assert_failures_back_off(&[30]).await;
    h.fake.set_mode(Mode::BadKey);
    h.assert_failures_back_off(&[2]).await;
    // The second unusable answer in a row: 30-60 s, not the first's 15-30 s again.
    h.assert_failures_back_off(&[60, 120]).await;
}

#[tokio::test]
async fn failing_refresh_serves_the_old_key_until_5s_before_expiry_then_recovers() {
    let mut h = harness(ExchangeScheme::RpcV1, Duration::from_secs(10), |f| {
        f.set_ttl(Some(Duration::from_secs(20)))
    })
    .await;
    let start = h.now();
    h.next_success().await;
    let first = h.key().await;

    h.fake.set_mode(Mode::Fail500);
    h.clock.advance_to_next_sleeper().await; // t = 10 s: refresh due
    assert_eq!(h.next_event().await, ExchangeEvent::Failure);
    assert_eq!(h.key().await, first);

    // Just before the margin: one retry (the first backoff is at most 1 s) and still the old key.
    h.clock
        .advance_to(start + Duration::from_secs(15) - Duration::from_millis(1));
    assert_eq!(h.next_event().await, ExchangeEvent::Failure);
    assert_eq!(h.key().await, first);
    assert!(h.source.ready());

    // 5 s before expiry the old key is no longer handed out.
    h.clock.advance_to(start + Duration::from_secs(15));
    let e = h.source.current().await.expect_err("key past its margin");
    assert_eq!(e.code(), "E1004", "{}", e.line());
    assert_eq!(e.http_status(), 503);
    assert!(e.to_string().contains("HTTP 500"), "{}", e.line());
    assert!(e.to_string().contains("InternalError"), "{}", e.line());
    assert!(!h.source.ready());

    // Retries continue with growing delays; once the endpoint is back, so is the key.
    h.fake.set_mode(Mode::Ok);
    h.clock.advance_to_next_sleeper().await;
    h.next_success().await;
    let second = h.key().await;
    assert_ne!(second, first);
    assert!(h.source.ready());
    assert_eq!(h.source.failures(), 2);
    assert_eq!(h.source.successes(), 2);
    assert_eq!(h.fake.calls(), 4);
}

/// The lines a subscriber writes, for a test that reads the refresher's own log lines.
#[derive(Clone, Default)]
struct Lines(Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Lines {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Lines {
    /// The "token exchange failed" lines so far.
    fn failures(&self) -> Vec<String> {
        let text = String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned();
        (text.lines())
            .filter(|l| l.contains("token exchange failed"))
            .map(str::to_string)
            .collect()
    }
}

/// Each "token exchange failed" line says, in `key=`, whether the key in use still serves
/// (`key_in_use` given the stored key, the refusal streak and the source's own clock): a
/// refused key still valid, a key still valid, none once the source's clock passed its
/// margin (by the wall clock it is valid for an hour more). The refresher logs on this
/// test's thread (a current-thread runtime), so a subscriber set here sees its lines, and
/// each is written before the refresher next waits, so before its event is read here.
#[tokio::test]
async fn a_failures_line_says_whether_the_key_in_use_still_serves() {
    let lines = Lines::default();
    let writer = lines.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .finish();
    // r1 experiment: a second live dispatcher, so callsites first hit on other threads
    // consult every registered dispatcher (tracing-core's one-dispatcher shortcut asks only
    // the registering thread's default).
    let _second = tracing::Dispatch::new(tracing_subscriber::registry());
    let _logs = tracing::subscriber::set_default(subscriber);
    let mut h = harness(ExchangeScheme::RpcV1, Duration::from_secs(300), |f| {
        f.set_ttl(Some(Duration::from_secs(3600)))
    })
    .await;
    h.next_success().await;
    let key = h.key().await;
    let issued_at = h.now();
    // A test elsewhere in this binary may have reached the line first, with no subscriber
    // anywhere, and left it disabled: asked again, now that this one exists.
    tracing::callsite::rebuild_interest_cache();
    h.fake.set_mode(Mode::Fail500);

    // Refused by the control plane: the early refresh fails.
    assert!(h.source.refused(&Secret::new(key.as_str())));
    assert_eq!(h.next_event().await, ExchangeEvent::Failure);
    // Accepted again: the refusals end, the retries go on.
    h.source.accepted(&Secret::new(key.as_str()));
    h.clock.advance_to_next_sleeper().await;
    assert_eq!(h.next_event().await, ExchangeEvent::Failure);
    // Past the 5 s margin by the source's clock.
    h.clock
        .advance_to(issued_at + Duration::from_secs(3600 - 5));
    assert_eq!(h.next_event().await, ExchangeEvent::Failure);

    let said = lines.failures();
    assert_eq!(said.len(), 3, "{said:#?}");
    let wants = [
        "key=refused by the control plane",
        "key=usable until ",
        "key=none usable: requests are answered 503",
    ];
    for (line, want) in said.iter().zip(wants) {
        assert!(line.contains(want), "want {want:?} in: {line}");
    }
    assert!(
        !said.iter().any(|l| l.contains(key.as_str())),
        "the key in a line: {said:#?}"
    );
}

#[tokio::test]
async fn retries_back_off_exponentially() {
    let mut h = harness(ExchangeScheme::RpcV1, Duration::from_secs(300), |f| {
        f.set_mode(Mode::Fail500)
    })
    .await;
    assert_eq!(h.next_event().await, ExchangeEvent::Failure);
    h.assert_failures_back_off(&[1, 2, 4, 8, 16, 30, 30]).await;
}

/// An answer with more in it than the key is read whole up to 64 KiB; a larger one is
/// refused as no answer this proxy can use.
#[tokio::test]
async fn answers_are_read_up_to_64_kib() {
    let clock = ManualClock::new();
    let fake = FakeExchange::start(clock.clone()).await;
    let ex = HttpExchanger::new(
        config(&fake.url, ExchangeScheme::RpcV1, ACCESS_KEY_SECRET),
        client(),
    );
    fake.set_padding(60 * 1024);
    let issued = ex.exchange_at(clock.now()).await.expect("a 60 KiB answer");
    assert_eq!(issued.key.expose(), fake.issued_keys()[0]);

    fake.set_padding(64 * 1024);
    let e = ex.exchange_at(clock.now()).await.expect_err("over 64 KiB");
    assert_eq!(e.code(), "E1004", "{}", e.line());
    assert!(
        e.to_string()
            .ends_with("HTTP 200: the answer is over 64 KiB"),
        "{}",
        e.line()
    );
}

/// A gateway's error page for an outage can be long: over 64 KiB it is still the endpoint
/// unavailable, by its status (`check` exits 69), not an answer that cannot be used (it was
/// E1004, exit 78, with the advice to check the AccessKey pair).
#[tokio::test]
async fn a_long_error_page_for_an_outage_is_the_endpoint_unavailable() {
    let clock = ManualClock::new();
    let fake = FakeExchange::start(clock.clone()).await;
    let ex = HttpExchanger::new(
        config(&fake.url, ExchangeScheme::RpcV1, ACCESS_KEY_SECRET),
        client(),
    );
    for (status, code) in [(502, "E5001"), (429, "E5001"), (403, "E1004")] {
        fake.set_mode(Mode::GatewayPage(status));
        let e = ex.exchange_at(clock.now()).await.expect_err("a page");
        assert_eq!(e.code(), code, "{status}: {}", e.line());
        let over = format!("HTTP {status}: the answer is over 64 KiB");
        assert!(e.to_string().contains(&over), "{}", e.line());
    }
}

#[tokio::test]
async fn no_key_ever_obtained_is_e1004() {
    let h = harness(ExchangeScheme::Acs3, Duration::from_secs(300), |f| {
        f.set_mode(Mode::Fail500)
    })
    .await;
    let e = h.source.current().await.expect_err("no key");
    assert_eq!(e.code(), "E1004", "{}", e.line());
    assert!(!h.source.ready());
    assert_eq!(h.source.expiry_unix(), None);
}

#[tokio::test]
async fn a_hanging_endpoint_fails_the_waiting_callers_after_the_call_timeout() {
    let mut h = harness(ExchangeScheme::RpcV1, Duration::from_secs(300), |f| {
        f.set_mode(Mode::Hang)
    })
    .await;
    h.fake.until_calls(1).await;
    let source = Arc::clone(&h.source);
    let caller = tokio::spawn(async move { source.current().await });
    // The attempt's backstop (a second after the exchanger's own 10 s bound) and the 30 s
    // startup wait.
    h.clock.until_sleepers(2).await;
    assert!(!caller.is_finished());
    h.clock.advance(Duration::from_secs(11));
    assert_eq!(h.next_event().await, ExchangeEvent::Failure);
    let e = caller.await.expect("join").expect_err("no key");
    assert_eq!(e.code(), "E1004", "{}", e.line());
    assert!(
        e.to_string().contains("no answer within 11s"),
        "{}",
        e.line()
    );
}

#[tokio::test]
async fn clock_skew_answer_is_e1002() {
    let h = harness(ExchangeScheme::Acs3, Duration::from_secs(300), |f| {
        f.set_mode(Mode::ClockSkew)
    })
    .await;
    let e = h.source.current().await.expect_err("skew");
    assert_eq!(e.code(), "E1002", "{}", e.line());
    assert!(e.render().contains("Synchronise the system clock"));

    // A real skew: this machine's clock an hour ahead of the endpoint's.
    let endpoint_clock = ManualClock::new();
    let fake = FakeExchange::start(endpoint_clock.clone()).await;
    for scheme in SCHEMES {
        let ex = HttpExchanger::new(config(&fake.url, scheme, ACCESS_KEY_SECRET), client());
        let ahead = endpoint_clock.now() + Duration::from_secs(3600);
        let e = ex.exchange_at(ahead).await.expect_err("skewed");
        assert_eq!(e.code(), "E1002", "{scheme:?}: {}", e.line());
        // How far, and which way, from the answer's `Date`.
        let said = "this machine's clock is about 1 h ahead of the endpoint's";
        assert!(e.line().contains(said), "{scheme:?}: {}", e.line());
    }
}

/// This machine's clock behind the endpoint's: a stated expiry is a time by the endpoint's
/// clock, which comes later here, and each key went out after it had expired there (every
/// request with a body then failing on the control plane's 401). Its life counts from the
/// answer's arrival instead. Ahead, or within a slow answer's time, nothing moves; nor
/// when the `Date` would leave the key no life (a gateway's clock, not the issuer's).
#[tokio::test]
async fn a_clock_behind_the_endpoints_counts_a_keys_life_from_its_arrival() {
    let endpoint_clock = ManualClock::new();
    let fake = FakeExchange::start(endpoint_clock.clone()).await;
    for scheme in SCHEMES {
        let ex = HttpExchanger::new(config(&fake.url, scheme, ACCESS_KEY_SECRET), client());
        for (behind, life) in [(100, 3600), (3, 3603), (0, 3600)] {
            let now = endpoint_clock.now() - Duration::from_secs(behind);
            let issued = ex.exchange_at(now).await.expect("exchange");
            let lives = issued.expires_at.duration_since(now).expect("after");
            let expected = Duration::from_secs(life);
            assert!(
                lives >= expected && lives < expected + Duration::from_secs(2),
                "{scheme:?}, {behind} s behind: {lives:?}"
            );
        }
        // A `Date` that leaves the key no life: not believed, the stated time kept.
        fake.set_ttl(Some(Duration::from_secs(4)));
        let now = endpoint_clock.now() - Duration::from_secs(100);
        let issued = ex.exchange_at(now).await.expect("exchange");
        let lives = issued.expires_at.duration_since(now).expect("after");
        assert_eq!(lives, Duration::from_secs(104), "{scheme:?}");
        fake.set_ttl(Some(Duration::from_secs(3600)));
    }
}

#[tokio::test]
async fn secrets_and_keys_never_show_in_debug_or_errors() {
    let mut h = harness(ExchangeScheme::Acs3, Duration::from_secs(10), |f| {
        f.set_ttl(Some(Duration::from_secs(20)))
    })
    .await;
    h.next_success().await;
    let key = h.key().await;
    let cfg = config(&h.fake.url, ExchangeScheme::RpcV1, ACCESS_KEY_SECRET);
    let ex = HttpExchanger::new(cfg.clone(), client());
    let issued = ex.exchange_at(h.now()).await.expect("exchange");

    h.fake.set_mode(Mode::Fail500);
    h.clock.advance(Duration::from_secs(15));
    let err: Error = h.source.current().await.expect_err("expired");

    let texts = [
        format!("{:?}", h.source),
        format!("{cfg:?}"),
        format!("{ex:?}"),
        format!("{issued:?}"),
        format!("{err:?}"),
        err.render(),
        err.json_body(),
    ];
    let secrets: Vec<String> = h
        .fake
        .issued_keys()
        .into_iter()
        .chain([key, ACCESS_KEY_SECRET.to_string()])
        .collect();
    for text in &texts {
        for secret in &secrets {
            assert!(!text.contains(secret.as_str()), "{text} leaks {secret}");
        }
    }
    // And they still say what is there, the secret aside.
    assert!(texts[0].contains("successes: 1"), "{}", texts[0]);
    for text in &texts[1..3] {
        assert!(text.contains(ACCESS_KEY_ID), "{text}");
    }
    assert!(texts[2].contains("hostname: \""), "{}", texts[2]);
    let options = format!("{:?}", RefreshOptions::new(Duration::from_secs(300)));
    assert!(options.contains("refresh_before: 300s"), "{options}");
}

/// A key no HTTP header can carry is a failed exchange, not a success that makes /readyz
/// say 200 while every request gets a 503 until the next refresh; the value is never echoed.
#[tokio::test]
async fn a_key_that_cannot_be_a_header_value_is_a_failed_exchange() {
    let clock = ManualClock::new();
    let fake = FakeExchange::start(clock.clone()).await;
    fake.set_mode(Mode::BadKey);
    let ex = HttpExchanger::new(
        config(&fake.url, ExchangeScheme::RpcV1, ACCESS_KEY_SECRET),
        client(),
    );
    let e = ex.exchange_at(clock.now()).await.expect_err("unusable key");
    assert_eq!(e.code(), "E1004", "{}", e.line());
    assert_eq!(e.exit_code(), 78);
    assert!(e.to_string().contains("header value"), "{}", e.line());

    let mut h = harness(ExchangeScheme::RpcV1, Duration::from_secs(300), |f| {
        f.set_mode(Mode::BadKey)
    })
    .await;
    assert_eq!(h.next_event().await, ExchangeEvent::Failure);
    assert!(!h.source.ready());
    assert_eq!(h.source.failures(), 1);
    let e = h.source.current().await.expect_err("no usable key");
    assert_eq!(e.code(), "E1004", "{}", e.line());
    for text in [e.line(), e.render(), e.json_body(), format!("{e:?}")] {
        assert!(
            !text.contains("tmpkey") && !text.contains("abcdef"),
            "{text}"
        );
    }

    // Retried 30 s later, not after a second's backoff: the endpoint created a key for each
    // such answer. Once it issues a usable key, that is served.
    let failed_at = h.now();
    h.fake.set_mode(Mode::Ok);
    h.clock.advance_to_next_sleeper().await;
    h.next_success().await;
    let waited = h.now().duration_since(failed_at).expect("forward");
    assert!(
        waited >= Duration::from_secs(15) && waited <= Duration::from_secs(30),
        "{waited:?}"
    );
    assert!(h.source.ready());
    assert_eq!(h.key().await, h.fake.issued_keys()[0]);
}

/// Throttling is the endpoint saying "not now": `check` exits 69 as for a 5xx, not 78 as
/// for a configuration error, and the refresher retries with the same backoff.
#[tokio::test]
async fn throttling_is_unavailable_not_a_configuration_error() {
    let clock = ManualClock::new();
    let fake = FakeExchange::start(clock.clone()).await;
    fake.set_mode(Mode::Throttle);
    for scheme in SCHEMES {
        let ex = HttpExchanger::new(config(&fake.url, scheme, ACCESS_KEY_SECRET), client());
        let e = ex.exchange_at(clock.now()).await.expect_err("throttled");
        assert_eq!(e.code(), "E5001", "{scheme:?}: {}", e.line());
        assert_eq!(e.exit_code(), 69, "{scheme:?}");
        // It answered: throttling, not out of reach.
        assert!(
            e.to_string()
                .starts_with("upstream unavailable: the endpoint answered HTTP 429"),
            "{}",
            e.line()
        );
        assert!(e.to_string().contains("Throttling.User"), "{}", e.line());
    }

    let mut h = harness(ExchangeScheme::Acs3, Duration::from_secs(300), |f| {
        f.set_mode(Mode::Throttle)
    })
    .await;
    assert_eq!(h.next_event().await, ExchangeEvent::Failure);
    let e = h.source.current().await.expect_err("throttled");
    assert_eq!(e.code(), "E1004", "{}", e.line());
    assert_eq!(e.http_status(), 503);
    let mut last = h.now();
    for step in [1u64, 2] {
        h.clock.advance_to_next_sleeper().await;
        assert_eq!(h.next_event().await, ExchangeEvent::Failure);
        let waited = h.now().duration_since(last).expect("forward");
        let step = Duration::from_secs(step);
        assert!(waited >= step / 2 && waited <= step, "waited {waited:?}");
        last = h.now();
    }
    h.fake.set_mode(Mode::Ok);
    h.clock.advance_to_next_sleeper().await;
    h.next_success().await;
    assert!(h.source.ready());
}

/// The endpoint's error code is said, but not a secret it repeats: a gateway answering
/// `InvalidAccessKeySecret.<the secret>` put it in every client's 503 and the log; so did
/// one that spelled it with a JSON escape.
#[tokio::test]
async fn an_error_code_that_repeats_the_secret_is_said_without_it() {
    let clock = ManualClock::new();
    let fake = FakeExchange::start(clock.clone()).await;
    for (mode, code, prefix) in [
        (Mode::EchoSecret(400), "E1004", "InvalidAccessKeySecret."),
        (Mode::EchoSecret(429), "E5001", "Throttling."),
        (Mode::EchoSecretEscaped, "E1004", "InvalidAccessKeySecret."),
    ] {
        fake.set_mode(mode);
        for scheme in SCHEMES {
            let ex = HttpExchanger::new(config(&fake.url, scheme, ACCESS_KEY_SECRET), client());
            let e = ex.exchange_at(clock.now()).await.expect_err("refused");
            assert_eq!(e.code(), code, "{scheme:?}: {}", e.line());
            let line = e.line();
            assert!(line.contains(prefix), "{line}");
            for part in ACCESS_KEY_SECRET.as_bytes().chunks(8) {
                let part = std::str::from_utf8(part).expect("ascii");
                assert!(part.len() < 8 || !line.contains(part), "{line}");
            }
        }
    }
}

/// An exchanger with a bug: the first call panics before its future exists, the second
/// inside it; later calls go to the real exchange.
struct PanicsTwice {
    inner: HttpExchanger,
    calls: std::sync::atomic::AtomicUsize,
}

impl Exchanger for PanicsTwice {
    fn exchange(&self, now: SystemTime) -> BoxFuture<'_, Result<IssuedKey, Error>> {
        match self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst) {
            0 => panic!("test: exchanger bug before the future"),
            1 => Box::pin(async { panic!("test: exchanger bug inside the future") }),
            _ => self.inner.exchange(now),
        }
    }
}

async fn next(events: &mut mpsc::UnboundedReceiver<ExchangeEvent>) -> ExchangeEvent {
    tokio::time::timeout(GUARD, events.recv())
        .await
        .ok()
        .flatten()
        .expect("an exchange event")
}

/// A panic in one attempt is a failed exchange, retried with backoff: nothing watches the
/// refresher, and a task that died would stop refreshing silently.
#[tokio::test]
async fn a_panicking_attempt_is_a_failed_exchange_and_is_retried() {
    let clock = ManualClock::new();
    let fake = FakeExchange::start(clock.clone()).await;
    let (tx, mut events) = mpsc::unbounded_channel();
    let options = RefreshOptions::new(Duration::from_secs(300))
        .with_clock(clock.clone())
        .with_observer(Arc::new(move |e| {
            let _ = tx.send(e);
        }));
    let exchanger = PanicsTwice {
        inner: HttpExchanger::new(
            config(&fake.url, ExchangeScheme::RpcV1, ACCESS_KEY_SECRET),
            client(),
        ),
        calls: Default::default(),
    };
    let source = ExchangedKey::with_exchanger(Arc::new(exchanger), options);
    assert_eq!(next(&mut events).await, ExchangeEvent::Failure);
    let e = source.current().await.expect_err("no key yet");
    assert_eq!(e.code(), "E1004", "{}", e.line());
    assert!(!source.ready());

    clock.advance_to_next_sleeper().await;
    assert_eq!(next(&mut events).await, ExchangeEvent::Failure);
    clock.advance_to_next_sleeper().await;
    assert!(matches!(
        next(&mut events).await,
        ExchangeEvent::Success { .. }
    ));
    assert!(source.ready());
    assert_eq!(source.failures(), 2);
    assert_eq!(source.successes(), 1);
    assert_eq!(fake.accepted(), 1);
}

/// A laptop that slept past its key's expiry: the wall clock moved on, the refresher's
/// timers did not run. A request then found the key expired and got 503 E1004 at once,
/// until the refresh it had just asked for landed. With no failed refresh behind the
/// expiry it now waits for that refresh (bounded, as a request at startup waits for the
/// first exchange); after a failed one, 503 at once as before.
#[tokio::test]
async fn a_key_that_ran_out_while_the_machine_slept_waits_for_its_refresh() {
    let mut h = harness(ExchangeScheme::Acs3, Duration::from_secs(300), |f| {
        f.set_ttl(Some(Duration::from_secs(3600)))
    })
    .await;
    let first = h.key().await;
    h.next_success().await;
    h.fake.hold();
    h.clock.advance(Duration::from_secs(5 * 3600));
    // The refresher woke and its exchange is at the fake, held: the request must wait.
    h.fake.until_calls(2).await;
    let waiting = {
        let source = h.source.clone();
        tokio::spawn(async move { source.current().await })
    };
    h.fake.release();
    let key = match tokio::time::timeout(GUARD, waiting).await {
        Ok(Ok(Ok(key))) => key.expose().to_string(),
        Ok(Ok(Err(e))) => panic!("a request after the sleep: {}", e.line()),
        other => panic!("a request after the sleep: {other:?}"),
    };
    assert_ne!(key, first);
    assert_eq!(h.fake.issued_keys(), [first.clone(), key.clone()]);

    // A refresh that failed: 503 at once, the endpoint's reason named.
    h.fake.set_mode(Mode::Fail500);
    h.clock.advance(Duration::from_secs(5 * 3600));
    loop {
        if let ExchangeEvent::Failure = h.next_event().await {
            break;
        }
    }
    match h.source.current().await {
        Ok(_) => panic!("an expired key was handed out"),
        Err(e) => assert!(e.line().contains("E1004"), "{}", e.line()),
    }
}

/// The other side of the wait above: a refresh that began on time and is still under way
/// when the key stops being handed out is slow, not late. A request then gets 503 E1004
/// at once rather than waiting up to 10 s with the endpoint; the refresh, when it lands,
/// serves the next one.
#[tokio::test]
async fn a_key_that_ran_out_during_a_slow_refresh_begun_on_time_is_refused_at_once() {
    let mut h = harness(ExchangeScheme::Acs3, Duration::from_secs(6), |f| {
        f.set_ttl(Some(Duration::from_secs(3600)))
    })
    .await;
    let ExchangeEvent::Success { expiry_unix } = h.next_event().await else {
        panic!("first exchange failed: {:?}", h.fake.rejections());
    };
    let first = h.key().await;
    let expiry = UNIX_EPOCH + Duration::from_secs(u64::try_from(expiry_unix).unwrap());
    h.fake.hold();
    // The refresh point: 6 s before expiry, brought forward to leave the exchange 5 s
    // before the key stops being handed out (5 s before expiry). It starts on time and
    // is held.
    h.clock.advance_to(expiry - Duration::from_secs(10));
    h.fake.until_calls(2).await;
    // 4 s before expiry: past the 5 s margin, the refresh still under way.
    h.clock.advance(Duration::from_secs(6));
    match tokio::time::timeout(GUARD, h.source.current()).await {
        Ok(Err(e)) => {
            assert_eq!(e.code(), "E1004", "{}", e.line());
            assert!(e.line().contains("has expired"), "{}", e.line());
        }
        Ok(Ok(_)) => panic!("a key within 5 s of its expiry was handed out"),
        Err(_) => panic!("the request waited for a refresh begun on time"),
    }
    h.fake.release();
    h.next_success().await;
    let second = h.key().await;
    assert_ne!(second, first);
}

/// SPEC §5: a temporary key is never sent later than 5 s before its expiry. The control
/// plane took the key before reading a rewritten request's body (`POST /v2/sandboxes`,
/// which may take up to --upstream-timeout): a client slow to send it, or a laptop asleep
/// meanwhile, had the key go upstream after its expiry. The key is taken once the body is
/// in: a fresh one, or 503 while there is none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_is_taken_after_a_rewritten_body_so_it_never_goes_out_expired() {
    use abx_proxy::credentials::ApiCredential;
    use abx_proxy::metrics::Metrics;
    use abx_proxy::proxy::{body, Options, Proxy};
    use abx_proxy::settings::{FlagValue, Inputs, Key, Resolved};
    use bytes::Bytes;
    use support::{response, within, ChannelBody, Pki, Proto, Upstream};

    let clock = ManualClock::new();
    let fake = FakeExchange::start(clock.clone()).await;
    fake.set_ttl(Some(Duration::from_secs(3600)));
    let options = RefreshOptions::new(Duration::from_secs(300)).with_clock(clock.clone());
    let exchanger = HttpExchanger::new(
        config(&fake.url, ExchangeScheme::Acs3, ACCESS_KEY_SECRET),
        client(),
    );
    let key = ExchangedKey::with_exchanger(Arc::new(exchanger), options);
    let first = match key.current().await {
        Ok(k) => k.expose().to_string(),
        Err(e) => panic!("the first key: {}", e.line()),
    };

    let pki = Pki::new();
    let upstream = Upstream::start(&pki, Proto::Http1, |_req| async { response(200, "{}") }).await;
    let cwd = tempfile::tempdir().expect("cwd");
    let inputs = Inputs {
        flags: [
            (
                Key::SandboxApiKey,
                FlagValue::Secret(Secret::new("sk-unused")),
            ),
            (Key::SandboxBaseUrl, FlagValue::Plain(upstream.url())),
        ]
        .into(),
        cwd: cwd.path().to_path_buf(),
        ..Inputs::default()
    };
    let settings = Resolved::from_inputs(&inputs)
        .and_then(|r| r.validate())
        .unwrap_or_else(|e| panic!("settings: {}", e.line()));
    let options = Options {
        upstream_ca: Some(pki.ca_pem.clone()),
        ..Options::default()
    };
    let metrics = Arc::new(Metrics::new().expect("metrics"));
    let credential = ApiCredential::Exchanged(key);
    let trust = abx_proxy::upstream::tls_config(options.upstream_ca.as_deref()).expect("trust");
    let proxy =
        Arc::new(Proxy::new(&settings, &options, &trust, credential, metrics).expect("proxy"));

    let (tx, rx) = mpsc::channel(1);
    let req = http::Request::post("/v2/sandboxes")
        .header("host", "127.0.0.1:49982")
        .header("content-type", "application/json")
        .body(body::boxed(ChannelBody(rx)))
        .expect("request");
    let handled = tokio::spawn(proxy.clone().handle(req));
    tx.send(Bytes::from_static(b"{\"templateID\":"))
        .await
        .expect("first half");
    // Once the proxy has taken the first half, the client stalls (or the laptop sleeps)
    // past the key's hour, then sends the rest.
    let rest = within("the proxy reading the body", tx.reserve())
        .await
        .expect("the proxy reads on");
    clock.advance(Duration::from_secs(2 * 3600));
    rest.send(Bytes::from_static(b"\"base\"}"));
    drop(tx);
    let resp = match within("the answer", handled).await {
        Ok(Ok(resp)) => resp,
        Ok(Err(never)) => match never {},
        Err(e) => panic!("the handler panicked: {e}"),
    };
    let sent: Vec<String> = upstream
        .seen()
        .iter()
        .filter_map(|s| s.header("authorization").map(str::to_string))
        .collect();
    assert!(
        !sent.contains(&format!("Bearer {first}")),
        "the expired key went upstream; answered {}",
        resp.status()
    );
    assert!(
        resp.status() == 200 || resp.status() == 503,
        "{}",
        resp.status()
    );
}
