//! Byte sizes on the command line: the one parser and formatter every subcommand uses.
//!
//! Units, case-insensitive, with an optional space before them:
//! * none or `B`: bytes;
//! * `K`, `M`, `G`, `T` and `KiB`, `MiB`, `GiB`, `TiB`: powers of 1024, as nccl-tests reads
//!   `-b 8 -e 128M`;
//! * `KB`, `MB`, `GB`, `TB`: powers of 1000.
//!
//! The number may have a fraction (`1.5K`) when the result is a whole number of bytes.

/// What every size option accepts, for its help and error texts.
pub const UNITS: &str = "bytes, or K, M, G, T (powers of 1024, also KiB, MiB, GiB, TiB) \
or KB, MB, GB, TB (powers of 1000)";

/// Parses a byte count; the error says what is accepted (clap adds the option and value).
pub fn parse(s: &str) -> Result<u64, String> {
    let bad = || format!("expected a byte count: {UNITS}, e.g. 4096, 64K, 1.5MiB or 1GB");
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let mult: u64 = match unit.trim_start().to_ascii_uppercase().as_str() {
        "" | "B" => 1,
        "K" | "KIB" => 1 << 10,
        "M" | "MIB" => 1 << 20,
        "G" | "GIB" => 1 << 30,
        "T" | "TIB" => 1 << 40,
        "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "TB" => 1_000_000_000_000,
        _ => return Err(bad()),
    };
    let (whole, frac) = num.split_once('.').unwrap_or((num, ""));
    if whole.is_empty() && frac.is_empty() || frac.contains('.') {
        return Err(bad());
    }
    // Integer arithmetic, so `1.1K` is exactly 1126.4 and refused, not rounded.
    let whole: u64 = if whole.is_empty() {
        0
    } else {
        whole.parse().map_err(|_| bad())?
    };
    let mut bytes = whole.checked_mul(mult).ok_or_else(|| too_big(s))?;
    if !frac.is_empty() {
        let digits = u32::try_from(frac.len()).map_err(|_| bad())?;
        let scale = 10u128.checked_pow(digits).ok_or_else(bad)?;
        let f: u128 = frac.parse().map_err(|_| bad())?;
        let part = f.checked_mul(u128::from(mult)).ok_or_else(|| too_big(s))?;
        if part % scale != 0 {
            return Err(format!("{s:?} is not a whole number of bytes"));
        }
        let part = u64::try_from(part / scale).map_err(|_| too_big(s))?;
        bytes = bytes.checked_add(part).ok_or_else(|| too_big(s))?;
    }
    Ok(bytes)
}

fn too_big(s: &str) -> String {
    format!("{s:?} is more bytes than this machine can count")
}

/// Parses a byte count within `lo ..= hi`.
pub fn parse_within(s: &str, lo: u64, hi: u64) -> Result<u64, String> {
    let n = parse(s)?;
    if (lo..=hi).contains(&n) {
        Ok(n)
    } else {
        Err(format!(
            "expected a size from {} to {} ({UNITS})",
            format(lo),
            format(hi)
        ))
    }
}

/// `8 B`, `4 KiB`, `256 MiB`, `1 GiB` when exact, else two decimals: `1.50 KiB`.
pub fn format(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut u = 0;
    while u + 1 < UNITS.len() && n >= 1u64 << (10 * (u + 1)) {
        u += 1;
    }
    let scale = 1u64 << (10 * u);
    if n % scale == 0 {
        format!("{} {}", n / scale, UNITS[u])
    } else {
        format!("{:.2} {}", n as f64 / scale as f64, UNITS[u])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn binary_letters_and_iec_names_are_powers_of_1024() {
        assert_eq!(parse("8"), Ok(8));
        assert_eq!(parse("8B"), Ok(8));
        assert_eq!(parse("4K"), Ok(4096));
        assert_eq!(parse("512k"), Ok(512 << 10));
        assert_eq!(parse("1m"), Ok(1 << 20));
        assert_eq!(parse("256M"), Ok(256 << 20));
        assert_eq!(parse("1G"), Ok(1 << 30));
        assert_eq!(parse("2T"), Ok(2 << 40));
        assert_eq!(parse("2MiB"), Ok(2 << 20));
        assert_eq!(parse("64 kib"), Ok(64 << 10));
    }

    #[test]
    fn si_names_are_powers_of_1000() {
        assert_eq!(parse("1KB"), Ok(1_000));
        assert_eq!(parse("2MB"), Ok(2_000_000));
        assert_eq!(parse("1GB"), Ok(1_000_000_000));
        assert_eq!(parse("1gb"), Ok(1_000_000_000));
        assert_eq!(parse("3TB"), Ok(3_000_000_000_000));
    }

    #[test]
    fn fractions_must_come_to_whole_bytes() {
        assert_eq!(parse("1.5K"), Ok(1536));
        assert_eq!(parse("0.5GiB"), Ok(1 << 29));
        assert_eq!(parse(".25M"), Ok(1 << 18));
        assert_eq!(parse("1.5KB"), Ok(1500));
        let e = parse("1.1K").unwrap_err();
        assert!(e.contains("whole number of bytes"), "{e}");
        assert!(parse("0.5").is_err());
    }

    #[test]
    fn garbage_is_refused_with_the_accepted_units() {
        for s in [
            "", "x", "M", "K8", "1X", "1.2.3K", "-1", "1 K B", ".", "1e6", "0x10",
        ] {
            let e = parse(s).expect_err(s);
            assert!(e.contains("K, M, G"), "{s}: {e}");
        }
        assert!(parse("16777216T").unwrap_err().contains("more bytes"));
        assert!(parse("99999999999999999999").is_err());
    }

    #[test]
    fn bounds_are_named_in_the_error() {
        assert_eq!(parse_within("1G", 1, 1 << 30), Ok(1 << 30));
        let e = parse_within("2G", 1, 1 << 30).unwrap_err();
        assert!(e.contains("from 1 B to 1 GiB"), "{e}");
        assert!(parse_within("0", 1, 10).is_err());
    }

    #[test]
    fn format_is_exact_when_it_can_be() {
        assert_eq!(format(0), "0 B");
        assert_eq!(format(8), "8 B");
        assert_eq!(format(1023), "1023 B");
        assert_eq!(format(4096), "4 KiB");
        assert_eq!(format(1536), "1.50 KiB");
        assert_eq!(format(256 << 20), "256 MiB");
        assert_eq!(format(1 << 30), "1 GiB");
        assert_eq!(format(1_000_000_000), "953.67 MiB");
        assert_eq!(format(3 << 40), "3 TiB");
        for n in [1, 8, 4096, 1536, 256 << 20, 3 << 40] {
            let s = format(n).replace(' ', "");
            assert_eq!(parse(&s), Ok(n), "{s}");
        }
    }
}
