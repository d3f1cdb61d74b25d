//! Phase 4, forward: send the rewritten request upstream with a deadline for the response
//! head, and turn failures into E5001/E5002 with a metric kind (or, when the client's own
//! body stalled or broke, into E5003's 400, which counts as no upstream error).
//!
//! The request goes through [`Upstream`] (`proxy::pool`): its own HTTP/1.1 pool, or
//! hyper-util's client for HTTP/2 and upgrades; what failed is told apart in
//! [`super::failure`].

use std::time::Duration;

use http::{Request, Response};

use super::failure::UpstreamError;
use super::pool::Upstream;
use crate::error::{Error, Within};
use crate::metrics::Plane;
use crate::upstream::ProxyBody;

pub use crate::metrics::FailKind;

/// A forward that failed: the proxy's answer, its metric kind (none when the client's own
/// body broke), and whether the upstream may have received the request.
#[derive(Debug)]
pub struct Failed {
    pub error: Error,
    pub kind: Option<FailKind>,
    /// False only when no connection was set up: the request cannot have been carried out.
    pub reached: bool,
}

/// A failure of the proxy's own, not of a forward (a request refused, a token look-up
/// failed): no upstream carried the request out.
impl From<Error> for Failed {
    fn from(error: Error) -> Self {
        Failed {
            error,
            kind: None,
            reached: false,
        }
    }
}

pub async fn send(
    client: &Upstream,
    plane: Plane,
    req: Request<ProxyBody>,
    timeout: Duration,
    host: &str,
) -> Result<Response<ProxyBody>, Failed> {
    let e = match client.request(plane, req, timeout).await {
        Ok(resp) => return Ok(resp),
        Err(e) => e,
    };
    let reached = e.reached_upstream();
    let (error, kind) = match e {
        UpstreamError::Timeout | UpstreamError::Unsent => (
            Error::UpstreamTimeout {
                within: Within(timeout),
                host: host.to_string(),
            },
            Some(FailKind::Timeout),
        ),
        UpstreamError::PingUnanswered => (
            Error::UpstreamSilent {
                within: Within(crate::upstream::ping_interval(timeout)),
                host: host.to_string(),
            },
            Some(FailKind::Timeout),
        ),
        // The client stopped sending its body before the end, and the upstream waited for
        // it: refused as the proxy's own read of a create body is when it stalls.
        UpstreamError::BodyStalled => (
            Error::Refused {
                reason: format!("request body not received within {}", Within(timeout)),
            },
            None,
        ),
        // The client's own body broke (a bad chunk, a closed upload): not the upstream's
        // fault, and not an upstream error in the metrics.
        e if e.is_client_body() => (
            Error::Refused {
                reason: "the request body could not be read".into(),
            },
            None,
        ),
        e => (
            Error::UpstreamUnreachable {
                reason: e.describe(),
                host: host.to_string(),
            },
            // The proxy's own saturation is no failure of the upstream's.
            (!e.is_no_slot()).then(|| e.kind()),
        ),
    };
    Err(Failed {
        error,
        kind,
        reached,
    })
}
