//! Counters every cache reports.

/// A snapshot of a cache's page states and hit counters.
///
/// Always `free_pages + evictable_pages + used_pages == num_pages`. `queries`, `query_tokens` and
/// `hit_tokens` count admissions (`admit` and `fork`): requests, their tokens, and their
/// `num_cached`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Physical pages in the pool.
    pub num_pages: usize,
    /// Tokens per page.
    pub page_size: usize,
    /// Pages holding nothing.
    pub free_pages: usize,
    /// Pages holding published KV that no live request uses.
    pub evictable_pages: usize,
    /// Pages pinned by at least one live request.
    pub used_pages: usize,
    /// Admissions so far.
    pub queries: u64,
    /// Tokens of those admissions.
    pub query_tokens: u64,
    /// Tokens served from the cache at admission.
    pub hit_tokens: u64,
    /// Device pages evicted so far (by allocation, `evict` or `reset`), to the host tier or not.
    pub evicted_pages: u64,
    /// Pages of the host tier (0: none).
    pub host_pages: usize,
    /// Host pages holding nothing.
    pub host_free_pages: usize,
    /// Of `hit_tokens`, those served from the host tier (loaded back at admission).
    pub host_hit_tokens: u64,
    /// Pages moved from the device to the host tier so far.
    pub offloaded_pages: u64,
    /// Pages moved from the host tier back to the device so far.
    pub loaded_pages: u64,
    /// Host pages dropped so far (to make room for offloads, or by `reset`).
    pub host_evicted_pages: u64,
    /// Retentions live now (`finish` with `retain`, not yet expired, released or evicted).
    pub retentions: usize,
    /// Device pages evicted while retained (nothing else was left to evict), so far.
    pub forced_evictions: u64,
    /// Retentions that expired (the clock passed their time), so far.
    pub expired_retentions: u64,
    /// Slots of the disk tier (0: none).
    pub disk_pages: usize,
    /// Disk slots holding nothing.
    pub disk_free_pages: usize,
    /// Pages written to the disk tier so far (dropped by the host tier, or persisted).
    pub disk_written_pages: u64,
    /// Pages read back from the disk tier into the host tier so far.
    pub disk_fetched_pages: u64,
    /// Disk pages dropped so far (to make room, or by `reset`).
    pub disk_evicted_pages: u64,
    /// Disk pages found torn or corrupted when read back (dropped, never served).
    pub disk_bad_pages: u64,
    /// Tokens a sliding-window layer's query reads (0: no window group).
    pub window: usize,
    /// Pages of the window group's pool (0: none).
    pub window_pages: usize,
    /// Window pages holding nothing.
    pub window_free_pages: usize,
    /// Cached window pages no live request holds (dropped first when the group needs room).
    pub window_evictable_pages: usize,
    /// Admissions whose hit a window cut short: the full pages went further, but the window
    /// pages of the longer prefix were gone.
    pub window_cut_hits: u64,
    /// Tokens those admissions recomputed because of the cut.
    pub window_cut_tokens: u64,
    /// Cached window pages dropped so far (to make room, or by `reset`).
    pub window_evicted_pages: u64,
    /// Window pages on the window host tier now.
    pub window_host_used_pages: usize,
    /// Window pages moved to the window host tier so far.
    pub window_offloaded_pages: u64,
    /// Window pages moved back from it so far (each for a hit).
    pub window_loaded_pages: u64,
    /// State slots: snapshots of a hybrid model's recurrent state the cache keeps (0: none).
    pub state_slots: usize,
    /// State slots holding nothing.
    pub state_free_slots: usize,
    /// State slots whose snapshot a live request's hit pins (not copied yet).
    pub state_pinned_slots: usize,
    /// Of `hit_tokens`, those whose hit ended at a snapshot (all of them with state slots).
    pub state_hit_tokens: u64,
    /// Snapshots taken so far (slots handed out by `take_state`).
    pub taken_states: u64,
    /// Snapshots evicted so far: for their slot, or with a page they needed.
    pub evicted_states: u64,
}

impl CacheStats {
    /// `hit_tokens / query_tokens`, 0.0 before any query.
    pub fn hit_rate(&self) -> f64 {
        if self.query_tokens == 0 {
            0.0
        } else {
            self.hit_tokens as f64 / self.query_tokens as f64
        }
    }
}

/// The counters a cache keeps itself; page counts are read off its pool when a snapshot is taken.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Counters {
    pub queries: u64,
    pub query_tokens: u64,
    pub hit_tokens: u64,
    pub evicted_pages: u64,
    pub host_hit_tokens: u64,
}

impl Counters {
    /// A snapshot with the pool's current page counts.
    pub fn snapshot(
        &self,
        num_pages: usize,
        page_size: usize,
        free: usize,
        evictable: usize,
    ) -> CacheStats {
        CacheStats {
            num_pages,
            page_size,
            free_pages: free,
            evictable_pages: evictable,
            used_pages: num_pages - free - evictable,
            queries: self.queries,
            query_tokens: self.query_tokens,
            hit_tokens: self.hit_tokens,
            evicted_pages: self.evicted_pages,
            host_hit_tokens: self.host_hit_tokens,
            ..CacheStats::default()
        }
    }

    pub fn record_query(&mut self, tokens: usize, hits: usize) {
        self.queries += 1;
        self.query_tokens += tokens as u64;
        self.hit_tokens += hits as u64;
    }
}
