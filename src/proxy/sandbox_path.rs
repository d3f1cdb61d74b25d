//! The control plane's sandbox paths: `/sandboxes`, `/sandboxes/{id}` and
//! `/sandboxes/{id}/{action}`, each also under `/v2`. Read here once for the three phases
//! that act on them (the `/v2` rewrite, token learning, and whether a request is safe to
//! send again), which read a path three ways before and disagreed on edges: a trailing
//! slash (a `/v2` connect with one went upstream unrewritten, yet was learned from and
//! counted safe to repeat) and an empty id (`/sandboxes//connect` was learned from).

/// A path of the sandbox collection, or of one sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SandboxPath<'a> {
    /// Under `/v2`.
    pub v2: bool,
    /// The sandbox, for `/sandboxes/{id}…`; `None` for the collection itself.
    pub id: Option<&'a str>,
    /// What follows the id: `connect`, `timeout`, `pause`, ….
    pub action: Option<&'a str>,
}

/// `path`'s reading, when it is one of those shapes. Trailing slashes are ignored; an empty
/// segment or one more than those shapes have is no sandbox path.
pub fn parse(path: &str) -> Option<SandboxPath<'_>> {
    let (v2, path) = match path.strip_prefix("/v2") {
        Some(rest) if rest.starts_with("/sandboxes") => (true, rest),
        _ => (false, path),
    };
    let rest = path.strip_prefix("/sandboxes")?.trim_end_matches('/');
    if rest.is_empty() {
        return Some(SandboxPath {
            v2,
            id: None,
            action: None,
        });
    }
    let mut segments = rest.strip_prefix('/')?.split('/');
    let id = segments.next().filter(|s| !s.is_empty())?;
    let action = match segments.next() {
        None => None,
        Some(action) if !action.is_empty() => Some(action),
        Some(_) => return None,
    };
    if segments.next().is_some() {
        return None;
    }
    Some(SandboxPath {
        v2,
        id: Some(id),
        action,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_three_shapes_and_nothing_else() {
        let at = |v2, id, action| Some(SandboxPath { v2, id, action });
        assert_eq!(parse("/sandboxes"), at(false, None, None));
        assert_eq!(parse("/v2/sandboxes/"), at(true, None, None));
        assert_eq!(parse("/sandboxes/isb-1"), at(false, Some("isb-1"), None));
        assert_eq!(parse("/sandboxes/isb-1//"), at(false, Some("isb-1"), None));
        assert_eq!(
            parse("/v2/sandboxes/isb-1/connect/"),
            at(true, Some("isb-1"), Some("connect"))
        );
        for no in [
            "/",
            "/v2",
            "/v2sandboxes",
            "/sandboxesx",
            "/sandboxes//connect",
            "/sandboxes/a/b/connect",
            "/v2/v2/sandboxes",
            "/api/sandboxes/isb-1",
            "/templates",
        ] {
            assert_eq!(parse(no), None, "{no}");
        }
    }
}
