//! The hash-table hashers of the two indexes' maps. Their keys are random already (keyed SipHash
//! or exact small values for radix children, blake3 output for block hashes), so hashing them
//! again would only cost time.

use std::hash::Hasher;

/// Radix child keys (`u64`): one multiply and a rotation, enough to spread them over a table.
#[derive(Default)]
pub(crate) struct MixHasher(u64);

impl Hasher for MixHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(b as u64);
        }
    }
    fn write_u64(&mut self, x: u64) {
        self.0 = (self.0 ^ x)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .rotate_left(29);
    }
}

/// Block hashes (32 bytes, uniformly random): their first eight bytes are the table hash.
#[derive(Default)]
pub(crate) struct PrefixHasher(u64);

impl Hasher for PrefixHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        if bytes.len() >= 8 {
            self.0 = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes"));
        }
    }
}
