//! The disk tier, case by case (docs/SEMANTICS.md, "Disk tier"): where a page the host drops
//! goes, how a prompt's pages come back (prefetch, confirm), what a bad page costs, persist and
//! restore across caches, reset, the errors. `robust.rs` drives it at random against a KV oracle.

use radixkv::{block_hashes, BlockCache, BlockHash, CacheEvent, CopyKind, PrefixCache, RadixCache};

fn caches(n: usize, p: usize, h: usize, d: usize) -> [(&'static str, Box<dyn PrefixCache>); 2] {
    [
        (
            "radix",
            Box::new(RadixCache::with_tiers(n, p, h, d).unwrap()),
        ),
        (
            "block",
            Box::new(BlockCache::with_tiers(n, p, h, d).unwrap()),
        ),
    ]
}

mod common;
use common::{copies, run};

fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| seed * 1000 + i).collect()
}

/// In a cache of 5 device and 4 host pages of 2 tokens: a prompt of four full pages computed,
/// then two others that push it off the device and off the host, onto the disk; the copies
/// drained. Returns the prompt.
fn on_disk(c: &mut dyn PrefixCache) -> Vec<u32> {
    let a = prompt(1, 9);
    run(c, &a);
    run(c, &prompt(2, 9)); // a's pages go to the host
    run(c, &prompt(3, 9)); // and from the host to disk
    copies(c);
    a
}

/// A prompt pushed off the device and the host lands on disk, keyed by its block hashes, and
/// comes back whole by a prefetch: its pages enter the host tier and the next admission loads
/// them as host hits.
#[test]
fn a_prompt_goes_to_disk_and_comes_back_by_prefetch() {
    for (kind, mut c) in caches(5, 2, 4, 16) {
        let a = prompt(1, 9); // four full pages
        run(&mut *c, &a);
        run(&mut *c, &prompt(2, 9)); // a's pages go to the host
        run(&mut *c, &prompt(3, 9)); // and from the host to disk
        let log = copies(&mut *c);
        let spills: Vec<_> = log.iter().filter(|x| x.0 == CopyKind::Spill).collect();
        assert_eq!(spills.len(), 4, "{kind}: {log:?}");
        assert_eq!(c.match_prefix(&a, &None).unwrap(), 0, "{kind}");
        let keys = block_hashes(&a[..8], 2, &None);
        let held: Vec<BlockHash> = c.disk_entries().iter().map(|e| e.0).collect();
        assert!(keys.iter().all(|k| held.contains(k)), "{kind}");
        let f = c.disk_prefetch(&a, None).unwrap().expect("a is on disk");
        assert_eq!(
            (f.from, f.slots.len(), f.keys),
            (0, 4, keys.clone()),
            "{kind}"
        );
        // Stored tail first from the top of the tier down: one run of slots along the prompt.
        assert!(
            f.slots.windows(2).all(|w| w[1] == w[0] + 1),
            "{kind}: {:?}",
            f.slots
        );
        c.check().unwrap();
        // Until confirmed the pages are no hit, and their host pages are nobody's.
        assert_eq!(c.match_prefix(&a, &None).unwrap(), 0, "{kind}");
        assert_eq!(c.disk_confirm(f.id, 4, false).unwrap(), 4, "{kind}");
        assert_eq!(c.match_prefix(&a, &None).unwrap(), 8, "{kind}");
        let r = c.admit(&a, None).unwrap();
        assert_eq!(c.request(r).unwrap().num_cached, 8, "{kind}");
        let s = c.stats();
        assert_eq!((s.disk_fetched_pages, s.host_hit_tokens), (4, 8), "{kind}");
        c.finish(r).unwrap();
        c.check().unwrap();
    }
}

/// The tier is inclusive: a page read back keeps its slot, so the host dropping it again copies
/// nothing; a second prefetch of pages already in memory finds nothing to read.
#[test]
fn a_page_read_back_keeps_its_slot() {
    for (kind, mut c) in caches(5, 2, 4, 16) {
        let a = on_disk(&mut *c);
        let f = c.disk_prefetch(&a, None).unwrap().unwrap();
        c.disk_confirm(f.id, 4, false).unwrap();
        assert!(c.disk_prefetch(&a, None).unwrap().is_none(), "{kind}");
        let written = c.stats().disk_written_pages;
        run(&mut *c, &prompt(4, 9));
        run(&mut *c, &prompt(5, 9));
        let log = copies(&mut *c);
        let s = c.stats();
        // a's pages left the host again without a copy; only the others' were written.
        let a_slots: Vec<u32> = f.slots.clone();
        assert!(
            log.iter()
                .filter(|x| x.0 == CopyKind::Spill)
                .all(|x| !a_slots.contains(&x.2)),
            "{kind}: {log:?}"
        );
        assert!(s.disk_written_pages > written, "{kind}");
        c.check().unwrap();
    }
}

/// A page that reads bad ends the run there and leaves the disk; the pages before it count.
#[test]
fn a_bad_page_ends_the_run_and_leaves_the_disk() {
    for (kind, mut c) in caches(5, 2, 4, 16) {
        let a = on_disk(&mut *c);
        let f = c.disk_prefetch(&a, None).unwrap().unwrap();
        assert_eq!(c.disk_confirm(f.id, 2, true).unwrap(), 2, "{kind}");
        assert_eq!(c.match_prefix(&a, &None).unwrap(), 4, "{kind}");
        let s = c.stats();
        assert_eq!(s.disk_bad_pages, 1, "{kind}");
        let held: Vec<BlockHash> = c.disk_entries().iter().map(|e| e.0).collect();
        assert!(
            !held.contains(&f.keys[2]),
            "{kind}: the bad page is still on disk"
        );
        assert!(held.contains(&f.keys[3]), "{kind}");
        // Confirming twice, or past the pages, is refused.
        assert!(c.disk_confirm(f.id, 0, false).is_err(), "{kind}");
        let g = c.disk_prefetch(&a, None).unwrap();
        assert!(
            g.is_none(),
            "{kind}: page 2 is gone, so page 3 cannot be reached: {g:?}"
        );
        c.check().unwrap();
    }
}

/// Persist writes every cached page the disk lacks (device pages as `Persist`, host pages as
/// `Spill`); its entries restore into a new cache, which finds the pages by prefetch.
#[test]
fn persisted_entries_restore_into_a_new_cache() {
    for (kind, mut c) in caches(8, 2, 4, 32) {
        let a = prompt(1, 9);
        let b = prompt(2, 9);
        run(&mut *c, &a);
        run(&mut *c, &b);
        run(&mut *c, &prompt(3, 9)); // some of a goes to the host
        copies(&mut *c);
        let n = c.disk_persist();
        let log = copies(&mut *c);
        assert_eq!(n, log.len(), "{kind}");
        assert!(log.iter().any(|x| x.0 == CopyKind::Persist), "{kind}");
        assert!(log.iter().any(|x| x.0 == CopyKind::Spill), "{kind}");
        assert_eq!(c.disk_persist(), 0, "{kind}: everything is on disk already");
        let entries = c.disk_entries();
        assert_eq!(entries.len(), 12, "{kind}");
        let mut fresh: Box<dyn PrefixCache> = if kind == "radix" {
            Box::new(RadixCache::with_tiers(8, 2, 4, 32).unwrap())
        } else {
            Box::new(BlockCache::with_tiers(8, 2, 4, 32).unwrap())
        };
        fresh.disk_restore(&entries).unwrap();
        fresh.check().unwrap();
        assert_eq!(fresh.disk_entries(), entries, "{kind}");
        assert!(fresh.disk_restore(&entries).is_err(), "{kind}: not empty");
        let f = fresh.disk_prefetch(&b, None).unwrap().unwrap();
        assert_eq!(fresh.disk_confirm(f.id, f.slots.len(), false).unwrap(), 4);
        assert_eq!(fresh.match_prefix(&b, &None).unwrap(), 8, "{kind}");
        fresh.check().unwrap();
    }
}

/// A prefetch brings back at most what the host tier can hold beside the match's own host
/// pages, and never drops those to make room.
#[test]
fn a_prefetch_keeps_its_own_host_pages() {
    for (kind, mut c) in caches(8, 1, 3, 32) {
        let a = prompt(1, 8); // 7 full pages within the match limit
        run(&mut *c, &a);
        for s in 2..6 {
            run(&mut *c, &prompt(s, 5));
        }
        copies(&mut *c);
        let before = c.match_prefix(&a, &None).unwrap();
        if let Some(f) = c.disk_prefetch(&a, None).unwrap() {
            assert_eq!(f.from, before, "{kind}");
            let k = f.slots.len();
            c.disk_confirm(f.id, k, false).unwrap();
            assert_eq!(c.match_prefix(&a, &None).unwrap(), before + k, "{kind}");
            assert!(k <= 3, "{kind}");
        }
        c.check().unwrap();
    }
}

/// Reset drops the disk's keys too, and a prefetch started before it enters nothing.
#[test]
fn reset_clears_the_disk_and_cancels_prefetches() {
    for (kind, mut c) in caches(5, 2, 4, 16) {
        let a = on_disk(&mut *c);
        let f = c.disk_prefetch(&a, None).unwrap().unwrap();
        c.reset();
        c.check().unwrap();
        assert_eq!(c.disk_confirm(f.id, 4, false).unwrap(), 0, "{kind}");
        let s = c.stats();
        assert_eq!((s.disk_free_pages, s.host_free_pages), (16, 4), "{kind}");
        assert!(c.disk_entries().is_empty(), "{kind}");
        assert!(c.disk_prefetch(&a, None).unwrap().is_none(), "{kind}");
        c.check().unwrap();
    }
}

/// Spilled pages are `removed` from the in-memory index; pages read back are `stored` again.
#[test]
fn events_follow_the_pages_in_and_out_of_memory() {
    for (kind, mut c) in caches(5, 2, 4, 16) {
        c.record_events(true);
        let a = on_disk(&mut *c);
        let keys = block_hashes(&a[..8], 2, &None);
        let removed: Vec<BlockHash> = c
            .drain_events()
            .into_iter()
            .filter_map(|e| match e {
                CacheEvent::Removed { hashes } => Some(hashes),
                _ => None,
            })
            .flatten()
            .collect();
        assert!(keys.iter().all(|k| removed.contains(k)), "{kind}");
        let f = c.disk_prefetch(&a, None).unwrap().unwrap();
        c.disk_confirm(f.id, 4, false).unwrap();
        let stored: Vec<BlockHash> = c
            .drain_events()
            .into_iter()
            .filter_map(|e| match e {
                CacheEvent::Stored { hashes, .. } => Some(hashes),
                _ => None,
            })
            .flatten()
            .collect();
        assert_eq!(stored, keys, "{kind}");
    }
}

/// Bad arguments: a disk tier without a host tier, prefetch without a disk tier, restore of
/// entries that do not fit.
#[test]
fn arguments_that_do_not_fit_are_refused() {
    assert!(RadixCache::with_tiers(4, 1, 0, 4).is_err());
    assert!(BlockCache::with_tiers(4, 1, 0, 4).is_err());
    let mut c = RadixCache::with_host(4, 1, 4).unwrap();
    assert!(c.disk_prefetch(&[1, 2], None).is_err());
    assert!(c.disk_restore(&[([0; 32], 0)]).is_err());
    let mut c = RadixCache::with_tiers(4, 1, 4, 2).unwrap();
    assert!(
        c.disk_restore(&[([0; 32], 2)]).is_err(),
        "slot past the tier"
    );
    assert!(
        c.disk_restore(&[([0; 32], 0), ([1; 32], 0)]).is_err(),
        "slot twice"
    );
    assert!(
        c.disk_restore(&[([0; 32], 0), ([0; 32], 1)]).is_err(),
        "key twice"
    );
    assert!(c
        .disk_restore(&[([0; 32], 0), ([1; 32], 1), ([2; 32], 1)])
        .is_err());
    c.check().unwrap();
    assert!(c.disk_entries().is_empty());
    assert!(c.disk_confirm(99, 0, false).is_err());
}
