//! The radix tree's invariant checker: everything `check()` verifies, recomputed from scratch.

use super::*;

/// Recomputes the tree's invariants from scratch (see `PrefixCache::check`).
pub(super) fn check_tree(
    t: &RadixIndex,
    requests: &Requests<RadixExt>,
    num_pages: usize,
) -> Result<()> {
    let p = t.page_size;
    let host_pages = t.tier.host_pages;
    let mut owner = vec![0u8; num_pages + host_pages];
    let mut own = |page: PageId, what: &str| -> Result<()> {
        let slot = owner
            .get_mut(page.index())
            .ok_or(())
            .or_else(|_| corrupt(format!("{what} holds page {}, outside the pool", page.0)))?;
        *slot += 1;
        Ok(())
    };
    // Structure, and pages held by the tree.
    let mut evictable = 0;
    let mut locks = vec![0u32; t.nodes.len()];
    for (ns, &root) in &t.roots {
        let r = t.node(root);
        if !r.alive || r.parent != NIL || !r.key.is_empty() || r.ns.as_deref() != Some(ns) {
            return corrupt(format!("root {} of namespace {ns:?} is malformed", root.0));
        }
        if r.lock == 0 && r.children.is_empty() {
            return corrupt(format!(
                "root {} of namespace {ns:?} is empty and unpinned, yet kept",
                root.0
            ));
        }
    }
    let (mut leaves, mut host_leaves) = (0, 0);
    for (id, n) in t.nodes.iter().enumerate() {
        if !n.alive {
            continue;
        }
        let id = NodeId(id as u32);
        if n.parent == NIL {
            if !t.roots.values().any(|&r| r == id) {
                return corrupt(format!(
                    "node {} has no parent and is no namespace root",
                    id.0
                ));
            }
        } else {
            let par = t.node(n.parent);
            if n.key.is_empty() || n.key.len() % p != 0 || n.pages.len() * p != n.key.len() {
                return corrupt(format!(
                    "node {} has {} tokens and {} pages",
                    id.0,
                    n.key.len(),
                    n.pages.len()
                ));
            }
            if !par.alive || par.children.get(&t.page_key(&n.key[..p])) != Some(&id) {
                return corrupt(format!("node {} is not its parent's child", id.0));
            }
            if !n.block_keys.is_empty() && !block_keys_hold(t, id) {
                return corrupt(format!(
                    "node {} holds {} block keys for {} pages, or keys not of its path",
                    id.0,
                    n.block_keys.len(),
                    n.pages.len()
                ));
            }
        }
        for (&k, &ch) in &n.children {
            let child = t.node(ch);
            if !child.alive || child.parent != id || t.page_key(&child.key[..p]) != k {
                return corrupt(format!(
                    "child {} of node {} has a wrong key or parent",
                    ch.0, id.0
                ));
            }
        }
        for &page in &n.pages {
            own(page, "the tree")?;
            if t.tier.is_host(page) != n.host {
                return corrupt(format!(
                    "node {} on the host: {}, holds page {}",
                    id.0, n.host, page.0
                ));
            }
        }
        if n.host && (n.lock > 0 || n.parent == NIL) {
            return corrupt(format!("node {} is on the host and pinned or a root", id.0));
        }
        if !n.host && n.parent != NIL && t.node(n.parent).host {
            return corrupt(format!("device node {} has a parent on the host", id.0));
        }
        let dev_children = n.children.values().filter(|&&c| !t.node(c).host).count();
        if dev_children != n.dev_children as usize {
            return corrupt(format!(
                "node {} counts {} children on the device, has {dev_children}",
                id.0, n.dev_children
            ));
        }
        if n.lock == 0 && !n.host {
            evictable += n.pages.len();
        }
        let is_leaf = n.parent != NIL && !n.host && n.dev_children == 0 && n.lock == 0;
        let is_host_leaf = n.host && n.children.is_empty();
        if (is_leaf || is_host_leaf) != t.lru.is_linked(id) {
            return corrupt(format!(
                "node {}: evictable leaf {}, in an LRU list {}",
                id.0,
                is_leaf || is_host_leaf,
                !(is_leaf || is_host_leaf)
            ));
        }
        leaves += is_leaf as usize;
        host_leaves += is_host_leaf as usize;
        if n.lock > 0 && n.parent != NIL && t.node(n.parent).lock < n.lock {
            return corrupt(format!("node {} is pinned more than its parent", id.0));
        }
    }
    let device_listed: usize = DEVICE_LISTS.iter().map(|&l| t.lru.len(l)).sum();
    if leaves != device_listed || host_leaves != t.lru.len(HOST_LRU) {
        return corrupt(format!(
            "LRU lists hold {device_listed} and {} nodes, {leaves} and {host_leaves} are \
             evictable leaves",
            t.lru.len(HOST_LRU)
        ));
    }
    for list in DEVICE_LISTS.into_iter().chain([HOST_LRU]) {
        let mut prev_time = 0;
        for id in t.lru.iter(list) {
            let n = t.node(id);
            if n.time < prev_time || list_for(n) != list {
                return corrupt(format!(
                    "LRU list {} out of order, or holding node {} of class {}, retained by {}, \
                     host {}",
                    list.0, id.0, n.class, n.soft, n.host
                ));
            }
            prev_time = n.time;
        }
    }
    // Retentions: each holds a live non-root node, and the counts are what they add up to.
    let mut soft = vec![0u32; t.nodes.len()];
    for (rid, r) in t.retained.iter() {
        let n = t.nodes.get(r.held.index());
        if !n.is_some_and(|n| n.alive && n.parent != NIL) || r.until.is_nan() {
            return corrupt(format!(
                "retention {rid} holds node {}, not a cached edge",
                r.held.0
            ));
        }
        let mut id = r.held;
        while t.node(id).parent != NIL {
            soft[id.index()] += 1;
            id = t.node(id).parent;
        }
    }
    for (i, n) in t.nodes.iter().enumerate() {
        if n.alive && (n.soft != soft[i] || n.class >= CLASSES) {
            return corrupt(format!(
                "node {i}: retained by {} (the retentions add up to {}), class {}",
                n.soft, soft[i], n.class
            ));
        }
    }
    if evictable != t.evictable {
        return corrupt(format!(
            "evictable count {} but unpinned nodes hold {evictable}",
            t.evictable
        ));
    }
    // Requests: pins, private pages, and paths that spell their published tokens.
    for r in requests.iter() {
        let mut id = r.ext.last;
        if !t.node(id).alive {
            return corrupt(format!("a request pins dead node {}", id.0));
        }
        while id != NIL {
            locks[id.index()] += 1;
            id = t.node(id).parent;
        }
        let path = t.path_to(r.ext.last);
        let spelled: Vec<u32> = path
            .iter()
            .flat_map(|&n| t.node(n).key.iter().copied())
            .collect();
        if spelled[..] != r.tokens[..r.published] {
            return corrupt("a request's pinned path does not spell its published tokens");
        }
        let tree_pages: Vec<PageId> = path
            .iter()
            .flat_map(|&n| t.node(n).pages.iter().copied())
            .collect();
        for (i, (&mine, &tree)) in r.pages.iter().zip(&tree_pages).enumerate() {
            if mine != tree && !r.ext.dups.contains(&mine) {
                return corrupt(format!(
                    "request page {i} is {}, the tree holds {} there",
                    mine.0, tree.0
                ));
            }
        }
        if let Some(pg) = r.pages.iter().find(|&&pg| t.tier.is_host(pg)) {
            return corrupt(format!("a request's page table holds host page {}", pg.0));
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
    for page in (0..num_pages as u32).map(PageId) {
        let held = owner[page.index()] + t.free.contains(page) as u8;
        if held != 1 {
            return corrupt(format!(
                "page {} is held {held} times (free, tree, requests)",
                page.0
            ));
        }
    }
    for h in (0..host_pages as u32).map(PageId) {
        let held = owner[t.tier.host_id(h).index()]
            + t.host_free.contains(h) as u8
            + t.tier.reserved.contains(&h) as u8;
        if held != 1 {
            return corrupt(format!(
                "host page {} is held {held} times (free, tree, prefetches)",
                h.0
            ));
        }
    }
    if t.tier.pending() > 0 && !t.tier.on() {
        return corrupt("copies logged without a host tier");
    }
    Ok(())
}

/// Whether `id`'s recorded block keys chain from its parent's path over its own pages. The key
/// its parent ends with is that parent's own recorded last key (checked on its turn), or hashed
/// down from the nearest ancestor that records keys (or from the namespace root).
fn block_keys_hold(t: &RadixIndex, id: NodeId) -> bool {
    let p = t.page_size;
    let n = t.node(id);
    if n.block_keys.len() != n.pages.len() {
        return false;
    }
    let mut above = Vec::new();
    let mut m = n.parent;
    let mut prev = loop {
        let nd = t.node(m);
        if nd.parent == NIL {
            break root_hash(p, nd.ns.as_deref().expect("a root holds its namespace"));
        }
        if let Some(&k) = nd.block_keys.last() {
            break k;
        }
        above.push(m);
        m = nd.parent;
    };
    for &a in above.iter().rev() {
        for page in t.node(a).key.chunks_exact(p) {
            prev = next_hash(&prev, page);
        }
    }
    n.key.chunks_exact(p).zip(&n.block_keys).all(|(page, &k)| {
        prev = next_hash(&prev, page);
        prev == k
    })
}
