//! Criterion benchmarks of the cache core: pure Rust, no Python (`cargo bench --bench cache`).
//!
//! Every group ends with ratios against a baseline measured in the same run, read from the very
//! samples criterion took (so the ratios and criterion's own figures agree):
//!
//! | group                  | measures                                     | baseline                          |
//! |------------------------|----------------------------------------------|-----------------------------------|
//! | `admit_finish_{2k,32k}`| admit + finish on a full hit / 50% hit       | the same on a miss (no cache)     |
//! | `match_prefix_{2k,32k}`| the read-only probe, hit / 50% / miss        | a token-by-token compare (memcmp) |
//! | `evict_64k`            | `evict` of 64k tokens from a full pool       | allocating 64k free pages         |
//! | `block_hashes_2k`      | the chained hashes of 2,048 tokens at P=16   | one blake3 over the same bytes    |
//! | `agent_trace`          | 1,000 requests, 100 sessions x 10 turns      | caching disabled (reset each time)|
//! | `mooncake`             | the first N requests of the Mooncake trace   | caching disabled (reset each time)|
//!
//! Token ids come from the same generator as `benches/common.py`, so both sides run the same
//! prompts and the same agent trace. Set `RADIXKV_MOONCAKE_REQUESTS` to replay more of Mooncake.

use criterion::measurement::WallTime;
use criterion::{BenchmarkGroup, Criterion, SamplingMode};
use std::collections::HashMap;
use std::hint::black_box;
use std::time::{Duration, Instant};

mod inputs;
use inputs::*;

// ---------------------------------------------------------------------------------------------
// Measurement helpers: criterion measures, and we keep its per-iteration samples for ratios
// ---------------------------------------------------------------------------------------------

/// Per-iteration times (ns) of each benchmark of one group, as criterion sampled them.
struct Samples {
    keep: usize,
    times: HashMap<String, Vec<f64>>,
}

impl Samples {
    fn new(keep: usize) -> Self {
        Samples {
            keep,
            times: HashMap::new(),
        }
    }

    /// Median of the last `keep` samples (the measurement proper; earlier ones are warm-up).
    fn median(&self, id: &str) -> Option<f64> {
        let v = self.times.get(id)?;
        let mut tail = v[v.len().saturating_sub(self.keep)..].to_vec();
        if tail.is_empty() {
            return None;
        }
        tail.sort_by(f64::total_cmp);
        Some(tail[tail.len() / 2])
    }

    /// Prints `num / den` when both were measured (a filter may have skipped either).
    fn ratio(&self, what: &str, num: &str, den: &str) {
        if let (Some(a), Some(b)) = (self.median(num), self.median(den)) {
            println!(
                "  ratio  {what:<44} {:>10} / {:>10} = {:>8.3}x",
                fmt_ns(a),
                fmt_ns(b),
                a / b
            );
        }
    }
}

fn fmt_ns(ns: f64) -> String {
    if ns < 1e3 {
        format!("{ns:.0} ns")
    } else if ns < 1e6 {
        format!("{:.2} us", ns / 1e3)
    } else {
        format!("{:.2} ms", ns / 1e6)
    }
}

/// Benchmarks `routine` on a state built once (the routine leaves it as it found it).
fn steady<S>(
    g: &mut BenchmarkGroup<'_, WallTime>,
    samples: &mut Samples,
    id: &str,
    state: &mut S,
    mut routine: impl FnMut(&mut S),
) {
    let times = samples.times.entry(id.to_string()).or_default();
    g.bench_function(id, |b| {
        b.iter_custom(|iters| {
            let t0 = Instant::now();
            for _ in 0..iters {
                routine(state);
            }
            let d = t0.elapsed();
            times.push(d.as_nanos() as f64 / iters as f64);
            d
        })
    });
}

/// Benchmarks `routine` on a fresh state from `setup` every iteration; only `routine` is timed
/// (criterion's `iter_batched` with per-iteration setup, keeping the samples).
fn batched<S, R>(
    g: &mut BenchmarkGroup<'_, WallTime>,
    samples: &mut Samples,
    id: &str,
    mut setup: impl FnMut() -> S,
    mut routine: impl FnMut(&mut S) -> R,
) {
    let times = samples.times.entry(id.to_string()).or_default();
    g.bench_function(id, |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let mut s = setup();
                let t0 = Instant::now();
                black_box(routine(&mut s));
                total += t0.elapsed();
                drop(s); // outside the timed region: freeing a big pool is not the routine's work
            }
            times.push(total.as_nanos() as f64 / iters as f64);
            total
        })
    });
}

// ---------------------------------------------------------------------------------------------
// Groups
// ---------------------------------------------------------------------------------------------

const SAMPLES: usize = 20;

fn group<'a>(c: &'a mut Criterion, name: &str) -> BenchmarkGroup<'a, WallTime> {
    let mut g = c.benchmark_group(name);
    g.sample_size(SAMPLES)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_millis(1200));
    g
}

/// admit + finish of a prompt on a full hit, a 50% hit and a miss. Nothing is committed, so each
/// iteration leaves the cache as it found it: a hit pins and unpins, a miss allocates and frees.
fn admit_finish(c: &mut Criterion, n: usize, label: &str) {
    let ps = prompts(n);
    let mut g = group(c, &format!("admit_finish_{label}"));
    let mut s = Samples::new(SAMPLES);
    for (name, p, make) in CACHES {
        let mut cache = make(4 * n / p);
        publish(&mut *cache, &ps.hit);
        for (case, tokens) in [("hit", &ps.hit), ("half", &ps.half), ("miss", &ps.miss)] {
            steady(&mut g, &mut s, &format!("{name}/{case}"), &mut cache, |c| {
                let id = c.admit(tokens, None).unwrap();
                c.finish(black_box(id)).unwrap();
            });
        }
        debug_assert!(cache.check().is_ok());
    }
    g.finish();
    for (name, _, _) in CACHES {
        s.ratio(
            &format!("{name}: full hit vs miss"),
            &format!("{name}/hit"),
            &format!("{name}/miss"),
        );
        s.ratio(
            &format!("{name}: 50% hit vs miss"),
            &format!("{name}/half"),
            &format!("{name}/miss"),
        );
    }
}

/// The read-only probe on a hit, a 50% hit and a miss, against the least work that can confirm a
/// cached prefix: comparing the prompt with a stored copy token by token.
fn match_prefix(c: &mut Criterion, n: usize, label: &str) {
    let ps = prompts(n);
    let mut g = group(c, &format!("match_prefix_{label}"));
    let mut s = Samples::new(SAMPLES);
    let mut pair = (ps.hit.clone(), ps.hit.clone());
    steady(&mut g, &mut s, "memcmp", &mut pair, |(a, b)| {
        black_box(black_box(&a[..]) == black_box(&b[..]));
    });
    for (name, p, make) in CACHES {
        let mut cache = make(4 * n / p);
        publish(&mut *cache, &ps.hit);
        for (case, tokens) in [("hit", &ps.hit), ("half", &ps.half), ("miss", &ps.miss)] {
            steady(&mut g, &mut s, &format!("{name}/{case}"), &mut cache, |c| {
                black_box(c.match_prefix(black_box(tokens), &None).unwrap());
            });
        }
    }
    g.finish();
    for (name, _, _) in CACHES {
        s.ratio(
            &format!("{name}: full hit vs memcmp"),
            &format!("{name}/hit"),
            "memcmp",
        );
    }
}

/// `evict` of 64k tokens from a pool full of evictable pages (64 cached prompts of 1,024 tokens,
/// distinct: 64 leaves), against allocating 64k pages from a free pool (admitting a 64k-token
/// prompt that misses).
fn evict_64k(c: &mut Criterion) {
    const TOKENS: usize = 1 << 16;
    let fills: Vec<Vec<u32>> = (0..64).map(|k| stream(20 + k, 0, 1024)).collect();
    let big = stream(19, 0, TOKENS);
    let mut g = group(c, "evict_64k");
    let mut s = Samples::new(SAMPLES);
    for (name, p, make) in CACHES {
        let pages = TOKENS / p;
        let full = || {
            let mut cache = make(pages);
            for f in &fills {
                publish(&mut *cache, f);
            }
            assert_eq!(cache.stats().evictable_pages, pages);
            cache
        };
        batched(&mut g, &mut s, &format!("{name}/evict"), full, |c| {
            c.evict(pages)
        });
        batched(
            &mut g,
            &mut s,
            &format!("{name}/alloc_free"),
            || make(pages),
            |c| c.admit(&big, None).unwrap(),
        );
    }
    g.finish();
    for (name, _, _) in CACHES {
        s.ratio(
            &format!("{name}: evict 64k vs allocate 64k free"),
            &format!("{name}/evict"),
            &format!("{name}/alloc_free"),
        );
    }
}

/// The chained block hashes of 2,048 tokens (128 pages of 16) against one blake3 over the same
/// 8 KiB: what the chaining (one keyed hash a page) costs over hashing the bytes once.
fn block_hashes_2k(c: &mut Criterion) {
    let tokens = stream(10, 0, 2048);
    let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    let mut g = group(c, "block_hashes_2k");
    let mut s = Samples::new(SAMPLES);
    let mut t = tokens;
    steady(&mut g, &mut s, "chained_p16", &mut t, |t| {
        black_box(radixkv::block_hashes(black_box(t), 16, &None));
    });
    let mut b = bytes;
    steady(&mut g, &mut s, "blake3_once", &mut b, |b| {
        black_box(blake3::hash(black_box(b)));
    });
    g.finish();
    s.ratio("chained hashes vs one blake3", "chained_p16", "blake3_once");
}

/// The 1,000-request agent trace, with the cache and with caching disabled.
fn agent(c: &mut Criterion) {
    let trace = agent_trace();
    let unique = agent_unique_tokens(&trace);
    let total: usize = trace.iter().map(|t| t.prompt.len()).sum();
    println!(
        "agent trace: {} requests, {total} prompt tokens, {unique} distinct tokens computed",
        trace.len()
    );
    let mut g = c.benchmark_group("agent_trace");
    g.sampling_mode(SamplingMode::Flat)
        .sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(2));
    let mut s = Samples::new(10);
    for (name, p, make) in CACHES {
        let pages = unique.div_ceil(p) + 2048;
        let mut probe = make(pages);
        run_agent(&mut *probe, &trace, false);
        println!(
            "agent trace {name}: hit rate {:.3}, {} pages cached, {:.2} bytes of metadata per cached token",
            probe.stats().hit_rate(),
            probe.stats().evictable_pages,
            probe.metadata_bytes() as f64 / (probe.stats().evictable_pages * p) as f64
        );
        drop(probe);
        for (case, disabled) in [("cached", false), ("nocache", true)] {
            batched(
                &mut g,
                &mut s,
                &format!("{name}/{case}"),
                || make(pages),
                |c| run_agent(&mut **c, &trace, disabled),
            );
        }
    }
    g.finish();
    for (name, _, _) in CACHES {
        s.ratio(
            &format!("{name}: cached vs caching disabled"),
            &format!("{name}/cached"),
            &format!("{name}/nocache"),
        );
    }
}

/// Replay of the first requests of the Mooncake conversation trace, unbounded pool.
fn mooncake(c: &mut Criterion) {
    let limit = std::env::var("RADIXKV_MOONCAKE_REQUESTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300);
    let Some((prompts, blocks, whole)) = load_mooncake(limit) else {
        println!("mooncake: {MOONCAKE} not found, skipped");
        return;
    };
    let tokens: usize = prompts.iter().map(Vec::len).sum();
    let bound = mooncake_bound(&prompts);
    println!(
        "mooncake: first {} requests, {tokens} prompt tokens, {blocks} distinct 512-token blocks; \
         unbounded-cache bound on these {:.1}% ({:.2}% over the whole trace)",
        prompts.len(),
        100.0 * bound,
        100.0 * whole
    );
    let mut g = c.benchmark_group("mooncake");
    g.sampling_mode(SamplingMode::Flat)
        .sample_size(10)
        .warm_up_time(Duration::from_millis(100))
        .measurement_time(Duration::from_secs(2));
    let mut s = Samples::new(10);
    for (name, p, make) in CACHES {
        // Every distinct block fits, plus room for one live request: nothing is ever evicted.
        let pages = (blocks * 512).div_ceil(p) + 1024;
        let hit = run_mooncake(&mut *make(pages), &prompts, false);
        println!(
            "mooncake {name}: hit rate {:.1}% (bound {:.1}%)",
            100.0 * hit,
            100.0 * bound
        );
        for (case, disabled) in [("cached", false), ("nocache", true)] {
            batched(
                &mut g,
                &mut s,
                &format!("{name}/{case}"),
                || make(pages),
                |c| run_mooncake(&mut **c, &prompts, disabled),
            );
        }
    }
    g.finish();
    for (name, _, _) in CACHES {
        s.ratio(
            &format!("{name}: cached vs caching disabled"),
            &format!("{name}/cached"),
            &format!("{name}/nocache"),
        );
    }
}

fn benches(c: &mut Criterion) {
    admit_finish(c, 2048, "2k");
    admit_finish(c, 32768, "32k");
    match_prefix(c, 2048, "2k");
    match_prefix(c, 32768, "32k");
    evict_64k(c);
    block_hashes_2k(c);
    agent(c);
    mooncake(c);
}

// A plain `main` rather than `criterion_group!`, whose generated function has no doc comment.
fn main() {
    let mut c = Criterion::default().configure_from_args();
    benches(&mut c);
    c.final_summary();
}
