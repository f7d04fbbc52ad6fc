//! The set of free pages of a [`crate::RadixCache`]: a two-level bitmap.
//!
//! An eighth of a byte a page (plus 1/4096 for the summary), so the pool's bookkeeping costs
//! almost nothing next to the 8 bytes a cached token takes in the tree. `pop` hands out the
//! lowest free id, which keeps page ids deterministic and dense.

use crate::arena::ids::PageId;

/// A set of page ids `0..capacity` with O(1) insert and an amortized O(1) `pop` of the smallest
/// member.
#[derive(Debug, Clone)]
pub struct FreeSet {
    words: Vec<u64>,
    summary: Vec<u64>,
    /// Every summary word below this index is zero, so `pop` starts its scan here. Pops only
    /// raise it and inserts only lower it, so a run of allocations scans each word once.
    low: usize,
    len: usize,
    capacity: usize,
}

impl FreeSet {
    /// A set holding every id in `0..capacity`.
    #[cfg(test)]
    pub fn full(capacity: usize) -> Self {
        Self::try_full(capacity).expect("free set allocated")
    }

    /// A set holding every id in `0..capacity`, or an error when it cannot be allocated.
    pub fn try_full(capacity: usize) -> crate::error::Result<Self> {
        let nwords = capacity.div_ceil(64);
        let mut words = crate::error::try_vec(nwords, u64::MAX)?;
        if capacity % 64 != 0 {
            words[nwords - 1] = (1u64 << (capacity % 64)) - 1;
        }
        let nsum = nwords.div_ceil(64);
        let mut summary = crate::error::try_vec(nsum, 0u64)?;
        for (w, &bits) in words.iter().enumerate() {
            if bits != 0 {
                summary[w / 64] |= 1 << (w % 64);
            }
        }
        Ok(FreeSet {
            words,
            summary,
            low: 0,
            len: capacity,
            capacity,
        })
    }

    /// Number of members.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether `id` is a member.
    pub fn contains(&self, page: PageId) -> bool {
        let id = page.0 as usize;
        id < self.capacity && self.words[id / 64] & (1 << (id % 64)) != 0
    }

    /// Adds `id`, which must not be a member (what `insert_all(&[id])` does).
    #[cfg(test)]
    pub fn insert(&mut self, page: PageId) {
        debug_assert!(page.0 < self.capacity as u32 && !self.contains(page));
        let id = page.0 as usize;
        let w = id / 64;
        self.words[w] |= 1 << (id % 64);
        self.summary[w / 64] |= 1 << (w % 64);
        self.low = self.low.min(w / 64);
        self.len += 1;
    }

    /// Removes and returns the smallest member (what `pop_many(1, ..)` takes).
    #[cfg(test)]
    pub fn pop(&mut self) -> Option<PageId> {
        let s = self.low + self.summary[self.low..].iter().position(|&s| s != 0)?;
        self.low = s;
        let w = s * 64 + self.summary[s].trailing_zeros() as usize;
        let bit = self.words[w].trailing_zeros() as usize;
        self.words[w] &= self.words[w] - 1;
        if self.words[w] == 0 {
            self.summary[s] &= !(1 << (w % 64));
        }
        self.len -= 1;
        Some(PageId((w * 64 + bit) as u32))
    }

    /// Adds every page of `pages` (distinct non-members), a bitmap word at a time: the bits of
    /// consecutive ids that share a word are gathered before the word is written.
    pub fn insert_all(&mut self, pages: &[PageId]) {
        let (mut word, mut bits) = (usize::MAX, 0u64);
        for &page in pages {
            debug_assert!(page.0 < self.capacity as u32 && !self.contains(page));
            let id = page.0 as usize;
            if id / 64 != word {
                self.set_bits(word, bits);
                (word, bits) = (id / 64, 0);
            }
            debug_assert_eq!(bits & 1 << (id % 64), 0, "page {id} given twice");
            bits |= 1 << (id % 64);
        }
        self.set_bits(word, bits);
        self.len += pages.len();
    }

    fn set_bits(&mut self, w: usize, bits: u64) {
        if bits == 0 {
            return;
        }
        self.words[w] |= bits;
        self.summary[w / 64] |= 1 << (w % 64);
        self.low = self.low.min(w / 64);
    }

    /// Removes the `count` smallest members into `out`, in increasing order: what `count` calls
    /// of [`FreeSet::pop`] would return, taken a bitmap word at a time (a word of free pages is
    /// one run of 64 ids). Panics if fewer than `count` are members.
    pub fn pop_many(&mut self, count: usize, out: &mut Vec<PageId>) {
        assert!(
            count <= self.len,
            "pop_many({count}) of a set of {}",
            self.len
        );
        out.reserve(count);
        let mut left = count;
        while left > 0 {
            let s = self.low
                + self.summary[self.low..]
                    .iter()
                    .position(|&s| s != 0)
                    .expect("len counted");
            self.low = s;
            let w = s * 64 + self.summary[s].trailing_zeros() as usize;
            let mut bits = self.words[w];
            let base = (w * 64) as u32;
            if bits == u64::MAX && left >= 64 {
                out.extend((base..base + 64).map(PageId));
                bits = 0;
                left -= 64;
            } else {
                while bits != 0 && left > 0 {
                    out.push(PageId(base + bits.trailing_zeros()));
                    bits &= bits - 1;
                    left -= 1;
                }
            }
            self.words[w] = bits;
            if bits == 0 {
                self.summary[s] &= !(1 << (w % 64));
            }
        }
        self.len -= count;
    }

    /// Heap bytes held.
    pub fn heap_bytes(&self) -> usize {
        (self.words.capacity() + self.summary.capacity()) * 8
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pops_smallest_first_and_reuses() {
        let mut f = FreeSet::full(130);
        assert_eq!(f.len(), 130);
        let got: Vec<u32> = (0..130).map(|_| f.pop().unwrap().0).collect();
        assert_eq!(got, (0..130).collect::<Vec<_>>());
        assert_eq!(f.pop(), None);
        f.insert(PageId(129));
        f.insert(PageId(5));
        f.insert(PageId(64));
        assert!(f.contains(PageId(64)) && !f.contains(PageId(63)));
        assert_eq!(f.pop(), Some(PageId(5)));
        assert_eq!(f.pop(), Some(PageId(64)));
        assert_eq!(f.pop(), Some(PageId(129)));
        assert_eq!(f.len(), 0);
    }

    #[test]
    fn pop_many_takes_what_pops_would() {
        // A set with holes of every shape: full words, partial words, empty summary words.
        let mut set = FreeSet::full(10_000);
        let mut taken = Vec::new();
        set.pop_many(9_000, &mut taken);
        assert_eq!(taken, (0..9_000).map(PageId).collect::<Vec<_>>());
        let mut x = 12345u64;
        for &page in &taken {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            if x >> 62 != 0 {
                set.insert(page);
            }
        }
        for count in [0, 1, 63, 64, 65, 130, 4096, 500] {
            let mut by_pop = set.clone();
            let want: Vec<PageId> = (0..count).map(|_| by_pop.pop().unwrap()).collect();
            let mut got = Vec::new();
            set.pop_many(count, &mut got);
            assert_eq!(got, want, "pop_many({count})");
            assert_eq!(set.len(), by_pop.len());
            assert_eq!(set.pop(), by_pop.pop());
        }
    }

    #[test]
    fn insert_all_adds_what_inserts_would() {
        let mut a = FreeSet::full(5_000);
        let mut all = Vec::new();
        a.pop_many(5_000, &mut all);
        let mut b = a.clone();
        // Runs, a full aligned word, scattered ids and a descending stretch.
        let mut pages: Vec<PageId> = (100..300).chain(4_032..4_096).map(PageId).collect();
        pages.extend([7, 4_999, 64, 65, 3_000].map(PageId));
        pages.extend((1_000..1_100).rev().map(PageId));
        for &p in &pages {
            a.insert(p);
        }
        b.insert_all(&pages);
        assert_eq!(a.len(), b.len());
        let (mut x, mut y) = (Vec::new(), Vec::new());
        a.pop_many(a.len(), &mut x);
        b.pop_many(b.len(), &mut y);
        assert_eq!(x, y);
        assert_eq!(b.pop(), None);
    }

    #[test]
    fn large_pools_span_summary_words() {
        let mut f = FreeSet::full(10_000);
        for _ in 0..9_000 {
            f.pop();
        }
        assert_eq!(f.pop(), Some(PageId(9_000)));
        f.insert(PageId(4097));
        assert_eq!(f.pop(), Some(PageId(4097)));
    }
}
