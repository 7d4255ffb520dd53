//! Where each worker's stdout and stderr go: to the console, to log files, both or
//! neither, per local rank, as torchrun's `--redirects` and `--tee` say it (`3`, or
//! `0:3,1:2`), and what the console puts before each line (`--log-line-prefix-template`).

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use crate::output::Stream;

/// A set of a worker's streams: torchrun's `0` (none), `1` (stdout), `2` (stderr),
/// `3` (both).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Streams {
    pub stdout: bool,
    pub stderr: bool,
}

impl Streams {
    pub const NONE: Streams = Streams { stdout: false, stderr: false };
    pub const BOTH: Streams = Streams { stdout: true, stderr: true };

    pub fn has(self, stream: Stream) -> bool {
        match stream {
            Stream::Stdout => self.stdout,
            Stream::Stderr => self.stderr,
        }
    }

    pub fn any(self) -> bool {
        self.stdout || self.stderr
    }

    pub fn union(self, other: Streams) -> Streams {
        Streams { stdout: self.stdout || other.stdout, stderr: self.stderr || other.stderr }
    }

    pub fn minus(self, other: Streams) -> Streams {
        Streams { stdout: self.stdout && !other.stdout, stderr: self.stderr && !other.stderr }
    }

    fn from_digit(text: &str) -> Option<Streams> {
        Some(match text.trim() {
            "0" => Streams::NONE,
            "1" => Streams { stdout: true, stderr: false },
            "2" => Streams { stdout: false, stderr: true },
            "3" => Streams::BOTH,
            _ => return None,
        })
    }

    fn digit(self) -> u8 {
        u8::from(self.stdout) + 2 * u8::from(self.stderr)
    }
}

/// Streams for every local rank (`3`), or per local rank (`0:3,1:2`; a rank not
/// named gets none), as torchrun's `--redirects` and `--tee` take them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PerRank {
    All(Streams),
    Ranks(BTreeMap<u32, Streams>),
}

impl PerRank {
    pub fn get(&self, local_rank: u32) -> Streams {
        match self {
            PerRank::All(streams) => *streams,
            PerRank::Ranks(map) => map.get(&local_rank).copied().unwrap_or_default(),
        }
    }

    /// Whether any stream of any of the first `nproc` local ranks is in the set.
    pub fn any_of(&self, nproc: u32) -> bool {
        (0..nproc).any(|l| self.get(l).any())
    }
}

/// A `--redirects`/`--tee` value that is neither a digit 0-3 nor a rank map.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("'{0}' is not 0 (none), 1 (stdout), 2 (stderr), 3 (both), or a map of local ranks to those, like 0:3,1:2")]
pub struct BadStreams(pub String);

impl FromStr for PerRank {
    type Err = BadStreams;

    fn from_str(text: &str) -> Result<PerRank, BadStreams> {
        let bad = || BadStreams(text.to_owned());
        if let Some(streams) = Streams::from_digit(text) {
            return Ok(PerRank::All(streams));
        }
        let mut map = BTreeMap::new();
        for entry in text.split(',') {
            let (rank, digit) = entry.split_once(':').ok_or_else(bad)?;
            let rank: u32 = rank.trim().parse().map_err(|_| bad())?;
            let streams = Streams::from_digit(digit).ok_or_else(bad)?;
            if map.insert(rank, streams).is_some() {
                return Err(bad());
            }
        }
        Ok(PerRank::Ranks(map))
    }
}

impl fmt::Display for PerRank {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PerRank::All(streams) => write!(f, "{}", streams.digit()),
            PerRank::Ranks(map) => {
                let entries: Vec<String> = map.iter().map(|(r, s)| format!("{r}:{}", s.digit())).collect();
                f.write_str(&entries.join(","))
            }
        }
    }
}

/// Where one worker's streams go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Route {
    pub console: Streams,
    pub files: Streams,
}

/// What the console puts before each line of a worker: `[rankN]: ` by default, or
/// torchrun's `--log-line-prefix-template` with `${role_name}`, `${local_rank}`,
/// `${rank}` and `${hostname}` replaced (anything else is kept as written, as
/// torchrun's substitution does).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LinePrefix {
    template: Option<String>,
}

impl LinePrefix {
    pub fn template(template: impl Into<String>) -> LinePrefix {
        LinePrefix { template: Some(template.into()) }
    }

    /// The prefix of `rank`'s lines; `None`: the default `[rankN]: `, which the
    /// console does not double when torch wrote it already.
    pub fn render(&self, rank: u32, local_rank: u32, role: &str, host: &str) -> Option<String> {
        let template = self.template.as_ref()?;
        Some(
            template
                .replace("${role_name}", role)
                .replace("${local_rank}", &local_rank.to_string())
                .replace("${rank}", &rank.to_string())
                .replace("${hostname}", host),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn torchrun_stream_specs() {
        assert_eq!("3".parse(), Ok(PerRank::All(Streams::BOTH)));
        assert_eq!("0".parse(), Ok(PerRank::All(Streams::NONE)));
        let map: PerRank = "0:3,1:2".parse().unwrap();
        assert_eq!(map.get(0), Streams::BOTH);
        assert_eq!(map.get(1), Streams { stdout: false, stderr: true });
        assert_eq!(map.get(2), Streams::NONE);
        assert_eq!(map.to_string(), "0:3,1:2");
        assert!(map.any_of(1) && !PerRank::All(Streams::NONE).any_of(4));
        for bad in ["4", "", "x", "0:4", "0:3,", "a:1", "0:1,0:2", "-1:3"] {
            assert_eq!(bad.parse::<PerRank>(), Err(BadStreams(bad.to_owned())), "{bad:?}");
        }
    }

    #[test]
    fn set_operations() {
        let out = Streams { stdout: true, stderr: false };
        let err = Streams { stdout: false, stderr: true };
        assert_eq!(out.union(err), Streams::BOTH);
        assert_eq!(Streams::BOTH.minus(out), err);
        assert!(err.has(Stream::Stderr) && !err.has(Stream::Stdout));
    }

    #[test]
    fn prefix_templates() {
        assert_eq!(LinePrefix::default().render(3, 1, "default", "h"), None);
        let p = LinePrefix::template("${hostname}:${rank}: [${role_name}${local_rank}] ${other}");
        assert_eq!(p.render(3, 1, "trainer", "gpu7").as_deref(), Some("gpu7:3: [trainer1] ${other}"));
    }
}
