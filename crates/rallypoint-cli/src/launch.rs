//! `rallypoint launch`: run a job's workers with an embedded coordinator.

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use rallypoint_launch::{launch, JoinError, LaunchError, LaunchOptions, PerRank, Streams};

use crate::exit::{JoinTimeout, UsageError};

#[derive(Args, Debug)]
#[command(after_help = "\
Each worker gets torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK,
GROUP_WORLD_SIZE, ROLE_*, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_*), plus RALLYPOINT_ADDR and
RALLYPOINT_JOB, so `rallypoint barrier ...` and Client::from_env() work inside it (with
--node-agent, RALLYPOINT_ADDR is this node's agent; a rank dying behind it is still named, with
its host, by every peer).
When a worker fails, every worker on every node gets SIGTERM (SIGKILL after --grace), a summary
names the root cause on stderr (the first failure, or a rank its peers lost: stopped, hung or
disconnected), and the launcher exits with the failed worker's exit code (128 + signal for a
signal). Whatever the workers started goes with them, even if the launcher is killed with SIGKILL.
Output is shown live (PYTHONUNBUFFERED=1 unless set); a console that does not read costs
lines (counted, with a notice), never the job.")]
pub struct LaunchArgs {
    /// Workers to start on this node.
    #[arg(long, default_value_t = 1)]
    nproc_per_node: u32,
    /// Nodes in the job, each running one launcher.
    #[arg(long, default_value_t = 1)]
    nnodes: u32,
    /// This node's index, 0..nnodes; node 0 hosts the coordinator [default: 0 on one
    /// node; on several, the launcher that can bind the coordinator's address is node
    /// 0 and the others take the next free index]
    #[arg(long)]
    node_rank: Option<u32>,
    /// Coordinator address HOST:PORT (node 0 binds exactly it). Default on one node: a free
    /// port on 127.0.0.1.
    #[arg(long)]
    master: Option<String>,
    /// Job name (TORCHELASTIC_RUN_ID); every node of a job must use the same.
    #[arg(long, default_value = "default")]
    job: String,
    /// Seconds between SIGTERM and SIGKILL when the job is taken down.
    #[arg(long, default_value_t = 5.0)]
    grace: f64,
    /// Write each rank's stdout and stderr to DIR/attempt<K>/rank<R>.{stdout,stderr}; the
    /// console then shows only the launcher's own messages, unless --tee.
    #[arg(long)]
    log_dir: Option<PathBuf>,
    /// With --log-dir: also show the workers' output on the console.
    #[arg(long)]
    tee: bool,
    /// Restart the whole job (all nodes) up to this many times after a failure.
    #[arg(long, default_value_t = 0)]
    max_restarts: u32,
    /// Seconds to wait for the coordinator and for every node to join.
    #[arg(long, default_value_t = 300.0)]
    join_timeout: f64,
    /// Seconds a worker may stay silent (no request, no heartbeat: stopped, hung, cut
    /// off) before the coordinator hosted on node 0 counts it lost; its peers then fail
    /// at once, naming it, and so does the summary. Clients heartbeat at a third of it;
    /// 0 turns leases off [default: 15]
    #[arg(long)]
    lease: Option<f64>,
    /// Host a node agent in this launcher: the workers' RALLYPOINT_ADDR becomes its Unix
    /// socket (unix:PATH, in a private temporary directory removed at exit) and it carries
    /// all of this node's worker connections to the coordinator over one connection.
    /// MASTER_ADDR/MASTER_PORT still name the coordinator itself (torch's TCPStore cannot
    /// go through the agent). Workers must share the launcher's filesystem to reach it.
    #[arg(long)]
    node_agent: bool,
    /// The worker command and its arguments.
    #[arg(last = true, required = true, value_name = "CMD")]
    command: Vec<OsString>,
}

pub async fn run(args: LaunchArgs) -> anyhow::Result<i32> {
    let seconds = |name: &str, v: f64| {
        Duration::try_from_secs_f64(v).map_err(|_| UsageError(format!("--{name} {v} is not a number of seconds")))
    };
    let options = LaunchOptions {
        nproc_per_node: args.nproc_per_node,
        nnodes: args.nnodes,
        node_rank: args.node_rank,
        master: args.master,
        job: args.job,
        role: "default".into(),
        host: None,
        grace: seconds("grace", args.grace)?,
        files: PerRank::All(if args.log_dir.is_some() { Streams::BOTH } else { Streams::NONE }),
        console: PerRank::All(if args.log_dir.is_none() || args.tee { Streams::BOTH } else { Streams::NONE }),
        log_dir: args.log_dir,
        line_prefix: Default::default(),
        max_restarts: args.max_restarts,
        join_timeout: seconds("join-timeout", args.join_timeout)?,
        lease: args.lease.map(|lease| seconds("lease", lease)).transpose()?,
        node_agent: args.node_agent,
        command: args.command,
    };
    match launch(options).await {
        Ok(code) => Ok(code),
        Err(LaunchError::Usage(message)) => Err(UsageError(message).into()),
        Err(LaunchError::Coordinator(e)) => Err(e.into()),
        Err(LaunchError::Join(e)) => match *e {
            e @ (JoinError::Timeout { .. } | JoinError::Attempt { .. }) => Err(JoinTimeout(e.to_string()).into()),
            // The coordinator went away: exit as its loss says (chained as the source).
            e @ JoinError::Coordinator { .. } => Err(e.into()),
            // Nodes started with different --nnodes or the same --node-rank.
            e => Err(UsageError(e.to_string()).into()),
        },
        Err(e) => Err(e.into()),
    }
}
