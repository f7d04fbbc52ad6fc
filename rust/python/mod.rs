//! The one PyO3 boundary: `radixkv._radixkv`.
//!
//! Calls are coarse (a whole admission, a whole step plan); token ids come in as buffers and page
//! tables go out as numpy arrays. Every cache call runs under the cache's mutex; calls on long
//! inputs release the GIL. Rule that keeps this deadlock-free: the mutex is never held while the
//! GIL is being acquired.
// pyo3's macros expand to FFI code that the crate-wide `unsafe_code = "deny"` would reject.
#![allow(unsafe_code)]

mod cache;
mod convert;
mod disk;
mod errors;
mod hashes;
mod indexes;
mod plan;
mod scheduler;
mod stats;

use pyo3::prelude::*;

#[pymodule]
fn _radixkv(m: &Bound<'_, PyModule>) -> PyResult<()> {
    errors::register(m)?;
    cache::register(m)?;
    indexes::register(m)?;
    hashes::register(m)?;
    stats::register(m)?;
    plan::register(m)?;
    scheduler::register(m)?;
    disk::register(m)?;
    Ok(())
}
