//! How the launchers of a job's nodes agree, through the coordinator, using
//! rallypoint's own primitives in a job of their own (`JOB/launch`, whose ranks are
//! the launchers, one per node):
//! - rendezvous: an all-gather of every node's worker count gives each node its
//!   rank range and the world size;
//! - each node `j > 0` reports its attempt's outcome (its first failure, or success)
//!   with a broadcast rooted at `j` that node 0 waits on; node 0 decides and
//!   broadcasts the verdict to all. A node whose launcher dies fails those
//!   broadcasts at once, by name, so every node learns of it immediately.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use rallypoint_client::{Client, ConnectOptions, Error, Identity, Members, OpError, RankState};

use crate::console::Console;
use crate::outcome::{Failure, FailureKind};
use crate::LaunchError;

/// Waits that last as long as an attempt runs.
const FOREVER: Duration = Duration::from_secs(30 * 24 * 3600);

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Report {
    Succeeded,
    Failed(Failure),
}

/// What the supervisor of an attempt hears from the other nodes.
#[derive(Debug)]
pub enum Remote {
    /// Node 0 only: node `j` finished its workers successfully.
    NodeSucceeded(u32),
    /// A failure elsewhere (or of another node itself): take this node's workers down.
    Failed(Failure),
    /// Not node 0: every node succeeded.
    VerdictSucceeded,
}

/// Where the ranks of an attempt are.
pub struct Layout {
    /// This node's first rank.
    pub base_rank: u32,
    pub world_size: u32,
    /// Workers per node, by node.
    pub counts: Vec<u32>,
}

/// This node's launcher as a member of the launchers' job.
#[derive(Clone)]
pub struct Launchers {
    client: Client,
    pub node: u32,
    pub nnodes: u32,
    /// Each node's host, as its claim said.
    hosts: Arc<HashMap<u32, String>>,
}

/// How a launcher joins its job.
pub struct Join<'a> {
    pub addr: &'a str,
    pub job: &'a str,
    /// This node's index; `None`: the next free one (node 0 is the one hosting the
    /// coordinator, which always knows it is).
    pub node: Option<u32>,
    pub nnodes: u32,
    pub host: &'a str,
    /// For connecting to the coordinator, and for every node to join.
    pub timeout: Duration,
    /// The job's token, which the launchers prove like any client.
    pub token: Option<std::sync::Arc<rallypoint_server::Token>>,
}

/// Why the nodes of a job could not come together.
#[derive(Debug, thiserror::Error)]
pub enum JoinError {
    #[error("{}", timeout_text(.job, *.nnodes, .missing, *.waited, .other_jobs))]
    Timeout { job: String, nnodes: u32, missing: Vec<u32>, waited: Duration, other_jobs: Vec<String> },
    #[error(
        "node {node} (host {host}, pid {pid}) was started with --nnodes {theirs}, this node with --nnodes {ours}: \
         every node of job '{job}' must give the same --nnodes"
    )]
    Nnodes { job: String, node: u32, host: String, pid: u32, theirs: u32, ours: u32 },
    #[error(
        "node rank {node} of job '{job}' is taken by host {host} (pid {pid}): every node needs its own --node-rank"
    )]
    Taken { job: String, node: u32, host: String, pid: u32 },
    #[error("job '{job}' has all its {nnodes} nodes (--nnodes {nnodes}) already: this launcher is one too many")]
    Full { job: String, nnodes: u32 },
    #[error("{source} while waiting for {} to join job '{job}'{}", nodes_of(.missing, *.nnodes), other_jobs_hint(.other_jobs))]
    Coordinator {
        job: String,
        nnodes: u32,
        missing: Vec<u32>,
        other_jobs: Vec<String>,
        #[source]
        source: Error,
    },
    #[error("{}", attempt_text(.job, *.attempt, *.max_restarts, .missing, *.waited))]
    Attempt { job: String, attempt: u32, max_restarts: u32, missing: Vec<u32>, waited: Duration },
    /// Node 0's coordinator never answered within the join timeout: node 0 has not
    /// started, or is elsewhere.
    #[error(
        "gave up after {} s (--join-timeout) waiting for node 0's coordinator at {addr} to join job '{job}': {source}",
        waited.as_secs()
    )]
    Unreached { job: String, addr: String, waited: Duration, source: Error },
}

impl JoinError {
    /// Nodes started differently (--nnodes, --node-rank): no wait will help.
    pub fn is_refusal(&self) -> bool {
        matches!(self, JoinError::Nnodes { .. } | JoinError::Taken { .. } | JoinError::Full { .. })
    }
}

fn timeout_text(job: &str, nnodes: u32, missing: &[u32], waited: Duration, other_jobs: &[String]) -> String {
    let mut text = format!(
        "gave up after {} s (--join-timeout) waiting for {} to join job '{job}'",
        waited.as_secs(),
        nodes_of(missing, nnodes)
    );
    text.push_str(&other_jobs_hint(other_jobs));
    text
}

fn attempt_text(job: &str, attempt: u32, max_restarts: u32, missing: &[u32], waited: Duration) -> String {
    format!(
        "gave up after {} s (--join-timeout) waiting for node(s) {} to start {} of job '{job}'",
        waited.as_secs(),
        list(missing),
        crate::attempt_of(attempt, max_restarts)
    )
}

/// "node 1 of 2", "nodes 1, 3 of 4", "5 of 64 nodes: 3, 9, 10, 11, 12, ...".
fn nodes_of(missing: &[u32], nnodes: u32) -> String {
    match missing.len() {
        1 => format!("node {} of {nnodes}", missing[0]),
        2..=8 => format!("nodes {} of {nnodes}", list(missing)),
        n => format!("{n} of {nnodes} nodes: {}, ...", list(&missing[..8])),
    }
}

fn list(nodes: &[u32]) -> String {
    nodes.iter().map(u32::to_string).collect::<Vec<_>>().join(", ")
}

/// The launchers of other jobs on this coordinator: nodes started with another --job.
fn other_jobs_hint(other_jobs: &[String]) -> String {
    if other_jobs.is_empty() {
        return String::new();
    }
    let names: Vec<String> = other_jobs.iter().map(|j| format!("'{j}'")).collect();
    format!(
        "; launchers of another job wait on this coordinator ({}): every node must give the same --job",
        names.join(", ")
    )
}

/// What a launcher writes under `node/<index>` in the launchers' job: it holds
/// that index, and this is how it was started.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Claim {
    pub host: String,
    pub pid: u32,
    pub nnodes: u32,
}

fn claim_key(node: u32) -> String {
    format!("node/{node}")
}

/// What names the launchers' own job, after the launched job's name.
pub(crate) const LAUNCHERS_SUFFIX: &str = "/launch";

/// The job the launchers of `job` meet in, on the job's coordinator beside it.
pub fn launchers_job(job: &str) -> String {
    format!("{job}{LAUNCHERS_SUFFIX}")
}

/// The launched job whose launchers' job `name` is, if it is one.
pub fn launched_job(name: &str) -> Option<&str> {
    name.strip_suffix(LAUNCHERS_SUFFIX)
}

/// Where the next free node index is counted (node 0 never takes one from it).
const NEXT_NODE: &str = "next-node";
/// Between "waiting for node ..." messages.
const WAITING_EVERY: Duration = Duration::from_secs(5);
/// Between looks at the claims and at the coordinator's other jobs while waiting.
const LOOK_EVERY: Duration = Duration::from_secs(1);

impl Launchers {
    /// Joins the launchers' job: takes this node's index (the given one, or the next
    /// free one), then waits for every node of the job, saying every few seconds
    /// which are missing. Nodes started with a different --nnodes, or claiming the
    /// same index, are refused by name.
    pub async fn join(j: &Join<'_>, console: &Console) -> Result<Self, LaunchError> {
        let started = tokio::time::Instant::now();
        let launch_job = launchers_job(j.job);
        let claim = Claim { host: j.host.to_owned(), pid: std::process::id(), nnodes: j.nnodes };
        let mut identity = Identity::anonymous(launch_job.clone());
        identity.host = j.host.to_owned();
        let tool = match connect(j, identity, j.timeout, console).await {
            Ok(tool) => tool,
            Err(Error::Connect { addr, waited, source }) => {
                let source = Error::Connect { addr: addr.clone(), waited, source };
                return Err(JoinError::Unreached { job: j.job.to_owned(), addr, waited, source }.into());
            }
            Err(error) => return Err(error.into()),
        };
        let claimed = claim_index(&tool, j, &claim).await;
        // The nodes that claimed before this one are checked now, on this session:
        // one of them may see this node's claim first and end the job at once.
        let mut seen = HashMap::new();
        let checked = match &claimed {
            Ok(node) => {
                seen.insert(*node, j.host.to_owned());
                match present_nodes(&tool).await {
                    Ok(present) => check_claims(&tool, j, &claim, &present, &mut seen).await,
                    Err(e) => Err(e.into()),
                }
            }
            Err(_) => Ok(()),
        };
        let _ = tool.close().await;
        let node = claimed?;
        checked?;
        if j.node.is_none() && node != 0 {
            console.message(format!("rallypoint: this launcher is node {node} of {} of job '{}'", j.nnodes, j.job));
        }
        let identity = Identity {
            host: j.host.to_owned(),
            pid: std::process::id(),
            role: Some("launcher".into()),
            ..Identity::ranked(launch_job, node, j.nnodes)
        };
        let left = j.timeout.saturating_sub(started.elapsed());
        let client = connect(j, identity, left, console).await?;
        let mut launchers = Launchers { client, node, nnodes: j.nnodes, hosts: Arc::default() };
        let hosts = launchers.wait_for_nodes(j, &claim, started, seen, console).await?;
        launchers.hosts = Arc::new(hosts);
        Ok(launchers)
    }

    /// Waits until every node has claimed its index, checking each claim, saying
    /// every few seconds which nodes are missing (and which other jobs' launchers
    /// wait on the coordinator: nodes started with another --job).
    async fn wait_for_nodes(
        &self,
        j: &Join<'_>,
        mine: &Claim,
        started: tokio::time::Instant,
        mut seen: HashMap<u32, String>,
        console: &Console,
    ) -> Result<HashMap<u32, String>, LaunchError> {
        let keys: Vec<String> = (0..j.nnodes).map(claim_key).collect();
        let mut missing: Vec<u32> = (0..j.nnodes).filter(|n| !seen.contains_key(n)).collect();
        let mut other_jobs = Vec::new();
        let mut next_message = started + WAITING_EVERY;
        let mut next_jobs_look = tokio::time::Instant::now();
        loop {
            let left = j.timeout.saturating_sub(started.elapsed());
            let lost = |source: Error, missing: Vec<u32>, other_jobs: Vec<String>| -> LaunchError {
                let job = j.job.to_owned();
                JoinError::Coordinator { job, nnodes: j.nnodes, missing, other_jobs, source }.into()
            };
            let absent: HashSet<u32> = match self.client.wait(&keys, Some(left.min(LOOK_EVERY))).await {
                Ok(()) => HashSet::new(),
                Err(Error::Op(OpError::KeyTimeout { missing: keys, .. })) => keys
                    .iter()
                    .filter_map(|k| std::str::from_utf8(k).ok()?.strip_prefix("node/")?.parse().ok())
                    .collect(),
                Err(e) => return Err(lost(e, missing, other_jobs)),
            };
            let present: Vec<u32> = (0..j.nnodes).filter(|n| !absent.contains(n)).collect();
            match check_claims(&self.client, j, mine, &present, &mut seen).await {
                Ok(()) => {}
                Err(LaunchError::Coordinator(e)) => return Err(lost(e, missing, other_jobs)),
                Err(e) => return Err(e),
            }
            if absent.is_empty() {
                return Ok(seen);
            }
            missing = (0..j.nnodes).filter(|n| absent.contains(n)).collect();
            let now = tokio::time::Instant::now();
            if now >= next_jobs_look || now >= next_message || started.elapsed() >= j.timeout {
                other_jobs = self.other_launcher_jobs(j.job).await;
                next_jobs_look = now + WAITING_EVERY;
            }
            let waited = started.elapsed();
            if waited >= j.timeout {
                return Err(JoinError::Timeout {
                    job: j.job.to_owned(),
                    nnodes: j.nnodes,
                    missing,
                    waited,
                    other_jobs,
                }
                .into());
            }
            if tokio::time::Instant::now() >= next_message {
                console.message(format!(
                    "rallypoint: waiting for {} ({} s of {} s){}",
                    nodes_of(&missing, j.nnodes),
                    waited.as_secs(),
                    j.timeout.as_secs(),
                    other_jobs_hint(&other_jobs)
                ));
                next_message += WAITING_EVERY;
            }
        }
    }

    /// Jobs other than `job` whose launchers are on the coordinator.
    async fn other_launcher_jobs(&self, job: &str) -> Vec<String> {
        let jobs = self.client.jobs().await.unwrap_or_default();
        jobs.iter().filter_map(|name| launched_job(name)).filter(|name| *name != job).map(str::to_owned).collect()
    }

    /// Waits for every node of attempt `attempt`; returns where the ranks are.
    /// A node that does not come is named as a node, not as a rank of an
    /// all-gather the user never wrote.
    pub async fn rendezvous(
        &self,
        job: &str,
        attempt: u32,
        max_restarts: u32,
        nproc: u32,
        timeout: Duration,
    ) -> Result<Layout, LaunchError> {
        let name = format!("attempt{attempt}/nproc");
        let counts = match self.client.all_gather(&name, Members::World, nproc.to_string(), Some(timeout)).await {
            Ok(counts) => counts,
            Err(Error::Op(OpError::CollectiveTimeout { waited_ms, missing, .. })) => {
                return Err(JoinError::Attempt {
                    job: job.to_owned(),
                    attempt,
                    max_restarts,
                    missing: missing.named().iter().map(|info| info.rank).collect(),
                    waited: Duration::from_millis(waited_ms),
                }
                .into())
            }
            Err(e) => return Err(e.into()),
        };
        let mut layout = Layout { base_rank: 0, world_size: 0, counts: Vec::with_capacity(counts.len()) };
        for (node, count) in counts.iter().enumerate() {
            let n: u32 = std::str::from_utf8(count).ok().and_then(|s| s.parse().ok()).ok_or_else(|| {
                Error::Protocol(format!("node {node} announced a bad worker count \"{}\"", count.escape_ascii()))
            })?;
            if (node as u32) < self.node {
                layout.base_rank += n;
            }
            layout.world_size = layout
                .world_size
                .checked_add(n)
                .ok_or_else(|| Error::Config("the world size exceeds 2^32 ranks".into()))?;
            layout.counts.push(n);
        }
        Ok(layout)
    }

    /// Starts listening to the other nodes for this attempt.
    pub fn watch(&self, attempt: u32, events: mpsc::UnboundedSender<Remote>) {
        if self.node == 0 {
            for j in 1..self.nnodes {
                let client = self.client.clone();
                let events = events.clone();
                let hosts = Arc::clone(&self.hosts);
                tokio::spawn(async move {
                    let name = report_name(attempt, j);
                    let got = client.broadcast(&name, Members::Ranks(vec![0, j]), j, None, Some(FOREVER)).await;
                    let _ = events.send(match decode(got, j, &hosts) {
                        Ok(Report::Succeeded) => Remote::NodeSucceeded(j),
                        Ok(Report::Failed(f)) | Err(f) => Remote::Failed(f),
                    });
                });
            }
        } else {
            let client = self.client.clone();
            let hosts = Arc::clone(&self.hosts);
            tokio::spawn(async move {
                let got = client.broadcast(&verdict_name(attempt), Members::World, 0, None, Some(FOREVER)).await;
                let _ = events.send(match decode(got, 0, &hosts) {
                    Ok(Report::Succeeded) => Remote::VerdictSucceeded,
                    Ok(Report::Failed(f)) | Err(f) => Remote::Failed(f),
                });
            });
        }
    }

    /// Node `j > 0`: tells node 0 how this node's attempt went. Node 0: tells every node the verdict.
    pub fn publish(&self, attempt: u32, report: &Report) {
        let Ok(value) = serde_json::to_vec(report) else { return };
        let client = self.client.clone();
        let node = self.node;
        tokio::spawn(async move {
            let result = if node == 0 {
                client.broadcast(&verdict_name(attempt), Members::World, 0, Some(&value), Some(FOREVER)).await
            } else {
                client
                    .broadcast(
                        &report_name(attempt, node),
                        Members::Ranks(vec![0, node]),
                        node,
                        Some(&value),
                        Some(FOREVER),
                    )
                    .await
            };
            if let Err(e) = result {
                tracing::debug!("publishing the outcome of attempt {attempt}: {e}");
            }
        });
    }

    /// Lets every node finish reading the verdict before node 0 stops the coordinator.
    pub async fn farewell(&self, attempt: u32) {
        let _ =
            self.client.barrier(&format!("attempt{attempt}/bye"), Members::World, Some(Duration::from_secs(10))).await;
    }

    /// This launcher's connection (for the stacks it answers and asks for).
    pub fn client(&self) -> Client {
        self.client.clone()
    }

    pub async fn close(self) {
        let _ = self.client.close().await;
    }
}

/// The nodes that claimed their index, with their claims.
pub(crate) async fn claims(client: &Client) -> Result<Vec<(u32, Claim)>, Error> {
    let nodes = present_nodes(client).await?;
    if nodes.is_empty() {
        return Ok(Vec::new());
    }
    let keys: Vec<String> = nodes.iter().map(|&n| claim_key(n)).collect();
    let values = client.multi_get(&keys, Some(Duration::ZERO)).await?;
    Ok(nodes.into_iter().zip(values).filter_map(|(n, v)| Some((n, serde_json::from_slice(&v).ok()?))).collect())
}

/// The nodes that have claimed their index.
async fn present_nodes(client: &Client) -> Result<Vec<u32>, Error> {
    let listed = client.list_keys("node/").await?;
    Ok(listed.iter().filter_map(|k| std::str::from_utf8(k).ok()?.strip_prefix("node/")?.parse().ok()).collect())
}

/// The launchers of a job as its launchers' job holds them (`client` is connected
/// to that job): the nodes that joined, with their host and pid, of how many.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Joined {
    pub nnodes: u32,
    /// By node index.
    pub nodes: Vec<(u32, String, u32)>,
}

impl Joined {
    /// The nodes not joined yet.
    pub fn missing(&self) -> Vec<u32> {
        (0..self.nnodes).filter(|n| !self.nodes.iter().any(|(joined, _, _)| joined == n)).collect()
    }
}

/// Reads which nodes joined the launchers' job `client` is connected to; `None` if
/// none has (or their claims cannot be read: another version's launchers).
pub async fn joined_nodes(client: &Client) -> Result<Option<Joined>, Error> {
    let mut present = present_nodes(client).await?;
    present.sort_unstable();
    let mut nnodes = None;
    let mut nodes = Vec::new();
    for (node, claim) in read_claims(client, &present).await? {
        let Some(claim) = claim else { continue };
        nnodes = nnodes.or(Some(claim.nnodes));
        nodes.push((node, claim.host, claim.pid));
    }
    Ok(nnodes.map(|nnodes| Joined { nnodes, nodes }))
}

/// The claims of `nodes`, each `None` if it cannot be read (another version's).
async fn read_claims(client: &Client, nodes: &[u32]) -> Result<Vec<(u32, Option<Claim>)>, Error> {
    let keys: Vec<String> = nodes.iter().map(|&n| claim_key(n)).collect();
    let values = client.multi_get(&keys, Some(Duration::ZERO)).await?;
    Ok(nodes.iter().zip(values).map(|(&node, value)| (node, serde_json::from_slice(&value).ok())).collect())
}

/// Reads the claims of the nodes in `present` not seen yet (noting each one's host),
/// and refuses one started with another --nnodes.
async fn check_claims(
    client: &Client,
    j: &Join<'_>,
    mine: &Claim,
    present: &[u32],
    seen: &mut HashMap<u32, String>,
) -> Result<(), LaunchError> {
    let others: Vec<u32> = present.iter().copied().filter(|n| !seen.contains_key(n)).collect();
    if others.is_empty() {
        return Ok(());
    }
    for (other, theirs) in read_claims(client, &others).await? {
        let Some(theirs) = theirs else {
            seen.insert(other, "?".to_owned());
            continue;
        };
        seen.insert(other, theirs.host.clone());
        if theirs.nnodes != mine.nnodes {
            return Err(JoinError::Nnodes {
                job: j.job.to_owned(),
                node: other,
                host: theirs.host,
                pid: theirs.pid,
                theirs: theirs.nnodes,
                ours: mine.nnodes,
            }
            .into());
        }
    }
    Ok(())
}

/// Takes this node's index in the launchers' job: the given one, unless another
/// launcher holds it; or the next free one (node 0 hosts the coordinator and knows
/// it is node 0, so counting starts at 1).
async fn claim_index(tool: &Client, j: &Join<'_>, claim: &Claim) -> Result<u32, LaunchError> {
    let value = serde_json::to_vec(claim).map_err(|e| Error::Protocol(e.to_string()))?;
    let take = |node: u32| {
        let value = value.clone();
        async move {
            let held = tool.compare_set(claim_key(node), b"", &value).await?;
            Ok::<_, Error>((held == value).then_some(()).ok_or(held))
        }
    };
    if let Some(node) = j.node {
        return match take(node).await? {
            Ok(()) => Ok(node),
            Err(held) => {
                let holder: Option<Claim> = serde_json::from_slice(&held).ok();
                let (host, pid) = holder.map_or(("?".to_owned(), 0), |c| (c.host, c.pid));
                Err(JoinError::Taken { job: j.job.to_owned(), node, host, pid }.into())
            }
        };
    }
    loop {
        let next = tool.add(NEXT_NODE, 1).await?;
        let node = match u32::try_from(next) {
            Ok(node) if node < j.nnodes => node,
            _ => return Err(JoinError::Full { job: j.job.to_owned(), nnodes: j.nnodes }.into()),
        };
        // Taken by a node started with this --node-rank: try the next one.
        if take(node).await?.is_ok() {
            return Ok(node);
        }
    }
}

/// Connects to the coordinator, saying after a second, and then now and again,
/// that it is still trying and why.
async fn connect(j: &Join<'_>, identity: Identity, timeout: Duration, console: &Console) -> Result<Client, Error> {
    let options = ConnectOptions::new(j.addr, identity).with_timeout(timeout).with_token(j.token.clone());
    Client::connect_saying(options, |line| console.message(line)).await
}

fn report_name(attempt: u32, node: u32) -> String {
    format!("attempt{attempt}/report/{node}")
}

fn verdict_name(attempt: u32) -> String {
    format!("attempt{attempt}/verdict")
}

/// A report, or the failure of not getting one: the sending node is gone. `hosts`:
/// each node's host as its claim said, for when the coordinator cannot say it.
fn decode(got: Result<bytes::Bytes, Error>, from: u32, hosts: &HashMap<u32, String>) -> Result<Report, Failure> {
    let host = hosts.get(&from).map_or("?", String::as_str);
    match got {
        Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| {
            Failure::now(FailureKind::NodeLost { detail: format!("it sent an unreadable report: {e}") }, from, host)
        }),
        Err(Error::Op(OpError::PeerLost { peer, .. })) => {
            // The peer is a launcher, whose "rank" is its node index: say it in those terms.
            let how = match peer.state {
                RankState::Lost(reason) => reason.to_string(),
                RankState::Finished { pid } => format!("ended (pid {pid} exited with code 0)"),
                _ => "was lost".to_owned(),
            };
            let pid = peer.pid.map_or(String::new(), |pid| format!(" (pid {pid})"));
            Err(Failure::now(
                FailureKind::NodeLost { detail: format!("its launcher{pid}: {how}") },
                from,
                peer.host.as_deref().unwrap_or(host),
            ))
        }
        Err(e) => {
            Err(Failure::now(FailureKind::NodeLost { detail: format!("no word from its launcher: {e}") }, from, host))
        }
    }
}
