//! One attempt of a job on this node: spawn the workers, watch them and the other
//! nodes, and on the first failure take everything down within the grace period.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::{Client, ConnectOptions, Identity};

/// Between aborting the job on the coordinator and signalling the workers: long enough
/// for a worker blocked in a barrier to receive the reason and report it itself, short
/// enough not to matter to a person waiting.
const NOTICE: Duration = Duration::from_millis(100);

use super::agents::{Agents, Remote, Report};
use super::console::Console;
use super::env::{live_output_env, worker_env, JobEnv, Placement};
use super::outcome::{summary, Failure, FailureKind, RankOutcome};
use super::procs::{Family, LAUNCH_ID_VAR};
use super::watchdog::Watchdog;
use super::worker::{self, Exited, Running, Spec};
use super::{LaunchError, LaunchOptions};

pub enum AttemptResult {
    Succeeded,
    Failed { first: Failure },
}

pub struct Attempt<'a> {
    pub options: &'a LaunchOptions,
    pub agents: &'a Agents,
    pub job: &'a JobEnv,
    pub host: &'a str,
    pub base_rank: u32,
    pub world_size: u32,
    pub attempt: u32,
    pub console: &'a Arc<Console>,
    pub family: &'a Arc<Family>,
    pub watchdog: Option<&'a Watchdog>,
}

impl Attempt<'_> {
    pub async fn run(&self, signals: &mut mpsc::UnboundedReceiver<i32>) -> Result<AttemptResult, LaunchError> {
        let o = self.options;
        let nproc = o.nproc_per_node;
        let log_dir = match &o.log_dir {
            Some(dir) => {
                let dir = dir.join(format!("attempt{}", self.attempt));
                std::fs::create_dir_all(&dir)?;
                Some(dir)
            }
            None => None,
        };
        let (exits_tx, mut exits) = mpsc::unbounded_channel::<Exited>();
        let (remote_tx, mut remote) = mpsc::unbounded_channel::<Remote>();
        if self.agents.nnodes > 1 {
            self.agents.watch(self.attempt, remote_tx);
        }
        let inherited_omp = std::env::var_os("OMP_NUM_THREADS").is_some();
        let inherited_unbuffered = std::env::var_os("PYTHONUNBUFFERED").is_some();
        let mut running: Vec<Option<Running>> = Vec::new();
        let mut pids = Vec::new();
        let mut state = State::default();
        for local_rank in 0..nproc {
            let placement = Placement {
                rank: self.base_rank + local_rank,
                local_rank,
                world_size: self.world_size,
                local_world_size: nproc,
                node_rank: self.agents.node,
                nnodes: self.agents.nnodes,
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
                console: (log_dir.is_none() || o.tee).then(|| Arc::clone(self.console)),
                log_dir: log_dir.clone(),
            };
            match worker::spawn(spec, self.family, exits_tx.clone()) {
                Ok(r) => {
                    if let Some(watchdog) = self.watchdog {
                        watchdog.watch_group(r.pid);
                    }
                    pids.push(r.pid);
                    running.push(Some(r));
                }
                Err(e) => {
                    // Could not even start: a failure like any other (exit 127, as a shell
                    // reports a missing command), with the reason as its stderr; start no more.
                    let failure = self.worker_failure(local_rank, 0, super::Exit::Code(127), vec![e.to_string()]);
                    state.outcomes.push(RankOutcome {
                        rank: placement.rank,
                        exit: super::Exit::Code(127),
                        signalled_by_launcher: None,
                        after_failure: false,
                    });
                    self.fail(&mut state, failure, &running);
                    break;
                }
            }
        }
        drop(exits_tx);

        let mut reports_ok = HashSet::new();
        let mut verdict_ok = false;
        let mut published_success = false;
        loop {
            let all_exited = running.iter().all(Option::is_none);
            if all_exited {
                if state.first.is_some() {
                    break;
                }
                let nnodes = self.agents.nnodes;
                if nnodes == 1 || verdict_ok {
                    break;
                }
                if self.agents.node == 0 && reports_ok.len() as u32 == nnodes - 1 {
                    self.agents.publish(self.attempt, &Report::Succeeded);
                    break;
                }
                if self.agents.node != 0 && !published_success {
                    self.agents.publish(self.attempt, &Report::Succeeded);
                    published_success = true;
                }
            }
            let next_step = state.term_at.or(state.kill_at).map(tokio::time::sleep_until);
            tokio::select! {
                Some(exited) = exits.recv() => {
                    let Some(r) = running.get_mut(exited.local_rank as usize).and_then(Option::take) else { continue };
                    state.outcomes.push(RankOutcome {
                        rank: self.base_rank + exited.local_rank,
                        exit: exited.exit,
                        signalled_by_launcher: state.signal_sent,
                        after_failure: state.first.is_some(),
                    });
                    if !exited.exit.success() && state.first.is_none() {
                        let failure = self.worker_failure(r.local_rank, r.pid, exited.exit, exited.stderr_tail);
                        self.fail(&mut state, failure, &running);
                    }
                }
                Some(event) = remote.recv() => match event {
                    Remote::NodeSucceeded(node) => { reports_ok.insert(node); }
                    Remote::VerdictSucceeded => verdict_ok = true,
                    Remote::Failed(failure) => {
                        if state.first.is_none() {
                            self.fail(&mut state, failure, &running);
                        }
                    }
                },
                Some(sig) = signals.recv() => {
                    if state.first.is_none() {
                        let failure = Failure::now(FailureKind::Interrupted { signal: sig }, self.agents.node, self.host);
                        self.fail(&mut state, failure, &running);
                        // The user asked: pass their signal on at once, no notice period.
                        state.term_at = None;
                        self.signal_all(&mut state, &running, sig);
                    } else {
                        // A second signal while tearing down: no more grace.
                        state.term_at = None;
                        state.kill_at = Some(Instant::now());
                    }
                }
                _ = async { if let Some(t) = next_step { t.await } else { std::future::pending().await } } => {
                    if state.term_at.take().is_some() {
                        self.signal_all(&mut state, &running, libc::SIGTERM);
                    } else {
                        for r in running.iter().flatten() {
                            worker::signal_group(r.pid, libc::SIGKILL);
                        }
                        self.family.signal_strays(libc::SIGKILL, &[]);
                        state.kill_at = None;
                    }
                }
            }
        }
        // Whatever the workers started goes too, in their groups or not: no worker
        // survives its job.
        for &pid in &pids {
            worker::signal_group(pid, libc::SIGKILL);
        }
        self.family.kill_strays().await;
        if let Some(watchdog) = self.watchdog {
            for &pid in &pids {
                watchdog.forget_group(pid);
            }
        }
        state.outcomes.sort_by_key(|o| o.rank);
        match state.first {
            None => Ok(AttemptResult::Succeeded),
            Some(first) => {
                self.console.message(summary(&o.job, self.attempt, o.max_restarts, &first, &state.outcomes));
                Ok(AttemptResult::Failed { first })
            }
        }
    }

    fn worker_failure(&self, local_rank: u32, pid: u32, exit: super::Exit, stderr_tail: Vec<String>) -> Failure {
        Failure::now(
            FailureKind::Worker { rank: self.base_rank + local_rank, local_rank, pid, exit, stderr_tail },
            self.agents.node,
            self.host,
        )
    }

    /// The first failure: tell the other nodes, and abort the job on the coordinator so
    /// peers blocked in barriers fail at once with the reason; after a short notice,
    /// SIGTERM whoever is still running.
    fn fail(&self, state: &mut State, failure: Failure, running: &[Option<Running>]) {
        let nnodes = self.agents.nnodes;
        let seen_here = failure.node == self.agents.node;
        if nnodes > 1 && (self.agents.node == 0 || seen_here) {
            self.agents.publish(self.attempt, &Report::Failed(failure.clone()));
        }
        abort_job(self.job, self.host, format!("launcher: {}", failure.headline()));
        state.first = Some(failure);
        if running.iter().any(Option::is_some) {
            state.term_at = Some(Instant::now() + NOTICE.min(self.options.grace));
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

#[derive(Default)]
struct State {
    first: Option<Failure>,
    outcomes: Vec<RankOutcome>,
    /// The signal sent to the workers at teardown.
    signal_sent: Option<i32>,
    /// When the workers still alive get SIGTERM (the end of the notice period).
    term_at: Option<Instant>,
    /// When the workers still alive get SIGKILL.
    kill_at: Option<Instant>,
}

/// Aborts the attempt's coordinator job in the background: workers blocked in a
/// barrier learn the reason at once instead of waiting for their signal.
fn abort_job(job: &JobEnv, host: &str, reason: String) {
    let mut identity = Identity::anonymous(job.attempt_job.clone());
    identity.host = host.to_owned();
    identity.pid = std::process::id();
    let mut options = ConnectOptions::new(job.coordinator.to_string(), identity);
    options.timeout = Duration::from_secs(5);
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
