//! One-shot verbs for shell scripts: each connects, does one operation, leaves
//! cleanly, and prints its result on stdout.
//!
//! Only barriers and collectives connect as a rank. The other verbs are tools: they
//! connect without one, so that a `rallypoint set` run by a worker does not claim
//! the worker's rank, which the worker's own process holds (docs/PROTOCOL.md,
//! section 14).

use std::io::{Read, Write};

use anyhow::Context;
use clap::{Args, Subcommand};
use rallypoint_client::env::{Overrides, Settings};
use rallypoint_client::{Client, Error, Incarnation, Members, OpError};
use rallypoint_launch::discovery;

use crate::exit::usage;
use crate::parse;

mod status;

#[derive(Subcommand, Debug)]
pub enum Verb {
    /// Wait until every member has reached barrier NAME (prints nothing).
    ///
    /// Calling the same NAME again is the next generation of that barrier, counted
    /// per rank by the coordinator, so `for step in ...; do rallypoint barrier step; done`
    /// works across separate processes.
    Barrier {
        /// The barrier's name (its calls are counted per rank: see above)
        name: String,
        /// Pass the barrier N times in a row, as N separate calls would
        #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
        times: u32,
        #[command(flatten)]
        members: MembersArgs,
        #[command(flatten)]
        conn: Conn,
    },
    /// Contribute VALUE; print every member's value, one line per rank, in rank order.
    AllGather {
        /// This rank's value (any text)
        #[arg(allow_negative_numbers = true)]
        value: String,
        /// Name of the collective (its generations are counted like a barrier's)
        #[arg(long, default_value = "all-gather")]
        name: String,
        /// End each value with a NUL byte rather than a newline (for `mapfile -d ''`),
        /// so that values holding newlines keep their place
        // No `-0`: that is a VALUE, as negative numbers are.
        #[arg(long)]
        null: bool,
        #[command(flatten)]
        members: MembersArgs,
        #[command(flatten)]
        conn: Conn,
    },
    /// Print the root's VALUE on every member (VALUE is required on the root only).
    Broadcast {
        /// The value to send: given on the root, not needed elsewhere
        #[arg(allow_negative_numbers = true)]
        value: Option<String>,
        /// Rank whose value everyone gets
        #[arg(long, value_name = "R", allow_negative_numbers = true)]
        root: u32,
        /// Name of the collective (its generations are counted like a barrier's)
        #[arg(long, default_value = "broadcast")]
        name: String,
        #[command(flatten)]
        members: MembersArgs,
        #[command(flatten)]
        conn: Conn,
    },
    /// Store VALUE under KEY (`-`: the value is read from stdin, byte for byte).
    Set {
        /// The key (any text; keys of one job share one namespace)
        key: String,
        /// The value; `-` reads it from stdin (a value that is `-` itself: `printf -- - | rallypoint set KEY -`)
        #[arg(allow_negative_numbers = true)]
        value: String,
        #[command(flatten)]
        conn: Conn,
    },
    /// Print the value of KEY and a newline, waiting until it exists (or --timeout; exit code 3).
    Get {
        /// The key to wait for and print
        key: String,
        /// Print the value's bytes as stored, without the newline (what `set KEY -` read)
        #[arg(long)]
        raw: bool,
        #[command(flatten)]
        conn: Conn,
    },
    /// Add N to the integer at KEY (missing counts as 0); print the new value.
    Add {
        /// The key holding a decimal integer
        key: String,
        /// How much to add (may be negative)
        #[arg(allow_negative_numbers = true)]
        n: i64,
        #[command(flatten)]
        conn: Conn,
    },
    /// Wait until every KEY exists (prints nothing).
    Wait {
        /// The keys to wait for
        #[arg(required = true, value_name = "KEY")]
        keys: Vec<String>,
        #[command(flatten)]
        conn: Conn,
    },
    /// Delete KEY; print `true` if it existed, `false` if not (exit code 0 either way).
    Delete {
        /// The key to delete
        key: String,
        #[command(flatten)]
        conn: Conn,
    },
    /// Print `true` if every KEY exists now, `false` if not (exit code 0 either way).
    Check {
        /// The keys to look for
        #[arg(required = true, value_name = "KEY")]
        keys: Vec<String>,
        #[command(flatten)]
        conn: Conn,
    },
    /// Print what the coordinator knows about the job: who waits where, who is missing.
    ///
    /// Every barrier, all-gather and broadcast someone is blocked in: for how long, how
    /// many arrived, and each missing rank with its state (never connected, connected
    /// but not arrived, lost) and host, pid, last seen; the ranks' states; lost ranks,
    /// and finished ones (their launcher saw their worker exit with code 0).
    /// For torch jobs (TCPStore clients) also: TCPStore connections and the ranks
    /// inferred for them, arrivals at `init/`, each process group's ranks that wrote
    /// their address key and the ranks others wait for that never did, store barriers,
    /// and every waiting connection (see docs/TCPSTORE.md).
    ///
    /// The last line lists the coordinator's jobs; a job it does not hold is an error
    /// (exit code 2) naming those it does. With no address given (no --addr,
    /// RALLYPOINT_ADDR or MASTER_ADDR), the coordinator of a `rallypoint launch` of
    /// this user on this machine is used, and its job unless --job says otherwise;
    /// with several launchers running, --job picks one.
    ///
    /// With --stacks, every node's launcher (`rallypoint launch`) also reads where its
    /// workers are (each one's Python stack, read from outside it) and the stacks are
    /// printed grouped: identical stacks folded with their rank ranges, the smallest
    /// group (the rank that is elsewhere) first, e.g.:
    ///
    /// rank 2 (1 of 4):      load_batch (data.py:17) ← train (train.py:40)
    ///
    /// ranks 0-1,3 (3 of 4): all_reduce (torch/distributed/distributed_c10d.py:2950) ← train (train.py:42)
    ///
    /// A node whose launcher does not answer within 10 s is named.
    ///
    /// --json prints the same as one JSON document of a documented, versioned schema
    /// (docs/STATUS.md; the live page's /api/status serves the same). --watch redraws
    /// it every second as `watch` does, ages ticking, until Ctrl-C; when stdout is
    /// not a terminal it prints one snapshot after another instead (with --json, one
    /// document per line).
    Status {
        #[command(flatten)]
        view: StatusView,
        #[command(flatten)]
        conn: Conn,
    },
    /// Start the job afresh as a new incarnation; print the incarnation.
    ///
    /// The job's keys, barrier generations, abort and lost ranks are gone, and so is
    /// every process's hold on its rank; every pending operation of the job fails,
    /// naming who reset it, and its processes are refused from then on (exit code 8).
    /// Processes started with RALLYPOINT_JOB_INCARNATION set to the printed value
    /// belong to the new incarnation; processes naming none join whatever is current.
    /// Other jobs are untouched. `rallypoint launch` does this before each attempt.
    Reset {
        /// The incarnation to start (up to 16 hex digits) [default: a random one]
        #[arg(long, value_name = "HEX", value_parser = parse::incarnation)]
        incarnation: Option<u64>,
        #[command(flatten)]
        conn: Conn,
    },
    /// Abort the job: its waiting and later operations fail (exit code 5).
    ///
    /// Every pending and later barrier, collective and wait of the job fails with
    /// REASON, naming who aborted.
    Abort {
        /// Why: every failed operation's error quotes it
        reason: String,
        #[command(flatten)]
        conn: Conn,
    },
}

/// Where the coordinator is and who this process is. Each flag falls back to the
/// environment exactly as the library's `Client::from_env` does.
#[derive(Args, Debug)]
#[command(next_help_heading = "Connection")]
pub struct Conn {
    /// Coordinator address [default: $RALLYPOINT_ADDR, else $MASTER_ADDR:$MASTER_PORT]
    #[arg(long, value_name = "HOST:PORT", value_parser = parse::addr)]
    pub(crate) addr: Option<String>,
    /// Job name; jobs on one coordinator are independent [default: $RALLYPOINT_JOB,
    /// else $TORCHELASTIC_RUN_ID, else $SLURM_JOB_ID, else "default"]
    #[arg(long, value_name = "NAME")]
    pub(crate) job: Option<String>,
    /// This process's rank [default: $RANK, else (no launcher) $SLURM_PROCID]
    #[arg(long, value_name = "N", allow_negative_numbers = true,
          value_parser = clap::value_parser!(i64).range(0..=i64::from(u32::MAX)))]
    rank: Option<i64>,
    /// Number of ranks [default: $WORLD_SIZE, else (no launcher) $SLURM_NTASKS]
    #[arg(long, value_name = "N", allow_negative_numbers = true,
          value_parser = clap::value_parser!(i64).range(1..=i64::from(u32::MAX)))]
    world_size: Option<i64>,
    /// Seconds to keep trying to connect, and then, afresh, to wait for the operation
    /// (so at most twice this in all) [default: $RALLYPOINT_TIMEOUT, else 300]
    #[arg(long, value_name = "SECS", allow_negative_numbers = true, value_parser = parse::secs)]
    timeout: Option<f64>,
    /// File holding the coordinator's token (not readable by group or others); the
    /// coordinator must prove it too [default: the file $RALLYPOINT_TOKEN_FILE names,
    /// else $RALLYPOINT_TOKEN]
    #[arg(long, value_name = "PATH")]
    pub(crate) token_file: Option<std::path::PathBuf>,
    /// Connect over TLS, trusting the CA certificate(s) in this PEM file for the
    /// coordinator's certificate [default: $RALLYPOINT_TLS_CA]
    #[arg(long, value_name = "PATH")]
    tls_ca: Option<std::path::PathBuf>,
}

/// How `status` shows what it finds.
#[derive(Args, Debug, Clone, Copy)]
pub struct StatusView {
    /// Print a JSON document (schema: docs/STATUS.md) instead of text
    #[arg(long)]
    json: bool,
    /// Show the status again every --interval seconds until interrupted: redrawn in
    /// place on a terminal, one after another otherwise
    #[arg(long)]
    watch: bool,
    /// Seconds between two snapshots with --watch
    #[arg(long, value_name = "SECS", default_value = "1", value_parser = parse::secs, requires = "watch")]
    interval: f64,
    /// With --watch: stop after N snapshots [default: until interrupted]
    #[arg(long, value_name = "N", requires = "watch")]
    count: Option<u64>,
    /// Also show where every rank is: its stack, read by its node's launcher,
    /// grouped (needs a job started with `rallypoint launch`)
    #[arg(long)]
    stacks: bool,
    /// With --stacks: native frames (C, C++) too, where the launcher's build reads
    /// them; each worker is stopped for the few milliseconds this takes
    #[arg(long, requires = "stacks")]
    native: bool,
}

/// Which ranks take part in a barrier or collective.
#[derive(Args, Debug)]
#[command(next_help_heading = "Members")]
pub struct MembersArgs {
    /// Only these ranks take part, e.g. 0,2,5 or 0-3 [default: all ranks]
    #[arg(long, value_name = "LIST", value_parser = parse::ranks, conflicts_with = "role")]
    ranks: Option<parse::RankList>,
    /// Only the ranks of this role take part; this process joins as that role
    #[arg(long, value_name = "NAME")]
    role: Option<String>,
}

pub async fn run(verb: Verb) -> anyhow::Result<()> {
    match verb {
        Verb::Barrier { name, times, members, conn } => {
            let (client, members) = collective(&conn, &members, "barrier").await?;
            let mut result = Ok(());
            for _ in 0..times {
                result = client.barrier(&name, members.clone(), None).await;
                if result.is_err() {
                    break;
                }
            }
            finish(client, result).await?;
        }
        Verb::AllGather { value, name, members, conn, null } => {
            let (client, members) = collective(&conn, &members, "all-gather").await?;
            let result = client.all_gather(&name, members, value, None).await;
            let values = finish(client, result).await?;
            let end = if null { b'\0' } else { b'\n' };
            // A value that holds the separator would take another member's place.
            if let Some(at) = values.iter().position(|value| value.contains(&end)) {
                let what =
                    if null { "a NUL byte" } else { "a newline, so it would take more than one line: use --null" };
                anyhow::bail!("all-gather '{name}': value {at} of {} (in rank order) holds {what}", values.len());
            }
            let mut out = std::io::stdout().lock();
            for value in values.iter() {
                out.write_all(value)?;
                out.write_all(&[end])?;
            }
            out.flush()?;
        }
        Verb::Broadcast { value, root, name, members, conn } => {
            let settings = conn.settings(members.role.as_deref())?;
            let (rank, world_size) = rank_and_world(&settings, "broadcast")?;
            if root >= world_size {
                usage!("--root {root} is outside the world of {world_size} ranks");
            }
            if rank == root && value.is_none() {
                usage!("broadcast: this process is the root (rank {root}), so it must give the VALUE");
            }
            let members = members.members(world_size)?;
            let client = connect(&settings).await?;
            let result = client.broadcast(&name, members, root, value.as_deref().map(str::as_bytes), None).await;
            print_line(&finish(client, result).await?)?;
        }
        Verb::Set { key, value, conn } => {
            let value = if value == "-" {
                let mut bytes = Vec::new();
                std::io::stdin().read_to_end(&mut bytes).context("reading the value from stdin")?;
                bytes
            } else {
                value.into_bytes()
            };
            let client = connect(&conn.tool()?).await?;
            let result = client.set(key, value).await;
            finish(client, result).await?;
        }
        Verb::Get { key, raw, conn } => {
            let settings = conn.tool()?;
            let client = connect(&settings).await?;
            let result = client.get(key, None).await;
            let others = other_jobs_if_empty(&client, &settings.job, &result).await;
            let value = finish(client, result).await.map_err(|error| in_job(error, &settings.job, others))?;
            if raw {
                print_bytes(&value)?;
            } else {
                print_line(&value)?;
            }
        }
        Verb::Add { key, n, conn } => {
            let client = connect(&conn.tool()?).await?;
            let result = client.add(key, n).await;
            print_line(finish(client, result).await?.to_string().as_bytes())?;
        }
        Verb::Wait { keys, conn } => {
            let settings = conn.tool()?;
            let client = connect(&settings).await?;
            let result = client.wait(&keys, None).await;
            let others = other_jobs_if_empty(&client, &settings.job, &result).await;
            finish(client, result).await.map_err(|error| in_job(error, &settings.job, others))?;
        }
        Verb::Delete { key, conn } => {
            let client = connect(&conn.tool()?).await?;
            let result = client.delete(key).await;
            print_line(finish(client, result).await?.to_string().as_bytes())?;
        }
        Verb::Check { keys, conn } => {
            let client = connect(&conn.tool()?).await?;
            let result = client.check(&keys).await;
            print_line(finish(client, result).await?.to_string().as_bytes())?;
        }
        Verb::Status { view, conn } => status::run(conn, view).await?,
        Verb::Reset { incarnation, conn } => {
            // The reset is about the job as it is now, whatever incarnation this
            // process's environment names.
            let settings = Settings { job_incarnation: None, ..conn.tool()? };
            let incarnation = incarnation.unwrap_or_else(rallypoint_client::new_job_incarnation);
            let client = connect(&settings).await?;
            let result = client.reset(incarnation).await;
            finish(client, result).await?;
            print_line(Incarnation(incarnation).to_string().as_bytes())?;
        }
        Verb::Abort { reason, conn } => {
            // As this process's rank, if it has one, so that every error names the
            // rank that aborted; as a tool if another process holds the rank (the
            // worker that runs this command).
            let settings = conn.settings(None)?;
            let client = match connect(&settings).await {
                Err(Error::Op(OpError::RankHeld { .. })) if settings.rank.is_some() => connect(&conn.tool()?).await?,
                connected => connected?,
            };
            let result = client.abort(&reason).await;
            finish(client, result).await?;
        }
    }
    Ok(())
}

pub(crate) fn quoted(names: &[String]) -> String {
    names.iter().map(|n| format!("'{n}'")).collect::<Vec<_>>().join(", ")
}

/// A key wait that timed out in a job holding no keys at all, while the coordinator
/// holds other jobs: most likely a mistyped `--job`, which the timeout alone does not
/// say (it blames the key).
#[derive(Debug)]
struct EmptyJob {
    timeout: Error,
    job: String,
    others: Vec<String>,
}

impl std::fmt::Display for EmptyJob {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Self { timeout, job, others } = self;
        write!(f, "{timeout}; job '{job}' holds no keys at all (the coordinator's other jobs: {})", quoted(others))
    }
}

impl std::error::Error for EmptyJob {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.timeout)
    }
}

/// If `result` is a key wait's timeout in job `job` that holds no keys while the
/// coordinator holds other jobs: those jobs.
async fn other_jobs_if_empty<T>(client: &Client, job: &str, result: &Result<T, Error>) -> Option<Vec<String>> {
    if !matches!(result, Err(Error::Op(rallypoint_client::OpError::KeyTimeout { .. }))) {
        return None;
    }
    if client.num_keys().await.ok()? != 0 {
        return None;
    }
    // Not launchers' own jobs: they hold no keys of the user's.
    let others: Vec<String> = client
        .jobs()
        .await
        .ok()?
        .into_iter()
        .filter(|j| j != job && rallypoint_launch::launched_job(j).is_none())
        .collect();
    (!others.is_empty()).then_some(others)
}

/// The error of a key wait in `job`, naming the coordinator's `others` if
/// [`other_jobs_if_empty`] found the job empty.
fn in_job(timeout: Error, job: &str, others: Option<Vec<String>>) -> anyhow::Error {
    match others {
        Some(others) => EmptyJob { timeout, job: job.to_owned(), others }.into(),
        None => timeout.into(),
    }
}

/// Whether the environment names a coordinator, as `Settings` reads it.
pub(crate) fn address_in_env() -> bool {
    ["RALLYPOINT_ADDR", "MASTER_ADDR"].iter().any(|v| std::env::var_os(v).is_some_and(|a| !a.is_empty()))
}

/// The one launcher of this user on this machine (the one running `job`, if given).
pub(crate) fn find_launcher(job: Option<&str>) -> anyhow::Result<discovery::Entry> {
    choose_launcher(discovery::launchers(), job)
}

/// [`find_launcher`] among `all`.
fn choose_launcher(all: Vec<discovery::Entry>, job: Option<&str>) -> anyhow::Result<discovery::Entry> {
    let mut matching: Vec<discovery::Entry> =
        all.iter().filter(|l| job.is_none_or(|j| l.job == j || l.attempt_job == j)).cloned().collect();
    // The launchers of one job's nodes on this host share its coordinator: node 0's will do.
    let one_job = matching.windows(2).all(|w| w[0].addr == w[1].addr && w[0].attempt_job == w[1].attempt_job);
    if one_job {
        matching.sort_by_key(|l| l.node_rank.unwrap_or(u32::MAX));
        matching.truncate(1);
    }
    // Several jobs of one name (on different coordinators): only the address tells them apart.
    let same_name = matching.windows(2).all(|w| w[0].job == w[1].job);
    match matching.len() {
        1 => Ok(matching.remove(0)),
        0 if all.is_empty() => usage!(
            "no coordinator address: pass --addr HOST:PORT or set RALLYPOINT_ADDR (no `rallypoint launch` of \
             this user runs on this machine)"
        ),
        0 => usage!(
            "no `rallypoint launch` of this user on this machine runs job '{}'; these do:\n{}",
            job.unwrap_or_default(),
            describe(&all)
        ),
        _ if same_name => usage!(
            "{} `rallypoint launch` of this user run job '{}' on this machine, not all on one coordinator; \
             pick one with --addr HOST:PORT:\n{}",
            matching.len(),
            matching[0].job,
            describe(&matching)
        ),
        _ => usage!(
            "{} `rallypoint launch` of this user run on this machine; pick one with --job NAME (or --addr):\n{}",
            matching.len(),
            describe(&matching)
        ),
    }
}

fn describe(launchers: &[discovery::Entry]) -> String {
    let lines: Vec<String> = launchers
        .iter()
        .map(|l| {
            format!(
                "  --job {}  (coordinator {}, pid {}, node {} of {}, {} worker(s): {})",
                l.job,
                l.addr,
                l.pid,
                l.node_rank.map_or("?".to_owned(), |n| n.to_string()),
                l.nnodes,
                l.nproc_per_node,
                one_line(&l.command)
            )
        })
        .collect();
    lines.join("\n")
}

/// Longest worker command shown in the list of launchers, in characters.
const COMMAND_SHOWN: usize = 100;

/// A worker command as one short line: a multi-line `sh -c` script would otherwise
/// fill the screen of a person choosing a launcher by its job.
fn one_line(command: &str) -> String {
    let words: Vec<&str> = command.split_whitespace().collect();
    let line = words.join(" ");
    match line.char_indices().nth(COMMAND_SHOWN) {
        Some((cut, _)) => format!("{}…", &line[..cut]),
        None => line,
    }
}

impl Conn {
    /// Flags over environment, resolved by the library so both agree.
    pub(crate) fn settings(&self, role: Option<&str>) -> anyhow::Result<Settings> {
        // Also checks that the rank is below the world size, wherever each came from.
        let settings = Settings::resolve(Overrides {
            addr: self.addr.clone(),
            job: self.job.clone(),
            rank: self.rank,
            world_size: self.world_size,
            role: role.map(str::to_owned),
            timeout_secs: self.timeout,
            token: None,
            token_file: self.token_file.clone(),
            tls_ca: self.tls_ca.clone(),
        })?;
        // From the environment: the flag was checked already.
        if let Err(problem) = parse::addr(&settings.addr) {
            usage!("bad coordinator address: {problem}");
        }
        Ok(settings)
    }
}

impl Conn {
    /// Settings of a verb that is a tool, not a rank: without rank and world size.
    fn tool(&self) -> anyhow::Result<Settings> {
        Ok(Settings { rank: None, world_size: None, role: None, ..self.settings(None)? })
    }
}

impl MembersArgs {
    fn members(&self, world_size: u32) -> anyhow::Result<Members> {
        if let Some(parse::RankList(ranks)) = &self.ranks {
            // The highest named: in "0-99" of a world of 3, rank 99 says what is wrong.
            if let Some(bad) = ranks.iter().copied().filter(|&r| r >= world_size).max() {
                usage!("--ranks: rank {bad} is outside the world of {world_size} ranks (0-{})", world_size - 1);
            }
            return Ok(Members::Ranks(ranks.clone()));
        }
        Ok(match &self.role {
            Some(role) => Members::Role(role.as_str().into()),
            None => Members::World,
        })
    }
}

fn rank_and_world(settings: &Settings, what: &str) -> anyhow::Result<(u32, u32)> {
    match (settings.rank, settings.world_size) {
        (Some(rank), Some(world_size)) => Ok((rank, world_size)),
        (None, _) => usage!("{what} needs this process's rank: pass --rank N or set RANK"),
        (_, None) => usage!("{what} needs the world size: pass --world-size N or set WORLD_SIZE"),
    }
}

/// Resolves settings and members of a barrier or collective, then connects.
async fn collective(conn: &Conn, members: &MembersArgs, what: &str) -> anyhow::Result<(Client, Members)> {
    let settings = conn.settings(members.role.as_deref())?;
    let (_, world_size) = rank_and_world(&settings, what)?;
    let members = members.members(world_size)?;
    Ok((connect(&settings).await?, members))
}

/// Connects, saying on stderr after a second, and then now and again, that it is
/// still trying and why: a verb waiting for a coordinator not up yet looks hung otherwise.
pub(crate) async fn connect(settings: &Settings) -> Result<Client, Error> {
    Client::connect_saying(settings.connect_options(), crate::exit::say).await
}

/// Leaves cleanly whatever the operation's outcome, so the coordinator counts this
/// rank as gone, not dead; the outcome alone decides the exit code.
pub(crate) async fn finish<T>(client: Client, result: Result<T, Error>) -> Result<T, Error> {
    if let Err(err) = client.close().await {
        if result.is_ok() {
            tracing::warn!("could not leave cleanly: {err}");
        }
    }
    result
}

fn print_line(value: &[u8]) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    out.write_all(value).and_then(|()| out.write_all(b"\n")).and_then(|()| out.flush()).context("writing to stdout")
}

fn print_bytes(value: &[u8]) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    out.write_all(value).and_then(|()| out.flush()).context("writing to stdout")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn launcher(job: &str, addr: &str, node_rank: u32) -> discovery::Entry {
        discovery::Entry {
            pid: 100 + node_rank,
            start_ticks: 0,
            addr: addr.to_owned(),
            job: job.to_owned(),
            attempt_job: job.to_owned(),
            node_rank: Some(node_rank),
            nnodes: 2,
            nproc_per_node: 1,
            command: "python train.py".to_owned(),
            started_unix_ms: 0,
            token_file: None,
        }
    }

    #[test]
    fn status_picks_the_launcher_of_one_job_and_asks_only_what_tells_them_apart() {
        // Two nodes of one job on this host: one coordinator, node 0's launcher.
        let nodes = vec![launcher("late", "h:1", 1), launcher("late", "h:1", 0)];
        let chosen = choose_launcher(nodes, Some("late")).expect("one job");
        assert_eq!(chosen.node_rank, Some(0));
        // Two jobs of one name on two coordinators: --job cannot choose, --addr can.
        let twins = vec![launcher("default", "h:1", 0), launcher("default", "h:2", 0)];
        let error = choose_launcher(twins, None).expect_err("ambiguous").to_string();
        assert!(error.contains("run job 'default' on this machine") && error.contains("--addr HOST:PORT"), "{error}");
        assert!(!error.contains("--job NAME"), "{error}");
        let two = vec![launcher("a", "h:1", 0), launcher("b", "h:2", 0)];
        let error = choose_launcher(two, None).expect_err("ambiguous").to_string();
        assert!(error.contains("pick one with --job NAME"), "{error}");
    }

    #[test]
    fn a_worker_command_is_shown_on_one_short_line() {
        assert_eq!(one_line("python train.py --epochs 3"), "python train.py --epochs 3");
        let script = "sh -c '\n    if [ \"$RANK\" = 1 ]; then\n        exec rp barrier hold\n    fi\n'";
        assert_eq!(one_line(script), "sh -c ' if [ \"$RANK\" = 1 ]; then exec rp barrier hold fi '");
        let long = format!("python {}", "é".repeat(200));
        let shown = one_line(&long);
        assert_eq!(shown.chars().count(), COMMAND_SHOWN + 1, "{shown}");
        assert!(shown.ends_with('…'));
    }
}
