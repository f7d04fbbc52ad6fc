//! Eviction from the radix tree on both tiers: device leaves dropped or moved to the host, host
//! leaves dropped, and the LRU lists that order them.

use super::*;

impl RadixIndex {
    /// Links an unpinned node that just became a leaf at its place by last use, in the list of
    /// its class. Its time is at least that of the leaf just evicted below it (the front), so
    /// the walk is short.
    pub(super) fn link_by_time(&mut self, id: NodeId) {
        let t = self.node(id).time;
        let list = list_for(self.node(id));
        let mut at = self.lru.front(list);
        while let Some(e) = at {
            if self.node(e).time > t {
                break;
            }
            at = self.lru.next_of(e);
        }
        match at {
            Some(e) => self.lru.insert_before(list, e, id),
            None => self.lru.push_back(list, id),
        }
    }

    /// Links a host edge that just became a host leaf after every host leaf used no later
    /// (walking from the back: edges come down to the host roughly in order of last use).
    pub(super) fn link_host_by_time(&mut self, id: NodeId) {
        let t = self.node(id).time;
        let mut at = self.lru.back(HOST_LRU);
        while let Some(e) = at {
            if self.node(e).time <= t {
                break;
            }
            at = self.lru.prev_of(e);
        }
        match at.and_then(|e| self.lru.next_of(e)) {
            Some(next) => self.lru.insert_before(HOST_LRU, next, id),
            None if at.is_some() => self.lru.push_back(HOST_LRU, id),
            None => self.lru.push_front(HOST_LRU, id),
        }
    }

    /// Host page ids (per tier) of index ids.
    pub(super) fn host_locals(&self, pages: &[PageId]) -> Vec<PageId> {
        pages.iter().map(|&pg| self.tier.local(pg)).collect()
    }

    /// Moves the whole device edge `id` (unpinned, no child on the device) to the host: its
    /// pages take the smallest free host ids, in page order (the caller made room).
    fn offload_edge(&mut self, id: NodeId) {
        let k = self.node(id).pages.len();
        let list = list_for(self.node(id));
        let mut hosts = Vec::with_capacity(k);
        self.host_free.pop_many(k, &mut hosts);
        let device = std::mem::take(&mut self.node_mut(id).pages);
        let mut moved = Vec::with_capacity(k);
        for (&d, &h) in device.iter().zip(&hosts) {
            let h = self.tier.host_id(h);
            self.tier.offload(d, h);
            moved.push(h);
        }
        self.drops.note(&device);
        self.free.insert_all(&device);
        self.evictable -= k;
        let n = self.node_mut(id);
        n.pages = moved;
        n.host = true;
        let (parent, leaf) = (n.parent, n.children.is_empty());
        self.lru.remove(list, id);
        let par = self.node_mut(parent);
        par.dev_children -= 1;
        if par.dev_children == 0 && par.lock == 0 && par.parent != NIL {
            self.link_by_time(parent);
        }
        if leaf {
            self.link_host_by_time(id);
        }
    }

    /// A host edge a request publishes onto (unpinned, all of it matched): the request's own
    /// device pages `mine` replace its host pages, which are freed.
    pub(super) fn promote(&mut self, id: NodeId, mine: &[PageId]) {
        let host = std::mem::replace(&mut self.node_mut(id).pages, mine.to_vec());
        let locals = self.host_locals(&host);
        self.host_free.insert_all(&locals);
        if self.lru.is_linked(id) {
            self.lru.remove(HOST_LRU, id);
        }
        let n = self.node_mut(id);
        n.host = false;
        let parent = n.parent;
        self.evictable += mine.len();
        self.node_mut(parent).dev_children += 1;
    }

    /// Drops up to `want` host pages from the least recently used host leaves; returns how many.
    pub(super) fn evict_host(&mut self, want: usize) -> usize {
        let mut done = 0;
        while done < want {
            let Some(leaf) = self.lru.front(HOST_LRU) else {
                break;
            };
            let take = (want - done).min(self.node(leaf).pages.len());
            self.trim_leaf(leaf, take, true);
            done += take;
        }
        done
    }

    /// Drops the last `drop` pages of the unpinned leaf `leaf` on its tier (`host` or device):
    /// records their removal, frees their pages, and removes the leaf when nothing is left of
    /// it, relinking its parent where that makes it a leaf of the same tier.
    fn trim_leaf(&mut self, leaf: NodeId, drop: usize, host: bool) {
        let p = self.page_size;
        let first = self.page_key(&self.node(leaf).key[..p]);
        let keep = self.node(leaf).pages.len() - drop;
        let spill = host && self.tier.spills();
        if self.events.on || spill {
            let keys = self.trailing_keys(leaf, drop);
            if spill {
                // Stored deepest first (the disk drops its least recently stored slots first,
                // so a path's tail goes before its head there too), in consecutive slots.
                let pages = self.node(leaf).pages[keep..].to_vec();
                self.tier.send_to_disk(&pages, &keys);
            }
            if self.events.on {
                self.events.removed(keys);
            }
        }
        if host {
            let locals = self.host_locals(&self.node(leaf).pages[keep..]);
            self.host_free.insert_all(&locals);
            self.tier.dropped += drop as u64;
        } else {
            self.drops.note(&self.nodes[leaf.index()].pages[keep..]);
            self.free
                .insert_all(&self.nodes[leaf.index()].pages[keep..]);
            self.evictable -= drop;
        }
        let n = self.node_mut(leaf);
        n.pages.truncate(keep);
        n.key.truncate(keep * p);
        n.block_keys.truncate(keep);
        if keep > 0 {
            return;
        }
        let parent = n.parent;
        let list = list_for(n);
        self.lru.remove(list, leaf);
        if self.node(leaf).soft > 0 {
            self.drop_retentions_at(leaf);
        }
        self.free_node(leaf);
        let par = self.node_mut(parent);
        par.children.remove(&first);
        if !host {
            par.dev_children -= 1;
        }
        if par.parent == NIL {
            self.drop_root_if_empty(parent);
        } else if host && par.host && par.children.is_empty() && par.lock == 0 {
            self.link_host_by_time(parent);
        } else if !host && par.dev_children == 0 && par.lock == 0 {
            self.link_by_time(parent);
        }
    }

    /// Frees up to `want` device pages from the least recently used device leaves, moving them
    /// to the host tier when `offload` (see SEMANTICS.md); returns how many.
    pub(super) fn evict_device(&mut self, want: usize, offload: bool) -> usize {
        let p = self.page_size;
        let mut done = 0;
        while done < want {
            let Some((leaf, retained)) = self.device_front() else {
                break;
            };
            let len = self.node(leaf).pages.len();
            let take = (want - done).min(len);
            let mut down = 0;
            if offload {
                let free = self.host_free.len();
                if free < take {
                    self.evict_host(take - free);
                }
                down = take.min(self.host_free.len());
            }
            let mut drop = take - down;
            if drop > 0 && !self.node(leaf).children.is_empty() {
                // Unreachable: the host tier came up short only if it holds no unpinned page,
                // and nothing below an unpinned edge is pinned.
                debug_assert!(false, "dropping pages above host edges");
                drop = 0;
                if down == 0 {
                    break;
                }
            }
            if drop > 0 {
                let whole = drop == len;
                self.trim_leaf(leaf, drop, false);
                done += drop;
                self.retained.forced_pages += if retained { drop as u64 } else { 0 };
                if whole {
                    continue;
                }
            }
            if down > 0 {
                let len = self.node(leaf).pages.len();
                if down < len {
                    // The head stays: a new unpinned device edge whose only child goes down.
                    self.split(leaf, (len - down) * p);
                }
                self.offload_edge(leaf);
                done += down;
                self.retained.forced_pages += if retained { down as u64 } else { 0 };
            }
        }
        done
    }
}
