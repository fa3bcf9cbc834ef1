//! Importer for the Azure LLM inference traces (Splitwise, ISCA'24): arrivals and lengths only.
//!
//! CSV with a header row naming at least `TIMESTAMP`, `ContextTokens` and `GeneratedTokens` (any
//! order, case-insensitive; other columns ignored; no quoting, which these files never use):
//!
//! ```text
//! TIMESTAMP,ContextTokens,GeneratedTokens
//! 2023-11-16 18:15:46.6805900,374,44
//! ```
//!
//! `TIMESTAMP` is wall-clock `YYYY-MM-DD HH:MM:SS[.fraction]` (a `T` separator is accepted too),
//! up to 100 ns resolution (7 fraction digits; more are truncated), no time zone. Timestamps must
//! never decrease. Output rows: `arrival_us` = time since the first row, truncated to microseconds;
//! `request_id = "{file_stem}-{line}"`; `input_length = ContextTokens`; `output_length =
//! GeneratedTokens`; `block_size` = [`LoadOptions::block_size`] (default [`AZURE_BLOCK_SIZE`]). The traces carry no prompt
//! content, so there is no prefix sharing to model: each request gets `ceil(input / block_size)`
//! fresh block ids from one counter, and no two requests share any id.

use super::{LoadOptions, Trace, TraceError, TraceRequest, blocks_for};
use std::path::Path;

/// Tokens per invented block when [`LoadOptions::block_size`] is not given.
pub const AZURE_BLOCK_SIZE: u32 = 16;

/// The most blocks one imported request may span (guards memory against absurd token counts).
pub const MAX_BLOCKS_PER_REQUEST: u64 = 1 << 20;

const COLUMNS: [&str; 3] = ["TIMESTAMP", "ContextTokens", "GeneratedTokens"];

/// Reads an Azure trace CSV (see the module docs).
///
/// # Errors
/// [`TraceError::Line`] for a bad header, field count, timestamp or token count;
/// [`TraceError::NotMonotonic`] naming both lines when time goes backwards; [`TraceError::Empty`]
/// without data rows; [`TraceError::InvalidOption`] for a zero block size; [`TraceError::Io`].
pub fn import(path: &Path, opts: &LoadOptions) -> Result<Trace, TraceError> {
    let block_size = opts.block_size.unwrap_or(AZURE_BLOCK_SIZE);
    if block_size == 0 {
        return Err(TraceError::InvalidOption(
            "the trace block size must be positive".to_owned(),
        ));
    }
    let text = super::read_text(path)?;
    let mut lines = super::numbered_lines(&text);
    let Some((header_line, header)) = lines.next() else {
        return Err(TraceError::Empty {
            path: path.to_path_buf(),
        });
    };
    let names: Vec<&str> = header
        .trim_start_matches('\u{feff}')
        .split(',')
        .map(str::trim)
        .collect();
    let mut index = [0usize; 3];
    for (slot, want) in index.iter_mut().zip(COLUMNS) {
        *slot = names
            .iter()
            .position(|n| n.eq_ignore_ascii_case(want))
            .ok_or_else(|| {
                TraceError::line(
                    path,
                    header_line,
                    format!(
                        "header lacks column `{want}`; expected `{}`",
                        COLUMNS.join(",")
                    ),
                )
            })?;
    }

    let stem = super::file_stem(path);
    let mut requests = Vec::new();
    let mut first: Option<(i64, &str)> = None;
    let mut previous: Option<(i64, usize, &str)> = None;
    let mut next_block: u64 = 0;
    for (line_no, line) in lines {
        let fields: Vec<&str> = line.split(',').map(str::trim).collect();
        if fields.len() != names.len() {
            return Err(TraceError::line(
                path,
                line_no,
                format!(
                    "expected {} fields like the header, found {}",
                    names.len(),
                    fields.len()
                ),
            ));
        }
        let stamp = fields[index[0]];
        let ticks = parse_timestamp(stamp).map_err(|m| {
            TraceError::line(path, line_no, format!("bad `TIMESTAMP` {stamp:?}: {m}"))
        })?;
        if let Some((prev, prev_line, prev_stamp)) = previous
            && ticks < prev
        {
            return Err(TraceError::NotMonotonic {
                path: path.to_path_buf(),
                line: line_no,
                value: stamp.to_owned(),
                previous_line: prev_line,
                previous: prev_stamp.to_owned(),
            });
        }
        previous = Some((ticks, line_no, stamp));
        let (start, _) = *first.get_or_insert((ticks, stamp));
        let input_length = parse_count(fields[index[1]], COLUMNS[1])
            .map_err(|m| TraceError::line(path, line_no, m))?;
        let output_length = parse_count(fields[index[2]], COLUMNS[2])
            .map_err(|m| TraceError::line(path, line_no, m))?;
        let blocks = blocks_for(input_length, block_size);
        if blocks > MAX_BLOCKS_PER_REQUEST {
            return Err(TraceError::line(
                path,
                line_no,
                format!(
                    "`ContextTokens` {input_length} spans {blocks} blocks of {block_size}, more \
                     than the {MAX_BLOCKS_PER_REQUEST} allowed per request"
                ),
            ));
        }
        let block_hashes: Vec<u64> = (next_block..next_block + blocks).collect();
        next_block += blocks;
        requests.push(TraceRequest {
            // ticks never decrease, so ticks >= start.
            arrival_us: (ticks - start) as u64 / 10,
            request_id: format!("{stem}-{line_no}"),
            model: opts.model.clone(),
            input_length,
            output_length,
            block_size,
            block_hashes,
            token_ids: None,
            session_id: None,
            retention: None,
            ttl_seconds: None,
            think_time_us: None,
            lora: None,
            cache_salt: None,
            images: Vec::new(),
            tenant: None,
            priority: None,
        });
    }
    if requests.is_empty() {
        return Err(TraceError::Empty {
            path: path.to_path_buf(),
        });
    }
    let first_stamp = first.map(|(_, s)| s).unwrap_or_default();
    Ok(Trace {
        requests,
        source: format!(
            "{} (Azure LLM inference CSV, block size {block_size})",
            super::file_name(path)
        ),
        notes: vec![
            format!("arrivals relative to the first request at {first_stamp}"),
            format!(
                "no prompt content in the source: every request has its own {block_size}-token \
                 block ids, so no two requests share a prefix"
            ),
        ],
    })
}

fn parse_count(field: &str, column: &str) -> Result<u32, String> {
    if let Some(digits) = field.strip_prefix('-')
        && !digits.is_empty()
        && digits.bytes().all(|b| b.is_ascii_digit())
    {
        return Err(format!("`{column}` is negative ({field})"));
    }
    field
        .parse::<u32>()
        .map_err(|e| format!("`{column}` must be a token count (u32), found {field:?}: {e}"))
}

/// Parses `YYYY-MM-DD HH:MM:SS[.fffffff]` to 100 ns ticks since 1970-01-01 00:00:00.
pub fn parse_timestamp(s: &str) -> Result<i64, String> {
    const FORMAT: &str = "expected `YYYY-MM-DD HH:MM:SS[.fffffff]`";
    let (date, time) = s.split_once([' ', 'T']).ok_or_else(|| FORMAT.to_owned())?;
    let num = |part: &str, what: &str, lo: i64, hi: i64| -> Result<i64, String> {
        if part.is_empty() || !part.bytes().all(|b| b.is_ascii_digit()) || part.len() > 4 {
            return Err(format!("{what} {part:?} is not a number; {FORMAT}"));
        }
        let v: i64 = part
            .parse()
            .map_err(|_| format!("{what} {part:?}; {FORMAT}"))?;
        if v < lo || v > hi {
            return Err(format!("{what} {v} is out of range {lo}..={hi}"));
        }
        Ok(v)
    };
    let mut d = date.split('-');
    let (Some(y), Some(mo), Some(da), None) = (d.next(), d.next(), d.next(), d.next()) else {
        return Err(FORMAT.to_owned());
    };
    let year = num(y, "year", 0, 9999)?;
    let month = num(mo, "month", 1, 12)?;
    let day = num(da, "day", 1, days_in_month(year, month))?;
    let (hms, frac) = match time.split_once('.') {
        Some((hms, frac)) => (hms, Some(frac)),
        None => (time, None),
    };
    let mut t = hms.split(':');
    let (Some(h), Some(mi), Some(se), None) = (t.next(), t.next(), t.next(), t.next()) else {
        return Err(FORMAT.to_owned());
    };
    let hour = num(h, "hour", 0, 23)?;
    let minute = num(mi, "minute", 0, 59)?;
    let second = num(se, "second", 0, 59)?;
    let mut ticks: i64 = 0;
    if let Some(frac) = frac {
        if frac.is_empty() || frac.len() > 9 || !frac.bytes().all(|b| b.is_ascii_digit()) {
            return Err(format!("fraction {frac:?} must be 1 to 9 digits; {FORMAT}"));
        }
        for i in 0..7 {
            let digit = frac.as_bytes().get(i).map_or(0, |b| i64::from(b - b'0'));
            ticks = ticks * 10 + digit;
        }
    }
    let days = days_from_civil(year, month, day);
    let seconds = days * 86_400 + hour * 3_600 + minute * 60 + second;
    Ok(seconds * 10_000_000 + ticks)
}

fn is_leap(y: i64) -> bool {
    (y % 4 == 0 && y % 100 != 0) || y % 400 == 0
}

fn days_in_month(y: i64, m: i64) -> i64 {
    match m {
        2 if is_leap(y) => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's `days_from_civil`).
pub fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn civil_days_match_known_dates() {
        assert_eq!(days_from_civil(1970, 1, 1), 0);
        assert_eq!(days_from_civil(2000, 3, 1), 11_017);
        assert_eq!(days_from_civil(2023, 11, 16), 19_677);
        assert_eq!(days_from_civil(1969, 12, 31), -1);
        assert_eq!(
            days_from_civil(2024, 2, 29) + 1,
            days_from_civil(2024, 3, 1)
        );
    }

    #[test]
    fn timestamps_parse_to_100ns_ticks() {
        let t = parse_timestamp("2023-11-16 18:15:46.6805900").expect("valid");
        // 1700158546 s since the epoch (date -u -d '2023-11-16 18:15:46' +%s).
        assert_eq!(t, 1_700_158_546 * 10_000_000 + 6_805_900);
        assert_eq!(
            parse_timestamp("2023-11-16T18:15:46.68").expect("short fraction"),
            1_700_158_546 * 10_000_000 + 6_800_000
        );
        assert_eq!(
            parse_timestamp("2023-11-16 18:15:46").expect("no fraction"),
            1_700_158_546 * 10_000_000
        );
        assert_eq!(
            parse_timestamp("2023-11-16 18:15:46.123456789").expect("ns truncated"),
            1_700_158_546 * 10_000_000 + 1_234_567
        );
    }

    #[test]
    fn bad_timestamps_are_rejected() {
        for bad in [
            "",
            "2023-11-16",
            "2023-13-01 00:00:00",
            "2023-02-29 00:00:00",
            "2023-11-16 24:00:00",
            "2023-11-16 18:15:46.",
            "2023-11-16 18:15:46.12a",
            "2023-11-16 18:15",
            "2023-11-16 +8:15:46",
            "23-11-16-1 18:15:46",
        ] {
            assert!(parse_timestamp(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn counts_must_be_u32() {
        assert_eq!(parse_count("17", "c"), Ok(17));
        assert!(
            parse_count("-3", "c")
                .err()
                .unwrap_or_default()
                .contains("negative")
        );
        assert!(parse_count("x", "c").is_err());
        assert!(parse_count("4294967296", "c").is_err());
    }
}
