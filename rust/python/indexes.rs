//! `RadixCache` and `BlockCache`, the two index kinds of `Cache`, and the one constructor both
//! use: the Python signature is declared once, in `index_class!`, and the arguments are checked
//! once, in [`new_cache`].

use super::cache::PyCache;
use super::convert;
use crate::block::BlockIndex;
use crate::radix::RadixIndex;
use crate::{Cache, Index};
use pyo3::prelude::*;

/// A count argument that defaults to 0.
fn opt_count(name: &str, value: Option<&Bound<'_, PyAny>>) -> PyResult<usize> {
    match value {
        Some(v) if !v.is_none() => convert::count(name, v),
        _ => Ok(0),
    }
}

/// The arguments of `RadixCache(...)` and `BlockCache(...)`, as Python gave them.
struct CacheArgs<'a, 'py> {
    num_pages: &'a Bound<'py, PyAny>,
    page_size: Option<&'a Bound<'py, PyAny>>,
    host_pages: Option<&'a Bound<'py, PyAny>>,
    disk_pages: Option<&'a Bound<'py, PyAny>>,
    window: Option<&'a Bound<'py, PyAny>>,
    window_pages: Option<&'a Bound<'py, PyAny>>,
    window_host_pages: Option<&'a Bound<'py, PyAny>>,
    state_slots: Option<&'a Bound<'py, PyAny>>,
}

/// A new cache over index `I`, named `kind` in messages: the arguments checked (`page_size`
/// defaulting to `default_page_size`, the counts, `state_slots` among them, to 0,
/// `window_host_pages` to `host_pages` when there is a window group), then built by the core,
/// which names a zero or a too-large value (a value past 64 bits is named here).
fn new_cache<I: Index + 'static>(
    kind: &'static str,
    default_page_size: usize,
    args: CacheArgs<'_, '_>,
) -> PyResult<PyCache> {
    let disk_pages = opt_count("disk_pages", args.disk_pages)?;
    let state_slots = opt_count("state_slots", args.state_slots)?;
    let window_host_pages = match args.window_host_pages {
        Some(v) if !v.is_none() => Some(convert::count("window_host_pages", v)?),
        _ => None,
    };
    let window = opt_count("window", args.window)?;
    let window_pages = opt_count("window_pages", args.window_pages)?;
    let num_pages = convert::count("num_pages", args.num_pages)?;
    let page_size = match args.page_size {
        Some(p) => convert::count("page_size", p)?,
        None => default_page_size,
    };
    let host_pages = opt_count("host_pages", args.host_pages)?;
    let windowed = window > 0 || window_pages > 0;
    let window_host_pages = window_host_pages.unwrap_or(if windowed { host_pages } else { 0 });
    let core = Cache::<I>::with_groups(
        num_pages,
        page_size,
        host_pages,
        disk_pages,
        window,
        window_pages,
        window_host_pages,
    )?
    .with_state_slots(state_slots)?;
    Ok(PyCache::from_core(Box::new(core), kind))
}

/// A `Cache` subclass over one index kind, whose `__new__` is [`new_cache`]: the Python name,
/// the index, the default `page_size` and the text signature that shows it.
macro_rules! index_class {
    (
        $(#[$doc:meta])*
        $class:ident($name:tt, $index:ty, page_size = $page_size:tt, $text_signature:tt)
    ) => {
        $(#[$doc])*
        #[pyclass(name = $name, module = "radixkv._radixkv", extends = PyCache, frozen)]
        pub struct $class;

        #[pymethods]
        impl $class {
            #[new]
            #[allow(clippy::too_many_arguments)]
            #[pyo3(
                signature = (num_pages, page_size=None, host_pages=None, disk_pages=None, *, window=None, window_pages=None, window_host_pages=None, state_slots=None),
                text_signature = $text_signature
            )]
            fn new(
                num_pages: &Bound<'_, PyAny>,
                page_size: Option<&Bound<'_, PyAny>>,
                host_pages: Option<&Bound<'_, PyAny>>,
                disk_pages: Option<&Bound<'_, PyAny>>,
                window: Option<&Bound<'_, PyAny>>,
                window_pages: Option<&Bound<'_, PyAny>>,
                window_host_pages: Option<&Bound<'_, PyAny>>,
                state_slots: Option<&Bound<'_, PyAny>>,
            ) -> PyResult<PyClassInitializer<Self>> {
                let args = CacheArgs {
                    num_pages,
                    page_size,
                    host_pages,
                    disk_pages,
                    window,
                    window_pages,
                    window_host_pages,
                    state_slots,
                };
                let base = new_cache::<$index>($name, $page_size, args)?;
                Ok(PyClassInitializer::from(base).add_subclass($class))
            }
        }
    };
}

index_class!(
    /// A prefix cache indexed by a compressed radix tree over token ids (SGLang RadixAttention
    /// style): token-exact reuse at ``page_size=1``; least recently used leaves are evicted first.
    PyRadixCache("RadixCache", RadixIndex, page_size = 1,
        "(num_pages, page_size=1, host_pages=0, disk_pages=0, *, window=0, window_pages=0, window_host_pages=None, state_slots=0)")
);

index_class!(
    /// A prefix cache indexed by chained block hashes (vLLM Automatic Prefix Caching style): full
    /// pages only; least recently used pages are evicted first, a chain's tail before its head.
    PyBlockCache("BlockCache", BlockIndex, page_size = 16,
        "(num_pages, page_size=16, host_pages=0, disk_pages=0, *, window=0, window_pages=0, window_host_pages=None, state_slots=0)")
);

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyRadixCache>()?;
    m.add_class::<PyBlockCache>()?;
    Ok(())
}
