//! Typed ids of the two arenas a cache indexes into: pages of the pool and nodes of a radix
//! tree. A bare `u32` would not say which arena it belongs to.

/// An id that indexes an arena: a `u32` underneath.
pub trait ArenaId: Copy + Eq + std::fmt::Debug {
    /// The id of arena slot `raw`.
    fn from_raw(raw: u32) -> Self;
    /// The arena slot.
    fn raw(self) -> u32;
    /// The arena slot, for indexing.
    fn index(self) -> usize {
        self.raw() as usize
    }
}

/// A physical page of the pool: `page_size` KV slots starting at slot `id * page_size`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct PageId(pub u32);

impl ArenaId for PageId {
    fn from_raw(raw: u32) -> Self {
        PageId(raw)
    }
    fn raw(self) -> u32 {
        self.0
    }
}

impl std::fmt::Display for PageId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}
