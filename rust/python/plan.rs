//! `plan_step`: the index arithmetic of one forward pass, as numpy arrays.

use super::cache::{PyCache, PyRequest};
use crate::plan::{plan_step as plan_core, StepPlan};
use numpy::{PyArray1, PyArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// Plans one step over ``requests`` (all of one cache, each named once, each with tokens left to
/// compute): a dict of numpy int64 arrays ``input_ids, positions, write_slots [T]``,
/// ``q_start [B+1]``, ``kv_len, last_token_index [B]``, ``kv_slots [B, max_kv_len]`` and ints
/// ``max_kv_len``, ``max_q_len``.
#[pyfunction]
fn plan_step<'py>(
    py: Python<'py>,
    requests: Vec<Bound<'py, PyRequest>>,
) -> PyResult<Bound<'py, PyDict>> {
    let Some(first) = requests.first() else {
        return Err(PyValueError::new_err(
            "requests must hold at least one request, got none",
        ));
    };
    let cache: Py<PyCache> = first.get().cache.clone_ref(py);
    let ids: Vec<_> = requests.iter().map(|r| r.get().id).collect();
    let mut seen = std::collections::HashMap::new();
    for (i, r) in requests.iter().enumerate() {
        if !r.get().cache.is(&cache) {
            return Err(PyValueError::new_err(format!(
                "requests[{i}] belongs to another cache than requests[0]"
            )));
        }
        if let Some(j) = seen.insert(r.get().id, i) {
            return Err(PyValueError::new_err(format!(
                "requests[{i}] repeats requests[{j}]: plan each request once"
            )));
        }
    }
    let plan: StepPlan = cache.get().with(py, false, |c| {
        let views = ids
            .iter()
            .map(|&id| c.request(id))
            .collect::<crate::Result<Vec<_>>>()?;
        plan_core(&views).map_err(|b| {
            crate::Error::InvalidArgument(format!(
                "requests[{b}] has no tokens left to compute (num_computed == num_tokens)"
            ))
        })
    })?;
    let d = PyDict::new(py);
    let b = ids.len();
    d.set_item("input_ids", PyArray1::from_vec(py, plan.input_ids))?;
    d.set_item("positions", PyArray1::from_vec(py, plan.positions))?;
    d.set_item("write_slots", PyArray1::from_vec(py, plan.write_slots))?;
    d.set_item("q_start", PyArray1::from_vec(py, plan.q_start))?;
    d.set_item("kv_len", PyArray1::from_vec(py, plan.kv_len))?;
    d.set_item(
        "last_token_index",
        PyArray1::from_vec(py, plan.last_token_index),
    )?;
    d.set_item(
        "kv_slots",
        PyArray1::from_vec(py, plan.kv_slots).reshape([b, plan.max_kv_len])?,
    )?;
    d.set_item("max_kv_len", plan.max_kv_len)?;
    d.set_item("max_q_len", plan.max_q_len)?;
    Ok(d)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(plan_step, m)?)
}
