//! The host tier, case by case (docs/SEMANTICS.md, "Host tier"): where an evicted page goes,
//! what a hit on the host costs, the copy log, the counters and the events. The fuzz tests
//! (`robust.rs`) drive both tiers at random against a KV oracle; these pin the rules down.

use radixkv::{BlockCache, CacheEvent, CopyKind, Error, PageId, PrefixCache, RadixCache};

mod common;
use common::{copies, run};

fn caches(
    num_pages: usize,
    page_size: usize,
    host: usize,
) -> [(&'static str, Box<dyn PrefixCache>); 2] {
    [
        (
            "radix",
            Box::new(RadixCache::with_host(num_pages, page_size, host).unwrap()),
        ),
        (
            "block",
            Box::new(BlockCache::with_host(num_pages, page_size, host).unwrap()),
        ),
    ]
}

const OFF: CopyKind = CopyKind::Offload;
const LOAD: CopyKind = CopyKind::Load;

/// A prompt evicted to the host comes back as a hit: its pages are loaded into device pages
/// before the request sees them, and the counters say so.
#[test]
fn evicted_pages_go_down_and_come_back_on_a_hit() {
    for (kind, mut c) in caches(4, 2, 8) {
        let a = [1, 2, 3, 4, 5, 6, 9];
        run(&mut *c, &a); // pages 0, 1, 2 hold a's three full pages; page 3 is free
        assert!(copies(&mut *c).is_empty(), "{kind}");
        let b = [7, 7, 7, 7, 7, 7, 9];
        run(&mut *c, &b); // needs 4 pages: three of a's go down
        let down = copies(&mut *c);
        assert_eq!(down.len(), 3, "{kind}: {down:?}");
        assert!(down.iter().all(|c| c.0 == OFF), "{kind}");
        let s = c.stats();
        assert_eq!(
            (s.offloaded_pages, s.evicted_pages, s.host_free_pages),
            (3, 3, 5),
            "{kind}"
        );
        // a is still cached in full, on the host.
        assert_eq!(c.match_prefix(&a, &None).unwrap(), 6, "{kind}");
        let r = c.admit(&a, None).unwrap();
        let v = c.request(r).unwrap();
        assert_eq!(v.num_cached, 6, "{kind}");
        let pages: Vec<PageId> = v.pages.to_vec();
        let log = copies(&mut *c);
        let loads: Vec<_> = log.iter().filter(|c| c.0 == LOAD).collect();
        assert_eq!(loads.len(), 3, "{kind}: {log:?}");
        // Each load lands in the page the request's table holds at that position, in order.
        for (i, l) in loads.iter().enumerate() {
            assert_eq!(l.2, pages[i].0, "{kind}: load {i}");
            assert!((l.2 as usize) < 4 && (l.1 as usize) < 8, "{kind}");
        }
        let s = c.stats();
        assert_eq!(
            (s.host_hit_tokens, s.hit_tokens, s.loaded_pages),
            (6, 6, 3),
            "{kind}"
        );
        c.check().unwrap();
        c.abort(r).unwrap();
        c.check().unwrap();
    }
}

/// A host hit needs a device page for each host page: `OutOfPages` counts them, and changes
/// nothing.
#[test]
fn host_hits_need_device_pages() {
    for (kind, mut c) in caches(3, 1, 8) {
        run(&mut *c, &[1, 2, 3]);
        run(&mut *c, &[4, 5, 6]); // 1, 2, 3 all go down
        let pinned = c.admit(&[4, 5, 9], None).unwrap(); // pins 4, 5, takes the third page
        assert_eq!(c.request(pinned).unwrap().num_cached, 2, "{kind}");
        let before = (c.stats(), copies(&mut *c).len());
        match c.admit(&[1, 2, 3, 4], None) {
            Err(Error::OutOfPages { needed, available }) => {
                assert_eq!((needed, available), (4, 0), "{kind}")
            }
            other => panic!("{kind}: {other:?}"),
        }
        assert_eq!(c.stats(), before.0, "{kind}");
        assert!(copies(&mut *c).is_empty(), "{kind}");
        c.check().unwrap();
    }
}

/// `reset` drops both tiers and offloads nothing; a full host tier drops its least recently
/// used pages to make room.
#[test]
fn reset_and_a_full_host_tier_drop_pages() {
    for (kind, mut c) in caches(3, 1, 3) {
        run(&mut *c, &[1, 2, 0]);
        run(&mut *c, &[3, 4, 0]); // 1, 2, 0 go down
        run(&mut *c, &[5, 6, 0]); // 3, 4, 0 go down: the host tier drops 1, 2, 0 first
        let s = c.stats();
        assert_eq!((s.offloaded_pages, s.host_evicted_pages), (6, 3), "{kind}");
        assert_eq!(c.match_prefix(&[1, 2, 0], &None).unwrap(), 0, "{kind}");
        assert_eq!(c.match_prefix(&[3, 4, 0], &None).unwrap(), 2, "{kind}");
        copies(&mut *c);
        assert_eq!(
            c.reset(),
            6,
            "{kind}: three device pages and three host pages"
        );
        assert!(copies(&mut *c).is_empty(), "{kind}: reset offloads nothing");
        let s = c.stats();
        assert_eq!((s.free_pages, s.host_free_pages), (3, 3), "{kind}");
        c.check().unwrap();
    }
}

/// A page that goes down or comes back stays in the index: no event. A reset clears both tiers.
#[test]
fn moves_between_tiers_are_not_events() {
    for (kind, mut c) in caches(3, 1, 8) {
        c.record_events(true);
        run(&mut *c, &[1, 2, 0]);
        run(&mut *c, &[3, 4, 0]);
        let r = c.admit(&[1, 2, 0], None).unwrap(); // comes back
        c.abort(r).unwrap();
        let removed = |c: &mut dyn PrefixCache| {
            c.drain_events()
                .into_iter()
                .filter(|e| matches!(e, CacheEvent::Removed { .. } | CacheEvent::Cleared))
                .count()
        };
        assert_eq!(removed(&mut *c), 0, "{kind}");
        c.reset();
        assert!(removed(&mut *c) > 0, "{kind}: dropped pages are removed");
        c.check().unwrap();
    }
}

/// A request that computes a prefix the index holds on the host publishes its own pages in
/// place of the host copy: no duplicate stays private, and the host page is freed.
#[test]
fn publishing_over_a_host_copy_replaces_it() {
    for (kind, mut c) in caches(4, 1, 4) {
        run(&mut *c, &[1, 2, 0]);
        // Admitted before the prefix went down: computes 1, 2 itself.
        let r = c.admit(&[9, 1, 2], None).unwrap();
        let q = c
            .admit(&[1, 2, 3, 4], Some(b"other".to_vec().into()))
            .unwrap_err();
        assert!(matches!(q, Error::OutOfPages { .. }), "{kind}");
        c.abort(r).unwrap();
        let r = c.admit(&[5, 6, 7, 8], None).unwrap(); // 1, 2, 0 go down
        c.abort(r).unwrap();
        assert_eq!(c.stats().host_free_pages, 1, "{kind}");
        let before = c.stats().host_free_pages;
        let r = c.admit(&[1, 2, 0], None).unwrap();
        c.abort(r).unwrap(); // loaded back, on the device again
        assert_eq!(c.stats().host_free_pages, before + 2, "{kind}");
        c.check().unwrap();
    }
}
