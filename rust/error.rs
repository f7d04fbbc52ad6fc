//! The one error type of the core. The Python glue maps each variant to one exception class.

use std::fmt;

/// Everything that can go wrong in a cache call. No variant is returned after a partial change:
/// a call that fails leaves the cache exactly as it was.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// A malformed argument; the message names the argument and the bad value.
    InvalidArgument(String),
    /// The pool cannot supply `needed` pages even after evicting every evictable page.
    OutOfPages {
        /// Pages the call needed.
        needed: usize,
        /// Pages that were free or evictable (and not pinned by the call itself).
        available: usize,
    },
    /// `check()` found a broken invariant; the message names it.
    Corruption(String),
    /// The request was finished or aborted already.
    ClosedRequest,
    /// The request belongs to another cache.
    ForeignRequest,
}

/// Result alias of the core.
pub type Result<T> = std::result::Result<T, Error>;

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::InvalidArgument(msg) => f.write_str(msg),
            Error::OutOfPages { needed, available } => write!(
                f,
                "out of pages: needs {needed} pages, only {available} are free or evictable"
            ),
            Error::Corruption(msg) => write!(f, "cache invariant broken: {msg}"),
            Error::ClosedRequest => f.write_str("the request is closed (finished or aborted)"),
            Error::ForeignRequest => f.write_str("the request belongs to another cache"),
        }
    }
}

impl std::error::Error for Error {}

/// Shorthand for an [`Error::InvalidArgument`].
pub(crate) fn invalid(msg: impl Into<String>) -> Error {
    Error::InvalidArgument(msg.into())
}

/// Shorthand for an [`Error::Corruption`] result.
pub(crate) fn corrupt<T>(msg: impl Into<String>) -> Result<T> {
    Err(Error::Corruption(msg.into()))
}

/// An empty vector with room for `len` elements, or an error naming the size when the
/// allocation fails (instead of aborting the process). Nothing is written yet.
pub(crate) fn try_with_capacity<T>(len: usize) -> Result<Vec<T>> {
    let mut v = Vec::new();
    if v.try_reserve_exact(len).is_err() {
        let bytes = (len as u128) * std::mem::size_of::<T>() as u128;
        return Err(invalid(format!(
            "cannot allocate {len} page records ({bytes} bytes)"
        )));
    }
    Ok(v)
}

/// A vector of `len` copies of `value`, or an error naming the size when the allocation fails
/// (instead of aborting the process, as `vec![value; len]` does).
pub(crate) fn try_vec<T: Clone>(len: usize, value: T) -> Result<Vec<T>> {
    let mut v = try_with_capacity(len)?;
    v.resize(len, value);
    Ok(v)
}
