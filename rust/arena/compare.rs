//! Token compares on the hit paths, without a libc call per few tokens: `common_prefix`, the
//! radix tree's (a hit compares the whole prompt with the keys of the path it matches), and
//! `differ`, the block index's check of a page record.

/// Nonzero when `a` and `b` (of equal length) differ anywhere: an or of xors, branch-free and
/// vectorised. A slice `==` compiles to a memcmp call, which costs more than the compare itself
/// for the 64-256 bytes these see.
#[inline]
pub(crate) fn differ(a: &[u32], b: &[u32]) -> u32 {
    debug_assert_eq!(a.len(), b.len());
    a.iter().zip(b).fold(0, |acc, (x, y)| acc | (x ^ y))
}

/// First `n` such that `a[n] != b[n]` (or the shorter length): 4 KiB blocks by memcmp, then
/// 64-token chunks by [`differ`], then single tokens.
/// Comparing 128-byte chunks by memcmp, as this did before, paid a call per chunk: half the
/// time of a 32k radix hit.
pub(crate) fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    const BLOCK: usize = 1024;
    const CHUNK: usize = 64;
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut i = 0;
    while i + BLOCK <= n && a[i..i + BLOCK] == b[i..i + BLOCK] {
        i += BLOCK;
    }
    let (a, b) = (&a[i..], &b[i..]);
    let mut j = 0;
    for (x, y) in a.chunks_exact(CHUNK).zip(b.chunks_exact(CHUNK)) {
        if differ(x, y) != 0 {
            break;
        }
        j += CHUNK;
    }
    i + j
        + a[j..]
            .iter()
            .zip(&b[j..])
            .take_while(|(p, q)| p == q)
            .count()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The blocked compare finds the first difference wherever it falls: in a memcmp block, in
    /// a 64-token chunk after whole blocks, in the tail, or nowhere, for either order and for
    /// unequal lengths.
    #[test]
    fn common_prefix_finds_the_first_difference() {
        let naive = |a: &[u32], b: &[u32]| a.iter().zip(b).take_while(|(x, y)| x == y).count();
        for n in [0, 1, 63, 64, 65, 1023, 1024, 1025, 2100, 4097] {
            let a: Vec<u32> = (0..n as u32)
                .map(|t| t.wrapping_mul(2_654_435_761))
                .collect();
            assert_eq!(common_prefix(&a, &a), n);
            for at in [
                0, 1, 62, 63, 64, 700, 1023, 1024, 1030, 1087, 2048, 2099, 4096,
            ] {
                if at >= n {
                    continue;
                }
                let mut b = a.clone();
                b[at] ^= 1 << 20;
                b.truncate(n - (n - at) / 2); // a shorter b when the difference allows it
                assert_eq!(common_prefix(&a, &b), at, "n {n} at {at}");
                assert_eq!(common_prefix(&b, &a), naive(&b, &a));
                // A second difference later changes nothing.
                if at + 1 < b.len() {
                    b[at + 1] ^= 1;
                    assert_eq!(common_prefix(&a, &b), at);
                }
            }
            assert_eq!(common_prefix(&a, &a[..n / 2]), n / 2);
        }
    }
}
