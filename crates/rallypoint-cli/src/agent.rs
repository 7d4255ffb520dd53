//! `rallypoint agent`: a node agent, until SIGINT or SIGTERM or the loss of its
//! coordinator.

use clap::Args;
use rallypoint_agent::{Agent, AgentConfig};

use crate::parse;
use crate::serve::{print_addr, shutdown_signal};

#[derive(Args, Debug)]
pub struct AgentArgs {
    /// The coordinator this agent carries its node's ranks to
    #[arg(long, value_name = "HOST:PORT")]
    upstream: String,
    /// Where this node's ranks connect (their RALLYPOINT_ADDR): `IP:PORT` (port 0 picks
    /// a free port) or `unix:PATH` for a Unix domain socket (cheaper per message)
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:29501")]
    listen: String,
    /// Seconds to keep trying to reach the coordinator at start
    #[arg(long, value_name = "SECS", default_value = "300", value_parser = parse::secs)]
    connect_timeout: f64,
    /// Seconds a local rank may stop sending in the middle of a request before it is
    /// disconnected
    #[arg(long, value_name = "SECS", default_value = "30", value_parser = parse::secs)]
    read_timeout: f64,
    /// Bytes of unfinished requests all local ranks together may hold; past it, the
    /// connection holding the most is closed
    #[arg(long, value_name = "BYTES", default_value_t = 256 << 20)]
    max_pending_bytes: usize,
    /// Print the local address as the first line on stdout (for scripts using port 0)
    #[arg(long)]
    print_addr: bool,
    /// The token (--token-file, else $RALLYPOINT_TOKEN_FILE's file, else
    /// $RALLYPOINT_TOKEN) is proven to the coordinator and required of every local
    /// rank; --tls-cert/--tls-key serve local ranks over TCP with TLS
    #[command(flatten)]
    auth: crate::auth::ServeAuth,
    /// Reach the coordinator over TLS, trusting the CA certificate(s) in this PEM
    /// file for its certificate [default: $RALLYPOINT_TLS_CA]
    #[arg(long, value_name = "PATH", help_heading = "Authentication and TLS")]
    tls_ca: Option<std::path::PathBuf>,
}

pub async fn run(args: AgentArgs) -> anyhow::Result<()> {
    let mut config = AgentConfig::new(args.upstream, args.listen);
    config.connect_timeout = std::time::Duration::from_secs_f64(args.connect_timeout);
    config.read_timeout = std::time::Duration::from_secs_f64(args.read_timeout);
    config.max_pending_bytes = args.max_pending_bytes;
    config.token = args.auth.token()?;
    config.tls = args.auth.tls()?;
    config.upstream_tls = crate::auth::tls_ca(args.tls_ca.as_ref())?;
    let stop = shutdown_signal()?;
    let agent = Agent::bind(config).await?;
    if args.print_addr {
        print_addr(agent.local_addr())?;
    }
    agent.run_until(stop).await?;
    Ok(())
}
