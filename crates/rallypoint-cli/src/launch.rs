//! `rallypoint launch`: run a job's workers with an embedded coordinator. Takes
//! torchrun's command line with torchrun's meaning ([`torchrun`]), and the number
//! of nodes, the node rank and node 0's host from Slurm when run under it
//! ([`slurm`]).

mod slurm;
mod torchrun;

/// Seconds between SIGTERM and SIGKILL at a teardown unless told: torchrun's.
const DEFAULT_GRACE: f64 = 30.0;

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use clap::builder::BoolishValueParser;
use clap::Args;
use rallypoint_launch::{launch, JoinError, LaunchError, LaunchOptions, LinePrefix, PerRank, Streams};

use crate::exit::{JoinTimeout, UsageError};
use crate::parse;
use torchrun::Nproc;

/// Shown by `rallypoint launch --help` (not -h).
const LONG_HELP: &str = "\
The program:
  rallypoint launch [OPTIONS] train.py ARGS...     runs `python -u train.py ARGS...` (torchrun's way)
  rallypoint launch [OPTIONS] -m pkg.train ARGS... runs `python -u -m pkg.train ARGS...`
  rallypoint launch [OPTIONS] -- CMD ARGS...       runs CMD as it is (also --no-python SCRIPT)
  python is $PYTHON_EXEC if set (torchrun's override), else the python3 installed next to this
  command (in a venv's bin/, the venv's: torchrun uses its own interpreter), else python3, then
  python, on PATH.

Each worker gets torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK,
GROUP_WORLD_SIZE, ROLE_*, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_*; what torch's @record writes
to TORCHELASTIC_ERROR_FILE heads the summary of a failure), plus RALLYPOINT_ADDR,
RALLYPOINT_JOB and RALLYPOINT_COORDINATOR, so `rallypoint barrier ...` and Client::from_env()
work inside it (with --node-agent, RALLYPOINT_ADDR is this node's agent; a rank dying behind it
is still named, with its host, by every peer).
The job is authenticated: on one node the launcher makes a random token, and its workers find it
in the private file RALLYPOINT_TOKEN_FILE names (removed at exit); the nodes of a multi-node job
must all be given the same --token-file (or RALLYPOINT_TOKEN_FILE / RALLYPOINT_TOKEN), and so
must a job whose --master is beyond loopback, unless --insecure.
The launcher starts with a line saying where its coordinator is and how to inspect the job
(`rallypoint status`, which also finds it with no address on this machine). When a worker
fails, every worker on every node gets SIGTERM (SIGKILL after --grace), a summary names the root
cause on stderr (the first failure, or a rank its peers lost: stopped, hung or disconnected),
and the launcher exits with the failed worker's exit code (128 + signal for a signal; 127 or
126 for a program that could not start). Whatever the workers started goes with them, even if
the launcher is killed with SIGKILL. With --hang-timeout SECS, a job none of whose ranks wrote
output or asked the coordinator anything for SECS is taken for hung: node 0 reads every rank's
stack on every node, every node's summary shows them grouped (the odd rank out first, as
`rallypoint status --stacks` does), and the launcher exits 124; every other takedown then also
lists the stacks of the ranks still running. Output is shown live (PYTHONUNBUFFERED=1 unless set), each
line prefixed [rankN]: (a line torch already prefixed so is not prefixed twice); a console that
does not read costs lines (counted, with a notice), never the job.

torchrun's flags, and what they do here:
  taken as torchrun means them: --nproc-per-node (N, gpu, cpu, auto), --nnodes (N, or MIN:MAX
    with MIN = MAX), --node-rank, --master-addr, --master-port, --rdzv-endpoint (default port
    29400; port 0 on one node: a free one), --rdzv-id (the job name), --standalone, --max-restarts,
    --role, -m/--module, --no-python, --run-path, --local-addr (this node's name in reports),
    --redirects/-r and --tee/-t (0-3, or a map of local ranks like 0:3,1:2), --log-dir,
    --local-ranks-filter, --log-line-prefix-template (also $TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE;
    it replaces [rankN]: on every console line), --shutdown-timeout (= --grace; default 30 s, or
    $TORCH_ELASTIC_SHUTDOWN_TIMEOUT, as torchrun). Both spellings
    (--nproc-per-node, --nproc_per_node) and --flag=value work, and each also reads PET_<FLAG>
    (PET_NPROC_PER_NODE, ...) from the environment when not given, as torchrun does.
  rallypoint's own, in torchrun's spellings too: --hang-timeout (--hang_timeout, PET_HANG_TIMEOUT:
    torchrun has none; with it, a hang is a failure as NCCL's timeout would make it, but named).
  accepted and ignored: --rdzv-backend (any value: the coordinator is always this launcher's,
    hosted by node 0, and it is the workers' TCPStore too), --rdzv-conf (only join_timeout=SECS
    is used, as --join-timeout; the rest tunes torchrun's own rendezvous), --monitor-interval
    (exits are seen at once), --start-method (workers are always new processes).
  not accepted, because they would change what the job does: elastic --nnodes MIN:MAX with MIN <
    MAX (use a fixed size and --max-restarts), --nproc-per-node xpu, --virtual-local-rank,
    --numa-binding, --signals-to-handle (SIGINT, SIGTERM and SIGHUP are forwarded),
    --logs-specs, --event-log-handler, --duplicate-stdout-filters/--duplicate-stderr-filters.
  what differs: without --redirects or --tee, --log-dir alone sends all output to files
    (DIR/attempt<K>/rank<N>.stdout and .stderr; torchrun keeps it on the console and names its
    files DIR/<id>/attempt_<K>/<local rank>/stdout.log); --redirects/--tee without --log-dir
    write under a new directory in the temporary directory, named at the end. Console lines are
    prefixed [rankN]: (torchrun: none, or [default0]: with --tee). --node-rank may be left out
    on several nodes: the launcher that can bind the coordinator's address is node 0, the
    others take the next free index (as torchrun's c10d rendezvous). Restarts run the whole job
    again on the same nodes; a failure on any node takes every node down. The coordinator
    authenticates: on one node the launcher makes a token for its workers; a job of several
    nodes (or a coordinator listening beyond loopback) needs one token file every launcher is
    given (--token-file, RALLYPOINT_TOKEN_FILE, RALLYPOINT_TOKEN), or --insecure.

Under Slurm (SLURM_JOB_ID set), what the flags do not say comes from Slurm: --nnodes from
SLURM_STEP_NUM_NODES (an srun step) or SLURM_NNODES, --node-rank from SLURM_NODEID, node 0's host
from the first host of SLURM_STEP_NODELIST or SLURM_JOB_NODELIST (port: --master-port, else
29500), the job name from SLURM_JOB_ID. Run one launcher per node: srun --ntasks-per-node=1
rallypoint launch --nproc-per-node 4 train.py.";

#[derive(Args, Debug)]
#[command(
    after_help = "Accepts torchrun's flags (--nproc_per_node=4, --rdzv-endpoint, train.py ARGS, ...): \
                  see --help for which ones and what differs.",
    after_long_help = LONG_HELP
)]
pub struct LaunchArgs {
    /// Workers to start on this node: a number, gpu (one per visible NVIDIA GPU), cpu (one per
    /// CPU this process may run on), auto (gpu if there is one, else cpu)
    #[arg(long, alias = "nproc_per_node", env = "PET_NPROC_PER_NODE", hide_env = true,
          value_name = "N|gpu|cpu|auto", default_value = "1", value_parser = torchrun::nproc)]
    nproc_per_node: Nproc,
    /// Nodes in the job, each running one launcher; MIN:MAX only with MIN = MAX (no elastic
    /// membership) [default: 1, or Slurm's]
    #[arg(long, env = "PET_NNODES", hide_env = true, value_name = "N", value_parser = torchrun::nnodes)]
    nnodes: Option<u32>,
    /// This node's index, 0..nnodes; node 0 hosts the coordinator [default: 0 on one node, or
    /// Slurm's; on several, the launcher that can bind the coordinator's address is node 0 and
    /// the others take the next free index]
    #[arg(long, alias = "node_rank", env = "PET_NODE_RANK", hide_env = true, value_name = "N")]
    node_rank: Option<u32>,
    /// Coordinator address HOST:PORT (node 0 binds exactly it). Default on one node: a free
    /// port on 127.0.0.1
    #[arg(long, value_name = "HOST:PORT")]
    master: Option<String>,
    /// The coordinator's host, as torchrun's (with --master-port; port 29500 if not given)
    #[arg(long, alias = "master_addr", env = "PET_MASTER_ADDR", hide_env = true, value_name = "HOST")]
    master_addr: Option<String>,
    /// The coordinator's port, as torchrun's (host 127.0.0.1 if not given, or Slurm's node 0)
    #[arg(long, alias = "master_port", env = "PET_MASTER_PORT", hide_env = true, value_name = "PORT")]
    master_port: Option<u16>,
    /// The coordinator's address, as torchrun's rendezvous endpoint (port 29400 if not given)
    #[arg(long, alias = "rdzv_endpoint", env = "PET_RDZV_ENDPOINT", hide_env = true, value_name = "HOST[:PORT]")]
    rdzv_endpoint: Option<String>,
    /// Job name (TORCHELASTIC_RUN_ID); every node of a job must use the same [default:
    /// "default", or $SLURM_JOB_ID]
    #[arg(
        long,
        visible_alias = "rdzv-id",
        alias = "rdzv_id",
        env = "PET_RDZV_ID",
        hide_env = true,
        value_name = "NAME"
    )]
    job: Option<String>,
    /// Accepted for torchrun's sake and ignored: the coordinator is always this launcher's
    #[arg(long, alias = "rdzv_backend", env = "PET_RDZV_BACKEND", hide_env = true, value_name = "NAME")]
    rdzv_backend: Option<String>,
    /// torchrun's rendezvous settings: join_timeout=SECS is used (as --join-timeout), the rest
    /// ignored
    #[arg(long, alias = "rdzv_conf", env = "PET_RDZV_CONF", hide_env = true, value_name = "K=V,...")]
    rdzv_conf: Option<String>,
    /// One node, the coordinator on a free port (torchrun's; --rdzv-endpoint and
    /// --rdzv-backend are ignored)
    #[arg(long, env = "PET_STANDALONE", hide_env = true, value_parser = BoolishValueParser::new())]
    standalone: bool,
    /// Seconds between SIGTERM and SIGKILL when the job is taken down, for workers that
    /// save a checkpoint then [default: $TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 30, as torchrun]
    #[arg(long, visible_alias = "shutdown-timeout", alias = "shutdown_timeout", env = "PET_SHUTDOWN_TIMEOUT",
          hide_env = true, value_parser = parse::secs, value_name = "SECS")]
    grace: Option<f64>,
    /// Directory for log files: DIR/attempt<K>/rank<N>.{stdout,stderr}. Without --redirects or
    /// --tee every stream goes there and the console shows only the launcher's messages
    #[arg(long, alias = "log_dir", env = "PET_LOG_DIR", hide_env = true, value_name = "DIR")]
    log_dir: Option<PathBuf>,
    /// Streams written to log files instead of the console: 0 none, 1 stdout, 2 stderr, 3 both,
    /// or per local rank, e.g. 0:3,1:2
    #[arg(short = 'r', long, env = "PET_REDIRECTS", hide_env = true, value_name = "STREAMS",
          value_parser = streams)]
    redirects: Option<PerRank>,
    /// Streams written to log files and shown too (as --redirects); alone: 3
    #[arg(short = 't', long, env = "PET_TEE", hide_env = true, value_name = "STREAMS", num_args = 0..=1,
          default_missing_value = "3", value_parser = streams)]
    tee: Option<PerRank>,
    /// Only these local ranks are shown on the console (log files get every rank), e.g. 0,1
    #[arg(long, alias = "local_ranks_filter", env = "PET_LOCAL_RANKS_FILTER", hide_env = true,
          value_name = "LIST", value_parser = parse::ranks)]
    local_ranks_filter: Option<parse::RankList>,
    /// What console lines start with instead of [rankN]: , with ${rank}, ${local_rank},
    /// ${role_name}, ${hostname} replaced [default: $TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE]
    #[arg(
        long,
        alias = "log_line_prefix_template",
        env = "PET_LOG_LINE_PREFIX_TEMPLATE",
        hide_env = true,
        value_name = "TEMPLATE"
    )]
    log_line_prefix_template: Option<String>,
    /// Restart the whole job (all nodes) up to this many times after a failure
    #[arg(
        long,
        alias = "max_restarts",
        env = "PET_MAX_RESTARTS",
        hide_env = true,
        default_value_t = 0,
        value_name = "N"
    )]
    max_restarts: u32,
    /// The workers' role (ROLE_NAME)
    #[arg(long, env = "PET_ROLE", hide_env = true, default_value = "default", value_name = "NAME")]
    role: String,
    /// This node's name in the coordinator's reports and the summaries [default: the hostname]
    #[arg(long, alias = "local_addr", env = "PET_LOCAL_ADDR", hide_env = true, value_name = "ADDR")]
    local_addr: Option<String>,
    /// The program is a Python module: python -u -m MODULE ARGS
    #[arg(short = 'm', long, env = "PET_MODULE", hide_env = true, value_parser = BoolishValueParser::new())]
    module: bool,
    /// The program is run as it is, not with python (as after --)
    #[arg(long, alias = "no_python", env = "PET_NO_PYTHON", hide_env = true,
          value_parser = BoolishValueParser::new())]
    no_python: bool,
    /// The program is a Python script run with python (torchrun runs it in its own interpreter
    /// with runpy: the script sees the same __main__ and sys.argv)
    #[arg(long, alias = "run_path", env = "PET_RUN_PATH", hide_env = true, value_parser = BoolishValueParser::new())]
    run_path: bool,
    /// Accepted for torchrun's sake and ignored: worker exits are seen at once
    #[arg(long, alias = "monitor_interval", env = "PET_MONITOR_INTERVAL", hide_env = true, value_name = "SECS",
          value_parser = parse::secs)]
    monitor_interval: Option<f64>,
    /// Accepted for torchrun's sake and ignored: workers are always new processes
    #[arg(long, alias = "start_method", env = "PET_START_METHOD", hide_env = true,
          value_parser = ["spawn", "fork", "forkserver"])]
    start_method: Option<String>,
    /// Seconds to wait for the coordinator and for every node to join [default: 300]
    #[arg(long, value_parser = parse::secs, value_name = "SECS")]
    join_timeout: Option<f64>,
    /// Seconds a worker may stay silent (no request, no heartbeat: stopped, hung, cut
    /// off) before the coordinator hosted on node 0 counts it lost; its peers then fail
    /// at once, naming it, and so does the summary. Clients heartbeat at a third of it;
    /// 0 turns leases off [default: 15]
    #[arg(long, value_parser = parse::secs, value_name = "SECS")]
    lease: Option<f64>,
    /// Seconds after which a job none of whose ranks wrote output or asked the
    /// coordinator anything (a store or rallypoint operation) is taken for hung: node
    /// 0's launcher reads every rank's stack, prints them grouped in the summary (and
    /// into --log-dir), and takes the job down with exit code 124. Pick it longer than
    /// the quietest stretch of a healthy run. With it, every failure's summary also
    /// gives the stacks of the ranks still running [default: off; 0: off]
    #[arg(long, alias = "hang_timeout", env = "PET_HANG_TIMEOUT", hide_env = true, value_name = "SECS",
          value_parser = parse::secs, allow_negative_numbers = true)]
    hang_timeout: Option<f64>,
    /// Host a node agent in this launcher: the workers' RALLYPOINT_ADDR becomes its Unix
    /// socket (unix:PATH, in a private temporary directory removed at exit) and it carries
    /// all of this node's worker connections to the coordinator over one connection.
    /// MASTER_ADDR/MASTER_PORT still name the coordinator itself (torch's TCPStore cannot
    /// go through the agent). Workers must share the launcher's filesystem to reach it.
    #[arg(long)]
    node_agent: bool,
    /// File holding the job's token (not readable by group or others): every node's
    /// launcher must be given the same. On one node without it the launcher makes a
    /// token for the job; its workers find it in RALLYPOINT_TOKEN_FILE (a private file
    /// removed at exit) [default: the file $RALLYPOINT_TOKEN_FILE names, else
    /// $RALLYPOINT_TOKEN]
    #[arg(long, value_name = "PATH", help_heading = "Authentication")]
    token_file: Option<PathBuf>,
    /// Run without a token where one is needed (several nodes, or a --master beyond
    /// loopback), and make none: anyone who reaches the coordinator can read, change,
    /// join or abort the job.
    #[arg(long, help_heading = "Authentication")]
    insecure: bool,
    /// Serve PyTorch TCPStore clients (which cannot prove a token) from this network
    /// of other machines too, e.g. 10.0.0.0/16; repeatable. This user's processes on
    /// node 0, and the other nodes whose launchers proved the token, are always served
    #[arg(long, value_name = "CIDR", help_heading = "Authentication")]
    tcpstore_allow: Vec<rallypoint_server::IpNet>,
    /// Serve the live page of the job (each rank's state, who waits where, this node's
    /// workers and how they ended), its JSON API (/api/status) and Prometheus metrics
    /// (/metrics) over HTTP at this address, e.g. 127.0.0.1:8080, from node 0 (which
    /// hosts the coordinator). Requests must carry the job's token; the line the
    /// launcher prints links to the page with it when the launcher made the token
    #[arg(long, value_name = "IP:PORT", help_heading = "Live page and metrics", value_parser = crate::parse::listen)]
    http: Option<std::net::SocketAddr>,
    #[command(flatten)]
    refused: torchrun::Refused,
    /// The program and its arguments: SCRIPT.py ARGS (run with python), -m MODULE ARGS, or
    /// -- CMD ARGS (run as it is)
    #[arg(value_name = "PROGRAM", required = true, trailing_var_arg = true)]
    program: Vec<OsString>,
}

fn streams(text: &str) -> Result<PerRank, String> {
    text.parse().map_err(|e: rallypoint_launch::BadStreams| e.to_string())
}

/// Reads an environment variable (unset and empty alike: `None`).
type Lookup = Box<dyn Fn(&str) -> Option<String>>;

/// Where values come from besides the flags: the environment, and this executable.
pub struct Context {
    /// The command line as given (to tell `-- CMD` from `SCRIPT`).
    pub argv: Vec<OsString>,
    pub var: Lookup,
    pub exe: Option<PathBuf>,
    pub gpus: PathBuf,
}

impl Context {
    pub fn of_process() -> Context {
        Context {
            argv: std::env::args_os().collect(),
            var: Box::new(|name| std::env::var(name).ok().filter(|v| !v.is_empty())),
            exe: std::env::current_exe().ok(),
            gpus: PathBuf::from(torchrun::NVIDIA_GPUS),
        }
    }
}

pub async fn run(args: LaunchArgs) -> anyhow::Result<i32> {
    let options = args.options(&Context::of_process()).map_err(UsageError)?;
    match launch(options).await {
        Ok(code) => Ok(code),
        Err(LaunchError::Usage(message)) => Err(UsageError(message).into()),
        Err(LaunchError::Coordinator(e)) => Err(e.into()),
        Err(LaunchError::Join(e)) => match *e {
            e @ (JoinError::Timeout { .. } | JoinError::Attempt { .. } | JoinError::Unreached { .. }) => {
                Err(JoinTimeout(e.to_string()).into())
            }
            // The coordinator went away: exit as its loss says (chained as the source).
            e @ JoinError::Coordinator { .. } => Err(e.into()),
            // Nodes started with different --nnodes or the same --node-rank.
            e => Err(UsageError(e.to_string()).into()),
        },
        Err(e) => Err(e.into()),
    }
}

impl LaunchArgs {
    /// The launcher's options: torchrun's flags read with torchrun's meaning, then
    /// Slurm's variables for what they leave open.
    fn options(self, cx: &Context) -> Result<LaunchOptions, String> {
        self.refused.check()?;
        let var = &cx.var;
        let nproc_per_node = self.nproc_per_node.resolve(&cx.gpus, var("CUDA_VISIBLE_DEVICES").as_deref())?;
        let explicit_master = [self.master.is_some(), self.master_addr.is_some() || self.master_port.is_some()];
        if self.master.is_some() && (explicit_master[1] || self.rdzv_endpoint.is_some()) {
            return Err("give the coordinator's address once: --master HOST:PORT, --rdzv-endpoint HOST:PORT, or \
                        --master-addr/--master-port"
                .into());
        }
        let endpoint = match (&self.rdzv_endpoint, self.standalone) {
            (Some(endpoint), false) => Some(torchrun::endpoint(endpoint)?),
            _ => None,
        };

        // Slurm, for what the flags leave open.
        let wants_slurm = self.nnodes.is_none()
            || self.nnodes.is_some_and(|n| n > 1)
                && (self.node_rank.is_none() || !(explicit_master.contains(&true) || endpoint.is_some()));
        let slurm = if wants_slurm && !self.standalone { slurm::from_env(var.as_ref())? } else { None };
        let nnodes = self.nnodes.or(slurm.as_ref().map(|s| s.nnodes)).unwrap_or(1);
        if self.standalone && nnodes != 1 {
            return Err(format!("--standalone runs one node, not --nnodes {nnodes}"));
        }
        let node_rank = self.node_rank.or(slurm.as_ref().filter(|_| nnodes > 1).map(|s| s.node_id));

        let master = if self.standalone {
            None
        } else if let Some(master) = &self.master {
            Some(parse::addr(master)?)
        } else if let Some(endpoint) = endpoint {
            if explicit_master[1] {
                return Err("give the coordinator's address once: --rdzv-endpoint, or --master-addr/--master-port \
                            (rallypoint's coordinator is both)"
                    .into());
            }
            Some(endpoint)
        } else {
            let host = self.master_addr.clone().or(slurm.as_ref().map(|s| s.first_host.clone()));
            match (host, self.master_port) {
                (None, None) => None,
                // One node without a port: a free one (torchrun picks one too).
                (Some(host), None) if nnodes == 1 => Some(torchrun::host_port(&host, 0)),
                (host, port) => Some(torchrun::host_port(
                    host.as_deref().unwrap_or("127.0.0.1"),
                    port.unwrap_or(torchrun::MASTER_PORT),
                )),
            }
        };
        if nnodes > 1 && master.is_none() {
            return Err(format!(
                "--nnodes {nnodes} needs the coordinator's address on every node: --rdzv-endpoint HOST:PORT, \
                 --master-addr HOST --master-port PORT, or --master HOST:PORT (under Slurm it comes from \
                 SLURM_JOB_NODELIST)"
            ));
        }
        if nnodes > 1 && master.as_deref().is_some_and(|m| m.ends_with(":0")) {
            return Err("port 0 (a free port) works on one node only: the other nodes must know the port".into());
        }
        let job = self.job.or(slurm.map(|s| s.job_id)).unwrap_or_else(|| "default".to_owned());

        let join_timeout = match (self.join_timeout, self.rdzv_conf.as_deref().map(torchrun::rdzv_conf).transpose()?) {
            (Some(secs), _) | (None, Some(Some(secs))) => secs,
            _ => 300.0,
        };

        // Where output goes.
        let torchrun_style = self.redirects.is_some() || self.tee.is_some();
        let (files, mut console) = if torchrun_style {
            let redirects = self.redirects.unwrap_or(PerRank::All(Streams::NONE));
            let tee = self.tee.unwrap_or(PerRank::All(Streams::NONE));
            let ranks = 0..nproc_per_node;
            let files = ranks.clone().map(|l| (l, redirects.get(l).union(tee.get(l)))).collect();
            let console = ranks.map(|l| (l, Streams::BOTH.minus(redirects.get(l)).union(tee.get(l)))).collect();
            (PerRank::Ranks(files), PerRank::Ranks(console))
        } else if self.log_dir.is_some() {
            (PerRank::All(Streams::BOTH), PerRank::All(Streams::NONE))
        } else {
            (PerRank::All(Streams::NONE), PerRank::All(Streams::BOTH))
        };
        if let Some(parse::RankList(shown)) = &self.local_ranks_filter {
            console = PerRank::Ranks(
                (0..nproc_per_node)
                    .map(|l| (l, if shown.contains(&l) { console.get(l) } else { Streams::NONE }))
                    .collect(),
            );
        }
        let log_dir = match self.log_dir {
            Some(dir) => Some(dir),
            // torchrun writes into a new temporary directory too.
            None if files.any_of(nproc_per_node) => Some(temp_log_dir().map_err(|e| format!("--log-dir: {e}"))?),
            None => None,
        };
        let line_prefix = match self.log_line_prefix_template.or_else(|| var("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE")) {
            Some(template) => LinePrefix::template(template),
            None => LinePrefix::default(),
        };

        let words_after_dashes = {
            let n = self.program.len();
            cx.argv.len() > n && cx.argv[cx.argv.len() - n - 1] == "--"
        };
        let program = torchrun::Program {
            after_dashes: words_after_dashes,
            words: self.program,
            module: self.module,
            no_python: self.no_python,
            run_path: self.run_path,
        };
        let command = program.command(|| {
            torchrun::python(var("PYTHON_EXEC").map(OsString::from), cx.exe.clone(), var("PATH").map(OsString::from))
        })?;

        let token = match &self.token_file {
            Some(path) => Some(rallypoint_client::Token::from_file(path).map_err(|e| e.to_string())?),
            None => rallypoint_client::Token::from_lookup(|name| (cx.var)(name).map(Into::into))
                .map_err(|e| e.to_string())?,
        }
        .map(std::sync::Arc::new);
        // torchrun's default and variable (PET_SHUTDOWN_TIMEOUT is the flag's).
        let grace = match (self.grace, var("TORCH_ELASTIC_SHUTDOWN_TIMEOUT")) {
            (Some(secs), _) => secs,
            (None, Some(text)) => parse::secs(&text).map_err(|e| format!("TORCH_ELASTIC_SHUTDOWN_TIMEOUT: {e}"))?,
            (None, None) => DEFAULT_GRACE,
        };
        let seconds = |name: &str, v: f64| {
            Duration::try_from_secs_f64(v).map_err(|_| format!("--{name} {v} is not a number of seconds"))
        };
        Ok(LaunchOptions {
            nproc_per_node,
            nnodes,
            node_rank,
            master,
            job,
            role: self.role,
            host: self.local_addr,
            grace: seconds("grace", grace)?,
            log_dir,
            files,
            console,
            line_prefix,
            max_restarts: self.max_restarts,
            join_timeout: seconds("join-timeout", join_timeout)?,
            lease: self.lease.map(|lease| seconds("lease", lease)).transpose()?,
            hang_timeout: self
                .hang_timeout
                .map(|secs| seconds("hang-timeout", secs))
                .transpose()?
                .filter(|d| !d.is_zero()),
            node_agent: self.node_agent,
            token: token.clone(),
            insecure: self.insecure,
            tcpstore_allow: self.tcpstore_allow,
            command,
            // Without --insecure the job always has a token (given, or made by the
            // launcher), so a page beyond loopback is behind it.
            observe: self.http.map(|listen| {
                crate::page::LaunchPage::new(listen, self.insecure, token.is_some())
                    as std::sync::Arc<dyn rallypoint_launch::LaunchObserver>
            }),
        })
    }
}

/// A new directory for log files nobody gave a place to, as torchrun makes one.
fn temp_log_dir() -> std::io::Result<PathBuf> {
    use std::os::unix::fs::DirBuilderExt;
    let pid = std::process::id();
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    let dir = std::env::temp_dir().join(format!("rallypoint-logs-{pid}-{nanos:x}"));
    std::fs::DirBuilder::new().mode(0o700).create(&dir)?;
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        launch: LaunchArgs,
    }

    /// The options `rallypoint launch ARGS` gets with `vars` as its environment (but
    /// for PET_* variables, which clap reads from the process's own: the integration
    /// tests set those).
    fn options(args: &[&str], vars: &[(&str, &str)]) -> Result<LaunchOptions, String> {
        let vars: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let argv: Vec<OsString> = ["rallypoint", "launch"].iter().chain(args).map(OsString::from).collect();
        let cli = Cli::try_parse_from(argv.iter().skip(1)).map_err(|e| e.to_string())?;
        let cx = Context {
            argv,
            var: Box::new(move |name| vars.get(name).cloned()),
            exe: None,
            gpus: PathBuf::from("/nonexistent/gpus"),
        };
        cli.launch.options(&cx)
    }

    fn words(o: &LaunchOptions) -> Vec<String> {
        o.command.iter().map(|w| w.to_string_lossy().into_owned()).collect()
    }

    const PY: (&str, &str) = ("PYTHON_EXEC", "/py/bin/python3");

    #[test]
    fn both_spellings_and_equals_signs() {
        for args in [
            &["--nproc_per_node=3", "--max_restarts=2", "--rdzv_id=run7", "t.py"][..],
            &["--nproc-per-node", "3", "--max-restarts", "2", "--rdzv-id", "run7", "t.py"],
            &["--nproc-per-node=3", "--max-restarts=2", "--job=run7", "t.py"],
        ] {
            let o = options(args, &[PY]).unwrap();
            assert_eq!((o.nproc_per_node, o.max_restarts, o.job.as_str()), (3, 2, "run7"), "{args:?}");
            assert_eq!(words(&o), ["/py/bin/python3", "-u", "t.py"]);
        }
    }

    #[test]
    fn the_program() {
        let o = options(&["train.py", "--lr", "0.1", "--", "x"], &[PY]).unwrap();
        assert_eq!(words(&o), ["/py/bin/python3", "-u", "train.py", "--lr", "0.1", "--", "x"]);
        let o = options(&["--", "./worker", "--flag"], &[PY]).unwrap();
        assert_eq!(words(&o), ["./worker", "--flag"]);
        let o = options(&["--no-python", "./run.sh", "a"], &[PY]).unwrap();
        assert_eq!(words(&o), ["./run.sh", "a"]);
        let o = options(&["-m", "pkg.train", "-v"], &[PY]).unwrap();
        assert_eq!(words(&o), ["/py/bin/python3", "-u", "-m", "pkg.train", "-v"]);
        let o = options(&["--run-path", "/abs/t.py"], &[PY]).unwrap();
        assert_eq!(words(&o), ["/py/bin/python3", "-u", "/abs/t.py"]);
        assert!(options(&["--no-python", "-m", "x"], &[PY]).unwrap_err().contains("--no-python"));
        assert!(options(&["--bogus", "t.py"], &[PY]).unwrap_err().contains("--bogus"));
    }

    #[test]
    fn coordinator_addresses() {
        let master = |args: &[&str]| options(&[args, &["t.py"]].concat(), &[PY]).map(|o| o.master);
        assert_eq!(master(&[]), Ok(None));
        assert_eq!(master(&["--master-port", "1234"]), Ok(Some("127.0.0.1:1234".into())));
        assert_eq!(master(&["--master-addr", "10.0.0.1"]), Ok(Some("10.0.0.1:0".into())), "one node: a free port");
        assert_eq!(master(&["--nnodes", "2", "--node-rank", "1", "--master-addr", "n0"]), Ok(Some("n0:29500".into())));
        assert_eq!(master(&["--rdzv-endpoint", "localhost:0"]), Ok(Some("localhost:0".into())));
        assert_eq!(master(&["--rdzv_endpoint=n0", "--nnodes=2"]), Ok(Some("n0:29400".into())));
        assert_eq!(master(&["--standalone", "--rdzv-endpoint", "n0:1"]), Ok(None), "standalone ignores it");
        assert_eq!(master(&["--master", "h:7"]), Ok(Some("h:7".into())));
        assert!(master(&["--master", "h:7", "--master-port", "8"]).unwrap_err().contains("once"));
        assert!(master(&["--rdzv-endpoint", "h:7", "--master-addr", "g"]).unwrap_err().contains("once"));
        assert!(master(&["--nnodes", "2"]).unwrap_err().contains("needs the coordinator's address"));
        assert!(master(&["--nnodes", "2", "--rdzv-endpoint", "h:0"]).unwrap_err().contains("one node only"));
        assert!(master(&["--standalone", "--nnodes", "2"]).unwrap_err().contains("--standalone runs one node"));
        assert!(master(&["--nnodes", "1:2"]).unwrap_err().contains("elastic membership"));
        assert_eq!(options(&["--nnodes", "2:2", "--master-port", "9", "t.py"], &[PY]).unwrap().nnodes, 2);
    }

    #[test]
    fn torchruns_refused_flags_are_refused_by_name() {
        for (args, flag) in [
            (&["--numa-binding", "node"][..], "--numa-binding"),
            (&["--numa_binding=socket"], "--numa-binding"),
            (&["--virtual-local-rank"], "--virtual-local-rank"),
            (&["--signals-to-handle", "SIGUSR1"], "--signals-to-handle"),
            (&["--logs_specs=x"], "--logs-specs"),
            (&["--event-log-handler", "console"], "--event-log-handler"),
            (&["--duplicate-stdout-filters", "err"], "--duplicate-stdout-filters"),
            (&["--duplicate_stderr_filters=err"], "--duplicate-stderr-filters"),
        ] {
            let args: Vec<&str> = args.iter().copied().chain(["t.py"]).collect();
            let refused = options(&args, &[PY]).unwrap_err();
            assert!(refused.starts_with(&format!("{flag} is torchrun's and not accepted")), "{args:?}: {refused}");
        }
        // After the program, they are the program's.
        let o = options(&["t.py", "--numa-binding", "node"], &[PY]).unwrap();
        assert_eq!(words(&o)[words(&o).len() - 2..], ["--numa-binding", "node"]);
    }

    #[test]
    fn accepted_and_ignored() {
        let o = options(
            &[
                "--rdzv-backend=c10d",
                "--rdzv-conf=join_timeout=42,close_timeout=3",
                "--monitor-interval=0.5",
                "--start-method=fork",
                "--role=trainer",
                "--local-addr=node-a",
                "--shutdown-timeout=9",
                "t.py",
            ],
            &[PY],
        )
        .unwrap();
        assert_eq!(o.join_timeout, Duration::from_secs(42));
        assert_eq!((o.role.as_str(), o.host.as_deref(), o.grace), ("trainer", Some("node-a"), Duration::from_secs(9)));
        let o = options(&["--rdzv-conf=join_timeout=42", "--join-timeout=7", "t.py"], &[PY]).unwrap();
        assert_eq!(o.join_timeout, Duration::from_secs(7), "--join-timeout wins");
        assert!(options(&["--start-method=thread", "t.py"], &[PY]).is_err());
        assert!(options(&["--rdzv-conf=oops", "t.py"], &[PY]).unwrap_err().contains("key=value"));
    }

    #[test]
    fn the_grace_is_torchruns() {
        let grace = |args: &[&str], vars: &[(&str, &str)]| {
            let args: Vec<&str> = args.iter().copied().chain(["t.py"]).collect();
            options(&args, &[PY].into_iter().chain(vars.iter().copied()).collect::<Vec<_>>()).map(|o| o.grace)
        };
        assert_eq!(grace(&[], &[]), Ok(Duration::from_secs(30)));
        assert_eq!(grace(&[], &[("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "12")]), Ok(Duration::from_secs(12)));
        assert_eq!(grace(&["--grace", "2"], &[("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "12")]), Ok(Duration::from_secs(2)));
        let refused = grace(&[], &[("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "soon")]).unwrap_err();
        assert!(refused.starts_with("TORCH_ELASTIC_SHUTDOWN_TIMEOUT: "), "{refused}");
    }

    #[test]
    fn redirects_tee_and_log_dirs() {
        let both = Streams::BOTH;
        let out = Streams { stdout: true, stderr: false };
        let err = Streams { stdout: false, stderr: true };
        // rallypoint's --log-dir: files only; --tee (no value): files and console.
        let o = options(&["--log-dir", "/l", "t.py"], &[PY]).unwrap();
        assert_eq!((o.files.get(0), o.console.get(0)), (both, Streams::NONE));
        let o = options(&["--log-dir", "/l", "--tee", "--", "cmd"], &[PY]).unwrap();
        assert_eq!((o.files.get(0), o.console.get(0)), (both, both));
        // torchrun's: -r 1 sends stdout to files only; --tee 0:2,1:3 per local rank.
        let o = options(&["--nproc-per-node=2", "--log-dir=/l", "-r", "1", "t.py"], &[PY]).unwrap();
        assert_eq!((o.files.get(1), o.console.get(1)), (out, err));
        let o = options(&["--nproc-per-node=2", "--log_dir=/l", "--tee=0:2,1:3", "t.py"], &[PY]).unwrap();
        assert_eq!((o.files.get(0), o.console.get(0)), (err, both));
        assert_eq!((o.files.get(1), o.console.get(1)), (both, both));
        // No --log-dir: a new temporary one, as torchrun.
        let o = options(&["-r", "3", "t.py"], &[PY]).unwrap();
        let dir = o.log_dir.clone().expect("a log dir");
        assert!(dir.starts_with(std::env::temp_dir()) && dir.is_dir(), "{}", dir.display());
        std::fs::remove_dir(&dir).expect("cleanup");
        // Console filter.
        let o = options(&["--nproc-per-node=3", "--local-ranks-filter=0,2", "t.py"], &[PY]).unwrap();
        assert_eq!([o.console.get(0), o.console.get(1), o.console.get(2)], [both, Streams::NONE, both]);
        assert!(options(&["--tee", "s.py"], &[PY]).unwrap_err().contains("'s.py' is not 0"));
        // Prefix template, from the flag or torchrun's variable.
        let o = options(&["t.py"], &[PY, ("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "${rank}| ")]).unwrap();
        assert_eq!(o.line_prefix.render(3, 1, "default", "h").as_deref(), Some("3| "));
    }

    #[test]
    fn slurm_fills_in_what_the_flags_leave_open() {
        let step = [
            PY,
            ("SLURM_JOB_ID", "777"),
            ("SLURM_STEP_ID", "0"),
            ("SLURM_STEP_NUM_NODES", "4"),
            ("SLURM_STEP_NODELIST", "gpu[08-11]"),
            ("SLURM_STEP_NUM_TASKS", "4"),
            ("SLURM_NODEID", "2"),
        ];
        let o = options(&["t.py"], &step).unwrap();
        assert_eq!((o.nnodes, o.node_rank, o.job.as_str()), (4, Some(2), "777"));
        assert_eq!(o.master.as_deref(), Some("gpu08:29500"));
        let o = options(&["--master-port", "6000", "--job", "mine", "t.py"], &step).unwrap();
        assert_eq!((o.master.as_deref(), o.job.as_str()), (Some("gpu08:6000"), "mine"));
        let o = options(&["--nnodes", "1", "t.py"], &step).unwrap();
        assert_eq!((o.nnodes, o.node_rank, o.master.as_deref()), (1, None, None), "the flags say it all");
        let batch = [PY, ("SLURM_JOB_ID", "1"), ("SLURM_NNODES", "2"), ("SLURM_JOB_NODELIST", "n[1-2]")];
        assert!(options(&["t.py"], &batch).unwrap_err().contains("srun --ntasks-per-node=1"));
    }

    #[test]
    fn the_hang_timeout_is_off_unless_given() {
        assert_eq!(options(&["t.py"], &[PY]).unwrap().hang_timeout, None);
        let o = options(&["--hang-timeout", "2.5", "t.py"], &[PY]).unwrap();
        assert_eq!(o.hang_timeout, Some(Duration::from_millis(2500)));
        let o = options(&["--hang_timeout=60", "t.py"], &[PY]).unwrap();
        assert_eq!(o.hang_timeout, Some(Duration::from_secs(60)), "torchrun's spelling");
        assert_eq!(options(&["--hang-timeout", "0", "t.py"], &[PY]).unwrap().hang_timeout, None, "0: off");
        assert!(options(&["--hang-timeout", "-1", "t.py"], &[PY]).unwrap_err().contains("seconds must be 0 or more"));
    }

    #[test]
    fn gpu_counts_need_gpus() {
        assert!(options(&["--nproc-per-node", "gpu", "t.py"], &[PY]).unwrap_err().contains("no NVIDIA GPU"));
        assert!(options(&["--nproc-per-node", "auto", "t.py"], &[PY]).unwrap().nproc_per_node >= 1);
    }
}
