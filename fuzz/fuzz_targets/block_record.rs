//! Block records as the disk and Redis tiers read them back (`kura_tiers::decode_record`): a valid record
//! built from the input, then damaged where the input says (bytes overwritten, the record cut short, the
//! expected block, fingerprint or payload size changed). Every damaged record must be refused with a
//! reason and every intact one accepted with its own payload; nothing may panic.
//!
//! Input: bytes 0..8 pick the block (hash, tokens), byte 8 the damage, the rest the bytes written over the
//! record (pairs of position and value) or the payload.
#![no_main]

use kura_tiers::{decode_record, encode_record, BlockRecord};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if data.len() < 9 {
        return;
    }
    let seed = u64::from_le_bytes(data[..8].try_into().unwrap());
    let damage = data[8];
    let rest = &data[9..];
    let tokens: Vec<u32> = (0..(seed % 33) as u32).map(|i| i.wrapping_mul(seed as u32)).collect();
    let rec = BlockRecord {
        hash: u128::from(seed) << 3 | 1,
        parent_hash: u128::from(seed.rotate_left(7)),
        key_digest: u128::from(seed.rotate_left(13)),
        tokens,
    };
    let payload: Vec<u8> = rest.iter().copied().take(512).collect();
    let fingerprint = u128::from(seed) * 31;
    let mut bytes = encode_record(fingerprint, &rec, &payload);
    // The intact record reads back as itself.
    assert_eq!(
        decode_record(&bytes, fingerprint, payload.len(), &rec).ok(),
        Some(&payload[..])
    );
    match damage % 5 {
        0 => {
            for pair in rest.chunks_exact(3) {
                let at = usize::from(u16::from_le_bytes([pair[0], pair[1]])) % bytes.len().max(1);
                bytes[at] = pair[2];
            }
        }
        1 => bytes.truncate(usize::from(damage) % bytes.len().max(1)),
        2 => {
            let mut other = rec.clone();
            other.hash ^= u128::from(damage) + 1;
            assert!(decode_record(&bytes, fingerprint, payload.len(), &other).is_err());
            return;
        }
        3 => {
            assert!(decode_record(&bytes, fingerprint ^ 1, payload.len(), &rec).is_err());
            return;
        }
        _ => {
            assert!(decode_record(&bytes, fingerprint, payload.len() + 1, &rec).is_err());
            return;
        }
    }
    // Damaged bytes: refused, or (when the damage rewrote bytes with their own values) the same payload.
    if let Ok(p) = decode_record(&bytes, fingerprint, payload.len(), &rec) {
        assert_eq!(p, &payload[..]);
    }
});
