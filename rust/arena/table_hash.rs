//! The keys of the two indexes' hash tables and the hashers that place them.
//!
//! [`TokenKeys`] turns a page of tokens (after a 64-bit lead word) into a 64-bit key with a
//! secret per cache, four tokens a folded multiply, as foldhash and wyhash do; the keys are
//! random already, so the radix child maps' hasher ([`MixHasher`]) only places them.

use std::hash::{BuildHasher, Hasher};

/// `a * b` in 128 bits, folded to 64 by xor of its halves.
#[inline]
fn fold_mul(a: u64, b: u64) -> u64 {
    let p = (a as u128) * (b as u128);
    (p as u64) ^ ((p >> 64) as u64)
}

/// A seeded 64-bit key of token pages. The secret is random per instance, so nobody can build
/// prompts whose pages collide or pile into one bucket of a table (hash flooding) without it;
/// users compare the tokens of a candidate exactly, so a chance collision (2^-64 a pair) costs
/// at most a cache hit, never a wrong page.
#[derive(Debug, Clone)]
pub(crate) struct TokenKeys {
    secret: [u64; 4],
}

impl TokenKeys {
    /// Keys with a fresh secret, drawn from the standard library's per-process random keys.
    pub fn random() -> Self {
        let state = std::collections::hash_map::RandomState::new();
        TokenKeys {
            secret: std::array::from_fn(|i| {
                let mut h = state.build_hasher();
                h.write_usize(i);
                h.finish() | 1
            }),
        }
    }

    /// The key of `tokens` after `lead` (a prefix's key, or 0). Each four tokens are one folded
    /// multiply of two secret-mixed words, independent of the others (so they run in parallel),
    /// folded into the state with a rotation that makes their order count; `lead` joins last,
    /// multiplied with the page's state (never xored into a token word, so a prompt built to
    /// cancel a known lead needs the secret). Joining last keeps a chain of keys
    /// (`k_i = key(k_{i-1}, page i)`) one multiply a page deep: the pages' own folds have no
    /// dependence on each other and overlap, where joining first made every fold of a page wait
    /// for the key before it.
    #[inline]
    pub fn key(&self, lead: u64, tokens: &[u32]) -> u64 {
        let s = &self.secret;
        let word = |a: u32, b: u32| (a as u64) << 32 | b as u64;
        let mut h = tokens.len() as u64 ^ s[3];
        let mut quads = tokens.chunks_exact(4);
        for q in &mut quads {
            h = h.rotate_left(23) ^ fold_mul(word(q[0], q[1]) ^ s[0], word(q[2], q[3]) ^ s[1]);
        }
        let rest = quads.remainder();
        if !rest.is_empty() {
            let t = |i: usize| rest.get(i).copied().unwrap_or(0);
            h = h.rotate_left(23) ^ fold_mul(word(t(0), t(1)) ^ s[0], word(t(2), t(3)) ^ s[1]);
        }
        fold_mul(h ^ s[2], lead ^ s[3])
    }
}

/// Radix child keys (`u64`): one multiply and a rotation, enough to spread them over a table.
#[derive(Default)]
pub(crate) struct MixHasher(u64);

impl Hasher for MixHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(b as u64);
        }
    }
    fn write_u64(&mut self, x: u64) {
        self.0 = (self.0 ^ x)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .rotate_left(29);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_depend_on_lead_tokens_order_and_secret() {
        let (a, b) = (TokenKeys::random(), TokenKeys::random());
        let page = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16];
        let k = a.key(7, &page);
        assert_eq!(k, a.key(7, &page));
        assert_ne!(k, a.key(8, &page));
        assert_ne!(k, a.key(7, &page[..15]));
        let mut swapped = page;
        swapped.swap(0, 1);
        assert_ne!(k, a.key(7, &swapped));
        assert_ne!(k, b.key(7, &page), "two instances, two secrets");
        // Every odd length takes its tail into account.
        assert_ne!(a.key(0, &[1, 2, 3]), a.key(0, &[1, 2, 4]));
        assert_ne!(a.key(0, &[1]), a.key(0, &[2]));
    }
}
