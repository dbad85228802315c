//! Block identity: the chained, seeded 128-bit hash of a full block and the cache key that isolates tenants.
//!
//! A block's hash is `xxh3_128(seed, parent_hash ‖ token ids of the block)`, where the parent hash of a
//! sequence's first block is the hash of its [`CacheKey`] (cache salt, adapter, model fingerprint). Equal hashes
//! therefore mean "equal tokens from the start of the sequence under the same key", up to a collision, which
//! the prefix index rules out by checking every hit against the stored tokens, the parent block and the key
//! (see `prefix`). The seed is random per process unless the configuration fixes it (tests, simulation), so
//! an outsider cannot craft colliding prompts.
//!
//! Cost: one xxh3 pass over `16 + 4 * block_size` bytes per block, no heap allocation (the scratch buffer is
//! reused).
//!
//! Outside one process blocks are named by `kura_fleet::ContentNamer`: keyed BLAKE3 over the same chain,
//! with a key derived from the fleet's [`Secret`], so that replicas, a router and a shared tier name a
//! prefix alike while nobody without the secret can compute a prompt's names or learn anything from them.

use xxhash_rust::xxh3::xxh3_128_with_seed;

/// The 128-bit identity of a full block (or, for a sequence's root, of its cache key).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct BlockHash(pub u128);

/// What besides the tokens decides whether two sequences may share KV.
///
/// Requests with different keys never share a block: a tenant's cache salt (as vLLM's `cache_salt`), the
/// adapter that produced the KV, and a fingerprint of the model and KV format.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct CacheKey {
    salt: Option<String>,
    adapter: Option<String>,
    model_fingerprint: Option<String>,
}

impl CacheKey {
    /// The key of a request with no salt, no adapter and no model fingerprint.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets the tenant's cache salt.
    pub fn with_salt(mut self, salt: impl Into<String>) -> Self {
        self.salt = Some(salt.into());
        self
    }

    /// Sets the adapter (e.g. LoRA) identity.
    pub fn with_adapter(mut self, adapter: impl Into<String>) -> Self {
        self.adapter = Some(adapter.into());
        self
    }

    /// Sets the fingerprint of the model weights and KV format.
    pub fn with_model_fingerprint(mut self, fingerprint: impl Into<String>) -> Self {
        self.model_fingerprint = Some(fingerprint.into());
        self
    }

    /// The cache salt, if any.
    pub fn salt(&self) -> Option<&str> {
        self.salt.as_deref()
    }

    /// Appends an unambiguous encoding (tag, length, bytes for each field) to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        for (tag, field) in [
            (1u8, &self.salt),
            (2u8, &self.adapter),
            (3u8, &self.model_fingerprint),
        ] {
            match field {
                None => out.push(0),
                Some(s) => {
                    out.push(tag);
                    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
                    out.extend_from_slice(s.as_bytes());
                }
            }
        }
    }
}

/// Computes block and key hashes with one seed.
#[derive(Clone, Debug)]
pub struct BlockHasher {
    seed: u64,
    /// Keeps only the low bits of every hash; all ones in production. Narrowed only to force collisions
    /// in tests of the collision path.
    mask: u128,
    scratch: Vec<u8>,
}

impl BlockHasher {
    /// A hasher with the given seed and `hash_bits` (1..=128) significant bits.
    pub fn new(seed: u64, hash_bits: u32) -> Self {
        let bits = hash_bits.clamp(1, 128);
        let mask = if bits == 128 {
            u128::MAX
        } else {
            (1u128 << bits) - 1
        };
        Self {
            seed,
            mask,
            scratch: Vec::with_capacity(16 + 4 * 256),
        }
    }

    /// A fresh random seed for this process.
    pub fn random_seed() -> u64 {
        rand::random::<u64>()
    }

    /// The root hash of sequences under `key`.
    pub fn key_hash(&mut self, key: &CacheKey) -> BlockHash {
        self.scratch.clear();
        self.scratch.extend_from_slice(b"kura-key");
        key.encode(&mut self.scratch);
        BlockHash(xxh3_128_with_seed(&self.scratch, self.seed) & self.mask)
    }

    /// The hash of a full block of `tokens` whose parent has hash `parent`.
    pub fn chain(&mut self, parent: BlockHash, tokens: &[u32]) -> BlockHash {
        let len = 16 + 4 * tokens.len();
        // Every byte is overwritten below, so the buffer is only resized, never cleared.
        if self.scratch.len() != len {
            self.scratch.resize(len, 0);
        }
        let (head, body) = self.scratch.split_at_mut(16);
        head.copy_from_slice(&parent.0.to_le_bytes());
        for (dst, t) in body.chunks_exact_mut(4).zip(tokens) {
            dst.copy_from_slice(&t.to_le_bytes());
        }
        BlockHash(xxh3_128_with_seed(&self.scratch, self.seed) & self.mask)
    }
}

/// A secret shared by the processes of one fleet (or kept by one server), from which a key for each
/// purpose is derived (BLAKE3's `derive_key`), so that no two uses share a key.
#[derive(Clone)]
pub struct Secret([u8; 32]);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

impl Secret {
    /// Fewest characters a secret's text may have.
    pub const MIN_CHARS: usize = 32;

    /// A fresh random secret.
    pub fn random() -> Self {
        Self(rand::random())
    }

    /// The secret of a text (a file's or an environment variable's content, surrounding whitespace
    /// ignored), which must have at least [`Secret::MIN_CHARS`] characters: e.g. the output of
    /// `openssl rand -hex 32`.
    pub fn from_text(text: &str) -> Result<Self, String> {
        let text = text.trim();
        let chars = text.chars().count();
        if chars < Self::MIN_CHARS {
            return Err(format!(
                "a secret must have at least {} characters, this one has {chars} (make one with \
                 `openssl rand -hex 32`)",
                Self::MIN_CHARS
            ));
        }
        Ok(Self(blake3::derive_key(
            "kura 2026 secret text",
            text.as_bytes(),
        )))
    }

    /// The secret of 32 raw bytes (as persisted by a server).
    pub fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    /// The raw bytes, for persisting.
    pub fn to_bytes(&self) -> [u8; 32] {
        self.0
    }

    /// The key for `purpose` (a constant string naming one use).
    pub fn derive(&self, purpose: &str) -> [u8; 32] {
        blake3::derive_key(purpose, &self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_depends_on_parent_tokens_and_seed() {
        let mut h = BlockHasher::new(7, 128);
        let root = h.key_hash(&CacheKey::new());
        let a = h.chain(root, &[1, 2, 3, 4]);
        assert_ne!(a, h.chain(root, &[1, 2, 3, 5]));
        assert_ne!(a, h.chain(BlockHash(root.0 ^ 1), &[1, 2, 3, 4]));
        assert_eq!(a, h.chain(root, &[1, 2, 3, 4]));
        let mut other_seed = BlockHasher::new(8, 128);
        assert_ne!(a, other_seed.chain(root, &[1, 2, 3, 4]));
    }

    #[test]
    fn keys_with_different_fields_hash_differently() {
        let mut h = BlockHasher::new(1, 128);
        let plain = h.key_hash(&CacheKey::new());
        let salted = h.key_hash(&CacheKey::new().with_salt("a"));
        let adapter = h.key_hash(&CacheKey::new().with_adapter("a"));
        assert_ne!(plain, salted);
        assert_ne!(salted, adapter, "the field tag is part of the encoding");
    }

    #[test]
    fn a_short_secret_is_refused_with_its_length() {
        let err = Secret::from_text("  short \n").unwrap_err();
        assert!(
            err.contains("at least 32") && err.contains("has 5"),
            "{err}"
        );
        assert_eq!(
            Secret::from_text(&"k".repeat(40)).unwrap().derive("a"),
            Secret::from_text(&format!("{}\n", "k".repeat(40)))
                .unwrap()
                .derive("a")
        );
        let s = Secret::random();
        assert_ne!(s.derive("a"), s.derive("b"));
    }

    #[test]
    fn narrowed_hashes_keep_only_low_bits() {
        let mut h = BlockHasher::new(1, 2);
        for t in 0..50 {
            assert!(h.chain(BlockHash(0), &[t]).0 < 4);
        }
    }
}
