//! hyper's HTTP/1.1 client reading one response from given bytes: the reference the
//! `response` and `response_writer` targets hold the proxy's HTTP/1 code to (each includes
//! this file with `#[path]`; `fast_head` takes its runtime and `pairs`).
#![allow(dead_code)]

use std::io;
use std::pin::Pin;
use std::sync::OnceLock;
use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use http::{HeaderMap, Method, Request};
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// One current-thread runtime for every input (building one per input would dominate).
pub fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .build()
            .expect("a current-thread runtime")
    })
}

#[derive(Debug)]
pub struct Hyper {
    pub status: u16,
    pub headers: Vec<(String, Vec<u8>)>,
    pub body: Vec<u8>,
    pub trailers: Vec<(String, Vec<u8>)>,
}

/// hyper's client reading one response from `wire` (in `seg`-byte reads, then the end) to
/// a GET, or a HEAD.
pub fn hyper_read(wire: &[u8], seg: usize, head_request: bool) -> Result<Hyper, hyper::Error> {
    let io = Wire {
        bytes: Bytes::copy_from_slice(wire),
        seg,
        asked: false,
        reader: None,
    };
    runtime().block_on(async move {
        let (mut send, conn) =
            hyper::client::conn::http1::handshake::<_, Empty<Bytes>>(TokioIo::new(io)).await?;
        let conn = tokio::spawn(conn);
        let method = if head_request {
            Method::HEAD
        } else {
            Method::GET
        };
        let req = Request::builder()
            .method(method)
            .uri("/")
            .header("host", "upstream")
            .body(Empty::new())
            .expect("a valid request");
        let result = async {
            let resp = send.send_request(req).await?;
            let status = resp.status().as_u16();
            let headers = pairs(resp.headers());
            let collected = resp.into_body().collect().await?;
            let trailers = collected.trailers().map(pairs).unwrap_or_default();
            Ok(Hyper {
                status,
                headers,
                body: collected.to_bytes().to_vec(),
                trailers,
            })
        }
        .await;
        drop(send);
        let _ = conn.await;
        result
    })
}

pub fn pairs(map: &HeaderMap) -> Vec<(String, Vec<u8>)> {
    map.iter()
        .map(|(n, v)| (n.as_str().to_owned(), v.as_bytes().to_vec()))
        .collect()
}

/// The upstream's side of the connection: once the request is written, `bytes` in reads of
/// at most `seg`, then the end; what the client writes is taken and dropped. (Bytes there
/// before the request would be an unsolicited answer, which hyper refuses.)
struct Wire {
    bytes: Bytes,
    seg: usize,
    asked: bool,
    reader: Option<Waker>,
}

impl AsyncRead for Wire {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if !self.asked {
            self.reader = Some(cx.waker().clone());
            return Poll::Pending;
        }
        let n = self.seg.min(self.bytes.len()).min(buf.remaining());
        let chunk = self.bytes.split_to(n);
        buf.put_slice(&chunk);
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for Wire {
    fn poll_write(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
        b: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.asked = true;
        if let Some(w) = self.reader.take() {
            w.wake();
        }
        Poll::Ready(Ok(b.len()))
    }
    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}
