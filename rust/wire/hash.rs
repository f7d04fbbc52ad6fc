//! The chained block hash of the design (`radixkv.block.v1`), usable by routers in any language.
//!
//! ```text
//! ns_bytes = b""                  if namespace is None   (tag 0)
//!            utf-8 / raw bytes    otherwise              (tag 1)
//! h_root   = blake3( b"radixkv.block.v1" || le32(page_size) || u8(tag) || le32(len(ns_bytes)) || ns_bytes )
//! h_i      = blake3_keyed( key = h_{i-1}, data = le32(t[i*P]) || ... || le32(t[i*P + P - 1]) )
//! ```
//! Only full pages have a hash.

/// A namespace: `None`, or the bytes of a str (utf-8) or bytes value. Requests in different
/// namespaces never share pages.
pub type Namespace = Option<Box<[u8]>>;

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
    if !page.is_empty() && page.len() <= BLOCK_WORDS {
        return one_block::keyed_hash(prev, page);
    }
    // Stay on the stack up to 64 tokens.
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

/// Tokens in one BLAKE3 block (64 bytes).
const BLOCK_WORDS: usize = 16;

/// BLAKE3's keyed hash of an input of one block (1 to 64 bytes, here 1 to 16 little-endian
/// words), written from the BLAKE3 specification: one call of the compression function with the
/// key as chaining value and the flags `CHUNK_START | CHUNK_END | ROOT | KEYED_HASH`.
///
/// A page of up to 16 tokens is one block, and a published page costs one such call, which is
/// latency bound (7 rounds, each a chain of dependent adds, xors and rotations). The `blake3`
/// crate runs it in SIMD rows and adds its general API (chunk state, platform dispatch); written
/// plainly on sixteen words, fully unrolled, it takes about 40% less time per call on x86-64.
/// Tests compare it with the crate on every length and random keys.
mod one_block {
    use super::{BlockHash, BLOCK_WORDS};

    const IV: [u32; 8] = [
        0x6A09_E667,
        0xBB67_AE85,
        0x3C6E_F372,
        0xA54F_F53A,
        0x510E_527F,
        0x9B05_688C,
        0x1F83_D9AB,
        0x5BE0_CD19,
    ];
    const CHUNK_START: u32 = 1;
    const CHUNK_END: u32 = 2;
    const ROOT: u32 = 8;
    const KEYED_HASH: u32 = 16;

    /// The message word permutation between rounds.
    const PERMUTATION: [usize; 16] = [2, 6, 3, 10, 7, 0, 4, 13, 1, 11, 12, 5, 9, 14, 15, 8];

    /// The message word order of each of the 7 rounds (the permutation applied `r` times).
    const SCHEDULE: [[usize; 16]; 7] = {
        let mut s = [[0usize; 16]; 7];
        let mut i = 0;
        while i < 16 {
            s[0][i] = i;
            i += 1;
        }
        let mut r = 1;
        while r < 7 {
            let mut i = 0;
            while i < 16 {
                s[r][i] = s[r - 1][PERMUTATION[i]];
                i += 1;
            }
            r += 1;
        }
        s
    };

    #[inline(always)]
    fn g(v: &mut [u32; 16], [a, b, c, d]: [usize; 4], x: u32, y: u32) {
        v[a] = v[a].wrapping_add(v[b]).wrapping_add(x);
        v[d] = (v[d] ^ v[a]).rotate_right(16);
        v[c] = v[c].wrapping_add(v[d]);
        v[b] = (v[b] ^ v[c]).rotate_right(12);
        v[a] = v[a].wrapping_add(v[b]).wrapping_add(y);
        v[d] = (v[d] ^ v[a]).rotate_right(8);
        v[c] = v[c].wrapping_add(v[d]);
        v[b] = (v[b] ^ v[c]).rotate_right(7);
    }

    #[inline(always)]
    fn round(v: &mut [u32; 16], m: &[u32; 16], r: usize) {
        let s = &SCHEDULE[r];
        g(v, [0, 4, 8, 12], m[s[0]], m[s[1]]);
        g(v, [1, 5, 9, 13], m[s[2]], m[s[3]]);
        g(v, [2, 6, 10, 14], m[s[4]], m[s[5]]);
        g(v, [3, 7, 11, 15], m[s[6]], m[s[7]]);
        g(v, [0, 5, 10, 15], m[s[8]], m[s[9]]);
        g(v, [1, 6, 11, 12], m[s[10]], m[s[11]]);
        g(v, [2, 7, 8, 13], m[s[12]], m[s[13]]);
        g(v, [3, 4, 9, 14], m[s[14]], m[s[15]]);
    }

    /// `blake3::keyed_hash(key, le32(words))` for 1 to 16 words.
    pub(super) fn keyed_hash(key: &BlockHash, words: &[u32]) -> BlockHash {
        debug_assert!(!words.is_empty() && words.len() <= BLOCK_WORDS);
        let mut m = [0u32; 16];
        m[..words.len()].copy_from_slice(words);
        let k: [u32; 8] =
            std::array::from_fn(|i| u32::from_le_bytes(key[4 * i..4 * i + 4].try_into().unwrap()));
        let flags = CHUNK_START | CHUNK_END | ROOT | KEYED_HASH;
        // Counter 0 (words 12 and 13), block length in bytes, flags.
        let mut v = [
            k[0],
            k[1],
            k[2],
            k[3],
            k[4],
            k[5],
            k[6],
            k[7],
            IV[0],
            IV[1],
            IV[2],
            IV[3],
            0,
            0,
            4 * words.len() as u32,
            flags,
        ];
        round(&mut v, &m, 0);
        round(&mut v, &m, 1);
        round(&mut v, &m, 2);
        round(&mut v, &m, 3);
        round(&mut v, &m, 4);
        round(&mut v, &m, 5);
        round(&mut v, &m, 6);
        let mut out = [0u8; 32];
        for (i, chunk) in out.chunks_exact_mut(4).enumerate() {
            chunk.copy_from_slice(&(v[i] ^ v[i + 8]).to_le_bytes());
        }
        out
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
        namespace: &super::Namespace,
        seed: &str,
    ) -> Vec<BlockHash> {
        chain(none_hash(seed), tokens, page_size, namespace.as_deref())
    }

    /// The hashes of every full page of `tokens`, the first chained from `prev` and salted
    /// with `first_salt` (a chain continued from a block already hashed has none).
    pub fn chain(
        mut prev: BlockHash,
        tokens: &[u32],
        page_size: usize,
        first_salt: Option<&[u8]>,
    ) -> Vec<BlockHash> {
        tokens
            .chunks_exact(page_size)
            .enumerate()
            .map(|(i, page)| {
                prev = next_hash(&prev, page, if i == 0 { first_salt } else { None });
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

    /// The one-block path equals the `blake3` crate for every page size it serves, random keys
    /// and tokens (extreme values included), and the crate's path takes over from 17 tokens on.
    #[test]
    fn one_block_hash_equals_the_blake3_crate() {
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let mut rand = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for case in 0..2000 {
            let key: BlockHash = std::array::from_fn(|_| rand() as u8);
            let len = 1 + case % 20;
            let page: Vec<u32> = (0..len)
                .map(|i| match (case / 20 + i) % 5 {
                    0 => 0,
                    1 => u32::MAX,
                    _ => rand() as u32,
                })
                .collect();
            let bytes: Vec<u8> = page.iter().flat_map(|t| t.to_le_bytes()).collect();
            let want = *blake3::keyed_hash(&key, &bytes).as_bytes();
            assert_eq!(next_hash(&key, &page), want, "case {case}, {len} tokens");
            if len <= BLOCK_WORDS {
                assert_eq!(one_block::keyed_hash(&key, &page), want);
            }
        }
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
