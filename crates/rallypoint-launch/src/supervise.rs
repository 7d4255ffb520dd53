//! One attempt of a job on this node: spawn the workers, watch them and the other
//! nodes, and on the first failure take everything down within the grace period.
//!
//! The summary blames the root cause. When a worker fails, node 0 (which hosts the
//! coordinator) asks it which ranks of the attempt it counts as lost: a rank its
//! peers lost (it stopped heartbeating, or dropped its connection before the
//! failure) is the cause, and the failed peer only what revealed it. The other
//! nodes learn that verdict from node 0 and wait briefly for it before their own
//! summary, so every node names the same rank; the node running that rank adds its
//! process's state from `/proc`.

use std::collections::HashSet;
use std::path::PathBuf;
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

use crate::console::Console;
use crate::outcome::{self, summary, unix_ms, Failure, FailureKind, Loss, RankOutcome};
use crate::procs::{self, Family, LAUNCH_ID_VAR};
use crate::rendezvous::{Launchers, Remote, Report};
use crate::watchdog::Watchdog;
use crate::worker::{self, Exited, Running, Spec};
use crate::{Exit, LaunchError, LaunchOptions, Route};
use rallypoint_client::env::{live_output_env, worker_env, JobEnv, Placement};
use rallypoint_client::Token;
use rallypoint_core::snapshot::{LauncherView, WorkerView};

pub enum AttemptResult {
    Succeeded,
    Failed { first: Failure },
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
        let mut state = State::default();
        let mut workers = Workers::default();
        let log_dir = self.log_dir();
        if let Some(dir) = &log_dir {
            std::fs::create_dir_all(dir).map_err(|e| LaunchError::LogDir { dir: dir.clone(), source: e })?;
        }
        self.spawn_workers(&mut state, &mut workers, log_dir, exits_tx);
        self.publish(&state, &workers, None);
        while let Some(verdict_by) = self.waits_for_more(&mut state, &workers) {
            let next_step = [state.term_at, state.kill_at, verdict_by].into_iter().flatten().min();
            let step = async {
                match next_step {
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
                () = step => self.on_step(&mut state, &workers, verdict_by),
            }
        }
        Ok(self.finish(state, &workers).await)
    }

    /// `<log_dir>/attempt<K>` (K from 1, as "attempt K of N" says), if output of
    /// this node's workers goes to files.
    pub fn log_dir(&self) -> Option<PathBuf> {
        let o = self.options;
        let dir = o.log_dir.as_ref().filter(|_| o.files.any_of(o.nproc_per_node))?;
        Some(dir.join(format!("attempt{}", self.attempt + 1)))
    }

    /// Starts this node's workers; a worker that cannot start fails the attempt (and
    /// no more are started).
    fn spawn_workers(
        &self,
        state: &mut State,
        workers: &mut Workers,
        log_dir: Option<PathBuf>,
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
            };
            match worker::spawn(spec, self.family, exits.clone()) {
                Ok(r) => {
                    if let Some(watchdog) = self.watchdog {
                        watchdog.watch_group(r.pid);
                    }
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
        state.outcomes.push(RankOutcome {
            rank: self.base_rank + exited.local_rank,
            exit: exited.exit,
            signalled_by_launcher: state.signal_sent,
            after_failure: state.first.is_some(),
        });
        if exited.exit.success() {
            return;
        }
        let failure = self.worker_failure(r.local_rank, r.pid, exited.exit, exited.stderr_tail);
        if state.first.is_none() {
            self.fail(state, failure, &workers.running, Origin::Here);
        } else if state.signal_sent.is_none() {
            // Ended by itself before the teardown: may be the lost rank's own end.
            self.reconsider(state, failure, &workers.running);
        }
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
        if state.first.is_none() {
            let failure = Failure::now(FailureKind::Interrupted { signal: sig }, self.launchers.node, self.host);
            self.fail(state, failure, &workers.running, Origin::Here);
            // The user asked: pass their signal on at once, no notice period.
            state.term_at = None;
            self.signal_all(state, &workers.running, sig);
        } else {
            // A second signal while tearing down: no more grace.
            state.term_at = None;
            state.kill_at = Some(Instant::now());
        }
    }

    /// The next step of a teardown is due: SIGTERM after the notice, SIGKILL after
    /// the grace, or the end of the wait for node 0's verdict.
    fn on_step(&self, state: &mut State, workers: &Workers, verdict_by: Option<Instant>) {
        let now = Instant::now();
        if state.term_at.is_some_and(|t| t <= now) {
            state.term_at = None;
            self.signal_all(state, &workers.running, libc::SIGTERM);
        } else if state.kill_at.is_some_and(|t| t <= now) {
            for r in workers.running.iter().flatten() {
                worker::signal_group(r.pid, libc::SIGKILL);
            }
            self.family.signal_strays(libc::SIGKILL, &[]);
            state.signal_sent = Some(libc::SIGKILL);
            state.kill_at = None;
        } else if verdict_by.is_some_and(|t| t <= now) {
            tracing::debug!("no verdict from node 0; the summary says what this node saw");
            state.verdict_seen = true;
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
        match state.first.take() {
            None => {
                self.publish(&state, workers, Some(("succeeded", None)));
                AttemptResult::Succeeded
            }
            Some(first) => {
                let o = self.options;
                let mut text = summary(&o.job, self.attempt, o.max_restarts, &first, &state.outcomes);
                if let Some(dir) = self.log_dir() {
                    text.push_str(&format!("logs of this node's ranks: {}\n", dir.display()));
                }
                let phase = if self.attempt < o.max_restarts { "restarting" } else { "failed" };
                self.publish(&state, workers, Some((phase, Some(text.clone()))));
                self.console.message(text);
                AttemptResult::Failed { first }
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

    fn worker_failure(&self, local_rank: u32, pid: u32, exit: Exit, stderr_tail: Vec<String>) -> Failure {
        Failure::now(
            FailureKind::Worker { rank: self.base_rank + local_rank, local_rank, pid, exit, stderr_tail },
            self.launchers.node,
            self.host,
        )
    }

    /// The first failure: judge its root cause, tell the other nodes, and abort the
    /// job on the coordinator so peers blocked in barriers fail at once with the
    /// reason; after a short notice, SIGTERM whoever is still running.
    fn fail(&self, state: &mut State, failure: Failure, running: &[Option<Running>], origin: Origin) {
        let failure = self.localize(self.judge(failure, state, running), running);
        let nnodes = self.launchers.nnodes;
        if nnodes > 1 && (self.launchers.node == 0 || origin == Origin::Here) {
            self.launchers.publish(self.attempt, &Report::Failed(failure.clone()));
        }
        if nnodes > 1 && self.launchers.node != 0 {
            // Node 0 may know better (a rank it counts as lost): its verdict is awaited.
            state.verdict_by = Some(Instant::now() + VERDICT_WAIT);
        }
        abort_job(self.job, self.host, self.token.clone(), format!("launcher: {}", failure.headline()));
        state.first = Some(failure);
        if running.iter().any(Option::is_some) {
            state.term_at = Some(Instant::now() + NOTICE.min(self.options.grace));
        }
    }

    /// A later failure may say more about the root cause than the first one did:
    /// node 0's verdict naming a lost rank, the lost rank's own exit, or (on node 0)
    /// the failure of a rank the coordinator had lost before the first failure (a
    /// crash on another node, reported after a peer here failed for it).
    fn reconsider(&self, state: &mut State, later: Failure, running: &[Option<Running>]) {
        let Some(first) = &state.first else { return };
        let better = match (&first.what, &later.what) {
            (FailureKind::Worker { rank: failed, .. }, FailureKind::RankLost { rank, .. }) => failed != rank,
            (FailureKind::RankLost { rank: lost, .. }, FailureKind::Worker { rank, .. }) => lost == rank,
            (FailureKind::Worker { rank: failed, .. }, FailureKind::Worker { rank, .. }) => {
                failed != rank && self.lost(*rank).is_some_and(|(lost_at, ..)| lost_at <= first.at_unix_ms)
            }
            _ => false,
        };
        if better {
            state.first = Some(self.localize(later, running));
        }
    }

    /// On node 0: a worker failure whose peers had lost another rank first becomes
    /// that rank's loss. A rank lost by lease is never a consequence of the failure
    /// (killing a worker drops its connection, it does not silence it). A dropped
    /// connection counts only on this node, before the failure, and not from a worker
    /// seen to finish: torch's processes and clients that never close leave that way
    /// when they are done, and a rank elsewhere that crashed is reported by its own
    /// node (see `reconsider`).
    fn judge(&self, failure: Failure, state: &State, running: &[Option<Running>]) -> Failure {
        let FailureKind::Worker { rank: failed, .. } = &failure.what else { return failure };
        let Some(server) = self.server else { return failure };
        let now_ms = unix_ms(SystemTime::now());
        let mut cause: Option<(u64, u64, Loss, RankInfo)> = None;
        for info in server.lost_ranks(&self.job.attempt_job) {
            if info.rank == *failed || info.rank >= self.world_size {
                continue;
            }
            let Some((lost_at, last_seen, loss)) = loss_of(&info, now_ms) else { continue };
            if loss == Loss::Disconnected {
                let finished = state.outcomes.iter().any(|o| o.rank == info.rank && o.exit.success());
                if !self.is_local(info.rank) || finished || lost_at > failure.at_unix_ms {
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
        let Some((_, last_seen, loss, info)) = cause else { return failure };
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

    /// When (ms since the epoch) and how the hosted coordinator lost `rank`, if it did.
    fn lost(&self, rank: u32) -> Option<(u64, u64, Loss)> {
        let now_ms = unix_ms(SystemTime::now());
        let lost = self.server?.lost_ranks(&self.job.attempt_job);
        lost.iter().find(|info| info.rank == rank).and_then(|info| loss_of(info, now_ms))
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
    first: Option<Failure>,
    outcomes: Vec<RankOutcome>,
    /// The last signal sent to the workers at teardown.
    signal_sent: Option<i32>,
    /// When the workers still alive get SIGTERM (the end of the notice period).
    term_at: Option<Instant>,
    /// When the workers still alive get SIGKILL.
    kill_at: Option<Instant>,
    /// Off node 0: until when to wait for node 0's verdict on a failure seen here.
    verdict_by: Option<Instant>,
    verdict_seen: bool,
    /// Node 0: the nodes that reported success.
    reports_ok: HashSet<u32>,
    /// Not node 0: node 0 said every node succeeded.
    verdict_ok: bool,
    /// Not node 0: this node told node 0 it succeeded.
    published_success: bool,
}

/// When a lost rank was lost, when it was last heard from (ms since the epoch, from
/// the coordinator's "ago" and `now_ms`), and how.
fn loss_of(info: &RankInfo, now_ms: u64) -> Option<(u64, u64, Loss)> {
    let RankState::Lost(reason) = info.state else { return None };
    let last_seen = now_ms.saturating_sub(info.last_seen_ms_ago.unwrap_or(0));
    Some(match reason {
        LossReason::LeaseExpired { lease_ms } => {
            (last_seen.saturating_add(lease_ms), last_seen, Loss::Silent { lease_ms })
        }
        LossReason::Disconnected => (last_seen, last_seen, Loss::Disconnected),
    })
}

/// Aborts the attempt's coordinator job in the background: workers blocked in a
/// barrier learn the reason at once instead of waiting for their signal.
fn abort_job(job: &JobEnv, host: &str, token: Option<Arc<Token>>, reason: String) {
    let mut identity = Identity::anonymous(job.attempt_job.clone());
    identity.host = host.to_owned();
    identity.pid = std::process::id();
    let options = ConnectOptions::new(job.coordinator.to_string(), identity)
        .with_timeout(Duration::from_secs(5))
        .with_token(token);
    tokio::spawn(async move {
        match Client::connect_with(options).await {
            Ok(client) => {
                if let Err(e) = client.abort(&reason).await {
                    tracing::debug!("aborting the job: {e}");
                }
                let _ = client.close().await;
            }
            Err(e) => tracing::debug!("aborting the job: {e}"),
        }
    });
}
