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

/// vLLM's default block hash (`sha256_cbor`), so that an indexer that computes vLLM's hashes
/// finds radixkv's blocks:
///
/// ```text
/// cbor(x)  = canonical CBOR (RFC 8949 deterministic encoding: shortest heads, definite lengths)
/// h_{-1}   = sha256( cbor(seed) )                        vLLM's NONE_HASH for PYTHONHASHSEED=seed
/// h_i      = sha256( cbor([ h_{i-1}, [t[i*P], ..., t[i*P+P-1]], extra_i ]) )
/// extra_0  = [namespace]  (text string; a byte string if not utf-8), or null for None / empty
/// extra_i  = null for i > 0
/// ```
///
/// `h_{i-1}` is a 32-byte byte string, token ids unsigned integers; the namespace plays vLLM's
/// `cache_salt`, which vLLM adds to the first block's extra keys only.
pub mod sha256_cbor {
    use super::BlockHash;
    use sha2::{Digest, Sha256};

    const BYTES: u8 = 2;
    const TEXT: u8 = 3;
    const ARRAY: u8 = 4;
    const NULL: u8 = 0xf6;

    /// A CBOR head: major type and argument, in the shortest form.
    fn head(out: &mut Vec<u8>, major: u8, n: u64) {
        let m = major << 5;
        match n {
            0..=23 => out.push(m | n as u8),
            24..=0xff => out.extend_from_slice(&[m | 24, n as u8]),
            0x100..=0xffff => {
                out.push(m | 25);
                out.extend_from_slice(&(n as u16).to_be_bytes());
            }
            0x1_0000..=0xffff_ffff => {
                out.push(m | 26);
                out.extend_from_slice(&(n as u32).to_be_bytes());
            }
            _ => {
                out.push(m | 27);
                out.extend_from_slice(&n.to_be_bytes());
            }
        }
    }

    /// A str or bytes value: a text string when it is utf-8, else a byte string.
    fn string(out: &mut Vec<u8>, s: &[u8]) {
        let major = if std::str::from_utf8(s).is_ok() {
            TEXT
        } else {
            BYTES
        };
        head(out, major, s.len() as u64);
        out.extend_from_slice(s);
    }

    /// vLLM's `NONE_HASH` when its `PYTHONHASHSEED` is `seed`: `sha256(cbor(seed))`.
    pub fn none_hash(seed: &str) -> BlockHash {
        let mut buf = Vec::with_capacity(seed.len() + 9);
        string(&mut buf, seed.as_bytes());
        Sha256::digest(&buf).into()
    }

    /// `h_i` from `h_{i-1}`, the tokens of page `i` and the salt of the first page.
    pub fn next_hash(prev: &BlockHash, page: &[u32], salt: Option<&[u8]>) -> BlockHash {
        let mut buf = Vec::with_capacity(40 + page.len() * 5 + salt.map_or(0, |s| s.len() + 10));
        head(&mut buf, ARRAY, 3);
        head(&mut buf, BYTES, 32);
        buf.extend_from_slice(prev);
        head(&mut buf, ARRAY, page.len() as u64);
        for &t in page {
            head(&mut buf, 0, t as u64);
        }
        match salt {
            Some(s) if !s.is_empty() => {
                head(&mut buf, ARRAY, 1);
                string(&mut buf, s);
            }
            _ => buf.push(NULL),
        }
        Sha256::digest(&buf).into()
    }

    /// The hashes of every full page of `tokens`, the first chained from `none_hash(seed)`.
    pub fn block_hashes(
        tokens: &[u32],
        page_size: usize,
        namespace: &crate::request::Namespace,
        seed: &str,
    ) -> Vec<BlockHash> {
        let mut prev = none_hash(seed);
        tokens
            .chunks_exact(page_size)
            .enumerate()
            .map(|(i, page)| {
                let salt = if i == 0 { namespace.as_deref() } else { None };
                prev = next_hash(&prev, page, salt);
                prev
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sha256_cbor_by_hand() {
        use sha2::{Digest, Sha256};
        // cbor("0") = 0x61 '0'; the first block of [1, 2, 300, 70000] at P=4, no salt:
        // [h, [1, 2, 300, 70000], null] = 0x83 0x58 0x20 <32 bytes> 0x84 0x01 0x02 0x19 0x01 0x2c
        // 0x1a 0x00 0x01 0x11 0x70 0xf6.
        let none: [u8; 32] = Sha256::digest(b"\x610").into();
        assert_eq!(sha256_cbor::none_hash("0"), none);
        let mut msg = vec![0x83, 0x58, 0x20];
        msg.extend_from_slice(&none);
        msg.extend_from_slice(&[
            0x84, 0x01, 0x02, 0x19, 0x01, 0x2c, 0x1a, 0x00, 0x01, 0x11, 0x70,
        ]);
        msg.push(0xf6);
        let h0: [u8; 32] = Sha256::digest(&msg).into();
        assert_eq!(
            sha256_cbor::block_hashes(&[1, 2, 300, 70000, 5], 4, &None, "0"),
            vec![h0]
        );
        // A salt goes into the first block only, as a one-element array of a text string.
        let mut salted = msg[..msg.len() - 1].to_vec();
        salted.extend_from_slice(&[0x81, 0x62, b't', b'a']);
        let s0: [u8; 32] = Sha256::digest(&salted).into();
        let ns: Namespace = Some(b"ta".to_vec().into());
        let hs = sha256_cbor::block_hashes(&[1, 2, 300, 70000, 1, 2, 300, 70000], 4, &ns, "0");
        assert_eq!(hs[0], s0);
        assert_eq!(
            hs[1],
            sha256_cbor::next_hash(&s0, &[1, 2, 300, 70000], None)
        );
    }

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
