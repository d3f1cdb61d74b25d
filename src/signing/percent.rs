//! Alibaba POP percent-encoding, shared by RPC V1 and ACS3.
//!
//! RFC 3986 unreserved characters stay, every other UTF-8 byte becomes `%XX` in upper case.
//! This differs from `application/x-www-form-urlencoded` (space is `%20`, not `+`; `*` is
//! encoded; `~` is not), which is why a general URL library is not used here: one byte of
//! difference breaks the signature.

const HEX: &[u8; 16] = b"0123456789ABCDEF";

fn is_unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~')
}

fn push_encoded(out: &mut String, b: u8) {
    out.push('%');
    out.push(char::from(HEX[usize::from(b >> 4)]));
    out.push(char::from(HEX[usize::from(b & 0x0f)]));
}

/// Percent-encodes every byte outside `A-Z a-z 0-9 - _ . ~`.
pub fn encode(value: &str) -> String {
    encode_bytes(value.as_bytes())
}

fn encode_bytes(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len() * 3 / 2);
    for &b in bytes {
        if is_unreserved(b) {
            out.push(char::from(b));
        } else {
            push_encoded(&mut out, b);
        }
    }
    out
}

/// Encodes a URL path as sent, segment by segment, keeping the `/` separators; an empty
/// path is `/`. A `%XX` escape already in it is read as the byte it stands for, as the
/// server reads it before it encodes the path to check the signature: a prefix written
/// `/pre%20fix` was encoded again as `/pre%2520fix`, and every signature failed.
pub fn encode_path(path: &str) -> String {
    if path.is_empty() {
        return "/".to_string();
    }
    path.split('/')
        .map(|segment| encode_bytes(&decoded(segment)))
        .collect::<Vec<_>>()
        .join("/")
}

/// A path segment with its `%XX` escapes read; a `%` that starts none stays itself.
fn decoded(segment: &str) -> Vec<u8> {
    let bytes = segment.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |at: usize| bytes.get(at).and_then(|&b| char::from(b).to_digit(16));
        match (bytes[i], hex(i + 1), hex(i + 2)) {
            (b'%', Some(hi), Some(lo)) => {
                // Two hex digits make a byte: `hi * 16 + lo` is at most 255.
                out.push(u8::try_from(hi * 16 + lo).unwrap_or(b'%'));
                i += 3;
            }
            (b, _, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unreserved_are_kept() {
        let s = "AZaz09-_.~";
        assert_eq!(encode(s), s);
    }

    #[test]
    fn reserved_and_special_are_encoded_upper_case() {
        assert_eq!(encode(" "), "%20");
        assert_eq!(encode("*"), "%2A");
        assert_eq!(encode("/"), "%2F");
        assert_eq!(encode("="), "%3D");
        assert_eq!(encode("&"), "%26");
        assert_eq!(encode("+"), "%2B");
        assert_eq!(encode("%"), "%25");
        assert_eq!(encode(":"), "%3A");
        assert_eq!(encode("a b*c~d"), "a%20b%2Ac~d");
    }

    #[test]
    fn non_ascii_is_encoded_over_utf8_bytes() {
        assert_eq!(encode("é"), "%C3%A9");
        assert_eq!(encode("中"), "%E4%B8%AD");
        assert_eq!(encode("😀"), "%F0%9F%98%80");
    }

    #[test]
    fn empty_is_empty() {
        assert_eq!(encode(""), "");
    }

    #[test]
    fn path_keeps_separators() {
        assert_eq!(encode_path(""), "/");
        assert_eq!(encode_path("/"), "/");
        assert_eq!(
            encode_path("/pop/2026-05-09/api-keys"),
            "/pop/2026-05-09/api-keys"
        );
        assert_eq!(encode_path("/a b/c*d/"), "/a%20b/c%2Ad/");
    }

    /// A path as sent, escapes and all, is signed as the server reads it: each escape is
    /// the byte it stands for, encoded once.
    #[test]
    fn path_escapes_are_read_before_encoding() {
        let cases = [
            ("/pre%20fix/pop", "/pre%20fix/pop"),
            ("/pre%2afix", "/pre%2Afix"),
            ("/%7Euser/%41", "/~user/A"),
            ("/a%2Fb", "/a%2Fb"),
            ("/%C3%A9", "/%C3%A9"),
            // A `%` that starts no escape is itself.
            ("/100%", "/100%25"),
            ("/%zz%4", "/%25zz%254"),
        ];
        for (sent, signed) in cases {
            assert_eq!(encode_path(sent), signed, "{sent}");
        }
    }
}
