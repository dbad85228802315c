//! Block names shared by a fleet: keyed BLAKE3 over the chain of a prefix's blocks, with a key derived
//! from the fleet's [`Secret`], so that replicas, a router and a shared tier name a prefix alike while
//! nobody without the secret can compute a prompt's names or learn anything from them.

use kura_kv::{CacheKey, Secret};

/// Names blocks by content with a key: a root is named by its [`CacheKey`], every other block by
/// `MAC(its parent's name ‖ its token ids)`, truncated to 128 bits (keyed BLAKE3). Processes that share
/// the key (a fleet's replicas, its router, its shared tier) name equal prefixes under equal keys alike,
/// whatever their own per-process hash seeds; without the key a name reveals nothing of the tokens or
/// the tenant, and nobody can compute the name a prompt will have.
///
/// Cost: one keyed BLAKE3 pass over `17 + 4 * block_size` bytes per block.
#[derive(Clone)]
pub struct ContentNamer {
    key: [u8; 32],
    scratch: Vec<u8>,
}

impl std::fmt::Debug for ContentNamer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ContentNamer(..)")
    }
}

fn mac128(key: &[u8; 32], bytes: &[u8]) -> u128 {
    let mut first = [0u8; 16];
    first.copy_from_slice(&blake3::keyed_hash(key, bytes).as_bytes()[..16]);
    u128::from_le_bytes(first)
}

impl ContentNamer {
    /// The purpose a fleet secret's naming key is derived for.
    pub const PURPOSE: &'static str = "kura 2026 kv block content names";

    /// A namer with the naming key of `secret`.
    pub fn new(secret: &Secret) -> Self {
        Self {
            key: secret.derive(Self::PURPOSE),
            scratch: Vec::with_capacity(17 + 4 * 256),
        }
    }

    /// The name of the root of sequences under `key`.
    pub fn root(&mut self, key: &CacheKey) -> u128 {
        self.scratch.clear();
        self.scratch.push(0);
        key.encode(&mut self.scratch);
        mac128(&self.key, &self.scratch)
    }

    /// The name of a full block of `tokens` whose parent is named `parent`.
    pub fn chain(&mut self, parent: u128, tokens: &[u32]) -> u128 {
        self.scratch.clear();
        self.scratch.push(1);
        self.scratch.extend_from_slice(&parent.to_le_bytes());
        for t in tokens {
            self.scratch.extend_from_slice(&t.to_le_bytes());
        }
        mac128(&self.key, &self.scratch)
    }

    /// The names of the whole blocks of `tokens` under `key` (a trailing partial block has none).
    pub fn chain_blocks(&mut self, key: &CacheKey, tokens: &[u32], block_size: usize) -> Vec<u128> {
        let mut parent = self.root(key);
        tokens
            .chunks_exact(block_size.max(1))
            .map(|block| {
                parent = self.chain(parent, block);
                parent
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_names_depend_on_the_secret_the_key_and_every_token() {
        let secret = Secret::from_text(&"s".repeat(32)).unwrap();
        let mut a = ContentNamer::new(&secret);
        let mut b = ContentNamer::new(&secret);
        let key = CacheKey::new().with_salt("tenant");
        let tokens: Vec<u32> = (0..8).collect();
        let names = a.chain_blocks(&key, &tokens, 4);
        assert_eq!(
            names,
            b.chain_blocks(&key, &tokens, 4),
            "the same secret names alike"
        );
        assert_eq!(names[1], a.chain(names[0], &tokens[4..]));
        let mut other = ContentNamer::new(&Secret::from_text(&"t".repeat(32)).unwrap());
        assert_ne!(names, other.chain_blocks(&key, &tokens, 4));
        assert_ne!(names, a.chain_blocks(&CacheKey::new(), &tokens, 4));
        let mut changed = tokens.clone();
        changed[6] = 99;
        let moved = a.chain_blocks(&key, &changed, 4);
        assert_eq!((moved[0] == names[0], moved[1] == names[1]), (true, false));
        // A root's name and a block's name come from inputs of different tags.
        assert_ne!(a.root(&CacheKey::new()), a.chain(0, &[]));
    }
}
