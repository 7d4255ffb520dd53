//! `rallypoint`: run a coordinator, a node agent or a job; call the coordinator from
//! shell scripts; see a demo. A thin binary over the library crates (see the
//! `rallypoint` crate's docs for how they fit together).

mod agent;
mod auth;
mod bench;
mod demo;
mod exit;
mod launch;
mod page;
mod parse;
mod serve;
mod verbs;

use std::io::IsTerminal;
use std::process::ExitCode;
use std::time::Duration;

use clap::error::ErrorKind;
use clap::{CommandFactory, Parser, Subcommand};
use tracing_subscriber::EnvFilter;

#[derive(Parser, Debug)]
#[command(
    name = "rallypoint",
    version,
    about = "Coordination for distributed jobs: barriers, collectives, a key-value store, and \
             dead or missing ranks named at once",
    after_help = exit::HELP
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run the coordinator.
    Serve(serve::ServeArgs),
    /// Run a node agent: this node's ranks connect to it, and it carries them all
    /// to the coordinator over one connection.
    Agent(agent::AgentArgs),
    /// Run a job: host the coordinator, spawn the workers, take the job down when one fails.
    // Boxed: its many torchrun flags make it the largest by far.
    Launch(Box<launch::LaunchArgs>),
    #[command(flatten)]
    Verb(verbs::Verb),
    /// Measure barrier, collective and key-value latency (runs `rallypoint-bench`,
    /// built separately: `cargo build --release -p rallypoint-bench`).
    Bench(bench::BenchArgs),
    /// Start a coordinator and a few worker processes, and show what they do.
    Demo(demo::DemoArgs),
    /// One worker of the demo job, configured by RANK, WORLD_SIZE, RALLYPOINT_ADDR and
    /// RALLYPOINT_JOB: run it under `rallypoint launch`.
    DemoWorker(demo::WorkerArgs),
    /// Print a completion script for SHELL on stdout.
    ///
    /// bash: rallypoint completions bash > ~/.local/share/bash-completion/completions/rallypoint
    /// zsh:  rallypoint completions zsh > ~/.zfunc/_rallypoint (with fpath+=~/.zfunc before compinit)
    /// fish: rallypoint completions fish > ~/.config/fish/completions/rallypoint.fish
    Completions {
        /// The shell to complete in
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
}

/// A bad value the parser took from an option's variable (torchrun's `PET_*`, set by
/// schedulers and left in containers) rather than the command line: the parser's
/// message names only the option, which the user never typed; `text` says the
/// variable too.
fn with_env_source(error: &clap::Error, text: String) -> String {
    use clap::error::{ContextKind, ContextValue};
    if !matches!(error.kind(), ErrorKind::ValueValidation | ErrorKind::InvalidValue) {
        return text;
    }
    let (Some(ContextValue::String(shown)), Some(ContextValue::String(value))) =
        (error.get(ContextKind::InvalidArg), error.get(ContextKind::InvalidValue))
    else {
        return text;
    };
    let Some(long) = shown.strip_prefix("--").and_then(|rest| rest.split([' ', '=']).next()) else { return text };
    let argv: Vec<String> = std::env::args_os().skip(1).map(|a| a.to_string_lossy().into_owned()).collect();
    let mut commands = vec![Cli::command()];
    while let Some(command) = commands.pop() {
        for arg in command.get_arguments().filter(|arg| arg.get_long() == Some(long)) {
            let Some(var) = arg.get_env().and_then(|var| var.to_str()) else { continue };
            let mut names = arg
                .get_long_and_visible_aliases()
                .into_iter()
                .flatten()
                .chain(arg.get_all_aliases().into_iter().flatten());
            let typed = names.any(|name| {
                argv.iter()
                    .any(|a| a.strip_prefix("--").is_some_and(|a| a == name || a.starts_with(&format!("{name}="))))
            });
            if !typed && std::env::var(var).is_ok_and(|set| set == *value) {
                return text.replacen(&format!("'{shown}'"), &format!("'{shown}' (from ${var})"), 1);
            }
        }
        commands.extend(command.get_subcommands().cloned());
    }
    text
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        // --help, --version, and the help shown for no command at all: as the parser shows them.
        Err(error) if !error.use_stderr() || error.kind() == ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
            error.exit()
        }
        Err(error) => {
            // The parser's own "error: " gives way to the name every error starts with.
            let text = with_env_source(&error, error.render().to_string());
            exit::report(text.strip_prefix("error: ").unwrap_or(&text).trim_end());
            return ExitCode::from(exit::Exit::Usage as u8);
        }
    };
    if matches!(cli.command, Command::Serve(_) | Command::Agent(_) | Command::Launch(_)) {
        limit_malloc_arenas();
    }
    // The coordinator reports what it does; a verb in a shell script stays quiet
    // unless something is wrong. RUST_LOG overrides both.
    let default_level = match cli.command {
        Command::Serve(_) | Command::Agent(_) => "info",
        _ => "warn",
    };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_level));
    // Colour only for a person at a terminal, not in a log file or a pipe.
    let ansi = std::io::stderr().is_terminal();
    // A process serving others never waits on its log: with stderr a pipe nobody
    // reads, a blocking write would stop the thread serving connections. Its log
    // goes through a queue to a thread of its own, dropping lines when the queue is
    // full; the guard flushes what is queued at exit.
    let _log = match cli.command {
        Command::Serve(_) | Command::Agent(_) | Command::Launch(_) => {
            let (writer, guard) = tracing_appender::non_blocking(std::io::stderr());
            tracing_subscriber::fmt().with_env_filter(filter).with_ansi(ansi).with_writer(writer).init();
            Some(guard)
        }
        _ => {
            tracing_subscriber::fmt().with_env_filter(filter).with_ansi(ansi).with_writer(std::io::stderr).init();
            None
        }
    };

    match run(cli.command) {
        Ok(0) => ExitCode::SUCCESS,
        // The launcher exits with its first failed worker's code (128 + signal for a signal).
        Ok(code) => ExitCode::from(u8::try_from(code).unwrap_or(1)),
        Err(err) if exit::reader_gone(&err) => ExitCode::SUCCESS,
        Err(err) => {
            exit::report(exit::render(&err));
            ExitCode::from(exit::code_of(&err) as u8)
        }
    }
}

/// A process serving connections keeps glibc's allocations in one arena, not one
/// per thread up to eight per core: a connection's state is made on one thread and
/// its replies on others, and each arena keeps its own partly used pages, a tenth
/// of an idle connection's memory (docs/BENCHMARKS.md, "Coordinator memory per idle
/// connection"). Threads still allocate from caches of their own; the coordinator's
/// engine runs under one lock anyway. `MALLOC_ARENA_MAX` (or the tunable
/// `glibc.malloc.arena_max` in `GLIBC_TUNABLES`) still decides where set.
fn limit_malloc_arenas() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    if std::env::var_os("MALLOC_ARENA_MAX").is_none()
        && !std::env::var("GLIBC_TUNABLES").is_ok_and(|tunables| tunables.contains("glibc.malloc.arena_max"))
    {
        // SAFETY: mallopt only sets a tunable of the allocator; called before any
        // thread of ours starts.
        unsafe { libc::mallopt(libc::M_ARENA_MAX, 1) };
    }
}

/// How long a command's leftover tasks are waited for once it is done.
const EXIT_WAIT: Duration = Duration::from_secs(1);

fn run(command: Command) -> anyhow::Result<i32> {
    if let Command::Completions { shell } = command {
        let mut cli = <Cli as clap::CommandFactory>::command();
        clap_complete::generate(shell, &mut cli, "rallypoint", &mut std::io::stdout());
        return Ok(0);
    }
    // A verb does one request: a single-threaded runtime starts fastest. The server,
    // benchmarks and demo do many things at once.
    let runtime = match command {
        Command::Bench(args) => return bench::run(args),
        Command::Verb(_) | Command::DemoWorker(_) => tokio::runtime::Builder::new_current_thread(),
        _ => tokio::runtime::Builder::new_multi_thread(),
    }
    .enable_all()
    .build()?;
    let result = runtime.block_on(async move {
        match command {
            Command::Serve(args) => serve::run(args).await.map(|()| 0),
            Command::Agent(args) => agent::run(args).await.map(|()| 0),
            Command::Launch(args) => launch::run(*args).await,
            Command::Verb(verb) => verbs::run(verb).await.map(|()| 0),
            Command::Bench(_) | Command::Completions { .. } => unreachable!("run without a runtime above"),
            Command::Demo(args) => demo::run(args).await.map(|()| 0),
            Command::DemoWorker(args) => demo::worker(args).await.map(|()| 0),
        }
    });
    // The command is done: a task or blocking call it left behind (a connection
    // being closed, a file being written) must not keep the process from exiting.
    runtime.shutdown_timeout(EXIT_WAIT);
    result
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::Cli;

    #[test]
    fn every_argument_of_every_command_has_help() {
        let cli = Cli::command();
        for command in cli.get_subcommands() {
            for arg in command.get_arguments().filter(|a| !a.is_hide_set()) {
                assert!(
                    arg.get_help().is_some(),
                    "`rallypoint {}`: {} has no help text",
                    command.get_name(),
                    arg.get_id()
                );
            }
        }
        Cli::command().debug_assert();
    }
}
