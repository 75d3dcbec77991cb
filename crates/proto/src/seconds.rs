//! The one parser of durations given in seconds on a command line (`--idle-timeout 2.5`):
//! a finite, non-negative number no larger than a bound each option chooses. `NaN`, `inf`,
//! `1e309` or a negative number is a usage error with a message, never a panic in
//! [`std::time::Duration::from_secs_f64`].

use std::time::Duration;

use crate::Error;

/// One day, in seconds: the bound of timeouts and intervals that have no reason to be longer.
pub const DAY: f64 = 86_400.0;
/// One year, in seconds: the bound of durations that may sensibly be long.
pub const YEAR: f64 = 365.0 * DAY;

/// `text` as a number of seconds from 0 to `max` (fractions allowed), or why not.
pub fn parse_seconds_up_to(text: &str, max: f64) -> Result<f64, Error> {
    let v: f64 = text
        .parse()
        .map_err(|_| Error::invalid(format!("{text:?} is not a number of seconds")))?;
    if !v.is_finite() || !(0.0..=max).contains(&v) {
        return Err(Error::invalid(format!(
            "{text:?} is not a number of seconds from 0 to {max}"
        )));
    }
    Ok(v)
}

/// `text` as a [`Duration`] of at most a year.
pub fn parse_seconds(text: &str) -> Result<Duration, Error> {
    parse_seconds_up_to(text, YEAR).map(Duration::from_secs_f64)
}

/// For a clap `value_parser`: seconds from 0 to a day.
pub fn up_to_a_day(text: &str) -> Result<f64, Error> {
    parse_seconds_up_to(text, DAY)
}

/// For a clap `value_parser`: seconds from 0 to a year.
pub fn up_to_a_year(text: &str) -> Result<f64, Error> {
    parse_seconds_up_to(text, YEAR)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_finite_bounded_non_negative_seconds_parse() {
        assert_eq!(up_to_a_day("2.5"), Ok(2.5));
        assert_eq!(up_to_a_day("0"), Ok(0.0));
        assert_eq!(up_to_a_day("86400"), Ok(DAY));
        assert_eq!(parse_seconds("1"), Ok(Duration::from_secs(1)));
        for bad in [
            "NaN", "nan", "inf", "-inf", "infinity", "1e20", "1e309", "-1", "-0.5", "86401", "",
            " 1", "1s", "x",
        ] {
            assert!(up_to_a_day(bad).is_err(), "{bad:?}");
        }
        assert!(parse_seconds("1e20").is_err());
        assert!(up_to_a_year("31536000").is_ok() && up_to_a_year("31536001").is_err());
    }
}
