//! `rallypoint bench handshake`: what the token handshake and TLS cost, in one run.
//! For each security mode (plaintext, token, token over TLS) it starts a coordinator
//! of its own (`rallypoint serve` with the token file and a certificate of a CA made
//! here), then measures
//!
//! - one connect at a time: a client's connect-to-welcome latency without contention
//!   (the token adds a round trip, TLS its handshake and the certificate checks);
//! - N clients connecting at once (256 in flight, as `bench barrier` connects): how
//!   long until all are admitted;
//! - barrier rounds of those N clients: what the steady state costs (TLS encrypts
//!   every frame; the token costs nothing after the handshake).

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use rallypoint_client::{Client, ConnectOptions, Identity, TlsClient, Token};
use rallypoint_net::test_pki::TestPki;
use serde::Serialize;

use crate::{
    close_all, connect_many, mono_ns, print_report, round_stats, run_rounds, BarrierRound, Stats, Target, Times,
};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Clients connecting at once, then all in one barrier
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u32).range(1..))]
    clients: u32,
    /// Connects timed one at a time (each opened, welcomed and closed)
    #[arg(long, default_value_t = 200, value_parser = clap::value_parser!(u32).range(1..))]
    sequential: u32,
    /// Measured barrier rounds
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..))]
    rounds: u32,
    /// Unmeasured rounds before them
    #[arg(long, default_value_t = 5)]
    warmup: u32,
    /// Modes to measure, in this order
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [Mode::Plain, Mode::Token, Mode::Tls])]
    modes: Vec<Mode>,
    /// Print one JSON object instead of text
    #[arg(long)]
    json: bool,
}

#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// No token, no TLS
    Plain,
    /// The token handshake, plaintext
    Token,
    /// The token handshake over TLS
    Tls,
}

#[derive(Debug, Serialize)]
struct Report {
    clients: u32,
    rounds: u32,
    modes: Vec<ModeReport>,
}

#[derive(Debug, Serialize)]
struct ModeReport {
    mode: Mode,
    /// One client at a time: connect, hello (and token, TLS), welcome.
    connect_one: Times,
    /// All clients connecting at once, until the last is welcomed.
    connect_all_ms: f64,
    /// Barrier rounds of all clients.
    barrier: Times,
    /// Ratios to the plaintext mode's (when measured in this run).
    connect_one_median_vs_plain: Option<f64>,
    connect_all_vs_plain: Option<f64>,
    barrier_median_vs_plain: Option<f64>,
}

/// The files a coordinator and its clients need: a token file and a CA-signed
/// certificate, in a directory removed when this is dropped.
struct Material {
    pki: TestPki,
    token: Arc<Token>,
}

impl Material {
    fn make() -> anyhow::Result<Material> {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("rallypoint-bench-handshake-{}", std::process::id()));
        let pki = TestPki::create(dir, "rallypoint bench CA")
            .map_err(|error| anyhow::anyhow!("making the benchmark's certificates: {error}"))?;
        std::fs::set_permissions(pki.dir(), std::fs::Permissions::from_mode(0o700))?;
        let token = Token::generate();
        std::fs::write(pki.path("token"), token.secret())?;
        std::fs::set_permissions(pki.path("token"), std::fs::Permissions::from_mode(0o600))?;
        Ok(Material { pki, token: Arc::new(token) })
    }

    fn path(&self, name: &str) -> String {
        self.pki.path(name).display().to_string()
    }

    fn serve_args(&self, mode: Mode) -> Vec<String> {
        let mut args = Vec::new();
        if mode != Mode::Plain {
            args.extend(["--token-file".to_owned(), self.path("token")]);
        }
        if mode == Mode::Tls {
            args.extend(["--tls-cert".to_owned(), self.path("cert.pem"), "--tls-key".to_owned(), self.path("key.pem")]);
        }
        args
    }

    fn options(&self, mode: Mode, addr: &str, identity: Identity) -> anyhow::Result<ConnectOptions> {
        let options = ConnectOptions::new(addr, identity).with_timeout(Duration::from_secs(120));
        Ok(match mode {
            Mode::Plain => options,
            Mode::Token => options.with_token(Some(Arc::clone(&self.token))),
            Mode::Tls => options
                .with_token(Some(Arc::clone(&self.token)))
                .with_tls(Some(TlsClient::from_ca_file(Path::new(&self.path("ca.pem")))?)),
        })
    }
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    crate::ensure_fds(u64::from(args.clients) + 64)?;
    let material = Material::make()?;
    let mut modes = Vec::new();
    for &mode in &args.modes {
        if !args.json {
            eprintln!("{mode:?}: {} clients ...", args.clients);
        }
        let target = Target::start_with(None, &material.serve_args(mode)).await?;
        let measured = measure(&args, &material, mode, &target).await;
        target.stop().await;
        modes.push(measured.with_context(|| format!("mode {mode:?}"))?);
    }
    if let Some(plain) =
        modes.iter().find(|m| m.mode == Mode::Plain).map(|m| (m.connect_one, m.connect_all_ms, m.barrier))
    {
        for m in &mut modes {
            let ratio = |a: f64, b: f64| (b > 0.0).then(|| (a / b * 100.0).round() / 100.0);
            m.connect_one_median_vs_plain = ratio(m.connect_one.median_us, plain.0.median_us);
            m.connect_all_vs_plain = ratio(m.connect_all_ms, plain.1);
            m.barrier_median_vs_plain = ratio(m.barrier.median_us, plain.2.median_us);
        }
    }
    let report = Report { clients: args.clients, rounds: args.rounds, modes };
    print_report(&report, args.json, |report| {
        for m in &report.modes {
            println!("{:?}:", m.mode);
            println!("  one connect at a time:   {}", m.connect_one);
            println!("  {} connecting at once: {:.1} ms", report.clients, m.connect_all_ms);
            println!("  barrier round:           {}", m.barrier);
            if let (Some(one), Some(all), Some(barrier)) =
                (m.connect_one_median_vs_plain, m.connect_all_vs_plain, m.barrier_median_vs_plain)
            {
                println!("  vs plaintext: connect {one}×, all connecting {all}×, barrier {barrier}×");
            }
        }
    })
}

async fn measure(args: &Args, material: &Material, mode: Mode, target: &Target) -> anyhow::Result<ModeReport> {
    let job = format!("bench-handshake-{}-{mode:?}", std::process::id());
    // One at a time, each closed before the next: the handshake's latency alone.
    let mut one = Vec::with_capacity(args.sequential as usize);
    for i in 0..args.sequential {
        let options = material.options(mode, &target.addr, Identity::anonymous(format!("{job}-seq")))?;
        let started = Instant::now();
        let client = Client::connect_with(options).await.with_context(|| format!("sequential connect {i}"))?;
        one.push(started.elapsed());
        client.close().await?;
    }
    let connect_one = Stats::of(&mut one).context("no connects")?.times;

    // All at once. The credentials are made once (a CA file read per client would be
    // timed too).
    let n = args.clients;
    let credentials = material.options(mode, &target.addr, Identity::anonymous(""))?.credentials;
    let started = Instant::now();
    let clients = connect_many(0..n, |rank| {
        let mut options = ConnectOptions::new(target.addr.clone(), Identity::ranked(&job, rank, n))
            .with_timeout(Duration::from_secs(120));
        options.credentials = credentials.clone();
        options
    })
    .await?;
    let connect_all = started.elapsed();

    let timeout = Duration::from_secs(120);
    let round = Arc::new(BarrierRound { name: "bench", timeout });
    let start = mono_ns();
    let (clients, ends) = run_rounds(clients, (args.warmup + args.rounds) as usize, round, None).await;
    close_all(clients).await;
    let ends = ends.context("a barrier round failed")?;
    let barrier = round_stats(start, &ends, args.warmup as usize).context("no rounds measured")?.times;
    Ok(ModeReport {
        mode,
        connect_one,
        connect_all_ms: (connect_all.as_secs_f64() * 1e4).round() / 10.0,
        barrier,
        connect_one_median_vs_plain: None,
        connect_all_vs_plain: None,
        barrier_median_vs_plain: None,
    })
}
