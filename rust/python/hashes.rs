//! Block hashes: the keys `BlockCache` uses, and vLLM's `sha256_cbor` ones for routers that index
//! vLLM workers.

use super::convert;
use crate::wire::hash;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

/// vLLM's ``sha256_cbor`` block hashes of every full page of ``tokens``, the first chained
/// from the 32-byte ``parent`` (vLLM's ``NONE_HASH`` for ``PYTHONHASHSEED=seed`` when None)
/// and salted with ``salt`` (str or bytes, None for none): the one implementation, which
/// ``radixkv.events`` uses too.
#[pyfunction]
#[pyo3(signature = (parent, tokens, page_size, salt=None, seed="0"))]
fn _sha256_cbor_chain<'py>(
    py: Python<'py>,
    parent: Option<&[u8]>,
    tokens: &Bound<'py, PyAny>,
    page_size: &Bound<'py, PyAny>,
    salt: Option<&Bound<'py, PyAny>>,
    seed: &str,
) -> PyResult<Vec<Bound<'py, PyBytes>>> {
    let page_size = convert::count("page_size", page_size)?;
    crate::cache::check_pool_args(1, page_size)?;
    let prev: hash::BlockHash = match parent {
        None => hash::sha256_cbor::none_hash(seed),
        Some(p) => p.try_into().map_err(|_| {
            PyValueError::new_err(format!("parent must be 32 bytes, got {}", p.len()))
        })?,
    };
    let toks = convert::tokens("tokens", tokens)?;
    let salt = convert::namespace(salt)?;
    let hashes = hash::sha256_cbor::chain(prev, &toks, page_size, salt.as_deref());
    Ok(hashes.iter().map(|h| PyBytes::new(py, h)).collect())
}

/// vLLM's ``NONE_HASH`` for ``PYTHONHASHSEED=seed``: ``sha256(cbor(seed))``.
#[pyfunction]
fn _sha256_cbor_none_hash<'py>(py: Python<'py>, seed: &str) -> Bound<'py, PyBytes> {
    PyBytes::new(py, &hash::sha256_cbor::none_hash(seed))
}

/// Block hashes of every full page of ``tokens``, 32 bytes each.
///
/// ``algorithm="blake3"``: the keys ``BlockCache`` uses (spec ``radixkv.block.v1`` in the
/// design). ``algorithm="sha256_cbor"``: vLLM's default block hashes (sha256 over canonical CBOR
/// of ``(parent_hash, token_ids, extra_keys)``), the first block chained from vLLM's
/// ``NONE_HASH`` for ``PYTHONHASHSEED=hash_seed`` and salted with ``namespace`` as vLLM salts
/// with ``cache_salt``; ``hash_seed`` is used by ``sha256_cbor`` only (another seed with
/// ``blake3`` raises ``ValueError``).
#[pyfunction]
#[pyo3(
    signature = (tokens, page_size=None, namespace=None, algorithm="blake3", hash_seed="0"),
    text_signature = "(tokens, page_size=16, namespace=None, algorithm='blake3', hash_seed='0')"
)]
fn block_hashes<'py>(
    py: Python<'py>,
    tokens: &Bound<'py, PyAny>,
    page_size: Option<&Bound<'py, PyAny>>,
    namespace: Option<&Bound<'py, PyAny>>,
    algorithm: &str,
    hash_seed: &str,
) -> PyResult<Vec<Bound<'py, PyBytes>>> {
    let page_size = match page_size {
        Some(p) => convert::count("page_size", p)?,
        None => 16,
    };
    crate::cache::check_pool_args(1, page_size)?;
    let sha = match algorithm {
        "blake3" if hash_seed != "0" => {
            return Err(PyValueError::new_err(format!(
                "hash_seed='{hash_seed}' has no effect with algorithm='blake3' (blake3 block keys \
                 take no seed): it seeds algorithm='sha256_cbor' only"
            )))
        }
        "blake3" => false,
        "sha256_cbor" => true,
        other => {
            return Err(PyValueError::new_err(format!(
                "algorithm must be 'blake3' or 'sha256_cbor', got '{other}'"
            )))
        }
    };
    let toks = convert::tokens("tokens", tokens)?;
    let ns = convert::namespace(namespace)?;
    let hashes = py.allow_threads(|| {
        if sha {
            hash::sha256_cbor::block_hashes(&toks, page_size, &ns, hash_seed)
        } else {
            hash::block_hashes(&toks, page_size, &ns)
        }
    });
    Ok(hashes.iter().map(|h| PyBytes::new(py, h)).collect())
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(block_hashes, m)?)?;
    m.add_function(wrap_pyfunction!(_sha256_cbor_chain, m)?)?;
    m.add_function(wrap_pyfunction!(_sha256_cbor_none_hash, m)?)?;
    Ok(())
}
