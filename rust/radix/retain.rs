//! What outlives its request: eviction classes and retentions of the radix tree.
//!
//! Every node has an eviction class, the highest any request finishing through it gave
//! (`finish(..., priority=c)`), and a count of the live retentions whose path runs through it
//! (`finish(..., retain=seconds)`). Evictable device leaves sit in one LRU list per class, and
//! those under a retention in a list of their own; eviction takes the front of the lowest list
//! that holds a leaf. So a retained page is evicted only once nothing else on the device can
//! be: retention never makes an admission fail that would succeed without it (its pages still
//! count as evictable), and each page so evicted is counted (`forced_pages`).
//!
//! ```text
//!   lists:  class 0 | class 1 | class 2 | class 3 | retained | host
//!           ^ evicted first                          ^ evicted last (forced)
//! ```
//!
//! A retention is a record `(node, until)`: it holds the path from `node` (the request's
//! deepest published node) to the root until the cache's clock passes `until`, it is released,
//! or `node` itself is evicted. Splits keep it exact: the head of a split edge takes the
//! tail's count, and the record stays on the tail (the old id). Nothing here reads a clock:
//! the owner advances the cache's time, so ranks in lockstep stay identical.

use super::*;

/// The list an evictable node belongs in (whether it is linked or not).
pub(super) fn list_for(n: &Node) -> ListId {
    if n.host {
        HOST_LRU
    } else if n.soft > 0 {
        RETAINED
    } else {
        ListId(n.class as u32)
    }
}

impl RadixIndex {
    /// The least recently used device leaf of the lowest list that has one, and whether it
    /// is retained.
    pub(super) fn device_front(&self) -> Option<(NodeId, bool)> {
        DEVICE_LISTS
            .iter()
            .find_map(|&l| self.lru.front(l).map(|id| (id, l == RETAINED)))
    }

    /// Moves `id`, if linked, from `old` to the list its class and retentions now say.
    fn relink(&mut self, id: NodeId, old: ListId) {
        if old != list_for(self.node(id)) && self.lru.is_linked(id) {
            self.lru.remove(old, id);
            self.link_by_time(id);
        }
    }

    /// Raises the class of the path from `last` to its root to at least `class` and, with
    /// `until`, retains it until then; returns the retention's id (0: none made, as when the
    /// path is empty).
    pub(super) fn retain_path(&mut self, last: NodeId, class: u8, until: Option<f64>) -> u64 {
        let mut id = last;
        while self.node(id).parent != NIL {
            let old = list_for(self.node(id));
            let n = self.node_mut(id);
            n.class = n.class.max(class);
            n.soft += until.is_some() as u32;
            let parent = n.parent;
            self.relink(id, old);
            id = parent;
        }
        let (Some(until), false) = (until, id == last) else {
            return 0;
        };
        self.retained.insert(last, until)
    }

    /// See `Index::retain_prefix`: retains the path to where the device part of the cached
    /// prefix of `tokens` ends (splitting the edge it ends inside), pinning nothing and
    /// touching no node's time, so the LRU order and the counters stay as they were. Host
    /// edges sit below every device edge, so the device part is the path down to the first.
    pub(super) fn retain_cached(
        &mut self,
        tokens: &[u32],
        namespace: &Namespace,
        class: u8,
        until: Option<f64>,
    ) -> (u64, usize) {
        let Some(&root) = self.roots.get(namespace) else {
            return (0, 0);
        };
        let (walk, _) = self.walk(root, tokens);
        let (mut last, mut held, mut whole) = (root, 0, true);
        for &id in &walk.path {
            if self.node(id).host {
                whole = false;
                break;
            }
            held += self.node(id).key.len();
            last = id;
        }
        if let Some((c, at)) = walk.partial.filter(|&(c, _)| whole && !self.node(c).host) {
            last = self.split(c, at);
            held += at;
        }
        if last == root {
            return (0, 0);
        }
        (self.retain_path(last, class, until), held)
    }

    /// Ends the retention `rid`; false when there is none (expired, released, or evicted).
    pub(super) fn release_retention(&mut self, rid: u64) -> bool {
        let Some(r) = self.retained.remove(rid) else {
            return false;
        };
        let mut id = r.held;
        while id != NIL && self.node(id).parent != NIL {
            let old = list_for(self.node(id));
            self.node_mut(id).soft -= 1;
            let parent = self.node(id).parent;
            self.relink(id, old);
            id = parent;
        }
        true
    }

    /// Ends every retention whose time is up at `now`; returns how many.
    pub(super) fn expire(&mut self, now: f64) -> usize {
        let due = self.retained.due(now);
        for &rid in &due {
            self.release_retention(rid);
        }
        self.retained.expired += due.len() as u64;
        due.len()
    }

    /// Ends the retentions held at `node`, which is about to go (its last page evicted).
    pub(super) fn drop_retentions_at(&mut self, node: NodeId) {
        let at: Vec<u64> = self
            .retained
            .iter()
            .filter(|(_, r)| r.held == node)
            .map(|(rid, _)| rid)
            .collect();
        for rid in at {
            self.release_retention(rid);
        }
    }
}
