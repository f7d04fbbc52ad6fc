//! Long random operation sequences, fuzz style, against each cache and the scheduler: no call
//! may panic, every call that fails must change nothing, `check()` must pass after every step,
//! and at the end every page comes back and no namespace is remembered.
//!
//! Few cases by default so that `cargo test` stays quick; `PROPTEST_CASES=n` runs more.

use proptest::collection::vec;
use proptest::prelude::*;
use radixkv::{
    BlockCache, CacheStats, CopyKind, Error, Namespace, Policy, PrefixCache, RadixCache, RequestId,
    Scheduler,
};
use std::collections::{BTreeMap, HashMap};

#[derive(Debug, Clone)]
enum Op {
    Admit {
        base: usize,
        len: usize,
        ns: u8,
    },
    Fork(usize),
    Extend(usize, usize),
    Commit(usize, usize),
    CommitMany(Vec<usize>),
    ExtendMany(Vec<usize>),
    Finish(usize),
    Abort(usize),
    Evict(usize),
    Reset,
    Match {
        base: usize,
        len: usize,
        ns: u8,
    },
    /// A read back from the disk tier (with `corrupt`, that page of it reads bad).
    Prefetch {
        base: usize,
        len: usize,
        ns: u8,
        corrupt: Option<usize>,
    },
    /// Every page the cache holds written to disk.
    Persist,
    /// The process restarts: every request aborted, the cache persisted and emptied, the device
    /// and host KV lost, the disk's index restored from what was saved.
    Restart,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0..6usize, 1..40usize, 0..12u8).prop_map(|(base, len, ns)| Op::Admit { base, len, ns }),
        1 => any::<usize>().prop_map(Op::Fork),
        3 => (any::<usize>(), 0..9usize).prop_map(|(r, n)| Op::Extend(r, n)),
        4 => (any::<usize>(), any::<usize>()).prop_map(|(r, n)| Op::Commit(r, n)),
        1 => vec(any::<usize>(), 0..4).prop_map(Op::CommitMany),
        1 => vec(any::<usize>(), 0..4).prop_map(Op::ExtendMany),
        3 => any::<usize>().prop_map(Op::Finish),
        2 => any::<usize>().prop_map(Op::Abort),
        1 => (0..12usize).prop_map(Op::Evict),
        1 => Just(Op::Reset),
        1 => (0..6usize, 1..40usize, 0..12u8).prop_map(|(base, len, ns)| Op::Match { base, len, ns }),
    ]
}

/// [`op`] with the disk tier's operations mixed in.
fn disk_op() -> impl Strategy<Value = Op> {
    let prefetch = (
        0..6usize,
        1..40usize,
        0..12u8,
        proptest::option::weighted(0.15, 0..8usize),
    )
        .prop_map(|(base, len, ns, corrupt)| Op::Prefetch {
            base,
            len,
            ns,
            corrupt,
        });
    prop_oneof![
        12 => op(),
        3 => prefetch,
        1 => Just(Op::Persist),
        1 => Just(Op::Restart),
    ]
}

fn namespace(ns: u8) -> Namespace {
    // Mostly distinct tenants, so namespaces come and go all the time.
    (ns > 0).then(|| format!("tenant-{ns}").into_bytes().into_boxed_slice())
}

/// Prompts share prefixes: base `b` is a run of a small alphabet, so pages repeat.
fn prompt(base: usize, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i * (base as u32 + 1) / 3) % 5)
        .collect()
}

fn config() -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(12);
    ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

/// Fails the case unless `check()` passes.
fn checked(c: &dyn PrefixCache, step: usize, op: &Op) -> Result<(), TestCaseError> {
    if let Err(e) = c.check() {
        return Err(TestCaseError::fail(format!("step {step} ({op:?}): {e}")));
    }
    Ok(())
}

/// A failed call changed nothing it reports on.
fn unchanged(before: CacheStats, after: CacheStats, e: &Error) -> Result<(), TestCaseError> {
    prop_assert_eq!(before, after, "a call failed ({}) yet changed the cache", e);
    Ok(())
}

/// The KV a page must hold: a fingerprint of its namespace and every token up to its end.
fn fingerprint(ns: &Namespace, tokens: &[u32]) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    ns.hash(&mut h);
    tokens.hash(&mut h);
    h.finish() | 1
}

/// Simulated KV of both tiers, one fingerprint a page (0: never written): the copies of the
/// log are performed on it, requests write their pages as they commit, and every page a
/// request is served from the cache must hold its prefix's fingerprint.
struct Pools {
    dev: Vec<u64>,
    host: Vec<u64>,
    disk: Vec<u64>,
}

impl Pools {
    fn new(c: &dyn PrefixCache) -> Self {
        Pools {
            dev: vec![0; c.stats().num_pages],
            host: vec![0; c.host_pages()],
            disk: vec![0; c.disk_pages()],
        }
    }

    /// Performs the pending copies, in order.
    fn copy(&mut self, c: &mut dyn PrefixCache) -> Result<(), TestCaseError> {
        let tier = c.host_pages() > 0;
        for cp in c.drain_copies() {
            prop_assert!(tier, "a copy was logged without a host tier");
            let (s, d) = (cp.src as usize, cp.dst as usize);
            match cp.kind {
                CopyKind::Offload => self.host[d] = self.dev[s],
                CopyKind::Load => self.dev[d] = self.host[s],
                CopyKind::Spill => self.disk[d] = self.host[s],
                CopyKind::Persist => self.disk[d] = self.dev[s],
                CopyKind::WindowOffload | CopyKind::WindowLoad => {
                    prop_assert!(false, "a window copy from a cache without a window group")
                }
            }
        }
        Ok(())
    }

    /// What an owner does to read pages back from disk: the copies logged so far performed
    /// first (a spill must land before its slot is read), then each slot read and checked (its
    /// KV against its prefix, as a checksum against the key), the good ones copied into their
    /// host pages, and the prefetch confirmed. With `corrupt`, that page's bytes are damaged on
    /// disk first: it must read bad and end the run there.
    fn prefetch(
        &mut self,
        c: &mut dyn PrefixCache,
        tokens: &[u32],
        ns: Namespace,
        corrupt: Option<usize>,
    ) -> Result<(), Error> {
        if c.disk_pages() == 0 {
            return Ok(());
        }
        let before = c.match_prefix(tokens, &ns)?;
        let Some(f) = c.disk_prefetch(tokens, ns.clone())? else {
            return Ok(());
        };
        self.copy(c).expect("copies are performed");
        let p = c.page_size();
        assert_eq!(
            f.from, before,
            "a prefetch starts where the memory match ends"
        );
        if let Some(k) = corrupt {
            let k = k % f.slots.len();
            self.disk[f.slots[k] as usize] ^= 2;
        }
        let mut good = 0;
        for (i, (&slot, &h)) in f.slots.iter().zip(&f.host).enumerate() {
            let end = f.from + (i + 1) * p;
            let want = fingerprint(&ns, &tokens[..end]);
            let key = radixkv::block_hashes(&tokens[..end], p, &ns)[end / p - 1];
            assert_eq!(f.keys[i], key, "slot {slot}: the key of another page");
            if self.disk[slot as usize] != want {
                assert_eq!(
                    corrupt.map(|k| k % f.slots.len()),
                    Some(i),
                    "slot {slot} holds another page's KV"
                );
                break;
            }
            self.host[h as usize] = self.disk[slot as usize];
            good += 1;
        }
        let bad = good < f.slots.len() && corrupt.is_some();
        let used = c.disk_confirm(f.id, good, bad)?;
        assert!(used <= good);
        let after = c.match_prefix(tokens, &ns)?;
        assert_eq!(after, before + used * p, "the pages read back are hits");
        Ok(())
    }

    /// Every page `r` was served from the cache holds its prefix.
    fn served(&self, c: &dyn PrefixCache, r: RequestId) -> Result<(), TestCaseError> {
        let v = c.request(r).unwrap();
        let p = c.page_size();
        for i in 0..v.num_cached / p {
            let want = fingerprint(v.namespace, &v.tokens[..(i + 1) * p]);
            prop_assert_eq!(
                self.dev[v.pages[i].0 as usize],
                want,
                "cached page {} of a hit",
                i
            );
        }
        Ok(())
    }

    /// `r` computes its full pages up to `upto` tokens.
    fn write(&mut self, c: &dyn PrefixCache, r: RequestId, upto: usize) {
        let v = c.request(r).unwrap();
        let p = c.page_size();
        for k in v.num_computed / p..upto / p {
            self.dev[v.pages[k].0 as usize] = fingerprint(v.namespace, &v.tokens[..(k + 1) * p]);
        }
    }
}

fn fuzz_cache(c: &mut dyn PrefixCache, ops: &[Op]) -> Result<(), TestCaseError> {
    let mut live: Vec<RequestId> = Vec::new();
    let mut kv = Pools::new(c);
    let pick = |live: &Vec<RequestId>, i: usize| (!live.is_empty()).then(|| i % live.len());
    let empty = c.metadata_bytes();
    for (step, op) in ops.iter().enumerate() {
        let before = c.stats();
        let opened = live.len();
        let res: Result<(), Error> = match op {
            Op::Admit { base, len, ns } => c
                .admit(&prompt(*base, *len), namespace(*ns))
                .map(|r| live.push(r)),
            Op::Fork(i) => match pick(&live, *i) {
                // The parent's computed pages are written before the fork reads them.
                Some(i) => c.fork(live[i]).map(|r| live.push(r)),
                None => Ok(()),
            },
            Op::Extend(i, n) => match pick(&live, *i) {
                Some(i) => c.extend(live[i], &prompt(*n, *n)),
                None => Ok(()),
            },
            Op::Commit(i, n) => match pick(&live, *i) {
                Some(i) => {
                    let v = c.request(live[i]).unwrap();
                    let span = v.num_tokens() - v.num_computed + 1;
                    let upto = v.num_computed + n % span;
                    kv.write(c, live[i], upto);
                    c.commit(live[i], upto)
                }
                None => Ok(()),
            },
            Op::CommitMany(is) => {
                let batch: Vec<(RequestId, usize)> = is
                    .iter()
                    .filter_map(|&i| pick(&live, i))
                    .map(|i| (live[i], c.request(live[i]).unwrap().num_tokens()))
                    .collect();
                let distinct = batch
                    .iter()
                    .map(|b| b.0)
                    .collect::<std::collections::HashSet<_>>();
                if distinct.len() == batch.len() {
                    for &(r, upto) in &batch {
                        kv.write(c, r, upto);
                    }
                }
                c.commit_many(&batch)
            }
            Op::ExtendMany(is) => {
                let t = [1u32, 2, 3];
                let batch: Vec<(RequestId, &[u32])> = is
                    .iter()
                    .filter_map(|&i| pick(&live, i))
                    .map(|i| (live[i], &t[..]))
                    .collect();
                c.extend_many(&batch).map(|_| ())
            }
            Op::Finish(i) | Op::Abort(i) => match pick(&live, *i) {
                Some(i) => {
                    let r = live.swap_remove(i);
                    let done = if matches!(op, Op::Finish(_)) {
                        c.finish(r)
                    } else {
                        c.abort(r)
                    };
                    prop_assert!(c.request(r).is_err(), "a closed request stays readable");
                    done
                }
                None => Ok(()),
            },
            Op::Evict(n) => {
                c.evict(*n);
                Ok(())
            }
            Op::Reset => {
                c.reset();
                Ok(())
            }
            Op::Prefetch {
                base,
                len,
                ns,
                corrupt,
            } => kv.prefetch(c, &prompt(*base, *len), namespace(*ns), *corrupt),
            Op::Persist => {
                c.disk_persist();
                Ok(())
            }
            Op::Restart => {
                for r in live.drain(..) {
                    c.abort(r).unwrap();
                }
                c.disk_persist();
                kv.copy(c)?;
                let entries = c.disk_entries();
                c.reset();
                kv.dev.fill(0);
                kv.host.fill(0);
                c.disk_restore(&entries).unwrap();
                prop_assert_eq!(c.disk_entries(), entries);
                Ok(())
            }
            Op::Match { base, len, ns } => {
                let t = prompt(*base, *len);
                let m = c.match_prefix(&t, &namespace(*ns)).unwrap();
                prop_assert!(m < t.len() && m % c.page_size() == 0);
                prop_assert_eq!(c.stats(), before, "match_prefix changed the cache");
                Ok(())
            }
        };
        match &res {
            Ok(()) => {}
            Err(e @ Error::OutOfPages { .. }) => unchanged(before, c.stats(), e)?,
            Err(e @ Error::InvalidArgument(_))
                if matches!(op, Op::CommitMany(_) | Op::ExtendMany(_)) =>
            {
                unchanged(before, c.stats(), e)?
            }
            Err(e) => return Err(TestCaseError::fail(format!("step {step} ({op:?}): {e}"))),
        }
        checked(c, step, op)?;
        kv.copy(c)?;
        if res.is_ok() && matches!(op, Op::Admit { .. } | Op::Fork(_)) && live.len() > opened {
            kv.served(c, *live.last().unwrap())?;
        }
    }
    for r in live.drain(..) {
        c.abort(r).unwrap();
    }
    c.reset();
    c.check().unwrap();
    let s = c.stats();
    prop_assert_eq!(s.free_pages, s.num_pages, "pages did not all come back");
    prop_assert_eq!(
        s.host_free_pages,
        s.host_pages,
        "host pages did not all come back"
    );
    prop_assert!(s.host_hit_tokens <= s.hit_tokens);
    // Nothing is remembered of namespaces or requests that are gone (the arenas may keep their
    // capacity, never more than the busiest moment needed).
    prop_assert!(c.metadata_bytes() >= empty);
    Ok(())
}

#[derive(Debug, Clone)]
enum SOp {
    Add {
        base: usize,
        len: usize,
        ns: u8,
        prio: i8,
        gen: u8,
    },
    Cancel(usize),
    Schedule {
        budget: usize,
        max: usize,
    },
    Step(usize),
    Finish(usize),
    Abort(usize),
    Evict(usize),
}

fn sop() -> impl Strategy<Value = SOp> {
    prop_oneof![
        6 => (0..6usize, 1..90usize, 0..10u8, -2..3i8, 0..6u8)
            .prop_map(|(base, len, ns, prio, gen)| SOp::Add { base, len, ns, prio, gen }),
        2 => any::<usize>().prop_map(SOp::Cancel),
        4 => (0..80usize, 0..5usize).prop_map(|(budget, max)| SOp::Schedule { budget, max }),
        4 => any::<usize>().prop_map(SOp::Step),
        2 => any::<usize>().prop_map(SOp::Finish),
        1 => any::<usize>().prop_map(SOp::Abort),
        1 => (0..8usize).prop_map(SOp::Evict),
    ]
}

/// An admitted request being prefilled in chunks: the rest of its prompt to extend.
struct Running {
    id: RequestId,
    rest: Vec<u32>,
    ns: Namespace,
}

fn fuzz_scheduler(
    c: &mut dyn PrefixCache,
    policy: Policy,
    max_wait: u64,
    ops: &[SOp],
) -> Result<(), TestCaseError> {
    let mut s = Scheduler::new(c, policy, max_wait);
    let mut waiting: BTreeMap<u64, (Vec<u32>, Namespace)> = BTreeMap::new();
    let mut running: Vec<Running> = Vec::new();
    for (step, op) in ops.iter().enumerate() {
        match op {
            SOp::Add {
                base,
                len,
                ns,
                prio,
                gen,
            } => {
                let t = prompt(*base, *len);
                match s.add(&t, namespace(*ns), *prio as i32, *gen as u32) {
                    Ok(id) => {
                        prop_assert!(waiting.insert(id, (t, namespace(*ns))).is_none());
                    }
                    Err(Error::InvalidArgument(_)) => {
                        let pages = (t.len() + (*gen).max(1) as usize - 1).div_ceil(c.page_size());
                        prop_assert!(pages > c.stats().num_pages, "refused a request that fits");
                    }
                    Err(e) => return Err(TestCaseError::fail(format!("add: {e}"))),
                }
            }
            SOp::Cancel(i) => {
                let ids: Vec<u64> = waiting.keys().copied().collect();
                let id = if ids.is_empty() {
                    *i as u64
                } else {
                    ids[i % ids.len()]
                };
                prop_assert_eq!(s.cancel(id), waiting.remove(&id).is_some());
                prop_assert!(!s.cancel(id), "cancelled twice");
            }
            SOp::Schedule { budget, max } => {
                let before = c.stats();
                let out = s.schedule(c, *budget, *max);
                prop_assert!(out.len() <= *max);
                let mut spent = 0;
                for a in &out {
                    let (t, ns) = waiting
                        .remove(&a.id)
                        .expect("admitted a request that was waiting");
                    let v = c.request(a.request).unwrap();
                    prop_assert_eq!(v.namespace, &ns, "admitted with another namespace");
                    prop_assert_eq!(v.tokens, &t[..v.num_tokens()]);
                    prop_assert_eq!(a.num_tokens, t.len());
                    spent += v.num_tokens() - v.num_computed;
                    running.push(Running {
                        id: a.request,
                        rest: t[v.num_tokens()..].to_vec(),
                        ns,
                    });
                }
                prop_assert!(spent <= *budget, "budget {} exceeded: {}", budget, spent);
                if out.is_empty() {
                    prop_assert_eq!(
                        c.stats(),
                        before,
                        "a call that admitted nothing changed the cache"
                    );
                }
                // With pages for it, the first request in order is always admitted.
                if out.is_empty() && *budget > 0 && *max > 0 && !waiting.is_empty() {
                    prop_assert!(
                        c.stats().free_pages + c.stats().evictable_pages < c.stats().num_pages
                    );
                }
            }
            SOp::Step(i) if !running.is_empty() => {
                let k = i % running.len();
                let r = &mut running[k];
                let n = c.request(r.id).unwrap().num_tokens();
                c.commit(r.id, n).unwrap();
                if !r.rest.is_empty() {
                    let take = r.rest.len().min(16);
                    let chunk: Vec<u32> = r.rest.drain(..take).collect();
                    if c.extend(r.id, &chunk).is_err() {
                        r.rest.splice(0..0, chunk);
                    }
                }
            }
            SOp::Finish(i) | SOp::Abort(i) if !running.is_empty() => {
                let r = running.swap_remove(i % running.len());
                prop_assert!(c.request(r.id).unwrap().namespace == &r.ns);
                if matches!(op, SOp::Finish(_)) {
                    c.finish(r.id).unwrap();
                } else {
                    c.abort(r.id).unwrap();
                }
            }
            SOp::Evict(n) => {
                c.evict(*n);
            }
            _ => {}
        }
        if let Err(e) = c.check() {
            return Err(TestCaseError::fail(format!("step {step} ({op:?}): {e}")));
        }
        prop_assert_eq!(s.len(), waiting.len());
        prop_assert_eq!(s.waiting_ids(), waiting.keys().copied().collect::<Vec<_>>());
        let namespaces: HashMap<&Namespace, ()> =
            waiting.values().map(|(_, ns)| (ns, ())).collect();
        prop_assert_eq!(
            s.num_namespaces(),
            namespaces.len(),
            "namespaces remembered"
        );
    }
    for id in waiting.keys() {
        prop_assert!(s.cancel(*id));
    }
    prop_assert_eq!(s.num_namespaces(), 0);
    for r in running {
        c.abort(r.id).unwrap();
    }
    c.reset();
    c.check().unwrap();
    prop_assert_eq!(c.stats().free_pages, c.stats().num_pages);
    Ok(())
}

fn policy() -> impl Strategy<Value = Policy> {
    prop_oneof![
        Just(Policy::Fcfs),
        Just(Policy::Lpm),
        Just(Policy::DfsWeight)
    ]
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn radix_cache_survives_long_random_sequences(
        p in prop_oneof![Just(1usize), Just(2), Just(4)],
        pool in 6..48usize,
        host in prop_oneof![Just(0usize), Just(1), 2..16usize, 16..96usize],
        ops in vec(op(), 300..600),
    ) {
        let mut c = RadixCache::with_host(pool, p, host).unwrap();
        fuzz_cache(&mut c, &ops)?;
    }

    #[test]
    fn block_cache_survives_long_random_sequences(
        p in prop_oneof![Just(1usize), Just(2), Just(4)],
        pool in 6..48usize,
        host in prop_oneof![Just(0usize), Just(1), 2..16usize, 16..96usize],
        ops in vec(op(), 300..600),
    ) {
        let mut c = BlockCache::with_host(pool, p, host).unwrap();
        fuzz_cache(&mut c, &ops)?;
    }

    #[test]
    fn radix_cache_with_a_disk_tier_survives_long_random_sequences(
        p in prop_oneof![Just(1usize), Just(2), Just(4)],
        pool in 6..48usize,
        host in prop_oneof![Just(1usize), 2..16usize],
        disk in prop_oneof![Just(1usize), 2..24usize, 24..128usize],
        ops in vec(disk_op(), 300..600),
    ) {
        let mut c = RadixCache::with_tiers(pool, p, host, disk).unwrap();
        fuzz_cache(&mut c, &ops)?;
    }

    #[test]
    fn block_cache_with_a_disk_tier_survives_long_random_sequences(
        p in prop_oneof![Just(1usize), Just(2), Just(4)],
        pool in 6..48usize,
        host in prop_oneof![Just(1usize), 2..16usize],
        disk in prop_oneof![Just(1usize), 2..24usize, 24..128usize],
        ops in vec(disk_op(), 300..600),
    ) {
        let mut c = BlockCache::with_tiers(pool, p, host, disk).unwrap();
        fuzz_cache(&mut c, &ops)?;
    }

    #[test]
    fn scheduler_survives_long_random_sequences(
        radix in any::<bool>(),
        p in prop_oneof![Just(1usize), Just(4)],
        pool in 8..64usize,
        policy in policy(),
        max_wait in 0..4u64,
        ops in vec(sop(), 300..600),
    ) {
        if radix {
            fuzz_scheduler(&mut RadixCache::new(pool, p).unwrap(), policy, max_wait, &ops)?;
        } else {
            fuzz_scheduler(&mut BlockCache::new(pool, p).unwrap(), policy, max_wait, &ops)?;
        }
    }
}

/// Namespaces come and go: a cache forgets a namespace when its last page goes.
#[test]
fn radix_roots_of_empty_namespaces_are_released() {
    let mut c = RadixCache::new(16, 1).unwrap();
    let r = c.admit(&[1, 2, 3], namespace(1)).unwrap();
    c.abort(r).unwrap();
    let base = c.metadata_bytes();
    for i in 0..10_000u32 {
        let ns: Namespace = Some(i.to_le_bytes().to_vec().into_boxed_slice());
        let r = c.admit(&[1, 2, 3], ns).unwrap();
        if i % 2 == 0 {
            c.abort(r).unwrap();
        } else {
            c.commit(r, 3).unwrap();
            c.finish(r).unwrap();
            c.evict(3);
        }
        c.check().unwrap();
    }
    assert!(
        c.metadata_bytes() <= base + 256,
        "{} > {base}",
        c.metadata_bytes()
    );
}
