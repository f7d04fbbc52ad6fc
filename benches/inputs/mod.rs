//! Inputs shared by the Rust benchmarks: the deterministic token streams (mirrored in
//! `benches/common.py`), the agent trace, the Mooncake trace and the caches under test.

// Each benchmark binary uses a part of this module.
#![allow(dead_code)]

use radixkv::{BlockCache, PrefixCache, RadixCache};
use std::io::Read;
use std::path::Path;
use std::time::Instant;

// ---------------------------------------------------------------------------------------------
// Deterministic inputs (mirrored in benches/common.py)
// ---------------------------------------------------------------------------------------------

/// Token ids are drawn from a vocabulary of this size (a typical LLM has 32k-150k).
pub const VOCAB: u64 = 1 << 17;

/// splitmix64's finalizer: a bijective mix of a 64-bit counter.
pub fn mix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Tokens `start..start + n` of stream `k`: `mix64((k << 32) | i) % VOCAB`.
pub fn stream(k: u64, start: usize, n: usize) -> Vec<u32> {
    (start as u64..(start + n) as u64)
        .map(|i| (mix64((k << 32) | i) % VOCAB) as u32)
        .collect()
}

/// One request of the agent trace: its prompt, then the tokens it generates.
pub struct Turn {
    pub prompt: Vec<u32>,
    pub output: Vec<u32>,
}

pub const SYSTEM_TOKENS: usize = 1024;
pub const SESSIONS: usize = 100;
pub const TURNS: usize = 10;

/// The multi-turn agent trace: 100 sessions x 10 turns over a shared 1,024-token system prompt.
/// Turn `t` of a session prompts with everything before it plus a new user message (64-256
/// tokens) and generates 64-512 tokens. Sessions interleave: every session's turn 0, then every
/// session's turn 1, ...
pub fn agent_trace() -> Vec<Turn> {
    let system = stream(1, 0, SYSTEM_TOKENS);
    let mut history = vec![system; SESSIONS];
    let mut next = 0; // position in stream 2, which supplies every message and output
    let mut turns = Vec::with_capacity(SESSIONS * TURNS);
    for t in 0..TURNS {
        for (s, hist) in history.iter_mut().enumerate() {
            let j = (s * TURNS + t) as u64;
            let user = 64 + (mix64((3 << 32) | (2 * j)) % 193) as usize;
            let out = 64 + (mix64((3 << 32) | (2 * j + 1)) % 449) as usize;
            hist.extend(stream(2, next, user));
            next += user;
            let output = stream(2, next, out);
            next += out;
            turns.push(Turn {
                prompt: hist.clone(),
                output: output.clone(),
            });
            hist.extend(output);
        }
    }
    turns
}

/// Tokens the agent trace computes in all, each once: the system prompt, every user message and
/// every output. An unbounded cache ends up holding exactly these.
pub fn agent_unique_tokens(trace: &[Turn]) -> usize {
    let last_turn = &trace[trace.len() - SESSIONS..];
    let finals: usize = last_turn
        .iter()
        .map(|t| t.prompt.len() + t.output.len())
        .sum();
    finals - (SESSIONS - 1) * SYSTEM_TOKENS
}

/// Replays the agent trace: admit, commit the prompt, extend with the output, commit, finish.
/// With `disabled`, the cache is reset before every admission (the no-cache baseline).
pub fn run_agent(c: &mut dyn PrefixCache, trace: &[Turn], disabled: bool) {
    for turn in trace {
        if disabled {
            c.reset();
        }
        let n = turn.prompt.len();
        let id = c
            .admit(&turn.prompt, None)
            .expect("pool sized for the trace");
        c.commit(id, n).unwrap();
        c.extend(id, &turn.output)
            .expect("pool sized for the trace");
        c.commit(id, n + turn.output.len()).unwrap();
        c.finish(id).unwrap();
    }
}

/// The Mooncake conversation trace, gzipped (see `benches/data/README.md`).
pub const MOONCAKE: &str = "benches/data/mooncake_conversation_trace.jsonl.gz";

/// The first `limit` requests of the Mooncake conversation trace as token ids, or `None` when the
/// trace is absent. Hash id `h` expands to the 512 ids `h * 512 .. h * 512 + 512`; the last block
/// is cut to `input_length`. Returns the prompts, their number of distinct blocks, and the
/// unbounded-cache bound over the whole trace (every request, not only the first `limit`).
pub fn load_mooncake(limit: usize) -> Option<(Vec<Vec<u32>>, usize, f64)> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(MOONCAKE);
    let mut text = String::new();
    flate2::read::GzDecoder::new(std::fs::File::open(path).ok()?)
        .read_to_string(&mut text)
        .ok()?;
    let mut prompts = Vec::new();
    let mut blocks = std::collections::HashSet::new();
    let mut whole = Bound::default();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let n: usize = json_field(line, "\"input_length\"")
            .trim_end_matches(|c: char| !c.is_ascii_digit())
            .parse()
            .expect("input_length");
        let ids = json_field(line, "\"hash_ids\"");
        let ids = &ids[ids.find('[').expect("hash_ids list") + 1..ids.find(']').expect("]")];
        let ids: Vec<u32> = ids
            .split(',')
            .map(|s| s.trim().parse().expect("hash id"))
            .collect();
        whole.add(&ids, n);
        if prompts.len() < limit {
            blocks.extend(ids.iter().copied());
            let tokens: Vec<u32> = ids
                .iter()
                .flat_map(|&h| (0..512).map(move |j| h * 512 + j))
                .take(n)
                .collect();
            prompts.push(tokens);
        }
    }
    Some((prompts, blocks.len(), whole.share()))
}

/// Share of prompt tokens an unbounded cache of 512-token blocks could serve. Equal hash ids
/// mean equal blocks after equal prefixes, so a request hits its leading blocks seen before.
#[derive(Default)]
pub struct Bound {
    pub seen: std::collections::HashSet<u32>,
    pub hit: usize,
    pub total: usize,
}

impl Bound {
    pub fn add(&mut self, ids: &[u32], n: usize) {
        let k = ids.iter().take_while(|h| self.seen.contains(*h)).count();
        self.hit += (k * 512).min(n);
        self.total += n;
        self.seen.extend(ids.iter().copied());
    }

    pub fn share(&self) -> f64 {
        self.hit as f64 / self.total.max(1) as f64
    }
}

/// The text after `"key":` up to the next top-level comma (or the end of the object).
pub fn json_field<'a>(line: &'a str, key: &str) -> &'a str {
    let at = line.find(key).unwrap_or_else(|| panic!("{key} missing"));
    let rest = line[at + key.len()..].trim_start().trim_start_matches(':');
    let rest = rest.trim_start();
    if rest.starts_with('[') {
        &rest[..=rest.find(']').expect("]")]
    } else {
        rest.split([',', '}']).next().unwrap_or(rest).trim()
    }
}

/// The bound over the same requests that are replayed.
pub fn mooncake_bound(prompts: &[Vec<u32>]) -> f64 {
    let mut b = Bound::default();
    for p in prompts {
        let ids: Vec<u32> = p.chunks(512).map(|b| b[0] / 512).collect();
        b.add(&ids, p.len());
    }
    b.share()
}

/// Mooncake replay: admit, commit the whole prompt (its prefill), finish. Returns the hit rate.
pub fn run_mooncake(c: &mut dyn PrefixCache, prompts: &[Vec<u32>], disabled: bool) -> f64 {
    for p in prompts {
        if disabled {
            c.reset();
        }
        let id = c.admit(p, None).expect("pool sized for the trace");
        c.commit(id, p.len()).unwrap();
        c.finish(id).unwrap();
    }
    c.stats().hit_rate()
}

// ---------------------------------------------------------------------------------------------
// Caches under test
// ---------------------------------------------------------------------------------------------

pub type Make = fn(usize) -> Box<dyn PrefixCache>;

/// The three configurations: name, page size, constructor from a page count.
pub const CACHES: [(&str, usize, Make); 3] = [
    ("radix_p1", 1, |n| Box::new(RadixCache::new(n, 1).unwrap())),
    ("radix_p16", 16, |n| {
        Box::new(RadixCache::new(n, 16).unwrap())
    }),
    ("block_p16", 16, |n| {
        Box::new(BlockCache::new(n, 16).unwrap())
    }),
];

/// Admits `tokens`, computes all of them and finishes: they are cached from now on.
pub fn publish(c: &mut dyn PrefixCache, tokens: &[u32]) {
    let id = c.admit(tokens, None).unwrap();
    c.commit(id, tokens.len()).unwrap();
    c.finish(id).unwrap();
}

/// Prompts of `n` tokens: `hit` is cached, `half` shares its first half with it, `miss` shares
/// nothing with anything cached.
pub struct Prompts {
    pub hit: Vec<u32>,
    pub half: Vec<u32>,
    pub miss: Vec<u32>,
}

pub fn prompts(n: usize) -> Prompts {
    let hit = stream(10, 0, n);
    let miss = stream(11, 0, n);
    let mut half = hit[..n / 2].to_vec();
    half.extend_from_slice(&miss[n / 2..]);
    Prompts { hit, half, miss }
}

// ---------------------------------------------------------------------------------------------
// Timing (the benches with a plain `main`)
// ---------------------------------------------------------------------------------------------

pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

pub fn fmt_ns(ns: f64) -> String {
    if ns < 1e3 {
        format!("{ns:.0} ns")
    } else if ns < 1e6 {
        format!("{:.2} us", ns / 1e3)
    } else if ns < 1e9 {
        format!("{:.2} ms", ns / 1e6)
    } else {
        format!("{:.3} s", ns / 1e9)
    }
}

/// Nanoseconds per call of `f`, over a batch long enough to read a clock around (median of runs).
pub fn per_call(runs: usize, mut f: impl FnMut()) -> f64 {
    for _ in 0..3 {
        f(); // warm-up: caches, branch predictors, the first growth of any table
    }
    let mut batch = 1;
    loop {
        let t0 = Instant::now();
        for _ in 0..batch {
            f();
        }
        if t0.elapsed().as_millis() >= 20 || batch >= 1 << 20 {
            break;
        }
        batch *= 2;
    }
    median(
        (0..runs)
            .map(|_| {
                let t0 = Instant::now();
                for _ in 0..batch {
                    f();
                }
                t0.elapsed().as_nanos() as f64 / batch as f64
            })
            .collect(),
    )
}
