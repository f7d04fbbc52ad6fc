//! `PageRecords`: what the block index remembers of each hashed page, one record a page.
//!
//! A hit compares a page's parent hash and tokens and then reads its hash. Kept in three arrays,
//! that is three cache misses a page once page ids come back in eviction order (as they do in
//! a pool that has been full); kept together it is one record, two adjacent lines at P=16:
//!
//! ```text
//!   record of page i (u32 words):  [ h_i: 8 | h_{i-1}: 8 | tokens: P ]     stride 16 + P
//! ```
//!
//! Records grow with the highest page id hashed (doubling, up to the pool), never reserved for
//! the whole pool up front: a pool sized for the KV tensors costs no token memory until used.
//! Whether a page is hashed, and its content key in the block map (so that eviction finds its
//! entry without reading the record), sit in two small arrays reserved for the pool.

use crate::arena::compare::differ;
use crate::arena::ids::{ArenaId, PageId};
use crate::wire::hash::BlockHash;

/// Records of the hashed pages of a pool of `num_pages` pages of `page_size` tokens.
#[derive(Debug)]
pub struct PageRecords {
    page_size: usize,
    num_pages: usize,
    words: Vec<u32>,
    hashed: Vec<bool>,
    keys: Vec<u64>,
    count: usize,
}

/// Words of a 32-byte hash.
pub const HASH_WORDS: usize = 8;

fn to_words(h: &BlockHash) -> [u32; HASH_WORDS] {
    std::array::from_fn(|i| u32::from_le_bytes(h[4 * i..4 * i + 4].try_into().expect("4 bytes")))
}

fn from_words(w: &[u32]) -> BlockHash {
    let mut h = [0u8; 32];
    for (chunk, word) in h.chunks_exact_mut(4).zip(w) {
        chunk.copy_from_slice(&word.to_le_bytes());
    }
    h
}

impl PageRecords {
    /// No page hashed; the flags and keys for the whole pool (9 bytes a page) are allocated here.
    pub fn try_new(num_pages: usize, page_size: usize) -> crate::error::Result<Self> {
        Ok(PageRecords {
            page_size,
            num_pages,
            words: Vec::new(),
            hashed: crate::error::try_vec(num_pages, false)?,
            keys: crate::error::try_vec(num_pages, 0)?,
            count: 0,
        })
    }

    fn stride(&self) -> usize {
        2 * HASH_WORDS + self.page_size
    }

    fn record(&self, page: PageId) -> &[u32] {
        let s = self.stride();
        &self.words[page.index() * s..(page.index() + 1) * s]
    }

    /// Whether `page` is hashed.
    #[inline]
    pub fn is_hashed(&self, page: PageId) -> bool {
        self.hashed[page.index()]
    }

    /// Number of hashed pages.
    pub fn count(&self) -> usize {
        self.count
    }

    /// The hash `h_i` of a hashed page, `None` for another.
    pub fn hash(&self, page: PageId) -> Option<BlockHash> {
        self.is_hashed(page)
            .then(|| from_words(&self.record(page)[..HASH_WORDS]))
    }

    /// The parent hash `h_{i-1}` of a hashed page.
    pub fn parent(&self, page: PageId) -> BlockHash {
        debug_assert!(self.is_hashed(page));
        from_words(&self.record(page)[HASH_WORDS..2 * HASH_WORDS])
    }

    /// The tokens of a hashed page.
    pub fn tokens(&self, page: PageId) -> &[u32] {
        debug_assert!(self.is_hashed(page));
        &self.record(page)[2 * HASH_WORDS..]
    }

    /// Whether hashed `page` holds `tokens` (a whole page) after the parent hash whose words are
    /// `prev` (see [`PageRecords::words_of`]); if so, its hash's words. Compared by
    /// [`differ`]: two `==` on slices were two memcmp calls a page, a fifth of a 32k hit.
    #[inline]
    pub fn holds(
        &self,
        page: PageId,
        prev: &[u32; HASH_WORDS],
        tokens: &[u32],
    ) -> Option<[u32; HASH_WORDS]> {
        let rec = self.record(page);
        let (hash, rest) = rec.split_at(HASH_WORDS);
        let (parent, toks) = rest.split_at(HASH_WORDS);
        if toks.len() != tokens.len() {
            return None;
        }
        (differ(parent, prev) | differ(toks, tokens) == 0).then(|| std::array::from_fn(|i| hash[i]))
    }

    /// Loads the records of `pages` (those allocated so far), all at once, so that the writes
    /// or reads after it hit the cache.
    #[inline]
    pub fn prefetch(&self, pages: &[PageId]) {
        let s = self.stride();
        let mut acc = 0;
        for page in pages {
            let at = page.index() * s;
            if let Some(rec) = self.words.get(at..at + s) {
                // One word of each cache line of the record.
                for w in rec.iter().step_by(16) {
                    acc ^= w;
                }
                acc ^= rec[s - 1];
            }
        }
        std::hint::black_box(acc);
    }

    /// A hash as the record stores it, for [`PageRecords::holds`].
    pub fn words_of(h: &BlockHash) -> [u32; HASH_WORDS] {
        to_words(h)
    }

    /// The hash whose words are `w` (the inverse of [`PageRecords::words_of`]).
    pub fn hash_of(w: &[u32; HASH_WORDS]) -> BlockHash {
        from_words(w)
    }

    /// The content key a hashed page was entered into the map under.
    pub fn key(&self, page: PageId) -> u64 {
        debug_assert!(self.is_hashed(page));
        self.keys[page.index()]
    }

    /// Records `page` as hashed: `h = H(prev, tokens)`, entered into the map under `key`.
    pub fn set(&mut self, page: PageId, prev: &BlockHash, tokens: &[u32], h: &BlockHash, key: u64) {
        debug_assert!(!self.is_hashed(page) && tokens.len() == self.page_size);
        let s = self.stride();
        let end = (page.index() + 1) * s;
        if self.words.len() < end {
            // Double, up to the whole pool, so growth costs amortized O(1) per page.
            let total = self.num_pages * s;
            let len = end.max(self.words.len().saturating_mul(2).min(total));
            self.words.reserve_exact(len - self.words.len());
            self.words.resize(len, 0);
        }
        let rec = &mut self.words[page.index() * s..end];
        rec[..HASH_WORDS].copy_from_slice(&to_words(h));
        rec[HASH_WORDS..2 * HASH_WORDS].copy_from_slice(&to_words(prev));
        rec[2 * HASH_WORDS..].copy_from_slice(tokens);
        self.hashed[page.index()] = true;
        self.keys[page.index()] = key;
        self.count += 1;
    }

    /// Moves hashed `from`'s record to unhashed `to` (`from` is left unhashed).
    pub fn relocate(&mut self, from: PageId, to: PageId) {
        debug_assert!(self.is_hashed(from) && !self.is_hashed(to));
        let (h, prev, key) = (
            self.hash(from).expect("hashed"),
            self.parent(from),
            self.key(from),
        );
        let tokens = self.tokens(from).to_vec();
        self.clear(from);
        self.set(to, &prev, &tokens, &h, key);
    }

    /// Forgets `page`'s record.
    pub fn clear(&mut self, page: PageId) {
        debug_assert!(self.is_hashed(page), "only hashed pages are cleared");
        self.hashed[page.index()] = false;
        self.count -= 1;
    }

    /// Heap bytes held.
    pub fn heap_bytes(&self) -> usize {
        self.words.capacity() * 4 + self.hashed.capacity() + self.keys.capacity() * 8
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_compare_exactly() {
        let mut r = PageRecords::try_new(10, 3).unwrap();
        let (prev, h): (BlockHash, BlockHash) = (std::array::from_fn(|i| i as u8), [7; 32]);
        assert_eq!(r.hash(PageId(9)), None);
        r.set(PageId(9), &prev, &[1, 2, 3], &h, 77);
        assert_eq!(r.key(PageId(9)), 77);
        assert_eq!((r.hash(PageId(9)), r.parent(PageId(9))), (Some(h), prev));
        assert_eq!(r.tokens(PageId(9)), &[1, 2, 3]);
        let w = PageRecords::words_of(&prev);
        assert_eq!(
            r.holds(PageId(9), &w, &[1, 2, 3]),
            Some(PageRecords::words_of(&h))
        );
        assert_eq!(PageRecords::hash_of(&PageRecords::words_of(&h)), h);
        assert_eq!(r.holds(PageId(9), &w, &[1, 2, 4]), None);
        assert_eq!(r.holds(PageId(9), &w, &[0, 2, 3]), None);
        assert_eq!(r.holds(PageId(9), &w, &[1, 2]), None);
        let mut w2 = w;
        w2[7] ^= 1 << 31;
        assert_eq!(
            r.holds(PageId(9), &w2, &[1, 2, 3]),
            None,
            "the parent's last word counts"
        );
        assert_eq!(
            r.holds(PageId(9), &PageRecords::words_of(&h), &[1, 2, 3]),
            None
        );
        assert_eq!(r.count(), 1);
        r.clear(PageId(9));
        assert!(!r.is_hashed(PageId(9)));
        assert_eq!(r.count(), 0);
    }
}
