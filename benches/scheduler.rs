//! Cost of one `schedule` call against the length of the waiting queue (criterion, no Python).
//!
//! Each waiting request is a shared 1,024-token system prompt (cached) plus a unique 1,024-token
//! tail: 2,048 tokens. A call ranks the whole queue and admits one request, which is then aborted
//! and replaced, so the queue length stays put. Baselines in the same run: `fcfs` (no ranking) and
//! the plain way to rank by cached prefix, `match_prefix` on every waiting prompt and a sort.

// criterion_group! expands to undocumented public functions.
#![allow(missing_docs)]

use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use radixkv::{Policy, PrefixCache, RadixCache, Scheduler};
use std::time::{Duration, Instant};

const PROMPT: u32 = 2048;

fn tail(i: u32) -> Vec<u32> {
    (0..PROMPT - 1024)
        .map(|j| 1_000_000 + i * PROMPT + j)
        .collect()
}

fn prompt(i: u32) -> Vec<u32> {
    [(0..1024).collect::<Vec<u32>>(), tail(i)].concat()
}

fn setup(waiting: u32, policy: Policy) -> (RadixCache, Scheduler) {
    let mut cache = RadixCache::new((4 * waiting * PROMPT / 16 + 65_536) as usize, 16).unwrap();
    let warm = cache.admit(&prompt(u32::MAX / PROMPT - 1), None).unwrap();
    cache.commit(warm, 1024).unwrap();
    cache.finish(warm).unwrap();
    let mut s = Scheduler::new(&cache, policy, 0);
    for i in 0..waiting {
        s.add(&prompt(i), None, 0, 0).unwrap();
    }
    (cache, s)
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("schedule_one_call");
    g.sample_size(20)
        .measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(500));
    for waiting in [128u32, 1024, 8192] {
        for (name, policy) in [
            ("fcfs", Policy::Fcfs),
            ("lpm", Policy::Lpm),
            ("dfs-weight", Policy::DfsWeight),
        ] {
            let (mut cache, mut s) = setup(waiting, policy);
            let mut next = waiting;
            g.bench_function(format!("{name}/{waiting}"), |b| {
                // Time the call alone; the abort and the refill that keep the queue at its
                // length stay outside the clock.
                b.iter_custom(|iters| {
                    let mut spent = Duration::ZERO;
                    for _ in 0..iters {
                        let t0 = Instant::now();
                        let out = s.schedule(&mut cache, 1 << 30, 1);
                        spent += t0.elapsed();
                        for a in &out {
                            cache.abort(a.request).unwrap();
                        }
                        while s.len() < waiting as usize {
                            s.add(&prompt(next), None, 0, 0).unwrap();
                            next += 1;
                        }
                    }
                    spent
                })
            });
        }
        let (cache, _) = setup(1, Policy::Fcfs);
        let prompts: Vec<Vec<u32>> = (0..waiting).map(prompt).collect();
        g.bench_function(format!("naive-lpm/{waiting}"), |b| {
            b.iter_batched(
                || (),
                |_| {
                    let mut keyed: Vec<(usize, usize)> = prompts
                        .iter()
                        .enumerate()
                        .map(|(i, p)| (usize::MAX - cache.match_prefix(p, &None).unwrap(), i))
                        .collect();
                    keyed.sort_unstable();
                    keyed[0].1
                },
                BatchSize::SmallInput,
            )
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
