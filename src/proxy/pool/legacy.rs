//! hyper-util's client, beside the pool, for what it alone can do: `https` origins that may
//! speak HTTP/2 (until one answers in HTTP/1.1: [`Http1Origins`]) and requests that carry
//! `Upgrade`. Around it: the request given up when dropped before its answer's head
//! ([`GiveUp`]: what of its body has not gone is never sent), and one more try of a request
//! the upstream refused unprocessed or lost with its connection ([`Again`], which the
//! handler also uses to send a request again after a 401 to a temporary key).

use std::pin::pin;
use std::sync::PoisonError;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::UPGRADE;
use http::{HeaderMap, Method, Request, Response, Version};
use http_body::Body as _;
use http_body_util::BodyExt as _;
use hyper_util::client::legacy::connect::capture_connection;

use super::codec::admit;
use super::{held_off, is_idempotent, Upstream};
use crate::metrics::{FailKind, Plane};
use crate::proxy::body;
use crate::proxy::failure::{self, UpstreamError};
use crate::upstream::{BoxError, ProxyBody};

/// `https` origins that negotiated HTTP/1.1 through ALPN: their requests go to the pool.
/// hyper-util's HTTP/1 pool races a waiting request's connect against connections coming
/// back and finishes a losing connect in the background, for nobody: in a pool this one
/// does not see, holding a [`Slot`](crate::descriptors::Slot) that
/// [`IdleConnections`](crate::descriptors::IdleConnections) cannot give back. An answer
/// holds for [`Http1Origins::FOR`]; then one request asks hyper-util's client again (the
/// others keep to the pool meanwhile), so that an origin whose HTTP/1.1 was passing (a
/// balancer's node without HTTP/2, a deploy) is multiplexed again.
#[derive(Default)]
pub(super) struct Http1Origins {
    /// Whether `list` has any, read first: an HTTP/2 control plane (the usual one) takes
    /// no lock per request.
    any: std::sync::atomic::AtomicBool,
    /// Each origin with the time until which its requests go to the pool.
    pub(super) list: std::sync::RwLock<Vec<(Box<str>, Instant)>>,
}

impl Http1Origins {
    /// A client has a handful of origins; more are not remembered.
    const MAX: usize = 64;
    const FOR: Duration = Duration::from_secs(600);
    /// How long the other requests keep to the pool while one asks again.
    const ASKING: Duration = Duration::from_secs(10);

    /// Whether `uri`'s origin goes to the pool. Once its time is up, false for one
    /// request in each [`Http1Origins::ASKING`].
    pub(super) fn has(&self, uri: &http::Uri, now: Instant) -> bool {
        use std::sync::atomic::Ordering::Relaxed;
        if !self.any.load(Relaxed) {
            return false;
        }
        let Some(authority) = uri.authority() else {
            return false;
        };
        {
            let list = self.list.read().unwrap_or_else(PoisonError::into_inner);
            match Self::index(&list, authority.as_str()) {
                None => return false,
                Some(i) if now < list[i].1 => return true,
                Some(_) => {}
            }
        }
        let mut list = self.list.write().unwrap_or_else(PoisonError::into_inner);
        match Self::index(&list, authority.as_str()) {
            Some(i) if now < list[i].1 => true,
            Some(i) => {
                list[i].1 = now + Self::ASKING;
                false
            }
            None => false,
        }
    }

    fn index(list: &[(Box<str>, Instant)], authority: &str) -> Option<usize> {
        list.iter().position(|(a, _)| **a == *authority)
    }

    /// `uri`'s origin answered in HTTP/1.x at `now`.
    #[cold]
    pub(super) fn add(&self, uri: &http::Uri, now: Instant) {
        let Some(authority) = uri.authority() else {
            return;
        };
        let until = now + Self::FOR;
        let mut list = self.list.write().unwrap_or_else(PoisonError::into_inner);
        if let Some(i) = Self::index(&list, authority.as_str()) {
            list[i].1 = until;
            return;
        }
        if list.len() >= Self::MAX {
            list.retain(|(_, until)| now < *until);
        }
        if list.len() < Self::MAX {
            list.push((authority.as_str().into(), until));
            self.any.store(true, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// `uri`'s origin answered in HTTP/2: hyper-util's client keeps it.
    fn remove(&self, uri: &http::Uri) {
        if !self.any.load(std::sync::atomic::Ordering::Relaxed) {
            return;
        }
        let Some(authority) = uri.authority() else {
            return;
        };
        let mut list = self.list.write().unwrap_or_else(PoisonError::into_inner);
        list.retain(|(a, _)| **a != *authority.as_str());
    }
}

impl Upstream {
    /// [`Upstream::request`] through hyper-util's client.
    pub(super) async fn legacy(
        &self,
        plane: Plane,
        req: Request<ProxyBody>,
        timeout: Duration,
    ) -> Result<Response<ProxyBody>, UpstreamError> {
        let mut deadline = Instant::now() + timeout;
        // Only a request with a body is watched (no allocation for a GET). Its trailers
        // are dropped as on the pool's connections (nothing an SDK sends has them, and a
        // client's could carry credential fields past the head's rewrite).
        let moved = (!req.body().is_end_stream()).then(body::Moved::default);
        let mut req = match &moved {
            Some(m) => req.map(|b| body::boxed(body::Uploading::new(b, m.clone()))),
            None => req,
        };
        // Given up before the answer's head (dropped at its timeout, or with its client):
        // what of the body has not gone is never sent.
        let mut give_up = GiveUp(moved.clone());
        let upgrade = req.headers().contains_key(UPGRADE);
        let mut again = if upgrade { None } else { Again::of(&req) };
        let idempotent = is_idempotent(req.method());
        // The origin, to remember should it answer in HTTP/1.1 (a refcount, not a copy).
        let origin = (self.negotiate && !upgrade).then(|| req.uri().clone());
        // To poison the connection of an answer refused below: hyper would reuse it, though
        // an upstream framing its answers that way may have more bytes of it to come.
        let mut conn = capture_connection(&mut req);
        let mut response = pin!(self.legacy.request(req));
        let mut resp = loop {
            match tokio::time::timeout_at(deadline.into(), response.as_mut()).await {
                // hyper's HTTP/1 client marks the body's error as the caller's; its HTTP/2
                // client resets the stream and fails with that reset, the upstream's
                // answer to nothing it did.
                Ok(Err(e)) if moved.as_ref().is_some_and(body::Moved::broken) => {
                    return Err(UpstreamError::ClientBody(e.into()))
                }
                Ok(Err(e)) if failure::timed_out(&e) => return Err(UpstreamError::PingUnanswered),
                // Not processed at all (RFC 9113 §8.7): sent once more, as curl and Go's
                // client do, whatever the method. hyper-util sends again only what it never
                // wrote. Once: an upstream refusing every stream is answered. So is a
                // request that may be done twice whose connection was lost under it with no
                // word (closed or reset without a GOAWAY, as a server ending an idle
                // connection may), as the pool's HTTP/1.1 connections and Go's client do.
                Ok(Err(e))
                    if failure::refused(&e) || idempotent && failure::connection_lost(&e) =>
                {
                    let Some(again) = again.take() else {
                        return Err(e.into());
                    };
                    let why = if failure::refused(&e) {
                        "refused"
                    } else {
                        "lost"
                    };
                    tracing::debug!(
                        plane = plane.label(),
                        method = %again.method,
                        why,
                        "the upstream refused the request unprocessed, or its connection was \
                         lost: sending it again"
                    );
                    let mut req = again.into_request(moved.as_ref());
                    conn = capture_connection(&mut req);
                    response.set(self.legacy.request(req));
                }
                Ok(resp) => break resp?,
                // An upload still moving is not an upstream gone quiet: the wait counts
                // from its last bytes (as nginx's proxy_send_timeout does).
                Err(_) => {
                    let last = moved.as_ref().and_then(body::Moved::last);
                    match held_off(last.map(tokio::time::Instant::into_std), timeout) {
                        Some(later) => deadline = later,
                        None if moved.as_ref().is_some_and(body::Moved::awaiting_client) => {
                            return Err(UpstreamError::BodyStalled)
                        }
                        // Given up here, so that the body's first poll, should it race this
                        // on hyper's side, finds it so, or is seen to have come first.
                        None if moved.as_ref().is_some_and(body::Moved::give_up) => {
                            return Err(UpstreamError::Unsent)
                        }
                        None => return Err(UpstreamError::Timeout),
                    }
                }
            }
        };
        // Answered: the rest of the body goes on (an upstream may answer before its end).
        give_up.0 = None;
        if let Err(e) = admit(upgrade, &mut resp) {
            if let Some(conn) = &*conn.connection_metadata() {
                conn.poison();
            }
            return Err(e);
        }
        if let Some(origin) = origin {
            if resp.version() < Version::HTTP_2 {
                self.http1.add(&origin, Instant::now());
            } else {
                self.http1.remove(&origin);
            }
        }
        let pool = self.pool.clone();
        let count = move |e: BoxError| {
            // An answer cut because the client's upload broke (the stream reset with it)
            // is no upstream error.
            // Said as the client's (see `failure::client_left`).
            if moved.as_ref().is_some_and(body::Moved::broken) {
                return UpstreamError::ClientBody(e).into();
            }
            // The one error that is not hyper's: a stream reset before its END_STREAM.
            let kind = e
                .downcast_ref::<hyper::Error>()
                .map_or(FailKind::Reset, failure::body_kind);
            pool.count_broken(plane, kind);
            e
        };
        // Not for HTTP/1: hyper never says a chunked body is at its end, and a connection
        // cut mid-body is hyper's own error there.
        let h2 = resp.version() == Version::HTTP_2;
        Ok(resp.map(|incoming| {
            if h2 {
                body::boxed(body::EndStreamed::response(incoming).map_err(count))
            } else {
                body::boxed(incoming.map_err(BoxError::from).map_err(count))
            }
        }))
    }
}

/// Gives the request up ([`body::Moved::give_up`]) when dropped still holding its body's
/// progress: before the answer's head.
struct GiveUp(Option<body::Moved>);

impl Drop for GiveUp {
    fn drop(&mut self) {
        if let Some(moved) = &self.0 {
            let _ = moved.give_up();
        }
    }
}

/// A request kept to be sent once more should the upstream refuse it unprocessed (or, in
/// the handler, refuse its temporary key): its head, and its body when there is none or
/// the handler holds it whole ([`Replay`]). A body streamed from the client is gone once
/// sent: such a request is not kept.
pub(in crate::proxy) struct Again {
    method: Method,
    uri: http::Uri,
    headers: HeaderMap,
    body: Option<Bytes>,
}

/// A request body the handler holds whole (a rewritten create or connect), put in the
/// request's extensions so that the upstream client can send it again.
#[derive(Clone)]
pub struct Replay(pub Bytes);

impl Again {
    pub(in crate::proxy) fn of(req: &Request<ProxyBody>) -> Option<Again> {
        let body = if req.body().is_end_stream() {
            None
        } else {
            Some(req.extensions().get::<Replay>()?.0.clone())
        };
        Some(Again {
            method: req.method().clone(),
            uri: req.uri().clone(),
            headers: req.headers().clone(),
            body,
        })
    }

    /// The request again; its body marks `moved` as the first one's did, and is held for
    /// the pool to send once more as the first one's was.
    pub(in crate::proxy) fn into_request(self, moved: Option<&body::Moved>) -> Request<ProxyBody> {
        let body = match (&self.body, moved) {
            (Some(b), Some(m)) => {
                body::boxed(body::Uploading::new(body::full(b.clone()), m.clone()))
            }
            (Some(b), None) => body::full(b.clone()),
            (None, _) => body::empty(),
        };
        let mut req = Request::new(body);
        *req.method_mut() = self.method;
        *req.uri_mut() = self.uri;
        *req.headers_mut() = self.headers;
        if let Some(b) = self.body {
            req.extensions_mut().insert(Replay(b));
        }
        req
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An origin's HTTP/1.1 holds `Http1Origins::FOR`; then one request in each `ASKING`
    /// goes to hyper-util's client again and the others to the pool, until an answer
    /// renews it (HTTP/1.1) or ends it (HTTP/2). When the list is full, expired origins
    /// make room.
    #[test]
    fn remembered_origins_are_asked_again_one_request_at_a_time() {
        let origins = Http1Origins::default();
        let uri = |host: &str| -> http::Uri { format!("https://{host}/").parse().unwrap() };
        let t0 = Instant::now();
        assert!(!origins.has(&uri("a:443"), t0));
        origins.add(&uri("a:443"), t0);
        assert!(origins.has(&uri("a:443"), t0));
        assert!(!origins.has(&uri("b:443"), t0), "by origin");
        assert!(!origins.has(&uri("a:8443"), t0), "by origin");

        let due = t0 + Http1Origins::FOR;
        assert!(!origins.has(&uri("a:443"), due), "one request asks again");
        assert!(
            origins.has(&uri("a:443"), due),
            "the others keep to the pool"
        );
        let later = due + Http1Origins::ASKING;
        assert!(
            !origins.has(&uri("a:443"), later),
            "no answer yet: another asks"
        );
        origins.add(&uri("a:443"), later);
        assert!(origins.has(&uri("a:443"), later + Http1Origins::ASKING));
        assert_eq!(
            origins.list.read().unwrap().len(),
            1,
            "renewed, not added again"
        );
        origins.remove(&uri("a:443"));
        assert!(
            !origins.has(&uri("a:443"), later),
            "an HTTP/2 answer ends it"
        );

        for i in 0..Http1Origins::MAX {
            origins.add(&uri(&format!("h{i}:443")), t0);
        }
        origins.add(&uri("new:443"), t0);
        assert!(!origins.has(&uri("new:443"), t0), "full");
        origins.add(&uri("new:443"), due);
        assert!(origins.has(&uri("new:443"), due), "expired ones make room");
    }
}
