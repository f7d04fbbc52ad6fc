//! `plan_step`: the index arithmetic of one forward pass, as a typed `StepPlan`.

use super::cache::{PyCache, PyRequest};
use super::errors::StaleStepError;
use crate::cache::request::RequestId;
use crate::cache::PrefixCache;
use crate::plan::{plan_step as plan_core, StepPlan};
use numpy::{PyArray1, PyArray2, PyArrayMethods};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

/// One planned step (built by ``plan_step``): numpy arrays, each a fresh copy on every read.
///
/// ``input_ids``, ``positions``, ``write_slots`` (int64 ``[T]``), ``q_start`` (int64 ``[B+1]``),
/// ``kv_len``, ``last_token_index`` (int64 ``[B]``); the page tables, int32: ``block_table``
/// ``[B, max_pages]`` (row ``b`` starts with request ``b``'s pages, padded with page 0),
/// ``seq_lens`` ``[B]``, ``qo_indptr`` ``[B+1]``, and FlashInfer's CSR triplet
/// ``paged_kv_indptr`` ``[B+1]``, ``paged_kv_indices``, ``paged_kv_last_page_len`` ``[B]``
/// (``1..page_size``); ``longs`` and ``ints``, the int64 and the int32 arrays each back to back
/// in one array; ints ``batch_size``, ``num_tokens``, ``max_pages``, ``max_kv_len``,
/// ``max_q_len``.
#[pyclass(name = "StepPlan", module = "radixkv._radixkv", frozen)]
pub struct PyStepPlan {
    plan: StepPlan,
    cache: Py<PyCache>,
    /// Each request's id, `num_computed` and `num_tokens` when the step was planned.
    stamps: Vec<(RequestId, usize, usize)>,
}

fn arr<'py, T: numpy::Element + Copy>(py: Python<'py>, v: &[T]) -> Bound<'py, PyArray1<T>> {
    PyArray1::from_slice(py, v)
}

#[pymethods]
impl PyStepPlan {
    /// int64 ``[T]``: token ids of the new tokens, packed request after request.
    #[getter]
    fn input_ids<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        arr(py, &self.plan.input_ids)
    }
    /// int64 ``[T]``: absolute position of each new token.
    #[getter]
    fn positions<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        arr(py, &self.plan.positions)
    }
    /// int64 ``[T]``: slot each new token's K/V is written to.
    #[getter]
    fn write_slots<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        arr(py, &self.plan.write_slots)
    }
    /// int64 ``[B+1]``: packed row offsets of each request's queries.
    #[getter]
    fn q_start<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        arr(py, &self.plan.q_start)
    }
    /// int64 ``[B]``: keys each request attends to (its ``num_tokens``).
    #[getter]
    fn kv_len<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        arr(py, &self.plan.kv_len)
    }
    /// int64 ``[B]``: packed row of each request's last token.
    #[getter]
    fn last_token_index<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        arr(py, &self.plan.last_token_index)
    }
    /// int64 ``[T]``: with a window group, each new token's slot in the window layers' pool
    /// (empty without one).
    #[getter]
    fn window_write_slots<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        arr(py, &self.plan.window_write_slots)
    }

    /// int32 ``[B, max_pages]``: with a window group, request ``b``'s window pages (page 0 where
    /// released and as padding); ``[B, 0]`` without one.
    #[getter]
    fn window_block_table<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray2<i32>>> {
        let cols = if self.plan.window_block_table.is_empty() {
            0
        } else {
            self.plan.max_pages
        };
        arr(py, &self.plan.window_block_table).reshape([self.plan.kv_len.len(), cols])
    }

    /// int32 ``[B, max_pages]``: request ``b``'s pages, then page 0 as padding.
    #[getter]
    fn block_table<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray2<i32>>> {
        arr(py, &self.plan.block_table).reshape([self.plan.kv_len.len(), self.plan.max_pages])
    }
    /// int32 ``[B]``: keys each request attends to.
    #[getter]
    fn seq_lens<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        arr(py, &self.plan.seq_lens)
    }
    /// int32 ``[B+1]``: query offsets.
    #[getter]
    fn qo_indptr<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        arr(py, &self.plan.qo_indptr)
    }
    /// int32 ``[B+1]``: offsets of each request's pages in ``paged_kv_indices``.
    #[getter]
    fn paged_kv_indptr<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        arr(py, &self.plan.paged_kv_indptr)
    }
    /// int32: every request's pages, one request after the other.
    #[getter]
    fn paged_kv_indices<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        arr(py, &self.plan.paged_kv_indices)
    }
    /// int32 ``[B]``: keys in each request's last page, ``1..page_size``.
    #[getter]
    fn paged_kv_last_page_len<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        arr(py, &self.plan.paged_kv_last_page_len)
    }
    /// int64 ``[3T + 2B]``: ``input_ids``, ``positions``, ``write_slots``,
    /// ``last_token_index`` and ``kv_len`` back to back, in one array (what ``Step`` moves to
    /// the device in one copy).
    #[getter]
    fn longs<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        let p = &self.plan;
        let parts = [
            &p.input_ids[..],
            &p.positions[..],
            &p.write_slots[..],
            &p.last_token_index[..],
            &p.kv_len[..],
        ];
        PyArray1::from_vec(py, parts.concat())
    }
    /// int32: ``block_table`` (row-major), ``seq_lens``, ``qo_indptr``, ``paged_kv_indptr``,
    /// ``paged_kv_last_page_len`` and ``paged_kv_indices`` back to back, in one array.
    #[getter]
    fn ints<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        let p = &self.plan;
        let parts = [
            &p.block_table[..],
            &p.seq_lens[..],
            &p.qo_indptr[..],
            &p.paged_kv_indptr[..],
            &p.paged_kv_last_page_len[..],
            &p.paged_kv_indices[..],
        ];
        PyArray1::from_vec(py, parts.concat())
    }
    /// Requests in the step (B).
    #[getter]
    fn batch_size(&self) -> usize {
        self.plan.kv_len.len()
    }
    /// New tokens in the step (T).
    #[getter]
    fn num_tokens(&self) -> usize {
        self.plan.input_ids.len()
    }
    /// Columns of ``block_table``.
    #[getter]
    fn max_pages(&self) -> usize {
        self.plan.max_pages
    }
    /// Longest ``kv_len``.
    #[getter]
    fn max_kv_len(&self) -> usize {
        self.plan.max_kv_len
    }
    /// Longest query run.
    #[getter]
    fn max_q_len(&self) -> usize {
        self.plan.max_q_len
    }
    /// Raises ``StaleStepError`` unless every request of the step is as it was planned: open,
    /// with the same ``num_computed`` and ``num_tokens``. A stale step's slots may belong to
    /// pages published since (a commit) or handed to another request (a finish or abort):
    /// writing them would corrupt KV the cache serves. One call under the cache's mutex.
    fn check_current(&self, py: Python<'_>) -> PyResult<()> {
        let stamps = &self.stamps;
        match self.cache.get().with(py, false, |c| Ok(stale(c, stamps)))? {
            None => Ok(()),
            Some(msg) => Err(StaleStepError::new_err(msg)),
        }
    }
    fn __repr__(&self) -> String {
        format!(
            "StepPlan(batch_size={}, num_tokens={}, max_q_len={}, max_kv_len={}, max_pages={})",
            self.plan.kv_len.len(),
            self.plan.input_ids.len(),
            self.plan.max_q_len,
            self.plan.max_kv_len,
            self.plan.max_pages
        )
    }
}

/// Plans one step over ``requests`` (each a ``Request`` of one cache, ``cache`` when given,
/// each named once, each with tokens left to compute): a ``StepPlan``. The one place these are
/// checked: ``KVCache.plan`` passes its own cache.
#[pyfunction]
#[pyo3(signature = (requests, cache=None))]
fn plan_step<'py>(
    py: Python<'py>,
    requests: &Bound<'py, PyAny>,
    cache: Option<&Bound<'py, PyCache>>,
) -> PyResult<PyStepPlan> {
    let mut reqs: Vec<Bound<'py, PyRequest>> = Vec::new();
    for (i, r) in requests.try_iter()?.enumerate() {
        let r = r?;
        match r.downcast_into::<PyRequest>() {
            Ok(r) => reqs.push(r),
            Err(e) => {
                return Err(PyTypeError::new_err(format!(
                    "requests[{i}] must be a Request, got {}",
                    e.into_inner().get_type().name()?
                )))
            }
        }
    }
    let Some(first) = reqs.first() else {
        return Err(PyValueError::new_err(
            "requests must hold at least one request, got none",
        ));
    };
    let (cache, than): (Py<PyCache>, &str) = match cache {
        Some(c) => (c.clone().unbind(), "the cache planned for"),
        None => (first.get().cache.clone_ref(py), "requests[0]"),
    };
    let ids: Vec<_> = reqs.iter().map(|r| r.get().id).collect();
    let mut seen = std::collections::HashMap::new();
    for (i, r) in reqs.iter().enumerate() {
        if !r.get().cache.is(&cache) {
            // Its slots index another pool: writing them here would overwrite KV that cache
            // has published and still serves.
            return Err(PyValueError::new_err(format!(
                "requests[{i}] belongs to another cache than {than}"
            )));
        }
        if let Some(j) = seen.insert(r.get().id, i) {
            return Err(PyValueError::new_err(format!(
                "requests[{i}] repeats requests[{j}]: plan each request once"
            )));
        }
    }
    let (plan, stamps) = cache.get().with(py, false, |c| {
        let views = ids
            .iter()
            .map(|&id| c.request(id))
            .collect::<crate::Result<Vec<_>>>()?;
        let plan: StepPlan = plan_core(&views).map_err(|b| {
            crate::Error::InvalidArgument(format!(
                "requests[{b}] has no tokens left to compute (num_computed == num_tokens)"
            ))
        })?;
        let stamps = ids
            .iter()
            .zip(&views)
            .map(|(&id, r)| (id, r.num_computed, r.num_tokens()))
            .collect();
        Ok((plan, stamps))
    })?;
    Ok(PyStepPlan {
        plan,
        cache,
        stamps,
    })
}

/// What makes a step stale, or `None` when every request is as it was planned.
fn stale(c: &dyn PrefixCache, stamps: &[(RequestId, usize, usize)]) -> Option<String> {
    for (i, &(id, computed, tokens)) in stamps.iter().enumerate() {
        let Ok(r) = c.request(id) else {
            return Some(format!(
                "requests[{i}] was finished or aborted after the step was planned"
            ));
        };
        if r.num_computed != computed {
            return Some(format!(
                "requests[{i}] was committed after the step was planned (num_computed {computed} \
                 -> {})",
                r.num_computed
            ));
        }
        if r.num_tokens() != tokens {
            return Some(format!(
                "requests[{i}] was extended after the step was planned (num_tokens {tokens} -> {})",
                r.num_tokens()
            ));
        }
    }
    None
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyStepPlan>()?;
    m.add_function(wrap_pyfunction!(plan_step, m)?)
}
