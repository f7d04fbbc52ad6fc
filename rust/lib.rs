//! radixkv: a prefix cache for LLM key/value pages.
//!
//! The core is pure Rust and knows nothing of tensors or Python. It manages a fixed pool of
//! `num_pages` physical pages of `page_size` tokens and decides, for every request, which pages
//! already hold the KV of its prefix and which pages its new tokens are written to. Two indexes
//! sit behind one trait, [`PrefixCache`]:
//!
//! - [`RadixCache`]: a compressed radix tree over token ids (SGLang's RadixAttention style),
//!   evicting the least recently used leaf first.
//! - [`BlockCache`]: a map from chained block hash to page (vLLM's Automatic Prefix Caching
//!   style), evicting the least recently used page first.
//!
//! The PyO3 glue lives in [`python`] behind the `python` cargo feature.

pub mod block;
pub mod cache;
pub mod error;
pub mod freeset;
pub mod hash;
pub mod links;
pub mod plan;
pub mod radix;
pub mod request;
pub mod scheduler;
pub mod stats;
pub mod waiting;

#[cfg(feature = "python")]
pub mod python;

pub use block::BlockCache;
pub use cache::{Cursor, Namespace, PrefixCache, RequestView};
pub use error::{Error, Result};
pub use radix::RadixCache;
pub use request::RequestId;
pub use scheduler::{Admitted, Policy, Scheduler};
pub use stats::CacheStats;
