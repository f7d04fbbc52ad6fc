//! [`StateDigest`]: the ordered digest behind `state_digest`, and the tests that hold both caches
//! to its contract.

use crate::wire::hash::Namespace;

/// An ordered 64-bit digest with fixed keys: the same words give the same value in every
/// process (unlike the per-cache keys of the hash tables).
#[derive(Debug, Clone)]
pub struct StateDigest {
    h: u64,
}

impl Default for StateDigest {
    fn default() -> Self {
        StateDigest {
            h: 0x243F_6A88_85A3_08D3,
        }
    }
}

impl StateDigest {
    const K0: u64 = 0x9E37_79B9_7F4A_7C15;
    const K1: u64 = 0xBF58_476D_1CE4_E5B9;

    /// Mixes in one word.
    #[inline]
    pub fn word(&mut self, w: u64) {
        let p = ((self.h ^ w ^ Self::K0) as u128) * (Self::K1 as u128);
        self.h = (p as u64) ^ ((p >> 64) as u64) ^ w.rotate_left(17);
    }

    /// Mixes in a length-prefixed run of tokens, two a word.
    pub fn tokens(&mut self, tokens: &[u32]) {
        self.word(tokens.len() as u64);
        for pair in tokens.chunks(2) {
            let hi = pair.get(1).map_or(u32::MAX as u64, |&t| t as u64);
            self.word((pair[0] as u64) << 32 | hi);
        }
    }

    /// Mixes in a length-prefixed run of bytes, eight a word.
    pub fn bytes(&mut self, bytes: &[u8]) {
        self.word(bytes.len() as u64);
        for chunk in bytes.chunks(8) {
            let mut w = [0u8; 8];
            w[..chunk.len()].copy_from_slice(chunk);
            self.word(u64::from_le_bytes(w));
        }
    }

    /// Mixes in a namespace (none and empty differ).
    pub fn namespace(&mut self, ns: &Namespace) {
        match ns {
            None => self.word(u64::MAX),
            Some(b) => self.bytes(b),
        }
    }

    /// Mixes in a length-prefixed run of page ids.
    pub fn pages(&mut self, pages: &[crate::arena::ids::PageId]) {
        self.word(pages.len() as u64);
        for pair in pages.chunks(2) {
            let hi = pair.get(1).map_or(u32::MAX as u64, |p| p.0 as u64);
            self.word((pair[0].0 as u64) << 32 | hi);
        }
    }

    /// The digest so far.
    pub fn finish(&self) -> u64 {
        let p = ((self.h ^ Self::K1) as u128) * (Self::K0 as u128);
        (p as u64) ^ ((p >> 64) as u64)
    }
}

/// `state_digest` of both caches (the same driver for each).
#[cfg(test)]
mod tests {
    use crate::cache::PrefixCache;
    use crate::wire::hash::Namespace;
    use crate::{BlockCache, RadixCache};

    type Make = fn() -> Box<dyn PrefixCache>;

    fn makers() -> [(&'static str, Make); 2] {
        [
            ("radix", || Box::new(RadixCache::new(12, 2).unwrap())),
            ("block", || Box::new(BlockCache::new(12, 2).unwrap())),
        ]
    }

    fn ns(name: &str) -> Namespace {
        Some(name.as_bytes().into())
    }

    fn run(c: &mut dyn PrefixCache, tokens: &[u32], namespace: Namespace) {
        let r = c.admit(tokens, namespace).unwrap();
        c.commit(r, tokens.len()).unwrap();
        c.finish(r).unwrap();
    }

    /// Shared prefixes, two namespaces, a live request, and eviction by allocation and by call.
    fn script(c: &mut dyn PrefixCache) {
        run(c, &[1, 2, 3, 4, 5, 6, 7], None);
        run(c, &[1, 2, 3, 4, 9, 9, 9], None);
        run(c, &[1, 2, 3, 4, 5], ns("a"));
        let live = c.admit(&[1, 2, 3, 4, 8, 8, 1], None).unwrap();
        c.commit(live, 4).unwrap();
        run(c, &[20, 21, 22, 23, 24], None);
        assert_eq!(c.evict(1), 1);
        c.check().unwrap();
    }

    #[test]
    fn equal_for_caches_driven_alike_whatever_their_secrets() {
        for (kind, make) in makers() {
            let (mut a, mut b) = (make(), make());
            assert_eq!(a.state_digest(), b.state_digest(), "{kind}: empty");
            script(&mut *a);
            script(&mut *b);
            let d = a.state_digest();
            assert_eq!(d, b.state_digest(), "{kind}");
            // Reading changes nothing.
            a.match_prefix(&[1, 2, 3, 4, 5, 6, 7], &None).unwrap();
            assert_eq!(
                a.state_digest(),
                d,
                "{kind}: match_prefix changed the digest"
            );
            assert_ne!(
                d,
                make().state_digest(),
                "{kind}: a driven cache digests as empty"
            );
        }
    }

    #[test]
    fn differs_after_any_decision_differs() {
        // Each variant makes one decision differently after the same script.
        type Variant = fn(&mut dyn PrefixCache);
        let variants: [(&str, Variant); 6] = [
            ("evict one more page", |c| assert_eq!(c.evict(1), 1)),
            // Only the LRU order moves: no page changes hands.
            ("touch a cached prompt", |c| {
                let r = c.admit(&[1, 2, 3, 4, 5], ns("a")).unwrap();
                c.abort(r).unwrap();
            }),
            ("pin a cached prefix", |c| {
                c.admit(&[1, 2, 3, 4, 5], ns("a")).unwrap();
            }),
            ("same tokens, other namespace", |c| {
                run(c, &[30, 31, 32, 33, 1], ns("b"))
            }),
            ("other tokens, same shape", |c| {
                run(c, &[30, 31, 34, 33, 1], ns("c"))
            }),
            ("reset", |c| assert!(c.reset() > 0)),
        ];
        for (kind, make) in makers() {
            let mut base = make();
            script(&mut *base);
            run(&mut *base, &[30, 31, 32, 33, 1], ns("c"));
            let mut seen = vec![base.state_digest()];
            for (name, variant) in variants {
                let mut c = make();
                script(&mut *c);
                variant(&mut *c);
                c.check().unwrap();
                let d = c.state_digest();
                assert!(!seen.contains(&d), "{kind}: {name} left the digest equal");
                seen.push(d);
            }
        }
    }
}
