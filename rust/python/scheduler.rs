//! `Scheduler` as a Python class.

use super::cache::{PyCache, PyRequest};
use super::convert;
use crate::scheduler::{Policy, Scheduler, WAIT_BOUNDS};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use std::collections::HashMap;
use std::sync::Mutex;

/// A waiting queue that admits requests into a cache in a cache-aware order.
///
/// ``policy``: ``"fcfs"`` (arrival order), ``"lpm"`` (longest cached prefix first) or
/// ``"dfs-weight"`` (requests sharing a prefix back to back, heaviest group first).
/// ``max_wait``: a request that has waited more than this many ``schedule`` calls goes ahead of
/// cache order (``0`` turns the bound off). Higher ``priority`` goes first within every policy.
#[pyclass(name = "Scheduler", module = "radixkv._radixkv", frozen)]
pub struct PyScheduler {
    cache: Py<PyCache>,
    inner: Mutex<Scheduler>,
    policy: String,
    /// The namespace object each waiting request was added with, handed back "as given".
    namespaces: Mutex<HashMap<u64, PyObject>>,
}

#[pymethods]
impl PyScheduler {
    #[new]
    #[pyo3(signature = (cache, policy="lpm", max_wait=256))]
    fn new(
        py: Python<'_>,
        cache: &Bound<'_, PyCache>,
        policy: &str,
        max_wait: i64,
    ) -> PyResult<Self> {
        let p: Policy = policy.parse()?;
        if max_wait < 0 {
            return Err(PyValueError::new_err(format!(
                "max_wait must be >= 0, got {max_wait}"
            )));
        }
        let inner = cache
            .get()
            .with(py, false, |c| Ok(Scheduler::new(c, p, max_wait as u64)))?;
        Ok(PyScheduler {
            cache: cache.clone().unbind(),
            inner: Mutex::new(inner),
            policy: policy.to_string(),
            namespaces: Mutex::new(HashMap::new()),
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
            Some(p) => p.extract().map_err(|_| {
                PyValueError::new_err(format!(
                    "priority must be an int in [-2**31, 2**31), got {p}"
                ))
            })?,
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
        let mut s = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let id = s.add(&toks, ns, priority, max_new_tokens)?;
        let ns_obj = namespace.map_or_else(|| tokens.py().None(), |o| o.clone().unbind());
        self.namespaces
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id, ns_obj);
        Ok(id)
    }

    /// Drops a waiting request; returns whether it was waiting.
    fn cancel(&self, id: u64) -> bool {
        self.namespaces
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&id);
        self.inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .cancel(id)
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
        let admitted = self.cache.get().with(py, true, |c| {
            let mut s = self.inner.lock().unwrap_or_else(|e| e.into_inner());
            Ok(s.schedule(c, token_budget, max_requests))
        })?;
        let mut namespaces = self.namespaces.lock().unwrap_or_else(|e| e.into_inner());
        Ok(admitted
            .into_iter()
            .map(|a| {
                let ns = namespaces.remove(&a.id).unwrap_or_else(|| py.None());
                (a.id, PyRequest::new(cache, a.request, ns))
            })
            .collect())
    }

    /// Ids of the waiting requests, by arrival.
    #[getter]
    fn waiting(&self) -> Vec<u64> {
        self.inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .waiting_ids()
    }

    /// How long the requests admitted so far waited, in ``schedule`` calls that passed them
    /// over: a list of ``(upper_bound, count)`` pairs, counts not cumulative, the last bound
    /// ``inf``; and the sum of the waits. For a Prometheus histogram (``radixkv.metrics``).
    #[getter]
    fn wait_histogram(&self) -> (Vec<(f64, u64)>, u64) {
        let h = self.inner.lock().unwrap_or_else(|e| e.into_inner()).waits();
        let bounds = WAIT_BOUNDS
            .iter()
            .map(|&b| b as f64)
            .chain(std::iter::once(f64::INFINITY));
        (bounds.zip(h.counts).collect(), h.sum)
    }

    /// The policy name.
    #[getter]
    fn policy(&self) -> &str {
        &self.policy
    }

    fn __len__(&self) -> usize {
        self.inner.lock().unwrap_or_else(|e| e.into_inner()).len()
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
