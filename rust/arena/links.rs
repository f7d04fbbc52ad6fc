//! Intrusive doubly linked lists over the ids of one arena.
//!
//! One [`Links`] holds the `prev`/`next` pair of every element and a fixed number of lists, each
//! with its own sentinel. An element is in at most one list at a time. Push, pop and removal from
//! the middle are O(1) and allocate nothing (the arrays grow only when the id space does).
//!
//! ```text
//!   index:   0 .. num_lists          num_lists + id
//!            sentinels (one a list)  elements
//!   sentinel.next = front (least recently pushed to the back), sentinel.prev = back
//! ```

use crate::arena::ids::ArenaId;
use std::marker::PhantomData;

const UNLINKED: u32 = u32::MAX;

/// Which of a [`Links`]'s lists.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ListId(pub u32);

/// The neighbours of one slot. Kept together, so that an unlink touches one cache line a
/// neighbour rather than two.
#[derive(Debug, Clone, Copy)]
struct Link {
    prev: u32,
    next: u32,
}

const FREE_LINK: Link = Link {
    prev: UNLINKED,
    next: UNLINKED,
};

/// Storage for a few intrusive lists over the ids `0..capacity`.
#[derive(Debug, Clone)]
pub struct Links<T> {
    links: Vec<Link>,
    lens: Vec<usize>,
    id: PhantomData<T>,
}

impl<T: ArenaId> Links<T> {
    /// `num_lists` empty lists over ids `0..capacity`.
    pub fn new(num_lists: u32, capacity: usize) -> Self {
        Self::try_new(num_lists, capacity).expect("links allocated")
    }

    /// `num_lists` empty lists over ids `0..capacity`, or an error when they cannot be allocated.
    pub fn try_new(num_lists: u32, capacity: usize) -> crate::error::Result<Self> {
        let n = num_lists as usize;
        let mut links = crate::error::try_vec(n.saturating_add(capacity), FREE_LINK)?;
        for (s, link) in links.iter_mut().enumerate().take(n) {
            *link = Link {
                prev: s as u32,
                next: s as u32,
            };
        }
        Ok(Links {
            links,
            lens: vec![0; n],
            id: PhantomData,
        })
    }

    fn base(&self) -> u32 {
        self.lens.len() as u32
    }

    /// Makes room for ids `0..capacity`.
    pub fn ensure(&mut self, capacity: usize) {
        let want = self.lens.len() + capacity;
        if self.links.len() < want {
            self.links.resize(want, FREE_LINK);
        }
    }

    /// Number of elements in `list`.
    pub fn len(&self, list: ListId) -> usize {
        self.lens[list.0 as usize]
    }

    /// Whether `id` is in some list.
    pub fn is_linked(&self, id: T) -> bool {
        self.links[(self.base() + id.raw()) as usize].next != UNLINKED
    }

    fn link_after(&mut self, list: ListId, at: u32, id: T) {
        let i = self.base() + id.raw();
        debug_assert_eq!(
            self.links[i as usize].next, UNLINKED,
            "{id:?} is linked already"
        );
        let after = self.links[at as usize].next;
        self.links[i as usize].prev = at;
        self.links[i as usize].next = after;
        self.links[at as usize].next = i;
        self.links[after as usize].prev = i;
        self.lens[list.0 as usize] += 1;
    }

    /// Appends `id` at the back of `list`.
    pub fn push_back(&mut self, list: ListId, id: T) {
        let back = self.links[list.0 as usize].prev;
        self.link_after(list, back, id);
    }

    /// Puts `id` at the front of `list`.
    pub fn push_front(&mut self, list: ListId, id: T) {
        self.link_after(list, list.0, id);
    }

    /// Inserts `id` right before the element `before` (which must be in `list`).
    pub fn insert_before(&mut self, list: ListId, before: T, id: T) {
        let at = self.links[(self.base() + before.raw()) as usize].prev;
        self.link_after(list, at, id);
    }

    /// Unlinks `id` from `list`, which must hold it.
    pub fn remove(&mut self, list: ListId, id: T) {
        let i = (self.base() + id.raw()) as usize;
        let (p, n) = (self.links[i].prev, self.links[i].next);
        debug_assert_ne!(n, UNLINKED, "{id:?} is not linked");
        self.links[p as usize].next = n;
        self.links[n as usize].prev = p;
        self.links[i].prev = UNLINKED;
        self.links[i].next = UNLINKED;
        self.lens[list.0 as usize] -= 1;
    }

    fn element(&self, index: u32) -> Option<T> {
        (index >= self.base()).then(|| T::from_raw(index - self.base()))
    }

    /// The front element of `list`.
    pub fn front(&self, list: ListId) -> Option<T> {
        self.element(self.links[list.0 as usize].next)
    }

    /// The element after `id` in its list.
    pub fn next_of(&self, id: T) -> Option<T> {
        self.element(self.links[(self.base() + id.raw()) as usize].next)
    }

    /// The back element of `list`.
    pub fn back(&self, list: ListId) -> Option<T> {
        self.element(self.links[list.0 as usize].prev)
    }

    /// The element before `id` in its list.
    pub fn prev_of(&self, id: T) -> Option<T> {
        self.element(self.links[(self.base() + id.raw()) as usize].prev)
    }

    /// Removes and returns the front element of `list`.
    pub fn pop_front(&mut self, list: ListId) -> Option<T> {
        let id = self.front(list)?;
        self.remove(list, id);
        Some(id)
    }

    /// The elements of `list`, front to back.
    pub fn iter(&self, list: ListId) -> impl Iterator<Item = T> + '_ {
        std::iter::successors(self.front(list), move |&id| self.next_of(id))
    }

    /// Heap bytes held.
    pub fn heap_bytes(&self) -> usize {
        self.links.capacity() * std::mem::size_of::<Link>() + self.lens.capacity() * 8
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arena::ids::PageId;

    const A: ListId = ListId(0);
    const B: ListId = ListId(1);

    #[test]
    fn push_pop_remove_keep_order() {
        let mut l = Links::<PageId>::new(2, 8);
        for id in [3, 1, 4] {
            l.push_back(A, PageId(id));
        }
        l.push_front(A, PageId(5));
        l.push_back(B, PageId(0));
        assert_eq!(
            l.iter(A).collect::<Vec<_>>(),
            vec![PageId(5), PageId(3), PageId(1), PageId(4)]
        );
        l.remove(A, PageId(1));
        assert!(!l.is_linked(PageId(1)));
        l.insert_before(A, PageId(4), PageId(7));
        assert_eq!(
            l.iter(A).collect::<Vec<_>>(),
            vec![PageId(5), PageId(3), PageId(7), PageId(4)]
        );
        assert_eq!(l.pop_front(A), Some(PageId(5)));
        assert_eq!(l.len(A), 3);
        assert_eq!(l.iter(B).collect::<Vec<_>>(), vec![PageId(0)]);
        l.ensure(20);
        l.push_back(B, PageId(19));
        assert_eq!(l.iter(B).collect::<Vec<_>>(), vec![PageId(0), PageId(19)]);
        assert_eq!(l.pop_front(B), Some(PageId(0)));
        assert_eq!(l.pop_front(B), Some(PageId(19)));
        assert_eq!(l.pop_front(B), None);
        assert_eq!(l.len(B), 0);
    }
}
