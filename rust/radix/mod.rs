//! `RadixIndex`: a compressed radix tree over token ids, in the style of SGLang's RadixAttention.
//!
//! ```text
//!   roots[namespace] ── "You are a helpful ...|tools" ──┬── "turn 1 ...|turn 2" ── ...
//!                         (pages 0..272, shared trunk)  └── "sub-agent B ..."
//! ```
//!
//! Each node holds an edge: `key` (a whole number of pages of tokens) and the `pages` that hold
//! their KV. Children are keyed by their first page, so a lookup costs one hash probe per node.
//! Edges split at divergence without copying KV: the new node takes the matched head of the edge,
//! the old node keeps the tail (so ids held by requests and the LRU list stay valid).
//!
//! Pinning is per node (SGLang's `lock_ref`): a live request pins the path from its deepest
//! published node to the root. A node is evictable when nothing pins it. Only leaves are evicted,
//! least recently used first, so a shared trunk outlives its branches. The evictable leaves sit
//! in an intrusive list ordered by last use; eviction pops its front, trimming the leaf's tail
//! page by page so that exactly the pages asked for are freed.
//!
//! With a host tier every edge is on one tier, and the device edges form the top of the tree:
//! device eviction takes the least recently used edge with no child on the device and moves its
//! tail to the host (splitting the edge where only part goes); the host tier has its own list of
//! leaves, dropped least recently used first; a match through host edges loads them back whole.

use crate::arena::compare::common_prefix;
use crate::arena::ids::{ArenaId, PageId};
use crate::arena::links::{Links, ListId};
use crate::arena::table_hash::{MixHasher, TokenKeys};
use crate::cache::index::{Cursor, CursorAt, Found, Index};
use crate::cache::request::{Request, Requests};
use crate::cache::tier::Tier;
use crate::cache::Cache;
use crate::error::{corrupt, Result};
use crate::wire::events::EventLog;
use crate::wire::hash::Namespace;
use crate::wire::hash::{block_hashes, next_hash, root_hash, BlockHash};
use freeset::FreeSet;
use std::collections::HashMap;
use std::hash::BuildHasherDefault;

mod check;
mod continuation;
mod disk;
mod evict;
mod freeset;
mod retain;

use crate::cache::retention::Retentions;
use retain::list_for;

/// A prefix cache indexed by a compressed radix tree over token ids.
pub type RadixCache = Cache<RadixIndex>;

/// A node of the tree: an index into its node arena.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct NodeId(u32);

impl NodeId {
    /// No node: the parent of a namespace root.
    const NIL: NodeId = NodeId(u32::MAX);
}

impl ArenaId for NodeId {
    fn from_raw(raw: u32) -> Self {
        NodeId(raw)
    }
    fn raw(self) -> u32 {
        self.0
    }
}

const NIL: NodeId = NodeId::NIL;
use crate::cache::index::CLASSES;
/// Device leaves of eviction class `c` are in list `ListId(c)`, least recently used at the
/// front; those under a live retention are in `RETAINED`, evicted only when no other is left.
const RETAINED: ListId = ListId(CLASSES as u32);
/// Every device list, in eviction order.
const DEVICE_LISTS: [ListId; CLASSES as usize + 1] =
    [ListId(0), ListId(1), ListId(2), ListId(3), RETAINED];
/// Host edges with no child, least recently used at the front.
const HOST_LRU: ListId = ListId(CLASSES as u32 + 1);

type ChildMap = HashMap<u64, NodeId, BuildHasherDefault<MixHasher>>;

#[derive(Debug)]
struct Node {
    /// `NIL` for a namespace root.
    parent: NodeId,
    /// Tokens of the edge into this node; a whole number of pages (empty only for roots).
    key: Vec<u32>,
    /// `key.len() / page_size` page ids.
    pages: Vec<PageId>,
    children: ChildMap,
    /// Live requests whose pinned path runs through this node.
    lock: u32,
    /// Whether the edge's pages are on the host tier (index ids `num_pages..`).
    host: bool,
    /// Children on the device (all of them without a host tier).
    dev_children: u32,
    /// Logical time of the last admission or release through this node.
    time: u64,
    alive: bool,
    /// Of a namespace root: its namespace (the key of `roots`), so that the root can leave the
    /// map when its last node goes.
    ns: Option<Box<Namespace>>,
    /// The block key of each page of the edge, for the event log: empty until events need them
    /// (filled when a publish records the edge, or on first eviction with events on), else one
    /// a page. Splits and trims keep it exact, so evicting costs a hash per page evicted, not
    /// one per page of the path.
    block_keys: Vec<BlockHash>,
    /// Eviction class (`0..CLASSES`): the highest any request finishing through it gave.
    class: u8,
    /// Live retentions whose path runs through this node (see `retain.rs`).
    soft: u32,
}

impl Default for Node {
    fn default() -> Self {
        Node {
            parent: NIL,
            key: Vec::new(),
            pages: Vec::new(),
            children: ChildMap::default(),
            lock: 0,
            host: false,
            dev_children: 0,
            time: 0,
            alive: false,
            ns: None,
            block_keys: Vec::new(),
            class: 0,
            soft: 0,
        }
    }
}

/// The radix index's own part of a request.
#[derive(Debug, Clone)]
pub struct RadixExt {
    /// Deepest node whose path spells `tokens[..published]`; pinned by this request.
    last: NodeId,
    /// Pages this request computed that another request had published first: private to it,
    /// freed when it ends. (The rest of its private pages are `pages[published / P..]`.)
    dups: Vec<PageId>,
    /// With event recording on: the block key of `tokens[..at]` as `(at, key)`, so that each
    /// publish hashes only its new pages.
    key_at: Option<(usize, BlockHash)>,
}

/// Where a lookup ended.
#[derive(Debug)]
pub struct Walk {
    /// Nodes matched in full, root excluded, top down.
    path: Vec<NodeId>,
    /// A node matched only up to this many tokens (a page multiple, short of its key).
    partial: Option<(NodeId, usize)>,
}

/// The tree, its pool and its LRU list.
#[derive(Debug)]
pub struct RadixIndex {
    page_size: usize,
    nodes: Vec<Node>,
    vacant: Vec<NodeId>,
    roots: HashMap<Namespace, NodeId>,
    /// `DEVICE_LISTS`: unpinned non-root device edges with no child on the device, by eviction
    /// class, least recently used at the front. `HOST_LRU`: host edges with no child, the same
    /// way.
    lru: Links<NodeId>,
    free: FreeSet,
    /// Free host pages, by host id.
    host_free: FreeSet,
    tier: Tier,
    /// Pages held by unpinned nodes.
    evictable: usize,
    clock: u64,
    /// Keys pages longer than two tokens.
    keys: TokenKeys,
    events: EventLog,
    /// Live retentions, each holding the path from its node to the root.
    retained: Retentions<NodeId>,
    /// The device pages evicted, offloaded or reset since the cache last drained them (recorded
    /// only with state slots).
    drops: crate::cache::states::Drops,
    /// Unit tests set this to give every page the same child key, so that the collision paths
    /// (a lookup that must compare the page, a publish that must keep its page private) run.
    #[cfg(test)]
    collide: bool,
}

impl RadixIndex {
    fn node(&self, id: NodeId) -> &Node {
        &self.nodes[id.index()]
    }

    fn node_mut(&mut self, id: NodeId) -> &mut Node {
        &mut self.nodes[id.index()]
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// Child-map key of a page: exact for pages of one or two tokens; otherwise a key seeded with
    /// this cache's random secret, so nobody can construct two pages that collide. Lookups
    /// compare the page itself: a chance collision (2^-64 per pair) can only cost a cache hit.
    fn page_key(&self, page: &[u32]) -> u64 {
        #[cfg(test)]
        if self.collide {
            return 7;
        }
        match page {
            [t] => *t as u64,
            [a, b] => (*a as u64) << 32 | *b as u64,
            _ => self.keys.key(0, page),
        }
    }

    fn child(&self, node: NodeId, page: &[u32]) -> Option<NodeId> {
        let &c = self.node(node).children.get(&self.page_key(page))?;
        (self.node(c).key[..self.page_size] == *page).then_some(c)
    }

    fn alloc_node(&mut self, node: Node) -> NodeId {
        match self.vacant.pop() {
            Some(id) => {
                *self.node_mut(id) = node;
                id
            }
            None => {
                self.nodes.push(node);
                self.lru.ensure(self.nodes.len());
                NodeId((self.nodes.len() - 1) as u32)
            }
        }
    }

    fn free_node(&mut self, id: NodeId) {
        *self.node_mut(id) = Node::default();
        self.vacant.push(id);
    }

    /// Follows `tokens` (a page multiple) down from `root`, changing nothing; returns the walk
    /// and the tokens matched.
    fn walk(&self, root: NodeId, tokens: &[u32]) -> (Walk, usize) {
        let p = self.page_size;
        let (mut node, mut pos, mut path) = (root, 0, Vec::new());
        while pos < tokens.len() {
            let Some(c) = self.child(node, &tokens[pos..pos + p]) else {
                break;
            };
            let key = &self.node(c).key;
            let common = common_prefix(key, &tokens[pos..]) / p * p;
            pos += common;
            if common < key.len() {
                let partial = Some((c, common));
                return (Walk { path, partial }, pos);
            }
            path.push(c);
            node = c;
        }
        let partial = None;
        (Walk { path, partial }, pos)
    }

    /// Splits `id`'s edge after `at` tokens; returns the new node, which takes the head.
    fn split(&mut self, id: NodeId, at: usize) -> NodeId {
        let p = self.page_size;
        let n = self.node_mut(id);
        let head_key = n.key[..at].to_vec();
        let head_pages = n.pages[..at / p].to_vec();
        n.key = n.key[at..].to_vec();
        n.pages = n.pages[at / p..].to_vec();
        let head_keys = if n.block_keys.is_empty() {
            Vec::new()
        } else {
            n.block_keys.drain(..at / p).collect()
        };
        let (parent, lock, time, host) = (n.parent, n.lock, n.time, n.host);
        let (class, soft) = (n.class, n.soft);
        let tail_key = self.page_key(&self.node(id).key[..p]);
        let head_first = self.page_key(&head_key[..p]);
        let mut children = ChildMap::default();
        children.insert(tail_key, id);
        let mid = self.alloc_node(Node {
            parent,
            key: head_key,
            pages: head_pages,
            children,
            lock,
            host,
            dev_children: !host as u32,
            time,
            alive: true,
            ns: None,
            block_keys: head_keys,
            class,
            soft,
        });
        self.node_mut(id).parent = mid;
        self.node_mut(parent).children.insert(head_first, mid);
        mid
    }

    /// Pins the path from `id` to its root.
    fn lock(&mut self, mut id: NodeId) {
        let now = self.tick();
        while id != NIL {
            let n = &mut self.nodes[id.index()];
            if n.lock == 0 {
                if self.lru.is_linked(id) {
                    self.lru.remove(list_for(n), id);
                }
                if !n.host {
                    self.evictable -= n.pages.len();
                }
            }
            n.lock += 1;
            n.time = now;
            id = n.parent;
        }
    }

    /// Unpins the path from `id` to its root; leaves left unpinned become the most recently used.
    fn unlock(&mut self, mut id: NodeId) {
        let now = self.tick();
        while id != NIL {
            let n = &mut self.nodes[id.index()];
            n.lock -= 1;
            n.time = now;
            let parent = n.parent;
            if n.lock == 0 {
                // Pinned edges are on the device.
                self.evictable += n.pages.len();
                if parent != NIL && n.dev_children == 0 {
                    self.lru.push_back(list_for(n), id);
                }
            }
            id = parent;
        }
    }

    /// The root of `namespace`, created if missing.
    fn root(&mut self, namespace: &Namespace) -> NodeId {
        if let Some(&r) = self.roots.get(namespace) {
            return r;
        }
        let r = self.alloc_node(Node {
            alive: true,
            ns: Some(Box::new(namespace.clone())),
            ..Node::default()
        });
        self.roots.insert(namespace.clone(), r);
        r
    }

    /// Releases `root` and its namespace entry if nothing pins it and it has no child left, so
    /// that a namespace costs nothing once its last page is gone.
    fn drop_root_if_empty(&mut self, root: NodeId) {
        let n = self.node(root);
        if n.parent != NIL || n.lock != 0 || !n.children.is_empty() {
            return;
        }
        let ns = self
            .node_mut(root)
            .ns
            .take()
            .expect("roots hold their namespace");
        self.roots.remove(&*ns);
        self.free_node(root);
        // A burst of namespaces must not keep its map capacity once the burst is over.
        if self.roots.capacity() > 64 && self.roots.len() * 4 < self.roots.capacity() {
            self.roots.shrink_to(self.roots.len() * 2);
        }
    }

    /// The block keys of the last `count` pages of `node`'s edge (for the event log), filling
    /// in the edge's keys, and those of the edges above it that lack theirs, on first need.
    fn trailing_keys(&mut self, node: NodeId, count: usize) -> Vec<BlockHash> {
        self.fill_block_keys(node);
        let keys = &self.node(node).block_keys;
        keys[keys.len() - count..].to_vec()
    }

    /// Gives `node` and every edge above it their `block_keys`: hashed down from the deepest
    /// ancestor that has them (or from the namespace root), so each page is hashed once.
    fn fill_block_keys(&mut self, node: NodeId) {
        let p = self.page_size;
        let mut todo = Vec::new();
        let mut n = node;
        let mut prev = loop {
            let parent = self.node(n).parent;
            if parent == NIL {
                let ns = self
                    .node(n)
                    .ns
                    .as_deref()
                    .expect("a root holds its namespace");
                break root_hash(p, ns);
            }
            let nd = self.node(n);
            if nd.block_keys.len() == nd.pages.len() {
                break *nd.block_keys.last().expect("a non-root edge has a page");
            }
            todo.push(n);
            n = parent;
        };
        for &m in todo.iter().rev() {
            let keys: Vec<BlockHash> = self
                .node(m)
                .key
                .chunks_exact(p)
                .map(|page| {
                    prev = next_hash(&prev, page);
                    prev
                })
                .collect();
            self.node_mut(m).block_keys = keys;
        }
    }

    /// Nodes on the way from the namespace root (excluded) to `node`, top down.
    fn path_to(&self, mut node: NodeId) -> Vec<NodeId> {
        let mut path = Vec::new();
        while self.node(node).parent != NIL {
            path.push(node);
            node = self.node(node).parent;
        }
        path.reverse();
        path
    }
}

impl Index for RadixIndex {
    type Ext = RadixExt;
    type At = Walk;

    fn new(num_pages: usize, page_size: usize, host_pages: usize) -> Result<Self> {
        Ok(RadixIndex {
            page_size,
            nodes: Vec::new(),
            vacant: Vec::new(),
            roots: HashMap::new(),
            lru: Links::new(CLASSES as u32 + 2, 0),
            free: FreeSet::try_full(num_pages)?,
            host_free: FreeSet::try_full(host_pages)?,
            tier: Tier::new(num_pages, host_pages),
            evictable: 0,
            clock: 0,
            keys: TokenKeys::random(),
            events: EventLog::default(),
            retained: Retentions::default(),
            drops: Default::default(),
            #[cfg(test)]
            collide: false,
        })
    }

    fn page_size(&self) -> usize {
        self.page_size
    }

    fn free_pages(&self) -> usize {
        self.free.len()
    }

    fn evictable_pages(&self) -> usize {
        self.evictable
    }

    fn lookup(&self, tokens: &[u32], namespace: &Namespace) -> Found<Walk> {
        let Some(&root) = self.roots.get(namespace) else {
            let at = Walk {
                path: Vec::new(),
                partial: None,
            };
            return Found {
                matched: 0,
                evictable: 0,
                host: 0,
                at,
            };
        };
        let (walk, matched) = self.walk(root, tokens);
        // Pinning the match takes its unpinned device pages out of what eviction may reclaim;
        // its host pages each need a device page.
        let (mut evictable, mut host) = (0, 0);
        let partial = walk.partial.map(|(c, at)| (c, at / self.page_size));
        let full = walk.path.iter().map(|&id| (id, self.node(id).pages.len()));
        for (id, pages) in full.chain(partial) {
            let n = self.node(id);
            if n.host {
                host += pages;
            } else if n.lock == 0 {
                evictable += pages;
            }
        }
        Found {
            matched,
            evictable,
            host,
            at: walk,
        }
    }

    fn pin(
        &mut self,
        found: Found<Walk>,
        namespace: &Namespace,
        pages: &mut Vec<PageId>,
    ) -> RadixExt {
        let walk = found.at;
        let root = self.root(namespace);
        let mut last = walk.path.last().copied().unwrap_or(root);
        if let Some((c, at)) = walk.partial {
            last = self.split(c, at);
        }
        self.lock(last);
        for &id in walk.path.iter().chain(walk.partial.map(|_| &last)) {
            pages.extend_from_slice(&self.node(id).pages);
        }
        RadixExt {
            last,
            dups: Vec::new(),
            key_at: None,
        }
    }

    /// The host edges at the bottom of the request's pinned path come to the device whole, top
    /// down, each page into the next of `fresh`.
    fn load(&mut self, ext: &mut RadixExt, pages: &mut [PageId], fresh: &[PageId]) {
        let mut down = Vec::new();
        let mut id = ext.last;
        while self.node(id).host {
            down.push(id);
            id = self.node(id).parent;
        }
        let mut fresh_iter = fresh.iter();
        for &id in down.iter().rev() {
            let host = std::mem::take(&mut self.node_mut(id).pages);
            let mut moved = Vec::with_capacity(host.len());
            for &h in &host {
                let d = *fresh_iter
                    .next()
                    .expect("a device page for every host page");
                self.tier.load(h, d);
                moved.push(d);
            }
            let locals = self.host_locals(&host);
            self.host_free.insert_all(&locals);
            let n = self.node_mut(id);
            n.pages = moved;
            n.host = false;
            let parent = n.parent;
            self.node_mut(parent).dev_children += 1;
        }
        let mut fresh_iter = fresh.iter();
        for page in pages.iter_mut().filter(|pg| self.tier.is_host(**pg)) {
            *page = *fresh_iter
                .next()
                .expect("a device page for every host page");
        }
    }

    fn allocate(&mut self, count: usize, out: &mut Vec<PageId>) -> usize {
        let short = count.saturating_sub(self.free.len());
        let evicted = if short > 0 { self.evict(short) } else { 0 };
        self.free.pop_many(count, out);
        evicted
    }

    /// Inserts `tokens[published..upto]` of a request below its pinned node and moves its pin
    /// to the deepest node. Pages another request published first stay private (`dups`).
    fn publish(&mut self, r: &mut Request<RadixExt>, upto: usize) {
        let p = self.page_size;
        let (old, mut node, mut pos) = (r.ext.last, r.ext.last, r.published);
        while pos < upto {
            let page = &r.tokens[pos..pos + p];
            let k = self.page_key(page);
            match self.node(node).children.get(&k).copied() {
                None => {
                    let pages = r.pages[pos / p..upto / p].to_vec();
                    self.evictable += pages.len();
                    let now = self.clock;
                    let leaf = self.alloc_node(Node {
                        parent: node,
                        key: r.tokens[pos..upto].to_vec(),
                        pages,
                        time: now,
                        alive: true,
                        ..Node::default()
                    });
                    let par = self.node_mut(node);
                    par.children.insert(k, leaf);
                    par.dev_children += 1;
                    if self.events.on {
                        let keys = record_new_leaf(&mut self.events, r, pos, upto, p);
                        self.node_mut(leaf).block_keys = keys;
                    }
                    node = leaf;
                    pos = upto;
                }
                // A 64-bit child-key collision: the rest stays private to the request.
                Some(c) if self.node(c).key[..p] != *page => break,
                Some(c) => {
                    let key = &self.node(c).key;
                    let common = common_prefix(key, &r.tokens[pos..upto]) / p * p;
                    let c = if common < key.len() {
                        self.split(c, common)
                    } else {
                        c
                    };
                    let mine = &r.pages[pos / p..(pos + common) / p];
                    if self.node(c).host {
                        // The request's own pages replace the host copy: no duplicate.
                        self.promote(c, mine);
                    } else {
                        r.ext.dups.extend_from_slice(mine);
                    }
                    node = c;
                    pos += common;
                }
            }
        }
        r.published = pos;
        if node != old {
            self.lock(node);
            self.unlock(old);
            r.ext.last = node;
        }
    }

    fn release(&mut self, r: &Request<RadixExt>) {
        self.unlock(r.ext.last);
        // A request that published nothing pins only its root, which may be empty now.
        if self.node(r.ext.last).parent == NIL {
            self.drop_root_if_empty(r.ext.last);
        }
        self.free.insert_all(&r.ext.dups);
        self.free
            .insert_all(&r.pages[r.published / self.page_size..]);
    }

    fn free_private(&mut self, pages: &[PageId]) {
        self.free.insert_all(pages);
    }

    fn found_pages(&self, found: &Found<Walk>, out: &mut Vec<PageId>) {
        for &id in &found.at.path {
            out.extend_from_slice(&self.node(id).pages);
        }
        if let Some((c, at)) = found.at.partial {
            out.extend_from_slice(&self.node(c).pages[..at / self.page_size]);
        }
    }

    fn drops(&mut self) -> &mut crate::cache::states::Drops {
        &mut self.drops
    }

    fn continuation(&self, tokens: &[u32], namespace: &Namespace, max: usize) -> Vec<u32> {
        self.continue_after(tokens, namespace, max)
    }

    /// Frees up to `want` device pages from the least recently used leaves, to the host tier
    /// when there is one; returns how many.
    fn evict(&mut self, want: usize) -> usize {
        self.evict_device(want, self.tier.on())
    }

    /// Drops every host page, then every evictable device page; namespace roots left empty go
    /// with their last node.
    fn reset(&mut self) -> usize {
        if self.tier.on() {
            self.tier.resetting = true;
            self.evict_host(usize::MAX);
            self.tier.resetting = false;
        }
        let forced = self.retained.forced_pages; // a reset is asked for: nothing was forced
        let done = self.evict_device(usize::MAX, false);
        self.retained.forced_pages = forced;
        done
    }

    fn retains(&self) -> bool {
        true
    }

    fn retain(&mut self, r: &Request<RadixExt>, class: u8, until: Option<f64>) -> u64 {
        self.retain_path(r.ext.last, class, until)
    }

    fn retain_prefix(
        &mut self,
        tokens: &[u32],
        namespace: &Namespace,
        class: u8,
        until: Option<f64>,
    ) -> (u64, usize) {
        self.retain_cached(tokens, namespace, class, until)
    }

    fn release_retention(&mut self, id: u64) -> bool {
        RadixIndex::release_retention(self, id)
    }

    fn expire(&mut self, now: f64) -> usize {
        RadixIndex::expire(self, now)
    }

    fn retention_counts(&self) -> (usize, u64, u64) {
        self.retained.counts()
    }

    fn host_free_pages(&self) -> usize {
        self.host_free.len()
    }

    fn take_host(&mut self, count: usize, out: &mut Vec<PageId>) {
        let free = self.host_free.len();
        if free < count {
            self.evict_host(count - free);
        }
        self.host_free
            .pop_many(count.min(self.host_free.len()), out);
    }

    fn free_host(&mut self, pages: &[PageId]) {
        self.host_free.insert_all(pages);
    }

    fn touch_host(&mut self, tokens: &[u32], namespace: &Namespace) {
        RadixIndex::touch_host(self, tokens, namespace)
    }

    fn adopt(
        &mut self,
        tokens: &[u32],
        namespace: &Namespace,
        from: usize,
        host: &[PageId],
    ) -> usize {
        RadixIndex::adopt(self, tokens, namespace, from, host)
    }

    fn persist(&mut self) {
        RadixIndex::persist(self)
    }

    fn tier(&self) -> &Tier {
        &self.tier
    }

    fn tier_mut(&mut self) -> &mut Tier {
        &mut self.tier
    }

    fn cursor(&self, namespace: &Namespace) -> Cursor {
        let node = self.roots.get(namespace).map(|r| r.0);
        Cursor {
            matched: 0,
            at: CursorAt::Node { node, offset: 0 },
        }
    }

    fn advance(&self, cursor: &mut Cursor, tokens: &[u32]) -> bool {
        let p = self.page_size;
        let CursorAt::Node {
            node: Some(mut node),
            mut offset,
        } = cursor.at
        else {
            return tokens.is_empty();
        };
        let mut pos = 0;
        let mut all = true;
        while pos < tokens.len() {
            let key = &self.nodes[node as usize].key;
            if offset == key.len() {
                match self.child(NodeId(node), &tokens[pos..pos + p]) {
                    Some(c) => (node, offset) = (c.0, 0),
                    None => {
                        all = false;
                        break;
                    }
                }
                continue;
            }
            let rest = &key[offset..];
            let common = common_prefix(rest, &tokens[pos..]) / p * p;
            offset += common;
            cursor.matched += common;
            pos += common;
            if common < rest.len().min(tokens.len() - pos + common) {
                all = false;
                break;
            }
        }
        cursor.at = CursorAt::Node {
            node: Some(node),
            offset,
        };
        all
    }

    fn check(&self, requests: &Requests<RadixExt>, num_pages: usize) -> Result<()> {
        check::check_tree(self, requests, num_pages)
    }

    fn events(&mut self) -> &mut EventLog {
        &mut self.events
    }

    /// The arena in id order (ids are handed out the same way in every cache driven alike):
    /// each live node's parent, edge tokens, pages, pin count and last-use time, and each
    /// root's namespace; then the logical clock and the LRU list front to back. Child maps are
    /// left out: their keys are seeded per cache and their order is the map's, and the parent
    /// links say the same. O(nodes + cached tokens).
    fn digest(&self, d: &mut crate::cache::digest::StateDigest) {
        d.word(self.nodes.len() as u64);
        for (id, n) in self.nodes.iter().enumerate() {
            if !n.alive {
                continue;
            }
            d.word(id as u64);
            d.word(n.parent.0 as u64);
            d.word((n.lock as u64) << 32 | n.children.len() as u64);
            d.word(n.time);
            d.word((n.class as u64) << 32 | n.soft as u64);
            match &n.ns {
                Some(ns) => d.namespace(ns),
                None => d.word(0),
            }
            d.tokens(&n.key);
            d.pages(&n.pages);
        }
        d.word(self.clock);
        for list in DEVICE_LISTS {
            d.word(self.lru.len(list) as u64);
            for id in self.lru.iter(list) {
                d.word(id.0 as u64);
            }
        }
        self.retained.digest(d, |node, d| d.word(node.0 as u64));
        if self.tier.on() {
            d.word(self.lru.len(HOST_LRU) as u64);
            for id in self.lru.iter(HOST_LRU) {
                d.word(id.0 as u64);
            }
        }
    }

    fn metadata_bytes(&self) -> usize {
        let per_child = std::mem::size_of::<(u64, NodeId)>() + 1;
        let nodes: usize = self
            .nodes
            .iter()
            .map(|n| {
                (n.key.capacity() + n.pages.capacity()) * 4 + n.children.capacity() * per_child
            })
            .sum();
        let roots: usize = self
            .roots
            .keys()
            .map(|ns| ns.as_ref().map_or(0, |b| b.len()) + std::mem::size_of::<Namespace>())
            .sum();
        nodes
            + roots
            + self.roots.capacity() * (std::mem::size_of::<(Namespace, NodeId)>() + 1)
            + self.nodes.capacity() * std::mem::size_of::<Node>()
            + self.vacant.capacity() * 4
            + self.lru.heap_bytes()
            + self.free.heap_bytes()
            + self.host_free.heap_bytes()
    }
}

/// Records that `r.tokens[from..upto]` entered the tree as a new leaf, hashing from the key the
/// request's last publish left (`key_at`) when it is there; returns the leaf's block keys.
fn record_new_leaf(
    events: &mut EventLog,
    r: &mut Request<RadixExt>,
    from: usize,
    upto: usize,
    p: usize,
) -> Vec<BlockHash> {
    let mut prev = match r.ext.key_at {
        Some((at, key)) if at == from => key,
        _ => {
            let keys = block_hashes(&r.tokens[..from], p, &r.namespace);
            keys.last()
                .copied()
                .unwrap_or_else(|| root_hash(p, &r.namespace))
        }
    };
    let parent = (from > 0).then_some(prev);
    let hashes: Vec<BlockHash> = r.tokens[from..upto]
        .chunks_exact(p)
        .map(|page| {
            prev = next_hash(&prev, page);
            prev
        })
        .collect();
    r.ext.key_at = Some((upto, prev));
    events.stored_keys(
        &r.namespace,
        parent,
        hashes.clone(),
        r.tokens[from..upto].to_vec(),
    );
    hashes
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::PrefixCache;

    /// Two caches' child keys are seeded apart, so equal digests (cache/digest.rs) prove the
    /// digest reads no per-cache secret.
    #[test]
    fn child_keys_are_seeded_per_cache() {
        let (a, b) = (
            RadixCache::new(4, 4).unwrap(),
            RadixCache::new(4, 4).unwrap(),
        );
        assert_ne!(
            a.index().keys.key(0, &[1, 2, 3, 4]),
            b.index().keys.key(0, &[1, 2, 3, 4])
        );
    }

    /// A cache whose child keys all collide.
    fn colliding(num_pages: usize, page_size: usize) -> RadixCache {
        let mut c = RadixCache::new(num_pages, page_size).unwrap();
        c.index_mut().collide = true;
        c
    }

    fn compute(c: &mut RadixCache, tokens: &[u32]) {
        let r = c.admit(tokens, None).unwrap();
        c.commit(r, tokens.len()).unwrap();
        c.finish(r).unwrap();
        c.check().unwrap();
    }

    /// SEMANTICS.md: a child-key collision costs a cache hit and never shares wrong KV. Lookups
    /// compare the page under the key; a publish that meets another page under its key keeps
    /// its own pages private.
    #[test]
    fn colliding_child_keys_cost_a_hit_never_wrong_kv() {
        for p in [1, 2, 4] {
            let mut c = colliding(64, p);
            let a: Vec<u32> = (0..2 * p as u32).collect();
            let b: Vec<u32> = (100..100 + 2 * p as u32).collect();
            compute(&mut c, &[&a[..], &[7]].concat());
            // Lookup side: b's first page sits under a's key, and is not a's page.
            let tb = [&b[..], &[7]].concat();
            assert_eq!(c.match_prefix(&tb, &None).unwrap(), 0, "P={p}");
            let mut cur = c.cursor(&None);
            assert!(!c.advance(&mut cur, &b[..p]));
            assert_eq!(cur.matched, 0);
            // Publish side: b computes its pages; they stay private to it and are freed after.
            let rb = c.admit(&tb, None).unwrap();
            let pages = c.request(rb).unwrap().pages.to_vec();
            // a's two full pages are pages 0 and 1.
            assert!(
                pages.iter().all(|pg| pg.0 >= 2),
                "P={p}: b got a's pages {pages:?}"
            );
            c.commit(rb, tb.len()).unwrap();
            c.check().unwrap();
            let before = c.stats();
            c.finish(rb).unwrap();
            c.check().unwrap();
            let after = c.stats();
            assert_eq!(after.free_pages, before.free_pages + pages.len(), "P={p}");
            assert_eq!(c.match_prefix(&tb, &None).unwrap(), 0, "P={p}");
            // a is untouched: still cached in full.
            assert_eq!(
                c.match_prefix(&[&a[..], &[9]].concat(), &None).unwrap(),
                2 * p
            );
            // Below a shared first page, a colliding second page is not shared either.
            let ta2 = [&a[..p], &b[p..], &[7]].concat();
            let r = c.admit(&ta2, None).unwrap();
            assert_eq!(c.request(r).unwrap().num_cached, p, "P={p}");
            c.commit(r, ta2.len()).unwrap();
            c.finish(r).unwrap();
            c.check().unwrap();
            assert_eq!(
                c.match_prefix(&[&a[..], &[9]].concat(), &None).unwrap(),
                2 * p
            );
        }
    }
}
