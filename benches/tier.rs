//! What the host tier costs the index (`cargo bench --bench tier`; no criterion, no Python).
//!
//! Per request (admit + commit + finish, or admit + abort), median of `RADIXKV_TIER_RUNS` runs
//! (default 5) of a batch long enough to time, each figure printed beside its baseline measured
//! in the same run:
//!
//! | row           | measures                                                | baseline                  |
//! |---------------|---------------------------------------------------------|---------------------------|
//! | `2k miss`     | a new 2k prompt in a full pool: its eviction moves 2k   | the same without a tier   |
//! |               | tokens to the host (a full host tier drops as many)     | (evicted pages dropped)   |
//! | `2k host hit` | two 2k prompts taking turns in a pool that holds one:   | a 2k hit on the device    |
//! |               | each admission loads one from the host and sends the    | (both fit)                |
//! |               | other down                                              |                           |
//!
//! The copy log is drained after every request (its cost included); copying the KV itself is
//! the owner's work and not measured here. `RADIXKV_TIER_QUICK=1`: one short run.

mod inputs;

use inputs::*;
use radixkv::{BlockCache, PrefixCache, RadixCache};
use std::hint::black_box;

/// Tokens of each prompt.
const N: usize = 2048;

type MakeTiered = fn(usize, usize) -> Box<dyn PrefixCache>;

const CACHES_TIERED: [(&str, usize, MakeTiered); 3] = [
    ("radix_p1", 1, |n, h| {
        Box::new(RadixCache::with_host(n, 1, h).unwrap())
    }),
    ("radix_p16", 16, |n, h| {
        Box::new(RadixCache::with_host(n, 16, h).unwrap())
    }),
    ("block_p16", 16, |n, h| {
        Box::new(BlockCache::with_host(n, 16, h).unwrap())
    }),
];

/// A new prompt each call (its first token changes), computed and finished in a full pool.
fn miss(c: &mut dyn PrefixCache, seed: u64) -> impl FnMut() + '_ {
    let mut tokens = stream(seed, 0, N);
    let mut k = 0u32;
    move || {
        tokens[0] = 1 << 31 | k;
        k += 1;
        let id = c.admit(&tokens, None).expect("room by eviction");
        c.commit(id, tokens.len()).unwrap();
        c.finish(black_box(id)).unwrap();
        black_box(c.drain_copies());
    }
}

/// Two cached prompts admitted in turn (and aborted: nothing new is computed).
fn alternate(c: &mut dyn PrefixCache) -> impl FnMut() + '_ {
    let (a, b) = (stream(21, 0, N), stream(22, 0, N));
    publish(c, &a);
    publish(c, &b);
    let mut turn = false;
    move || {
        turn = !turn;
        let id = c.admit(if turn { &a } else { &b }, None).expect("room");
        c.abort(black_box(id)).unwrap();
        black_box(c.drain_copies());
    }
}

fn main() {
    let quick = std::env::var("RADIXKV_TIER_QUICK").is_ok_and(|v| v != "0");
    let runs = if quick {
        1
    } else {
        std::env::var("RADIXKV_TIER_RUNS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(5usize)
            .max(1)
    };
    println!("== tier: per request, median of {runs} runs (copy log drained each time)");
    for (name, p, make) in CACHES_TIERED {
        // A pool of 32 prompts; the tier holds 32 more.
        let pages = 32 * N / p;
        let mut plain = make(pages, 0);
        let mut tiered = make(pages, pages);
        for k in 0..32 {
            publish(&mut *plain, &stream(100 + k, 0, N));
            publish(&mut *tiered, &stream(100 + k, 0, N));
        }
        let base = per_call(runs, miss(&mut *plain, 7));
        let tier = per_call(runs, miss(&mut *tiered, 7));
        let s = tiered.stats();
        assert!(s.offloaded_pages > 0 && s.host_evicted_pages > 0);
        println!(
            "  {name:<10} 2k miss      with tier {:>9}   without {:>9}   ratio {:.2}x",
            fmt_ns(tier),
            fmt_ns(base),
            tier / base
        );
        // Room for one prompt and the request's own last page (the match leaves it to compute).
        let one = N / p + 1;
        let mut both = make(2 * one + 2, 0);
        let mut host = make(one + 1, 2 * one);
        let device = per_call(runs, alternate(&mut *both));
        let loads = per_call(runs, alternate(&mut *host));
        let s = host.stats();
        assert!(s.loaded_pages > 0 && s.host_hit_tokens > 0);
        assert_eq!(both.stats().loaded_pages, 0);
        println!(
            "  {name:<10} 2k host hit  {:>9}   device hit {:>9}   ratio {:.2}x",
            fmt_ns(loads),
            fmt_ns(device),
            loads / device
        );
    }
}
