//! `rallypoint status`: the coordinator's jobs and one job's report, as text or as
//! the JSON document of docs/STATUS.md, once or again and again (`--watch`).
//!
//! `--watch` on a terminal draws on the alternate screen, as `watch` does, and puts
//! the terminal back however it ends (Ctrl-C, `--count`, an error); elsewhere it
//! prints one snapshot after another. One connection serves every redraw; if the
//! coordinator goes away the screen says so and the next redraw connects again.

use std::io::{IsTerminal, Write};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use rallypoint_client::env::Settings;
use rallypoint_client::Client;
use rallypoint_core::snapshot::{StatusDocument, STATUS_SCHEMA};
use rallypoint_launch::stacks::{Ask, Collected};
use rallypoint_launch::{discovery, launched_job, launchers_job};

use super::{address_in_env, connect, find_launcher, finish, Conn, StatusView};
use crate::exit::{usage, UsageError};

pub(super) async fn run(mut conn: Conn, view: StatusView) -> anyhow::Result<()> {
    let token_given = conn.token_file.is_some()
        || [rallypoint_client::TOKEN_VAR, rallypoint_client::TOKEN_FILE_VAR]
            .iter()
            .any(|v| std::env::var_os(v).is_some_and(|t| !t.is_empty()));
    match &conn.addr {
        None if !address_in_env() => {
            let launcher = find_launcher(conn.job.as_deref())?;
            conn.addr = Some(launcher.addr);
            conn.job = Some(conn.job.unwrap_or(launcher.attempt_job));
            // The launcher's own token, unless one was given.
            if !token_given {
                conn.token_file = launcher.token_file;
            }
        }
        // The address a launcher of this user here prints ("inspect it with: ..."):
        // the token it made for its job, unless one was given.
        Some(addr) if !token_given => {
            if let Some(launcher) = discovery::launchers().into_iter().find(|l| l.addr == *addr) {
                conn.token_file = launcher.token_file;
            }
        }
        _ => {}
    }
    // A tool, not a rank: run inside a worker, it neither takes the worker's rank
    // (held by the worker's own client) nor shows itself among the ranks.
    let settings = conn.tool()?;
    let client = connect(&settings).await?;
    if view.watch {
        return watch(client, &settings, view).await;
    }
    let shown = show(&client, &settings, What::of(&view, true)).await;
    finish(client, Ok(())).await?;
    match shown {
        Ok(text) => print(&text),
        Err(Failure::NoSuchJob(message)) => usage!("{message}"),
        Err(Failure::Client(error)) => Err(error.into()),
    }
}

/// Why a snapshot could not be shown.
enum Failure {
    /// The coordinator does not hold the job (a usage error, exit code 2).
    NoSuchJob(String),
    Client(rallypoint_client::Error),
}

impl From<rallypoint_client::Error> for Failure {
    fn from(e: rallypoint_client::Error) -> Self {
        Failure::Client(e)
    }
}

/// What a snapshot shows.
#[derive(Debug, Clone, Copy)]
struct What {
    json: bool,
    /// JSON drawn for a person (indented).
    pretty: bool,
    /// The ranks' stacks too: `Some(native)`.
    stacks: Option<bool>,
}

impl What {
    fn of(view: &StatusView, pretty: bool) -> What {
        What { json: view.json, pretty, stacks: view.stacks.then_some(view.native) }
    }
}

/// How long `status --stacks` waits for the launchers' answers (at most).
const STACKS_WAIT: Duration = Duration::from_secs(10);

/// The report (or JSON document) of the job, with the coordinator's jobs and, if
/// asked, its ranks' stacks.
async fn show(client: &Client, settings: &Settings, what: What) -> Result<String, Failure> {
    let What { json, pretty, stacks } = what;
    let mut jobs = client.jobs().await?;
    let complete = jobs.len() < rallypoint_core::MAX_JOBS_LISTED;
    // A launcher's job whose workers have not connected (yet, or ever: they need not
    // use rallypoint) exists all the same: its launchers are there.
    let launched = jobs.contains(&launchers_job(&settings.job));
    // The job's snapshot where it was taken to tell whether the job exists: kept for
    // the JSON document, which would ask for it again.
    let mut snapshot = None;
    if complete && !launched && !jobs.contains(&settings.job) {
        // So does a job reset (`rallypoint reset`) with nothing in it since: its
        // incarnation is the job's state, which every process joining it must match.
        let taken = snapshot.insert(client.snapshot().await?);
        if taken.incarnation.is_none() {
            let held = if jobs.is_empty() { "none".to_owned() } else { named_jobs(&jobs) };
            return Err(Failure::NoSuchJob(format!(
                "the coordinator at {} holds no job '{}' (its jobs: {held})",
                settings.addr, settings.job
            )));
        }
        jobs.push(settings.job.clone());
        jobs.sort_unstable();
    }
    // While its launchers wait for nodes to join, no worker runs: said as such rather
    // than as a job of workers (and no node is asked for stacks it cannot have).
    let launch_job = launch_job_of(&jobs, &settings.job);
    let joining = match &launch_job {
        Some(launch_job) if !json => joining(settings, launch_job).await,
        _ => None,
    };
    let stacks = match stacks {
        Some(_) if joining.is_some() => None,
        Some(native) => {
            let Some(launch_job) = launch_job else {
                return Err(Failure::NoSuchJob(format!(
                    "--stacks asks the job's launchers, and job '{}' has none on the coordinator at {} (no \
                     '{}' job): was it started with `rallypoint launch`?",
                    settings.job,
                    settings.addr,
                    launchers_job(&settings.job)
                )));
            };
            Some(read_stacks(settings, &launch_job, native).await?)
        }
        None => None,
    };
    if json {
        let document = StatusDocument {
            schema: STATUS_SCHEMA,
            coordinator: settings.addr.clone(),
            generated_unix_ms: unix_ms(),
            jobs,
            jobs_complete: complete,
            job: Some(match snapshot {
                Some(taken) => taken,
                None => client.snapshot().await?,
            }),
            launcher: None,
            stacks: stacks.map(|c| c.view(unix_ms())),
        };
        let mut text = if pretty { serde_json::to_string_pretty(&document) } else { serde_json::to_string(&document) }
            .map_err(|e| Failure::Client(rallypoint_client::Error::Protocol(e.to_string())))?;
        text.push('\n');
        return Ok(text);
    }
    let report = client.status().await?;
    let count = match (jobs.len(), complete) {
        (1, _) => "1 job".to_owned(),
        (n, true) => format!("{n} jobs"),
        (n, false) => format!("more than {} jobs; the first {n}", n - 1),
    };
    // Asked for: the stacks above show what the workers run.
    let hint = if stacks.is_some() { "" } else { " (`rallypoint status --stacks` shows what they run)" };
    let stacks = stacks.map(|c| c.render(&rallypoint_stacks::Render::default())).unwrap_or_default();
    // Launched, and no process of the job ever connected: its zeros are not a hang.
    let unconnected = if let Some(joined) = &joining {
        let nodes = joined.nodes.iter().map(|(node, host, pid)| format!("node {node} on host {host}, pid {pid}"));
        let missing = joined.missing();
        format!(
            "job '{}' has not started: its launchers wait for node{} {} of {} to join (joined: {}; job '{}'), and \
             start no worker until every node has\n",
            settings.job,
            if missing.len() == 1 { "" } else { "s" },
            missing.iter().map(u32::to_string).collect::<Vec<_>>().join(", "),
            joined.nnodes,
            nodes.collect::<Vec<_>>().join("; "),
            launchers_job(&settings.job)
        )
    } else if launched && !jobs.contains(&settings.job) {
        format!(
            "no process of job '{}' has connected to the coordinator: its launchers run it (job '{}'), and \
             workers that do not use rallypoint never connect{hint}\n",
            settings.job,
            launchers_job(&settings.job)
        )
    } else {
        String::new()
    };
    Ok(format!("{report}{stacks}{unconnected}coordinator {} holds {count}: {}\n", settings.addr, named_jobs(&jobs)))
}

/// The jobs quoted, each launchers' own job said to be theirs: users did not make it.
fn named_jobs(jobs: &[String]) -> String {
    let name = |job: &String| match launched_job(job) {
        Some(launched) => format!("'{job}' (the launchers of job '{launched}')"),
        None => format!("'{job}'"),
    };
    jobs.iter().map(name).collect::<Vec<_>>().join(", ")
}

/// The launchers' job of `job` (or of the job whose restart it is) among `jobs`.
fn launch_job_of(jobs: &[String], job: &str) -> Option<String> {
    let base = job
        .rsplit_once(".restart")
        .filter(|(_, n)| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
        .map(|(base, _)| base);
    [Some(job), base].into_iter().flatten().map(launchers_job).find(|j| jobs.contains(j))
}

/// A connection's settings as a tool (no rank) of the launchers' job `launch_job`.
fn launchers_tool(settings: &Settings, launch_job: &str) -> Settings {
    Settings { job: launch_job.to_owned(), rank: None, world_size: None, role: None, ..settings.clone() }
}

/// The nodes joined so far, while some of the job's nodes have not (`launch_job`: its
/// launchers' job); `None` once all have, or if no launcher's claim can be read (the
/// report goes on without this line).
async fn joining(settings: &Settings, launch_job: &str) -> Option<rallypoint_launch::Joined> {
    let client = connect(&launchers_tool(settings, launch_job)).await.ok()?;
    let result = rallypoint_launch::joined_nodes(&client).await;
    let joined = finish(client, result).await.ok()??;
    (!joined.missing().is_empty()).then_some(joined)
}

/// Every node's stacks, asked of the launchers over a connection of the launchers' job.
async fn read_stacks(settings: &Settings, launch_job: &str, native: bool) -> Result<Collected, Failure> {
    let client = connect(&launchers_tool(settings, launch_job)).await?;
    let ask = Ask { stacks: true, native };
    let result = rallypoint_launch::stacks::request(&client, &ask, None, STACKS_WAIT.min(settings.timeout)).await;
    Ok(finish(client, result).await?)
}

fn print(result: &str) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    out.write_all(result.as_bytes()).and_then(|()| out.flush()).context("writing to stdout")
}

/// Shows the status every `view.interval` until Ctrl-C or `view.count` snapshots.
async fn watch(client: Client, settings: &Settings, view: StatusView) -> anyhow::Result<()> {
    let interval = Duration::from_secs_f64(view.interval.max(0.1));
    let tty = std::io::stdout().is_terminal();
    let mut client = Some(client);
    let mut screen = if tty { Some(Screen::enter()?) } else { None };
    let interrupted = tokio::signal::ctrl_c();
    tokio::pin!(interrupted);
    let mut shown = 0u64;
    let mut next = tokio::time::Instant::now();
    let header = |at: &str| {
        let what = if view.json { " --json" } else { "" };
        format!("Every {:.1} s: rallypoint status --job {}{what}    {at}\n\n", interval.as_secs_f64(), settings.job)
    };
    let ended = loop {
        let body = tokio::select! {
            _ = &mut interrupted => break Ok(()),
            body = snapshot(&mut client, settings, What::of(&view, tty)) => body,
        };
        let body = match body {
            Ok(body) => body,
            // The job was never there: as without --watch, a usage error at once.
            Err(Failure::NoSuchJob(message)) if shown == 0 => break Err(UsageError(message).into()),
            Err(Failure::NoSuchJob(message)) => format!("{message}\n"),
            Err(Failure::Client(error)) => {
                // Connect again next time; the screen says why it is empty.
                client = None;
                format!("rallypoint: {error}\n")
            }
        };
        let at = humantime::format_rfc3339_seconds(SystemTime::now()).to_string();
        let result = match (&mut screen, view.json) {
            (Some(screen), _) => screen.draw(&header(&at), &body),
            // A document per line, so that the output is JSON Lines.
            (None, true) => print(&body),
            (None, false) => print(&format!("{}{body}\n", header(&at))),
        };
        if let Err(error) = result {
            break Err(error);
        }
        shown += 1;
        if view.count.is_some_and(|count| shown >= count) {
            break Ok(());
        }
        next += interval;
        tokio::select! {
            _ = &mut interrupted => break Ok(()),
            () = tokio::time::sleep_until(next) => {}
        }
    };
    drop(screen);
    if let Some(client) = client {
        let _ = finish(client, Ok(())).await;
    }
    ended
}

/// One snapshot on the watch's connection, connecting first if it has none. JSON
/// is drawn pretty on a terminal, one line per document elsewhere.
async fn snapshot(client: &mut Option<Client>, settings: &Settings, what: What) -> Result<String, Failure> {
    if client.is_none() {
        *client = Some(Client::connect_with(settings.connect_options().with_timeout(Duration::from_secs(2))).await?);
    }
    let Some(connected) = client.as_ref() else { unreachable!("connected above") };
    show(connected, settings, what).await
}

/// The terminal while watching: the alternate screen, cursor hidden; put back on drop.
struct Screen;

impl Screen {
    fn enter() -> anyhow::Result<Screen> {
        print("\x1b[?1049h\x1b[?25l")?;
        Ok(Screen)
    }

    /// Clears the screen and draws `header` and `body`, cut to the terminal's size.
    fn draw(&mut self, header: &str, body: &str) -> anyhow::Result<()> {
        let (rows, cols) = terminal_size().unwrap_or((24, 80));
        let mut out = String::from("\x1b[H\x1b[2J");
        let lines: Vec<&str> = header.lines().chain(body.lines()).collect();
        let room = rows.saturating_sub(1).max(1);
        for (i, line) in lines.iter().enumerate() {
            if i + 1 == room && lines.len() > room {
                out.push_str(&format!("... ({} more lines)", lines.len() - i));
                break;
            }
            out.extend(line.chars().take(cols));
            out.push('\n');
        }
        print(&out)
    }
}

impl Drop for Screen {
    fn drop(&mut self) {
        let _ = print("\x1b[?25h\x1b[?1049l");
    }
}

/// The terminal's (rows, columns), if stdout is one.
fn terminal_size() -> Option<(usize, usize)> {
    // SAFETY: TIOCGWINSZ writes a winsize into the struct given, nothing else.
    let mut size: libc::winsize = unsafe { std::mem::zeroed() };
    // SAFETY: fd 1 is this process's stdout; the ioctl only reads its terminal's size.
    let rc = unsafe { libc::ioctl(1, libc::TIOCGWINSZ, &mut size) };
    (rc == 0 && size.ws_row > 0 && size.ws_col > 0).then(|| (usize::from(size.ws_row), usize::from(size.ws_col)))
}

fn unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}
