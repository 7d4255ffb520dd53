//! One attempt of a job on this node: spawn the workers, watch them and the other
//! nodes, and on the first failure take everything down within the grace period.
//!
//! The summary blames the root cause. When a worker fails, node 0 (which hosts the
//! coordinator) asks it which ranks of the attempt it counts as lost: a rank its
//! peers lost (it stopped heartbeating, or dropped its connection before the
//! failure) is the cause, and the failed peer only what revealed it; so is a rank
//! whose worker exited 0 while a barrier of its peers still needed it (every
//! node's launcher reports such ends, so that those peers fail at once). A worker here
//! that failed after another node's launcher aborted the job failed for that
//! node's failure, whose report may still be on its way: node 0 waits briefly for
//! it and gives it as the verdict. The other nodes learn that verdict from node 0
//! and wait briefly for it before their own summary, and take it over a failure of
//! their own that came later, so every node names the same rank; the node running
//! that rank adds its process's state from `/proc`.
//!
//! With a hang timeout, node 0 also watches for a job that does nothing: when its
//! coordinator has had no request from the attempt's processes and its workers have
//! written nothing for that long, it asks the other nodes how long theirs have been
//! quiet ([`crate::stacks`]); if every node agrees, it reads every rank's stack and
//! fails the attempt as hung, with those stacks in the verdict, so every node's
//! summary says where each rank was. And whenever an attempt is taken down, each
//! node first reads the stacks of its ranks still running (bounded) and puts them
//! in its summary: the teardown signal waits for that, the coordinator's abort does
//! not.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::sync::mpsc;
use tokio::time::Instant;

use rallypoint_client::{Client, ConnectOptions, Identity, LossReason, RankInfo, RankState};
use rallypoint_server::ServerHandle;

/// Between aborting the job on the coordinator and signalling the workers: long enough
/// for a worker blocked in a barrier to receive the reason and report it itself, short
/// enough not to matter to a person waiting.
const NOTICE: Duration = Duration::from_millis(100);
/// How long a node other than 0 waits, its workers gone, for node 0's verdict on a
/// failure it saw first (node 0 may know a rank was lost before it): an upper bound,
/// the verdict takes a round trip.
const VERDICT_WAIT: Duration = Duration::from_secs(5);
/// A signal this soon after the first one is that one delivered twice (`timeout`
/// sends it to the launcher and to its process group): the grace goes on.
const SAME_SIGNAL: Duration = Duration::from_secs(1);
/// Between node 0's looks at whether the job is quiet (cheap: in-process only).
const HANG_CHECK_EVERY: Duration = Duration::from_secs(1);
/// How long node 0 waits for the other nodes' answers about a quiet job.
const HANG_ASK_WAIT: Duration = Duration::from_secs(10);
/// How long a connection of the launcher's own is given to close cleanly.
pub(crate) const CLOSE_WAIT: Duration = Duration::from_secs(5);
/// How long a node waits for its own ranks' stacks before the teardown goes on
/// without them.
const CAPTURE_BOUND: Duration = Duration::from_secs(10);

use crate::console::Console;
use crate::error_file::Raised;
use crate::outcome::{
    self, stacks_text, summary, unix_ms, EarlyEnd, Failure, FailureKind, Loss, RankOutcome, LAUNCHER_ABORT,
    STACKS_HEADING,
};
use crate::procs::{self, Family, LAUNCH_ID_VAR};
use crate::rendezvous::{Launchers, Remote, Report};
use crate::stacks::{self, Ask, Collected, Roster};
use crate::watchdog::Watchdog;
use crate::worker::{self, Exited, Running, Spec};
use crate::{Exit, LaunchError, LaunchOptions, Route};
use rallypoint_client::env::{live_output_env, worker_env, JobEnv, Placement};
use rallypoint_client::Token;
use rallypoint_core::snapshot::{LauncherView, WorkerView};
use rallypoint_stacks::Grouped;

pub enum AttemptResult {
    Succeeded,
    /// `raised`: the rank of this node whose error file speaks for the node's failure
    /// (the root cause's if it is here and wrote one, else the first to fail that
    /// did), and how it exited.
    Failed {
        first: Failure,
        raised: Option<(u32, Exit)>,
    },
}

pub struct Attempt<'a> {
    pub options: &'a LaunchOptions,
    pub launchers: &'a Launchers,
    pub job: &'a JobEnv,
    pub host: &'a str,
    pub base_rank: u32,
    pub world_size: u32,
    /// Workers per node, by node.
    pub counts: &'a [u32],
    pub attempt: u32,
    /// The job's token, to abort the job with.
    pub token: Option<Arc<Token>>,
    /// The coordinator, when this launcher hosts it (node 0).
    pub server: Option<&'a ServerHandle>,
    pub console: &'a Arc<Console>,
    pub family: &'a Arc<Family>,
    pub watchdog: Option<&'a Watchdog>,
    /// This node's running workers, for the stacks asked of it.
    pub roster: &'a Arc<Roster>,
    /// The attempt's directory of torch error files ([`crate::error_file`]).
    pub error_files: Option<PathBuf>,
}

/// What tasks of the attempt report back.
enum Event {
    /// Node 0: how long every node's workers have been quiet.
    Probed(Result<Collected, String>),
    /// Node 0: every rank's stack, read because the job looked hung.
    HangStacks(Result<Collected, String>),
    /// This node's ranks' stacks, read as the attempt is taken down (`None`: not
    /// read in time).
    LocalStacks(Option<Grouped>),
}

/// Where a failure was seen.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Origin {
    Here,
    /// Another node's report, or node 0's verdict.
    Remote,
}

impl Attempt<'_> {
    /// Runs the attempt to its end: its workers all exited (or were taken down),
    /// and every node agreed on how it went.
    pub async fn run(&self, signals: &mut mpsc::UnboundedReceiver<i32>) -> Result<AttemptResult, LaunchError> {
        let (exits_tx, mut exits) = mpsc::unbounded_channel::<Exited>();
        let (remote_tx, mut remote) = mpsc::unbounded_channel::<Remote>();
        if self.launchers.nnodes > 1 {
            self.launchers.watch(self.attempt, remote_tx);
        }
        let (events_tx, mut events) = mpsc::unbounded_channel::<Event>();
        let mut state = State { events: Some(events_tx), ..State::default() };
        let mut workers = Workers::default();
        self.roster.start_attempt(&self.job.attempt_job);
        if self.watches_hangs() {
            state.hang_check_at = Some(Instant::now() + self.hang_check_every());
        }
        let log_dir = self.log_dir();
        if let Some(dir) = &log_dir {
            std::fs::create_dir_all(dir).map_err(|e| LaunchError::LogDir { dir: dir.clone(), source: e })?;
        }
        // Without it, workers still run; only what they raise is not read back.
        let error_files = self.error_files.clone().filter(|dir| match std::fs::create_dir_all(dir) {
            Ok(()) => true,
            Err(error) => {
                tracing::warn!(%error, "cannot create the directory of the workers' error files {}", dir.display());
                false
            }
        });
        self.spawn_workers(&mut state, &mut workers, log_dir, error_files.as_deref(), exits_tx);
        self.publish(&state, &workers, None);
        while let Some(verdict_by) = self.waits_for_more(&mut state, &workers) {
            // The teardown signal waits for this node's stacks to be read.
            let term_at = state.term_at.filter(|_| !state.capturing);
            let next_step = [term_at, state.kill_at, verdict_by].into_iter().flatten().min();
            let step = async {
                match next_step {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            let hang_check_at = state.hang_check_at.filter(|_| state.first.is_none() && !state.hang_asking);
            let hang_check = async {
                match hang_check_at {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                Some(exited) = exits.recv() => {
                    self.on_exit(&mut state, &mut workers, exited);
                    self.publish(&state, &workers, None);
                }
                Some(event) = remote.recv() => self.on_remote(&mut state, &workers, event),
                Some(sig) = signals.recv() => self.on_signal(&mut state, &workers, sig),
                Some(event) = events.recv() => self.on_event(&mut state, &workers, event),
                () = step => self.on_step(&mut state, &workers, verdict_by),
                () = hang_check => self.on_hang_check(&mut state),
            }
        }
        // Every worker exited while its stack was being read: what was read still counts.
        let deadline = Instant::now() + CAPTURE_BOUND;
        while state.capturing {
            match tokio::time::timeout_at(deadline, events.recv()).await {
                Ok(Some(Event::LocalStacks(stacks))) => {
                    state.capturing = false;
                    state.local_stacks = stacks;
                }
                Ok(Some(_)) => {}
                Ok(None) | Err(_) => break,
            }
        }
        Ok(self.finish(state, &workers).await)
    }

    /// `<log_dir>/attempt<K>` (K from 1, as "attempt K of N" says), if output of
    /// this node's workers goes to files.
    pub fn log_dir(&self) -> Option<PathBuf> {
        let o = self.options;
        let dir = o.log_dir.as_ref().filter(|_| o.files.any_of(o.nproc_per_node))?;
        Some(crate::attempt_dir(dir, self.attempt))
    }

    /// Starts this node's workers; a worker that cannot start fails the attempt (and
    /// no more are started).
    fn spawn_workers(
        &self,
        state: &mut State,
        workers: &mut Workers,
        log_dir: Option<PathBuf>,
        error_files: Option<&Path>,
        exits: mpsc::UnboundedSender<Exited>,
    ) {
        let o = self.options;
        let inherited_omp = std::env::var_os("OMP_NUM_THREADS").is_some();
        let inherited_unbuffered = std::env::var_os("PYTHONUNBUFFERED").is_some();
        for local_rank in 0..o.nproc_per_node {
            let placement = Placement {
                rank: self.base_rank + local_rank,
                local_rank,
                world_size: self.world_size,
                local_world_size: o.nproc_per_node,
                node_rank: self.launchers.node,
                nnodes: self.launchers.nnodes,
            };
            let mut env = worker_env(self.job, &placement, inherited_omp);
            env.extend(live_output_env(inherited_unbuffered));
            env.push((LAUNCH_ID_VAR, self.family.id().into()));
            let spec = Spec {
                rank: placement.rank,
                local_rank,
                program: o.command[0].clone(),
                args: o.command[1..].to_vec(),
                env,
                console: Arc::clone(self.console),
                prefix: o.line_prefix.render(placement.rank, local_rank, &o.role, self.host),
                route: Route { console: o.console.get(local_rank), files: o.files.get(local_rank) },
                log_dir: log_dir.clone(),
                error_file: error_files.map(|dir| crate::error_file::path(dir, placement.rank)),
            };
            match worker::spawn(spec, self.family, exits.clone()) {
                Ok(r) => {
                    if let Some(watchdog) = self.watchdog {
                        watchdog.watch_group(r.pid);
                    }
                    self.roster.add(placement.rank, r.pid, Arc::clone(&r.heard));
                    workers.pids.push(r.pid);
                    workers.running.push(Some(r));
                }
                Err(e) => {
                    // Could not even start: the attempt fails (no more workers are
                    // started), exiting as a shell would (127 not found, 126 not
                    // executable).
                    let what = FailureKind::NotStarted {
                        rank: placement.rank,
                        local_rank,
                        reason: e.describe(),
                        exit_code: e.exit_code(),
                    };
                    let failure = Failure::now(what, self.launchers.node, self.host);
                    self.fail(state, failure, &workers.running, Origin::Here);
                    break;
                }
            }
        }
    }

    /// Whether the attempt goes on; `Some(verdict_by)`: yes, and until when node 0's
    /// verdict is awaited, if it is. Once every local worker exited, a successful
    /// node still reports to node 0 (or node 0 waits for every node's report).
    fn waits_for_more(&self, state: &mut State, workers: &Workers) -> Option<Option<Instant>> {
        if workers.running.iter().any(Option::is_some) {
            return Some(None);
        }
        if state.first.is_some() {
            return match state.verdict_by {
                Some(by) if !state.verdict_seen && Instant::now() < by => Some(Some(by)),
                _ => None,
            };
        }
        let nnodes = self.launchers.nnodes;
        if nnodes == 1 || state.verdict_ok {
            return None;
        }
        if self.launchers.node == 0 && state.reports_ok.len() as u32 == nnodes - 1 {
            self.launchers.publish(self.attempt, &Report::Succeeded);
            return None;
        }
        if self.launchers.node != 0 && !state.published_success {
            self.launchers.publish(self.attempt, &Report::Succeeded);
            state.published_success = true;
        }
        Some(None)
    }

    /// A worker exited.
    fn on_exit(&self, state: &mut State, workers: &mut Workers, exited: Exited) {
        let Some(r) = workers.running.get_mut(exited.local_rank as usize).and_then(Option::take) else { return };
        self.roster.remove(r.pid);
        state.outcomes.push(RankOutcome {
            rank: self.base_rank + exited.local_rank,
            exit: exited.exit,
            signalled_by_launcher: state.signal_sent,
            after_failure: state.first.is_some(),
            raised: exited.raised.clone(),
        });
        if exited.exit.success() {
            if state.first.is_none() && state.first_done.is_none() {
                state.first_done = Some(EarlyEnd {
                    rank: self.base_rank + exited.local_rank,
                    pid: Some(r.pid),
                    node: Some(self.launchers.node),
                    host: Some(self.host.to_owned()),
                    at_unix_ms: unix_ms(SystemTime::now()),
                });
            }
            self.report_finished(state, self.base_rank + exited.local_rank, r.pid);
            return;
        }
        let failure = self.worker_failure(r.local_rank, r.pid, exited);
        if state.first.is_none() {
            self.fail(state, failure, &workers.running, Origin::Here);
        } else if state.signal_sent.is_none() {
            // Ended by itself before the teardown: may be the lost rank's own end.
            self.reconsider(state, failure, &workers.running);
        }
    }

    /// Tells the coordinator that `rank`'s worker (`pid`) exited with code 0: a
    /// barrier or collective of its peers that still needs it fails at once, naming
    /// it, rather than at its timeout. One connection per attempt and node, made at
    /// the first such end, carries them all (a job's end brings every worker's).
    fn report_finished(&self, state: &mut State, rank: u32, pid: u32) {
        let reports = state
            .finished
            .get_or_insert_with(|| report_finishes(self.job, self.host, self.world_size, self.token.clone()));
        let _ = reports.send((rank, pid));
    }

    /// Another node said how its attempt went (node 0), or node 0 gave its verdict.
    fn on_remote(&self, state: &mut State, workers: &Workers, event: Remote) {
        match event {
            Remote::NodeSucceeded(node) => {
                state.reports_ok.insert(node);
            }
            Remote::VerdictSucceeded => state.verdict_ok = true,
            Remote::Failed(failure) => {
                // Off node 0, this is node 0's verdict.
                state.verdict_seen |= self.launchers.node != 0;
                if state.first.is_none() {
                    self.fail(state, failure, &workers.running, Origin::Remote);
                } else {
                    self.reconsider(state, failure, &workers.running);
                }
            }
        }
    }

    /// The launcher received SIGINT, SIGTERM or SIGHUP.
    fn on_signal(&self, state: &mut State, workers: &Workers, sig: i32) {
        let now = Instant::now();
        let repeat = state.signalled_at.is_some_and(|at| now.duration_since(at) < SAME_SIGNAL);
        state.signalled_at.get_or_insert(now);
        if state.first.is_none() {
            let failure = Failure::now(FailureKind::Interrupted { signal: sig }, self.launchers.node, self.host);
            self.fail(state, failure, &workers.running, Origin::Here);
            // The user asked: pass their signal on at once, no notice period (once
            // this node's stacks are read, if they are being read).
            if state.capturing {
                state.term_signal = Some(sig);
                state.term_at = Some(Instant::now());
            } else {
                state.term_at = None;
                self.signal_all(state, &workers.running, sig);
            }
        } else if !repeat && workers.running.iter().any(Option::is_some) {
            // Asked again while tearing down (a second Ctrl-C): no more grace.
            let what = rallypoint_core::signal_name(sig);
            self.console.message(format!("rallypoint: {what} while the job is taken down: SIGKILL to its workers now"));
            state.term_at = None;
            state.kill_at = Some(now);
        }
    }

    /// The next step of a teardown is due: SIGTERM after the notice, SIGKILL after
    /// the grace, or the end of the wait for node 0's verdict.
    fn on_step(&self, state: &mut State, workers: &Workers, verdict_by: Option<Instant>) {
        let now = Instant::now();
        if state.term_at.is_some_and(|t| t <= now) && !state.capturing {
            state.term_at = None;
            let sig = state.term_signal.unwrap_or(libc::SIGTERM);
            self.signal_all(state, &workers.running, sig);
        } else if state.kill_at.is_some_and(|t| t <= now) {
            for r in workers.running.iter().flatten() {
                worker::signal_group(r.pid, libc::SIGKILL);
            }
            self.family.signal_strays(libc::SIGKILL, &[]);
            state.signal_sent = Some(libc::SIGKILL);
            state.kill_at = None;
        } else if verdict_by.is_some_and(|t| t <= now) {
            tracing::debug!("no verdict from node 0, or no report for node 0; the summary says what this node saw");
            state.verdict_seen = true;
            if state.verdict_held.take().is_some() {
                if let Some(first) = &state.first {
                    self.launchers.publish(self.attempt, &Report::Failed(first.clone()));
                }
            }
        }
    }

    /// Whether this launcher watches for a hung job: node 0 (it hosts the coordinator,
    /// which knows when every rank last asked for something) with a hang timeout.
    fn watches_hangs(&self) -> bool {
        self.options.hang_timeout.is_some() && self.server.is_some()
    }

    fn hang_check_every(&self) -> Duration {
        let timeout = self.options.hang_timeout.unwrap_or(HANG_CHECK_EVERY);
        HANG_CHECK_EVERY.min(timeout / 4).max(Duration::from_millis(50))
    }

    /// How long the job has been quiet as node 0 sees it: no request of the
    /// attempt's processes to the coordinator, no output of this node's workers.
    fn quiet_here(&self) -> Duration {
        let coordinator = self.server.and_then(|s| s.quiet_for(&self.job.attempt_job)).unwrap_or(Duration::MAX);
        coordinator.min(Duration::from_millis(self.roster.quiet_ms()))
    }

    /// Node 0's regular look: quiet for the hang timeout here, the other nodes are
    /// asked (or, alone, the stacks read at once).
    fn on_hang_check(&self, state: &mut State) {
        let Some(timeout) = self.options.hang_timeout else { return };
        let quiet = self.quiet_here();
        if quiet < timeout {
            state.hang_check_at = Some(Instant::now() + (timeout - quiet).max(self.hang_check_every()));
            return;
        }
        let Some(events) = state.events.clone() else { return };
        state.hang_asking = true;
        let client = self.launchers.client();
        let nnodes = self.launchers.nnodes;
        if nnodes == 1 {
            self.read_hang_stacks(state);
            return;
        }
        tokio::spawn(async move {
            let ask = Ask { stacks: false, native: false };
            let got = stacks::request(&client, &ask, Some(nnodes), HANG_ASK_WAIT).await;
            let _ = events.send(Event::Probed(got.map_err(|e| e.to_string())));
        });
    }

    /// Node 0: every rank's stack, as the job looks hung.
    fn read_hang_stacks(&self, state: &mut State) {
        let Some(events) = state.events.clone() else { return };
        state.hang_asking = true;
        let ask = Ask { stacks: true, native: false };
        let nnodes = self.launchers.nnodes;
        if nnodes == 1 {
            // Alone: read here, not through the coordinator.
            let (roster, node, host) = (Arc::clone(self.roster), self.launchers.node, self.host.to_owned());
            tokio::spawn(async move {
                let started = std::time::Instant::now();
                let answer = stacks::answer(&roster, node, &host, &ask).await;
                let elapsed_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
                let collected = Collected { nnodes, answers: vec![answer], unanswered: Vec::new(), elapsed_ms };
                let _ = events.send(Event::HangStacks(Ok(collected)));
            });
        } else {
            let client = self.launchers.client();
            tokio::spawn(async move {
                let got = stacks::request(&client, &ask, Some(nnodes), HANG_ASK_WAIT).await;
                let _ = events.send(Event::HangStacks(got.map_err(|e| e.to_string())));
            });
        }
    }

    /// What a task of the attempt reports.
    fn on_event(&self, state: &mut State, workers: &Workers, event: Event) {
        let timeout = self.options.hang_timeout.unwrap_or(Duration::MAX);
        match event {
            Event::LocalStacks(stacks) => {
                state.capturing = false;
                state.local_stacks = stacks;
            }
            Event::Probed(got) | Event::HangStacks(got) if state.first.is_some() => {
                state.hang_asking = false;
                if let Err(e) = got {
                    tracing::debug!("asking the nodes whether the job is quiet: {e}");
                }
            }
            Event::Probed(got) => {
                state.hang_asking = false;
                match got {
                    Ok(c) => {
                        let quiet = self.quiet_here().min(Duration::from_millis(c.quiet_ms()));
                        if c.unanswered.is_empty() && quiet >= timeout {
                            self.read_hang_stacks(state);
                        } else {
                            let wait = timeout.saturating_sub(quiet).max(self.hang_check_every());
                            state.hang_check_at = Some(Instant::now() + wait);
                        }
                    }
                    Err(e) => {
                        tracing::debug!("asking the nodes whether the job is quiet: {e}");
                        state.hang_check_at = Some(Instant::now() + self.hang_check_every());
                    }
                }
            }
            Event::HangStacks(got) => {
                state.hang_asking = false;
                match got {
                    // Quiet still, by every node's account when its stacks were read.
                    Ok(c) if self.quiet_here().min(Duration::from_millis(c.quiet_ms())) >= timeout => {
                        let quiet = self.quiet_here().min(Duration::from_millis(c.quiet_ms()));
                        let what = FailureKind::Hung {
                            quiet_ms: u64::try_from(quiet.as_millis()).unwrap_or(u64::MAX),
                            timeout_ms: u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
                            stacks: c.grouped(),
                            unanswered: c.unanswered.iter().map(|u| u.node).collect(),
                        };
                        let failure = Failure::now(what, self.launchers.node, self.host);
                        self.fail(state, failure, &workers.running, Origin::Here);
                    }
                    Ok(_) => state.hang_check_at = Some(Instant::now() + self.hang_check_every()),
                    Err(e) => {
                        tracing::debug!("reading the stacks of a quiet job: {e}");
                        state.hang_check_at = Some(Instant::now() + self.hang_check_every());
                    }
                }
            }
        }
    }

    /// This node's running ranks' stacks, read before the teardown signal (with a
    /// hang timeout given; a hang's verdict carries every rank's already).
    fn read_local_stacks(&self, state: &mut State, failure: &Failure) {
        if self.options.hang_timeout.is_none() || matches!(failure.what, FailureKind::Hung { .. }) {
            return;
        }
        let Some(events) = state.events.clone() else { return };
        state.capturing = true;
        let (roster, node, host) = (Arc::clone(self.roster), self.launchers.node, self.host.to_owned());
        tokio::spawn(async move {
            let ask = Ask { stacks: true, native: false };
            let read = tokio::time::timeout(CAPTURE_BOUND, stacks::answer(&roster, node, &host, &ask)).await;
            let _ = events.send(Event::LocalStacks(read.ok().and_then(|a| a.stacks)));
        });
    }

    /// The stacks of this attempt in a file of its log directory, all of them:
    /// `stacks-node<J>.txt` (nodes may share the directory).
    fn write_stacks(&self, first: &Failure, local: Option<&Grouped>) -> Option<PathBuf> {
        let dir = crate::attempt_dir(self.options.log_dir.as_ref()?, self.attempt);
        let (heading, stacks) = match &first.what {
            FailureKind::Hung { stacks, .. } => ("every rank was when the job was found hung", stacks),
            _ => ("this node's ranks still running were when the job was taken down", local?),
        };
        let text = format!(
            "job '{}' {}: {}\nwhere {heading} ({STACKS_HEADING}):\n{}",
            self.options.job,
            crate::attempt_of(self.attempt, self.options.max_restarts),
            first.headline(),
            stacks_text(stacks, "  ", true)
        );
        let path = dir.join(format!("stacks-node{}.txt", self.launchers.node));
        let written = std::fs::create_dir_all(&dir).and_then(|()| std::fs::write(&path, text));
        match written {
            Ok(()) => Some(path),
            Err(error) => {
                tracing::warn!(%error, "cannot write the stacks to {}", path.display());
                None
            }
        }
    }

    /// Every worker exited: whatever they started goes too, in their groups or not
    /// (no worker survives its job), and a failed attempt is summed up.
    async fn finish(&self, mut state: State, workers: &Workers) -> AttemptResult {
        for &pid in &workers.pids {
            worker::signal_group(pid, libc::SIGKILL);
        }
        self.family.kill_strays().await;
        if let Some(watchdog) = self.watchdog {
            for &pid in &workers.pids {
                watchdog.forget_group(pid);
            }
        }
        state.outcomes.sort_by_key(|o| o.rank);
        self.roster.end_attempt();
        match state.first.take() {
            None => {
                self.publish(&state, workers, Some(("succeeded", None)));
                AttemptResult::Succeeded
            }
            Some(first) => {
                let o = self.options;
                let local = state.local_stacks.as_ref();
                let mut text = summary(&o.job, self.attempt, o.max_restarts, &first, &state.outcomes, local);
                if let Some(dir) = self.log_dir() {
                    text.push_str(&format!("logs of this node's ranks: {}\n", dir.display()));
                }
                if let Some(path) = self.write_stacks(&first, local) {
                    text.push_str(&format!("stacks, all of them: {}\n", path.display()));
                }
                let captured = match &first.what {
                    FailureKind::Hung { stacks, .. } => Some(stacks),
                    _ => local,
                };
                if let (Some(observe), Some(grouped)) = (&o.observe, captured) {
                    observe.stacks(stacks::view_of(grouped, unix_ms(std::time::SystemTime::now())));
                }
                let phase = if self.attempt < o.max_restarts { "restarting" } else { "failed" };
                self.publish(&state, workers, Some((phase, Some(text.clone()))));
                self.console.message(text);
                // The root cause speaks for its node, or nobody does (killed by a signal,
                // it wrote nothing: a peer's error is not its); elsewhere, the first rank
                // here that failed by itself, if it wrote what it raised.
                let wrote = |o: &&RankOutcome| matches!(o.raised, Some(Raised::Message(_)));
                let root_here =
                    first.node == self.launchers.node && state.outcomes.iter().any(|o| Some(o.rank) == first.rank());
                let speaker = match root_here {
                    true => state.outcomes.iter().filter(wrote).find(|o| Some(o.rank) == first.rank()),
                    false => state.outcomes.iter().filter(wrote).find(|o| !o.after_failure),
                };
                AttemptResult::Failed { raised: speaker.map(|o| (o.rank, o.exit)), first }
            }
        }
    }

    /// Tells the launch's observer (a live page) where this node's workers stand;
    /// `ended`: the attempt's end and its summary.
    fn publish(&self, state: &State, workers: &Workers, ended: Option<(&str, Option<String>)>) {
        let Some(observe) = &self.options.observe else { return };
        let o = self.options;
        let views = (0..o.nproc_per_node)
            .map(|local_rank| {
                let rank = self.base_rank + local_rank;
                let pid = workers.pids.get(local_rank as usize).copied();
                let running = workers.running.get(local_rank as usize).is_some_and(Option::is_some);
                let outcome = state.outcomes.iter().find(|x| x.rank == rank);
                let (state, exit_code, signal, text) = match (running, outcome, pid) {
                    (true, _, _) => ("running", None, None, None),
                    (false, Some(x), _) => match x.exit {
                        Exit::Code(code) => ("exited", Some(code), None, Some(x.exit.to_string())),
                        Exit::Signal(sig) if x.signalled_by_launcher == Some(sig) => {
                            let text = format!("killed by the launcher ({})", outcome::signal_name(sig));
                            ("signalled", None, Some(sig), Some(text))
                        }
                        Exit::Signal(sig) => ("signalled", None, Some(sig), Some(x.exit.to_string())),
                    },
                    (false, None, None) => ("not_started", None, None, None),
                    (false, None, Some(_)) => ("exiting", None, None, None),
                };
                WorkerView { rank, local_rank, pid, state: state.to_owned(), exit_code, signal, text }
            })
            .collect();
        let (phase, summary) = match ended {
            Some((phase, summary)) => (phase, summary),
            None if state.first.is_some() => ("failing", None),
            None => ("running", None),
        };
        observe.launcher(LauncherView {
            job: o.job.clone(),
            attempt_job: self.job.attempt_job.clone(),
            node: Some(self.launchers.node),
            nnodes: self.launchers.nnodes,
            host: self.host.to_owned(),
            attempt: self.attempt + 1,
            max_restarts: o.max_restarts,
            state: phase.to_owned(),
            workers: views,
            summary,
        });
    }

    fn worker_failure(&self, local_rank: u32, pid: u32, exited: Exited) -> Failure {
        let Exited { exit, stderr_tail, raised, .. } = exited;
        let rank = self.base_rank + local_rank;
        let raised = raised.map(Box::new);
        let what = FailureKind::Worker { rank, local_rank, pid, exit, stderr_tail, raised, after: None };
        Failure::now(what, self.launchers.node, self.host)
    }

    /// The first failure: judge its root cause, tell the other nodes, and abort the
    /// job on the coordinator so peers blocked in barriers fail at once with the
    /// reason; after a short notice, SIGTERM whoever is still running.
    fn fail(&self, state: &mut State, failure: Failure, running: &[Option<Running>], origin: Origin) {
        let failure = self.after_early_end(self.localize(self.judge(failure, state, running), running), state);
        let nnodes = self.launchers.nnodes;
        let here = origin == Origin::Here && nnodes > 1;
        state.verdict_held = if here { self.aborted_elsewhere() } else { None };
        if nnodes > 1 && (self.launchers.node == 0 && state.verdict_held.is_none() || origin == Origin::Here) {
            self.launchers.publish(self.attempt, &Report::Failed(failure.clone()));
        }
        if nnodes > 1 && (self.launchers.node != 0 || state.verdict_held.is_some()) {
            // Node 0 may know better (a rank it counts as lost): its verdict is awaited;
            // on node 0, the report of the failure this one followed.
            state.verdict_by = Some(Instant::now() + VERDICT_WAIT);
        }
        // A worker that ended is lost to its peers by that end, told before the
        // abort, so that they learn of the rank whichever reaches them first. Every
        // node says so, not only the worker's: another node's launcher, told by its
        // report, may abort the job before the worker's own launcher does.
        let worker = match &failure.what {
            FailureKind::Aborted { revealed_by, .. } => revealed_by,
            _ => &failure,
        };
        let exited = match &worker.what {
            FailureKind::Worker { rank, pid, exit, .. } => Some((*rank, worker.host.clone(), *pid, *exit)),
            _ => None,
        };
        abort_job(self.job, self.host, self.world_size, self.token.clone(), exited, failure.abort_reason());
        if running.iter().any(Option::is_some) {
            self.read_local_stacks(state, &failure);
            state.term_at = Some(Instant::now() + NOTICE.min(self.options.grace));
        }
        state.first = Some(failure);
    }

    /// A later failure may say more about the root cause than the first one did:
    /// node 0's verdict naming a lost rank, the lost rank's own exit, or (on node 0)
    /// the failure of a rank the coordinator had lost before the first failure (a
    /// crash on another node, reported after a peer here failed for it).
    fn reconsider(&self, state: &mut State, later: Failure, running: &[Option<Running>]) {
        let Some(first) = &state.first else { return };
        // On node 0, the report of the failure that aborted the job, which one here
        // followed; elsewhere, node 0's verdict on a failure before this node's own
        // (so that every node names the same rank).
        let held = state.verdict_held.as_ref();
        let aborted_for = held.is_some_and(|reason| *reason == later.abort_reason());
        let verdict_before =
            self.launchers.node != 0 && later.node != self.launchers.node && later.at_unix_ms <= first.at_unix_ms;
        let better = match (&first.what, &later.what) {
            _ if aborted_for || verdict_before => true,
            (FailureKind::Worker { rank: failed, .. }, FailureKind::RankLost { rank, .. }) => failed != rank,
            (FailureKind::RankLost { rank: lost, .. }, FailureKind::Worker { rank, .. }) => lost == rank,
            (FailureKind::Worker { rank: failed, .. }, FailureKind::Worker { rank, .. }) => {
                let [own, theirs] = self.lost_at([*failed, *rank]);
                failed != rank && theirs.is_some_and(|lost_at| may_have_caused(lost_at, own, first.at_unix_ms))
            }
            _ => false,
        };
        if better {
            // The report that aborted the job may itself be a consequence: a peer
            // there failed for a rank this coordinator lost first. Judged as a
            // failure here would be.
            let later = if aborted_for { self.judge(later, state, running) } else { later };
            state.first = Some(self.localize(later, running));
        }
        if aborted_for {
            state.verdict_held = None;
            state.verdict_seen = true;
            if let Some(first) = &state.first {
                self.launchers.publish(self.attempt, &Report::Failed(first.clone()));
            }
        }
    }

    /// On node 0: the reason another node's launcher gave when it aborted the
    /// attempt's job, which it does at its first failure, right after reporting it.
    fn aborted_elsewhere(&self) -> Option<String> {
        let (abort, _) = self.server?.aborted(&self.job.attempt_job)?;
        let mine = abort.pid == std::process::id() && abort.host == self.host;
        (abort.by_rank.is_none() && abort.reason.starts_with(LAUNCHER_ABORT) && !mine).then_some(abort.reason)
    }

    /// On node 0: a worker failure whose peers had lost another rank first becomes
    /// that rank's loss. A rank lost by lease is never a consequence of the failure
    /// (killing a worker drops its connection, it does not silence it). A dropped
    /// connection counts only on this node, before the failure (see
    /// [`may_have_caused`]), and not from a worker seen to finish unless a collective
    /// failed for it: torch's processes and clients that never close leave that way
    /// when they are done, and a rank elsewhere that crashed is reported by its own
    /// node (see `reconsider`). A rank done early (finished) is among the lost ranks
    /// only if a collective failed for it.
    fn judge(&self, failure: Failure, state: &State, running: &[Option<Running>]) -> Failure {
        let FailureKind::Worker { rank: failed, .. } = &failure.what else { return failure };
        let Some(server) = self.server else { return failure };
        let now_ms = unix_ms(SystemTime::now());
        let lost = server.lost_ranks(&self.job.attempt_job);
        let failed_for = server.failed_for(&self.job.attempt_job);
        let own = lost_time(&lost, *failed, now_ms);
        let mut cause: Option<(u64, u64, Loss, RankInfo)> = None;
        for info in lost {
            if info.rank == *failed || info.rank >= self.world_size {
                continue;
            }
            let Some((lost_at, last_seen, loss)) = loss_of(&info, now_ms) else { continue };
            if loss == Loss::Disconnected {
                // Seen to finish, and nothing failed for its drop: done, not a cause.
                let finished = state.outcomes.iter().any(|o| o.rank == info.rank && o.exit.success())
                    && failed_for.binary_search(&info.rank).is_err();
                if !self.is_local(info.rank) || finished || !may_have_caused(lost_at, own, failure.at_unix_ms) {
                    continue;
                }
            }
            let earlier = match &cause {
                Some((at, ..)) => lost_at < *at,
                None => true,
            };
            if earlier {
                cause = Some((lost_at, last_seen, loss, info));
            }
        }
        let Some((_, last_seen, loss, info)) = cause else { return self.aborted_for(failure, own) };
        let (node, local_rank) = self.place(info.rank).map_or((failure.node, None), |(n, l)| (n, Some(l)));
        let process = self.process_of(info.rank, info.pid, info.host.as_deref(), running);
        Failure {
            what: FailureKind::RankLost {
                rank: info.rank,
                local_rank,
                pid: info.pid,
                loss,
                last_seen_unix_ms: last_seen,
                process,
                revealed_by: Box::new(failure),
            },
            node,
            host: info.host.unwrap_or_else(|| "?".into()),
            at_unix_ms: now_ms,
        }
    }

    /// On node 0: a worker failure in a job that a rank (or a process of no rank)
    /// aborted first becomes that abort: the peers fail for it, the first of them to
    /// exit is not the cause. Not where the failed worker's rank was lost before the
    /// abort (`own`: when): that abort answered its loss. A launcher's own abort (at
    /// another node's failure) is judged by that failure (see `reconsider`).
    fn aborted_for(&self, failure: Failure, own: Option<u64>) -> Failure {
        let Some(server) = self.server else { return failure };
        let Some((abort, at)) = server.aborted(&self.job.attempt_job) else { return failure };
        if abort.reason.starts_with(LAUNCHER_ABORT) || own.is_some_and(|lost| lost < at) {
            return failure;
        }
        let node = abort.by_rank.and_then(|rank| self.place(rank)).map_or(failure.node, |(node, _)| node);
        let what = FailureKind::Aborted {
            by_rank: abort.by_rank,
            pid: abort.pid,
            reason: abort.reason,
            revealed_by: Box::new(failure),
        };
        Failure { what, node, host: abort.host, at_unix_ms: at }
    }

    /// A worker's failure, with the first rank that exited with code 0 before it
    /// while its peers ran on: seen here, or (node 0) by the coordinator, which every
    /// node's launcher tells of such ends.
    fn after_early_end(&self, mut failure: Failure, state: &State) -> Failure {
        let FailureKind::Worker { rank: failed, after, .. } = &mut failure.what else { return failure };
        let now_ms = unix_ms(SystemTime::now());
        let told = self.server.map(|server| server.finished_ranks(&self.job.attempt_job)).unwrap_or_default();
        let told = told.into_iter().map(|info| EarlyEnd {
            rank: info.rank,
            pid: info.pid,
            node: self.place(info.rank).map(|(node, _)| node),
            host: info.host,
            at_unix_ms: now_ms.saturating_sub(info.last_seen_ms_ago.unwrap_or(0)),
        });
        // A launcher's own sighting (this one's, or the failing node's) has the exact
        // time and host; the coordinator's, the time of the report and the host of
        // the rank's connection.
        let seen: Vec<EarlyEnd> = after.take().map(|a| *a).into_iter().chain(state.first_done.clone()).collect();
        let told: Vec<EarlyEnd> = told.filter(|t| seen.iter().all(|s| s.rank != t.rank)).collect();
        *after = seen
            .into_iter()
            .chain(told)
            .filter(|early| early.rank != *failed && early.at_unix_ms <= failure.at_unix_ms)
            .min_by_key(|early| early.at_unix_ms)
            .map(Box::new);
        failure
    }

    /// When (ms since the epoch) the hosted coordinator lost each of `ranks`, if it
    /// did, from one look at its lost ranks.
    fn lost_at<const N: usize>(&self, ranks: [u32; N]) -> [Option<u64>; N] {
        let now_ms = unix_ms(SystemTime::now());
        let lost = self.server.map(|server| server.lost_ranks(&self.job.attempt_job)).unwrap_or_default();
        ranks.map(|rank| lost_time(&lost, rank, now_ms))
    }

    fn is_local(&self, rank: u32) -> bool {
        rank.checked_sub(self.base_rank).is_some_and(|l| l < self.options.nproc_per_node)
    }

    /// A lost rank of this node, judged elsewhere: add its process's state.
    fn localize(&self, mut failure: Failure, running: &[Option<Running>]) -> Failure {
        if let FailureKind::RankLost { rank, pid, process: process @ None, .. } = &mut failure.what {
            *process = self.process_of(*rank, *pid, Some(&failure.host), running);
        }
        failure
    }

    /// The node and local rank of `rank`.
    fn place(&self, rank: u32) -> Option<(u32, u32)> {
        let mut first = 0u32;
        for (node, &count) in self.counts.iter().enumerate() {
            if rank < first.saturating_add(count) {
                return Some((u32::try_from(node).ok()?, rank - first));
            }
            first = first.saturating_add(count);
        }
        None
    }

    /// The state of `rank`'s process, if it runs on this node: the process the
    /// coordinator names (a wrapper's child, say), when it is one of ours, else the
    /// worker itself.
    fn process_of(
        &self,
        rank: u32,
        pid: Option<u32>,
        host: Option<&str>,
        running: &[Option<Running>],
    ) -> Option<String> {
        let local = rank.checked_sub(self.base_rank).filter(|_| self.is_local(rank))?;
        if let Some(pid) = pid.filter(|&p| host == Some(self.host) && procs::is_descendant(p)) {
            return Some(procs::describe(pid));
        }
        match running.get(local as usize) {
            Some(Some(worker)) => Some(procs::describe(worker.pid)),
            // Its worker exited already.
            _ => Some("gone".into()),
        }
    }

    /// Sends `sig` to every running worker's group and to what left those groups;
    /// SIGKILL follows after the grace period.
    fn signal_all(&self, state: &mut State, running: &[Option<Running>], sig: i32) {
        let groups: Vec<u32> = running.iter().flatten().map(|r| r.pid).collect();
        for &group in &groups {
            worker::signal_group(group, sig);
        }
        self.family.signal_strays(sig, &groups);
        state.signal_sent = Some(sig);
        state.kill_at = Some(Instant::now() + self.options.grace);
    }
}

/// This node's workers: those still running, by local rank, and every group started.
#[derive(Default)]
struct Workers {
    running: Vec<Option<Running>>,
    pids: Vec<u32>,
}

#[derive(Default)]
struct State {
    /// Where the attempt's tasks report (always set once the attempt runs).
    events: Option<mpsc::UnboundedSender<Event>>,
    /// Node 0 with a hang timeout: when to look next whether the job is quiet.
    hang_check_at: Option<Instant>,
    /// Node 0: the other nodes, or every rank's stack, are being asked for.
    hang_asking: bool,
    /// This node's ranks' stacks are being read: the teardown signal waits.
    capturing: bool,
    /// The signal the teardown starts with, if not SIGTERM (the one the launcher received).
    term_signal: Option<i32>,
    /// This node's ranks still running when the attempt was taken down, if read.
    local_stacks: Option<Grouped>,
    first: Option<Failure>,
    outcomes: Vec<RankOutcome>,
    /// The last signal sent to the workers at teardown.
    signal_sent: Option<i32>,
    /// When the workers still alive get SIGTERM (the end of the notice period).
    term_at: Option<Instant>,
    /// When the workers still alive get SIGKILL.
    kill_at: Option<Instant>,
    /// When the launcher first received SIGINT, SIGTERM or SIGHUP.
    signalled_at: Option<Instant>,
    /// Node 0: its first failure came after another node's launcher had aborted the
    /// job (a rank here failed for the abort, before that node's report arrived): the
    /// verdict waits for the report whose headline is this abort's reason.
    verdict_held: Option<String>,
    /// Off node 0: until when to wait for node 0's verdict on a failure seen here (on
    /// node 0: for the report its held verdict waits for).
    verdict_by: Option<Instant>,
    verdict_seen: bool,
    /// Node 0: the nodes that reported success.
    reports_ok: HashSet<u32>,
    /// Not node 0: node 0 said every node succeeded.
    verdict_ok: bool,
    /// Not node 0: this node told node 0 it succeeded.
    published_success: bool,
    /// Where this node's workers that exited with code 0 are reported (rank, pid),
    /// once one did (see `report_finished`).
    finished: Option<mpsc::UnboundedSender<(u32, u32)>>,
    /// This node's first worker that exited with code 0 before any failure.
    first_done: Option<EarlyEnd>,
}

/// Whether a rank lost at `lost_at` may have caused the failure of a worker seen to
/// fail at `failed_at`, the coordinator having lost the failed worker's rank at
/// `own_loss` if it did (ms since the epoch). A rank lost after the failed one was
/// lost for it, however much sooner its own process was reaped: its peers fail at
/// once, and their connections may close while the failed process still exits.
fn may_have_caused(lost_at: u64, own_loss: Option<u64>, failed_at: u64) -> bool {
    match own_loss {
        Some(own) => lost_at < own,
        None => lost_at <= failed_at,
    }
}

/// When `rank` was lost, if it is among `lost` (ms since the epoch).
fn lost_time(lost: &[RankInfo], rank: u32, now_ms: u64) -> Option<u64> {
    lost.iter().find(|info| info.rank == rank).and_then(|info| loss_of(info, now_ms)).map(|(lost_at, ..)| lost_at)
}

/// When a lost rank was lost, when it was last heard from (ms since the epoch, from
/// the coordinator's "ago" and `now_ms`), and how.
fn loss_of(info: &RankInfo, now_ms: u64) -> Option<(u64, u64, Loss)> {
    let last_seen = now_ms.saturating_sub(info.last_seen_ms_ago.unwrap_or(0));
    let reason = match info.state {
        RankState::Lost(reason) => reason,
        // Done when the coordinator learnt of it (its last session's close, or the
        // launcher's report).
        RankState::Finished { pid } => return Some((last_seen, last_seen, Loss::Finished { worker_pid: pid })),
        _ => return None,
    };
    Some(match reason {
        LossReason::LeaseExpired { lease_ms } => {
            (last_seen.saturating_add(lease_ms), last_seen, Loss::Silent { lease_ms })
        }
        // A launcher saw its process end (and reported that end, whose report names
        // it better): judged as the connection the end dropped.
        LossReason::Disconnected | LossReason::Exited { .. } => (last_seen, last_seen, Loss::Disconnected),
    })
}

/// A connection of this launcher's own to the attempt's coordinator job, as a tool
/// (no rank). The world size is stated: a coordinator that knows it takes the report
/// of a rank that ended even before any rank of the job connected and said it.
fn attempt_connection(job: &JobEnv, host: &str, world_size: u32, token: Option<Arc<Token>>) -> ConnectOptions {
    let mut identity = Identity::anonymous(job.attempt_job.clone());
    (identity.host, identity.pid, identity.world_size) = (host.to_owned(), std::process::id(), Some(world_size));
    ConnectOptions::new(job.coordinator.to_string(), identity).with_timeout(Duration::from_secs(5)).with_token(token)
}

/// Starts the task that reports the workers of this node that exit with code 0 to
/// the attempt's coordinator job, over one connection.
fn report_finishes(
    job: &JobEnv,
    host: &str,
    world_size: u32,
    token: Option<Arc<Token>>,
) -> mpsc::UnboundedSender<(u32, u32)> {
    let (tx, mut ends) = mpsc::unbounded_channel::<(u32, u32)>();
    let options = attempt_connection(job, host, world_size, token);
    let host = host.to_owned();
    tokio::spawn(async move {
        let client = match Client::connect_with(options).await {
            Ok(client) => client,
            Err(e) => return tracing::debug!("reporting workers that finished: {e}"),
        };
        while let Some((rank, pid)) = ends.recv().await {
            if let Err(e) = client.rank_exited(rank, &host, pid, Exit::Code(0)).await {
                tracing::debug!("reporting that rank {rank} finished: {e}");
            }
        }
        let _ = tokio::time::timeout(CLOSE_WAIT, client.close()).await;
    });
    tx
}

/// Aborts the attempt's coordinator job in the background: workers blocked in a
/// barrier learn the reason at once instead of waiting for their signal. A rank
/// whose worker ended (`exited`: rank, host, pid, how) is reported lost first, so
/// that its peers are told by name that it was lost, not that the job was aborted:
/// the coordinator may hear of the end later than this launcher does (a grace for
/// its session to resume, a node agent between them), or never (it never connected).
fn abort_job(
    job: &JobEnv,
    host: &str,
    world_size: u32,
    token: Option<Arc<Token>>,
    exited: Option<(u32, String, u32, Exit)>,
    reason: String,
) {
    let options = attempt_connection(job, host, world_size, token);
    tokio::spawn(async move {
        match Client::connect_with(options).await {
            Ok(client) => {
                if let Some((rank, worker_host, pid, exit)) = exited {
                    if let Err(e) = client.rank_exited(rank, &worker_host, pid, exit).await {
                        tracing::debug!("reporting rank {rank}'s end: {e}");
                    }
                }
                if let Err(e) = client.abort(&reason).await {
                    tracing::debug!("aborting the job: {e}");
                }
                let _ = client.close().await;
            }
            Err(e) => tracing::debug!("aborting the job: {e}"),
        }
    });
}
