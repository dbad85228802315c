//! Who a request is: the API keys it presents ([`presented_keys`]), compared in constant time
//! ([`same_key`]), and the tenant a key names ([`TenantNamer`]), whose name salts every cached block of
//! its requests ([`effective_salt`]).

use std::sync::Arc;

use axum::http::header;
use kura_kv::Secret;
pub use kura_request::TENANT_SEPARATOR;

/// Which tenant a request belongs to: a keyed digest of the API key it authenticated with (stable across
/// restarts and key reordering, so that saved contexts and disk blocks keep their owner), if keys are
/// configured.
#[derive(Debug, Clone)]
pub struct Tenant(pub Option<Arc<str>>);

/// Names tenants by a keyed BLAKE3 digest of their API key: stable for one secret, and no oracle for
/// guessing keys to whoever sees a tenant name without the secret.
#[derive(Clone)]
pub struct TenantNamer {
    key: [u8; 32],
}

impl std::fmt::Debug for TenantNamer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TenantNamer(..)")
    }
}

impl TenantNamer {
    /// The purpose a secret's tenant-naming key is derived for.
    pub const PURPOSE: &'static str = "kura 2026 tenant names of api keys";

    pub fn new(secret: &Secret) -> Self {
        Self {
            key: secret.derive(Self::PURPOSE),
        }
    }

    /// The tenant name of an API key: what its requests' blocks are salted with and what owns its
    /// saved contexts.
    pub fn tenant_of_key(&self, key: &str) -> Arc<str> {
        let mac = blake3::keyed_hash(&self.key, key.as_bytes());
        let mut first = [0u8; 16];
        first.copy_from_slice(&mac.as_bytes()[..16]);
        // Big-endian, so that the name spells the MAC's first 16 bytes in order.
        format!("key-{:032x}", u128::from_be_bytes(first)).into()
    }
}

/// The tenant name earlier versions gave an API key (an unkeyed xxh3 digest), for moving their saved
/// contexts to the keyed name (`kura_server::caching::ContextStore::migrate_owners`).
pub fn legacy_tenant_of_key(key: &str) -> String {
    format!("key-{:016x}", xxhash_rust::xxh3::xxh3_64(key.as_bytes()))
}

/// The API keys a request presents, in the order they are tried: `Authorization: Bearer <key>`
/// (OpenAI's clients), then `x-api-key: <key>` (Anthropic's).
pub fn presented_keys(headers: &axum::http::HeaderMap) -> [Option<&str>; 2] {
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            let (scheme, key) = v.split_once(' ')?;
            scheme.eq_ignore_ascii_case("bearer").then_some(key.trim())
        });
    let x_api_key = headers
        .get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .map(str::trim);
    [bearer, x_api_key]
}

/// Compares the keys' BLAKE3 digests, in constant time (`blake3::Hash`'s equality), so that response
/// timing reveals neither how much of a key matched nor whether its length did (a byte-wise comparison
/// answers a key of another length at once). Hashing takes as long for any key of up to 64 bytes (one
/// BLAKE3 block).
pub fn same_key(a: &str, b: &str) -> bool {
    blake3::hash(a.as_bytes()) == blake3::hash(b.as_bytes())
}

/// The engine's cache salt for a request: the tenant (a digest of its key, when keys are configured)
/// and the request's own `cache_salt`, so that neither tenants nor salts ever share blocks.
pub fn effective_salt(tenant: &Tenant, salt: Option<String>) -> Option<String> {
    match (&tenant.0, salt) {
        (None, salt) => salt,
        (Some(t), None) => Some(t.to_string()),
        (Some(t), Some(s)) => Some(format!("{t}{TENANT_SEPARATOR}{s}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_match_only_whole() {
        assert!(same_key("sk-tenant-a-0123", "sk-tenant-a-0123"));
        assert!(!same_key("sk-tenant-a-0123", "sk-tenant-a-0124"));
        assert!(!same_key("sk-tenant-a-0123", "sk-tenant-a-012"));
        assert!(!same_key("sk-tenant-a-0123", "sk-tenant-a-01234"));
        assert!(!same_key("sk-tenant-a-0123", ""));
        assert!(same_key("", ""));
    }
}
