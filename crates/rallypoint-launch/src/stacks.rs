//! Where every rank of a launched job is: each node's launcher reads its own
//! workers' stacks (it is their parent, so it may read their memory), and the
//! answers of all nodes travel through the coordinator, in the launchers' job
//! (`JOB/launch`, see [`crate::rendezvous`]), over the connections the launchers
//! hold anyway:
//!
//! - an asker (`rallypoint status --stacks`, or node 0's launcher on a hang) takes
//!   the next request number `N` by adding 1 to `stacks/requests`, then writes
//!   what it asks under `stacks/N/ask`;
//! - every launcher has a task waiting for the key of the next request; it reads
//!   its running workers' stacks (several at once, each within a bound) and writes
//!   its node's answer under `stacks/N/node/J`, then waits for request `N + 1`;
//! - the asker waits (bounded) for the answer of every node, names those that did
//!   not answer, and deletes the request's keys.
//!
//! An answer says how long the node's workers have written no output, so node 0
//! learns cheaply whether the whole job is quiet (see [`crate::supervise`]): it asks
//! only when its own side (the coordinator, its workers) has been quiet for the
//! hang timeout, and the stacks only once every node agrees.
//!
//! An asker that died between taking its number and writing its key would stop
//! the queue: a launcher that has waited a while for a key whose number is taken
//! moves past it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::task::JoinHandle;

use rallypoint_client::{Client, Error, OpError};
use rallypoint_core::snapshot::{RangeSet, StackGroup, StacksView};
use rallypoint_stacks::capture::{self, Options};
use rallypoint_stacks::{Grouped, RankStack, Render};

/// Where request numbers are counted.
const REQUESTS: &str = "stacks/requests";
/// How long a launcher waits for a request's key before it looks whether an asker
/// died after taking a number: a taken number then holds the queue this long.
const SKIP_AFTER: Duration = Duration::from_secs(10);
/// How long one process's stack may take to read.
const PER_PROCESS: Duration = Duration::from_secs(3);
/// Processes read at once, at most.
const PARALLEL: usize = 16;

fn ask_key(n: i64) -> String {
    format!("stacks/{n}/ask")
}

fn answer_key(n: i64, node: u32) -> String {
    format!("stacks/{n}/node/{node}")
}

/// Milliseconds on a clock of this process that only goes forward.
pub(crate) fn mono_ms() -> u64 {
    static ORIGIN: OnceLock<Instant> = OnceLock::new();
    let origin = *ORIGIN.get_or_init(Instant::now);
    // 1 and up: 0 means "never".
    u64::try_from(origin.elapsed().as_millis()).unwrap_or(u64::MAX).saturating_add(1)
}

/// What is asked of every node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ask {
    /// Read the workers' stacks (else only say how long they have been quiet).
    pub stacks: bool,
    /// Native frames too.
    pub native: bool,
}

/// One node's answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeStacks {
    pub node: u32,
    pub host: String,
    /// The coordinator job of the attempt its workers run ("" between attempts).
    pub attempt_job: String,
    /// Its workers running.
    pub running: u32,
    /// How long none of its workers has written output (or since the attempt started).
    pub quiet_ms: u64,
    /// Its running workers' stacks, grouped, if asked for.
    pub stacks: Option<Grouped>,
    /// How long reading them took.
    pub capture_ms: u64,
    /// Something the asker should know (native frames asked for but not read, and why).
    pub note: Option<String>,
}

/// A node that did not answer in time.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Unanswered {
    pub node: u32,
    /// Its host, from the claim it made when it joined.
    pub host: Option<String>,
}

/// `grouped` as the status document carries it: groups in the same order.
pub fn view_of(grouped: &Grouped, captured_unix_ms: u64) -> StacksView {
    let groups = grouped
        .groups
        .iter()
        .map(|g| StackGroup {
            ranks: RangeSet::of_ranks(g.ranks.iter().copied()),
            of: u64::from(grouped.ranks),
            frames: rallypoint_stacks::frame_texts(&g.stack),
        })
        .collect();
    StacksView { captured_unix_ms, groups }
}

/// Every node's answer to one request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Collected {
    pub nnodes: u32,
    /// By node.
    pub answers: Vec<NodeStacks>,
    pub unanswered: Vec<Unanswered>,
    /// From the request to the last answer.
    pub elapsed_ms: u64,
}

impl Collected {
    /// The stacks of every node that answered, as one view.
    pub fn grouped(&self) -> Grouped {
        Grouped::merge(self.answers.iter().filter_map(|a| a.stacks.clone()))
    }

    /// The grouped stacks as the status document and the live page carry them.
    pub fn view(&self, captured_unix_ms: u64) -> StacksView {
        view_of(&self.grouped(), captured_unix_ms)
    }

    /// How long the whole job has been quiet: its least quiet node's figure.
    pub fn quiet_ms(&self) -> u64 {
        self.answers.iter().map(|a| a.quiet_ms).min().unwrap_or(0)
    }

    /// The grouped stacks for a person: a heading, a line per group (at most
    /// `how.max_groups`), the nodes that did not answer and what they noted.
    pub fn render(&self, how: &Render) -> String {
        let grouped = self.grouped();
        let nodes = self.answers.len();
        let mut text = if grouped.ranks == 0 {
            format!(
                "stacks: no worker is running on the {} (between attempts, or all have exited)\n",
                plural(nodes, "node that answered", "nodes that answered")
            )
        } else {
            format!(
                "stacks of {} on {}, read in {:.2} s (each rank's main thread, innermost frame first):\n{}",
                plural(grouped.ranks as usize, "rank", "ranks"),
                plural(nodes, "node", "nodes"),
                self.elapsed_ms as f64 / 1000.0,
                rallypoint_stacks::render(&grouped, how)
            )
        };
        for missing in &self.unanswered {
            let host = missing.host.as_deref().map_or(String::new(), |h| format!(" (host {h})"));
            text.push_str(&format!(
                "{}node {}{host} did not answer: its ranks are not shown\n",
                how.indent, missing.node
            ));
        }
        let mut notes: Vec<&str> = self.answers.iter().filter_map(|a| a.note.as_deref()).collect();
        notes.dedup();
        for note in notes {
            text.push_str(&format!("{}({note})\n", how.indent));
        }
        text
    }
}

fn plural(n: usize, one: &str, many: &str) -> String {
    if n == 1 {
        format!("1 {one}")
    } else {
        format!("{n} {many}")
    }
}

/// Asks every node of the launchers' job `client` is in (a tool or a launcher's
/// own client) and waits up to `wait` for their answers. `nnodes`: the number of
/// nodes, if the caller knows it (else read from the nodes' claims).
pub async fn request(client: &Client, ask: &Ask, nnodes: Option<u32>, wait: Duration) -> Result<Collected, Error> {
    let started = Instant::now();
    let claims = crate::rendezvous::claims(client).await?;
    let nnodes = nnodes.or_else(|| claims.iter().map(|(_, c)| c.nnodes).max()).unwrap_or(1);
    let value = serde_json::to_vec(ask).map_err(|e| Error::Protocol(e.to_string()))?;
    let n = client.add(REQUESTS, 1).await?;
    client.set(ask_key(n), value).await?;
    let keys: Vec<String> = (0..nnodes).map(|node| answer_key(n, node)).collect();
    let absent: Vec<String> = match client.wait(&keys, Some(wait)).await {
        Ok(()) => Vec::new(),
        Err(Error::Op(OpError::KeyTimeout { missing, .. })) => {
            missing.iter().map(|k| String::from_utf8_lossy(k).into_owned()).collect()
        }
        Err(e) => return Err(e),
    };
    let present: Vec<&String> = keys.iter().filter(|k| !absent.contains(k)).collect();
    let values = if present.is_empty() { Vec::new() } else { client.multi_get(&present, Some(Duration::ZERO)).await? };
    let elapsed_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
    let mut answers: Vec<NodeStacks> = values.iter().filter_map(|v| serde_json::from_slice(v).ok()).collect();
    answers.sort_by_key(|a| a.node);
    let unanswered = (0..nnodes)
        .filter(|node| !answers.iter().any(|a| a.node == *node))
        .map(|node| Unanswered { node, host: claims.iter().find(|(n, _)| *n == node).map(|(_, c)| c.host.clone()) })
        .collect();
    // The request is done with: nobody reads its keys again (a late answer stays).
    for key in present.iter().map(|k| k.as_str()).chain([ask_key(n).as_str()]) {
        let _ = client.delete(key).await;
    }
    Ok(Collected { nnodes, answers, unanswered, elapsed_ms })
}

/// One running worker of this node.
struct Live {
    rank: u32,
    pid: u32,
    /// When it last wrote output ([`mono_ms`]; 0: never).
    heard: Arc<AtomicU64>,
}

/// This node's running workers, for whoever reads their stacks or asks how long
/// they have been quiet.
#[derive(Default)]
pub struct Roster {
    state: Mutex<RosterState>,
}

#[derive(Default)]
struct RosterState {
    attempt_job: String,
    /// When the attempt started, or a worker of it that has exited last wrote.
    quiet_since: u64,
    workers: Vec<Live>,
}

impl Roster {
    fn lock(&self) -> std::sync::MutexGuard<'_, RosterState> {
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// An attempt starts: no worker yet, and quiet since now.
    pub fn start_attempt(&self, attempt_job: &str) {
        let mut state = self.lock();
        state.attempt_job = attempt_job.to_owned();
        state.quiet_since = mono_ms();
        state.workers.clear();
    }

    pub fn add(&self, rank: u32, pid: u32, heard: Arc<AtomicU64>) {
        self.lock().workers.push(Live { rank, pid, heard });
    }

    /// The worker `pid` exited.
    pub fn remove(&self, pid: u32) {
        let mut state = self.lock();
        if let Some(gone) = state.workers.iter().position(|w| w.pid == pid) {
            let heard = state.workers.swap_remove(gone).heard.load(Ordering::Relaxed);
            state.quiet_since = state.quiet_since.max(heard);
        }
    }

    /// The attempt is over: nothing runs.
    pub fn end_attempt(&self) {
        let mut state = self.lock();
        state.attempt_job.clear();
        state.workers.clear();
    }

    /// How long no worker of this attempt has written output (every worker that
    /// ever ran in it, running or not: one that exited was heard of then).
    pub fn quiet_ms(&self) -> u64 {
        let state = self.lock();
        let last = state.workers.iter().map(|w| w.heard.load(Ordering::Relaxed)).fold(state.quiet_since, u64::max);
        mono_ms().saturating_sub(last)
    }

    /// (rank, pid) of the running workers, by rank.
    pub fn running(&self) -> Vec<(u32, u32)> {
        let mut running: Vec<(u32, u32)> = self.lock().workers.iter().map(|w| (w.rank, w.pid)).collect();
        running.sort_unstable();
        running
    }

    fn attempt_job(&self) -> String {
        self.lock().attempt_job.clone()
    }
}

/// Why native frames cannot be read here, if they cannot.
fn native_unavailable() -> Option<&'static str> {
    if !capture::native_supported() {
        return Some(
            "native frames are not in this launcher's build: build rallypoint with --features native-stacks \
             (needs libunwind-dev); Python frames are shown",
        );
    }
    if !crate::procs::has_pidfd() {
        // Without pidfds, tokio's reaper polls the workers with waitpid on every
        // SIGCHLD, and would take a ptrace stop for an exit.
        return Some("native frames need Linux 5.3 or later (pidfd) on the launcher's node; Python frames are shown");
    }
    None
}

/// This node's answer to `ask`: its running workers' stacks read here and now.
pub async fn answer(roster: &Roster, node: u32, host: &str, ask: &Ask) -> NodeStacks {
    let started = Instant::now();
    let running = roster.running();
    let running_count = running.len();
    let quiet_ms = roster.quiet_ms();
    let unavailable = ask.native.then(native_unavailable).flatten();
    let stacks = if ask.stacks {
        let options = Options {
            native: ask.native && unavailable.is_none(),
            timeout: PER_PROCESS,
            parallel: PARALLEL.min(running.len().max(1)),
        };
        let pids: Vec<u32> = running.iter().map(|&(_, pid)| pid).collect();
        let read = tokio::task::spawn_blocking(move || capture::capture_all(&pids, &options)).await;
        let captured = read.unwrap_or_else(|e| {
            let error = format!("the reader failed: {e}");
            running.iter().map(|_| rallypoint_stacks::Captured::Failed { error: error.clone() }).collect()
        });
        let stacks = running.iter().zip(captured).map(|(&(rank, pid), captured)| RankStack { rank, pid, captured });
        Some(rallypoint_stacks::group(stacks))
    } else {
        None
    };
    NodeStacks {
        node,
        host: host.to_owned(),
        attempt_job: roster.attempt_job(),
        running: u32::try_from(running_count).unwrap_or(u32::MAX),
        quiet_ms,
        stacks,
        capture_ms: u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
        note: unavailable.filter(|_| ask.stacks).map(str::to_owned),
    }
}

/// Answers every request of the launchers' job until the client's connection ends
/// (or the task is aborted).
pub fn spawn_responder(client: Client, node: u32, host: String, roster: Arc<Roster>) -> JoinHandle<()> {
    tokio::spawn(async move {
        // Requests made before this launcher joined are not for it.
        let Ok(mut next) = client.add(REQUESTS, 0).await.map(|n| n + 1) else { return };
        loop {
            match client.wait(&[ask_key(next)], Some(SKIP_AFTER)).await {
                Ok(()) => {}
                Err(Error::Op(OpError::KeyTimeout { .. })) => {
                    // A number taken but never asked under: its asker died. Move on.
                    match client.add(REQUESTS, 0).await {
                        Ok(taken) if taken > next => next += 1,
                        Ok(_) => {}
                        Err(_) => return,
                    }
                    continue;
                }
                Err(_) => return,
            }
            let asked = client.get(ask_key(next), Some(Duration::ZERO)).await;
            if let Some(ask) = asked.ok().and_then(|v| serde_json::from_slice::<Ask>(&v).ok()) {
                let answer = answer(&roster, node, &host, &ask).await;
                if let Ok(value) = serde_json::to_vec(&answer) {
                    if let Err(e) = client.set(answer_key(next, node), value).await {
                        tracing::debug!("answering stacks request {next}: {e}");
                        if matches!(e, Error::Disconnected(_)) {
                            return;
                        }
                    }
                }
            }
            next += 1;
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rallypoint_stacks::{Captured, Frame, ThreadChoice};

    fn python(function: &str, line: u32) -> Captured {
        Captured::Python {
            pid: 1,
            thread: ThreadChoice::Main,
            thread_name: None,
            threads: 1,
            native: false,
            frames: vec![Frame::python(function, "train.py", line)],
            stopped: false,
        }
    }

    fn node(node: u32, stacks: Vec<(u32, Captured)>, quiet_ms: u64) -> NodeStacks {
        let running = stacks.len() as u32;
        let grouped = rallypoint_stacks::group(stacks.into_iter().map(|(rank, captured)| RankStack {
            rank,
            pid: 100 + rank,
            captured,
        }));
        NodeStacks {
            node,
            host: format!("h{node}"),
            attempt_job: "j".into(),
            running,
            quiet_ms,
            stacks: Some(grouped),
            capture_ms: 5,
            note: None,
        }
    }

    #[test]
    fn the_nodes_answers_make_one_view_naming_the_silent_nodes() {
        let collected = Collected {
            nnodes: 3,
            answers: vec![
                node(0, vec![(0, python("all_reduce", 9)), (1, python("all_reduce", 9))], 7_000),
                NodeStacks {
                    note: Some("native frames are not in this launcher's build".into()),
                    ..node(1, vec![(2, python("load_batch", 4)), (3, python("all_reduce", 9))], 6_000)
                },
            ],
            unanswered: vec![Unanswered { node: 2, host: Some("h2".into()) }],
            elapsed_ms: 250,
        };
        assert_eq!(collected.quiet_ms(), 6_000, "the least quiet node's");
        let how = Render { indent: "  ".into(), ..Render::default() };
        let text = collected.render(&how);
        let lines: Vec<String> = text.lines().map(|l| l.split_whitespace().collect::<Vec<_>>().join(" ")).collect();
        assert_eq!(
            lines,
            [
                "stacks of 4 ranks on 2 nodes, read in 0.25 s (each rank's main thread, innermost frame first):",
                "rank 2 (1 of 4): load_batch (train.py:4)",
                "ranks 0-1,3 (3 of 4): all_reduce (train.py:9)",
                "node 2 (host h2) did not answer: its ranks are not shown",
                "(native frames are not in this launcher's build)",
            ]
        );
        let idle = Collected { nnodes: 1, answers: vec![node(0, vec![], 0)], unanswered: vec![], elapsed_ms: 1 };
        assert!(idle.render(&how).starts_with("stacks: no worker is running on the 1 node that answered"));
        let json = serde_json::to_string(&collected).expect("plain data");
        assert_eq!(serde_json::from_str::<Collected>(&json).expect("back"), collected);
    }

    #[test]
    fn the_roster_knows_who_runs_and_remembers_when_a_gone_worker_last_spoke() {
        let roster = Roster::default();
        roster.start_attempt("j.restart1");
        let (loud, quiet) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        roster.add(5, 505, Arc::clone(&loud));
        roster.add(4, 404, Arc::clone(&quiet));
        assert_eq!(roster.running(), [(4, 404), (5, 505)], "by rank");
        assert_eq!(roster.attempt_job(), "j.restart1");
        // A worker heard "later than now": the node is not quiet at all.
        loud.store(mono_ms() + 3_600_000, Ordering::Relaxed);
        assert_eq!(roster.quiet_ms(), 0);
        // Once it exits, when it last spoke still counts.
        roster.remove(505);
        assert_eq!(roster.running(), [(4, 404)]);
        assert_eq!(roster.quiet_ms(), 0);
        roster.end_attempt();
        assert!(roster.running().is_empty());
        assert_eq!(roster.attempt_job(), "");
    }
}
