//! Byte quantities as people write them: `24GiB`, `80GB`, `512 MiB`, `1.5T`, `1e9`, plain bytes.
//! Binary suffixes (KiB to EiB) are powers of 1024; decimal ones (KB to EB) powers of 1000; a bare
//! letter (K, M, G, T, P) is binary, as in most serving tools' flags.

/// A size that could not be read, with what was given.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("cannot read '{given}' as a size: {why} (examples: 24GiB, 80GB, 512MiB, 1073741824)")]
pub struct BadSize {
    pub given: String,
    pub why: &'static str,
}

pub fn parse_bytes(s: &str) -> Result<u64, BadSize> {
    let bad = |why| BadSize {
        given: s.to_string(),
        why,
    };
    let t = s.trim();
    // The unit starts at the first letter that is not an exponent's `e` (one followed by a digit or a
    // sign, as in `1e9` or `2.5E+3`): `16EiB` is 16 of the unit `EiB`.
    let bytes_of = t.as_bytes();
    let split = t
        .char_indices()
        .find(|&(i, c)| {
            c.is_ascii_alphabetic()
                && !(matches!(c, 'e' | 'E')
                    && i > 0
                    && bytes_of
                        .get(i + 1)
                        .is_some_and(|n| n.is_ascii_digit() || *n == b'+' || *n == b'-'))
        })
        .map_or(t.len(), |(i, _)| i);
    let (num, unit) = t.split_at(split);
    let value: f64 = num.trim().parse().map_err(|_| bad("not a number"))?;
    if !value.is_finite() || value < 0.0 {
        return Err(bad("must be a non-negative number"));
    }
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => 1024.0,
        "m" | "mib" => 1024f64.powi(2),
        "g" | "gib" => 1024f64.powi(3),
        "t" | "tib" => 1024f64.powi(4),
        "p" | "pib" => 1024f64.powi(5),
        "eib" => 1024f64.powi(6),
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        "pb" => 1e15,
        "eb" => 1e18,
        _ => return Err(bad("unknown unit")),
    };
    // Whole numbers exactly (an f64 holds only 53 bits: u64::MAX would round up to 2^64).
    if let Ok(n) = num.trim().parse::<u64>() {
        return n.checked_mul(mult as u64).ok_or_else(|| bad("too large"));
    }
    let bytes = value * mult;
    // 2^64 is the first value past u64.
    if bytes >= 18_446_744_073_709_551_616.0 {
        return Err(bad("too large"));
    }
    Ok(bytes.round() as u64)
}

/// `1536` → `1.50 KiB`; exact bytes are in the JSON output.
pub fn format_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_binary_and_decimal_units() {
        assert_eq!(parse_bytes("24GiB").unwrap(), 24 << 30);
        assert_eq!(parse_bytes("24 G").unwrap(), 24 << 30);
        assert_eq!(parse_bytes("80GB").unwrap(), 80_000_000_000);
        assert_eq!(parse_bytes("512MiB").unwrap(), 512 << 20);
        assert_eq!(parse_bytes("1.5KiB").unwrap(), 1536);
        assert_eq!(parse_bytes("1e9").unwrap(), 1_000_000_000);
        assert_eq!(parse_bytes("4096").unwrap(), 4096);
        assert_eq!(parse_bytes("2.5E+3").unwrap(), 2500);
        assert_eq!(parse_bytes("2PiB").unwrap(), 2 << 50);
        assert_eq!(parse_bytes("7EiB").unwrap(), 7 << 60);
        assert_eq!(parse_bytes("3 EB").unwrap(), 3_000_000_000_000_000_000);
        assert_eq!(parse_bytes("18446744073709551615").unwrap(), u64::MAX);
        assert_eq!(parse_bytes("15EiB").unwrap(), 15 << 60);
    }

    #[test]
    fn bad_sizes_are_named() {
        for s in [
            "",
            "GiB",
            "12 parsecs",
            "-1GiB",
            "1e400",
            "16EiB",
            "18446744073709551616",
        ] {
            let err = parse_bytes(s).unwrap_err();
            assert!(err.to_string().contains(&format!("'{s}'")), "{err}");
        }
    }

    #[test]
    fn formatting_picks_a_readable_unit() {
        assert_eq!(format_bytes(100), "100 B");
        assert_eq!(format_bytes(1536), "1.50 KiB");
        assert_eq!(format_bytes(8 << 30), "8.00 GiB");
    }
}
