//! `rallypoint launch`: hosts the coordinator (node 0), spawns the workers with
//! torchrun-compatible environments, and takes the whole job down, on every node,
//! as soon as one worker fails; then says which one, and why.
//!
//! Nothing it does waits on its console ([`console`]: output goes through a bounded
//! queue to threads of its own), and nothing it starts outlives it ([`procs`]: a
//! subreaper that kills whole process groups and what left them; [`watchdog`]: a
//! process that does so when the launcher itself is killed with SIGKILL).

mod console;
pub mod discovery;
mod error_file;
mod node_agent;
mod outcome;
mod output;
mod procs;
mod rendezvous;
pub mod stacks;
mod streams;
mod supervise;
mod watchdog;
mod worker;

use std::ffi::OsString;
use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::mpsc;

use rallypoint_core::snapshot::{LauncherView, StacksView};
use rallypoint_core::Config;
use rallypoint_server::{IpNet, Observer, Server, ServerConfig, ServerHandle, Token};

pub use outcome::{Exit, Failure, FailureKind, Loss, HANG_EXIT};
pub use streams::{BadStreams, LinePrefix, PerRank, Route, Streams};

use console::Console;
use node_agent::NodeAgent;
use procs::Family;
use rallypoint_client::env::JobEnv;
use rallypoint_client::{ConnectOptions, Identity};
pub use rendezvous::{joined_nodes, launched_job, launchers_job, JoinError, Joined};
use rendezvous::{Join, Launchers};
use supervise::{Attempt, AttemptResult};
use watchdog::Watchdog;

/// How long the launcher, done, lets its console show what is queued: a console
/// that does not read is not waited for.
const CONSOLE_CLOSE: Duration = Duration::from_secs(2);
/// How long node 0, refusing a node started differently, keeps the coordinator up
/// so that the other nodes can read what they are refused for.
const REFUSAL_LINGER: Duration = Duration::from_secs(2);

#[derive(Debug, Clone)]
pub struct LaunchOptions {
    pub nproc_per_node: u32,
    pub nnodes: u32,
    /// This node's index, 0..nnodes; node 0 hosts the coordinator. `None`: on one
    /// node, 0; on several, the launcher that can bind `master` on its machine is
    /// node 0 and the others take the next free index when they join.
    pub node_rank: Option<u32>,
    /// Coordinator address: node 0 binds exactly it (port 0: a free one); the other
    /// nodes connect to it. Single node without it: a free port on 127.0.0.1.
    pub master: Option<String>,
    pub job: String,
    /// The workers' role (`ROLE_NAME`): torchrun's `--role`.
    pub role: String,
    /// The name this node goes by in the coordinator's reports and the summaries
    /// (torchrun's `--local-addr`); default: the hostname.
    pub host: Option<String>,
    /// Between SIGTERM and SIGKILL when the job is taken down.
    pub grace: Duration,
    /// Where log files go: `<log_dir>/attempt<K>/rank<N>.{stdout,stderr}`, K counting
    /// attempts from 1. Needed when `files` names any stream.
    pub log_dir: Option<PathBuf>,
    /// Which streams of which local ranks are written to log files.
    pub files: PerRank,
    /// Which streams of which local ranks are shown on the console.
    pub console: PerRank,
    /// What the console puts before each line of a worker.
    pub line_prefix: LinePrefix,
    pub max_restarts: u32,
    /// How long to wait for the coordinator and the other nodes.
    pub join_timeout: Duration,
    /// The hosted coordinator's lease: a rank silent this long is lost (its peers
    /// fail at once, naming it). `None`: the coordinator's default.
    pub lease: Option<Duration>,
    /// Take the job for hung when none of its ranks has written output or asked the
    /// coordinator anything for this long (node 0 watches; every node answers):
    /// every rank's stack is read and shown, and the job taken down (exit code
    /// [`HANG_EXIT`]). With it, every takedown also reads the stacks of the ranks
    /// still running first. `None`: never.
    pub hang_timeout: Option<Duration>,
    /// Host a node agent for this node's workers (their `RALLYPOINT_ADDR`), so the
    /// coordinator holds one connection for the node instead of one per worker.
    pub node_agent: bool,
    /// The job's token, given to every node's launcher (`--token-file`,
    /// RALLYPOINT_TOKEN_FILE, RALLYPOINT_TOKEN). `None` on one node: the launcher
    /// makes one for the job. Several nodes, or a `master` beyond loopback, need a
    /// given one, unless `insecure`.
    pub token: Option<Arc<Token>>,
    /// Run without a token where one would be needed (and make none): anyone who
    /// reaches the coordinator can read, change, join or abort the job.
    pub insecure: bool,
    /// Networks of other machines whose PyTorch TCPStore clients the hosted
    /// coordinator serves (they cannot prove a token): the other nodes of a torch job.
    pub tcpstore_allow: Vec<IpNet>,
    pub command: Vec<OsString>,
    /// Told what the launch does, for a live page (`launch --http`).
    pub observe: Option<Arc<dyn LaunchObserver>>,
}

/// Follows a launch as it goes: what `rallypoint launch --http` serves its page
/// from. Called from the launcher's tasks: each call must return at once.
pub trait LaunchObserver: Send + Sync + std::fmt::Debug {
    /// The coordinator this launcher hosts is up (node 0 only), with the job's token.
    fn coordinator(&self, observer: Observer, token: Option<Arc<Token>>);
    /// This node's workers started or ended, or the attempt ended.
    fn launcher(&self, view: LauncherView);
    /// The workers' stacks were captured (grouped, the smallest group first).
    fn stacks(&self, _stacks: StacksView) {}
}

/// Who most likely holds a port node 0 cannot listen on.
fn in_use_hint(error: &io::Error) -> &'static str {
    match error.kind() {
        io::ErrorKind::AddrInUse => {
            " (another launcher of node 0, or another coordinator, listens there: give each job its own \
             --master-port, and each node its own --node-rank)"
        }
        _ => "",
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    #[error("{0}")]
    Usage(String),
    #[error("cannot host the coordinator at {addr}: {source}{}", in_use_hint(source))]
    Bind { addr: String, source: io::Error },
    #[error("{0}")]
    Io(#[from] io::Error),
    #[error("cannot create the log directory {dir}: {source}")]
    LogDir { dir: PathBuf, source: io::Error },
    #[error("{0}")]
    Coordinator(#[from] rallypoint_client::Error),
    /// Boxed: a join error is large, and launch errors are rare.
    #[error("{0}")]
    Join(Box<JoinError>),
    #[error("cannot create the launcher's private directory in {dir}: {source}")]
    SocketDir { dir: PathBuf, source: io::Error },
    #[error("cannot write the job's token file {path}: {source}")]
    TokenFile { path: PathBuf, source: io::Error },
    #[error("{0}")]
    /// Boxed: an agent error is large, and launch errors are rare.
    NodeAgent(Box<rallypoint_agent::AgentError>),
}

impl From<JoinError> for LaunchError {
    fn from(error: JoinError) -> Self {
        LaunchError::Join(Box::new(error))
    }
}

/// Runs the job to its end; returns the launcher's exit code (0, or the first failure's).
pub async fn launch(options: LaunchOptions) -> Result<i32, LaunchError> {
    validate(&options)?;
    check_exposure(&options).await?;
    let console = Console::start();
    let result = supervised(&options, &console).await;
    console.close(CONSOLE_CLOSE);
    result
}

async fn supervised(options: &LaunchOptions, console: &Arc<Console>) -> Result<i32, LaunchError> {
    let family = Arc::new(Family::new());
    if let Err(error) = procs::become_subreaper() {
        tracing::warn!(%error, "cannot become the subreaper of the workers' processes; orphans they leave go to init");
    }
    procs::spawn_reaper(Arc::clone(&family))?;
    // Forked before any socket or pipe of the job exists, so it holds none of them.
    let watchdog = match Watchdog::start(family.entry()) {
        Ok(watchdog) => {
            family.set_watchdog(watchdog.pid());
            Some(watchdog)
        }
        Err(error) => {
            tracing::warn!(%error, "cannot start the watchdog; if the launcher is killed with SIGKILL, what the workers started may survive");
            None
        }
    };
    let host = options.host.clone().unwrap_or_else(rallypoint_net::hostname);
    // A job's token: given, else made for it (one node on loopback), else none (--insecure).
    let token = match (&options.token, options.insecure) {
        (Some(token), _) => Some(Arc::clone(token)),
        (None, true) => None,
        (None, false) => Some(Arc::new(Token::generate())),
    };
    let token_file = token.as_deref().map(TokenFile::write).transpose()?;
    // torch's error files: beside the log files, kept, when there are any; else in a
    // private directory of this launcher's, removed at its end. Without one the job
    // still runs; only what its workers raise is not read back.
    let error_scratch = match options.log_dir {
        Some(_) => None,
        None => node_agent::SocketDir::create()
            .inspect_err(|error| tracing::warn!(%error, "no directory for the workers' error files"))
            .ok(),
    };
    let error_files = options.log_dir.clone().or_else(|| error_scratch.as_ref().map(|dir| dir.path().to_owned()));
    let server = match options.node_rank {
        Some(0) => Some(host_coordinator(options, token.clone()).await?),
        Some(_) => None,
        None if options.nnodes == 1 => Some(host_coordinator(options, token.clone()).await?),
        None => match host_coordinator(options, token.clone()).await {
            Ok(server) => Some(server),
            // Another machine's address, or another launcher of this machine hosts it.
            Err(LaunchError::Bind { source, .. })
                if matches!(source.kind(), io::ErrorKind::AddrInUse | io::ErrorKind::AddrNotAvailable) =>
            {
                None
            }
            Err(e) => return Err(e),
        },
    };
    let node_rank = if server.is_some() { Some(0) } else { options.node_rank };
    let addr = match (&server, &options.master) {
        (Some(server), _) => server.local_addr().to_string(),
        (None, Some(master)) => master.clone(),
        (None, None) => return Err(LaunchError::Usage("--master is required on nodes other than 0".into())),
    };
    let coordinator: SocketAddr = match &server {
        Some(server) => server.local_addr(),
        None => resolve(&addr).await?,
    };
    console.message(start_line(options, coordinator, node_rank));
    if let Some(observe) = &options.observe {
        match &server {
            Some(server) => observe.coordinator(server.observer(), token.clone()),
            None => console.message(
                "rallypoint: no live page on this node: node 0, which hosts the coordinator, serves it (its --http)"
                    .to_owned(),
            ),
        }
    }
    let mut registration = register(options, coordinator, node_rank, token_file.as_ref().map(|file| file.path.clone()));
    let join = Join {
        addr: &addr,
        job: &options.job,
        node: node_rank,
        nnodes: options.nnodes,
        host: &host,
        timeout: options.join_timeout,
        token: token.clone(),
    };
    let launchers = match Launchers::join(&join, console).await {
        Ok(launchers) => launchers,
        Err(LaunchError::Join(e)) if server.is_some() && e.is_refusal() => {
            // The other nodes learn why from the claims on this coordinator: it stays
            // up a moment for them to read.
            tokio::time::sleep(REFUSAL_LINGER).await;
            return Err(LaunchError::Join(e));
        }
        Err(e) => return Err(e),
    };
    if let Some(registration) = &mut registration {
        registration.set_node_rank(launchers.node);
    }
    // Answers `rallypoint status --stacks` and node 0's questions about a quiet job.
    let roster = Arc::new(stacks::Roster::default());
    let responder = stacks::spawn_responder(launchers.client(), launchers.node, host.clone(), Arc::clone(&roster));
    // After the join: the coordinator is known to be up, so the agent connects at once.
    let node_agent = if options.node_agent {
        Some(NodeAgent::start(&coordinator.to_string(), &host, options.join_timeout, token.clone()).await?)
    } else {
        None
    };
    let signals = forward_signals()?;
    let run = Run {
        options,
        token: token.clone(),
        token_file: token_file.as_ref().map(|file| file.path.clone()),
        launchers: &launchers,
        server: server.as_ref(),
        coordinator,
        node_agent: node_agent.as_ref().map(|a| a.addr().to_owned()),
        host: &host,
        console,
        family: &family,
        watchdog: watchdog.as_ref(),
        registration: registration.map(std::sync::Mutex::new),
        roster: &roster,
        error_files: error_files.as_deref(),
    };
    let result = run_attempts(&run, signals).await;
    responder.abort();
    // Every worker has exited: no rank is left behind the agent.
    if let Some(node_agent) = node_agent {
        node_agent.stop().await;
    }
    // The other launchers' coordinator may be going away as this one leaves.
    let _ = tokio::time::timeout(supervise::CLOSE_WAIT, launchers.close()).await;
    if let Some(server) = server {
        server.shutdown().await;
    }
    // Everything the job started is gone: the watchdog has nothing left to do.
    if let Some(watchdog) = watchdog {
        watchdog.disarm();
    }
    result
}

/// What every attempt of a launch shares.
struct Run<'a> {
    options: &'a LaunchOptions,
    /// The job's token (its launchers, workers and coordinator prove it).
    token: Option<Arc<Token>>,
    /// Where the workers find it.
    token_file: Option<PathBuf>,
    launchers: &'a Launchers,
    server: Option<&'a ServerHandle>,
    coordinator: SocketAddr,
    node_agent: Option<String>,
    host: &'a str,
    console: &'a Arc<Console>,
    family: &'a Arc<Family>,
    watchdog: Option<&'a Watchdog>,
    /// What `rallypoint status` finds of this launcher; removed when dropped.
    registration: Option<std::sync::Mutex<discovery::Registration>>,
    roster: &'a Arc<stacks::Roster>,
    /// Where each attempt's directory of torch error files goes ([`error_file`]).
    error_files: Option<&'a Path>,
}

async fn run_attempts(run: &Run<'_>, mut signals: mpsc::UnboundedReceiver<i32>) -> Result<i32, LaunchError> {
    let options = run.options;
    let mut attempt = 0;
    loop {
        let attempt_job = if attempt == 0 { options.job.clone() } else { format!("{}.restart{attempt}", options.job) };
        // Each attempt is a fresh job incarnation: node 0 starts it before it joins the
        // rendezvous, and the other nodes, once past the rendezvous, read it, with the
        // launcher's own client of the attempt's job, which proves the job's token.
        let options_of_job = || {
            ConnectOptions::new(run.coordinator.to_string(), Identity::anonymous(attempt_job.as_str()))
                .with_timeout(options.join_timeout)
                .with_token(run.token.clone())
        };
        let started = match run.launchers.node {
            0 => Some(rallypoint_client::reset_job(options_of_job()).await?),
            _ => None,
        };
        let layout = run
            .launchers
            .rendezvous(&options.job, attempt, options.max_restarts, options.nproc_per_node, options.join_timeout)
            .await?;
        let job_incarnation = match started {
            Some(incarnation) => Some(incarnation),
            None => rallypoint_client::job_incarnation(options_of_job()).await?,
        };
        let job = JobEnv {
            coordinator: run.coordinator,
            node_agent: run.node_agent.clone(),
            run_id: options.job.clone(),
            role: options.role.clone(),
            attempt_job,
            restart_count: attempt,
            max_restarts: options.max_restarts,
            job_incarnation,
            token_file: run.token_file.clone(),
        };
        // torch's TCPStore clients (MASTER_ADDR/MASTER_PORT point here) cannot name a
        // job: they join the attempt's, so their keys and ranks are the workers'.
        if let Some(server) = run.server {
            server.set_tcpstore_job(&job.attempt_job);
        }
        if let Some(registration) = &run.registration {
            registration.lock().unwrap_or_else(|e| e.into_inner()).set_attempt_job(&job.attempt_job);
        }
        let attempt_run = Attempt {
            options,
            launchers: run.launchers,
            job: &job,
            host: run.host,
            base_rank: layout.base_rank,
            world_size: layout.world_size,
            counts: &layout.counts,
            attempt,
            token: run.token.clone(),
            server: run.server,
            console: run.console,
            family: run.family,
            watchdog: run.watchdog,
            roster: run.roster,
            error_files: run.error_files.map(|dir| attempt_dir(dir, attempt)),
        };
        let result = attempt_run.run(&mut signals).await?;
        match result {
            AttemptResult::Succeeded => {
                // Said as failures are, so that a job's end is told, not only its failures.
                let last = layout.base_rank + options.nproc_per_node - 1;
                let ranks = match options.nproc_per_node {
                    1 => format!("rank {last}"),
                    _ => format!("ranks {}-{last}", layout.base_rank),
                };
                let logs =
                    attempt_run.log_dir().map_or(String::new(), |dir| format!("; their logs are in {}", dir.display()));
                // An abort every rank lived through: not the success it looks like.
                let aborted =
                    run.server.and_then(|server| server.aborted(&job.attempt_job)).map_or(String::new(), |(by, _)| {
                        format!("; but the job was aborted by {by}, and its ranks exited with code 0 all the same")
                    });
                run.console.message(format!(
                    "rallypoint: job '{}' succeeded ({}): {ranks} on this node exited with code 0{logs}{aborted}",
                    options.job,
                    attempt_of(attempt, options.max_restarts),
                ));
                run.launchers.farewell(attempt).await;
                return Ok(0);
            }
            AttemptResult::Failed { first, raised } => {
                let interrupted = matches!(first.what, FailureKind::Interrupted { .. });
                if attempt < options.max_restarts && !interrupted {
                    run.console.message(format!(
                        "rallypoint: job '{}' {} failed ({}); restarting ({} of {} restarts)",
                        options.job,
                        attempt_of(attempt, options.max_restarts),
                        first.headline(),
                        attempt + 1,
                        options.max_restarts
                    ));
                    attempt += 1;
                    continue;
                }
                if let (Some(dir), Some((rank, exit))) = (&attempt_run.error_files, raised) {
                    pass_on_error_file(error_file::path(dir, rank), exit).await;
                }
                run.launchers.farewell(attempt).await;
                return Ok(first.exit_code());
            }
        }
    }
}

/// `<base>/attempt<K>`, attempt `attempt` counted from 1 there, as "attempt K of N" says.
pub(crate) fn attempt_dir(base: &Path, attempt: u32) -> PathBuf {
    base.join(format!("attempt{}", attempt + 1))
}

/// A launcher run by something that reads torch's error files (its own
/// `TORCHELASTIC_ERROR_FILE` set, as a scheduler sets it for torchrun) gets the file
/// of the rank that speaks for this node's failure, as torchrun's agent passes it on.
async fn pass_on_error_file(ours: PathBuf, exit: Exit) {
    let Some(parent) = std::env::var_os(error_file::VAR).filter(|path| !path.is_empty()) else { return };
    let code = match exit {
        Exit::Code(code) => code,
        Exit::Signal(signal) => -signal,
    };
    if let Err(error) = error_file::pass_on(ours, PathBuf::from(&parent), code).await {
        tracing::warn!(%error, "cannot pass the root cause's error file on to {}", Path::new(&parent).display());
    }
}

/// The line a launcher starts with: where its coordinator is, and how to look at the
/// job there.
fn start_line(o: &LaunchOptions, coordinator: SocketAddr, node_rank: Option<u32>) -> String {
    let whose = match (node_rank, o.nnodes) {
        (Some(0), 1) => "hosted by this launcher".to_owned(),
        (Some(0), n) => format!("hosted by this launcher, node 0 of {n}"),
        (Some(node), n) => format!("hosted by node 0; this is node {node} of {n}"),
        (None, n) => format!("hosted by node 0 of {n}; this node takes the next free index"),
    };
    let workers = if o.nproc_per_node == 1 { "1 worker".to_owned() } else { format!("{} workers", o.nproc_per_node) };
    format!(
        "rallypoint: job '{}': coordinator at {coordinator} ({whose}), {workers} on this node; \
         inspect it with: rallypoint status --addr {coordinator} --job {}",
        o.job,
        shell_word(&o.job)
    )
}

/// `word` as one shell word: quoted unless it is plainly safe.
fn shell_word(word: &str) -> String {
    let plain = !word.is_empty() && word.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-/:=@%+,".contains(&b));
    if plain {
        word.to_owned()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

/// Tells `rallypoint status` on this machine where this launcher's coordinator is.
fn register(
    o: &LaunchOptions,
    coordinator: SocketAddr,
    node_rank: Option<u32>,
    token_file: Option<PathBuf>,
) -> Option<discovery::Registration> {
    let command: Vec<String> = o.command.iter().map(|a| shell_word(&a.to_string_lossy())).collect();
    let entry = discovery::Entry {
        pid: 0,
        start_ticks: 0,
        addr: coordinator.to_string(),
        job: o.job.clone(),
        attempt_job: o.job.clone(),
        node_rank,
        nnodes: o.nnodes,
        nproc_per_node: o.nproc_per_node,
        command: command.join(" "),
        started_unix_ms: outcome::unix_ms(std::time::SystemTime::now()),
        token_file,
    };
    match discovery::Registration::create(entry) {
        Ok(registration) => Some(registration),
        Err(error) => {
            tracing::warn!(%error, "cannot tell `rallypoint status` where this launcher's coordinator is");
            None
        }
    }
}

/// "attempt 2 of 3": attempts count from 1, as the log folders (`attempt2/`) do.
pub(crate) fn attempt_of(attempt: u32, max_restarts: u32) -> String {
    format!("attempt {} of {}", attempt + 1, max_restarts.saturating_add(1))
}

fn validate(o: &LaunchOptions) -> Result<(), LaunchError> {
    let usage = |m: String| Err(LaunchError::Usage(m));
    if o.command.is_empty() {
        return usage("no command to launch: put it after `--`".into());
    }
    if o.nproc_per_node == 0 {
        return usage("--nproc-per-node must be at least 1".into());
    }
    if o.nnodes == 0 {
        return usage("--nnodes must be at least 1".into());
    }
    if let Some(node_rank) = o.node_rank.filter(|&n| n >= o.nnodes) {
        return usage(format!("--node-rank {node_rank} is out of range for --nnodes {} (0..{})", o.nnodes, o.nnodes));
    }
    if o.nnodes > 1 && o.master.is_none() {
        return usage("--master HOST:PORT is required with --nnodes > 1".into());
    }
    if o.job.is_empty() {
        return usage("--job must not be empty".into());
    }
    // The coordinator's jobs the launch uses: the job's attempts, and its launchers'.
    let longest_suffix = match o.max_restarts {
        0 => rendezvous::LAUNCHERS_SUFFIX.len(),
        n => format!(".restart{n}").len().max(rendezvous::LAUNCHERS_SUFFIX.len()),
    };
    let most = Config::default().limits.max_name_len.saturating_sub(longest_suffix);
    if o.job.len() > most {
        return usage(format!(
            "--job: a name of {} bytes is too long: at most {most} (a coordinator's job names are at most {} \
             bytes, and the launch adds up to {longest_suffix}: '{}' for its launchers, '.restartN' for restarts)",
            o.job.len(),
            most + longest_suffix,
            rendezvous::LAUNCHERS_SUFFIX
        ));
    }
    if o.log_dir.is_none() && o.files.any_of(o.nproc_per_node) {
        return usage("log files need a directory: give --log-dir".into());
    }
    Ok(())
}

/// A coordinator reachable from other machines needs a token every launcher
/// shares, so that only the job's own processes can use it: refused without one
/// unless `--insecure` says otherwise.
async fn check_exposure(o: &LaunchOptions) -> Result<(), LaunchError> {
    if o.token.is_some() || o.insecure {
        return Ok(());
    }
    let how = "give every node's launcher the same token: --token-file PATH (a file only you can read, \
               e.g. made with `openssl rand -hex 32 > PATH && chmod 600 PATH`), or RALLYPOINT_TOKEN_FILE \
               or RALLYPOINT_TOKEN; or pass --insecure to run without authentication";
    if o.nnodes > 1 {
        return Err(LaunchError::Usage(format!(
            "a job of {} nodes needs a token that all of its launchers share (each would make its own and \
             refuse the others'): {how}",
            o.nnodes
        )));
    }
    if let Some(master) = &o.master {
        let addr = resolve(master).await?;
        if !addr.ip().is_loopback() {
            return Err(LaunchError::Usage(format!(
                "--master {master} listens beyond this machine, and without a token anyone who can reach it \
                 could read and change the job's keys, join it under any rank, or abort it: {how}"
            )));
        }
    }
    Ok(())
}

/// The job's token in a file of a private directory (mode 0700, the file 0600),
/// whose path the workers get in RALLYPOINT_TOKEN_FILE: a file rather than the
/// token in their environment, since environments end up in logs and crash
/// reports (and every child process inherits them). Removed when dropped; left by a
/// launcher killed with SIGKILL, it is removed by the next launch of this user.
struct TokenFile {
    path: PathBuf,
    _dir: node_agent::SocketDir,
}

impl TokenFile {
    fn write(token: &Token) -> Result<TokenFile, LaunchError> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let dir = node_agent::SocketDir::create()?;
        let path = dir.path().join("token");
        let written = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .and_then(|mut file| file.write_all(token.secret()));
        written.map_err(|source| LaunchError::TokenFile { path: path.clone(), source })?;
        Ok(TokenFile { path, _dir: dir })
    }
}

async fn host_coordinator(options: &LaunchOptions, token: Option<Arc<Token>>) -> Result<ServerHandle, LaunchError> {
    let listen = match &options.master {
        Some(master) => resolve(master).await?,
        None => SocketAddr::from(([127, 0, 0, 1], 0)),
    };
    let mut engine = Config::default();
    if let Some(lease) = options.lease {
        engine.lease_ms = u64::try_from(lease.as_millis()).unwrap_or(u64::MAX);
    }
    let mut config = ServerConfig::new(listen, engine);
    config.token = token;
    config.tcpstore_allow = options.tcpstore_allow.clone();
    let server = Server::bind(config).await.map_err(|source| LaunchError::Bind { addr: listen.to_string(), source })?;
    Ok(server.spawn())
}

async fn resolve(addr: &str) -> Result<SocketAddr, LaunchError> {
    let mut found = tokio::net::lookup_host(addr)
        .await
        .map_err(|e| LaunchError::Usage(format!("bad coordinator address '{addr}': {e}")))?;
    found.next().ok_or_else(|| LaunchError::Usage(format!("coordinator address '{addr}' resolves to nothing")))
}

/// SIGINT, SIGTERM and SIGHUP to the launcher, as signal numbers to forward.
fn forward_signals() -> io::Result<mpsc::UnboundedReceiver<i32>> {
    let (tx, rx) = mpsc::unbounded_channel();
    for (kind, number) in [
        (SignalKind::interrupt(), libc::SIGINT),
        (SignalKind::terminate(), libc::SIGTERM),
        (SignalKind::hangup(), libc::SIGHUP),
    ] {
        let mut stream = signal(kind)?;
        let tx = tx.clone();
        tokio::spawn(async move {
            while stream.recv().await.is_some() {
                if tx.send(number).is_err() {
                    break;
                }
            }
        });
    }
    Ok(rx)
}
