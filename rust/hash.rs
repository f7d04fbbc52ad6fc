//! The chained block hash of the design (`radixkv.block.v1`), usable by routers in any language.
//!
//! ```text
//! ns_bytes = b""                  if namespace is None   (tag 0)
//!            utf-8 / raw bytes    otherwise              (tag 1)
//! h_root   = blake3( b"radixkv.block.v1" || le32(page_size) || u8(tag) || le32(len(ns_bytes)) || ns_bytes )
//! h_i      = blake3_keyed( key = h_{i-1}, data = le32(t[i*P]) || ... || le32(t[i*P + P - 1]) )
//! ```
//! Only full pages have a hash.

use crate::request::Namespace;

/// A 32-byte block hash.
pub type BlockHash = [u8; 32];

const DOMAIN: &[u8] = b"radixkv.block.v1";

/// `h_root` for a page size and namespace.
pub fn root_hash(page_size: usize, namespace: &Namespace) -> BlockHash {
    let mut h = blake3::Hasher::new();
    h.update(DOMAIN);
    h.update(&(page_size as u32).to_le_bytes());
    match namespace {
        None => {
            h.update(&[0u8]);
            h.update(&0u32.to_le_bytes());
        }
        Some(ns) => {
            h.update(&[1u8]);
            h.update(&(ns.len() as u32).to_le_bytes());
            h.update(ns);
        }
    }
    *h.finalize().as_bytes()
}

/// `h_i` from `h_{i-1}` and the tokens of page `i`.
pub fn next_hash(prev: &BlockHash, page: &[u32]) -> BlockHash {
    // One page of 16 tokens is 64 bytes: one blake3 block. Stay on the stack up to 64 tokens.
    let mut buf = [0u8; 256];
    if page.len() <= 64 {
        for (chunk, t) in buf.chunks_exact_mut(4).zip(page) {
            chunk.copy_from_slice(&t.to_le_bytes());
        }
        *blake3::keyed_hash(prev, &buf[..page.len() * 4]).as_bytes()
    } else {
        let mut h = blake3::Hasher::new_keyed(prev);
        for t in page {
            h.update(&t.to_le_bytes());
        }
        *h.finalize().as_bytes()
    }
}

/// The hashes of every full page of `tokens`.
pub fn block_hashes(tokens: &[u32], page_size: usize, namespace: &Namespace) -> Vec<BlockHash> {
    let mut prev = root_hash(page_size, namespace);
    tokens
        .chunks_exact(page_size)
        .map(|page| {
            prev = next_hash(&prev, page);
            prev
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_by_hand() {
        // Recompute the spec with the plain blake3 API, byte by byte.
        let ns: Namespace = Some(b"tenant-a".to_vec().into());
        let mut root_in = b"radixkv.block.v1".to_vec();
        root_in.extend_from_slice(&2u32.to_le_bytes());
        root_in.push(1);
        root_in.extend_from_slice(&8u32.to_le_bytes());
        root_in.extend_from_slice(b"tenant-a");
        let root = *blake3::hash(&root_in).as_bytes();
        let page0: Vec<u8> = [7u32, 8].iter().flat_map(|t| t.to_le_bytes()).collect();
        let h0 = *blake3::keyed_hash(&root, &page0).as_bytes();
        let page1: Vec<u8> = [9u32, 4_000_000_000]
            .iter()
            .flat_map(|t| t.to_le_bytes())
            .collect();
        let h1 = *blake3::keyed_hash(&h0, &page1).as_bytes();
        assert_eq!(
            block_hashes(&[7, 8, 9, 4_000_000_000, 1], 2, &ns),
            vec![h0, h1]
        );
    }

    #[test]
    fn namespace_and_page_size_change_every_hash() {
        let t: Vec<u32> = (0..64).collect();
        let a = block_hashes(&t, 16, &None);
        let b = block_hashes(&t, 16, &Some(Box::from(&b""[..])));
        let c = block_hashes(&t, 8, &None);
        assert_eq!(a.len(), 4);
        assert!(a.iter().zip(&b).all(|(x, y)| x != y));
        assert_ne!(a[0], c[0]);
        // Long pages take the streaming path and still follow the spec.
        let long: Vec<u32> = (0..200).collect();
        let root = root_hash(100, &None);
        let bytes: Vec<u8> = long[..100].iter().flat_map(|t| t.to_le_bytes()).collect();
        assert_eq!(
            block_hashes(&long, 100, &None)[0],
            *blake3::keyed_hash(&root, &bytes).as_bytes()
        );
    }
}
