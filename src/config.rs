//! `RAILOVER_*` environment variables, parsed once into typed values.
//!
//! Everything downstream takes a [`Config`] and never re-reads or re-checks the
//! environment. A bad value is an error that names the variable, the value and what is
//! accepted, so the WARN NCCL prints is enough to fix it.

use std::fmt;
use std::time::Duration;

/// A rejected environment value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{var}={value:?} is not valid: expected {accepted}")]
pub struct ConfigError {
    pub var: &'static str,
    pub value: String,
    pub accepted: &'static str,
}

/// Which network interfaces become railover TCP NICs: `NCCL_SOCKET_IFNAME` syntax.
///
/// A comma-separated list of name prefixes; a leading `^` turns the list into an
/// exclusion list; a leading `=` (after any `^`) makes the names exact.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct IfFilter {
    /// The list was given (false: the default selection applies).
    pub given: bool,
    pub exclude: bool,
    pub exact: bool,
    pub names: Vec<String>,
}

impl IfFilter {
    /// Parses the `NCCL_SOCKET_IFNAME`-style value.
    pub fn parse(value: &str) -> Result<IfFilter, String> {
        let mut rest = value.trim();
        let exclude = rest.starts_with('^');
        if exclude {
            rest = &rest[1..];
        }
        let exact = rest.starts_with('=');
        if exact {
            rest = &rest[1..];
        }
        let names: Vec<String> = rest
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(String::from)
            .collect();
        if names.is_empty() {
            return Err("an empty interface list".into());
        }
        if let Some(bad) = names
            .iter()
            .find(|n| n.len() > 15 || n.contains(|c: char| c.is_whitespace() || c == '/'))
        {
            return Err(format!("{bad:?} is not an interface name"));
        }
        Ok(IfFilter {
            given: true,
            exclude,
            exact,
            names,
        })
    }

    /// Does the explicit list select `ifname`? (Only meaningful when `given`.)
    pub fn matches(&self, ifname: &str) -> bool {
        let listed = self.names.iter().any(|n| {
            if self.exact {
                ifname == n
            } else {
                ifname.starts_with(n.as_str())
            }
        });
        listed != self.exclude
    }

    /// Does the list name `ifname` positively (used to allow loopback)?
    pub fn names_positively(&self, ifname: &str) -> bool {
        self.given && !self.exclude && self.matches(ifname)
    }
}

/// Level of the log lines railover writes to stderr when NCCL's logger is not in use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum LogLevel {
    Off,
    Warn,
    Info,
    Debug,
    Trace,
}

/// The validated configuration of one process.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// `RAILOVER_IFNAME`: which interfaces are NICs.
    pub ifname: IfFilter,
    /// `RAILOVER_SPIN_US`: how long the reactor busy-polls after its last progress
    /// while requests are in flight, before it parks in epoll.
    pub spin: Duration,
    /// `RAILOVER_LOG`: stderr log level (NCCL's own logger ignores it).
    pub log: LogLevel,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            ifname: IfFilter::default(),
            spin: Duration::from_micros(200),
            log: LogLevel::Warn,
        }
    }
}

impl fmt::Display for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "ifname={:?} spin={:?} log={:?}",
            self.ifname.names, self.spin, self.log
        )
    }
}

/// The variables railover reads, with their accepted values (the README's table).
pub const VARIABLES: &[(&str, &str, &str)] = &[
    (
        "RAILOVER_IFNAME",
        "every up, non-loopback interface with an address (loopback only if nothing else)",
        "NCCL_SOCKET_IFNAME syntax: prefix list, `^` to exclude, `=` for exact names",
    ),
    (
        "RAILOVER_SPIN_US",
        "200",
        "busy-poll budget in microseconds, 0..=1000000",
    ),
    (
        "RAILOVER_LOG",
        "warn",
        "off|warn|info|debug|trace (stderr only)",
    ),
];

impl Config {
    /// Reads the process environment.
    pub fn from_env() -> Result<Config, ConfigError> {
        Config::from_lookup(|k| std::env::var(k).ok())
    }

    /// Parses from any key lookup (tests pass a map; nothing reads the real environment).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Config, ConfigError> {
        let mut cfg = Config::default();
        if let Some(v) = get("RAILOVER_IFNAME") {
            cfg.ifname = IfFilter::parse(&v).map_err(|_| ConfigError {
                var: "RAILOVER_IFNAME",
                value: v.clone(),
                accepted: "a comma-separated list of interface names or prefixes, optionally starting with ^ (exclude) and/or = (exact)",
            })?;
        }
        if let Some(v) = get("RAILOVER_SPIN_US") {
            let us = parse_u64(&v, 0, 1_000_000).ok_or(ConfigError {
                var: "RAILOVER_SPIN_US",
                value: v.clone(),
                accepted: "an integer number of microseconds from 0 to 1000000",
            })?;
            cfg.spin = Duration::from_micros(us);
        }
        if let Some(v) = get("RAILOVER_LOG") {
            cfg.log = match v.trim().to_ascii_lowercase().as_str() {
                "off" | "none" => LogLevel::Off,
                "warn" => LogLevel::Warn,
                "info" => LogLevel::Info,
                "debug" => LogLevel::Debug,
                "trace" => LogLevel::Trace,
                _ => {
                    return Err(ConfigError {
                        var: "RAILOVER_LOG",
                        value: v,
                        accepted: "one of off, warn, info, debug, trace",
                    })
                }
            };
        }
        Ok(cfg)
    }
}

fn parse_u64(s: &str, min: u64, max: u64) -> Option<u64> {
    s.trim()
        .parse::<u64>()
        .ok()
        .filter(|v| (min..=max).contains(v))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn cfg(pairs: &[(&str, &str)]) -> Result<Config, ConfigError> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Config::from_lookup(|k| map.get(k).cloned())
    }

    #[test]
    fn defaults_without_variables() {
        assert_eq!(cfg(&[]).unwrap(), Config::default());
    }

    #[test]
    fn ifname_syntax() {
        let f = IfFilter::parse("eth,ib").unwrap();
        assert!(f.matches("eth0") && f.matches("ib3") && !f.matches("lo"));
        let f = IfFilter::parse("^docker,lo").unwrap();
        assert!(!f.matches("docker0") && !f.matches("lo") && f.matches("eth0"));
        let f = IfFilter::parse("=eth0").unwrap();
        assert!(f.matches("eth0") && !f.matches("eth01"));
        let f = IfFilter::parse("^=eth0").unwrap();
        assert!(!f.matches("eth0") && f.matches("eth01"));
        assert!(f.given && !f.names_positively("eth01"));
        assert!(IfFilter::parse("lo").unwrap().names_positively("lo"));
    }

    #[test]
    fn bad_values_name_variable_value_and_accepted() {
        for (var, value) in [
            ("RAILOVER_IFNAME", "^"),
            ("RAILOVER_IFNAME", "a b"),
            ("RAILOVER_SPIN_US", "fast"),
            ("RAILOVER_SPIN_US", "-1"),
            ("RAILOVER_SPIN_US", "1000001"),
            ("RAILOVER_LOG", "loud"),
        ] {
            let err = cfg(&[(var, value)]).unwrap_err();
            assert_eq!(err.var, var);
            assert_eq!(err.value, value);
            let msg = err.to_string();
            assert!(
                msg.contains(var) && msg.contains(value) && msg.contains("expected"),
                "{msg}"
            );
        }
    }

    #[test]
    fn good_values_parse() {
        let c = cfg(&[
            ("RAILOVER_SPIN_US", "0"),
            ("RAILOVER_LOG", "INFO"),
            ("RAILOVER_IFNAME", "lo"),
        ])
        .unwrap();
        assert_eq!(c.spin, Duration::ZERO);
        assert_eq!(c.log, LogLevel::Info);
        assert_eq!(c.ifname.names, vec!["lo".to_string()]);
    }
}
