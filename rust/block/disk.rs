//! The block index's side of the disk tier: pages read back from disk are hashed onto host
//! pages (`adopt`), and `persist` hands every hashed page to the disk.

use super::*;

impl BlockIndex {
    /// Hashes `host` (host pages holding, in order, the KV of the pages of `tokens` from token
    /// `from`) onto the host tier, for the part of the chain the map does not hold already; the
    /// pages it does not use go back to HOST_FREE. Only pages that extend the current run of
    /// hits are used, and none when that run now ends before `from`. They enter HOST_EVICTABLE
    /// at its back, the chain's tail first (so the tail is dropped first). Returns how many
    /// were used.
    pub(super) fn adopt(
        &mut self,
        tokens: &[u32],
        namespace: &Namespace,
        from: usize,
        host: &[PageId],
    ) -> usize {
        let p = self.page_size;
        let end = from + host.len() * p;
        let root = self.root(namespace);
        let mut at = (root, Self::root_lead(&root));
        let mut hits = 0;
        self.walk(&tokens[..end], &mut at, |_| hits += 1);
        let matched = hits * p;
        if matched < from || matched >= end {
            self.free_host_pages(host);
            return 0;
        }
        let skip = (matched - from) / p;
        self.free_host_pages(&host[..skip]);
        let parent = (matched > 0).then_some(at.0);
        let mut prev = at;
        let mut entered = Vec::with_capacity(host.len() - skip);
        let mut hashes = Vec::new();
        for (k, &h) in host[skip..].iter().enumerate() {
            let page = self.tier.host_id(h);
            let i = matched / p + k;
            let toks = &tokens[i * p..(i + 1) * p];
            let (hash, key) = (next_hash(&prev.0, toks), self.key(prev.1, toks));
            if self.find(key, &prev.0, toks).is_some() {
                // Only by a chance content-key collision with another chain's page: stop here.
                self.free_host_pages(&host[skip + k..]);
                break;
            }
            self.hash_page(page, &prev.0, toks, hash, key);
            entered.push(page);
            if self.events.on {
                hashes.push(hash);
            }
            prev = (hash, key);
        }
        for &page in entered.iter().rev() {
            self.lists.push_back(HOST_EVICTABLE, page);
        }
        if self.events.on && !hashes.is_empty() {
            let n = hashes.len();
            self.events.stored_keys(
                namespace,
                parent,
                hashes,
                tokens[matched..matched + n * p].to_vec(),
            );
        }
        entered.len()
    }

    pub(super) fn free_host_pages(&mut self, host: &[PageId]) {
        for &h in host {
            let id = self.tier.host_id(h);
            self.lists.push_front(HOST_FREE, id);
        }
    }

    /// Hands every hashed page, on either tier, to the disk tier (a copy for each one the disk
    /// lacks): HOST_EVICTABLE front to back, then the evictable device lists in eviction order,
    /// then the pinned pages, so that the pages evicted last here are also kept longest there.
    pub(super) fn persist(&mut self) {
        let mut order: Vec<PageId> = self.lists.iter(HOST_EVICTABLE).collect();
        for list in DEVICE_LISTS {
            order.extend(self.lists.iter(list));
        }
        let pinned = (0..self.refcount.len() as u32)
            .map(PageId)
            .filter(|&pg| self.refcount[pg.index()] > 0 && self.recs.is_hashed(pg));
        order.extend(pinned);
        for page in order {
            let key = self.recs.hash(page).expect("listed pages are hashed");
            self.tier.send_to_disk(&[page], &[key]);
        }
    }
}
