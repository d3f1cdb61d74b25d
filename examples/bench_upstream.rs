//! A fast plain-HTTP/1.1 upstream for `benches/load.sh`: the thing every proxy under test
//! forwards to, so that the proxy (not the upstream) is what the numbers measure.
//!
//! ```text
//! bench_upstream [ADDR]            default 127.0.0.1:0; prints `listening http://127.0.0.1:PORT`
//! ```
//!
//! - `GET /download[?bytes=N]`  N bytes (default 1 GiB) generated on the fly, 64 KiB frames,
//!   with `Content-Length`; nothing is held in memory but one shared chunk.
//! - `POST|PUT /upload`         reads and discards the body; answers the byte count.
//! - `GET /headers`             the request's headers, one `name: value` a line (lets the
//!   load script check that every proxy rewrites the same way).
//! - anything else              200 with a small fixed JSON body (the request-rate test).
//!
//! One process, tokio's multi-thread runtime, HTTP/1.1 keep-alive, `TCP_NODELAY`.

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body_util::{combinators::BoxBody, BodyExt, Full};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::header::{HeaderValue, CONTENT_LENGTH, CONTENT_TYPE};
use hyper::{Method, Request, Response};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

type ResBody = BoxBody<Bytes, Infallible>;

const SMALL: &[u8] = br#"{"sandboxID":"isb-bench","state":"running","ok":true}"#;
const CHUNK: usize = 64 * 1024;
const GIB: u64 = 1 << 30;

/// `len` bytes of a repeated chunk.
struct Generated {
    chunk: Bytes,
    left: u64,
}

impl Body for Generated {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if self.left == 0 {
            return Poll::Ready(None);
        }
        let n = self.left.min(CHUNK as u64) as usize;
        self.left -= n as u64;
        Poll::Ready(Some(Ok(Frame::data(self.chunk.slice(..n)))))
    }

    fn is_end_stream(&self) -> bool {
        self.left == 0
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.left)
    }
}

fn query_bytes(req: &Request<Incoming>) -> u64 {
    req.uri()
        .query()
        .and_then(|q| q.split('&').find_map(|kv| kv.strip_prefix("bytes=")))
        .and_then(|v| v.parse().ok())
        .unwrap_or(GIB)
}

async fn handle(req: Request<Incoming>, chunk: Bytes) -> Result<Response<ResBody>, Infallible> {
    match (req.method(), req.uri().path()) {
        (&Method::GET, "/download") => {
            let left = query_bytes(&req);
            let mut resp = Response::new(Generated { chunk, left }.boxed());
            resp.headers_mut()
                .insert(CONTENT_LENGTH, HeaderValue::from(left));
            Ok(resp)
        }
        (&Method::POST | &Method::PUT, "/upload") => {
            let mut body = req.into_body();
            let mut total: u64 = 0;
            while let Some(frame) = body.frame().await {
                match frame {
                    Ok(f) => total += f.data_ref().map_or(0, |d| d.len() as u64),
                    Err(_) => break,
                }
            }
            Ok(Response::new(
                Full::new(Bytes::from(format!("{{\"received\":{total}}}\n"))).boxed(),
            ))
        }
        (&Method::GET, "/headers") => {
            let mut text = String::new();
            for (name, value) in req.headers() {
                let value = String::from_utf8_lossy(value.as_bytes());
                text.push_str(&format!("{name}: {value}\n"));
            }
            Ok(Response::new(Full::new(Bytes::from(text)).boxed()))
        }
        _ => {
            let mut resp = Response::new(Full::new(Bytes::from_static(SMALL)).boxed());
            resp.headers_mut()
                .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
            Ok(resp)
        }
    }
}

fn main() -> std::io::Result<()> {
    let addr = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "127.0.0.1:0".into());
    if addr.starts_with('-') {
        let usage = "usage: bench_upstream [ADDR (default 127.0.0.1:0)]";
        if addr == "--help" || addr == "-h" {
            println!("{usage}");
            return Ok(());
        }
        eprintln!("{usage}");
        std::process::exit(2);
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let listener = TcpListener::bind(&addr).await?;
        println!("listening http://{}", listener.local_addr()?);
        let chunk = Bytes::from(vec![b'x'; CHUNK]);
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let _ = stream.set_nodelay(true);
            let chunk = chunk.clone();
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |req| handle(req, chunk.clone()));
                let _ = hyper::server::conn::http1::Builder::new()
                    .keep_alive(true)
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    })
}
