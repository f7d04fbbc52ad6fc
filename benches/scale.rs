//! Cost per request as the index grows (`cargo bench --bench scale`; no criterion, no Python).
//!
//! A cache's per-request cost should not depend on how much it holds. Every figure here is a
//! median of `RADIXKV_SCALE_RUNS` runs (default 5), each timing a batch of requests on one
//! thread, and is printed beside the baseline it is judged against, measured in the same run:
//!
//! | table            | measures                                                  | baseline                      |
//! |------------------|-----------------------------------------------------------|-------------------------------|
//! | `requests`       | admit + commit + finish: a 2k miss (the pool full, so each | a full hit of the same size   |
//! |                  | request evicts what it needs), a 2k and a 32k full hit     | (for a miss), a memcmp (hit)  |
//! | `evict_64k`      | `evict` of 64k tokens from a full pool, worst of the runs  | allocating 64k free pages     |
//! | `scaling`        | the 2k miss and the 2k hit with the index holding 10^4 ..  | the same at 10^4 tokens       |
//! |                  | 10^7 cached tokens                                         |                               |
//! | `mooncake`       | the first N requests of the Mooncake trace, unbounded pool | per request and per published |
//! |                  | (every block kept): total, and per request and per         | page of the first tenth       |
//! |                  | published page over the first and the last tenth; one      |                               |
//! |                  | cache reset between runs (the first, cold run apart)       |                               |
//!
//! Environment: `RADIXKV_SCALE_RUNS` (runs per figure), `RADIXKV_SCALE_MAX` (largest index of the
//! scaling table, default 10^7 tokens), `RADIXKV_MOONCAKE_REQUESTS` (default 2,000),
//! `RADIXKV_SCALE_QUICK=1` (a seconds-long smoke run: small sizes, one run).

mod inputs;

use inputs::*;
use radixkv::PrefixCache;
use std::hint::black_box;
use std::time::Instant;

/// Knobs read from the environment.
struct Config {
    runs: usize,
    max_index: usize,
    mooncake: usize,
    quick: bool,
}

impl Config {
    fn from_env() -> Self {
        let var = |name: &str, default: usize| {
            std::env::var(name)
                .ok()
                .and_then(|v| v.replace('_', "").parse().ok())
                .unwrap_or(default)
        };
        let quick = var("RADIXKV_SCALE_QUICK", 0) != 0;
        Config {
            runs: if quick {
                1
            } else {
                var("RADIXKV_SCALE_RUNS", 5).max(1)
            },
            max_index: if quick {
                100_000
            } else {
                var("RADIXKV_SCALE_MAX", 10_000_000)
            },
            mooncake: if quick {
                100
            } else {
                var("RADIXKV_MOONCAKE_REQUESTS", 2000)
            },
            quick,
        }
    }
}

/// A pool of `tokens` tokens filled with distinct cached 2k-token prompts (all evictable).
fn filled(make: Make, p: usize, tokens: usize, seed: u64) -> Box<dyn PrefixCache> {
    let mut c = make(tokens / p);
    let mut k = 0;
    while c.stats().free_pages >= 2048 / p {
        publish(&mut *c, &stream(seed + k, 0, 2048));
        k += 1;
    }
    c
}

/// A request that misses: admit, compute (commit) and finish, a new prompt every call. In a full
/// pool each one evicts the least recently used 2k tokens, so the index size stays put. The
/// prompts are one buffer whose first token changes each call (a token no other prompt has):
/// a miss from the first page on, for both indexes, while the prompt stays in the processor's
/// cache as a just-received prompt would (distinct buffers measured reading them from memory).
fn miss_fn(c: &mut dyn PrefixCache, seed: u64) -> impl FnMut() + '_ {
    let mut tokens = stream(seed, 0, 2048);
    let mut k = 0u32;
    move || {
        tokens[0] = 1 << 31 | k;
        k += 1;
        let id = c.admit(&tokens, None).expect("room by eviction");
        c.commit(id, tokens.len()).unwrap();
        c.finish(black_box(id)).unwrap();
    }
}

/// A full hit: admit, commit (nothing to compute) and finish a cached prompt.
fn hit_once(c: &mut dyn PrefixCache, tokens: &[u32]) {
    let id = c.admit(tokens, None).unwrap();
    c.commit(id, tokens.len()).unwrap();
    c.finish(black_box(id)).unwrap();
}

fn requests(cfg: &Config) {
    println!(
        "== requests: admit + commit + finish, per request (median of {} runs)",
        cfg.runs
    );
    for (name, p, make) in CACHES {
        let mut c = filled(make, p, 1 << 16, 1000);
        let miss = per_call(cfg.runs, miss_fn(&mut *c, 900));
        let hit_tokens = stream(5, 0, 2048);
        publish(&mut *c, &hit_tokens);
        let hit = per_call(cfg.runs, || hit_once(&mut *c, &hit_tokens));
        println!(
            "  {name:<10} 2k miss {:>10}   2k full hit {:>10}   miss / hit {:>6.1}x",
            fmt_ns(miss),
            fmt_ns(hit),
            miss / hit
        );
        let long = stream(6, 0, 32768);
        let mut c = make((1 << 17) / p);
        publish(&mut *c, &long);
        let hit = per_call(cfg.runs, || hit_once(&mut *c, &long));
        let copy = long.clone();
        let cmp = per_call(cfg.runs, || {
            black_box(black_box(&long[..]) == black_box(&copy[..]));
        });
        println!(
            "  {name:<10} 32k full hit {:>10}   memcmp of 32k tokens {:>10}   hit / memcmp {:>6.1}x",
            fmt_ns(hit),
            fmt_ns(cmp),
            hit / cmp
        );
    }
}

fn evict_64k(cfg: &Config) {
    const TOKENS: usize = 1 << 16;
    let runs = cfg.runs.max(5);
    println!("== evict_64k: evict 64k tokens from a pool of 64 cached 1k prompts ({runs} runs)");
    let fills: Vec<Vec<u32>> = (0..64).map(|k| stream(20 + k, 0, 1024)).collect();
    let big = stream(19, 0, TOKENS);
    for (name, p, make) in CACHES {
        let pages = TOKENS / p;
        let (mut evict, mut alloc) = (Vec::new(), Vec::new());
        for _ in 0..runs {
            let mut c = make(pages);
            for f in &fills {
                publish(&mut *c, f);
            }
            let t0 = Instant::now();
            assert_eq!(black_box(c.evict(pages)), pages);
            evict.push(t0.elapsed().as_nanos() as f64);
            let mut c = make(pages);
            let t0 = Instant::now();
            let id = black_box(c.admit(&big, None).unwrap());
            alloc.push(t0.elapsed().as_nanos() as f64);
            c.abort(id).unwrap();
        }
        let worst = evict.iter().copied().fold(0.0, f64::max);
        let (e, a) = (median(evict), median(alloc));
        println!(
            "  {name:<10} evict median {:>10}  worst {:>10}   alloc 64k free {:>10}   ratio {:>5.2}x",
            fmt_ns(e),
            fmt_ns(worst),
            fmt_ns(a),
            e / a
        );
    }
}

fn scaling(cfg: &Config) {
    println!("== scaling: per request against cached tokens in the index (miss evicts as it goes)");
    let mut sizes = vec![];
    let mut s = 10_000;
    while s <= cfg.max_index {
        sizes.push(s);
        s *= 10;
    }
    for (name, p, make) in CACHES {
        let mut base: Option<(f64, f64)> = None;
        for &size in &sizes {
            let t0 = Instant::now();
            let mut c = filled(make, p, size.max(4096), 3000);
            let fill = t0.elapsed();
            let cached = c.stats().evictable_pages * p;
            let miss = per_call(cfg.runs, miss_fn(&mut *c, 900));
            let hit_tokens = stream(3000, 0, 2048); // the oldest prompt: bring it back first
            publish(&mut *c, &hit_tokens);
            let hit = per_call(cfg.runs, || hit_once(&mut *c, &hit_tokens));
            let meta = c.metadata_bytes() as f64 / (c.stats().evictable_pages * p) as f64;
            let (m0, h0) = *base.get_or_insert((miss, hit));
            println!(
                "  {name:<10} {cached:>10} tokens  2k miss {:>10} ({:>5.2}x)  2k hit {:>10} ({:>5.2}x)  \
                 {meta:>5.1} B/token  (fill {:.1} s)",
                fmt_ns(miss),
                miss / m0,
                fmt_ns(hit),
                hit / h0,
                fill.as_secs_f64()
            );
        }
    }
}

fn mooncake(cfg: &Config) {
    let Some((prompts, blocks, _)) = load_mooncake(cfg.mooncake) else {
        println!("== mooncake: {MOONCAKE} not found, skipped");
        return;
    };
    let tokens: usize = prompts.iter().map(Vec::len).sum();
    println!(
        "== mooncake: first {} requests, {tokens} prompt tokens, unbounded pool (median of {} runs)",
        prompts.len(),
        cfg.runs
    );
    let tenth = (prompts.len() / 10).max(1);
    for (name, p, make) in CACHES {
        let pages = (blocks * 512).div_ceil(p) + 1024;
        let mut total = Vec::new();
        let mut head = Vec::new();
        let mut tail = Vec::new();
        let mut hit = 0.0;
        // One cache for every run, reset in between: the first run also pays for first touching
        // the index's memory (page faults); the later ones see what a long-running server sees.
        let mut c = make(pages);
        let mut cold = 0.0;
        for run in 0..=cfg.runs {
            c.reset();
            let mut times = Vec::with_capacity(prompts.len());
            let mut published = Vec::with_capacity(prompts.len());
            let t_all = Instant::now();
            for pr in &prompts {
                let before = c.stats().evictable_pages;
                let t0 = Instant::now();
                let id = c.admit(pr, None).expect("unbounded");
                c.commit(id, pr.len()).unwrap();
                c.finish(id).unwrap();
                times.push(t0.elapsed().as_nanos() as f64);
                published.push(c.stats().evictable_pages - before);
            }
            let elapsed = t_all.elapsed().as_nanos() as f64;
            if run == 0 {
                cold = elapsed;
                continue;
            }
            total.push(elapsed);
            hit = c.stats().hit_rate();
            let span = |r: std::ops::Range<usize>| {
                let t: f64 = times[r.clone()].iter().sum();
                let n: usize = published[r.clone()].iter().sum();
                (t / r.len() as f64, t / n.max(1) as f64)
            };
            head.push(span(0..tenth));
            tail.push(span(prompts.len() - tenth..prompts.len()));
        }
        let pick = |v: &[(f64, f64)], f: fn(&(f64, f64)) -> f64| median(v.iter().map(f).collect());
        let (h_req, h_page) = (pick(&head, |x| x.0), pick(&head, |x| x.1));
        let (t_req, t_page) = (pick(&tail, |x| x.0), pick(&tail, |x| x.1));
        println!(
            "  {name:<10} total {:>10} (first run {:>10}, hit rate {:.1}%)  first tenth: {:>9}/request \
             {:>8}/page   last tenth: {:>9}/request {:>8}/page ({:.2}x)",
            fmt_ns(median(total)),
            fmt_ns(cold),
            100.0 * hit,
            fmt_ns(h_req),
            fmt_ns(h_page),
            fmt_ns(t_req),
            fmt_ns(t_page),
            t_page / h_page
        );
    }
}

fn main() {
    let cfg = Config::from_env();
    let only: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let wants = |name: &str| only.is_empty() || only.iter().any(|o| name.contains(o.as_str()));
    if cfg.quick {
        println!("(quick run: small sizes, one run each; no figure here is meaningful)");
    }
    if wants("requests") {
        requests(&cfg);
    }
    if wants("evict") {
        evict_64k(&cfg);
    }
    if wants("scaling") {
        scaling(&cfg);
    }
    if wants("mooncake") {
        mooncake(&cfg);
    }
}
