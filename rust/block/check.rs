//! The block index's invariant checker: everything `check()` verifies, recomputed from scratch.

use super::*;

/// Recomputes the index's invariants from scratch (see `PrefixCache::check`).
pub(super) fn check_index(
    t: &BlockIndex,
    requests: &Requests<BlockExt>,
    num_pages: usize,
) -> Result<()> {
    let p = t.page_size;
    let mut refs = vec![0u32; num_pages];
    for r in requests.iter() {
        // Straight from the spec (not the map), so a wrong entry cannot vouch for itt.
        let hashes = crate::wire::hash::block_hashes(&r.tokens[..r.published], p, &r.namespace);
        if hashes.last() != r.ext.tip.as_ref() {
            return corrupt("a request's tip hash differs from its published tokens'");
        }
        // The content keys along its published pages, and the recorded keys of the pages
        // that hold them (its own, or the stored copies it pins).
        let mut lead = BlockIndex::root_lead(&crate::wire::hash::root_hash(p, &r.namespace));
        let pages = r.tokens[..r.published].chunks_exact(p);
        for (page, holder) in pages.zip(published_holders(r, p)) {
            lead = t.key(lead, page);
            if t.recs.is_hashed(holder) && t.recs.key(holder) != lead {
                return corrupt(format!(
                    "page {}: its recorded content key is not its prefix's",
                    holder.0
                ));
            }
        }
        if lead != r.ext.lead {
            return corrupt("a request's tip key differs from its published tokens'");
        }
        for (i, &page) in r.pages.iter().enumerate() {
            let Some(rc) = refs.get_mut(page.index()) else {
                return corrupt(format!("a request holds page {}, outside the pool", page.0));
            };
            *rc += 1;
            if i < r.num_cached / p && t.recs.hash(page) != Some(hashes[i]) {
                return corrupt(format!(
                    "page {}, a cache hit, no longer holds its prefix",
                    page.0
                ));
            }
        }
        for &(at, copy) in &r.ext.stored {
            let at = at as usize;
            let stands_for = at < r.published / p
                && t.recs.hash(copy) == Some(hashes[at])
                && !t.recs.is_hashed(r.pages[at]);
            if !stands_for {
                return corrupt(format!(
                    "request position {at}: stored copy {} does not stand for its private page",
                    copy.0
                ));
            }
            refs[copy.index()] += 1;
        }
    }
    for page in (0..num_pages as u32).map(PageId) {
        let (rc, held) = (t.refcount[page.index()], refs[page.index()]);
        if rc != held {
            return corrupt(format!(
                "page {} has refcount {rc}, live requests hold it {held} times",
                page.0
            ));
        }
        let linked = t.lists.is_linked(page);
        if linked != (rc == 0) {
            return corrupt(format!(
                "page {} with refcount {rc} is linked: {linked}",
                page.0
            ));
        }
    }
    let total = num_pages + t.tier.host_pages;
    for page in (0..total as u32).map(PageId) {
        let reserved = t.tier.is_host(page) && t.tier.reserved.contains(&t.tier.local(page));
        if reserved && (t.lists.is_linked(page) || t.recs.is_hashed(page)) {
            return corrupt(format!(
                "host page {} is taken by a prefetch and held",
                page.0
            ));
        }
        if t.tier.is_host(page) && !reserved && !t.lists.is_linked(page) {
            return corrupt(format!("host page {} is on no list", page.0));
        }
        if let Some(h) = t.recs.hash(page) {
            let (parent, tokens) = (t.recs.parent(page), t.recs.tokens(page));
            if next_hash(&parent, tokens) != h {
                return corrupt(format!(
                    "page {}: its parent hash and tokens do not hash to its key",
                    page.0
                ));
            }
            let key = t.recs.key(page);
            if t.map.find(key, |q| q == page) != Some(page) {
                return corrupt(format!(
                    "page {} is hashed but the map does not point to it",
                    page.0
                ));
            }
        }
    }
    let lists = [
        (FREE, false, false, "free"),
        (EVICTABLE, true, false, "evictable"),
        (CLASS_LISTS[1], true, false, "class 1"),
        (CLASS_LISTS[2], true, false, "class 2"),
        (CLASS_LISTS[3], true, false, "class 3"),
        (RETAINED, true, false, "retained"),
        (HOST_FREE, false, true, "host free"),
        (HOST_EVICTABLE, true, true, "host evictable"),
    ];
    for (list, hashed, host, name) in lists {
        for page in t.lists.iter(list) {
            let pinned = !host && t.refcount.get(page.index()).map_or(true, |&rc| rc != 0);
            let wrong_class = hashed && !host && t.list_for(page) != list;
            if t.recs.is_hashed(page) != hashed || t.tier.is_host(page) != host || pinned {
                return corrupt(format!(
                    "page {} does not belong on the {name} list",
                    page.0
                ));
            }
            if wrong_class {
                return corrupt(format!(
                    "page {} of class {}, retained by {}, is on the {name} list",
                    page.0,
                    t.class_of(page),
                    t.soft_of(page)
                ));
            }
        }
    }
    // Retentions: each holds hashed device pages; the counts and holders are what they add to.
    let mut soft = vec![0u32; num_pages];
    for (rid, r) in t.retained.iter() {
        for &page in &r.held {
            let ok = page.index() < num_pages
                && t.recs.is_hashed(page)
                && t.holders.get(&page).is_some_and(|h| h.contains(&rid));
            if !ok || r.until.is_nan() {
                return corrupt(format!(
                    "retention {rid} holds page {}, not a cached one",
                    page.0
                ));
            }
            soft[page.index()] += 1;
        }
    }
    for page in (0..num_pages as u32).map(PageId) {
        let held = t.holders.get(&page).map_or(0, |h| h.len() as u32);
        if t.soft_of(page) != soft[page.index()] || held != soft[page.index()] {
            return corrupt(format!(
                "page {}: retained by {} (holders {held}; the retentions add up to {})",
                page.0,
                t.soft_of(page),
                soft[page.index()]
            ));
        }
        if t.keep[page.index()] != 0 && !t.recs.is_hashed(page) {
            return corrupt(format!("page {} holds nothing but has a class", page.0));
        }
    }
    let hashed = t.recs.count();
    if hashed != t.map.len() {
        return corrupt(format!(
            "{hashed} pages are hashed, the map holds {}",
            t.map.len()
        ));
    }
    Ok(())
}
