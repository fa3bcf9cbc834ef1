//! Human-friendly units used by command-line flags: durations and byte sizes.
//!
//! Both types parse with [`std::str::FromStr`] (so clap can use them as value parsers), print
//! back in a canonical form with [`std::fmt::Display`], and (de)serialize as that same string,
//! so `--check-config` shows what a user would type.
//!
//! **Durations** ([`HumanDuration`]): a non-negative decimal number with an optional unit:
//! `ns`, `us` (or `µs`), `ms`, `s`, `m`, `h`; no unit means seconds (`900` = `900s`, the seed's
//! upstream flags take seconds). Examples: `900s`, `15m`, `1h`, `250ms`, `1.5s`, `0`. What `0`
//! means (off, forever, no wait) is decided by each flag, not here.
//!
//! **Sizes** ([`ByteSize`]): a non-negative decimal number with an optional unit. Every unit is
//! binary, whichever spelling is used, as the Python kvd's `K/M/G/T` suffixes were: `K`, `KB`,
//! `KiB` = 1024; `M`/`MB`/`MiB` = 1024²; `G`/`GB`/`GiB` = 1024³; `T`/`TB`/`TiB` = 1024⁴; `B` or
//! no unit = bytes. Units are case-insensitive. A fractional value is rounded down to a whole
//! byte (`1.5K` = 1536).

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;
use std::str::FromStr;
use std::time::Duration;

/// Why a duration or size did not parse. The message is shown by clap after
/// `invalid value '...' for '--flag'`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct UnitError(String);

/// Splits `input` into a non-negative decimal number and the unit text that follows it.
fn split_number(input: &str, what: &str, example: &str) -> Result<(f64, String), UnitError> {
    let text = input.trim();
    let end = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(end);
    if number.is_empty() || number == "." {
        return Err(UnitError(format!(
            "'{input}' is not a {what}: expected a number with an optional unit, e.g. {example}"
        )));
    }
    let value: f64 = number.parse().map_err(|_| {
        UnitError(format!(
            "'{input}' is not a {what}: '{number}' is not a number (e.g. {example})"
        ))
    })?;
    Ok((value, unit.trim().to_ascii_lowercase()))
}

/// A duration given on the command line (`900s`, `15m`, `250ms`, `0`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct HumanDuration(pub Duration);

impl HumanDuration {
    /// Whether this is zero, which flags use for "off" or "forever".
    pub fn is_zero(self) -> bool {
        self.0.is_zero()
    }

    /// `None` for zero, the duration otherwise: the usual reading of "0 = off".
    pub fn non_zero(self) -> Option<Self> {
        (!self.is_zero()).then_some(self)
    }
}

impl FromStr for HumanDuration {
    type Err = UnitError;

    fn from_str(input: &str) -> Result<Self, Self::Err> {
        const EXAMPLE: &str = "900s, 15m, 1h, 250ms or 0";
        let (value, unit) = split_number(input, "duration", EXAMPLE)?;
        let nanos_per_unit: f64 = match unit.as_str() {
            "" | "s" | "sec" | "secs" => 1e9,
            "ms" => 1e6,
            "us" | "µs" => 1e3,
            "ns" => 1.0,
            "m" | "min" | "mins" => 60e9,
            "h" | "hr" | "hrs" => 3600e9,
            other => {
                return Err(UnitError(format!(
                    "'{input}' is not a duration: unknown unit '{other}' \
                     (use ns, us, ms, s, m or h, e.g. {EXAMPLE})"
                )));
            }
        };
        let nanos = value * nanos_per_unit;
        // Durations beyond ~584 years do not fit a u64 of nanoseconds; nobody means them.
        if !nanos.is_finite() || nanos >= u64::MAX as f64 {
            return Err(UnitError(format!("'{input}' is too long a duration")));
        }
        Ok(Self(Duration::from_nanos(nanos.round() as u64)))
    }
}

impl fmt::Display for HumanDuration {
    /// The largest unit that represents the value exactly: `900s` prints as `15m`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let nanos = self.0.as_nanos();
        if nanos == 0 {
            return f.write_str("0s");
        }
        const UNITS: [(u128, &str); 6] = [
            (3_600_000_000_000, "h"),
            (60_000_000_000, "m"),
            (1_000_000_000, "s"),
            (1_000_000, "ms"),
            (1_000, "us"),
            (1, "ns"),
        ];
        for (size, name) in UNITS {
            if nanos.is_multiple_of(size) {
                return write!(f, "{}{name}", nanos / size);
            }
        }
        write!(f, "{nanos}ns")
    }
}

impl Serialize for HumanDuration {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for HumanDuration {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// A number of bytes given on the command line (`64GiB`, `512MiB`, `1G`, `4096`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct ByteSize(pub u64);

impl ByteSize {
    const KIB: u64 = 1 << 10;
    const MIB: u64 = 1 << 20;
    const GIB: u64 = 1 << 30;
    const TIB: u64 = 1 << 40;

    /// The number of bytes.
    pub fn bytes(self) -> u64 {
        self.0
    }
}

impl FromStr for ByteSize {
    type Err = UnitError;

    fn from_str(input: &str) -> Result<Self, Self::Err> {
        const EXAMPLE: &str = "64GiB, 512MiB, 1G or 4096";
        let (value, unit) = split_number(input, "size", EXAMPLE)?;
        let multiplier = match unit.as_str() {
            "" | "b" => 1,
            "k" | "kb" | "kib" => Self::KIB,
            "m" | "mb" | "mib" => Self::MIB,
            "g" | "gb" | "gib" => Self::GIB,
            "t" | "tb" | "tib" => Self::TIB,
            other => {
                return Err(UnitError(format!(
                    "'{input}' is not a size: unknown unit '{other}' \
                     (use B, KiB, MiB, GiB or TiB; K/M/G/T are binary too; e.g. {EXAMPLE})"
                )));
            }
        };
        let bytes = value * multiplier as f64;
        if !bytes.is_finite() || bytes >= u64::MAX as f64 {
            return Err(UnitError(format!("'{input}' is too large a size")));
        }
        Ok(Self(bytes.floor() as u64))
    }
}

impl fmt::Display for ByteSize {
    /// The largest binary unit that represents the value exactly: `1073741824` prints as `1GiB`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let bytes = self.0;
        for (size, name) in [
            (Self::TIB, "TiB"),
            (Self::GIB, "GiB"),
            (Self::MIB, "MiB"),
            (Self::KIB, "KiB"),
        ] {
            if bytes != 0 && bytes.is_multiple_of(size) {
                return write!(f, "{}{name}", bytes / size);
            }
        }
        write!(f, "{bytes}B")
    }
}

impl Serialize for ByteSize {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn duration(text: &str) -> Duration {
        text.parse::<HumanDuration>().unwrap().0
    }

    fn size(text: &str) -> u64 {
        text.parse::<ByteSize>().unwrap().bytes()
    }

    #[test]
    fn durations_accept_every_documented_form() {
        assert_eq!(duration("900"), Duration::from_secs(900));
        assert_eq!(duration("900s"), Duration::from_secs(900));
        assert_eq!(duration("15m"), Duration::from_secs(900));
        assert_eq!(duration("1h"), Duration::from_secs(3600));
        assert_eq!(duration("250ms"), Duration::from_millis(250));
        assert_eq!(duration("1.5s"), Duration::from_millis(1500));
        assert_eq!(duration("0.5"), Duration::from_millis(500));
        assert_eq!(duration("10us"), Duration::from_micros(10));
        assert_eq!(duration("7ns"), Duration::from_nanos(7));
        assert_eq!(duration(" 2M "), Duration::from_secs(120));
        assert_eq!(duration("0"), Duration::ZERO);
        assert!("0".parse::<HumanDuration>().unwrap().is_zero());
    }

    #[test]
    fn durations_reject_garbage_with_a_useful_message() {
        for bad in [
            "",
            "s",
            "-1s",
            "1d",
            "abc",
            "1.2.3s",
            "1e3s",
            "99999999999999h",
        ] {
            let error = bad.parse::<HumanDuration>().unwrap_err().to_string();
            assert!(error.contains("duration"), "{bad:?} -> {error}");
        }
        let error = "3d".parse::<HumanDuration>().unwrap_err().to_string();
        assert!(error.contains("unknown unit 'd'"), "{error}");
    }

    #[test]
    fn durations_print_in_the_largest_exact_unit() {
        let shown = |text: &str| text.parse::<HumanDuration>().unwrap().to_string();
        assert_eq!(shown("900s"), "15m");
        assert_eq!(shown("901"), "901s");
        assert_eq!(shown("0"), "0s");
        assert_eq!(shown("1.5s"), "1500ms");
        assert_eq!(shown("2h"), "2h");
        assert_eq!(shown("250ms"), "250ms");
    }

    #[test]
    fn durations_round_trip_through_serde() {
        for text in ["0", "900s", "250ms", "1.5s", "3h", "7ns"] {
            let value: HumanDuration = text.parse().unwrap();
            let json = serde_json::to_string(&value).unwrap();
            let back: HumanDuration = serde_json::from_str(&json).unwrap();
            assert_eq!(back, value, "{text} -> {json}");
        }
    }

    #[test]
    fn non_zero_maps_zero_to_none() {
        assert_eq!("0".parse::<HumanDuration>().unwrap().non_zero(), None);
        assert!("1s".parse::<HumanDuration>().unwrap().non_zero().is_some());
    }

    #[test]
    fn sizes_accept_every_documented_form() {
        assert_eq!(size("64GiB"), 64 << 30);
        assert_eq!(size("512MiB"), 512 << 20);
        assert_eq!(size("1G"), 1 << 30);
        assert_eq!(size("1g"), 1 << 30);
        assert_eq!(size("1GB"), 1 << 30);
        assert_eq!(size("2TiB"), 2 << 40);
        assert_eq!(size("8K"), 8 << 10);
        assert_eq!(size("4096"), 4096);
        assert_eq!(size("4096B"), 4096);
        assert_eq!(size("1.5K"), 1536);
        assert_eq!(size("32MiB"), 32 << 20);
        assert_eq!(size("0"), 0);
    }

    #[test]
    fn sizes_reject_garbage_with_a_useful_message() {
        for bad in ["", "G", "-1G", "1PB", "lots", "1..5G", "99999999999TiB"] {
            let error = bad.parse::<ByteSize>().unwrap_err().to_string();
            assert!(error.contains("size"), "{bad:?} -> {error}");
        }
    }

    #[test]
    fn sizes_print_in_the_largest_exact_binary_unit() {
        let shown = |text: &str| text.parse::<ByteSize>().unwrap().to_string();
        assert_eq!(shown("1073741824"), "1GiB");
        assert_eq!(shown("32MiB"), "32MiB");
        assert_eq!(shown("1536"), "1536B");
        assert_eq!(shown("1.5K"), "1536B");
        assert_eq!(shown("2048"), "2KiB");
        assert_eq!(shown("0"), "0B");
        assert_eq!(shown("1025"), "1025B");
    }

    #[test]
    fn sizes_round_trip_through_serde() {
        for text in ["0", "1", "8GiB", "1536", "3TiB"] {
            let value: ByteSize = text.parse().unwrap();
            let json = serde_json::to_string(&value).unwrap();
            let back: ByteSize = serde_json::from_str(&json).unwrap();
            assert_eq!(back, value, "{text} -> {json}");
        }
    }
}
