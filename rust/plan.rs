//! Index arithmetic of one forward pass: what the torch layer needs to pack a batch.
//!
//! For each request `b` the step computes its new tokens `num_computed..num_tokens`:
//!
//! ```text
//!   request b:   [ cached / computed KV ........ | new tokens (queries) ]
//!                0                        num_computed             num_tokens = kv_len[b]
//!   packed rows: q_start[b] .. q_start[b + 1]  (T rows in all)
//! ```
//!
//! A query at absolute position `pos` attends to keys `0..=pos` of its own request, which is the
//! bottom-right aligned causal mask when a request has a cached prefix.
//!
//! Keys are described by page tables, never by a slot per key: `block_table` (row `b` starts with
//! request `b`'s pages, as vLLM's `block_table`) and the same pages in FlashInfer's CSR form
//! (`paged_kv_indptr`, `paged_kv_indices`, `paged_kv_last_page_len`). Page ids, lengths and
//! offsets are `i32` there, as attention kernels take them; a backend that wants one slot per key
//! derives it (`block_table[b, i / P] * P + i % P`).

use crate::cache::request::RequestView;

/// Everything a step's layers share, as flat arrays (lengths in the field docs).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepPlan {
    /// `[T]` token ids of the new tokens, packed request after request.
    pub input_ids: Vec<i64>,
    /// `[T]` absolute positions.
    pub positions: Vec<i64>,
    /// `[T]` slot each new token's K/V is written to.
    pub write_slots: Vec<i64>,
    /// `[B + 1]` row offsets of each request's queries in the packed batch.
    pub q_start: Vec<i64>,
    /// `[B]` keys each request attends to (its `num_tokens`).
    pub kv_len: Vec<i64>,
    /// `[B]` packed row of each request's last token.
    pub last_token_index: Vec<i64>,
    /// `[B, max_pages]` row-major: request `b`'s pages (`ceil(kv_len[b] / P)` of them), then
    /// padding with page 0.
    pub block_table: Vec<i32>,
    /// Columns of `block_table`: the most pages any request attends to.
    pub max_pages: usize,
    /// `[B]` keys each request attends to (`kv_len` as `i32`).
    pub seq_lens: Vec<i32>,
    /// `[B + 1]` query offsets (`q_start` as `i32`).
    pub qo_indptr: Vec<i32>,
    /// `[B + 1]` offsets of each request's pages in `paged_kv_indices`.
    pub paged_kv_indptr: Vec<i32>,
    /// Every request's pages, one request after the other.
    pub paged_kv_indices: Vec<i32>,
    /// `[B]` keys in each request's last page, `1..=P`.
    pub paged_kv_last_page_len: Vec<i32>,
    /// Longest `kv_len`.
    pub max_kv_len: usize,
    /// Longest query run (`q_start[b + 1] - q_start[b]`).
    pub max_q_len: usize,
    /// With a window group (else empty): `[T]` slot each new token's K/V is written to in the
    /// window layers' pool.
    pub window_write_slots: Vec<i64>,
    /// With a window group (else empty): `[B, max_pages]` like `block_table`, of window pages;
    /// a released page (which no query of the step reads) and the padding are page 0.
    pub window_block_table: Vec<i32>,
}

/// Plans a step over `requests`, each of which must have at least one token left to compute.
/// Returns the index of the first request with nothing to compute as an error.
pub fn plan_step(requests: &[RequestView<'_>]) -> std::result::Result<StepPlan, usize> {
    let mut s = StepPlan {
        q_start: vec![0],
        qo_indptr: vec![0],
        paged_kv_indptr: vec![0],
        ..StepPlan::default()
    };
    for (b, r) in requests.iter().enumerate() {
        let (start, end) = (r.num_computed, r.num_tokens());
        if start >= end {
            return Err(b);
        }
        s.input_ids
            .extend(r.tokens[start..end].iter().map(|&t| t as i64));
        s.positions.extend(start as i64..end as i64);
        r.extend_slots(start, end, &mut s.write_slots);
        if !r.window_pages.is_empty() {
            let p = r.page_size as i64;
            s.window_write_slots
                .extend((start..end).map(|i| {
                    r.window_pages[i / r.page_size] as i64 * p + (i % r.page_size) as i64
                }));
        }
        s.q_start.push(s.input_ids.len() as i64);
        s.kv_len.push(end as i64);
        s.last_token_index.push(s.input_ids.len() as i64 - 1);
        s.max_kv_len = s.max_kv_len.max(end);
        s.max_q_len = s.max_q_len.max(end - start);
        s.seq_lens.push(end as i32);
        s.qo_indptr.push(s.input_ids.len() as i32);
        let pages = end.div_ceil(r.page_size);
        s.paged_kv_indices
            .extend(r.pages[..pages].iter().map(|p| p.0 as i32));
        s.paged_kv_indptr.push(s.paged_kv_indices.len() as i32);
        s.paged_kv_last_page_len
            .push((end - (pages - 1) * r.page_size) as i32);
        s.max_pages = s.max_pages.max(pages);
    }
    s.block_table.reserve(requests.len() * s.max_pages);
    for b in 0..requests.len() {
        let (lo, hi) = (
            s.paged_kv_indptr[b] as usize,
            s.paged_kv_indptr[b + 1] as usize,
        );
        s.block_table.extend_from_slice(&s.paged_kv_indices[lo..hi]);
        s.block_table
            .resize(s.block_table.len() + s.max_pages - (hi - lo), 0);
        let w = requests[b].window_pages;
        if !w.is_empty() {
            let row = &w[..hi - lo];
            s.window_block_table.extend(row.iter().map(|&x| {
                if x == crate::cache::request::GONE {
                    0
                } else {
                    x as i32
                }
            }));
            s.window_block_table
                .resize(s.window_block_table.len() + s.max_pages - (hi - lo), 0);
        }
    }
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arena::ids::PageId;

    #[test]
    fn packs_suffixes_and_pads_slots() {
        let ns = None;
        let a = RequestView {
            tokens: &[5, 6, 7, 8, 9],
            namespace: &ns,
            pages: &[PageId(3), PageId(1), PageId(4)],
            num_cached: 2,
            num_computed: 2,
            page_size: 2,
            window_pages: &[],
            kv_matched: 0,
            state_slot: None,
        };
        let b = RequestView {
            tokens: &[1, 2],
            namespace: &ns,
            pages: &[PageId(0)],
            num_cached: 0,
            num_computed: 1,
            page_size: 2,
            window_pages: &[],
            kv_matched: 0,
            state_slot: None,
        };
        let s = plan_step(&[a, b]).unwrap();
        assert_eq!(s.input_ids, vec![7, 8, 9, 2]);
        assert_eq!(s.positions, vec![2, 3, 4, 1]);
        assert_eq!(s.write_slots, vec![2, 3, 8, 1]);
        assert_eq!(s.q_start, vec![0, 3, 4]);
        assert_eq!(s.kv_len, vec![5, 2]);
        assert_eq!(s.last_token_index, vec![2, 3]);
        assert_eq!(s.block_table, vec![3, 1, 4, 0, 0, 0]);
        assert_eq!(s.max_pages, 3);
        assert_eq!(s.seq_lens, vec![5, 2]);
        assert_eq!(s.qo_indptr, vec![0, 3, 4]);
        assert_eq!(s.paged_kv_indptr, vec![0, 3, 4]);
        assert_eq!(s.paged_kv_indices, vec![3, 1, 4, 0]);
        assert_eq!(s.paged_kv_last_page_len, vec![1, 2]);
        assert_eq!((s.max_kv_len, s.max_q_len), (5, 3));
        let done = RequestView {
            num_computed: 2,
            ..b
        };
        assert_eq!(plan_step(&[a, done]), Err(1));
    }
}
