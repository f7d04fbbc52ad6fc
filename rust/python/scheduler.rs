//! `Scheduler` as a Python class.

use super::cache::{PyCache, PyRequest};
use super::convert;
use crate::sched::{Policy, Scheduler, WAIT_BOUNDS};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use std::collections::HashMap;
use std::sync::Mutex;

/// A waiting queue that admits requests into a cache in a cache-aware order.
///
/// ``policy``: ``"fcfs"`` (arrival order), ``"lpm"`` (longest cached prefix first) or
/// ``"dfs-weight"`` (requests sharing a prefix back to back, heaviest group first).
/// ``max_wait``: a request that has waited more than this many ``schedule`` calls goes ahead of
/// cache order (``0`` turns the bound off). Higher ``priority`` goes first within every policy.
///
/// In-batch prefix sharing (``"lpm"``, ``"dfs-weight"``): waiting requests that share an
/// uncached prefix of at least 64 tokens (rounded up to whole pages; see
/// ``radixkv.engine.defaults.sharing_threshold``) are admitted one ``schedule`` call apart, so
/// that the later ones find the shared part cached and it is computed once.
#[pyclass(name = "Scheduler", module = "radixkv._radixkv", frozen)]
pub struct PyScheduler {
    cache: Py<PyCache>,
    /// The queue and the namespace objects of its requests, under one lock, so that a request
    /// and its namespace object leave together (a `cancel` racing a `schedule` cannot part
    /// them). Rule: no Python object is dropped while this lock is held (a `__del__` could call
    /// back into the scheduler); they are taken out and dropped after it is released.
    inner: Mutex<Queue>,
    policy: String,
}

/// The core queue and, by id, the namespace object each waiting request was added with,
/// handed back "as given".
struct Queue {
    core: Scheduler,
    namespaces: HashMap<u64, PyObject>,
}

impl PyScheduler {
    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[pymethods]
impl PyScheduler {
    #[new]
    #[pyo3(signature = (cache, policy="lpm", max_wait=None), text_signature = "(cache, policy='lpm', max_wait=256)")]
    fn new(
        py: Python<'_>,
        cache: &Bound<'_, PyCache>,
        policy: &str,
        max_wait: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let p: Policy = policy.parse()?;
        let max_wait = match max_wait {
            None => 256,
            Some(m) => convert::count("max_wait", m)? as u64,
        };
        let core = cache
            .get()
            .with(py, false, |c| Ok(Scheduler::new(c, p, max_wait)))?;
        Ok(PyScheduler {
            cache: cache.clone().unbind(),
            inner: Mutex::new(Queue {
                core,
                namespaces: HashMap::new(),
            }),
            policy: policy.to_string(),
        })
    }

    /// Queues a prompt; returns its id (ids grow with arrival). Raises ``ValueError`` for a
    /// request that could never fit the pool (its prompt and every generated token but the last
    /// need more pages than the pool has).
    #[pyo3(
        signature = (tokens, namespace=None, priority=None, max_new_tokens=None),
        text_signature = "($self, tokens, namespace=None, priority=0, max_new_tokens=0)"
    )]
    fn add(
        &self,
        tokens: &Bound<'_, PyAny>,
        namespace: Option<&Bound<'_, PyAny>>,
        priority: Option<&Bound<'_, PyAny>>,
        max_new_tokens: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<u64> {
        let toks = convert::tokens("tokens", tokens)?;
        let ns = convert::namespace(namespace)?;
        let priority: i32 = match priority {
            None => 0,
            Some(p) => match convert::as_int(p) {
                None => {
                    return Err(PyTypeError::new_err(format!(
                        "priority must be an int, got {}",
                        p.get_type().name()?
                    )))
                }
                Some(i) => i.extract().map_err(|_| {
                    PyValueError::new_err(format!(
                        "priority must be an int in [-2**31, 2**31), got {i}"
                    ))
                })?,
            },
        };
        let max_new_tokens = match max_new_tokens {
            None => 0,
            Some(m) => convert::count("max_new_tokens", m)?,
        };
        let Ok(max_new_tokens) = u32::try_from(max_new_tokens) else {
            return Err(PyValueError::new_err(format!(
                "max_new_tokens must be below 2**32, got {max_new_tokens}"
            )));
        };
        let ns_obj = namespace.map_or_else(|| tokens.py().None(), |o| o.clone().unbind());
        let mut q = self.lock();
        let (id, dropped) = match q.core.add(&toks, ns, priority, max_new_tokens) {
            // Ids are fresh: nothing is replaced, but nothing is dropped under the lock either.
            Ok(id) => (Ok(id), q.namespaces.insert(id, ns_obj)),
            Err(e) => (Err(e), Some(ns_obj)),
        };
        drop(q);
        drop(dropped);
        Ok(id?)
    }

    /// Raises ``ValueError`` (``"{name} of N tokens ... could never run"``) when a request of
    /// ``num_tokens`` prompt tokens and ``max_new_tokens`` could never fit the pool: the rule
    /// ``add`` enforces, for callers that check before queueing anything.
    #[pyo3(signature = (num_tokens, max_new_tokens, name="a request"))]
    fn check_fits(
        &self,
        num_tokens: &Bound<'_, PyAny>,
        max_new_tokens: &Bound<'_, PyAny>,
        name: &str,
    ) -> PyResult<()> {
        let n = convert::count("num_tokens", num_tokens)?;
        let m = convert::count("max_new_tokens", max_new_tokens)?;
        let m = u32::try_from(m).map_err(|_| {
            PyValueError::new_err(format!("max_new_tokens must be below 2**32, got {m}"))
        })?;
        Ok(self.lock().core.check_fits(name, n, m)?)
    }

    /// Drops a waiting request; returns whether it was waiting. ``id`` is an int ``>= 0``
    /// (``ValueError`` naming it otherwise).
    fn cancel(&self, id: &Bound<'_, PyAny>) -> PyResult<bool> {
        let id = convert::count("id", id)?;
        let Ok(id) = u64::try_from(id) else {
            return Ok(false);
        };
        let mut q = self.lock();
        let was_waiting = q.core.cancel(id);
        let ns_obj = if was_waiting {
            q.namespaces.remove(&id)
        } else {
            None
        };
        drop(q);
        drop(ns_obj); // may run a __del__ that calls back in: the lock is released
        Ok(was_waiting)
    }

    /// Admits waiting requests in service order while ``token_budget`` (tokens to compute in this
    /// step), ``max_requests`` and the cache's pages (evictable ones count as available) last.
    /// Each request is opened on its cached prefix plus at most what is left of the budget: one
    /// whose uncached part does not fit is admitted in part (``num_tokens`` short of its prompt),
    /// and the caller appends the rest with ``extend`` over later steps (chunked prefill).
    /// Returns ``(id, Request)`` pairs in admission order. A call that admits nothing leaves the
    /// cache unchanged.
    #[pyo3(signature = (token_budget, max_requests=None))]
    fn schedule(
        &self,
        py: Python<'_>,
        token_budget: &Bound<'_, PyAny>,
        max_requests: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Vec<(u64, PyRequest)>> {
        let token_budget = convert::count("token_budget", token_budget)?;
        let max_requests = match max_requests.filter(|m| !m.is_none()) {
            None => usize::MAX,
            Some(m) => convert::count("max_requests", m)?,
        };
        let cache = self.cache.bind(py);
        // Lock order: the cache, then the scheduler (the only place that holds both).
        // The namespace objects leave the map in the same critical section as their requests
        // leave the queue; they are only moved here (no reference count changes without the GIL).
        let admitted = self.cache.get().with(py, true, |c| {
            let mut q = self.lock();
            let admitted = q.core.schedule(c, token_budget, max_requests);
            let out: Vec<_> = admitted
                .into_iter()
                .map(|a| (a, q.namespaces.remove(&a.id)))
                .collect();
            Ok(out)
        })?;
        Ok(admitted
            .into_iter()
            .map(|(a, ns)| {
                let ns = ns.unwrap_or_else(|| py.None());
                (a.id, PyRequest::new(cache, a.request, ns))
            })
            .collect())
    }

    /// Ids of the waiting requests, by arrival.
    #[getter]
    fn waiting(&self) -> Vec<u64> {
        self.lock().core.waiting_ids()
    }

    /// How long the requests admitted so far waited, in ``schedule`` calls that passed them
    /// over: a list of ``(upper_bound, count)`` pairs, counts not cumulative, the last bound
    /// ``inf``; and the sum of the waits. For a Prometheus histogram (``radixkv.metrics``).
    #[getter]
    fn wait_histogram(&self) -> (Vec<(f64, u64)>, u64) {
        let h = self.lock().core.waits();
        let bounds = WAIT_BOUNDS
            .iter()
            .map(|&b| b as f64)
            .chain(std::iter::once(f64::INFINITY));
        (bounds.zip(h.counts).collect(), h.sum)
    }

    /// Namespaces the waiting requests use: the scheduler forgets a namespace as soon as no
    /// waiting request uses it.
    #[getter]
    fn num_namespaces(&self) -> usize {
        self.lock().core.num_namespaces()
    }

    /// The policy name.
    #[getter]
    fn policy(&self) -> &str {
        &self.policy
    }

    fn __len__(&self) -> usize {
        self.lock().core.len()
    }

    fn __repr__(&self) -> String {
        format!(
            "Scheduler(policy={:?}, waiting={})",
            self.policy,
            self.__len__()
        )
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyScheduler>()
}
