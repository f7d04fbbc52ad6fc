//! The exception types and the one conversion of a core error into them.

use crate::error::Error as CoreError;
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyValueError};
use pyo3::prelude::*;

create_exception!(
    _radixkv,
    Error,
    PyException,
    "Base class of every radixkv error that is not a plain ValueError or TypeError."
);
create_exception!(_radixkv, OutOfPages, Error, "The pool cannot supply the pages a call needs, even after evicting every evictable page. Nothing was changed.");
create_exception!(_radixkv, CorruptionError, Error, "check() found a broken internal invariant (the message names it), or an internal error occurred.");
create_exception!(
    _radixkv,
    InvalidRequest,
    Error,
    "The request is closed (finished or aborted) or belongs to another cache."
);

create_exception!(
    _radixkv,
    StaleStepError,
    InvalidRequest,
    "A step was used after one of its requests was committed, extended, finished or aborted: plan a new step."
);

impl From<CoreError> for PyErr {
    fn from(e: CoreError) -> PyErr {
        let msg = e.to_string();
        match e {
            CoreError::InvalidArgument(_) => PyValueError::new_err(msg),
            CoreError::OutOfPages { .. } => OutOfPages::new_err(msg),
            CoreError::Corruption(_) => CorruptionError::new_err(msg),
            CoreError::ClosedRequest | CoreError::ForeignRequest => InvalidRequest::new_err(msg),
        }
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("Error", py.get_type::<Error>())?;
    m.add("OutOfPages", py.get_type::<OutOfPages>())?;
    m.add("CorruptionError", py.get_type::<CorruptionError>())?;
    m.add("InvalidRequest", py.get_type::<InvalidRequest>())?;
    m.add("StaleStepError", py.get_type::<StaleStepError>())?;
    Ok(())
}
