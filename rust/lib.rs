//! radixkv: a prefix cache for LLM key/value pages.
//!
//! The core is pure Rust and knows nothing of tensors or Python. It manages a fixed pool of
//! `num_pages` physical pages of `page_size` tokens and decides, for every request, which pages
//! already hold the KV of its prefix and which pages its new tokens are written to.
//!
//! The request life cycle is written once, in [`Cache`], over an index that answers only how
//! prefixes are found, pinned, published and evicted (the `Index` trait in `cache/index.rs`). Two
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
//! The folders are the layers, each using only those above it in this picture:
//!
//! ```text
//!   error                 the one error type
//!   arena/                ids, intrusive links, table hashing: storage with no cache policy
//!   wire/                 formats read outside the crate: block hashes (with namespaces), events
//!   cache/                the request life cycle and the contract an index fulfils: Cache<I>,
//!                         Index, requests, stats, the host tier's copy log, the state digest
//!   radix/   block/       the two indexes, each with its invariant checker and private tables
//!   sched/                the cache-aware scheduler and its waiting trie
//!   plan                  step plans over live requests
//!   python/               the one PyO3 boundary
//! ```

mod arena;
mod block;
mod cache;
mod error;
mod plan;
mod radix;
mod sched;
mod wire;

#[cfg(feature = "python")]
mod python;

pub use arena::ids::PageId;
pub use block::BlockCache;
pub use cache::index::{Cursor, Index, CLASSES};
pub use cache::request::{RequestId, RequestView};
pub use cache::stats::CacheStats;
pub use cache::tier::{CopyKind, PageCopy};
pub use cache::{Cache, DiskFetch, PrefixCache};
pub use error::{Error, Result};
pub use plan::{plan_step, StepPlan};
pub use radix::RadixCache;
pub use sched::{Admitted, Policy, Scheduler};
pub use wire::events::CacheEvent;
pub use wire::hash::{block_hashes, sha256_cbor, BlockHash, Namespace};
