//! radixkv: a prefix cache for LLM key/value pages.
//!
//! The core is pure Rust and knows nothing of tensors or Python. It manages a fixed pool of
//! `num_pages` physical pages of `page_size` tokens and decides, for every request, which pages
//! already hold the KV of its prefix and which pages its new tokens are written to.
//!
//! The request life cycle is written once, in [`Cache`], over an index that answers only how
//! prefixes are found, pinned, published and evicted (the `Index` trait in `index.rs`). Two
//! indexes implement it:
//!
//! - [`RadixCache`]: a compressed radix tree over token ids (SGLang's RadixAttention style),
//!   evicting the least recently used leaf first.
//! - [`BlockCache`]: a map from chained block hash to page (vLLM's Automatic Prefix Caching
//!   style), evicting the least recently used page first.
//!
//! [`Scheduler`] admits waiting requests into either in a cache-aware order. The PyO3 glue lives
//! in `python/` behind the `python` cargo feature.
//!
//! ```text
//!   error  ids  stats  hash  links  freeset  table_hash  page_table  page_records   (leaves)
//!   events (what a cache records for routers, when asked to)
//!   request ── index ── cache ──┬── radix
//!                               ├── block
//!                               └── scheduler ── waiting
//!   tier (the host tier's copy log, shared by both indexes)
//!   plan (step plans)           python (the boundary)
//! ```

mod block;
mod cache;
mod error;
mod events;
mod freeset;
mod hash;
mod ids;
mod index;
mod links;
mod page_records;
mod page_table;
mod plan;
mod radix;
mod request;
mod scheduler;
mod stats;
mod table_hash;
mod tier;
mod waiting;

#[cfg(feature = "python")]
mod python;

pub use block::BlockCache;
pub use cache::{Cache, PrefixCache};
pub use error::{Error, Result};
pub use events::CacheEvent;
pub use hash::{block_hashes, sha256_cbor, BlockHash};
pub use ids::PageId;
pub use index::{Cursor, Index};
pub use plan::{plan_step, StepPlan};
pub use radix::RadixCache;
pub use request::{Namespace, RequestId, RequestView};
pub use scheduler::{Admitted, Policy, Scheduler};
pub use stats::CacheStats;
pub use tier::{CopyKind, PageCopy};
