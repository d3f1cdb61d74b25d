//! Body helpers: boxing, bounded reads that never lose bytes, and the proxy's own answers.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http::{HeaderValue, Response, StatusCode};
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt, Empty, Full};

use crate::error::Error;
use crate::upstream::{BoxError, ProxyBody};

/// The size bound for bodies the proxy reads itself (create bodies, token responses).
pub const SNIFF_LIMIT: usize = 1024 * 1024;

pub fn boxed<B>(body: B) -> ProxyBody
where
    B: Body<Data = Bytes> + Send + Sync + 'static,
    B::Error: Into<BoxError>,
{
    body.map_err(Into::into).boxed()
}

pub fn full(bytes: impl Into<Bytes>) -> ProxyBody {
    Full::new(bytes.into()).map_err(|e| match e {}).boxed()
}

pub fn empty() -> ProxyBody {
    Empty::new().map_err(|e| match e {}).boxed()
}

/// The proxy's own error answer: E2B JSON shape plus `X-Abx-Error`.
pub fn error_response(e: &Error) -> Response<ProxyBody> {
    let mut resp = Response::new(full(e.json_body()));
    *resp.status_mut() =
        StatusCode::from_u16(e.http_status()).unwrap_or(StatusCode::SERVICE_UNAVAILABLE);
    let h = resp.headers_mut();
    h.insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    h.insert("x-abx-error", HeaderValue::from_static(e.code()));
    resp
}

/// Reads `body` up to `limit` bytes. `Ok(Complete)` holds all of it; `Ok(Partial)` holds
/// what was read and the rest of the stream, so nothing is lost when the bound is hit.
pub async fn read_bounded<B>(mut body: B, limit: usize) -> Result<Bounded<B>, BoxError>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    let mut buf = BytesMut::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(Into::into)?;
        if let Ok(data) = frame.into_data() {
            buf.extend_from_slice(&data);
            if buf.len() > limit {
                return Ok(Bounded::Partial(buf.freeze(), body));
            }
        }
        // Trailers on these small JSON bodies carry nothing we pass on.
    }
    Ok(Bounded::Complete(buf.freeze()))
}

pub enum Bounded<B> {
    Complete(Bytes),
    Partial(Bytes, B),
}

/// Already-read bytes followed by the rest of a stream.
pub struct Prefixed<B> {
    prefix: Option<Bytes>,
    rest: B,
}

impl<B> Prefixed<B> {
    pub fn new(prefix: Bytes, rest: B) -> Self {
        Prefixed {
            prefix: Some(prefix).filter(|b| !b.is_empty()),
            rest,
        }
    }
}

impl<B> Body for Prefixed<B>
where
    B: Body<Data = Bytes> + Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if let Some(p) = self.prefix.take() {
            return Poll::Ready(Some(Ok(Frame::data(p))));
        }
        Pin::new(&mut self.rest).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.prefix.is_none() && self.rest.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        let extra = self.prefix.as_ref().map_or(0, |p| p.len() as u64);
        let inner = self.rest.size_hint();
        let mut hint = SizeHint::new();
        hint.set_lower(inner.lower() + extra);
        if let Some(u) = inner.upper() {
            hint.set_upper(u + extra);
        }
        hint
    }
}
