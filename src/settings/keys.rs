//! The key table of SPEC §2: every setting's canonical key, environment variable, secrecy,
//! config.toml section and default. Adding a setting starts here.

/// One row of the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeySpec {
    pub key: Key,
    /// Canonical key, as in `config get KEY` and config.toml.
    pub name: &'static str,
    pub env: &'static str,
    pub secret: bool,
    /// The config.toml table the key lives in (`None` for secrets, which never do).
    pub section: Option<&'static str>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Key {
    SandboxApiKey,
    AccessKeyId,
    AccessKeySecret,
    Region,
    GithubToken,
    Provider,
    SandboxBaseUrl,
    SandboxDomain,
    SandboxUrl,
    TokenExchangeUrl,
    TokenExchange,
    TokenTtl,
    TokenRefreshBefore,
    CompatV2Paths,
    Listen,
    AdminListen,
}

const fn row(
    key: Key,
    name: &'static str,
    env: &'static str,
    secret: bool,
    section: Option<&'static str>,
) -> KeySpec {
    KeySpec {
        key,
        name,
        env,
        secret,
        section,
    }
}

/// In the order `config list` prints them.
pub const KEYS: &[KeySpec] = &[
    row(
        Key::SandboxApiKey,
        "sandbox_api_key",
        "ABX_SANDBOX_API_KEY",
        true,
        None,
    ),
    row(
        Key::AccessKeyId,
        "access_key_id",
        "ALICLOUD_ACCESS_KEY_ID",
        false,
        Some("auth"),
    ),
    row(
        Key::AccessKeySecret,
        "access_key_secret",
        "ALICLOUD_ACCESS_KEY_SECRET",
        true,
        None,
    ),
    row(
        Key::Region,
        "region",
        "ALIBABA_CLOUD_REGION_ID",
        false,
        Some("transport"),
    ),
    row(Key::GithubToken, "github_token", "GITHUB_TOKEN", true, None),
    row(
        Key::Provider,
        "provider",
        "ABX_PROVIDER",
        false,
        Some("core"),
    ),
    row(
        Key::SandboxBaseUrl,
        "sandbox_base_url",
        "ABX_SANDBOX_BASE_URL",
        false,
        Some("transport"),
    ),
    row(
        Key::SandboxDomain,
        "sandbox_domain",
        "ABX_SANDBOX_DOMAIN",
        false,
        Some("transport"),
    ),
    row(
        Key::SandboxUrl,
        "sandbox_url",
        "ABX_SANDBOX_URL",
        false,
        Some("transport"),
    ),
    row(
        Key::TokenExchangeUrl,
        "token_exchange_url",
        "ABX_TOKEN_EXCHANGE_URL",
        false,
        Some("auth"),
    ),
    row(
        Key::TokenExchange,
        "token_exchange",
        "ABX_TOKEN_EXCHANGE",
        false,
        Some("auth"),
    ),
    row(
        Key::TokenTtl,
        "token_ttl",
        "ABX_TOKEN_TTL",
        false,
        Some("auth"),
    ),
    row(
        Key::TokenRefreshBefore,
        "token_refresh_before",
        "ABX_TOKEN_REFRESH_BEFORE",
        false,
        Some("auth"),
    ),
    row(
        Key::CompatV2Paths,
        "compat_v2_paths",
        "ABX_COMPAT_V2_PATHS",
        false,
        Some("proxy"),
    ),
    row(
        Key::Listen,
        "listen",
        "ABX_PROXY_LISTEN",
        false,
        Some("proxy"),
    ),
    row(
        Key::AdminListen,
        "admin_listen",
        "ABX_PROXY_ADMIN_LISTEN",
        false,
        Some("proxy"),
    ),
];

impl Key {
    pub fn spec(self) -> &'static KeySpec {
        // KEYS lists every variant once, in declaration order.
        &KEYS[self as usize]
    }

    pub fn name(self) -> &'static str {
        self.spec().name
    }

    /// Whether only the built-in provider reads this key: a plugin provider takes where its
    /// key goes from its own fields, and exchanges nothing.
    pub fn builtin_only(self) -> bool {
        matches!(
            self,
            Key::AccessKeyId
                | Key::AccessKeySecret
                | Key::Region
                | Key::SandboxBaseUrl
                | Key::SandboxDomain
                | Key::SandboxUrl
                | Key::TokenExchangeUrl
                | Key::TokenExchange
                | Key::TokenTtl
                | Key::TokenRefreshBefore
                | Key::CompatV2Paths
        )
    }

    /// The command-line flag that sets this key (a secret's is the file it is read from).
    pub fn flag(self) -> String {
        let name = self.name().replace('_', "-");
        if self.spec().secret {
            format!("--{name}-file")
        } else {
            format!("--{name}")
        }
    }

    pub fn by_name(name: &str) -> Option<Key> {
        KEYS.iter().find(|s| s.name == name).map(|s| s.key)
    }

    /// The built-in default; some derive from the effective region.
    pub fn default_value(self, region: &str) -> Option<String> {
        Some(match self {
            Key::Region => DEFAULT_REGION.to_string(),
            Key::Provider => crate::providers::BUILTIN.to_string(),
            Key::SandboxBaseUrl => format!("https://api.{region}.e2b.fc.aliyuncs.com"),
            Key::SandboxDomain => format!("{region}.e2b.fc.aliyuncs.com"),
            Key::TokenExchangeUrl => format!("https://fcsandbox.{region}.aliyuncs.com"),
            Key::TokenExchange => "rpc-v1".to_string(),
            Key::TokenTtl => "3600".to_string(),
            Key::TokenRefreshBefore => "300".to_string(),
            Key::CompatV2Paths => "rewrite".to_string(),
            Key::Listen => "127.0.0.1:49982".to_string(),
            Key::AdminListen => "127.0.0.1:9464".to_string(),
            Key::SandboxApiKey
            | Key::AccessKeyId
            | Key::AccessKeySecret
            | Key::GithubToken
            | Key::SandboxUrl => return None,
        })
    }
}

pub const DEFAULT_REGION: &str = "cn-hangzhou";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_is_in_declaration_order() {
        for (i, spec) in KEYS.iter().enumerate() {
            assert_eq!(spec.key as usize, i, "{}", spec.name);
        }
    }
}
