//! `CacheStats` as a Python class: a read-only property per counter, `as_dict`, `__eq__` and
//! `__repr__`, all generated from the one field list below, where each counter is declared once,
//! with its doc.

use crate::cache::stats::CacheStats;
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// A snapshot of a cache's page states and hit counters. Always
/// ``free_pages + evictable_pages + used_pages == num_pages``.
#[pyclass(name = "CacheStats", module = "radixkv._radixkv", frozen)]
pub struct PyCacheStats(pub(super) CacheStats);

/// A counter as `__repr__` shows it: an int in full, a rate to 4 decimals.
trait Shown {
    fn shown(&self) -> String;
}

impl Shown for usize {
    fn shown(&self) -> String {
        self.to_string()
    }
}

impl Shown for u64 {
    fn shown(&self) -> String {
        self.to_string()
    }
}

impl Shown for f64 {
    fn shown(&self) -> String {
        format!("{self:.4}")
    }
}

/// The pymethods of `PyCacheStats` from its counters, in groups: `[always] { .. }`, or
/// `[a || b] { .. }` for a group `__repr__` shows only while one of `a`, `b` is not 0 (a tier the
/// cache does not have stays out of sight). A counter is `name: type`, the core field of that
/// name, or `name: type = method()` for one the core computes. The order is the order of
/// `as_dict` and `__repr__`.
macro_rules! stats_class {
    (@value $s:ident, $name:ident) => { $s.$name };
    (@value $s:ident, $name:ident, $method:ident) => { $s.$method() };
    (@shown $s:ident; always) => { true };
    (@shown $s:ident; $($key:ident)||+) => { $($s.$key != 0)||+ };
    ($(
        [$($when:tt)+] {
            $( $(#[$doc:meta])* $name:ident: $ty:ty $(= $method:ident())?, )+
        }
    )+) => {
        #[pymethods]
        impl PyCacheStats {
            $($(
                $(#[$doc])*
                #[getter]
                fn $name(&self) -> $ty {
                    let s = &self.0;
                    stats_class!(@value s, $name $(, $method)?)
                }
            )+)+

            /// The fields as a dict.
            fn as_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
                let d = PyDict::new(py);
                let s = &self.0;
                $($(
                    d.set_item(stringify!($name), stats_class!(@value s, $name $(, $method)?))?;
                )+)+
                Ok(d)
            }

            fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
                other
                    .downcast::<PyCacheStats>()
                    .is_ok_and(|o| o.get().0 == self.0)
            }

            fn __repr__(&self) -> String {
                let s = &self.0;
                let mut fields: Vec<String> = Vec::new();
                $(
                    if stats_class!(@shown s; $($when)+) {
                        $(
                            let value = stats_class!(@value s, $name $(, $method)?);
                            fields.push(format!("{}={}", stringify!($name), value.shown()));
                        )+
                    }
                )+
                format!("CacheStats({})", fields.join(", "))
            }
        }
    };
}

stats_class! {
    [always] {
        /// Physical pages in the pool.
        num_pages: usize,
        /// Tokens per page.
        page_size: usize,
        /// Pages holding nothing.
        free_pages: usize,
        /// Pages holding published KV that no live request uses.
        evictable_pages: usize,
        /// Pages pinned by at least one live request.
        used_pages: usize,
        /// Admissions (``admit`` and ``fork``) so far.
        queries: u64,
        /// Tokens of those admissions.
        query_tokens: u64,
        /// Tokens served from the cache at admission.
        hit_tokens: u64,
        /// ``hit_tokens / query_tokens`` (0.0 before any query).
        hit_rate: f64 = hit_rate(),
        /// Device pages evicted so far (to the host tier or not).
        evicted_pages: u64,
    }
    [host_pages] {
        /// Pages of the host tier (0: none).
        host_pages: usize,
        /// Host pages holding nothing.
        host_free_pages: usize,
        /// Of ``hit_tokens``, those served from the host tier.
        host_hit_tokens: u64,
        /// Pages moved from the device to the host tier so far.
        offloaded_pages: u64,
        /// Pages moved from the host tier back to the device so far.
        loaded_pages: u64,
        /// Host pages dropped so far (to make room, or by ``reset``).
        host_evicted_pages: u64,
    }
    [retentions || forced_evictions || expired_retentions] {
        /// Retentions live now.
        retentions: usize,
        /// Device pages evicted while retained (nothing else was left to evict), so far.
        forced_evictions: u64,
        /// Retentions that expired, so far.
        expired_retentions: u64,
    }
    [disk_pages] {
        /// Slots of the disk tier (0: none).
        disk_pages: usize,
        /// Disk slots holding nothing.
        disk_free_pages: usize,
        /// Pages written to the disk tier so far (dropped by the host tier, or persisted).
        disk_written_pages: u64,
        /// Pages read back from the disk tier into the host tier so far.
        disk_fetched_pages: u64,
        /// Disk pages dropped so far (to make room, or by ``reset``).
        disk_evicted_pages: u64,
        /// Disk pages found torn or corrupted when read back (dropped, never served).
        disk_bad_pages: u64,
    }
    [window_pages] {
        /// Tokens a sliding-window layer's query reads (0: no window group).
        window: usize,
        /// Pages of the window group's pool (0: none).
        window_pages: usize,
        /// Window pages holding nothing.
        window_free_pages: usize,
        /// Cached window pages no live request holds (dropped first when the group needs room).
        window_evictable_pages: usize,
        /// Admissions whose hit a window cut short (the full pages went further, the window pages
        /// of the longer prefix were gone).
        window_cut_hits: u64,
        /// Tokens those admissions recomputed because of the cut.
        window_cut_tokens: u64,
        /// Cached window pages dropped so far (to make room, or by ``reset``).
        window_evicted_pages: u64,
        /// Window pages on the window host tier now.
        window_host_used_pages: usize,
        /// Window pages moved to the window host tier so far.
        window_offloaded_pages: u64,
        /// Window pages moved back from the window host tier so far (each for a hit).
        window_loaded_pages: u64,
    }
    [state_slots] {
        /// State slots: snapshots of a hybrid model's recurrent state the cache keeps (0: none).
        state_slots: usize,
        /// State slots holding nothing.
        state_free_slots: usize,
        /// State slots whose snapshot a live request's hit pins (not copied yet).
        state_pinned_slots: usize,
        /// Of ``hit_tokens``, those whose hit ended at a snapshot (all of them with state slots).
        state_hit_tokens: u64,
        /// Snapshots taken so far (slots handed out by ``take_state``).
        taken_states: u64,
        /// Snapshots evicted so far: for their slot, or with a page they needed.
        evicted_states: u64,
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyCacheStats>()
}
