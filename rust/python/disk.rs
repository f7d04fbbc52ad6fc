//! The disk tier's one function that must be fast and is not the index's: the checksum of a
//! page as it is written to and read from disk (see `docs/SEMANTICS.md`, "Disk tier").

use numpy::PyReadonlyArrayDyn;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

/// What a disk page's checksum covers: its block key and its bytes.
fn checksum(key: &[u8], data: &[u8]) -> [u8; 32] {
    let mut h = blake3::Hasher::new_derive_key("radixkv.disk.page.v1");
    h.update(&(key.len() as u32).to_le_bytes());
    h.update(key);
    h.update(data);
    *h.finalize().as_bytes()
}

/// The 32-byte checksum of a disk page: blake3 (derived key ``radixkv.disk.page.v1``) of the
/// page's block key (``key``, bytes) and its bytes (``data``: a C-contiguous uint8 numpy array,
/// or bytes). A page read back whose checksum differs from the one written beside it is torn,
/// corrupted or another page's, and is never served. Releases the GIL while hashing.
#[pyfunction]
fn _page_checksum<'py>(
    py: Python<'py>,
    key: &[u8],
    data: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyBytes>> {
    let sum = if let Ok(arr) = data.extract::<PyReadonlyArrayDyn<'py, u8>>() {
        let bytes = arr.as_slice().map_err(|_| {
            PyValueError::new_err("data must be a C-contiguous uint8 array, got a strided one")
        })?;
        py.allow_threads(|| checksum(key, bytes))
    } else if let Ok(b) = data.downcast::<PyBytes>() {
        let bytes = b.as_bytes();
        checksum(key, bytes)
    } else {
        return Err(PyValueError::new_err(format!(
            "data must be a C-contiguous uint8 numpy array or bytes, got {}",
            data.get_type().name()?
        )));
    };
    Ok(PyBytes::new(py, &sum))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(_page_checksum, m)?)?;
    Ok(())
}
