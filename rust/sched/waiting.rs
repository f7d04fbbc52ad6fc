//! The waiting queue's prompts as a trie of fixed-size chunks, shared by the scheduler's policies.
//!
//! ```text
//!   root[namespace] ── chunk 0 ── chunk 1 ──┬── chunk 2 ...   (weight: waiting requests below)
//!                                           └── chunk 2'...
//! ```
//!
//! A chunk is `C` tokens, a whole number of pages. Requests sharing a prefix share trie nodes, so
//! ranking work is done once per shared chunk instead of once per request: matching the queue
//! against the cache probes each trie node at most once, and only where its parent matched in
//! full. Children are keyed by a 64-bit hash of the chunk and compared on the way down: a chunk
//! whose key another chunk holds ends its request's path there, and the rest of that prompt is
//! matched token by token, so a collision costs speed, never a wrong estimate.

use crate::cache::index::Cursor;
use crate::cache::PrefixCache;
use crate::wire::hash::Namespace;
use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

pub(crate) const NIL: u32 = u32::MAX;

#[derive(Debug, Default)]
pub(crate) struct TrieNode {
    parent: u32,
    /// Chunk tokens: `src[offset..offset + C]` (shared with the request that brought it).
    src: Option<Arc<[u32]>>,
    offset: usize,
    children: HashMap<u64, u32>,
    /// Waiting requests whose path runs through (or ends at) this node.
    weight: u32,
    /// Sum of the ids of those requests: when `weight` is 1 it is that request's id, so a
    /// depth-first walk can stop at a subtree of one request.
    id_sum: u64,
    /// Waiting requests whose path ends here, by id (= arrival order).
    ending: BTreeSet<u64>,
    /// Pass in which `cursor` was computed, and whether the chunk matched in full then.
    stamp: u64,
    cursor: Option<Cursor>,
    full: bool,
    /// Pass in which a request admitted by that pass claimed this (uncached) chunk.
    claimed: u64,
    /// Id of the request that created the node: the tie-break between equal weights.
    created_by: u64,
}

impl TrieNode {
    pub fn chunk(&self, c: usize) -> &[u32] {
        let src = self.src.as_ref().expect("non-root nodes hold a chunk");
        &src[self.offset..self.offset + c]
    }
}

fn chunk_key(chunk: &[u32]) -> u64 {
    chunk.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &t| {
        (h ^ t as u64).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// The trie of waiting prompts.
#[derive(Debug)]
pub(crate) struct WaitingTrie {
    chunk: usize,
    nodes: Vec<TrieNode>,
    vacant: Vec<u32>,
    roots: HashMap<Namespace, u32>,
    /// Cached prefix of requests whose match `match_all` settled on its own (the only request
    /// below a partially matched chunk), by id; the rest are looked up along their paths.
    settled: HashMap<u64, usize>,
    /// Child key of a chunk (`chunk_key`; tests swap in a colliding one).
    pub key: fn(&[u32]) -> u64,
}

impl WaitingTrie {
    /// Tokens per chunk.
    pub fn chunk(&self) -> usize {
        self.chunk
    }

    /// Namespaces with a root (each while a waiting request uses it).
    pub fn num_roots(&self) -> usize {
        self.roots.len()
    }

    /// Cached prefix of the waiting request `id` (its chunk `path`, its prompt up to its match
    /// limit `tokens`) as ranked in pass `stamp`, after `match_all`.
    pub fn estimate(
        &self,
        cache: &dyn PrefixCache,
        id: u64,
        path: &[u32],
        tokens: &[u32],
        stamp: u64,
    ) -> usize {
        if let Some(&est) = self.settled.get(&id) {
            return est;
        }
        let f = self.frontier(path, stamp);
        let node = &self.nodes[path[f] as usize];
        let mut cur = node.cursor.expect("probed nodes hold a cursor");
        if node.full && f + 1 == path.len() {
            let start = (path.len() - 1) * self.chunk;
            cache.advance(&mut cur, &tokens[start..]);
        }
        cur.matched
    }

    /// Whether a request admitted in pass `stamp` claimed any of the chunks `nodes`.
    pub fn any_claimed(&self, nodes: &[u32], stamp: u64) -> bool {
        nodes
            .iter()
            .any(|&nd| self.nodes[nd as usize].claimed == stamp)
    }

    /// Claims the (uncached) chunks `nodes` for a request admitted in pass `stamp`.
    pub fn claim(&mut self, nodes: &[u32], stamp: u64) {
        for &nd in nodes {
            self.nodes[nd as usize].claimed = stamp;
        }
    }

    pub fn new(chunk: usize) -> Self {
        WaitingTrie {
            chunk,
            nodes: Vec::new(),
            vacant: Vec::new(),
            roots: HashMap::new(),
            settled: HashMap::new(),
            key: chunk_key,
        }
    }

    fn alloc(&mut self, node: TrieNode) -> u32 {
        match self.vacant.pop() {
            Some(id) => {
                self.nodes[id as usize] = node;
                id
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as u32
            }
        }
    }

    /// Adds a request's first `full_chunks` chunks; returns its path (root first).
    pub fn insert(
        &mut self,
        id: u64,
        tokens: &Arc<[u32]>,
        namespace: &Namespace,
        full_chunks: usize,
    ) -> Vec<u32> {
        let c = self.chunk;
        let root = match self.roots.get(namespace) {
            Some(&r) => r,
            None => {
                let r = self.alloc(TrieNode {
                    parent: NIL,
                    created_by: id,
                    ..Default::default()
                });
                self.roots.insert(namespace.clone(), r);
                r
            }
        };
        let mut path = Vec::with_capacity(full_chunks + 1);
        let mut node = root;
        self.nodes[root as usize].weight += 1;
        self.nodes[root as usize].id_sum += id;
        path.push(root);
        for i in 0..full_chunks {
            let chunk = &tokens[i * c..(i + 1) * c];
            let key = (self.key)(chunk);
            node = match self.nodes[node as usize].children.get(&key) {
                Some(&child) if self.nodes[child as usize].chunk(c) == chunk => child,
                // Another chunk holds this key: the path stops here, and the scheduler matches
                // the rest of the prompt token by token from this node, so estimates stay exact.
                Some(_) => break,
                None => {
                    let child = self.alloc(TrieNode {
                        parent: node,
                        src: Some(tokens.clone()),
                        offset: i * c,
                        created_by: id,
                        ..Default::default()
                    });
                    self.nodes[node as usize].children.insert(key, child);
                    child
                }
            };
            self.nodes[node as usize].weight += 1;
            self.nodes[node as usize].id_sum += id;
            path.push(node);
        }
        self.nodes[node as usize].ending.insert(id);
        path
    }

    /// Removes a request along `path`, dropping nodes no request passes through any more, the
    /// root of its `namespace` included (so a namespace costs nothing once no request uses it).
    pub fn remove(&mut self, id: u64, path: &[u32], namespace: &Namespace) {
        let c = self.chunk;
        if let Some(&end) = path.last() {
            self.nodes[end as usize].ending.remove(&id);
        }
        for &n in path.iter().rev() {
            let node = &mut self.nodes[n as usize];
            node.weight -= 1;
            node.id_sum -= id;
            if node.weight == 0 && node.parent != NIL {
                let key = (self.key)(node.chunk(c));
                let parent = node.parent;
                self.nodes[parent as usize].children.remove(&key);
                self.nodes[n as usize] = TrieNode::default();
                self.vacant.push(n);
            } else if node.weight == 0 {
                self.roots.remove(namespace);
                self.nodes[n as usize] = TrieNode::default();
                self.vacant.push(n);
                if self.roots.capacity() > 64 && self.roots.len() * 4 < self.roots.capacity() {
                    self.roots.shrink_to(self.roots.len() * 2);
                }
            }
        }
    }

    /// Matches every live trie node against `cache` for pass `stamp`: a node is probed only if
    /// its parent matched in full. Returns nothing; results sit in the nodes' `cursor`/`full`.
    pub fn match_all(&mut self, cache: &dyn PrefixCache, stamp: u64) {
        let c = self.chunk;
        self.settled.clear();
        let mut stack: Vec<u32> = Vec::new();
        for (ns, &root) in &self.roots {
            let node = &mut self.nodes[root as usize];
            node.stamp = stamp;
            node.cursor = Some(cache.cursor(ns));
            node.full = true;
            stack.push(root);
        }
        while let Some(n) = stack.pop() {
            let cursor = self.nodes[n as usize]
                .cursor
                .expect("stamped nodes hold a cursor");
            let children: Vec<u32> = self.nodes[n as usize].children.values().copied().collect();
            for ch in children {
                let mut cur = cursor;
                let full = cache.advance(&mut cur, self.nodes[ch as usize].chunk(c));
                let node = &mut self.nodes[ch as usize];
                node.stamp = stamp;
                node.cursor = Some(cur);
                node.full = full;
                if full {
                    stack.push(ch);
                } else if node.weight == 1 {
                    // The one request below a partial match: its estimate is settled here.
                    self.settled.insert(node.id_sum, cur.matched);
                }
            }
        }
    }

    /// The deepest node of `path` probed in pass `stamp` (the match frontier), as an index.
    pub fn frontier(&self, path: &[u32], stamp: u64) -> usize {
        // Probed nodes form a prefix of the path: binary search for its end.
        let (mut lo, mut hi) = (0, path.len());
        while hi - lo > 1 {
            let mid = (lo + hi) / 2;
            if self.nodes[path[mid] as usize].stamp == stamp {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        lo
    }

    /// Requests in depth-first order: at each node its own requests, then its children, those
    /// whose chunk is cached in full (in pass `stamp`) first, then the heaviest, then the oldest.
    /// This is SGLang's DFS-weight order made to see the cache: a group whose prefix is cached
    /// is served before a heavier group that would have to compute (and maybe evict for) its own.
    pub fn dfs_order(&self, stamp: u64) -> Vec<u64> {
        let key = |n: u32| {
            let node = &self.nodes[n as usize];
            let cached =
                node.stamp == stamp && node.full && node.cursor.is_some_and(|c| c.matched > 0);
            (!cached, std::cmp::Reverse(node.weight), node.created_by)
        };
        let mut out = Vec::new();
        let mut roots: Vec<u32> = self.roots.values().copied().collect();
        roots.sort_by_key(|&r| key(r));
        let mut stack: Vec<u32> = roots.into_iter().rev().collect();
        while let Some(n) = stack.pop() {
            let node = &self.nodes[n as usize];
            if node.weight == 1 {
                out.push(node.id_sum);
                continue;
            }
            out.extend(node.ending.iter().copied());
            let mut kids: Vec<u32> = node.children.values().copied().collect();
            kids.sort_by_key(|&k| key(k));
            stack.extend(kids.into_iter().rev());
        }
        out
    }
}
