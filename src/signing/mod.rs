//! Alibaba Cloud POP request signing: the percent-encoding both schemes share, RPC V1
//! (HMAC-SHA1) and ACS3-HMAC-SHA256.
//!
//! Everything here is a pure function of its inputs: the caller passes the nonce and the
//! timestamp, so the published vectors can be reproduced byte for byte and no clock is read
//! inside the signing math. [`rpc_nonce`], [`acs3_nonce`] and [`timestamp`] make fresh values
//! for real calls. A secret enters only as [`crate::secret::Secret`] and leaves only as an
//! HMAC; signatures themselves are not secret.

pub mod acs3;
pub mod percent;
pub mod rpc_v1;

use time::{OffsetDateTime, UtcOffset};

/// A fresh `SignatureNonce` for RPC V1: a UUID v4, as Alibaba's SDKs send.
pub fn rpc_nonce() -> String {
    uuid::Uuid::new_v4().to_string()
}

/// A fresh `x-acs-signature-nonce` for ACS3: 32 lowercase hex characters.
pub fn acs3_nonce() -> String {
    uuid::Uuid::new_v4().simple().to_string()
}

/// `YYYY-MM-DDTHH:MM:SSZ` in UTC, the form both schemes sign (`Timestamp`, `x-acs-date`).
///
/// Written by hand rather than through a format description so it cannot fail: every
/// `OffsetDateTime` without the `large-dates` feature has a four-digit year.
pub fn timestamp(at: OffsetDateTime) -> String {
    let t = at.to_offset(UtcOffset::UTC);
    format!(
        "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}Z",
        t.year(),
        u8::from(t.month()),
        t.day(),
        t.hour(),
        t.minute(),
        t.second()
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use time::macros::datetime;

    #[test]
    fn timestamp_is_utc_with_seconds_and_z() {
        assert_eq!(
            timestamp(datetime!(2025-01-01 08:00:05 +08:00)),
            "2025-01-01T00:00:05Z"
        );
        assert_eq!(
            timestamp(datetime!(2016-02-23 12:46:24.987 UTC)),
            "2016-02-23T12:46:24Z"
        );
    }

    #[test]
    fn nonces_have_the_expected_shape_and_differ() {
        let a = rpc_nonce();
        assert_eq!(a.len(), 36);
        assert_eq!(a.matches('-').count(), 4);
        assert_ne!(a, rpc_nonce());

        let b = acs3_nonce();
        assert_eq!(b.len(), 32);
        assert!(b
            .bytes()
            .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase()));
        assert_ne!(b, acs3_nonce());
    }
}
