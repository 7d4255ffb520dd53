//! The contract between a launcher and its workers, from both sides: the variables
//! a launcher sets for each worker ([`worker_env`]: torchrun's, so that torch and
//! tools reading them work unchanged, plus rallypoint's own), and how a client
//! resolves them, and those that Slurm sets for each task, into connection
//! settings ([`Settings`]).
//!
//! Each setting is taken from the first of these that is present: an explicit
//! value ([`Overrides`]), then the variables in the order listed on the field.
//! An empty variable counts as unset. Invalid values are errors naming the
//! variable and the value, never silently ignored.
//!
//! Slurm's variables count only outside a launcher: a process started by
//! `rallypoint launch` or torchrun under `srun` also inherits the `SLURM_*` of the
//! launcher's task, which describe that task, not this worker. So rank, world size
//! and local rank come from Slurm only when neither `RANK` nor `WORLD_SIZE` is set
//! (every launcher sets both), and the job from `SLURM_JOB_ID` only when no
//! launcher named one. [`expand_nodelist`] reads Slurm's compressed host lists
//! (`SLURM_JOB_NODELIST`).

mod slurm;
mod workers;

use std::ffi::OsString;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use rallypoint_core::{Identity, Incarnation};
use rallypoint_net::auth::Token;
use rallypoint_net::tls::{TlsClient, TLS_CA_VAR};

use crate::{Error, DEFAULT_TIMEOUT};

pub use slurm::{expand_nodelist, NodelistError, NodelistProblem, MAX_NODELIST_HOSTS};
pub use workers::{live_output_env, worker_env, JobEnv, Placement};

#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    /// Explicit, else `RALLYPOINT_ADDR`, else `MASTER_ADDR:MASTER_PORT`.
    pub addr: String,
    /// Explicit, else `RALLYPOINT_JOB`, else `TORCHELASTIC_RUN_ID`, else
    /// `SLURM_JOB_ID`, else `"default"`.
    pub job: String,
    /// Explicit, else `RANK`, else `SLURM_PROCID` (outside a launcher: see the module doc).
    pub rank: Option<u32>,
    /// Explicit, else `WORLD_SIZE`, else `SLURM_NTASKS` (outside a launcher).
    pub world_size: Option<u32>,
    /// This process's index among those of the job on its node (which device to
    /// use): `LOCAL_RANK`, else `SLURM_LOCALID` (outside a launcher).
    pub local_rank: Option<u32>,
    /// Explicit, else `RALLYPOINT_ROLE`, else `ROLE_NAME`.
    pub role: Option<String>,
    /// Explicit, else `RALLYPOINT_TIMEOUT` (seconds, may be fractional), else 300 s.
    pub timeout: Duration,
    /// `RALLYPOINT_JOB_INCARNATION` (16 hex digits, as a launcher sets it per attempt):
    /// the job incarnation this process belongs to; unset joins the current one.
    pub job_incarnation: Option<u64>,
    /// Explicit (a token, or a token file), else the file `RALLYPOINT_TOKEN_FILE`
    /// names (it must not be readable by group or others), else `RALLYPOINT_TOKEN`.
    pub token: Option<Arc<Token>>,
    /// Explicit, else `RALLYPOINT_TLS_CA`: connect over TLS, trusting the CA
    /// certificate(s) in this PEM file for the coordinator's certificate.
    pub tls: Option<TlsClient>,
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
    /// The token itself (an argument of a program; a file is safer: see `token_file`).
    pub token: Option<String>,
    /// A file holding the token (`--token-file`).
    pub token_file: Option<PathBuf>,
    /// The CA certificate (PEM) of the coordinator's TLS certificate (`--tls-ca`).
    pub tls_ca: Option<PathBuf>,
}

impl Settings {
    pub fn resolve(overrides: Overrides) -> Result<Settings, Error> {
        resolve_with(overrides, |name| std::env::var_os(name))
    }

    pub fn from_env() -> Result<Settings, Error> {
        Settings::resolve(Overrides::default())
    }

    /// This process's identity: these settings, this machine's hostname, this pid and
    /// this process's incarnation.
    pub fn identity(&self) -> Identity {
        Identity {
            job: self.job.clone(),
            rank: self.rank,
            world_size: self.world_size,
            host: rallypoint_net::hostname(),
            pid: std::process::id(),
            role: self.role.clone(),
            incarnation: Some(crate::process_incarnation()),
            job_incarnation: self.job_incarnation,
            resume: None,
        }
    }

    /// Options to connect with these settings.
    pub fn connect_options(&self) -> crate::ConnectOptions {
        crate::ConnectOptions::new(self.addr.clone(), self.identity())
            .with_timeout(self.timeout)
            .with_token(self.token.clone())
            .with_tls(self.tls.clone())
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
            Some(addr) => {
                rallypoint_net::check_addr(&addr).map_err(|why| config(format!("RALLYPOINT_ADDR: {why}")))?;
                addr
            }
            None => master_addr(var("MASTER_ADDR")?, var("MASTER_PORT")?, var("SLURM_JOB_ID")?.is_some())?,
        },
    };

    let job = match overrides.job {
        Some(job) => job,
        None => first_var(var, &["RALLYPOINT_JOB", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"])?
            .unwrap_or_else(|| "default".to_owned()),
    };

    // Slurm describes this process only if no launcher stands between (module doc).
    let launched = var("RANK")?.is_some() || var("WORLD_SIZE")?.is_some();
    let from_env = |names: [&'static str; 2], min: u32| -> Result<Option<(u32, &'static str)>, Error> {
        let names = if launched { &names[..1] } else { &names[..] };
        for &name in names {
            if let Some(value) = var(name)? {
                return Ok(Some((env_int(&value, name, min)?, name)));
            }
        }
        Ok(None)
    };

    let rank = match overrides.rank {
        Some(rank) => Some((
            u32::try_from(rank).map_err(|_| config(format!("rank={rank} is not a non-negative integer")))?,
            "rank",
        )),
        None => from_env(["RANK", "SLURM_PROCID"], 0)?,
    };
    let world_size = match overrides.world_size {
        Some(n) => Some((world_size_of(n).map_err(config)?, "world_size")),
        None => from_env(["WORLD_SIZE", "SLURM_NTASKS"], 1)?,
    };
    if let (Some((rank, rank_from)), Some((world_size, world_from))) = (rank, world_size) {
        if rank >= world_size {
            // Where the numbers came from, when that is not the obvious RANK and WORLD_SIZE.
            let from =
                [rank_from, world_from].into_iter().filter(|name| name.starts_with("SLURM_")).collect::<Vec<_>>();
            let from = if from.is_empty() { String::new() } else { format!("; from {}", from.join(" and ")) };
            return Err(config(format!(
                "rank {rank} is not below the world size {world_size} (ranks are 0 to {}{from})",
                world_size - 1
            )));
        }
    }
    let (rank, world_size) = (rank.map(|(n, _)| n), world_size.map(|(n, _)| n));
    let local_rank = from_env(["LOCAL_RANK", "SLURM_LOCALID"], 0)?.map(|(n, _)| n);

    let role = match overrides.role {
        Some(role) => Some(role),
        None => first_var(var, &["RALLYPOINT_ROLE", "ROLE_NAME"])?,
    };

    let timeout = match overrides.timeout_secs {
        Some(secs) => seconds(secs).ok_or_else(|| config(not_seconds(format_args!("timeout={secs}"))))?,
        None => match var("RALLYPOINT_TIMEOUT")? {
            Some(value) => value
                .trim()
                .parse()
                .ok()
                .and_then(seconds)
                .ok_or_else(|| config(not_seconds(format_args!("RALLYPOINT_TIMEOUT='{value}'"))))?,
            None => DEFAULT_TIMEOUT,
        },
    };

    let job_incarnation = match var("RALLYPOINT_JOB_INCARNATION")? {
        Some(value) => {
            Some(value.parse::<Incarnation>().map_err(|e| config(format!("RALLYPOINT_JOB_INCARNATION: {e}")))?.0)
        }
        None => None,
    };

    let token = match (overrides.token, overrides.token_file) {
        (Some(_), Some(_)) => return Err(config("give either a token or a token file, not both".to_owned())),
        (Some(token), None) => Some(Token::new(token, "the token argument")),
        (None, Some(path)) => Some(Token::from_file(&path)),
        (None, None) => Token::from_lookup(&lookup).transpose(),
    };
    let token = token.transpose().map_err(|error| config(error.to_string()))?.map(Arc::new);

    let tls_ca = match overrides.tls_ca {
        Some(path) => Some(path),
        None => var(TLS_CA_VAR)?.map(PathBuf::from),
    };
    let tls = tls_ca.map(|ca| TlsClient::from_ca_file(&ca)).transpose().map_err(|error| config(error.to_string()))?;

    Ok(Settings { addr, job, rank, world_size, local_rank, role, timeout, job_incarnation, token, tls })
}

/// The value of the first of `names` that is set.
fn first_var(var: impl Fn(&str) -> Result<Option<String>, Error>, names: &[&str]) -> Result<Option<String>, Error> {
    for name in names {
        if let Some(value) = var(name)? {
            return Ok(Some(value));
        }
    }
    Ok(None)
}

/// `MASTER_ADDR:MASTER_PORT`, bracketing an IPv6 address. Slurm gives no coordinator
/// address, so under Slurm (`slurm`) the error says where one usually runs.
fn master_addr(host: Option<String>, port: Option<String>, slurm: bool) -> Result<String, Error> {
    let (host, port) = match (host, port) {
        (Some(host), Some(port)) => (host, port),
        (Some(_), None) => return Err(config("MASTER_ADDR is set but MASTER_PORT is not".to_owned())),
        (None, _) => {
            let hint = if slurm {
                " (under Slurm: the address of a `rallypoint serve` started by the batch script, \
                 usually on the first host of SLURM_JOB_NODELIST)"
            } else {
                ""
            };
            return Err(config(format!(
                "no coordinator address: set RALLYPOINT_ADDR (host:port), or MASTER_ADDR and MASTER_PORT \
                 (or --addr){hint}"
            )));
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

/// A world size given as a number (`world_size=`), or why no world has it.
pub fn world_size_of(n: i64) -> Result<u32, String> {
    match u32::try_from(n) {
        Ok(n) if n > 0 => Ok(n),
        _ if n <= 0 => Err(format!("world_size={n} is not a positive integer")),
        _ => Err(format!("world_size={n} is more ranks than a world can have (at most {})", u32::MAX)),
    }
}

/// The longest wait a timeout (or lease, or grace) stands for, in seconds: a century.
/// A longer one, `inf` included, means "forever" and is taken as this, a deadline
/// the clock can hold (adding some 10^19 seconds to it would overflow).
pub const LONGEST_WAIT_SECS: f64 = 100.0 * 365.0 * 86_400.0;

/// Seconds a user gave for a wait, capped at [`LONGEST_WAIT_SECS`]; `None` for a
/// negative number or NaN.
pub fn seconds(secs: f64) -> Option<Duration> {
    (secs >= 0.0).then(|| Duration::from_secs_f64(secs.min(LONGEST_WAIT_SECS)))
}

/// The message for seconds [`seconds`] refuses, given as `what` (`timeout=-1`).
pub fn not_seconds(what: impl std::fmt::Display) -> String {
    format!("{what} is not a number of seconds of 0 or more")
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use rallypoint_net::auth::{TOKEN_FILE_VAR, TOKEN_VAR};

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
                local_rank: None,
                role: Some("trainer".into()),
                timeout: DEFAULT_TIMEOUT,
                job_incarnation: None,
                token: None,
                tls: None,
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
            ..Overrides::default()
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
            "RALLYPOINT_TIMEOUT='-1' is not a number of seconds of 0 or more"
        );
        assert_eq!(
            with(("RALLYPOINT_TIMEOUT", "nan")),
            "RALLYPOINT_TIMEOUT='nan' is not a number of seconds of 0 or more"
        );
        let port = config_error(resolve(Overrides::default(), &[("MASTER_ADDR", "h"), ("MASTER_PORT", "http")]));
        assert_eq!(port, "MASTER_PORT='http' is not a port number (1 to 65535)");
        let addr = config_error(resolve(Overrides::default(), &[("RALLYPOINT_ADDR", "localhost")]));
        assert_eq!(addr, "RALLYPOINT_ADDR: 'localhost' has no port: give HOST:PORT, e.g. localhost:29500");
    }

    #[test]
    fn bad_explicit_values() {
        let addr = || Overrides { addr: Some("c:1".into()), ..Overrides::default() };
        let e = config_error(resolve(Overrides { rank: Some(-2), ..addr() }, &[]));
        assert_eq!(e, "rank=-2 is not a non-negative integer");
        let e = config_error(resolve(Overrides { world_size: Some(0), ..addr() }, &[]));
        assert_eq!(e, "world_size=0 is not a positive integer");
        let e = config_error(resolve(Overrides { timeout_secs: Some(f64::NAN), ..addr() }, &[]));
        assert_eq!(e, "timeout=NaN is not a number of seconds of 0 or more");
        let e = config_error(resolve(Overrides { world_size: Some(1 << 40), ..addr() }, &[]));
        assert_eq!(e, "world_size=1099511627776 is more ranks than a world can have (at most 4294967295)");
    }

    #[test]
    fn a_wait_longer_than_a_century_or_infinite_is_a_century() {
        let addr = || Overrides { addr: Some("c:1".into()), ..Overrides::default() };
        let century = Duration::from_secs_f64(LONGEST_WAIT_SECS);
        for secs in [1.8e19, 1e300, f64::INFINITY] {
            let s = resolve(Overrides { timeout_secs: Some(secs), ..addr() }, &[]).unwrap();
            assert_eq!(s.timeout, century, "{secs}");
            // A deadline the clock holds, with room for margins.
            assert!(std::time::Instant::now().checked_add(s.timeout * 2).is_some());
        }
        let s = resolve(Overrides::default(), &[("RALLYPOINT_ADDR", "c:1"), ("RALLYPOINT_TIMEOUT", "inf")]).unwrap();
        assert_eq!(s.timeout, century);
        assert_eq!(seconds(2.5), Some(Duration::from_millis(2_500)));
        assert_eq!(seconds(-0.1), None);
    }

    #[test]
    fn rank_must_be_below_world_size() {
        let e = config_error(resolve(
            Overrides::default(),
            &[("RALLYPOINT_ADDR", "c:1"), ("RANK", "4"), ("WORLD_SIZE", "4")],
        ));
        assert_eq!(e, "rank 4 is not below the world size 4 (ranks are 0 to 3)");
    }

    /// What `srun` sets for task 5 of 8, the second on its node, in job 4242.
    const SLURM: [(&str, &str); 5] = [
        ("SLURM_PROCID", "5"),
        ("SLURM_NTASKS", "8"),
        ("SLURM_LOCALID", "1"),
        ("SLURM_JOB_ID", "4242"),
        ("SLURM_JOB_NODELIST", "node[01-04]"),
    ];

    fn with_slurm(vars: &[(&'static str, &'static str)]) -> Vec<(&'static str, &'static str)> {
        let mut all = SLURM.to_vec();
        all.extend_from_slice(vars);
        all
    }

    #[test]
    fn slurm_variables_outside_a_launcher() {
        let s = resolve(Overrides::default(), &with_slurm(&[("RALLYPOINT_ADDR", "node01:29500")])).unwrap();
        assert_eq!((s.rank, s.world_size, s.local_rank), (Some(5), Some(8), Some(1)));
        assert_eq!(s.job, "4242");
        assert_eq!(s.addr, "node01:29500");
    }

    #[test]
    fn a_launchers_variables_hide_slurms() {
        // A worker of `rallypoint launch` (or torchrun) run by srun: the SLURM_* it
        // inherits describe the launcher's task, not this worker.
        let s = resolve(
            Overrides::default(),
            &with_slurm(&[
                ("RALLYPOINT_ADDR", "node01:29500"),
                ("RANK", "2"),
                ("WORLD_SIZE", "16"),
                ("LOCAL_RANK", "2"),
                ("RALLYPOINT_JOB", "run42"),
            ]),
        )
        .unwrap();
        assert_eq!((s.rank, s.world_size, s.local_rank, s.job.as_str()), (Some(2), Some(16), Some(2), "run42"));
        let s = resolve(
            Overrides::default(),
            &with_slurm(&[("MASTER_ADDR", "node01"), ("MASTER_PORT", "29500"), ("TORCHELASTIC_RUN_ID", "t")]),
        )
        .unwrap();
        assert_eq!(s.job, "t");
        // Either of RANK and WORLD_SIZE marks a launcher: never half from each.
        let s = resolve(Overrides::default(), &with_slurm(&[("RALLYPOINT_ADDR", "c:1"), ("WORLD_SIZE", "2")])).unwrap();
        assert_eq!((s.rank, s.world_size, s.local_rank), (None, Some(2), None));
        let s = resolve(Overrides::default(), &with_slurm(&[("RALLYPOINT_ADDR", "c:1"), ("RANK", "1")])).unwrap();
        assert_eq!((s.rank, s.world_size, s.local_rank), (Some(1), None, None));
    }

    #[test]
    fn explicit_values_win_over_slurms() {
        let overrides =
            Overrides { addr: Some("c:1".into()), rank: Some(0), job: Some("mine".into()), ..Overrides::default() };
        let s = resolve(overrides, &SLURM).unwrap();
        assert_eq!((s.rank, s.world_size, s.local_rank, s.job.as_str()), (Some(0), Some(8), Some(1), "mine"));
    }

    #[test]
    fn bad_slurm_values_name_the_variable() {
        let with = |extra: (&'static str, &'static str)| {
            let mut vars = vec![("RALLYPOINT_ADDR", "c:1")];
            vars.extend(SLURM.iter().filter(|(name, _)| *name != extra.0));
            vars.push(extra);
            config_error(resolve(Overrides::default(), &vars))
        };
        assert_eq!(with(("SLURM_PROCID", "x")), "SLURM_PROCID='x' is not a non-negative integer");
        assert_eq!(with(("SLURM_NTASKS", "0")), "SLURM_NTASKS='0' is not a positive integer");
        assert_eq!(with(("SLURM_LOCALID", "-1")), "SLURM_LOCALID='-1' is not a non-negative integer");
        assert_eq!(with(("LOCAL_RANK", "one")), "LOCAL_RANK='one' is not a non-negative integer");
        assert_eq!(
            with(("SLURM_PROCID", "8")),
            "rank 8 is not below the world size 8 (ranks are 0 to 7; from SLURM_PROCID and SLURM_NTASKS)"
        );
        let e = config_error(resolve(
            Overrides { rank: Some(9), addr: Some("c:1".into()), ..Overrides::default() },
            &SLURM,
        ));
        assert_eq!(e, "rank 9 is not below the world size 8 (ranks are 0 to 7; from SLURM_NTASKS)");
    }

    #[test]
    fn missing_address_under_slurm_says_where_one_runs() {
        let e = config_error(resolve(Overrides::default(), &SLURM));
        assert!(e.starts_with("no coordinator address: set RALLYPOINT_ADDR"), "{e}");
        assert!(e.contains("rallypoint serve") && e.contains("SLURM_JOB_NODELIST"), "{e}");
    }

    #[test]
    fn job_incarnation_is_hex() {
        let s = resolve(
            Overrides::default(),
            &[("RALLYPOINT_ADDR", "c:1"), ("RALLYPOINT_JOB_INCARNATION", "00000000000000ff")],
        )
        .unwrap();
        assert_eq!(s.job_incarnation, Some(255));
        assert_eq!(s.identity().job_incarnation, Some(255));
        let e = config_error(resolve(
            Overrides::default(),
            &[("RALLYPOINT_ADDR", "c:1"), ("RALLYPOINT_JOB_INCARNATION", "x1")],
        ));
        assert_eq!(e, "RALLYPOINT_JOB_INCARNATION: 'x1' is not an incarnation (1 to 16 hex digits)");
    }

    #[test]
    fn tokens_come_from_arguments_then_the_file_variable_then_the_token_variable() {
        let base = [("RALLYPOINT_ADDR", "c:1"), (TOKEN_VAR, "from-env")];
        let token = |text: &str| Some(Arc::new(Token::new(text, "test").expect("token")));
        assert_eq!(resolve(Overrides::default(), &base).expect("env").token, token("from-env"));
        let explicit = Overrides { token: Some("explicit".into()), ..Overrides::default() };
        assert_eq!(resolve(explicit, &base).expect("explicit").token, token("explicit"));
        let missing_file = [("RALLYPOINT_ADDR", "c:1"), (TOKEN_FILE_VAR, "/nonexistent/token"), (TOKEN_VAR, "x")];
        let error = config_error(resolve(Overrides::default(), &missing_file));
        assert!(error.contains("/nonexistent/token"), "{error}");
        let both = Overrides {
            token: Some("a".into()),
            token_file: Some("/tmp/b".into()),
            addr: Some("c:1".into()),
            ..Overrides::default()
        };
        assert!(config_error(resolve(both, &[])).contains("not both"));
        let error = config_error(resolve(
            Overrides::default(),
            &[("RALLYPOINT_ADDR", "c:1"), (TLS_CA_VAR, "/nonexistent/ca.pem")],
        ));
        assert!(error.contains("/nonexistent/ca.pem"), "{error}");
        assert!(!format!("{:?}", resolve(Overrides::default(), &base).expect("env")).contains("from-env"), "redacted");
    }

    #[test]
    fn missing_address() {
        let e = config_error(resolve(Overrides::default(), &[]));
        assert!(e.contains("RALLYPOINT_ADDR") && e.contains("MASTER_ADDR"), "{e}");
        let e = config_error(resolve(Overrides::default(), &[("MASTER_ADDR", "h")]));
        assert_eq!(e, "MASTER_ADDR is set but MASTER_PORT is not");
    }
}
