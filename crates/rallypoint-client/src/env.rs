//! The contract between a launcher and its workers, from both sides: the variables
//! a launcher sets for each worker ([`worker_env`]: torchrun's, so that torch and
//! tools reading them work unchanged, plus rallypoint's own), and how a client
//! resolves them, and those that other launchers such as SLURM wrappers set, into
//! connection settings ([`Settings`]).
//!
//! Each setting is taken from the first of these that is present: an explicit
//! value ([`Overrides`]), then the variables in the order listed on the field.
//! An empty variable counts as unset. Invalid values are errors naming the
//! variable and the value, never silently ignored. [`expand_nodelist`] reads
//! Slurm's compressed host lists (`SLURM_JOB_NODELIST`).

mod slurm;
mod workers;

use std::ffi::OsString;
use std::time::Duration;

use rallypoint_core::Identity;

use crate::{Error, DEFAULT_TIMEOUT};

pub use slurm::{expand_nodelist, NodelistError, NodelistProblem, MAX_NODELIST_HOSTS};
pub use workers::{live_output_env, worker_env, JobEnv, Placement};

#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    /// Explicit, else `RALLYPOINT_ADDR`, else `MASTER_ADDR:MASTER_PORT`.
    pub addr: String,
    /// Explicit, else `RALLYPOINT_JOB`, else `TORCHELASTIC_RUN_ID`, else `"default"`.
    pub job: String,
    /// Explicit, else `RANK`.
    pub rank: Option<u32>,
    /// Explicit, else `WORLD_SIZE`.
    pub world_size: Option<u32>,
    /// Explicit, else `RALLYPOINT_ROLE`, else `ROLE_NAME`.
    pub role: Option<String>,
    /// Explicit, else `RALLYPOINT_TIMEOUT` (seconds, may be fractional), else 300 s.
    pub timeout: Duration,
}

/// Values given explicitly (command-line flags, function arguments); they win over
/// the environment. Numbers are signed so that a negative argument gets a clear error.
#[derive(Debug, Clone, Default)]
pub struct Overrides {
    pub addr: Option<String>,
    pub job: Option<String>,
    pub rank: Option<i64>,
    pub world_size: Option<i64>,
    pub role: Option<String>,
    pub timeout_secs: Option<f64>,
}

impl Settings {
    pub fn resolve(overrides: Overrides) -> Result<Settings, Error> {
        resolve_with(overrides, |name| std::env::var_os(name))
    }

    pub fn from_env() -> Result<Settings, Error> {
        Settings::resolve(Overrides::default())
    }

    /// This process's identity: these settings, this machine's hostname and this pid.
    pub fn identity(&self) -> Identity {
        Identity {
            job: self.job.clone(),
            rank: self.rank,
            world_size: self.world_size,
            host: rallypoint_net::hostname(),
            pid: std::process::id(),
            role: self.role.clone(),
        }
    }

    /// Options to connect with these settings.
    pub fn connect_options(&self) -> crate::ConnectOptions {
        crate::ConnectOptions::new(self.addr.clone(), self.identity()).with_timeout(self.timeout)
    }
}

fn config(message: String) -> Error {
    Error::Config(message)
}

/// Resolution against any variable lookup, so tests need not touch the process environment.
fn resolve_with(overrides: Overrides, lookup: impl Fn(&str) -> Option<OsString>) -> Result<Settings, Error> {
    let var = |name: &str| -> Result<Option<String>, Error> {
        match lookup(name) {
            None => Ok(None),
            Some(value) => match value.into_string() {
                Ok(value) if value.trim().is_empty() => Ok(None),
                Ok(value) => Ok(Some(value)),
                Err(value) => Err(config(format!("{name}={value:?} is not valid UTF-8"))),
            },
        }
    };

    let addr = match overrides.addr {
        Some(addr) => addr,
        None => match var("RALLYPOINT_ADDR")? {
            Some(addr) => addr,
            None => master_addr(var("MASTER_ADDR")?, var("MASTER_PORT")?)?,
        },
    };

    let job = match overrides.job {
        Some(job) => job,
        None => match var("RALLYPOINT_JOB")? {
            Some(job) => job,
            None => var("TORCHELASTIC_RUN_ID")?.unwrap_or_else(|| "default".to_owned()),
        },
    };

    let rank = match overrides.rank {
        Some(rank) => {
            Some(u32::try_from(rank).map_err(|_| config(format!("rank={rank} is not a non-negative integer")))?)
        }
        None => var("RANK")?.map(|v| env_int(&v, "RANK", 0)).transpose()?,
    };
    let world_size = match overrides.world_size {
        Some(n) => Some(
            u32::try_from(n)
                .ok()
                .filter(|&n| n > 0)
                .ok_or_else(|| config(format!("world_size={n} is not a positive integer")))?,
        ),
        None => var("WORLD_SIZE")?.map(|v| env_int(&v, "WORLD_SIZE", 1)).transpose()?,
    };
    if let (Some(rank), Some(world_size)) = (rank, world_size) {
        if rank >= world_size {
            return Err(config(format!(
                "rank {rank} is not below the world size {world_size} (ranks are 0 to {})",
                world_size - 1
            )));
        }
    }

    let role = match overrides.role {
        Some(role) => Some(role),
        None => match var("RALLYPOINT_ROLE")? {
            Some(role) => Some(role),
            None => var("ROLE_NAME")?,
        },
    };

    let timeout = match overrides.timeout_secs {
        Some(secs) => {
            seconds(secs).ok_or_else(|| config(format!("timeout={secs} is not a non-negative number of seconds")))?
        }
        None => match var("RALLYPOINT_TIMEOUT")? {
            Some(value) => value.trim().parse().ok().and_then(seconds).ok_or_else(|| {
                config(format!("RALLYPOINT_TIMEOUT='{value}' is not a non-negative number of seconds"))
            })?,
            None => DEFAULT_TIMEOUT,
        },
    };

    Ok(Settings { addr, job, rank, world_size, role, timeout })
}

/// `MASTER_ADDR:MASTER_PORT`, bracketing an IPv6 address.
fn master_addr(host: Option<String>, port: Option<String>) -> Result<String, Error> {
    let (host, port) = match (host, port) {
        (Some(host), Some(port)) => (host, port),
        (Some(_), None) => return Err(config("MASTER_ADDR is set but MASTER_PORT is not".to_owned())),
        (None, _) => {
            return Err(config(
                "no coordinator address: set RALLYPOINT_ADDR (host:port), or MASTER_ADDR and MASTER_PORT".to_owned(),
            ))
        }
    };
    let port: u16 = port
        .trim()
        .parse()
        .ok()
        .filter(|&p| p != 0)
        .ok_or_else(|| config(format!("MASTER_PORT='{port}' is not a port number (1 to 65535)")))?;
    let host = host.trim();
    if host.contains(':') && !host.starts_with('[') {
        Ok(format!("[{host}]:{port}"))
    } else {
        Ok(format!("{host}:{port}"))
    }
}

/// An integer variable of at least `min` (0 or 1).
fn env_int(value: &str, name: &str, min: u32) -> Result<u32, Error> {
    let kind = if min == 0 { "a non-negative integer" } else { "a positive integer" };
    value
        .trim()
        .parse::<u32>()
        .ok()
        .filter(|&n| n >= min)
        .ok_or_else(|| config(format!("{name}='{value}' is not {kind}")))
}

fn seconds(secs: f64) -> Option<Duration> {
    (secs >= 0.0).then(|| Duration::try_from_secs_f64(secs).ok()).flatten()
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn resolve(overrides: Overrides, vars: &[(&str, &str)]) -> Result<Settings, Error> {
        let vars: HashMap<String, OsString> = vars.iter().map(|(k, v)| (k.to_string(), OsString::from(v))).collect();
        resolve_with(overrides, |name| vars.get(name).cloned())
    }

    fn config_error(result: Result<Settings, Error>) -> String {
        match result {
            Err(Error::Config(message)) => message,
            other => panic!("expected a config error, got {other:?}"),
        }
    }

    #[test]
    fn torchrun_variables() {
        let s = resolve(
            Overrides::default(),
            &[
                ("MASTER_ADDR", "node0"),
                ("MASTER_PORT", "29500"),
                ("RANK", "3"),
                ("WORLD_SIZE", "8"),
                ("TORCHELASTIC_RUN_ID", "run-17"),
                ("ROLE_NAME", "trainer"),
            ],
        )
        .unwrap();
        assert_eq!(
            s,
            Settings {
                addr: "node0:29500".into(),
                job: "run-17".into(),
                rank: Some(3),
                world_size: Some(8),
                role: Some("trainer".into()),
                timeout: DEFAULT_TIMEOUT,
            }
        );
    }

    #[test]
    fn rallypoint_variables_win_over_launcher_ones() {
        let s = resolve(
            Overrides::default(),
            &[
                ("RALLYPOINT_ADDR", "coord:7000"),
                ("MASTER_ADDR", "node0"),
                ("MASTER_PORT", "29500"),
                ("RALLYPOINT_JOB", "mine"),
                ("TORCHELASTIC_RUN_ID", "run-17"),
                ("RALLYPOINT_ROLE", "reader"),
                ("ROLE_NAME", "trainer"),
                ("RALLYPOINT_TIMEOUT", "2.5"),
            ],
        )
        .unwrap();
        assert_eq!(s.addr, "coord:7000");
        assert_eq!(s.job, "mine");
        assert_eq!(s.role.as_deref(), Some("reader"));
        assert_eq!(s.timeout, Duration::from_millis(2500));
    }

    #[test]
    fn explicit_values_win_over_variables() {
        let overrides = Overrides {
            addr: Some("explicit:1".into()),
            job: Some("j".into()),
            rank: Some(0),
            world_size: Some(2),
            role: Some("r".into()),
            timeout_secs: Some(1.0),
        };
        let s = resolve(
            overrides,
            &[("RALLYPOINT_ADDR", "env:2"), ("RANK", "5"), ("WORLD_SIZE", "9"), ("RALLYPOINT_TIMEOUT", "oops")],
        )
        .unwrap();
        assert_eq!(s.addr, "explicit:1");
        assert_eq!((s.rank, s.world_size), (Some(0), Some(2)));
        assert_eq!(s.timeout, Duration::from_secs(1));
    }

    #[test]
    fn defaults_without_rank() {
        let s = resolve(Overrides::default(), &[("RALLYPOINT_ADDR", "c:1"), ("RANK", "")]).unwrap();
        assert_eq!((s.job.as_str(), s.rank, s.world_size, s.role), ("default", None, None, None));
    }

    #[test]
    fn ipv6_master_addr_is_bracketed() {
        let s = resolve(Overrides::default(), &[("MASTER_ADDR", "fe80::1"), ("MASTER_PORT", "29500")]).unwrap();
        assert_eq!(s.addr, "[fe80::1]:29500");
    }

    #[test]
    fn bad_values_name_the_variable_and_value() {
        let base = [("RALLYPOINT_ADDR", "c:1")];
        let with = |extra: (&'static str, &'static str)| {
            let mut vars = base.to_vec();
            vars.push(extra);
            config_error(resolve(Overrides::default(), &vars))
        };
        assert_eq!(with(("WORLD_SIZE", "-3")), "WORLD_SIZE='-3' is not a positive integer");
        assert_eq!(with(("WORLD_SIZE", "0")), "WORLD_SIZE='0' is not a positive integer");
        assert_eq!(with(("RANK", "two")), "RANK='two' is not a non-negative integer");
        assert_eq!(with(("RANK", "-1")), "RANK='-1' is not a non-negative integer");
        assert_eq!(
            with(("RALLYPOINT_TIMEOUT", "-1")),
            "RALLYPOINT_TIMEOUT='-1' is not a non-negative number of seconds"
        );
        assert_eq!(
            with(("RALLYPOINT_TIMEOUT", "inf")),
            "RALLYPOINT_TIMEOUT='inf' is not a non-negative number of seconds"
        );
        let port = config_error(resolve(Overrides::default(), &[("MASTER_ADDR", "h"), ("MASTER_PORT", "http")]));
        assert_eq!(port, "MASTER_PORT='http' is not a port number (1 to 65535)");
    }

    #[test]
    fn bad_explicit_values() {
        let addr = || Overrides { addr: Some("c:1".into()), ..Overrides::default() };
        let e = config_error(resolve(Overrides { rank: Some(-2), ..addr() }, &[]));
        assert_eq!(e, "rank=-2 is not a non-negative integer");
        let e = config_error(resolve(Overrides { world_size: Some(0), ..addr() }, &[]));
        assert_eq!(e, "world_size=0 is not a positive integer");
        let e = config_error(resolve(Overrides { timeout_secs: Some(f64::NAN), ..addr() }, &[]));
        assert_eq!(e, "timeout=NaN is not a non-negative number of seconds");
    }

    #[test]
    fn rank_must_be_below_world_size() {
        let e = config_error(resolve(
            Overrides::default(),
            &[("RALLYPOINT_ADDR", "c:1"), ("RANK", "4"), ("WORLD_SIZE", "4")],
        ));
        assert_eq!(e, "rank 4 is not below the world size 4 (ranks are 0 to 3)");
    }

    #[test]
    fn missing_address() {
        let e = config_error(resolve(Overrides::default(), &[]));
        assert!(e.contains("RALLYPOINT_ADDR") && e.contains("MASTER_ADDR"), "{e}");
        let e = config_error(resolve(Overrides::default(), &[("MASTER_ADDR", "h")]));
        assert_eq!(e, "MASTER_ADDR is set but MASTER_PORT is not");
    }
}
