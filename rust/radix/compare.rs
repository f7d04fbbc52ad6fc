//! `common_prefix`: how many leading tokens two slices share, the radix tree's hot compare (a
//! hit compares the whole prompt with the keys of the path it matches).

/// First `n` such that `a[n] != b[n]` (or the shorter length): 4 KiB blocks by memcmp, then
/// 64-token chunks by an or of xors (branch-free, vectorised, no call), then single tokens.
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
        if x.iter().zip(y).fold(0, |acc, (p, q)| acc | (p ^ q)) != 0 {
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
