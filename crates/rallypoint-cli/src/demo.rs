//! `rallypoint demo`: a coordinator and N worker processes on this machine. The
//! workers synchronise a few training-like steps, then one of them is killed and
//! the others learn at once which rank died.

use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::ExitStatusExt;
use std::process::{ExitStatus, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context};
use clap::Args;
use rallypoint_client::env::Settings;
use rallypoint_client::{Client, Error, Members, OpError};
use rallypoint_core::Config;
use rallypoint_server::{Server, ServerConfig};
use tokio::process::Command;

/// The job name the demo's workers use.
const JOB: &str = "demo";
/// Key where the killed rank leaves the time of its death (µs since the epoch).
const KILLED_AT: &str = "killed-at";

#[derive(Args, Debug)]
pub struct DemoArgs {
    /// Worker processes to start
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=64))]
    ranks: u32,
    /// Steps of barrier + all-gather + broadcast each worker does
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=100))]
    rounds: u32,
    /// Skip the last act (killing the last rank while the others wait for it)
    #[arg(long)]
    no_kill: bool,
}

#[derive(Args, Debug)]
pub struct WorkerArgs {
    /// Steps of barrier + all-gather + broadcast
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=100))]
    rounds: u32,
    /// The last rank kills itself with SIGKILL while the others wait for it
    #[arg(long)]
    kill_last: bool,
}

pub async fn run(args: DemoArgs) -> anyhow::Result<()> {
    let n = args.ranks;
    // Workers killing one of their own needs someone left to notice.
    let kill_last = !args.no_kill && n >= 2;
    let listen = "127.0.0.1:0".parse().context("loopback address")?;
    // A token of the demo's own, as a launched job has, which only its workers get
    // (a token or CA from this shell's environment is not theirs).
    let token = rallypoint_client::Token::generate();
    let mut config = ServerConfig::new(listen, Config::default());
    config.token = Some(std::sync::Arc::new(token.clone()));
    let server = Server::bind(config).await.context("starting the coordinator")?.spawn();
    let addr = server.local_addr();
    println!("coordinator listening on {addr}; starting {n} worker processes (job '{JOB}')\n");

    let exe = std::env::current_exe().context("finding the rallypoint executable")?;
    let mut workers = Vec::new();
    for rank in 0..n {
        let mut command = Command::new(&exe);
        command
            .arg("demo-worker")
            .args(["--rounds", &args.rounds.to_string()])
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", n.to_string())
            .env("RALLYPOINT_ADDR", addr.to_string())
            .env("RALLYPOINT_JOB", JOB)
            .env("RALLYPOINT_TIMEOUT", "60")
            .env(rallypoint_client::TOKEN_VAR, std::ffi::OsStr::from_bytes(token.secret()))
            .env(rallypoint_client::TOKEN_FILE_VAR, "")
            .env(rallypoint_client::TLS_CA_VAR, "")
            .stdin(Stdio::null())
            .kill_on_drop(true);
        if kill_last {
            command.arg("--kill-last");
        }
        workers.push(command.spawn().with_context(|| format!("starting worker {rank}"))?);
    }

    let mut failed = Vec::new();
    let deadline = Duration::from_secs(120);
    for (rank, worker) in (0..n).zip(&mut workers) {
        let status = match tokio::time::timeout(deadline, worker.wait()).await {
            Ok(status) => status.with_context(|| format!("waiting for worker {rank}"))?,
            Err(_) => bail!("worker {rank} did not finish within {} s", deadline.as_secs()),
        };
        let expected_kill = kill_last && rank == n - 1;
        if !worker_ok(status, expected_kill) {
            failed.push(format!("rank {rank} ({status})"));
        }
    }
    server.shutdown().await;

    println!();
    if !failed.is_empty() {
        bail!("demo failed: {}", failed.join(", "));
    }
    let ranks = if n == 1 { "1 rank".to_owned() } else { format!("{n} ranks") };
    println!("demo ok: {ranks} did {} steps of barrier + all-gather + broadcast", args.rounds);
    if n == 1 && !args.no_kill {
        println!("(the last act, killing a rank while its peers wait, needs --ranks 2 or more)");
    }
    if kill_last {
        let others = if n == 2 { "rank 0 was".to_owned() } else { format!("ranks 0-{} were", n - 2) };
        println!("and when rank {} was killed with SIGKILL, {others} told by name instead of hanging", n - 1);
    }
    Ok(())
}

fn unix_micros() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64)
}

/// A worker succeeded, or (the last one, when asked to) was killed.
fn worker_ok(status: ExitStatus, expected_kill: bool) -> bool {
    if expected_kill {
        status.signal() == Some(libc::SIGKILL)
    } else {
        status.success()
    }
}

/// One worker: reads RANK, WORLD_SIZE, RALLYPOINT_ADDR and RALLYPOINT_JOB like any
/// rallypoint program.
pub async fn worker(args: WorkerArgs) -> anyhow::Result<()> {
    let settings = Settings::from_env()?;
    let (rank, world_size) = match (settings.rank, settings.world_size) {
        (Some(rank), Some(world_size)) => (rank, world_size),
        _ => bail!("demo-worker needs RANK and WORLD_SIZE"),
    };
    let client = Client::connect_with(settings.connect_options()).await?;

    for step in 1..=args.rounds {
        let at = Instant::now();
        client.barrier("step", Members::World, None).await?;
        let waited = at.elapsed();

        // A made-up loss per rank: every rank sees all of them, in rank order.
        let loss = 2.0 / f64::from(step + 1) + 0.01 * f64::from(rank);
        let losses = client.all_gather("loss", Members::World, format!("{loss:.3}"), None).await?;
        let losses: Vec<_> = losses.iter().map(|l| String::from_utf8_lossy(l).into_owned()).collect();

        // Rank 0 decides the learning rate; everyone gets it.
        let lr = (rank == 0).then(|| format!("{:.4}", 0.01 / f64::from(step)));
        let lr = client.broadcast("lr", Members::World, 0, lr.as_deref().map(str::as_bytes), None).await?;

        println!(
            "[rank {rank}] step {step}: barrier 'step' passed (waited {:.1} ms) | all-gather 'loss': [{}] | broadcast 'lr' from rank 0: {}",
            waited.as_secs_f64() * 1000.0,
            losses.join(", "),
            String::from_utf8_lossy(&lr)
        );
    }

    if args.kill_last {
        if rank == world_size - 1 {
            println!("[rank {rank}] going down with SIGKILL while the others wait in barrier 'final'");
            // Let the others reach the barrier first, so they are waiting when it happens.
            tokio::time::sleep(Duration::from_millis(300)).await;
            // The others read when it happened to show how soon they knew.
            client.set(KILLED_AT, unix_micros().to_string()).await?;
            // SAFETY: kill(2) on our own pid; nothing runs after it.
            unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
        }
        match client.barrier("final", Members::World, None).await {
            Err(Error::Op(err)) if matches!(&err, OpError::PeerLost { peer, .. } if peer.rank == world_size - 1) => {
                let told = unix_micros();
                // Under a launcher, the job may be aborted by now (the launcher takes
                // it down once it has told the coordinator of the death): then told
                // without how soon.
                let after = match client.get(KILLED_AT, Some(Duration::ZERO)).await {
                    Ok(killed) => {
                        let killed: u64 = String::from_utf8_lossy(&killed).parse()?;
                        format!(" {:.1} ms after the kill", told.saturating_sub(killed) as f64 / 1000.0)
                    }
                    Err(Error::Op(OpError::Aborted { .. })) => String::new(),
                    Err(e) => return Err(e.into()),
                };
                println!("[rank {rank}] told{after}: {err}");
            }
            Ok(()) => bail!("barrier 'final' passed although rank {} was killed", world_size - 1),
            Err(err) => return Err(err.into()),
        }
    }
    client.close().await?;
    Ok(())
}
