//! The radix tree's side of the disk tier: pages read back from disk enter the tree as a host
//! edge (`adopt`), and `persist` hands every page the tree holds to the disk.

use super::*;

impl RadixIndex {
    /// Enters `host` (host pages holding, in order, the KV of the pages of `tokens` from token
    /// `from`) into the tree as one host edge below where `tokens[..from]` ends, for the part
    /// the tree does not hold already; the pages it does not use are freed. The tree may have
    /// changed since the pages were read: only pages that extend the current match are used, and
    /// none when the match now ends before `from`. Returns how many were used.
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
        let (walk, matched) = self.walk(root, &tokens[..end]);
        if matched < from || matched >= end {
            self.host_free.insert_all(host);
            self.drop_root_if_empty(root);
            return 0;
        }
        let skip = (matched - from) / p;
        let first = self.page_key(&tokens[matched..matched + p]);
        let mut parent = walk.path.last().copied().unwrap_or(root);
        if let Some((c, at)) = walk.partial {
            parent = self.split(c, at);
        }
        if self.node(parent).children.contains_key(&first) {
            // A 64-bit child-key collision: the pages stay out, as a publish's would.
            self.host_free.insert_all(host);
            return 0;
        }
        self.host_free.insert_all(&host[..skip]);
        let pages: Vec<PageId> = host[skip..].iter().map(|&h| self.tier.host_id(h)).collect();
        let used = pages.len();
        let now = self.tick();
        let leaf = self.alloc_node(Node {
            parent,
            key: tokens[matched..end].to_vec(),
            pages,
            host: true,
            time: now,
            alive: true,
            ..Node::default()
        });
        if self.node(parent).host && self.lru.is_linked(parent) {
            // No longer a host leaf.
            self.lru.remove(HOST_LRU, parent);
        }
        self.node_mut(parent).children.insert(first, leaf);
        self.link_host_by_time(leaf);
        if self.events.on {
            self.fill_block_keys(leaf);
            let prev = (parent != root).then(|| {
                *self
                    .node(parent)
                    .block_keys
                    .last()
                    .expect("keys filled down to the leaf")
            });
            let keys = self.node(leaf).block_keys.clone();
            let toks = self.node(leaf).key.clone();
            self.events.stored_keys(namespace, prev, keys, toks);
        }
        used
    }

    /// Gives the host edges of the cached prefix of `tokens` a new last-use time, relinking the
    /// host leaves among them at the back of the host tier's list.
    pub(super) fn touch_host(&mut self, tokens: &[u32], namespace: &Namespace) {
        let Some(&root) = self.roots.get(namespace) else {
            return;
        };
        let (walk, _) = self.walk(root, tokens);
        let nodes: Vec<NodeId> = walk
            .path
            .iter()
            .copied()
            .chain(walk.partial.map(|(c, _)| c))
            .filter(|&id| self.node(id).host)
            .collect();
        if nodes.is_empty() {
            return;
        }
        let now = self.tick();
        for id in nodes {
            self.node_mut(id).time = now;
            if self.lru.is_linked(id) {
                self.lru.remove(HOST_LRU, id);
                self.link_host_by_time(id);
            }
        }
    }

    /// Hands every page the tree holds, on either tier, to the disk tier (a copy for each one
    /// the disk lacks): edges by last use, least recent first, and a path's deeper pages before
    /// its higher ones, so that the disk keeps the most recently used paths' heads longest.
    pub(super) fn persist(&mut self) {
        let mut order: Vec<(u64, usize, u32)> = Vec::new();
        for (i, n) in self.nodes.iter().enumerate() {
            if !n.alive || n.parent == NIL {
                continue;
            }
            let id = NodeId(i as u32);
            let depth = self.path_to(id).len();
            order.push((n.time, usize::MAX - depth, id.0));
        }
        order.sort_unstable();
        for (_, _, raw) in order {
            let id = NodeId(raw);
            self.fill_block_keys(id);
            let n = self.node(id);
            let (pages, keys) = (n.pages.clone(), n.block_keys.clone());
            self.tier.send_to_disk(&pages, &keys);
        }
    }
}
