//! [`PrefixCache`], the object-safe interface of the request life cycle that the scheduler and
//! the Python boundary use; [`super::Cache`] implements it over either index.

use super::{check_commit, check_distinct, DiskFetch};
use crate::cache::index::Cursor;
use crate::cache::request::{RequestId, RequestView};
use crate::cache::stats::CacheStats;
use crate::cache::tier::PageCopy;
use crate::error::{Error, Result};
use crate::wire::events::CacheEvent;
use crate::wire::hash::{BlockHash, Namespace};

/// A prefix cache over a fixed pool of pages: the operations of the design, for either index.
///
/// Every method either succeeds or returns an error having changed nothing.
pub trait PrefixCache: Send {
    /// Finds the longest cached prefix of `tokens` in `namespace`, pins its pages and allocates
    /// pages for the rest, all or nothing.
    fn admit(&mut self, tokens: &[u32], namespace: Namespace) -> Result<RequestId>;
    /// [`PrefixCache::admit`] of tokens the caller owns: the request keeps them, uncopied.
    fn admit_owned(&mut self, tokens: Vec<u32>, namespace: Namespace) -> Result<RequestId> {
        self.admit(&tokens, namespace)
    }
    /// Appends tokens to a live request, allocating pages as needed.
    fn extend(&mut self, id: RequestId, tokens: &[u32]) -> Result<()>;
    /// Marks `tokens[..num_computed]` as written and publishes the full pages this completes.
    fn commit(&mut self, id: RequestId, num_computed: usize) -> Result<()>;
    /// Gives back the tokens of `id` past `num_tokens` (which must be at least its
    /// `num_computed`: nothing computed or published is dropped) and frees the pages they alone
    /// used: the draft tokens a speculative step rejected (their window pages too, with a window
    /// group; there, truncate before committing up to `num_tokens`: a commit releases the window
    /// pages below what its next query reads, which fewer tokens may need again, refused).
    fn truncate(&mut self, id: RequestId, num_tokens: usize) -> Result<()>;
    /// Up to `max` tokens the cache holds after `tokens` in `namespace` (never another's): the
    /// continuation of the cached sequence that `tokens` is a prefix of, the most recently used
    /// where several are. Read-only, LRU order included; empty where nothing is cached after
    /// `tokens` (and always with a block index, which keeps no order between pages).
    fn continuation(&self, tokens: &[u32], namespace: &Namespace, max: usize) -> Vec<u32>;
    /// A new request with the same tokens and namespace sharing the computed full pages of `id`.
    ///
    /// Commits publish computed full pages at once, so admitting `id`'s tokens again finds them
    /// (or an equal copy published earlier) and shares them without copying KV.
    fn fork(&mut self, id: RequestId) -> Result<RequestId> {
        let r = self.request(id)?;
        let (tokens, namespace) = (r.tokens.to_vec(), r.namespace.clone());
        self.admit(&tokens, namespace)
    }
    /// Extends each `(request, tokens)` in order and stops before the first one the pool cannot
    /// supply; returns how many were extended (that one and the rest are unchanged). Every
    /// request is checked first: a closed, foreign or repeated one changes nothing.
    fn extend_many(&mut self, batch: &[(RequestId, &[u32])]) -> Result<usize> {
        check_distinct(batch.iter().map(|b| b.0))?;
        for &(id, _) in batch {
            self.request(id)?;
        }
        for (done, &(id, tokens)) in batch.iter().enumerate() {
            match self.extend(id, tokens) {
                Ok(()) => {}
                Err(Error::OutOfPages { .. }) => return Ok(done),
                Err(e) => return Err(e),
            }
        }
        Ok(batch.len())
    }
    /// Commits each `(request, num_computed)`; every pair is checked first, all or nothing.
    fn commit_many(&mut self, batch: &[(RequestId, usize)]) -> Result<()> {
        check_distinct(batch.iter().map(|b| b.0))?;
        for &(id, n) in batch {
            let r = self.request(id)?;
            check_commit(n, r.num_computed, r.num_tokens())?;
        }
        for &(id, n) in batch {
            self.commit(id, n)?;
        }
        Ok(())
    }
    /// Publishes what is computed, unpins, frees what is not published, and closes the request.
    fn finish(&mut self, id: RequestId) -> Result<()>;
    /// [`PrefixCache::finish`] that also raises the eviction class of the request's published
    /// pages to at least `class` (`0..CLASSES`, 0 evicted first; see SEMANTICS.md) and, for
    /// `retain > 0` (seconds of the cache's clock, or infinite), retains them: evicted only
    /// when nothing else is left to evict, until the clock passes `now + retain` or
    /// [`PrefixCache::release_retention`]. Returns the retention's id (0: none made).
    fn finish_retained(&mut self, id: RequestId, class: u8, retain: f64) -> Result<u64>;
    /// Retains the cached prefix of `tokens` in `namespace` without admitting it (a cache
    /// breakpoint inside a prompt): its whole pages on the device, as far as they are cached,
    /// get `class` and `retain` as [`PrefixCache::finish_retained`] gives a request's pages,
    /// and nothing else changes: no query or hit is counted, nothing is pinned or allocated,
    /// no page changes state and the LRU order stays. Returns the retention's id (0: none
    /// made, as when nothing is cached or neither is asked for) and how many tokens it holds.
    fn retain_prefix(
        &mut self,
        tokens: &[u32],
        namespace: &Namespace,
        class: u8,
        retain: f64,
    ) -> Result<(u64, usize)>;
    /// Ends a retention before its time; false when it is not live (expired, released, its
    /// pages evicted).
    fn release_retention(&mut self, retention: u64) -> bool;
    /// Advances the cache's clock to `now` (never backwards) and ends the retentions whose
    /// time is up; returns how many. The core reads no clock of its own.
    fn set_time(&mut self, now: f64) -> Result<usize>;
    /// The cache's clock.
    fn now(&self) -> f64;
    /// Unpins and frees what is not published, publishing nothing more; closes the request.
    fn abort(&mut self, id: RequestId) -> Result<()>;
    /// How many tokens `admit` would find cached now. Changes nothing, LRU order included.
    fn match_prefix(&self, tokens: &[u32], namespace: &Namespace) -> Result<usize>;
    /// Evicts up to `num_pages` evictable pages in eviction order; returns how many.
    fn evict(&mut self, num_pages: usize) -> usize;
    /// Drops every evictable page, of both tiers; returns how many.
    fn reset(&mut self) -> usize;
    /// The copies between the tiers decided since the last call, in the order to perform them;
    /// the log is left empty. Always empty without a host tier. The window host tier's copies
    /// (`WindowOffload`, `WindowLoad`) come after the full group's: they touch other pools.
    fn drain_copies(&mut self) -> Vec<PageCopy>;
    /// [`PrefixCache::drain_copies`] with the block key of each disk copy (`Spill`, `Persist`),
    /// in order: what an owner with a disk tier writes beside each page.
    fn drain_copies_keyed(&mut self) -> (Vec<PageCopy>, Vec<BlockHash>);
    /// Pages of the host tier (0: none).
    fn host_pages(&self) -> usize;
    /// Slots of the disk tier (0: none).
    fn disk_pages(&self) -> usize;
    /// The window group's `(window, pages)`: tokens a window layer's query reads, and pages of
    /// its pool (`(0, 0)`: no window group).
    fn window(&self) -> (usize, usize);
    /// Pages of the window group's host tier (0: none): where its cached pages go when its
    /// pool needs room, copied with `WindowOffload`/`WindowLoad` between the window layers'
    /// pools.
    fn window_host_pages(&self) -> usize {
        0
    }
    /// With a window group: the most tokens to append to one request in one step (an
    /// admission's uncached part, a prefill chunk) so that it fits the window pool beside a
    /// hit's window (`(window_pages - ceil(window / P) - 2) * P`, at least one page); without
    /// one, unbounded (`usize::MAX`). Past it a chunk could never fit, however much is evicted.
    fn window_chunk(&self) -> usize {
        let (w, pages) = self.window();
        if pages == 0 {
            return usize::MAX;
        }
        let p = self.page_size();
        pages.saturating_sub(w.div_ceil(p) + 2).max(1) * p
    }
    /// Starts reading back from disk the pages of `tokens` past what the device and host tiers
    /// hold, while the disk holds them: their slots are pinned and host pages taken for them
    /// (the host tier dropping its least recently used pages to make room). `None` when the
    /// disk holds none of them. The owner reads each slot into its host page, checks it, then
    /// calls [`PrefixCache::disk_confirm`]; until then the pages are no hit. Errors without a
    /// disk tier, or for an empty prompt.
    fn disk_prefetch(&mut self, tokens: &[u32], namespace: Namespace) -> Result<Option<DiskFetch>>;
    /// Ends prefetch `id`: its first `good` pages read well and enter the index as host pages
    /// (the part that still extends the cached prefix); with `bad`, page `good` read torn or
    /// corrupted and leaves the disk tier. Returns how many pages entered the index. Errors for
    /// an id not in progress or `good` past its pages, changing nothing.
    fn disk_confirm(&mut self, id: u64, good: usize, bad: bool) -> Result<usize>;
    /// Logs a copy to disk of every page the index holds that the disk lacks (for saving the
    /// cache); returns how many copies it logged.
    fn disk_persist(&mut self) -> usize;
    /// The disk tier's `(block key, slot)` pairs, least recently used first.
    fn disk_entries(&self) -> Vec<(BlockHash, u32)>;
    /// Fills the empty disk tier with saved entries (as `disk_entries` gave them): the pages a
    /// directory holds from an earlier process. Checked first: errors change nothing.
    fn disk_restore(&mut self, entries: &[(BlockHash, u32)]) -> Result<()>;
    /// With state slots: a slot for the recurrent state of live request `id` at token `pos` (a
    /// page boundary, its tokens up to `pos` computed or about to be, before the commit that
    /// covers them): a free slot, else the first unpinned snapshot's in the snapshots' LRU
    /// (superseded ones first, then the least recently used). The owner copies the state into
    /// it; the snapshot becomes findable at the request's first `commit` or `finish` after which
    /// its pages up to `pos` are published (never before), and is freed if the request closes
    /// before. `None`, changing nothing, when every slot is pinned or pending, when the request
    /// took one at `pos` already, or when a snapshot of the same prefix is published. Errors without state slots or for a `pos` off a page boundary or
    /// past the request's tokens.
    fn take_state(&mut self, id: RequestId, pos: usize) -> Result<Option<u32>>;
    /// Unpins the snapshot request `id`'s admission hit ended at (the owner has copied it into
    /// the request's own state); false when none is pinned. `finish` and `abort` do it too.
    fn release_state(&mut self, id: RequestId) -> Result<bool>;
    /// Evicts the published snapshot in state slot `slot` (one found damaged, or a policy of
    /// the owner's): its pages stay cached. False, changing nothing, when the slot is free, its
    /// snapshot pending or pinned. Errors for a slot past `state_slots`.
    fn evict_state(&mut self, slot: u32) -> Result<bool>;
    /// The state slots freed since the last call (their snapshot evicted, dropped with a page it
    /// needed, or never published) and free still, each once.
    fn drain_freed_states(&mut self) -> Vec<u32>;
    /// The published snapshots: `(slot, prefix tokens, namespace)`, by slot.
    fn state_snapshots(&self) -> Vec<(u32, Vec<u32>, Namespace)>;
    /// A snapshot of the counters.
    fn stats(&self) -> CacheStats;
    /// `stats().evicted_pages` alone, without building the snapshot (the scheduler reads it per
    /// ranked candidate).
    fn evicted_pages(&self) -> u64;
    /// Recomputes every invariant from scratch; `Err(Corruption)` names the first broken one.
    fn check(&self) -> Result<()>;
    /// A view of a live request.
    fn request(&self, id: RequestId) -> Result<RequestView<'_>>;
    /// Heap bytes of the index and pool bookkeeping (requests excluded).
    fn metadata_bytes(&self) -> usize;
    /// Tokens per page.
    fn page_size(&self) -> usize;
    /// A cursor at the start of `namespace` (nothing matched yet).
    fn cursor(&self, namespace: &Namespace) -> Cursor;
    /// Continues a match over `tokens` (a whole number of pages); returns whether all of them
    /// matched. `cursor.matched` grows by the whole pages that did. Changes nothing.
    fn advance(&self, cursor: &mut Cursor, tokens: &[u32]) -> bool;
    /// Turns recording of KV events (blocks stored and removed, resets) on or off; off drops
    /// what was not drained. Off by default, and then free.
    fn record_events(&mut self, on: bool);
    /// The KV events recorded since the last call, in order.
    fn drain_events(&mut self) -> Vec<CacheEvent>;
    /// A 64-bit digest of the state every later decision depends on: the cached pages (their
    /// namespaces, token contents or block hashes, page ids and pins), the live requests' page
    /// tables and counts, the free and evictable counts and the eviction (LRU) order.
    ///
    /// Two caches driven by the same calls have the same digest whatever their per-cache random
    /// secrets, and in any process: it reads no secret, no map iteration order and no address.
    /// A differing decision (a page id, a pin, an eviction, a reordering of the LRU list)
    /// changes it, but for a chance collision of 2^-64. Cost: one pass over the index, O(nodes +
    /// cached tokens) for the radix tree and O(num_pages) for the block index, plus the live
    /// requests' pages; about 1 ms for 65k cached pages of 16 tokens (a million tokens) on
    /// either index, on one CPU core. Changes nothing.
    fn state_digest(&self) -> u64;
}
