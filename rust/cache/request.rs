//! Live requests: a slab of records addressed by generation-checked ids, and the read-only view
//! callers get of one.
//!
//! A [`RequestId`] names its cache and a slot's generation, so a closed request or a request of
//! another cache is detected and refused, never silently aliased to whatever reuses the slot.

pub use crate::arena::ids::PageId;
use crate::error::{Error, Result};
use std::sync::atomic::{AtomicU32, Ordering};

use crate::wire::hash::{BlockHash, Namespace};

/// A read-only view of one live request.
#[derive(Debug, Clone, Copy)]
pub struct RequestView<'a> {
    /// Token ids so far.
    pub tokens: &'a [u32],
    /// Namespace the request was admitted in.
    pub namespace: &'a Namespace,
    /// Page table, `ceil(num_tokens / page_size)` entries.
    pub pages: &'a [PageId],
    /// Tokens served from the cache at admission.
    pub num_cached: usize,
    /// Tokens whose KV has been written.
    pub num_computed: usize,
    /// Tokens per page.
    pub page_size: usize,
    /// With a window group: one window page per page, [`GONE`] where
    /// released (empty without one).
    pub window_pages: &'a [u32],
    /// With state slots: tokens the KV match ran to at admission (`num_cached` or more: the hit
    /// ends at the last snapshot, the KV may run further); `num_cached` without them.
    pub kv_matched: usize,
    /// With state slots: the slot of the snapshot the hit ended at, pinned until released
    /// (`None`: no hit, or released).
    pub state_slot: Option<u32>,
}

impl RequestView<'_> {
    /// Tokens in the request so far.
    pub fn num_tokens(&self) -> usize {
        self.tokens.len()
    }

    /// Slot of token `i`: `pages[i / P] * P + i % P`.
    pub fn slot(&self, i: usize) -> i64 {
        let p = self.page_size;
        self.pages[i / p].0 as i64 * p as i64 + (i % p) as i64
    }

    /// Slots of tokens `start..end`, appended to `out`.
    pub fn extend_slots(&self, start: usize, end: usize, out: &mut Vec<i64>) {
        if self.page_size == 1 {
            out.extend(self.pages[start..end].iter().map(|x| x.0 as i64));
        } else {
            out.extend((start..end).map(|i| self.slot(i)));
        }
    }
}

/// A request's entry for a page whose window page it released.
pub const GONE: u32 = u32::MAX;

/// A live request's part of the window group.
#[derive(Debug, Clone, Default)]
pub struct WindowPages {
    /// One entry per page of the request: its window page, [`GONE`] once released.
    pub pages: Vec<u32>,
    /// Pages `0..lo` are released; `lo..` are held.
    pub lo: usize,
    /// Block keys of the request's first `keys.len()` pages: those the window group has seen
    /// published (the same count as the request's `published / P`).
    pub keys: Vec<BlockHash>,
}

static NEXT_CACHE_ID: AtomicU32 = AtomicU32::new(1);

/// A fresh id for a new cache.
pub(crate) fn new_cache_id() -> u32 {
    NEXT_CACHE_ID.fetch_add(1, Ordering::Relaxed)
}

/// Handle of a live request inside one cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RequestId {
    cache: u32,
    slot: u32,
    generation: u32,
}

/// What every cache keeps of a request; `X` is the index's own part.
#[derive(Debug, Clone)]
pub struct Request<X> {
    /// Token ids so far.
    pub tokens: Vec<u32>,
    /// Namespace the request was admitted in.
    pub namespace: Namespace,
    /// Page table: `ceil(tokens / page_size)` page ids. Entries never change once set.
    pub pages: Vec<PageId>,
    /// Tokens served from the cache at admission.
    pub num_cached: usize,
    /// Tokens whose KV has been written.
    pub num_computed: usize,
    /// Tokens whose pages the index has seen published (page aligned, `<= num_computed`).
    pub published: usize,
    /// The index's own state of this request.
    pub ext: X,
    /// The request's window pages (empty without a window group).
    pub win: WindowPages,
    /// The request's state-slot pins and pending snapshots (empty without state slots).
    pub states: crate::cache::states::StateRefs,
}

impl<X> Request<X> {
    /// A read-only view for callers outside the cache.
    pub fn view(&self, page_size: usize) -> RequestView<'_> {
        RequestView {
            tokens: &self.tokens,
            namespace: &self.namespace,
            pages: &self.pages,
            num_cached: self.num_cached,
            num_computed: self.num_computed,
            page_size,
            window_pages: &self.win.pages,
            kv_matched: self.states.kv_matched.max(self.num_cached),
            state_slot: self.states.hit,
        }
    }
}

#[derive(Debug, Clone)]
struct Slot<X> {
    generation: u32,
    request: Option<Request<X>>,
}

/// The live requests of one cache.
#[derive(Debug, Clone)]
pub struct Requests<X> {
    cache: u32,
    slots: Vec<Slot<X>>,
    vacant: Vec<u32>,
}

impl<X> Requests<X> {
    /// An empty registry for the cache `cache`.
    pub fn new(cache: u32) -> Self {
        Requests {
            cache,
            slots: Vec::new(),
            vacant: Vec::new(),
        }
    }

    /// Stores `request` and returns its id.
    pub fn insert(&mut self, request: Request<X>) -> RequestId {
        let slot = match self.vacant.pop() {
            Some(s) => s,
            None => {
                self.slots.push(Slot {
                    generation: 0,
                    request: None,
                });
                (self.slots.len() - 1) as u32
            }
        };
        let s = &mut self.slots[slot as usize];
        s.request = Some(request);
        RequestId {
            cache: self.cache,
            slot,
            generation: s.generation,
        }
    }

    fn slot(&self, id: RequestId) -> Result<usize> {
        if id.cache != self.cache {
            return Err(Error::ForeignRequest);
        }
        match self.slots.get(id.slot as usize) {
            Some(s) if s.generation == id.generation && s.request.is_some() => Ok(id.slot as usize),
            _ => Err(Error::ClosedRequest),
        }
    }

    /// The live request `id`.
    pub fn get(&self, id: RequestId) -> Result<&Request<X>> {
        let i = self.slot(id)?;
        Ok(self.slots[i].request.as_ref().expect("slot checked live"))
    }

    /// The live request `id`, mutably.
    pub fn get_mut(&mut self, id: RequestId) -> Result<&mut Request<X>> {
        let i = self.slot(id)?;
        Ok(self.slots[i].request.as_mut().expect("slot checked live"))
    }

    /// Closes `id` and returns its record; the id is dead from now on.
    pub fn remove(&mut self, id: RequestId) -> Result<Request<X>> {
        let i = self.slot(id)?;
        let s = &mut self.slots[i];
        s.generation = s.generation.wrapping_add(1);
        self.vacant.push(i as u32);
        Ok(s.request.take().expect("slot checked live"))
    }

    /// Every live request.
    pub fn iter(&self) -> impl Iterator<Item = &Request<X>> + '_ {
        self.slots.iter().filter_map(|s| s.request.as_ref())
    }

    /// Number of live requests.
    pub fn len(&self) -> usize {
        self.slots.len() - self.vacant.len()
    }

    /// Whether no request is live.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req() -> Request<()> {
        Request {
            tokens: vec![1],
            namespace: None,
            pages: vec![PageId(0)],
            num_cached: 0,
            num_computed: 0,
            published: 0,
            ext: (),
            win: Default::default(),
            states: Default::default(),
        }
    }

    #[test]
    fn closed_and_foreign_ids_are_refused() {
        let mut a = Requests::new(1);
        let mut b = Requests::<()>::new(2);
        let id = a.insert(req());
        assert!(a.get(id).is_ok());
        assert_eq!(b.get(id).unwrap_err(), Error::ForeignRequest);
        a.remove(id).unwrap();
        assert_eq!(a.get(id).unwrap_err(), Error::ClosedRequest);
        let id2 = a.insert(req());
        // Same slot, new generation: the old handle stays dead.
        assert_eq!(a.get(id).unwrap_err(), Error::ClosedRequest);
        assert!(a.get(id2).is_ok());
        assert_eq!(a.len(), 1);
        let _ = b.insert(req());
    }
}
