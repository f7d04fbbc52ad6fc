//! What the two indexes really differ in: one short trait, [`Index`].
//!
//! The request life cycle (admit, extend, commit, finish, abort, stats, the argument checks) is
//! written once in [`crate::cache::Cache`], generic over an `Index`. An index only answers how a
//! prefix is found, pinned, published, released and evicted:
//!
//! | operation  | `RadixIndex` (radix tree)                  | `BlockIndex` (chained block hashes)     |
//! |------------|--------------------------------------------|-----------------------------------------|
//! | `lookup`   | walk the tree, one child probe per edge    | hash page by page until the first miss  |
//! | `pin`      | split a partly matched edge, lock the path | refcount each hit page                  |
//! | `publish`  | insert the request's pages below its node  | enter each page under its block hash    |
//! | `release`  | unlock the path, free private pages        | unpin the chain tail first              |
//! | `evict`    | least recently used leaf, page by page     | least recently released page            |

use crate::cache::request::{PageId, Request, Requests};
use crate::error::Result;
use crate::wire::events::EventLog;
use crate::wire::hash::BlockHash;
use crate::wire::hash::Namespace;

/// Eviction classes of cached pages: `0..CLASSES`, 0 evicted first (see SEMANTICS.md).
pub const CLASSES: u8 = 4;

/// The longest cached prefix a lookup found, before anything is pinned.
#[derive(Debug)]
pub struct Found<F> {
    /// Tokens matched (whole pages).
    pub matched: usize,
    /// Of the matched pages, how many are evictable device pages now (pinning them makes them
    /// unavailable).
    pub evictable: usize,
    /// Of the matched pages, how many are on the host tier (each needs a device page to come
    /// back into).
    pub host: usize,
    /// The index's own record of where the match ended.
    pub at: F,
}

/// Where a step-by-step match stands: how many tokens matched so far, and the index position to
/// continue from. Valid only while the cache is unchanged (the scheduler holds the cache's lock
/// for a whole ranking pass).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cursor {
    /// Tokens matched so far.
    pub matched: usize,
    pub(crate) at: CursorAt,
}

/// An index's position inside a match.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CursorAt {
    /// Radix: `offset` tokens into the edge of `node` (`None`: the namespace has no root).
    Node { node: Option<u32>, offset: usize },
    /// Block: the hash and the content key of the prefix matched so far.
    Hash(BlockHash, u64),
}

/// The part of a prefix cache that differs between a radix tree and a block-hash map. Every
/// method is called with arguments the life cycle has checked already, and none can fail.
pub trait Index: Send + std::fmt::Debug {
    /// The index's own state of a live request.
    type Ext: std::fmt::Debug + Send;
    /// Where a lookup ended, handed back to [`Index::pin`].
    type At;

    /// An empty index over `num_pages` pages of `page_size` tokens and a host tier of
    /// `host_pages` pages (arguments checked). Fails, rather than aborting, when its per-page
    /// records cannot be allocated.
    fn new(num_pages: usize, page_size: usize, host_pages: usize) -> crate::error::Result<Self>
    where
        Self: Sized;
    /// Tokens per page.
    fn page_size(&self) -> usize;
    /// Pages holding nothing.
    fn free_pages(&self) -> usize;
    /// Pages holding published KV that no live request pins.
    fn evictable_pages(&self) -> usize;
    /// The longest cached prefix of `tokens` (a whole number of pages) in `namespace`.
    fn lookup(&self, tokens: &[u32], namespace: &Namespace) -> Found<Self::At>;
    /// Pins what `lookup` found, appends its pages to `pages` (host pages by their index ids,
    /// until [`Index::load`]), and returns the request's state.
    fn pin(
        &mut self,
        found: Found<Self::At>,
        namespace: &Namespace,
        pages: &mut Vec<PageId>,
    ) -> Self::Ext;
    /// Takes `count` pages (the caller checked they are free or evictable), evicting as needed;
    /// appends them to `out` and returns how many cached pages were evicted.
    fn allocate(&mut self, count: usize, out: &mut Vec<PageId>) -> usize;
    /// Brings the host pages among `pages` (just pinned, in prefix order) back into the device
    /// pages `fresh` (just allocated), one each in order: the index entries move, and the
    /// loads are logged.
    fn load(&mut self, ext: &mut Self::Ext, pages: &mut [PageId], fresh: &[PageId]);
    /// Publishes the full pages of `r` from `r.published` up to `upto` tokens, then sets
    /// `r.published = upto`.
    fn publish(&mut self, r: &mut Request<Self::Ext>, upto: usize);
    /// Drops a closed request's pins and frees its pages that the index does not hold.
    fn release(&mut self, r: &Request<Self::Ext>);
    /// Frees `pages`, which a live request allocated, never published, and gives back.
    fn free_private(&mut self, pages: &[PageId]);
    /// Up to `max` tokens cached after `tokens` in `namespace` (see
    /// [`crate::PrefixCache::continuation`]); none by default.
    fn continuation(&self, _tokens: &[u32], _namespace: &Namespace, _max: usize) -> Vec<u32> {
        Vec::new()
    }
    /// Appends the device or host pages of what `lookup` found, in prefix order (changes
    /// nothing).
    fn found_pages(&self, found: &Found<Self::At>, out: &mut Vec<PageId>);
    /// The log of device pages the index stopped caching (evicted, offloaded, reset), which a
    /// cache with state slots turns on: every snapshot that needs such a page goes with it.
    fn drops(&mut self) -> &mut crate::cache::states::Drops;
    /// Evicts up to `num_pages` evictable pages in eviction order; returns how many.
    fn evict(&mut self, num_pages: usize) -> usize;
    /// Drops every evictable device page (offloading nothing) and every host page; returns how
    /// many device pages (the host ones count in the tier's `dropped`).
    fn reset(&mut self) -> usize;
    /// Host pages holding nothing.
    fn host_free_pages(&self) -> usize;
    /// Takes up to `count` host pages holding nothing (per-tier ids) for a prefetch from disk,
    /// dropping the host tier's least recently used pages (to the disk) to make room.
    fn take_host(&mut self, count: usize, out: &mut Vec<PageId>);
    /// Makes the host pages of the cached prefix of `tokens` the host tier's most recently used,
    /// so that a [`Index::take_host`] for the same prompt drops other pages first.
    fn touch_host(&mut self, tokens: &[u32], namespace: &Namespace);
    /// Gives host pages taken by [`Index::take_host`] back, holding nothing.
    fn free_host(&mut self, pages: &[PageId]);
    /// Enters the host pages `host` (taken by [`Index::take_host`], now holding the KV of the
    /// pages of `tokens` from token `from`) into the index as cached host pages, for the part
    /// that extends the current match; frees the rest. Returns how many it entered.
    fn adopt(
        &mut self,
        tokens: &[u32],
        namespace: &Namespace,
        from: usize,
        host: &[PageId],
    ) -> usize;
    /// Hands every page the index holds to the disk tier: a copy logged for each page whose key
    /// the disk lacks.
    fn persist(&mut self);
    /// The host tier: its counters and copy log.
    fn tier(&self) -> &crate::cache::tier::Tier;
    /// The host tier, mutably (to drain its log).
    fn tier_mut(&mut self) -> &mut crate::cache::tier::Tier;
    /// A cursor at the start of `namespace`.
    fn cursor(&self, namespace: &Namespace) -> Cursor;
    /// Continues a match over `tokens` (whole pages); see [`crate::PrefixCache::advance`].
    fn advance(&self, cursor: &mut Cursor, tokens: &[u32]) -> bool;
    /// Recomputes the index's own invariants, and its view of the live requests, from scratch.
    fn check(&self, requests: &Requests<Self::Ext>, num_pages: usize) -> Result<()>;
    /// Heap bytes of the index and its pool bookkeeping.
    fn metadata_bytes(&self) -> usize;
    /// The index's event log (recording off unless turned on).
    fn events(&mut self) -> &mut EventLog;
    /// Feeds the index's decision-relevant state into `d` (see [`crate::PrefixCache::state_digest`]).
    fn digest(&self, d: &mut crate::cache::digest::StateDigest);
    /// Whether the index keeps eviction classes and retentions (below); without them the
    /// life cycle refuses a class or a retention other than the defaults.
    fn retains(&self) -> bool {
        false
    }
    /// Called while `r` still pins its published pages (after its last publish, before
    /// [`Index::release`]): raises their eviction class to at least `class` and, with `until`,
    /// retains them until the clock passes it. Returns the retention's id (from 1; 0 when none
    /// was made).
    fn retain(&mut self, _r: &Request<Self::Ext>, _class: u8, _until: Option<f64>) -> u64 {
        0
    }
    /// Raises the eviction class of the cached device prefix of `tokens` (whole pages, up to
    /// the first page on the host tier) in `namespace` to at least `class` and, with `until`,
    /// retains it until the clock passes it, as [`Index::retain`] does for a request's
    /// published pages; but nothing is pinned or admitted: the counters, the LRU order and
    /// every page's state stay as they were. Returns the retention's id (0: none made) and
    /// the tokens the prefix holds.
    fn retain_prefix(
        &mut self,
        _tokens: &[u32],
        _namespace: &Namespace,
        _class: u8,
        _until: Option<f64>,
    ) -> (u64, usize) {
        (0, 0)
    }
    /// Ends retention `id`; false when it is not live.
    fn release_retention(&mut self, _id: u64) -> bool {
        false
    }
    /// Ends the retentions whose time is up at `now`; returns how many.
    fn expire(&mut self, _now: f64) -> usize {
        0
    }
    /// Live retentions, device pages evicted while retained, retentions expired.
    fn retention_counts(&self) -> (usize, u64, u64) {
        (0, 0, 0)
    }
}
