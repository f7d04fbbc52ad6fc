//! What a cache records for routers, when asked to: blocks published and removed, and resets.
//!
//! A block is a full page named by its radixkv block key (`hash::block_hashes` of its whole
//! prefix, in its namespace), the same for both indexes. A cache with a sliding-window group
//! records its window pages too, as events of their own ([`CacheEvent::WindowStored`],
//! [`CacheEvent::WindowRemoved`]) under the same keys; a cache with state slots records its
//! recurrent-state snapshots ([`CacheEvent::StateStored`], [`CacheEvent::StateRemoved`]) under
//! the key of the page each one ends on. Recording is off by default; off, each hook is one
//! branch on [`EventLog::on`].

use crate::wire::hash::Namespace;
use crate::wire::hash::{block_hashes, BlockHash};

/// One thing a cache did to its set of cached blocks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheEvent {
    /// Consecutive full pages of one prefix entered the index.
    Stored {
        /// Namespace of the prefix.
        namespace: Namespace,
        /// Key of the page before the first (`None`: the first page of a prompt).
        parent: Option<BlockHash>,
        /// Keys of the pages, in order.
        hashes: Vec<BlockHash>,
        /// Their tokens, `page_size` per key.
        tokens: Vec<u32>,
    },
    /// Pages left the index.
    Removed {
        /// Their keys.
        hashes: Vec<BlockHash>,
    },
    /// The index holds nothing any more (after `reset`), nor the window group.
    Cleared,
    /// Window pages of consecutive full pages of one prefix became findable in the window
    /// group (see `cache/window.rs`): a hit ending at or past them may read them.
    WindowStored {
        /// Namespace of the prefix.
        namespace: Namespace,
        /// Key of the page before the first (`None`: the first page of a prompt).
        parent: Option<BlockHash>,
        /// Keys of the pages, in order.
        hashes: Vec<BlockHash>,
        /// Their tokens, `page_size` per key.
        tokens: Vec<u32>,
    },
    /// Window pages left the window group (their full pages may still be cached).
    WindowRemoved {
        /// Their keys.
        hashes: Vec<BlockHash>,
    },
    /// A recurrent-state snapshot became findable: a hit may end where its prefix ends, on the
    /// page of key `hash` (that page and every page before it are cached).
    StateStored {
        /// Namespace of the prefix.
        namespace: Namespace,
        /// Key of the page before the one it ends on (`None`: it ends on the first page).
        parent: Option<BlockHash>,
        /// Key of the page it ends on.
        hash: BlockHash,
        /// The tokens of that page.
        tokens: Vec<u32>,
    },
    /// Snapshots left the cache (evicted for a slot, with a page they needed, or by
    /// `evict_state`): no hit ends on these pages any more (their pages may still be cached).
    StateRemoved {
        /// Keys of the pages they ended on.
        hashes: Vec<BlockHash>,
    },
}

/// The recorded events of one index.
#[derive(Debug, Default)]
pub struct EventLog {
    /// Whether to record.
    pub on: bool,
    events: Vec<CacheEvent>,
}

impl EventLog {
    /// Turns recording on or off (off drops what was not drained).
    pub fn set(&mut self, on: bool) {
        self.on = on;
        if !on {
            self.events = Vec::new();
        }
    }

    /// The events recorded so far, in order; the log is left empty.
    pub fn drain(&mut self) -> Vec<CacheEvent> {
        std::mem::take(&mut self.events)
    }

    /// Records that `tokens[from..upto]` (whole pages) of a prefix entered the index.
    pub fn stored(
        &mut self,
        namespace: &Namespace,
        tokens: &[u32],
        from: usize,
        upto: usize,
        p: usize,
    ) {
        if upto <= from {
            return;
        }
        let keys = block_hashes(&tokens[..upto], p, namespace);
        let first = from / p;
        self.events.push(CacheEvent::Stored {
            namespace: namespace.clone(),
            parent: first.checked_sub(1).map(|i| keys[i]),
            hashes: keys[first..].to_vec(),
            tokens: tokens[from..upto].to_vec(),
        });
    }

    /// Records a stored run whose keys are known already.
    pub fn stored_keys(
        &mut self,
        namespace: &Namespace,
        parent: Option<BlockHash>,
        hashes: Vec<BlockHash>,
        tokens: Vec<u32>,
    ) {
        if hashes.is_empty() {
            return;
        }
        self.events.push(CacheEvent::Stored {
            namespace: namespace.clone(),
            parent,
            hashes,
            tokens,
        });
    }

    /// Records that pages left the index (one event per call; nothing if `hashes` is empty).
    pub fn removed(&mut self, hashes: Vec<BlockHash>) {
        if !hashes.is_empty() {
            self.events.push(CacheEvent::Removed { hashes });
        }
    }

    /// Records that the window pages of `hashes` (the pages of `tokens`, `parent` the key of
    /// the page before) entered the window group.
    pub fn window_stored(
        &mut self,
        namespace: &Namespace,
        parent: Option<BlockHash>,
        hashes: Vec<BlockHash>,
        tokens: Vec<u32>,
    ) {
        if !hashes.is_empty() {
            self.events.push(CacheEvent::WindowStored {
                namespace: namespace.clone(),
                parent,
                hashes,
                tokens,
            });
        }
    }

    /// Records that the window page of `hash` left the window group.
    pub fn window_removed(&mut self, hash: BlockHash) {
        if let Some(CacheEvent::WindowRemoved { hashes }) = self.events.last_mut() {
            hashes.push(hash); // one event for a run of removals
        } else {
            self.events
                .push(CacheEvent::WindowRemoved { hashes: vec![hash] });
        }
    }

    /// Records that a snapshot of the prefix `tokens` (whole pages) became findable.
    pub fn state_stored(&mut self, namespace: &Namespace, tokens: &[u32], p: usize) {
        let keys = block_hashes(tokens, p, namespace);
        let Some((&hash, before)) = keys.split_last() else {
            return;
        };
        self.events.push(CacheEvent::StateStored {
            namespace: namespace.clone(),
            parent: before.last().copied(),
            hash,
            tokens: tokens[tokens.len() - p..].to_vec(),
        });
    }

    /// Records that the snapshot of the prefix `tokens` left the cache.
    pub fn state_removed(&mut self, namespace: &Namespace, tokens: &[u32], p: usize) {
        let Some(&hash) = block_hashes(tokens, p, namespace).last() else {
            return;
        };
        if let Some(CacheEvent::StateRemoved { hashes }) = self.events.last_mut() {
            hashes.push(hash); // one event for a run of removals
        } else {
            self.events
                .push(CacheEvent::StateRemoved { hashes: vec![hash] });
        }
    }

    /// Number of events recorded and not drained.
    pub fn len(&self) -> usize {
        self.events.len()
    }

    /// Whether no event waits.
    pub fn is_empty(&self) -> bool {
        self.events.is_empty()
    }

    /// A reset that left the index empty: its removals, recorded since `mark` (a `len()` taken
    /// before it), become one `Cleared`.
    pub fn cleared_since(&mut self, mark: usize) {
        self.events.truncate(mark);
        self.events.push(CacheEvent::Cleared);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{BlockCache, PrefixCache, RadixCache};

    /// The set of keys a log's events leave cached, replayed from the events alone.
    fn replay(events: &[CacheEvent], set: &mut std::collections::HashSet<BlockHash>) {
        for e in events {
            match e {
                CacheEvent::Stored { hashes, .. } => set.extend(hashes.iter().copied()),
                CacheEvent::Removed { hashes } => {
                    for h in hashes {
                        assert!(set.remove(h), "removed a block that was not stored");
                    }
                }
                CacheEvent::Cleared => set.clear(),
                CacheEvent::WindowStored { .. } | CacheEvent::WindowRemoved { .. } => {
                    panic!("a window event from a cache without a window group")
                }
                CacheEvent::StateStored { .. } | CacheEvent::StateRemoved { .. } => {
                    panic!("a state event from a cache without state slots")
                }
            }
        }
    }

    fn workload(c: &mut dyn PrefixCache) {
        let p = c.page_size();
        c.record_events(true);
        let mut set = std::collections::HashSet::new();
        for i in 0..30u32 {
            let mut t: Vec<u32> = (0..40).collect();
            t.extend((0..(i % 7) * 5).map(|x| 1000 + x + i * 100));
            let r = c.admit(&t, None).unwrap();
            c.commit(r, t.len()).unwrap();
            c.finish(r).unwrap();
            let events = c.drain_events();
            for e in &events {
                if let CacheEvent::Stored {
                    hashes,
                    tokens,
                    parent,
                    ..
                } = e
                {
                    // Each key is the block key of its prefix.
                    let at = t
                        .windows(tokens.len())
                        .position(|w| w == &tokens[..])
                        .unwrap();
                    let keys = block_hashes(&t[..at + tokens.len()], p, &None);
                    assert_eq!(&keys[at / p..], &hashes[..]);
                    assert_eq!(*parent, (at > 0).then(|| keys[at / p - 1]));
                }
            }
            replay(&events, &mut set);
            if i == 20 {
                c.evict(3);
                replay(&c.drain_events(), &mut set);
            }
        }
        // Nothing is pinned: every cached page is evictable, and the log names each once.
        assert_eq!(set.len(), c.stats().evictable_pages);
        c.reset();
        assert_eq!(c.drain_events(), vec![CacheEvent::Cleared]);
        c.record_events(false);
        let r = c.admit(&[1, 2, 3, 4, 5], None).unwrap();
        c.finish(r).unwrap();
        assert!(c.drain_events().is_empty());
    }

    #[test]
    fn events_rebuild_the_cached_set() {
        workload(&mut RadixCache::new(120, 1).unwrap());
        workload(&mut RadixCache::new(40, 4).unwrap());
        workload(&mut BlockCache::new(12, 8).unwrap());
    }
}
