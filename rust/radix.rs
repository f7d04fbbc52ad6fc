//! `RadixCache`: a compressed radix tree over token ids, in the style of SGLang's RadixAttention.
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

use crate::cache::{check_commit, check_pool_args, check_prompt, match_limit, Namespace};
use crate::cache::{Cursor, PrefixCache, RequestView};
use crate::error::{corrupt, Error, Result};
use crate::freeset::FreeSet;
use crate::links::{Links, ListId};
use crate::request::{new_cache_id, Request, RequestId, Requests};
use crate::stats::{CacheStats, Counters};
use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::hash::{BuildHasher, BuildHasherDefault, Hasher};

const NIL: u32 = u32::MAX;
const LRU: ListId = ListId(0);

/// Hashes the `u64` child keys: one multiply, enough to spread them over a hashbrown table.
#[derive(Default)]
struct MixHasher(u64);

impl Hasher for MixHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(b as u64);
        }
    }
    fn write_u64(&mut self, x: u64) {
        self.0 = (self.0 ^ x)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .rotate_left(29);
    }
}

type ChildMap = HashMap<u64, u32, BuildHasherDefault<MixHasher>>;

#[derive(Debug, Default)]
struct Node {
    /// `NIL` for a namespace root.
    parent: u32,
    /// Tokens of the edge into this node; a whole number of pages (empty only for roots).
    key: Vec<u32>,
    /// `key.len() / page_size` page ids.
    pages: Vec<u32>,
    children: ChildMap,
    /// Live requests whose pinned path runs through this node.
    lock: u32,
    /// Logical time of the last admission or release through this node.
    time: u64,
    alive: bool,
}

/// The radix cache's own part of a request.
#[derive(Debug, Clone, Default)]
pub struct RadixExt {
    /// Deepest node whose path spells `tokens[..published]`; pinned by this request.
    last: u32,
    /// Pages this request computed that another request had published first: private to it,
    /// freed when it ends. (The rest of its private pages are `pages[published / P..]`.)
    dups: Vec<u32>,
}

/// Result of walking the tree along a token sequence.
struct Walk {
    /// Nodes matched in full, root excluded, top down.
    path: Vec<u32>,
    /// A node matched only up to this many tokens (a page multiple, short of its key).
    partial: Option<(u32, usize)>,
    /// Tokens matched.
    matched: usize,
}

/// First `n` such that `a[n] != b[n]`, compared in chunks (memcmp) before single tokens.
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    const CHUNK: usize = 32;
    let n = a.len().min(b.len());
    let mut i = 0;
    while i + CHUNK <= n && a[i..i + CHUNK] == b[i..i + CHUNK] {
        i += CHUNK;
    }
    while i < n && a[i] == b[i] {
        i += 1;
    }
    i
}

/// The tree, its pool and its LRU list: everything a request's operations mutate besides the
/// request itself (kept apart so that a request can be borrowed while the tree changes).
#[derive(Debug)]
struct Tree {
    page_size: usize,
    nodes: Vec<Node>,
    vacant: Vec<u32>,
    roots: HashMap<Namespace, u32>,
    /// Unpinned non-root leaves, least recently used at the front.
    lru: Links,
    free: FreeSet,
    /// Pages held by unpinned nodes.
    evictable: usize,
    clock: u64,
    /// Keys the hash of pages longer than two tokens.
    hasher: RandomState,
}

impl Tree {
    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// Child-map key of a page: exact for pages of one or two tokens; otherwise SipHash keyed
    /// with this cache's random key, so nobody can construct two pages that collide. Lookups
    /// compare the page itself: a chance collision (2^-64 per pair) can only cost a cache hit.
    fn page_key(&self, page: &[u32]) -> u64 {
        match page {
            [t] => *t as u64,
            [a, b] => (*a as u64) << 32 | *b as u64,
            _ => {
                let mut h = self.hasher.build_hasher();
                for &t in page {
                    h.write_u32(t);
                }
                h.finish()
            }
        }
    }

    fn child(&self, node: u32, page: &[u32]) -> Option<u32> {
        let &c = self.nodes[node as usize]
            .children
            .get(&self.page_key(page))?;
        (self.nodes[c as usize].key[..self.page_size] == *page).then_some(c)
    }

    fn alloc_node(&mut self, node: Node) -> u32 {
        match self.vacant.pop() {
            Some(id) => {
                self.nodes[id as usize] = node;
                id
            }
            None => {
                self.nodes.push(node);
                self.lru.ensure(self.nodes.len());
                (self.nodes.len() - 1) as u32
            }
        }
    }

    fn free_node(&mut self, id: u32) {
        self.nodes[id as usize] = Node {
            parent: NIL,
            ..Node::default()
        };
        self.vacant.push(id);
    }

    /// Follows `tokens` (a page multiple) down from `root`, changing nothing.
    fn walk(&self, root: u32, tokens: &[u32]) -> Walk {
        let p = self.page_size;
        let (mut node, mut pos, mut path) = (root, 0, Vec::new());
        while pos < tokens.len() {
            let Some(c) = self.child(node, &tokens[pos..pos + p]) else {
                break;
            };
            let key = &self.nodes[c as usize].key;
            let common = common_prefix(key, &tokens[pos..]) / p * p;
            pos += common;
            if common < key.len() {
                return Walk {
                    path,
                    partial: Some((c, common)),
                    matched: pos,
                };
            }
            path.push(c);
            node = c;
        }
        Walk {
            path,
            partial: None,
            matched: pos,
        }
    }

    /// Splits `id`'s edge after `at` tokens; returns the new node, which takes the head.
    fn split(&mut self, id: u32, at: usize) -> u32 {
        let p = self.page_size;
        let n = &mut self.nodes[id as usize];
        let head_key = n.key[..at].to_vec();
        let head_pages = n.pages[..at / p].to_vec();
        n.key = n.key[at..].to_vec();
        n.pages = n.pages[at / p..].to_vec();
        let (parent, lock, time) = (n.parent, n.lock, n.time);
        let tail_key = self.page_key(&self.nodes[id as usize].key[..p]);
        let head_first = self.page_key(&head_key[..p]);
        let mut children = ChildMap::default();
        children.insert(tail_key, id);
        let mid = self.alloc_node(Node {
            parent,
            key: head_key,
            pages: head_pages,
            children,
            lock,
            time,
            alive: true,
        });
        self.nodes[id as usize].parent = mid;
        self.nodes[parent as usize].children.insert(head_first, mid);
        mid
    }

    /// Pins the path from `id` to its root.
    fn lock(&mut self, mut id: u32) {
        let now = self.tick();
        while id != NIL {
            let n = &mut self.nodes[id as usize];
            if n.lock == 0 {
                self.evictable -= n.pages.len();
                if self.lru.is_linked(id) {
                    self.lru.remove(LRU, id);
                }
            }
            n.lock += 1;
            n.time = now;
            id = n.parent;
        }
    }

    /// Unpins the path from `id` to its root; leaves left unpinned become the most recently used.
    fn unlock(&mut self, mut id: u32) {
        let now = self.tick();
        while id != NIL {
            let n = &mut self.nodes[id as usize];
            n.lock -= 1;
            n.time = now;
            let parent = n.parent;
            if n.lock == 0 {
                self.evictable += n.pages.len();
                if parent != NIL && n.children.is_empty() {
                    self.lru.push_back(LRU, id);
                }
            }
            id = parent;
        }
    }

    /// Links an unpinned node that just became a leaf at its place by last use. Its time is at
    /// least that of the leaf just evicted below it (the front), so the walk is short.
    fn link_by_time(&mut self, id: u32) {
        let t = self.nodes[id as usize].time;
        let mut at = self.lru.front(LRU);
        while let Some(e) = at {
            if self.nodes[e as usize].time > t {
                break;
            }
            at = self.lru.next_of(e);
        }
        match at {
            Some(e) => self.lru.insert_before(LRU, e, id),
            None => self.lru.push_back(LRU, id),
        }
    }

    /// Frees up to `want` pages from the least recently used leaves; returns how many.
    fn evict(&mut self, want: usize) -> usize {
        let p = self.page_size;
        let mut done = 0;
        while done < want {
            let Some(leaf) = self.lru.front(LRU) else {
                break;
            };
            let first = self.page_key(&self.nodes[leaf as usize].key[..p]);
            let n = &mut self.nodes[leaf as usize];
            let take = (want - done).min(n.pages.len());
            let keep = n.pages.len() - take;
            for &page in &n.pages[keep..] {
                self.free.insert(page);
            }
            n.pages.truncate(keep);
            n.key.truncate(keep * p);
            self.evictable -= take;
            done += take;
            if keep > 0 {
                continue;
            }
            let parent = n.parent;
            self.lru.remove(LRU, leaf);
            self.free_node(leaf);
            let par = &mut self.nodes[parent as usize];
            par.children.remove(&first);
            if par.parent != NIL && par.children.is_empty() && par.lock == 0 {
                self.link_by_time(parent);
            }
        }
        done
    }

    /// Takes `count` free pages (evicting first if needed), appending them to `out`.
    /// The caller has checked that `free + evictable >= count`.
    fn allocate(&mut self, count: usize, out: &mut Vec<u32>) -> usize {
        let short = count.saturating_sub(self.free.len());
        let evicted = if short > 0 { self.evict(short) } else { 0 };
        out.extend((0..count).map(|_| self.free.pop().expect("capacity checked")));
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
            match self.nodes[node as usize].children.get(&k).copied() {
                None => {
                    let pages = r.pages[pos / p..upto / p].to_vec();
                    self.evictable += pages.len();
                    let now = self.clock;
                    let leaf = self.alloc_node(Node {
                        parent: node,
                        key: r.tokens[pos..upto].to_vec(),
                        pages,
                        children: ChildMap::default(),
                        lock: 0,
                        time: now,
                        alive: true,
                    });
                    self.nodes[node as usize].children.insert(k, leaf);
                    node = leaf;
                    pos = upto;
                }
                // A 64-bit child-key collision: the rest stays private to the request.
                Some(c) if self.nodes[c as usize].key[..p] != *page => break,
                Some(c) => {
                    let key = &self.nodes[c as usize].key;
                    let common = common_prefix(key, &r.tokens[pos..upto]) / p * p;
                    let c = if common < key.len() {
                        self.split(c, common)
                    } else {
                        c
                    };
                    r.ext
                        .dups
                        .extend_from_slice(&r.pages[pos / p..(pos + common) / p]);
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

    /// The root of `namespace`, created if missing.
    fn root(&mut self, namespace: &Namespace) -> u32 {
        if let Some(&r) = self.roots.get(namespace) {
            return r;
        }
        let r = self.alloc_node(Node {
            parent: NIL,
            alive: true,
            ..Node::default()
        });
        self.roots.insert(namespace.clone(), r);
        r
    }
}

/// A prefix cache indexed by a compressed radix tree over token ids.
#[derive(Debug)]
pub struct RadixCache {
    tree: Tree,
    num_pages: usize,
    requests: Requests<RadixExt>,
    counters: Counters,
}

impl RadixCache {
    /// A cache over `num_pages` pages of `page_size` tokens (1 for token-exact reuse).
    pub fn new(num_pages: usize, page_size: usize) -> Result<Self> {
        check_pool_args(num_pages, page_size)?;
        Ok(RadixCache {
            tree: Tree {
                page_size,
                nodes: Vec::new(),
                vacant: Vec::new(),
                roots: HashMap::new(),
                lru: Links::new(1, 0),
                free: FreeSet::full(num_pages),
                evictable: 0,
                clock: 0,
                hasher: RandomState::new(),
            },
            num_pages,
            requests: Requests::new(new_cache_id()),
            counters: Counters::default(),
        })
    }

    fn p(&self) -> usize {
        self.tree.page_size
    }

    fn release(&mut self, id: RequestId, publish: bool) -> Result<()> {
        let mut r = self.requests.remove(id)?;
        if publish {
            let upto = r.num_computed / self.p() * self.p();
            self.tree.publish(&mut r, upto);
        }
        self.tree.unlock(r.ext.last);
        let private = r
            .ext
            .dups
            .iter()
            .chain(&r.pages[r.published / self.tree.page_size..]);
        for &page in private {
            self.tree.free.insert(page);
        }
        Ok(())
    }

    /// Pages of each node on the way from the namespace root to `node`, top down.
    fn path_to(&self, mut node: u32) -> Vec<u32> {
        let mut path = Vec::new();
        while self.tree.nodes[node as usize].parent != NIL {
            path.push(node);
            node = self.tree.nodes[node as usize].parent;
        }
        path.reverse();
        path
    }
}

impl PrefixCache for RadixCache {
    fn admit(&mut self, tokens: &[u32], namespace: Namespace) -> Result<RequestId> {
        check_prompt(tokens)?;
        let (p, n) = (self.p(), tokens.len());
        let limit = match_limit(n, p);
        let t = &self.tree;
        let walk = match t.roots.get(&namespace) {
            Some(&root) => t.walk(root, &tokens[..limit]),
            None => Walk {
                path: Vec::new(),
                partial: None,
                matched: 0,
            },
        };
        let needed = n.div_ceil(p) - walk.matched / p;
        // Pinning the match takes its unpinned pages out of what eviction may reclaim.
        let mut pinned: usize = walk
            .path
            .iter()
            .map(|&id| &t.nodes[id as usize])
            .filter(|n| n.lock == 0)
            .map(|n| n.pages.len())
            .sum();
        if let Some((c, at)) = walk.partial {
            if t.nodes[c as usize].lock == 0 {
                pinned += at / p;
            }
        }
        let available = t.free.len() + t.evictable - pinned;
        if needed > available {
            return Err(Error::OutOfPages { needed, available });
        }
        // Nothing below can fail.
        let root = self.tree.root(&namespace);
        let mut last = walk.path.last().copied().unwrap_or(root);
        if let Some((c, at)) = walk.partial {
            last = self.tree.split(c, at);
        }
        self.tree.lock(last);
        let mut pages = Vec::with_capacity(n.div_ceil(p));
        for &id in walk.path.iter().chain(walk.partial.map(|_| &last)) {
            pages.extend_from_slice(&self.tree.nodes[id as usize].pages);
        }
        self.counters.evicted_pages += self.tree.allocate(needed, &mut pages) as u64;
        self.counters.record_query(n, walk.matched);
        Ok(self.requests.insert(Request {
            tokens: tokens.to_vec(),
            namespace,
            pages,
            num_cached: walk.matched,
            num_computed: walk.matched,
            published: walk.matched,
            ext: RadixExt {
                last,
                dups: Vec::new(),
            },
        }))
    }

    fn extend(&mut self, id: RequestId, tokens: &[u32]) -> Result<()> {
        let p = self.p();
        let r = self.requests.get(id)?;
        let needed = (r.tokens.len() + tokens.len()).div_ceil(p) - r.pages.len();
        let available = self.tree.free.len() + self.tree.evictable;
        if needed > available {
            return Err(Error::OutOfPages { needed, available });
        }
        let r = self.requests.get_mut(id)?;
        self.counters.evicted_pages += self.tree.allocate(needed, &mut r.pages) as u64;
        r.tokens.extend_from_slice(tokens);
        Ok(())
    }

    fn commit(&mut self, id: RequestId, num_computed: usize) -> Result<()> {
        let p = self.p();
        let r = self.requests.get_mut(id)?;
        check_commit(num_computed, r.num_computed, r.tokens.len())?;
        r.num_computed = num_computed;
        self.tree.publish(r, num_computed / p * p);
        Ok(())
    }

    fn finish(&mut self, id: RequestId) -> Result<()> {
        self.release(id, true)
    }

    fn abort(&mut self, id: RequestId) -> Result<()> {
        self.release(id, false)
    }

    fn match_prefix(&self, tokens: &[u32], namespace: &Namespace) -> Result<usize> {
        check_prompt(tokens)?;
        let limit = match_limit(tokens.len(), self.p());
        Ok(match self.tree.roots.get(namespace) {
            Some(&root) => self.tree.walk(root, &tokens[..limit]).matched,
            None => 0,
        })
    }

    fn evict(&mut self, num_pages: usize) -> usize {
        let done = self.tree.evict(num_pages);
        self.counters.evicted_pages += done as u64;
        done
    }

    fn reset(&mut self) -> usize {
        let done = self.evict(usize::MAX);
        let t = &mut self.tree;
        let empty: Vec<u32> = t
            .roots
            .values()
            .copied()
            .filter(|&r| t.nodes[r as usize].lock == 0 && t.nodes[r as usize].children.is_empty())
            .collect();
        t.roots.retain(|_, r| !empty.contains(r));
        for r in empty {
            t.free_node(r);
        }
        done
    }

    fn stats(&self) -> CacheStats {
        let (free, evictable) = (self.tree.free.len(), self.tree.evictable);
        self.counters
            .snapshot(self.num_pages, self.p(), free, evictable)
    }

    fn check(&self) -> Result<()> {
        check_tree(self)
    }

    fn request(&self, id: RequestId) -> Result<RequestView<'_>> {
        Ok(self.requests.get(id)?.view(self.p()))
    }

    fn page_size(&self) -> usize {
        self.p()
    }

    fn cursor(&self, namespace: &Namespace) -> Cursor {
        let node = self.tree.roots.get(namespace).copied().unwrap_or(NIL);
        Cursor {
            matched: 0,
            node,
            offset: 0,
            hash: [0; 32],
        }
    }

    fn advance(&self, cursor: &mut Cursor, tokens: &[u32]) -> bool {
        let (t, p) = (&self.tree, self.p());
        let mut pos = 0;
        while pos < tokens.len() {
            if cursor.node == NIL {
                return false;
            }
            let node = &t.nodes[cursor.node as usize];
            if cursor.offset == node.key.len() {
                match t.child(cursor.node, &tokens[pos..pos + p]) {
                    Some(c) => {
                        *cursor = Cursor {
                            node: c,
                            offset: 0,
                            ..*cursor
                        }
                    }
                    None => return false,
                }
                continue;
            }
            let rest = &node.key[cursor.offset..];
            let common = common_prefix(rest, &tokens[pos..]) / p * p;
            cursor.offset += common;
            cursor.matched += common;
            pos += common;
            if common < rest.len().min(tokens.len() - pos + common) {
                return false;
            }
        }
        true
    }

    fn metadata_bytes(&self) -> usize {
        let t = &self.tree;
        let per_child = std::mem::size_of::<(u64, u32)>() + 1;
        let nodes: usize = t
            .nodes
            .iter()
            .map(|n| {
                (n.key.capacity() + n.pages.capacity()) * 4 + n.children.capacity() * per_child
            })
            .sum();
        nodes
            + t.nodes.capacity() * std::mem::size_of::<Node>()
            + t.vacant.capacity() * 4
            + t.lru.heap_bytes()
            + t.free.heap_bytes()
    }
}

/// Recomputes the tree's invariants from scratch (see `PrefixCache::check`).
fn check_tree(c: &RadixCache) -> Result<()> {
    let t = &c.tree;
    let p = t.page_size;
    let mut owner = vec![0u8; c.num_pages];
    let mut own = |page: u32, what: &str| -> Result<()> {
        let slot = owner
            .get_mut(page as usize)
            .ok_or(())
            .or_else(|_| corrupt(format!("{what} holds page {page}, outside the pool")))?;
        *slot += 1;
        Ok(())
    };
    // Structure, and pages held by the tree.
    let mut evictable = 0;
    let mut locks = vec![0u32; t.nodes.len()];
    for (ns, &root) in &t.roots {
        let r = &t.nodes[root as usize];
        if !r.alive || r.parent != NIL || !r.key.is_empty() {
            return corrupt(format!("root {root} of namespace {ns:?} is malformed"));
        }
    }
    let mut leaves = 0;
    for (id, n) in t.nodes.iter().enumerate() {
        if !n.alive {
            continue;
        }
        let id = id as u32;
        if n.parent == NIL {
            if !t.roots.values().any(|&r| r == id) {
                return corrupt(format!("node {id} has no parent and is no namespace root"));
            }
        } else {
            let par = &t.nodes[n.parent as usize];
            if n.key.is_empty() || n.key.len() % p != 0 || n.pages.len() * p != n.key.len() {
                return corrupt(format!(
                    "node {id} has {} tokens and {} pages",
                    n.key.len(),
                    n.pages.len()
                ));
            }
            if !par.alive || par.children.get(&t.page_key(&n.key[..p])) != Some(&id) {
                return corrupt(format!("node {id} is not its parent's child"));
            }
        }
        for (&k, &ch) in &n.children {
            let child = &t.nodes[ch as usize];
            if !child.alive || child.parent != id || t.page_key(&child.key[..p]) != k {
                return corrupt(format!("child {ch} of node {id} has a wrong key or parent"));
            }
        }
        for &page in &n.pages {
            own(page, "the tree")?;
        }
        if n.lock == 0 {
            evictable += n.pages.len();
        }
        let is_leaf = n.parent != NIL && n.children.is_empty() && n.lock == 0;
        if is_leaf != t.lru.is_linked(id) {
            return corrupt(format!(
                "node {id}: evictable leaf {is_leaf}, in the LRU list {}",
                !is_leaf
            ));
        }
        leaves += is_leaf as usize;
        if n.lock > 0 && n.parent != NIL && t.nodes[n.parent as usize].lock < n.lock {
            return corrupt(format!("node {id} is pinned more than its parent"));
        }
    }
    if leaves != t.lru.len(LRU) {
        return corrupt(format!(
            "LRU list holds {} nodes, {leaves} are evictable leaves",
            t.lru.len(LRU)
        ));
    }
    let mut prev_time = 0;
    for id in t.lru.iter(LRU) {
        let time = t.nodes[id as usize].time;
        if time < prev_time {
            return corrupt(format!("LRU list out of order at node {id}"));
        }
        prev_time = time;
    }
    if evictable != t.evictable {
        return corrupt(format!(
            "evictable count {} but unpinned nodes hold {evictable}",
            t.evictable
        ));
    }
    // Requests: pins, private pages, and paths that spell their published tokens.
    for r in c.requests.iter() {
        let mut id = r.ext.last;
        if !t.nodes[id as usize].alive {
            return corrupt(format!("a request pins dead node {id}"));
        }
        while id != NIL {
            locks[id as usize] += 1;
            id = t.nodes[id as usize].parent;
        }
        let path = c.path_to(r.ext.last);
        let spelled: Vec<u32> = path
            .iter()
            .flat_map(|&n| t.nodes[n as usize].key.iter().copied())
            .collect();
        if spelled[..] != r.tokens[..r.published] {
            return corrupt("a request's pinned path does not spell its published tokens");
        }
        if r.pages.len() != r.tokens.len().div_ceil(p)
            || r.published % p != 0
            || r.published > r.num_computed
        {
            return corrupt("a request's page table or published count is malformed");
        }
        let tree_pages: Vec<u32> = path
            .iter()
            .flat_map(|&n| t.nodes[n as usize].pages.iter().copied())
            .collect();
        for (i, (&mine, &tree)) in r.pages.iter().zip(&tree_pages).enumerate() {
            if mine != tree && !r.ext.dups.contains(&mine) {
                return corrupt(format!(
                    "request page {i} is {mine}, the tree holds {tree} there"
                ));
            }
        }
        for &page in r.ext.dups.iter().chain(&r.pages[r.published / p..]) {
            own(page, "a request")?;
        }
    }
    for (id, n) in t.nodes.iter().enumerate() {
        if n.alive && n.lock != locks[id] {
            return corrupt(format!(
                "node {id} is pinned {} times, live requests pin it {}",
                n.lock, locks[id]
            ));
        }
    }
    for page in 0..c.num_pages as u32 {
        let held = owner[page as usize] + t.free.contains(page) as u8;
        if held != 1 {
            return corrupt(format!(
                "page {page} is held {held} times (free, tree, requests)"
            ));
        }
    }
    let s = c.counters;
    if s.hit_tokens > s.query_tokens {
        return corrupt("more hit tokens than query tokens");
    }
    Ok(())
}
