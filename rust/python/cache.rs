//! `Cache` (the base of `RadixCache` and `BlockCache`) and `Request` as Python classes.

use super::convert;
use super::errors::CorruptionError;
use super::stats::PyCacheStats;
use crate::cache::request::RequestId;
use crate::cache::request::RequestView;
use crate::cache::PrefixCache;
use crate::error::Result as CoreResult;
use crate::wire::events::CacheEvent;
use numpy::{PyArray1, PyArrayMethods};
use pyo3::exceptions::{PyResourceWarning, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyTuple};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, TryLockError};

/// Inputs at least this long are handled with the GIL released.
const LONG: usize = 4096;

/// `Cache`, the common base of `RadixCache` and `BlockCache` (``isinstance(c, radixkv.Cache)``
/// for either): one core cache behind a mutex.
#[pyclass(name = "Cache", module = "radixkv._radixkv", subclass, frozen)]
pub struct PyCache {
    inner: Mutex<Box<dyn PrefixCache>>,
    kind: &'static str,
    /// Requests garbage-collected while open at a moment the mutex was taken: aborted by the
    /// next call that takes it (a drop never waits for the mutex).
    orphans: Mutex<Vec<RequestId>>,
    has_orphans: AtomicBool,
    /// Set when a call panicked: the core may be half-changed, so every later call is refused.
    broken: AtomicBool,
}

impl PyCache {
    /// A cache over `core`, named `kind` in messages.
    pub(super) fn from_core(core: Box<dyn PrefixCache>, kind: &'static str) -> Self {
        PyCache {
            inner: Mutex::new(core),
            kind,
            orphans: Mutex::new(Vec::new()),
            has_orphans: AtomicBool::new(false),
            broken: AtomicBool::new(false),
        }
    }

    /// Aborts the requests dropped while the mutex was taken (the caller holds it).
    fn abort_orphans(&self, core: &mut dyn PrefixCache) {
        // A plain load first: the common case (nothing orphaned) costs no read-modify-write.
        if self.has_orphans.load(Ordering::Relaxed)
            && self.has_orphans.swap(false, Ordering::Acquire)
        {
            let ids = std::mem::take(&mut *self.orphans.lock().unwrap_or_else(|e| e.into_inner()));
            for id in ids {
                let _ = core.abort(id); // closed meanwhile: nothing to do
            }
        }
    }

    /// Aborts `id` if it is still open, without ever waiting for the mutex (a drop runs with
    /// the GIL held, and may run inside a call that holds the mutex already); returns whether
    /// it was open. When the mutex is taken, the abort is left to the next call that takes it.
    fn abort_dropped(&self, id: RequestId) -> bool {
        if self.broken.load(Ordering::Acquire) {
            return false; // nothing more runs on a core that may be half-changed
        }
        let mut guard = match self.inner.try_lock() {
            Ok(g) => g,
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            Err(TryLockError::WouldBlock) => {
                self.orphans
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(id);
                self.has_orphans.store(true, Ordering::Release);
                return false;
            }
        };
        let core: &mut dyn PrefixCache = &mut **guard;
        self.abort_orphans(core);
        core.request(id).is_ok() && core.abort(id).is_ok()
    }

    /// Runs `f` on the core under the mutex, with the GIL released when `long`. A panic inside
    /// becomes a `CorruptionError` rather than crossing into Python, and marks the cache broken:
    /// the core may have been left half-changed, so every later call raises too.
    pub fn with<R: Send>(
        &self,
        py: Python<'_>,
        long: bool,
        f: impl FnOnce(&mut dyn PrefixCache) -> CoreResult<R> + Send,
    ) -> PyResult<R> {
        self.refuse_if_broken()?;
        let run = || {
            let mut guard = self
                .inner
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            catch_unwind(AssertUnwindSafe(|| {
                self.abort_orphans(&mut **guard);
                f(&mut **guard)
            }))
        };
        let out = if long { py.allow_threads(run) } else { run() };
        match out {
            Ok(r) => r.map_err(PyErr::from),
            Err(panic) => {
                let msg = panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                self.broken.store(true, Ordering::Release);
                Err(CorruptionError::new_err(format!(
                    "internal error: {msg}; this {} is broken from now on (its state may be \
                     half-changed): every later call raises, make a new cache",
                    self.kind
                )))
            }
        }
    }

    /// `CorruptionError` once a call has panicked (see [`PyCache::with`]).
    fn refuse_if_broken(&self) -> PyResult<()> {
        if self.broken.load(Ordering::Acquire) {
            return Err(CorruptionError::new_err(format!(
                "this {} is broken: an earlier call failed with an internal error and may have \
                 left it half-changed; make a new cache",
                self.kind
            )));
        }
        Ok(())
    }

    /// Reads a live request under the mutex (GIL held: views are short reads).
    pub fn view<R>(&self, id: RequestId, f: impl FnOnce(RequestView<'_>) -> R) -> PyResult<R> {
        self.refuse_if_broken()?;
        let guard = self
            .inner
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        Ok(f(guard.request(id)?))
    }
}

#[pymethods]
impl PyCache {
    /// Finds the longest cached prefix of ``tokens`` in ``namespace``, pins it and allocates pages
    /// for the rest, all or nothing (``OutOfPages`` leaves everything unchanged).
    #[pyo3(signature = (tokens, namespace=None))]
    fn admit(
        slf: &Bound<'_, Self>,
        tokens: &Bound<'_, PyAny>,
        namespace: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyRequest> {
        let py = slf.py();
        let toks = convert::tokens("tokens", tokens)?;
        let ns = convert::namespace(namespace)?;
        let long = toks.len() >= LONG;
        let id = slf.get().with(py, long, |c| c.admit_owned(toks, ns))?;
        let ns_obj = namespace.map_or_else(|| py.None(), |o| o.clone().unbind());
        Ok(PyRequest::new(slf, id, ns_obj))
    }

    /// Appends ``tokens`` to ``req`` (e.g. the sampled token), allocating pages as needed.
    fn extend(
        slf: &Bound<'_, Self>,
        req: &Bound<'_, PyRequest>,
        tokens: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let id = req.get().id; // another cache's id is refused by the core
        let toks = convert::tokens("tokens", tokens)?;
        slf.get()
            .with(slf.py(), toks.len() >= LONG, |c| c.extend(id, &toks))
    }

    /// Records that the KV of ``tokens[:num_computed]`` is written; publishes the full pages
    /// this completes so that concurrent requests can reuse them.
    fn commit(
        slf: &Bound<'_, Self>,
        req: &Bound<'_, PyRequest>,
        num_computed: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let id = req.get().id; // another cache's id is refused by the core
        let n = convert::count("num_computed", num_computed)?;
        slf.get().with(slf.py(), false, |c| c.commit(id, n))
    }

    /// Gives back ``req``'s tokens past ``num_tokens`` (from its ``num_computed`` to its
    /// ``num_tokens``) and frees the pages only they used: the draft tokens a speculative step
    /// rejected, never computed nor published (with a window group, their window pages too:
    /// truncate before committing up to ``num_tokens``; ``ValueError`` where a commit already
    /// released a window page the shorter request needs).
    fn truncate(
        slf: &Bound<'_, Self>,
        req: &Bound<'_, PyRequest>,
        num_tokens: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let id = req.get().id; // another cache's id is refused by the core
        let n = convert::count("num_tokens", num_tokens)?;
        slf.get().with(slf.py(), false, |c| c.truncate(id, n))
    }

    /// Up to ``max_tokens`` tokens cached after ``tokens`` in ``namespace`` (never another
    /// namespace's): the continuation of the cached sequence ``tokens`` begins, the most recently
    /// used where several are (uint32; empty where none, and always for a ``BlockCache``).
    /// Changes nothing, LRU order included.
    #[pyo3(signature = (tokens, max_tokens, namespace=None))]
    fn continuation<'py>(
        slf: &Bound<'py, Self>,
        tokens: &Bound<'py, PyAny>,
        max_tokens: &Bound<'py, PyAny>,
        namespace: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyArray1<u32>>> {
        let toks = convert::tokens("tokens", tokens)?;
        let max = convert::count("max_tokens", max_tokens)?;
        let ns = convert::namespace(namespace)?;
        let out = slf.get().with(slf.py(), toks.len() >= LONG, |c| {
            Ok(c.continuation(&toks, &ns, max))
        })?;
        Ok(PyArray1::from_vec(slf.py(), out))
    }

    /// Extends ``requests[i]`` by ``tokens[i]`` in order, in one call, and stops before the first
    /// request the pool cannot supply; returns how many were extended (that one and the rest are
    /// unchanged). A closed, foreign or repeated request, bad tokens or lengths that differ raise
    /// and change nothing.
    fn extend_many(
        slf: &Bound<'_, Self>,
        requests: &Bound<'_, PyAny>,
        tokens: &Bound<'_, PyAny>,
    ) -> PyResult<usize> {
        let ids = request_ids(requests)?;
        let toks: Vec<Vec<u32>> = tokens
            .try_iter()?
            .enumerate()
            .map(|(i, t)| convert::tokens(&format!("tokens[{i}]"), &t?))
            .collect::<PyResult<_>>()?;
        same_len("tokens", ids.len(), toks.len())?;
        let long = toks.iter().map(Vec::len).sum::<usize>() >= LONG;
        slf.get().with(slf.py(), long, |c| {
            let batch: Vec<(RequestId, &[u32])> =
                ids.iter().zip(&toks).map(|(&id, t)| (id, &t[..])).collect();
            c.extend_many(&batch)
        })
    }

    /// Commits ``requests[i]`` to ``num_computed[i]`` in one call; every pair is checked first,
    /// all or nothing.
    fn commit_many(
        slf: &Bound<'_, Self>,
        requests: &Bound<'_, PyAny>,
        num_computed: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let ids = request_ids(requests)?;
        let counts: Vec<usize> = num_computed
            .try_iter()?
            .enumerate()
            .map(|(i, n)| convert::count(&format!("num_computed[{i}]"), &n?))
            .collect::<PyResult<_>>()?;
        same_len("num_computed", ids.len(), counts.len())?;
        let batch: Vec<(RequestId, usize)> = ids.into_iter().zip(counts).collect();
        slf.get()
            .with(slf.py(), batch.len() >= LONG, |c| c.commit_many(&batch))
    }

    /// A new request with ``req``'s tokens and namespace sharing every full page of its
    /// computed prefix, without copying KV.
    fn fork(slf: &Bound<'_, Self>, req: &Bound<'_, PyRequest>) -> PyResult<PyRequest> {
        let id = req.get().id; // another cache's id is refused by the core
        let new = slf.get().with(slf.py(), false, |c| c.fork(id))?;
        Ok(PyRequest::new(
            slf,
            new,
            req.get().namespace.clone_ref(slf.py()),
        ))
    }

    /// Publishes what is computed, unpins, frees what is not published, and closes ``req``.
    ///
    /// ``priority``: the eviction class (``0 .. CLASSES - 1``, 0 evicted first) the request's
    /// pages are raised to at least. ``retain``: seconds of the cache's clock (see
    /// ``advance``; ``math.inf``: until released) that its pages stay out of eviction while
    /// anything else can go. Returns the retention's id (for ``release_retention``), or None
    /// when no retention was asked for.
    ///
    /// ``TypeError`` for a ``retain`` that is not a number or a ``priority`` that is not an int
    /// (a bool is neither: ``retain=True`` is not "one second"); ``ValueError`` naming the value
    /// for a class outside ``0 .. CLASSES - 1`` or a negative or NaN ``retain``.
    #[pyo3(
        signature = (req, *, retain=None, priority=None),
        text_signature = "($self, req, *, retain=0.0, priority=None)"
    )]
    fn finish(
        slf: &Bound<'_, Self>,
        req: &Bound<'_, PyRequest>,
        retain: Option<&Bound<'_, PyAny>>,
        priority: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Option<u64>> {
        let id = req.get().id; // another cache's id is refused by the core
        let retain = match retain {
            Some(r) => seconds("retain", r)?,
            None => 0.0,
        };
        let class = match priority {
            Some(p) => eviction_class(p)?,
            None => 0,
        };
        if class == 0 && retain == 0.0 {
            slf.get().with(slf.py(), false, |c| c.finish(id))?;
            return Ok(None);
        }
        let rid = slf
            .get()
            .with(slf.py(), false, |c| c.finish_retained(id, class, retain))?;
        Ok((rid != 0).then_some(rid))
    }

    /// Retains the cached prefix of ``tokens`` in ``namespace`` without admitting it (a cache
    /// breakpoint that ends inside a prompt): its whole pages on the device, as far as they
    /// are cached, get ``retain`` and ``priority`` as ``finish`` gives a request's pages.
    /// Nothing else changes: no query or hit is counted (``stats`` stay as they were), nothing
    /// is pinned or allocated, and the LRU order stays. Returns ``(retention, tokens)``: the
    /// retention's id (for ``release_retention``; None when none was made: nothing cached, or
    /// no ``retain``) and how many tokens of ``tokens`` it holds. Arguments are refused as
    /// ``admit``'s and ``finish``'s are.
    #[pyo3(
        signature = (tokens, namespace=None, *, retain=None, priority=None),
        text_signature = "($self, tokens, namespace=None, *, retain=0.0, priority=None)"
    )]
    fn retain_prefix(
        slf: &Bound<'_, Self>,
        tokens: &Bound<'_, PyAny>,
        namespace: Option<&Bound<'_, PyAny>>,
        retain: Option<&Bound<'_, PyAny>>,
        priority: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<(Option<u64>, usize)> {
        let toks = convert::tokens("tokens", tokens)?;
        let ns = convert::namespace(namespace)?;
        let retain = match retain {
            Some(r) => seconds("retain", r)?,
            None => 0.0,
        };
        let class = match priority {
            Some(p) => eviction_class(p)?,
            None => 0,
        };
        let long = toks.len() >= LONG;
        let (rid, held) = slf.get().with(slf.py(), long, |c| {
            c.retain_prefix(&toks, &ns, class, retain)
        })?;
        Ok(((rid != 0).then_some(rid), held))
    }

    /// Ends the retention ``retention`` (an id ``finish`` returned) before its time; False when
    /// it is not live (expired, released, or its pages were evicted).
    fn release_retention(slf: &Bound<'_, Self>, retention: u64) -> PyResult<bool> {
        slf.get()
            .with(slf.py(), false, |c| Ok(c.release_retention(retention)))
    }

    /// Advances the cache's clock to ``now`` (never backwards) and ends the retentions whose
    /// time is up; returns how many. The cache reads no clock of its own: its owner advances
    /// it (say, once per engine step), so that ranks in lockstep stay identical.
    fn advance(slf: &Bound<'_, Self>, now: f64) -> PyResult<usize> {
        slf.get().with(slf.py(), false, |c| c.set_time(now))
    }

    /// The cache's clock (``advance`` sets it; 0.0 at first).
    #[getter]
    fn now(slf: &Bound<'_, Self>) -> PyResult<f64> {
        slf.get().with(slf.py(), false, |c| Ok(c.now()))
    }

    /// Unpins and frees what is not published, publishing nothing more; closes ``req``.
    fn abort(slf: &Bound<'_, Self>, req: &Bound<'_, PyRequest>) -> PyResult<()> {
        let id = req.get().id; // another cache's id is refused by the core
        slf.get().with(slf.py(), false, |c| c.abort(id))
    }

    /// How many tokens ``admit`` would find cached now. Changes nothing, LRU order included.
    #[pyo3(signature = (tokens, namespace=None))]
    fn match_prefix(
        slf: &Bound<'_, Self>,
        tokens: &Bound<'_, PyAny>,
        namespace: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<usize> {
        let toks = convert::tokens("tokens", tokens)?;
        let ns = convert::namespace(namespace)?;
        slf.get()
            .with(slf.py(), toks.len() >= LONG, |c| c.match_prefix(&toks, &ns))
    }

    /// Evicts up to ``num_pages`` evictable pages in eviction order; returns how many.
    fn evict(slf: &Bound<'_, Self>, num_pages: &Bound<'_, PyAny>) -> PyResult<usize> {
        let n = convert::count("num_pages", num_pages)?;
        slf.get().with(slf.py(), n >= LONG, |c| Ok(c.evict(n)))
    }

    /// Drops every evictable page (e.g. after a weight update), of both tiers; returns how many.
    fn reset(slf: &Bound<'_, Self>) -> PyResult<usize> {
        slf.get().with(slf.py(), true, |c| Ok(c.reset()))
    }

    /// The copies between the tiers decided since the last call, in the order to perform them,
    /// as an int32 array ``[N, 3]`` of rows ``(kind, src, dst)``: kind ``COPY_OFFLOAD`` (0,
    /// device page ``src`` to host page ``dst``), ``COPY_LOAD`` (1, host page ``src`` to device
    /// page ``dst``), ``COPY_SPILL`` (2, host page ``src`` to disk slot ``dst``) or
    /// ``COPY_PERSIST`` (3, device page ``src`` to disk slot ``dst``); with a window host tier
    /// also ``COPY_WINDOW_OFFLOAD`` (4, window page ``src`` to window host page ``dst``) and
    /// ``COPY_WINDOW_LOAD`` (5, window host page ``src`` to window page ``dst``), which touch the
    /// window layers' pools only; ids per tier. Empties the log. Perform them in order before the next
    /// computation that reads or writes a page they name (``KVCache`` does it in ``plan``).
    ///
    /// With ``keys=True``, returns ``(rows, keys)``: ``keys`` holds the 32-byte block key of each
    /// disk copy (``COPY_SPILL``, ``COPY_PERSIST``) in order, concatenated: what the owner writes
    /// beside the page, so that a slot always names the page its bytes are.
    #[pyo3(signature = (keys=false))]
    fn drain_copies<'py>(slf: &Bound<'py, Self>, keys: bool) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        let (copies, disk_keys) = slf.get().with(py, false, |c| Ok(c.drain_copies_keyed()))?;
        let flat: Vec<i32> = copies
            .iter()
            .flat_map(|c| [c.kind as i32, c.src as i32, c.dst as i32])
            .collect();
        let n = copies.len();
        let rows = PyArray1::from_vec(py, flat).reshape([n, 3])?.into_any();
        if !keys {
            return Ok(rows);
        }
        let bytes: Vec<u8> = disk_keys.iter().flatten().copied().collect();
        let items: Vec<PyObject> =
            vec![rows.unbind(), PyBytes::new(py, &bytes).into_any().unbind()];
        Ok(PyTuple::new(py, items)?.into_any())
    }

    /// Pages of the host tier (0: none).
    #[getter]
    fn host_pages(slf: &Bound<'_, Self>) -> PyResult<usize> {
        slf.get().with(slf.py(), false, |c| Ok(c.host_pages()))
    }

    /// Slots of the disk tier (0: none).
    #[getter]
    fn disk_pages(slf: &Bound<'_, Self>) -> PyResult<usize> {
        slf.get().with(slf.py(), false, |c| Ok(c.disk_pages()))
    }

    /// Tokens a sliding-window layer's query reads, itself included (0: no window group; see
    /// SEMANTICS.md, "Sliding-window layers").
    #[getter]
    fn window(slf: &Bound<'_, Self>) -> PyResult<usize> {
        slf.get().with(slf.py(), false, |c| Ok(c.window().0))
    }

    /// Pages of the window group's pool (0: no window group).
    #[getter]
    fn window_pages(slf: &Bound<'_, Self>) -> PyResult<usize> {
        slf.get().with(slf.py(), false, |c| Ok(c.window().1))
    }

    /// Pages of the window group's host tier (0: none): where cached window pages go when the
    /// window pool needs room (``COPY_WINDOW_OFFLOAD``), and come back from for a hit
    /// (``COPY_WINDOW_LOAD``).
    #[getter]
    fn window_host_pages(slf: &Bound<'_, Self>) -> PyResult<usize> {
        slf.get()
            .with(slf.py(), false, |c| Ok(c.window_host_pages()))
    }

    /// With a window group, the most tokens to append to one request in one step (a prefill
    /// chunk) so that it fits the window pool beside a hit's window; ``None`` without one.
    /// The scheduler caps admissions by it; an engine caps its prefill chunks.
    #[getter]
    fn window_chunk(slf: &Bound<'_, Self>) -> PyResult<Option<usize>> {
        slf.get().with(slf.py(), false, |c| {
            Ok((c.window().1 > 0).then(|| c.window_chunk()))
        })
    }

    /// Starts reading back from the disk tier the pages of ``tokens`` past what the device and
    /// host tiers hold, while the disk holds them (see SEMANTICS.md, "Disk tier"). Returns
    /// ``None`` when it holds none, else ``(id, from_token, slots, keys, host_pages)``: read disk
    /// slot ``slots[i]`` (uint32), which must hold the page whose block key is
    /// ``keys[32*i:32*i+32]``, into host page ``host_pages[i]``, check it, then call
    /// :meth:`disk_confirm`. ``KVCache(..., disk_dir=...)`` does all of it in ``prefetch``.
    #[pyo3(signature = (tokens, namespace=None))]
    fn disk_prefetch<'py>(
        slf: &Bound<'py, Self>,
        tokens: &Bound<'py, PyAny>,
        namespace: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Option<Bound<'py, PyTuple>>> {
        let py = slf.py();
        let toks = convert::tokens("tokens", tokens)?;
        let ns = convert::namespace(namespace)?;
        let Some(f) = slf.get().with(py, true, |c| c.disk_prefetch(&toks, ns))? else {
            return Ok(None);
        };
        let keys: Vec<u8> = f.keys.iter().flatten().copied().collect();
        let items: Vec<PyObject> = vec![
            f.id.into_pyobject(py)?.into_any().unbind(),
            f.from.into_pyobject(py)?.into_any().unbind(),
            PyArray1::from_vec(py, f.slots).into_any().unbind(),
            PyBytes::new(py, &keys).into_any().unbind(),
            PyArray1::from_vec(py, f.host).into_any().unbind(),
        ];
        Ok(Some(PyTuple::new(py, items)?))
    }

    /// Ends prefetch ``id``: its first ``good`` pages read well and enter the cache as host pages
    /// (the part that still extends the cached prefix); with ``bad=True``, page ``good`` read torn
    /// or corrupted and leaves the disk tier. Returns how many pages entered the cache.
    #[pyo3(signature = (id, good, bad=false))]
    fn disk_confirm(
        slf: &Bound<'_, Self>,
        id: &Bound<'_, PyAny>,
        good: &Bound<'_, PyAny>,
        bad: bool,
    ) -> PyResult<usize> {
        let id = convert::count("id", id)? as u64;
        let good = convert::count("good", good)?;
        slf.get()
            .with(slf.py(), false, |c| c.disk_confirm(id, good, bad))
    }

    /// Logs a copy to disk (``COPY_SPILL`` from the host, ``COPY_PERSIST`` from the device) of
    /// every page the cache holds that the disk tier lacks, to save the cache; returns how many.
    fn disk_persist(slf: &Bound<'_, Self>) -> PyResult<usize> {
        slf.get().with(slf.py(), true, |c| Ok(c.disk_persist()))
    }

    /// The disk tier's entries, least recently used first: ``(keys, slots)``, the 32-byte block
    /// keys concatenated and a uint32 array of their slots.
    fn disk_entries<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyTuple>> {
        let py = slf.py();
        let entries = slf.get().with(py, true, |c| Ok(c.disk_entries()))?;
        let keys: Vec<u8> = entries.iter().flat_map(|e| e.0).collect();
        let slots: Vec<u32> = entries.iter().map(|e| e.1).collect();
        let items: Vec<PyObject> = vec![
            PyBytes::new(py, &keys).into_any().unbind(),
            PyArray1::from_vec(py, slots).into_any().unbind(),
        ];
        PyTuple::new(py, items)
    }

    /// Fills the empty disk tier with entries an earlier process saved (as :meth:`disk_entries`
    /// gave them): ``keys`` (32 bytes each, concatenated) and their ``slots``. ``ValueError``,
    /// changing nothing, for a tier that is not empty, a slot past ``disk_pages``, or a slot or
    /// key given twice.
    fn disk_restore(slf: &Bound<'_, Self>, keys: &[u8], slots: &Bound<'_, PyAny>) -> PyResult<()> {
        let slots = convert::tokens("slots", slots).or_else(|e| {
            if slots.len().is_ok_and(|n| n == 0) {
                Ok(Vec::new())
            } else {
                Err(e)
            }
        })?;
        if keys.len() != 32 * slots.len() {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "keys must be 32 bytes for each of the {} slots, got {} bytes",
                slots.len(),
                keys.len()
            )));
        }
        let entries: Vec<([u8; 32], u32)> = keys
            .chunks_exact(32)
            .map(|k| k.try_into().expect("32 bytes"))
            .zip(slots)
            .collect();
        slf.get().with(slf.py(), true, |c| c.disk_restore(&entries))
    }

    /// A snapshot of the page counts and hit counters.
    #[getter]
    fn stats(slf: &Bound<'_, Self>) -> PyResult<PyCacheStats> {
        Ok(PyCacheStats(
            slf.get().with(slf.py(), false, |c| Ok(c.stats()))?,
        ))
    }

    /// Turns recording of KV events (blocks published and evicted, resets) on or off; off (the
    /// default) costs nothing and drops what was not drained.
    #[pyo3(signature = (enabled=true))]
    fn record_events(slf: &Bound<'_, Self>, enabled: bool) -> PyResult<()> {
        slf.get().with(slf.py(), false, |c| {
            c.record_events(enabled);
            Ok(())
        })
    }

    /// The KV events recorded since the last call, in order: ``("stored", namespace, parent,
    /// keys, tokens)`` (full pages entered the index: their radixkv block keys, the key before
    /// the first or None, their tokens as numpy uint32, the namespace as bytes or None),
    /// ``("removed", keys)`` and ``("cleared",)`` (a reset left the index empty, and the window
    /// group). A cache with a window group also records ``("window_stored", namespace, parent,
    /// keys, tokens)`` and ``("window_removed", keys)``: window pages entering and leaving the
    /// window group, under the same block keys. A cache with state slots also records
    /// ``("state_stored", namespace, parent, [key], tokens)`` (a recurrent-state snapshot became
    /// findable, ending on the page of ``key``, whose tokens these are) and
    /// ``("state_removed", keys)`` (snapshots ending on those pages left the cache).
    fn drain_events<'py>(slf: &Bound<'py, Self>) -> PyResult<Vec<Bound<'py, PyTuple>>> {
        let py = slf.py();
        let events = slf.get().with(py, false, |c| Ok(c.drain_events()))?;
        let keys = |hs: &[crate::wire::hash::BlockHash]| -> Vec<Bound<'py, PyBytes>> {
            hs.iter().map(|h| PyBytes::new(py, h)).collect()
        };
        let stored = |what: &'static str,
                      ns: crate::wire::hash::Namespace,
                      parent: Option<crate::wire::hash::BlockHash>,
                      hashes: &[crate::wire::hash::BlockHash],
                      tokens: Vec<u32>| {
            let ns = ns.map(|n| PyBytes::new(py, &n));
            let parent = parent.map(|h| PyBytes::new(py, &h));
            let toks = PyArray1::from_vec(py, tokens);
            (what, ns, parent, keys(hashes), toks).into_pyobject(py)
        };
        events
            .into_iter()
            .map(|e| match e {
                CacheEvent::Stored {
                    namespace,
                    parent,
                    hashes,
                    tokens,
                } => stored("stored", namespace, parent, &hashes, tokens),
                CacheEvent::WindowStored {
                    namespace,
                    parent,
                    hashes,
                    tokens,
                } => stored("window_stored", namespace, parent, &hashes, tokens),
                CacheEvent::Removed { hashes } => ("removed", keys(&hashes)).into_pyobject(py),
                CacheEvent::WindowRemoved { hashes } => {
                    ("window_removed", keys(&hashes)).into_pyobject(py)
                }
                CacheEvent::StateStored {
                    namespace,
                    parent,
                    hash,
                    tokens,
                } => stored("state_stored", namespace, parent, &[hash], tokens),
                CacheEvent::StateRemoved { hashes } => {
                    ("state_removed", keys(&hashes)).into_pyobject(py)
                }
                CacheEvent::Cleared => ("cleared",).into_pyobject(py),
            })
            .collect()
    }

    /// Test hook: panics inside the core's mutex, as an internal error would; the cache is broken
    /// after it (every later call raises ``CorruptionError``).
    fn _panic_for_test(slf: &Bound<'_, Self>) -> PyResult<()> {
        slf.get().with(slf.py(), false, |_| -> CoreResult<()> {
            panic!("forced by _panic_for_test")
        })
    }

    /// Verifies every internal invariant; raises ``CorruptionError`` naming the first broken one.
    fn check(slf: &Bound<'_, Self>) -> PyResult<()> {
        slf.get().with(slf.py(), true, |c| c.check())
    }

    /// A 64-bit digest of the index's decision-relevant state (cached pages, pins, live
    /// requests' page tables, free and evictable counts, eviction order). Equal for two caches
    /// driven by the same calls, in any process, whatever their random per-cache keys; one pass
    /// over the index (about 1 ms for 65k cached pages of 16 tokens), the GIL released.
    fn state_digest(slf: &Bound<'_, Self>) -> PyResult<u64> {
        slf.get().with(slf.py(), true, |c| Ok(c.state_digest()))
    }

    /// Physical pages in the pool.
    #[getter]
    fn num_pages(slf: &Bound<'_, Self>) -> PyResult<usize> {
        Ok(Self::stats(slf)?.0.num_pages)
    }

    /// Tokens per page.
    #[getter]
    fn page_size(slf: &Bound<'_, Self>) -> PyResult<usize> {
        Ok(Self::stats(slf)?.0.page_size)
    }

    /// Heap bytes of the index and pool bookkeeping (live requests excluded).
    #[getter]
    fn metadata_bytes(slf: &Bound<'_, Self>) -> PyResult<usize> {
        slf.get().with(slf.py(), false, |c| Ok(c.metadata_bytes()))
    }

    fn __repr__(slf: &Bound<'_, Self>) -> PyResult<String> {
        let s = Self::stats(slf)?.0;
        Ok(format!(
            "{}(num_pages={}, page_size={}, free={}, evictable={}, used={})",
            slf.get().kind,
            s.num_pages,
            s.page_size,
            s.free_pages,
            s.evictable_pages,
            s.used_pages
        ))
    }

    // State slots (hybrid models' recurrent-state snapshots), kept together for the merge.

    /// With ``state_slots``: a state slot for ``req``'s recurrent state at token ``pos`` (a
    /// multiple of ``page_size``, at most ``num_tokens``; its tokens up to ``pos`` computed, the
    /// commit that covers them still to come). Copy the state into the slot, then ``commit``:
    /// the snapshot becomes findable at the first ``commit`` or ``finish`` after which the
    /// request's pages up to ``pos`` are published, never before, and its slot is freed if the
    /// request closes first. A free slot, else the least recently used unpinned snapshot's;
    /// ``None``, changing nothing, when every slot is pinned or pending, when ``req`` took one at
    /// ``pos`` already, or when a snapshot of that prefix is cached. ``ValueError`` naming
    /// ``pos``, or without state slots.
    fn take_state(
        slf: &Bound<'_, Self>,
        req: &Bound<'_, PyRequest>,
        pos: &Bound<'_, PyAny>,
    ) -> PyResult<Option<u32>> {
        let id = req.get().id; // another cache's id is refused by the core
        let pos = convert::count("pos", pos)?;
        slf.get().with(slf.py(), false, |c| c.take_state(id, pos))
    }

    /// Unpins the snapshot ``req``'s admission hit ended at (``req.state_slot``), once its
    /// state is copied into the request's own; returns False when none is pinned. ``finish``
    /// and ``abort`` unpin it too. A pinned snapshot is never evicted.
    fn release_state(slf: &Bound<'_, Self>, req: &Bound<'_, PyRequest>) -> PyResult<bool> {
        let id = req.get().id; // another cache's id is refused by the core
        slf.get().with(slf.py(), false, |c| c.release_state(id))
    }

    /// Evicts the snapshot in state slot ``slot`` (found damaged, or the owner's own policy);
    /// its pages stay cached. False, changing nothing, when the slot is free or its snapshot
    /// pending or pinned. ``ValueError`` naming ``slot`` past ``state_slots``.
    fn evict_state(slf: &Bound<'_, Self>, slot: &Bound<'_, PyAny>) -> PyResult<bool> {
        let slot = convert::count("slot", slot)?;
        let slot = u32::try_from(slot).unwrap_or(u32::MAX);
        slf.get().with(slf.py(), false, |c| c.evict_state(slot))
    }

    /// The state slots freed since the last call (their snapshot evicted for a slot or with a
    /// page it needed, or taken and never published) and free still: their tensors hold
    /// nothing of use. Each slot once, in the order freed.
    fn drain_freed_states(slf: &Bound<'_, Self>) -> PyResult<Vec<u32>> {
        slf.get()
            .with(slf.py(), false, |c| Ok(c.drain_freed_states()))
    }
}

/// The ids of a sequence of ``Request`` objects (another cache's are refused by the core).
fn request_ids(requests: &Bound<'_, PyAny>) -> PyResult<Vec<RequestId>> {
    requests
        .try_iter()?
        .enumerate()
        .map(|(i, r)| {
            let r = r?;
            r.downcast::<PyRequest>().map(|r| r.get().id).map_err(|_| {
                PyTypeError::new_err(format!(
                    "requests[{i}] must be a Request, got {}",
                    r.get_type()
                        .name()
                        .map_or_else(|_| "?".to_string(), |n| n.to_string())
                ))
            })
        })
        .collect()
}

fn same_len(what: &str, requests: usize, other: usize) -> PyResult<()> {
    if requests != other {
        return Err(PyValueError::new_err(format!(
            "{what} must hold one entry per request ({requests}), got {other}"
        )));
    }
    Ok(())
}

/// A live request: its tokens, its page table and how much of it is cached and computed.
/// Returned by ``admit`` and ``fork``; closed by ``finish`` or ``abort``, after which every
/// attribute but ``namespace`` and ``closed`` raises ``InvalidRequest``. A request
/// garbage-collected while open is aborted, with a ``ResourceWarning``.
#[pyclass(name = "Request", module = "radixkv._radixkv", frozen, weakref)]
pub struct PyRequest {
    pub(crate) cache: Py<PyCache>,
    pub(crate) id: RequestId,
    namespace: PyObject,
}

impl PyRequest {
    pub(crate) fn new(cache: &Bound<'_, PyCache>, id: RequestId, namespace: PyObject) -> Self {
        PyRequest {
            cache: cache.clone().unbind(),
            id,
            namespace,
        }
    }

    fn view<R>(&self, f: impl FnOnce(RequestView<'_>) -> R) -> PyResult<R> {
        self.cache.get().view(self.id, f)
    }
}

/// A request garbage-collected while open would pin its pages forever: it is aborted, with a
/// `ResourceWarning`, as Python does for a file left open.
impl Drop for PyRequest {
    fn drop(&mut self) {
        if !self.cache.get().abort_dropped(self.id) {
            return;
        }
        // No radixkv lock is held here: the warning may run Python code (filters, hooks).
        Python::with_gil(|py| {
            let pending = PyErr::take(py);
            let msg = c"a radixkv Request was garbage-collected while open; it was aborted \
                        (finish or abort requests explicitly)";
            let category = py.get_type::<PyResourceWarning>();
            if let Err(e) = PyErr::warn(py, &category, msg, 1) {
                e.write_unraisable(py, None);
            }
            if let Some(e) = pending {
                e.restore(py);
            }
        });
    }
}

#[pymethods]
impl PyRequest {
    /// Tokens in the request so far.
    #[getter]
    fn num_tokens(&self) -> PyResult<usize> {
        self.view(|r| r.num_tokens())
    }

    /// Tokens whose KV came from the cache at admission (a multiple of ``page_size``).
    #[getter]
    fn num_cached(&self) -> PyResult<usize> {
        self.view(|r| r.num_cached)
    }

    /// Tokens whose KV has been written; advanced by ``commit``.
    #[getter]
    fn num_computed(&self) -> PyResult<usize> {
        self.view(|r| r.num_computed)
    }

    /// Page table: numpy int32, ``ceil(num_tokens / page_size)`` entries.
    #[getter]
    fn pages<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray1<i32>>> {
        let v = self.view(|r| r.pages.iter().map(|p| p.0 as i32).collect::<Vec<_>>())?;
        Ok(PyArray1::from_vec(py, v))
    }

    /// With a window group: the window page of each page, numpy int32, ``-1`` where released
    /// (pages no later query of the request reads); empty without one. Unlike ``pages``, an
    /// entry may change at a commit: to ``-1`` once released, or to the page another request
    /// published first for the same prefix (the same KV), so that its key stays findable.
    #[getter]
    fn window_pages<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray1<i32>>> {
        let v = self.view(|r| r.window_pages.iter().map(|&w| w as i32).collect::<Vec<_>>())?;
        Ok(PyArray1::from_vec(py, v))
    }

    /// Slot of every token, numpy int64: ``pages[i // P] * P + i % P``.
    #[getter]
    fn slots<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray1<i64>>> {
        let v = self.view(|r| {
            let mut out = Vec::with_capacity(r.num_tokens());
            r.extend_slots(0, r.num_tokens(), &mut out);
            out
        })?;
        Ok(PyArray1::from_vec(py, v))
    }

    /// Token ids, numpy uint32 (a copy).
    #[getter]
    fn tokens<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray1<u32>>> {
        let v = self.view(|r| r.tokens.to_vec())?;
        Ok(PyArray1::from_vec(py, v))
    }

    /// The namespace, as given to ``admit``.
    #[getter]
    fn namespace(&self, py: Python<'_>) -> PyObject {
        self.namespace.clone_ref(py)
    }

    /// Whether the request was finished or aborted.
    #[getter]
    fn closed(&self) -> bool {
        self.view(|_| ()).is_err()
    }

    /// The cache this request belongs to.
    #[getter]
    fn cache(&self, py: Python<'_>) -> Py<PyCache> {
        self.cache.clone_ref(py)
    }

    /// With ``state_slots``: tokens the KV match ran to at admission (``num_cached`` or more:
    /// the hit ends at the last snapshot, the cached KV may run further, to a junction worth a
    /// snapshot); ``num_cached`` without them.
    #[getter]
    fn kv_matched(&self) -> PyResult<usize> {
        self.view(|r| r.kv_matched)
    }

    /// With ``state_slots``: the slot of the snapshot the hit ended at (copy it into the
    /// request's own state, then ``cache.release_state(req)``); None with no hit, or once
    /// released.
    #[getter]
    fn state_slot(&self) -> PyResult<Option<u32>> {
        self.view(|r| r.state_slot)
    }

    fn __repr__(&self) -> String {
        match self.view(|r| (r.num_tokens(), r.num_cached, r.num_computed)) {
            Ok((t, c, d)) => format!("Request(num_tokens={t}, num_cached={c}, num_computed={d})"),
            Err(_) => "Request(closed)".to_string(),
        }
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyCache>()?;
    m.add_class::<PyRequest>()?;
    m.add("COPY_OFFLOAD", crate::cache::tier::CopyKind::Offload as i32)?;
    m.add("COPY_LOAD", crate::cache::tier::CopyKind::Load as i32)?;
    m.add("COPY_SPILL", crate::cache::tier::CopyKind::Spill as i32)?;
    m.add("COPY_PERSIST", crate::cache::tier::CopyKind::Persist as i32)?;
    m.add(
        "COPY_WINDOW_OFFLOAD",
        crate::cache::tier::CopyKind::WindowOffload as i32,
    )?;
    m.add(
        "COPY_WINDOW_LOAD",
        crate::cache::tier::CopyKind::WindowLoad as i32,
    )?;
    m.add("EVICTION_CLASSES", crate::CLASSES)?;
    Ok(())
}

/// ``obj`` as seconds for ``what``: an int or a float, never a bool (``TypeError`` naming it).
fn seconds(what: &str, obj: &Bound<'_, PyAny>) -> PyResult<f64> {
    let number = !obj.is_instance_of::<pyo3::types::PyBool>()
        && (obj.is_instance_of::<pyo3::types::PyFloat>() || convert::as_int(obj).is_some());
    if !number {
        return Err(PyTypeError::new_err(format!(
            "{what} must be seconds (a number >= 0, or math.inf), got {}",
            obj.get_type().name()?
        )));
    }
    obj.extract::<f64>()
}

/// ``obj`` as an eviction class (``0 .. CLASSES - 1``): ``TypeError`` for a non-int (a bool
/// too), ``ValueError`` naming the value given (not a clamped one) and the valid classes.
fn eviction_class(obj: &Bound<'_, PyAny>) -> PyResult<u8> {
    let top = crate::CLASSES - 1;
    let out_of_range = || -> PyResult<PyErr> {
        Ok(PyValueError::new_err(format!(
            "priority must be an eviction class from 0 to {top} (0 evicted first), got {}",
            obj.str()?
        )))
    };
    match convert::count("priority", obj) {
        Ok(c) if c <= usize::from(top) => Ok(c as u8),
        Ok(_) => Err(out_of_range()?),
        Err(e) if e.is_instance_of::<PyValueError>(obj.py()) => Err(out_of_range()?),
        Err(e) => Err(e),
    }
}
