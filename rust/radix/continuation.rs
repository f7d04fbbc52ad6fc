//! What the tree holds after a sequence: the drafts of speculative decoding read from the cache.
//!
//! ```text
//!   roots[ns] ── "prompt ....|reply of an earlier try ...|" ── ...
//!                 tokens ──────────────^ here: the draft is the rest of this edge, then the
//!                                        most recently used child's, up to `max` tokens
//! ```
//!
//! Read-only: nothing is pinned, no clock or LRU position moves. A walk starts at the namespace's
//! own root, so a continuation never holds another namespace's tokens.

use super::{Node, NodeId, RadixIndex};
use crate::arena::compare::common_prefix;
use crate::wire::hash::Namespace;

impl RadixIndex {
    /// The most recently used child of `node` that `keep` accepts (ties: the higher id, so
    /// the choice never depends on the child map's order).
    fn latest_child(&self, node: NodeId, keep: impl Fn(&Node) -> bool) -> Option<NodeId> {
        let children = self.node(node).children.values().copied();
        children
            .filter(|&c| keep(self.node(c)))
            .max_by_key(|&c| (self.node(c).time, c.0))
    }

    /// Up to `max` tokens cached after `tokens` in `namespace`: walks `tokens` down the
    /// namespace's tree (a hash probe per edge, as a lookup), then follows the most recently
    /// used child from where they end.
    pub(super) fn continue_after(
        &self,
        tokens: &[u32],
        namespace: &Namespace,
        max: usize,
    ) -> Vec<u32> {
        let mut out = Vec::new();
        let Some(&root) = self.roots.get(namespace) else {
            return out;
        };
        let p = self.page_size;
        let (mut node, mut pos) = (root, 0);
        // `(edge, offset)`: where `tokens` end inside an edge, or None at a node.
        let mut at = loop {
            let rest = &tokens[pos..];
            if rest.len() < p {
                break None;
            }
            let Some(c) = self.child(node, &rest[..p]) else {
                return out;
            };
            let key = &self.node(c).key;
            let common = common_prefix(key, rest);
            if common == key.len() {
                (node, pos) = (c, pos + common);
            } else if common == rest.len() {
                break Some((c, common));
            } else {
                return out; // the cached sequence goes another way
            }
        };
        if at.is_none() {
            // Less than a page left: the children are keyed by whole pages, so compare each.
            let rest = &tokens[pos..];
            at = self
                .latest_child(node, |c| c.key.starts_with(rest))
                .map(|c| (c, rest.len()));
        }
        while let Some((c, from)) = at {
            let key = &self.node(c).key;
            let take = (max - out.len()).min(key.len() - from);
            out.extend_from_slice(&key[from..from + take]);
            if out.len() >= max {
                break;
            }
            at = self.latest_child(c, |_| true).map(|c| (c, 0));
        }
        out
    }
}
