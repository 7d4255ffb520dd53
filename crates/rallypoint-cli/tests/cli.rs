//! The `rallypoint` command end to end: a `rallypoint serve` child process, and
//! verbs as separate processes the way shell scripts run them.

use std::collections::HashSet;
use std::io::{BufRead, BufReader, Read};
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_rallypoint");

/// Variables the command reads; each test sets what it means and inherits none.
const ENV: &[&str] = &[
    "RALLYPOINT_ADDR",
    "MASTER_ADDR",
    "MASTER_PORT",
    "RALLYPOINT_JOB",
    "TORCHELASTIC_RUN_ID",
    "RANK",
    "WORLD_SIZE",
    "RALLYPOINT_ROLE",
    "ROLE_NAME",
    "RALLYPOINT_TIMEOUT",
    "RALLYPOINT_JOB_INCARNATION",
    "RUST_LOG",
];

/// How long any one process may run before the test kills it and fails.
const LIMIT: Duration = Duration::from_secs(60);

fn rallypoint() -> Command {
    let mut command = Command::new(BIN);
    for var in ENV {
        command.env_remove(var);
    }
    command.stdin(Stdio::null());
    command
}

/// A child process that is killed when the test ends, however it ends.
struct Guard(Child);

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Guard {
    fn pid(&self) -> u32 {
        self.0.id()
    }

    fn still_running(&mut self) -> bool {
        self.0.try_wait().expect("try_wait").is_none()
    }
}

#[derive(Debug)]
struct Run {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

fn spawn(mut command: Command) -> Guard {
    Guard(command.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("spawn rallypoint"))
}

/// The exit code of `child` once it ends by itself (within [`LIMIT`], else `failed`).
fn exit_code(child: &mut Guard, failed: &str) -> Option<i32> {
    let deadline = Instant::now() + LIMIT;
    loop {
        if let Some(status) = child.0.try_wait().expect("try_wait") {
            return status.code();
        }
        assert!(Instant::now() < deadline, "{failed}");
        thread::sleep(Duration::from_millis(20));
    }
}

fn exec(command: Command) -> Run {
    finish(&mut spawn(command))
}

/// Waits for a child (at most [`LIMIT`]) and collects its output.
fn finish(guard: &mut Guard) -> Run {
    fn drain(from: Option<impl Read + Send + 'static>) -> JoinHandle<String> {
        thread::spawn(move || {
            let mut text = String::new();
            if let Some(mut from) = from {
                let _ = from.read_to_string(&mut text);
            }
            text
        })
    }
    let child = &mut guard.0;
    let (stdout, stderr) = (drain(child.stdout.take()), drain(child.stderr.take()));
    let deadline = Instant::now() + LIMIT;
    let status = loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("pid {} did not finish within {LIMIT:?}", child.id());
        }
        thread::sleep(Duration::from_millis(10));
    };
    Run { code: status.code(), stdout: stdout.join().expect("stdout"), stderr: stderr.join().expect("stderr") }
}

/// A `rallypoint serve` on a free loopback port.
struct Server {
    addr: String,
    process: Guard,
}

impl Server {
    fn start() -> Server {
        Server::start_with(&[])
    }

    /// A server with these `serve` flags besides its address.
    fn start_with(flags: &[&str]) -> Server {
        let mut child = rallypoint()
            .args(["serve", "--listen", "127.0.0.1:0", "--print-addr"])
            .args(flags)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn rallypoint serve");
        let stdout = child.stdout.take().expect("piped stdout");
        let process = Guard(child);
        let (tx, rx) = std::sync::mpsc::channel();
        thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        let line = rx.recv_timeout(Duration::from_secs(30)).expect("the server printed its address");
        let addr = line.trim().to_owned();
        assert!(addr.starts_with("127.0.0.1:"), "unexpected first line: {line:?}");
        Server { addr, process }
    }

    /// `rallypoint ARGS... --addr ADDR --job JOB`
    fn cmd(&self, job: &str, args: &[&str]) -> Command {
        let mut command = rallypoint();
        command.args(args).args(["--addr", &self.addr, "--job", job]);
        command
    }

    /// `rallypoint ARGS... --rank RANK --world-size WORLD_SIZE` in `job`, with
    /// `--timeout 30` unless ARGS set one.
    fn ranked(&self, job: &str, rank: u32, world_size: u32, args: &[&str]) -> Command {
        let mut command = self.cmd(job, args);
        command.args(["--rank", &rank.to_string(), "--world-size", &world_size.to_string()]);
        if !args.contains(&"--timeout") {
            command.args(["--timeout", "30"]);
        }
        command
    }
}

/// Waits until process `pid` holds an established TCP connection (it has
/// connected to the server), at most [`LIMIT`].
fn wait_connected(pid: u32) {
    let deadline = Instant::now() + LIMIT;
    while Instant::now() < deadline {
        let sockets: HashSet<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
            .map(|dir| {
                dir.filter_map(|fd| std::fs::read_link(fd.ok()?.path()).ok())
                    .filter_map(|link| {
                        let link = link.to_string_lossy().into_owned();
                        Some(link.strip_prefix("socket:[")?.strip_suffix(']')?.to_owned())
                    })
                    .collect()
            })
            .unwrap_or_default();
        let established = ["/proc/net/tcp", "/proc/net/tcp6"].iter().any(|table| {
            std::fs::read_to_string(table).unwrap_or_default().lines().skip(1).any(|line| {
                let fields: Vec<&str> = line.split_whitespace().collect();
                // Field 3 is the state (01 = ESTABLISHED), field 9 the socket's inode.
                fields.len() > 9 && fields[3] == "01" && sockets.contains(fields[9])
            })
        });
        if established {
            // Connected; give the server a moment to admit the session and its request.
            thread::sleep(Duration::from_millis(500));
            return;
        }
        thread::sleep(Duration::from_millis(20));
    }
    panic!("pid {pid} did not connect within {LIMIT:?}");
}

fn assert_code(run: &Run, code: i32) {
    assert_eq!(run.code, Some(code), "expected exit code {code}: {run:#?}");
}

#[test]
fn key_value_verbs() {
    let server = Server::start();
    let ok = |args: &[&str]| {
        let run = exec(server.cmd("kv", args));
        assert_code(&run, 0);
        run.stdout
    };
    assert_eq!(ok(&["set", "greeting", "hello world"]), "");
    assert_eq!(ok(&["get", "greeting"]), "hello world\n");
    assert_eq!(ok(&["add", "counter", "5"]), "5\n");
    assert_eq!(ok(&["add", "counter", "-2"]), "3\n");
    assert_eq!(ok(&["check", "greeting", "counter"]), "true\n");
    assert_eq!(ok(&["check", "greeting", "nope"]), "false\n");
    assert_eq!(ok(&["delete", "greeting"]), "true\n");
    assert_eq!(ok(&["delete", "greeting"]), "false\n");
    ok(&["set", "negative", "-0.5"]);
    assert_eq!(ok(&["get", "negative"]), "-0.5\n");

    // `wait` and `get` block until the keys exist.
    let mut waiting = spawn(server.cmd("kv", &["wait", "a", "b", "--timeout", "30"]));
    let mut getting = spawn(server.cmd("kv", &["get", "b", "--timeout", "30"]));
    ok(&["set", "a", "1"]);
    thread::sleep(Duration::from_millis(300));
    assert!(waiting.still_running(), "wait returned before key b existed");
    ok(&["set", "b", "2"]);
    assert_code(&finish(&mut waiting), 0);
    assert_eq!(finish(&mut getting).stdout, "2\n");

    // Jobs are separate key spaces.
    let other = exec(server.cmd("other-job", &["check", "a"]));
    assert_eq!(other.stdout, "false\n");

    let missing = exec(server.cmd("kv", &["get", "missing-key", "--timeout", "0.5"]));
    assert_code(&missing, 3);
    assert!(missing.stderr.starts_with("rallypoint: "), "{missing:?}");
    assert!(missing.stderr.contains("missing-key"), "{missing:?}");

    let not_a_number = exec(server.cmd("kv", &["add", "a", "x1"]));
    assert_code(&not_a_number, 2);
    ok(&["set", "text", "abc"]);
    let not_a_number = exec(server.cmd("kv", &["add", "text", "1"]));
    assert_code(&not_a_number, 1);
    assert!(not_a_number.stderr.contains("not an integer"), "{not_a_number:?}");
}

#[test]
fn usage_errors_exit_2_and_name_the_bad_value() {
    // Nothing listens here; every case must fail before connecting.
    let addr = "127.0.0.1:1";
    let cases: &[(&[&str], &str)] = &[
        (&["barrier", "b", "--rank", "4", "--world-size", "4"], "rank 4"),
        (&["barrier", "b", "--rank", "0", "--world-size", "0"], "'0'"),
        (&["barrier", "b", "--rank", "0", "--world-size", "-3"], "'-3'"),
        (&["barrier", "b", "--rank", "-1", "--world-size", "2"], "'-1'"),
        (&["barrier", "b", "--rank", "0", "--world-size", "4", "--ranks", "0,x"], "'x'"),
        (&["barrier", "b", "--rank", "0", "--world-size", "4", "--ranks", "0,7"], "rank 7"),
        (&["barrier", "b", "--world-size", "4"], "RANK"),
        (&["barrier", "b", "--rank", "0", "--world-size", "2", "--timeout", "-1"], "'-1'"),
        (&["broadcast", "--root", "0", "--rank", "0", "--world-size", "2"], "VALUE"),
        (&["broadcast", "v", "--root", "2", "--rank", "0", "--world-size", "2"], "--root 2"),
        (&["frobnicate"], "frobnicate"),
    ];
    for (args, needle) in cases {
        let run = exec({
            let mut command = rallypoint();
            command.args(*args).args(["--addr", addr]);
            command
        });
        assert_code(&run, 2);
        assert!(run.stderr.contains(needle), "{args:?}: stderr should name {needle:?}: {run:#?}");
        // The argument parser's errors start as every other error does.
        assert!(run.stderr.starts_with("rallypoint: "), "{args:?}: {run:#?}");
    }

    // A bad value in the environment is named too.
    let run = exec({
        let mut command = rallypoint();
        command.args(["barrier", "b", "--addr", addr]).env("RANK", "abc").env("WORLD_SIZE", "2");
        command
    });
    assert_code(&run, 2);
    assert!(run.stderr.contains("RANK"), "{run:#?}");

    // No address anywhere.
    let run = exec({
        let mut command = rallypoint();
        command.args(["get", "k"]);
        command
    });
    assert_code(&run, 2);
    assert!(run.stderr.starts_with("rallypoint: "), "{run:#?}");
    assert!(run.stderr.contains("RALLYPOINT_ADDR") && run.stderr.contains("--addr"), "{run:#?}");

    // A coordinator's budget of unfinished requests below its largest request.
    let run = exec({
        let mut command = rallypoint();
        command.args(["serve", "--listen", "127.0.0.1:0", "--max-pending-bytes", "0"]);
        command
    });
    assert_code(&run, 2);
    assert!(run.stderr.contains("--max-pending-bytes 0 is less than the largest request"), "{run:#?}");
}

#[test]
fn cannot_connect_exits_7() {
    // A port that was free a moment ago: nothing listens there.
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let addr = format!("127.0.0.1:{port}");
    let run = exec({
        let mut command = rallypoint();
        command.args(["get", "k", "--addr", &addr, "--timeout", "1"]);
        command
    });
    assert_code(&run, 7);
    assert!(run.stderr.starts_with("rallypoint: ") && run.stderr.contains(&addr), "{run:#?}");
}

#[test]
fn barrier_across_processes_and_reused_name() {
    let server = Server::start();
    let n = 3;
    for step in 0..4 {
        let mut ranks: Vec<Guard> =
            (0..n - 1).map(|r| spawn(server.ranked("loop", r, n, &["barrier", "step"]))).collect();
        if step == 0 {
            // Nobody passes until the last rank arrives.
            thread::sleep(Duration::from_millis(500));
            assert!(ranks.iter_mut().all(Guard::still_running), "a rank passed the barrier alone");
        }
        ranks.push(spawn(server.ranked("loop", n - 1, n, &["barrier", "step"])));
        for rank in &mut ranks {
            let run = finish(rank);
            assert_code(&run, 0);
            assert_eq!(run.stdout, "");
        }
    }

    // A barrier of a subset does not wait for the others.
    let mut subset: Vec<Guard> =
        [0, 2].iter().map(|&r| spawn(server.ranked("loop", r, n, &["barrier", "pair", "--ranks", "0,2"]))).collect();
    for rank in &mut subset {
        assert_code(&finish(rank), 0);
    }
}

#[test]
fn all_gather_and_broadcast() {
    let server = Server::start();
    let n = 3;
    let mut gathering: Vec<Guard> =
        (0..n).map(|r| spawn(server.ranked("coll", r, n, &["all-gather", &format!("value of {r}")]))).collect();
    for rank in &mut gathering {
        let run = finish(rank);
        assert_code(&run, 0);
        assert_eq!(run.stdout, "value of 0\nvalue of 1\nvalue of 2\n");
    }
    // Values that hold newlines: NUL-ended with --null, refused as lines.
    let value = |r: u32| format!("line {r}\nsecond");
    let mut gathering: Vec<Guard> = (0..n)
        .map(|r| spawn(server.ranked("coll", r, n, &["all-gather", "--name", "nl", "--null", &value(r)])))
        .collect();
    for rank in &mut gathering {
        let run = finish(rank);
        assert_code(&run, 0);
        assert_eq!(run.stdout, "line 0\nsecond\0line 1\nsecond\0line 2\nsecond\0");
    }
    let mut gathering: Vec<Guard> =
        (0..n).map(|r| spawn(server.ranked("coll", r, n, &["all-gather", "--name", "nl2", &value(r)]))).collect();
    for rank in &mut gathering {
        let run = finish(rank);
        assert_code(&run, 1);
        assert!(run.stderr.contains("value 0 of 3 (in rank order) holds a newline"), "{}", run.stderr);
        assert_eq!(run.stdout, "");
    }

    let mut receiving: Vec<Guard> = (0..n)
        .map(|r| {
            let value = if r == 1 { vec!["from-one"] } else { vec![] };
            let args: Vec<&str> = ["broadcast"].into_iter().chain(value).chain(["--root", "1"]).collect();
            spawn(server.ranked("coll", r, n, &args))
        })
        .collect();
    for rank in &mut receiving {
        let run = finish(rank);
        assert_code(&run, 0);
        assert_eq!(run.stdout, "from-one\n");
    }
}

#[test]
fn killed_rank_fails_every_peer_with_code_4() {
    let server = Server::start();
    // World of 4: ranks 0, 1 and 2 wait in the barrier (3 never comes), then 1 is killed.
    let mut peers: Vec<Guard> = [0, 2].iter().map(|&r| spawn(server.ranked("kill", r, 4, &["barrier", "b"]))).collect();
    let mut victim = spawn(server.ranked("kill", 1, 4, &["barrier", "b"]));
    for pid in peers.iter().map(Guard::pid).chain([victim.pid()]) {
        wait_connected(pid);
    }
    victim.0.kill().expect("SIGKILL rank 1");
    let killed_at = Instant::now();
    for peer in &mut peers {
        let run = finish(peer);
        assert_code(&run, 4);
        assert!(run.stderr.starts_with("rallypoint: "), "{run:#?}");
        assert!(run.stderr.contains("rank 1"), "the error should name rank 1: {run:#?}");
    }
    // At once, not after the 30 s timeout.
    assert!(killed_at.elapsed() < Duration::from_secs(10), "peers took {:?}", killed_at.elapsed());
}

#[test]
fn timeout_exits_3_and_names_the_missing_rank() {
    let server = Server::start();
    let mut ranks: Vec<Guard> =
        (0..2).map(|r| spawn(server.ranked("late", r, 3, &["barrier", "b", "--timeout", "1"]))).collect();
    for rank in &mut ranks {
        let run = finish(rank);
        assert_code(&run, 3);
        assert!(run.stderr.starts_with("rallypoint: "), "{run:#?}");
        assert!(run.stderr.contains("rank 2"), "the error should name rank 2: {run:#?}");
    }
}

/// One client claiming a huge world cannot take the coordinator down (issue #13,
/// defect 1: a world size of 2^32 - 1 made it abort on a 137 GB allocation), and the
/// timeout of a world of a million names a bounded number of ranks.
#[test]
fn a_huge_world_size_is_refused_and_a_million_costs_a_short_error() {
    let server = Server::start();
    let run = exec(server.ranked("huge", 0, u32::MAX, &["barrier", "x", "--timeout", "1"]));
    assert_code(&run, 2);
    assert!(run.stderr.contains("limit of 1048576"), "{run:#?}");

    let run = exec(server.ranked("million", 0, 1_000_000, &["barrier", "x", "--timeout", "1"]));
    assert_code(&run, 3);
    assert!(run.stderr.contains("999935 more: ranks 65-999999"), "{run:#?}");
    assert!(run.stderr.len() < 8192, "{} bytes of error", run.stderr.len());

    let run = exec(server.cmd("other", &["set", "k", "v"]));
    assert_code(&run, 0);
}

/// A coordinator whose stderr is a pipe nobody reads keeps serving: its log never
/// blocks the threads that serve connections (lines are dropped instead).
#[test]
fn serve_keeps_serving_when_nobody_reads_its_log() {
    let mut child = rallypoint()
        .args(["serve", "--listen", "127.0.0.1:0", "--print-addr"])
        .env("RUST_LOG", "debug")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn rallypoint serve");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("piped stdout")).read_line(&mut line).expect("the address");
    let _unread_stderr = child.stderr.take();
    let server = Server { addr: line.trim().to_owned(), process: Guard(child) };
    // Each verb's connection logs a few hundred bytes at debug level: far more than
    // a pipe holds, in all.
    for i in 0..400 {
        let run = exec(server.cmd("log", &["set", "k", &i.to_string(), "--timeout", "10"]));
        assert_code(&run, 0);
    }
}

#[test]
fn abort_fails_waiting_ranks_with_code_5() {
    let server = Server::start();
    let mut waiting = spawn(server.ranked("doomed", 0, 2, &["barrier", "b"]));
    wait_connected(waiting.pid());
    assert_code(&exec(server.cmd("doomed", &["abort", "disk full on node 7"])), 0);
    let run = finish(&mut waiting);
    assert_code(&run, 5);
    assert!(run.stderr.contains("disk full on node 7"), "{run:#?}");
}

#[test]
fn status_names_who_waits_in_a_barrier_and_who_is_missing() {
    let server = Server::start();
    let mut waiting: Vec<Guard> = (0..2).map(|r| spawn(server.ranked("hang", r, 3, &["barrier", "setup"]))).collect();
    // A shell script's wait for a key: a connection of no rank, not a rank missing.
    let key_wait = spawn(server.cmd("hang", &["wait", "ready", "--timeout", "60"]));
    for process in waiting.iter().chain([&key_wait]) {
        wait_connected(process.pid());
    }
    let run = exec(server.cmd("hang", &["status"]));
    assert_code(&run, 0);
    assert!(
        run.stdout.starts_with(
            "job 'hang'\nconnections: 3 native (1 of no rank: launchers, tools)\nranks: 2 connected, 0 left \
             cleanly, 0 lost, 1 of 3 never connected\n"
        ),
        "{run:#?}"
    );
    drop(key_wait);
    let line = run
        .stdout
        .lines()
        .find(|l| l.starts_with("waiting: barrier 'setup' (generation 1) for "))
        .unwrap_or_else(|| panic!("{run:#?}"));
    assert!(line.ends_with(": 2 of 3 arrived; missing (1): rank 2 (never connected)"), "{line}");
    // The missing rank comes: everyone passes, and nobody waits any more.
    assert_code(&exec(server.ranked("hang", 2, 3, &["barrier", "setup"])), 0);
    for rank in &mut waiting {
        assert_code(&finish(rank), 0);
    }
    let run = exec(server.cmd("hang", &["status"]));
    assert!(!run.stdout.contains("waiting: "), "{run:#?}");
}

/// `rallypoint status --json` of `job`, parsed, once `ready` holds of it (at most [`LIMIT`]).
fn status_json_when(server: &Server, job: &str, ready: impl Fn(&serde_json::Value) -> bool) -> serde_json::Value {
    let deadline = Instant::now() + LIMIT;
    loop {
        let run = exec(server.cmd(job, &["status", "--json"]));
        // The job exists once its first rank has connected, which may take a while.
        if run.code == Some(2) && run.stderr.contains("holds no job") && Instant::now() < deadline {
            thread::sleep(Duration::from_millis(50));
            continue;
        }
        assert_code(&run, 0);
        let doc: serde_json::Value = serde_json::from_str(&run.stdout).unwrap_or_else(|e| panic!("{e}: {run:#?}"));
        if ready(&doc) {
            return doc;
        }
        assert!(Instant::now() < deadline, "status never showed what was expected: {doc:#}");
        thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn status_json_shows_a_missing_rank_and_the_ranks_waiting_in_a_barrier() {
    let server = Server::start();
    let mut waiting: Vec<Guard> = (0..2).map(|r| spawn(server.ranked("jhang", r, 3, &["barrier", "setup"]))).collect();
    let doc = status_json_when(&server, "jhang", |d| d["job"]["waits"][0]["arrived"] == 2);
    assert_eq!(doc["schema"], 1, "{doc:#}");
    assert_eq!(doc["coordinator"], server.addr.as_str());
    assert!(doc["generated_unix_ms"].as_u64().is_some_and(|t| t > 0), "{doc:#}");
    assert_eq!((doc["jobs"].clone(), doc["jobs_complete"].clone()), (serde_json::json!(["jhang"]), true.into()));
    let job = &doc["job"];
    assert_eq!((job["name"].as_str(), job["world_size"].as_u64()), (Some("jhang"), Some(3)), "{job:#}");
    assert_eq!(job["sessions"]["native"], 2, "the status tool's own session is not counted: {job:#}");
    let summary = &job["ranks_summary"];
    assert_eq!((summary["connected"].as_u64(), summary["never_connected"].as_u64()), (Some(2), Some(1)));
    assert_eq!(summary["in_collective"], 2);
    let ranks = job["ranks"].as_array().expect("ranks");
    assert_eq!(ranks.len(), 3);
    for (r, rank) in ranks.iter().enumerate().take(2) {
        assert_eq!((rank["rank"].as_u64(), rank["state"].as_str()), (Some(r as u64), Some("connected")), "{rank:#}");
        assert_eq!(rank["pid"].as_u64(), Some(u64::from(waiting[r].pid())), "{rank:#}");
        assert!(rank["host"].is_string() && rank["last_seen_ms_ago"].is_u64(), "{rank:#}");
        assert_eq!(rank["wait"], 0, "it waits in waits[0]: {rank:#}");
    }
    assert_eq!((ranks[2]["rank"].as_u64(), ranks[2]["state"].as_str()), (Some(2), Some("never_connected")));
    assert!(ranks[2].get("wait").is_none() && ranks[2].get("host").is_none(), "{:#}", ranks[2]);
    let wait = &job["waits"][0];
    assert_eq!(
        (wait["op"].as_str(), wait["name"].as_str(), wait["generation"].as_u64()),
        (Some("barrier"), Some("setup"), Some(1))
    );
    assert_eq!(
        (wait["members"].as_u64(), wait["arrived"].as_u64(), wait["missing_count"].as_u64()),
        (Some(3), Some(2), Some(1))
    );
    assert!(wait["waited_ms"].is_u64(), "{wait:#}");
    assert_eq!(
        (wait["missing"][0]["rank"].as_u64(), wait["missing"][0]["state"].as_str()),
        (Some(2), Some("never_connected"))
    );
    assert_eq!(wait["missing_more"]["count"], 0);
    assert!(job["torch"].is_null() && job["key_waits"] == serde_json::json!([]), "{job:#}");
    // A job the coordinator does not hold is the same usage error as without --json.
    assert_code(&exec(server.cmd("jhnag", &["status", "--json"])), 2);
    assert_code(&exec(server.ranked("jhang", 2, 3, &["barrier", "setup"])), 0);
    for rank in &mut waiting {
        assert_code(&finish(rank), 0);
    }
}

#[test]
fn status_watch_without_a_terminal_prints_snapshot_after_snapshot_and_stops_on_ctrl_c() {
    let server = Server::start();
    let _rank = spawn(server.ranked("watched", 0, 2, &["barrier", "b"]));
    status_json_when(&server, "watched", |d| d["job"]["waits"][0]["arrived"] == 1);
    let run = exec(server.cmd("watched", &["status", "--watch", "--interval", "0.2", "--count", "3"]));
    assert_code(&run, 0);
    assert_eq!(run.stdout.matches("Every 0.2 s: rallypoint status --job watched").count(), 3, "{run:#?}");
    assert_eq!(run.stdout.matches("waiting: barrier 'b' (generation 1)").count(), 3, "{run:#?}");
    assert!(!run.stdout.contains('\x1b'), "no terminal escapes without a terminal: {run:#?}");
    // --json: a document per line (JSON Lines).
    let run = exec(server.cmd("watched", &["status", "--watch", "--json", "--interval", "0.2", "--count", "2"]));
    assert_code(&run, 0);
    let docs: Vec<serde_json::Value> =
        run.stdout.lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}"))).collect();
    assert_eq!(docs.len(), 2, "{run:#?}");
    let ages: Vec<u64> = docs.iter().map(|d| d["job"]["waits"][0]["waited_ms"].as_u64().expect("waited_ms")).collect();
    assert!(ages[1] > ages[0], "ages tick from one snapshot to the next: {ages:?}");
    // Until interrupted: SIGINT ends it cleanly.
    let mut watching = spawn(server.cmd("watched", &["status", "--watch", "--interval", "0.2"]));
    let stdout = watching.0.stdout.take().expect("piped stdout");
    let mut lines = BufReader::new(stdout).lines();
    let first = lines.next().expect("a first snapshot").expect("readable");
    assert!(first.starts_with("Every 0.2 s"), "{first}");
    // SAFETY: kill(2) on a child we own and have not reaped.
    assert_eq!(unsafe { libc::kill(watching.pid() as i32, libc::SIGINT) }, 0);
    assert_eq!(exit_code(&mut watching, "status --watch did not stop on SIGINT"), Some(0));
    // Nor when its reader goes (`| head -1`): quietly, as SIGPIPE would end it.
    let mut watching = spawn(server.cmd("watched", &["status", "--watch", "--interval", "0.2"]));
    let stdout = watching.0.stdout.take().expect("piped stdout");
    let mut stderr = watching.0.stderr.take().expect("piped stderr");
    let first = BufReader::new(stdout).lines().next().expect("a first snapshot").expect("readable");
    assert!(first.starts_with("Every 0.2 s"), "{first}");
    let code = exit_code(&mut watching, "status --watch did not stop when its reader went");
    let mut said = String::new();
    stderr.read_to_string(&mut said).expect("stderr");
    assert_eq!((code, said.as_str()), (Some(0), ""));
}

#[test]
fn serve_stops_cleanly_on_sigterm_and_sigint() {
    for signal in [libc::SIGTERM, libc::SIGINT] {
        let mut server = Server::start();
        // SAFETY: kill(2) on a child we own and have not reaped.
        assert_eq!(unsafe { libc::kill(server.process.pid() as i32, signal) }, 0);
        let deadline = Instant::now() + Duration::from_secs(10);
        while server.process.still_running() {
            assert!(Instant::now() < deadline, "serve did not stop on signal {signal}");
            thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(server.process.0.wait().unwrap().code(), Some(0), "signal {signal}");
    }
}

#[test]
fn help_lists_exit_codes() {
    let run = exec({
        let mut command = rallypoint();
        command.arg("--help");
        command
    });
    assert_code(&run, 0);
    for line in ["3  timeout", "4  peer lost", "7  cannot connect", "8  refused incarnation"] {
        assert!(run.stdout.contains(line), "--help should list {line:?}");
    }
}

#[test]
fn demo_exits_0() {
    let run = exec({
        let mut command = rallypoint();
        command.args(["demo", "--ranks", "3"]);
        command
    });
    assert_code(&run, 0);
    for needle in ["[rank 0] step 1", "[rank 2] step 3", "SIGKILL", "rank 2", "demo ok"] {
        assert!(run.stdout.contains(needle), "demo output should contain {needle:?}: {run:#?}");
    }
}

#[test]
fn bench_runs_the_benchmark_binary_next_to_rallypoint_or_says_how_to_build_it() {
    // A copy of `rallypoint` alone in a directory: no `rallypoint-bench` beside it or on PATH.
    let dir = std::env::temp_dir().join(format!("rallypoint-bench-dispatch-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("test directory");
    let copy = dir.join("rallypoint");
    std::fs::copy(BIN, &copy).expect("copy the binary");
    let run_copy = |args: &[&str]| {
        // Another test's child forked while the copy was open for writing may hold it
        // for a moment ("text file busy"): try again then.
        for _ in 0..100 {
            let mut command = Command::new(&copy);
            command.args(args).env("PATH", "/nonexistent").stdin(Stdio::null());
            match command.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn() {
                Ok(child) => return finish(&mut Guard(child)),
                Err(error) if error.raw_os_error() == Some(libc::ETXTBSY) => {
                    thread::sleep(Duration::from_millis(20));
                }
                Err(error) => panic!("spawn the copy: {error}"),
            }
        }
        panic!("the copy stayed busy");
    };
    let run = run_copy(&["bench", "barrier", "--clients", "4"]);
    assert_code(&run, 1);
    assert!(run.stderr.contains("cargo build --release -p rallypoint-bench"), "{}", run.stderr);

    // With one beside it, every argument after `bench` reaches it as given, flags included.
    let fake = dir.join("rallypoint-bench");
    std::fs::write(&fake, "#!/bin/sh\nprintf '%s|' \"$@\"\nexit 3\n").expect("write a fake benchmark binary");
    std::fs::set_permissions(&fake, std::os::unix::fs::PermissionsExt::from_mode(0o755)).expect("chmod");
    let run = run_copy(&["bench", "kv", "--clients", "1,8", "--help", "-x"]);
    assert_code(&run, 3);
    assert_eq!(run.stdout, "kv|--clients|1,8|--help|-x|");
    std::fs::remove_dir_all(&dir).expect("cleanup");
}

/// Issue 14, story 1: a second process claiming a live rank is refused (exit code 8)
/// naming both processes, and releases nothing: rank 0 waits for the real rank 1.
#[test]
fn a_second_claimant_of_a_live_rank_is_refused_with_code_8() {
    let server = Server::start();
    let mut holder = spawn(server.ranked("claim", 1, 2, &["barrier", "b"]));
    wait_connected(holder.pid());
    let second = exec(server.ranked("claim", 1, 2, &["barrier", "b"]));
    assert_code(&second, 8);
    let held = format!("rallypoint: rank 1 is held by pid {} on host ", holder.pid());
    assert!(second.stderr.starts_with(&held), "{second:#?}");
    assert!(second.stderr.contains("; this process is pid "), "{second:#?}");
    assert!(holder.still_running(), "the refused claimant released the barrier");
    assert_code(&exec(server.ranked("claim", 0, 2, &["barrier", "b"])), 0);
    assert_code(&finish(&mut holder), 0);
}

/// Issue 14, story 1: a second claimant of rank 1 no longer hides the SIGKILL of
/// the real rank 1: rank 0 is told at once that rank 1 (its pid) is lost. (A world
/// of 3 whose rank 2 is late: ranks 0 and 1 wait in the barrier.)
#[test]
fn a_sigkill_is_not_hidden_by_a_second_claimant() {
    let server = Server::start();
    let mut zero = spawn(server.ranked("hidden", 0, 3, &["barrier", "b"]));
    let mut real = spawn(server.ranked("hidden", 1, 3, &["barrier", "b"]));
    wait_connected(zero.pid());
    wait_connected(real.pid());
    assert_code(&exec(server.ranked("hidden", 1, 3, &["barrier", "b"])), 8);
    let real_pid = real.pid();
    real.0.kill().expect("SIGKILL the real rank 1");
    let killed_at = Instant::now();
    let run = finish(&mut zero);
    assert_code(&run, 4);
    assert!(run.stderr.contains("rank 1 (host ") && run.stderr.contains(&format!("pid {real_pid}, lost")), "{run:#?}");
    assert!(killed_at.elapsed() < Duration::from_secs(10), "rank 0 took {:?}", killed_at.elapsed());
}

/// Issue 14, story 2: a job name re-run on a long-lived coordinator inherits
/// nothing of the old run once reset: not its lost rank, not its abort. What the old
/// run still waits for fails naming the reset (exit code 8), and a process naming an
/// old incarnation is refused by name.
#[test]
fn a_rerun_after_a_reset_starts_fresh() {
    let server = Server::start();
    // The old run: rank 2 dies while ranks 0 and 1 wait; a tool still waits for a key.
    let mut waiting: Vec<Guard> = (0..2).map(|r| spawn(server.ranked("rerun", r, 3, &["barrier", "b"]))).collect();
    let mut two = spawn(server.ranked("rerun", 2, 3, &["barrier", "late", "--ranks", "0,2"]));
    for guard in waiting.iter().chain([&two]) {
        wait_connected(guard.pid());
    }
    two.0.kill().expect("SIGKILL rank 2");
    for rank in &mut waiting {
        assert_code(&finish(rank), 4);
    }
    let mut old = spawn(server.cmd("rerun", &["get", "never", "--timeout", "30"]));
    wait_connected(old.pid());

    let reset = |server: &Server| {
        let reset = exec(server.cmd("rerun", &["reset"]));
        assert_code(&reset, 0);
        let incarnation = reset.stdout.trim().to_owned();
        assert!(incarnation.len() == 16 && incarnation.chars().all(|c| c.is_ascii_hexdigit()), "{reset:#?}");
        incarnation
    };
    let first = reset(&server);
    let old = finish(&mut old);
    assert_code(&old, 8);
    assert!(old.stderr.contains("job 'rerun' was reset by pid "), "{old:#?}");

    // A new run: every rank of the new incarnation passes; the lost rank 2 is gone.
    let run = |incarnation: &str, expected: i32| {
        let mut ranks: Vec<Guard> = (0..3)
            .map(|r| {
                let mut command = server.ranked("rerun", r, 3, &["barrier", "b"]);
                command.env("RALLYPOINT_JOB_INCARNATION", incarnation);
                spawn(command)
            })
            .collect();
        for rank in &mut ranks {
            assert_code(&finish(rank), expected);
        }
    };
    run(&first, 0);
    // That run is aborted: everything of it fails, until the next reset.
    assert_code(&exec(server.cmd("rerun", &["abort", "bad run"])), 0);
    run(&first, 5);
    let second = reset(&server);
    run(&second, 0);

    let mut stale = server.ranked("rerun", 0, 3, &["barrier", "b"]);
    stale.env("RALLYPOINT_JOB_INCARNATION", &first);
    let stale = exec(stale);
    assert_code(&stale, 8);
    let expected = format!(
        "this process belongs to incarnation {first} of job 'rerun'; the job is at incarnation {second} since "
    );
    assert!(stale.stderr.contains(&expected) && stale.stderr.contains("(reset by pid "), "{stale:#?}");
    // Plain use without an incarnation joins the current one.
    assert_code(&exec(server.cmd("rerun", &["set", "k", "v"])), 0);
}

/// A TCP proxy that forwards its first connection until a barrier request has gone
/// through, then cuts the client's side and keeps the coordinator's open (a half-open
/// connection); every later connection passes.
struct CutProxy {
    addr: String,
}

impl CutProxy {
    fn start(upstream: &str) -> CutProxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the proxy");
        let addr = listener.local_addr().expect("proxy address").to_string();
        let upstream = upstream.to_owned();
        thread::spawn(move || {
            for (n, client) in listener.incoming().enumerate() {
                let Ok(client) = client else { return };
                let Ok(server) = std::net::TcpStream::connect(&upstream) else { return };
                if n == 0 {
                    thread::spawn(move || cut_after_barrier(client, server));
                } else {
                    pass(client, server);
                }
            }
        });
        CutProxy { addr }
    }
}

fn pass(client: std::net::TcpStream, server: std::net::TcpStream) {
    let pump = |mut from: std::net::TcpStream, mut to: std::net::TcpStream| {
        thread::spawn(move || {
            let _ = std::io::copy(&mut from, &mut to);
            let _ = to.shutdown(std::net::Shutdown::Write);
        })
    };
    let (c, s) = (client.try_clone().expect("clone"), server.try_clone().expect("clone"));
    pump(client, server);
    pump(s, c);
}

fn cut_after_barrier(mut client: std::net::TcpStream, mut server: std::net::TcpStream) {
    use std::io::Write;
    let (mut from_server, mut to_client) = (server.try_clone().expect("clone"), client.try_clone().expect("clone"));
    thread::spawn(move || std::io::copy(&mut from_server, &mut to_client));
    let mut preamble = [0u8; 6];
    if client.read_exact(&mut preamble).is_err() || server.write_all(&preamble).is_err() {
        return;
    }
    loop {
        let mut len = [0u8; 4];
        if client.read_exact(&mut len).is_err() {
            return;
        }
        let mut body = vec![0u8; u32::from_le_bytes(len) as usize];
        if client.read_exact(&mut body).is_err() || server.write_all(&len).is_err() || server.write_all(&body).is_err()
        {
            return;
        }
        // A Request (0x02) frame: id (8 bytes), then the opcode; 0x0d is barrier.
        if body.first() == Some(&0x02) && body.get(9) == Some(&0x0d) {
            break;
        }
    }
    let _ = client.shutdown(std::net::Shutdown::Both);
    // The coordinator's end stays open until the test process ends.
    std::mem::forget(server);
}

/// Issue 14, story 3: rank 1's connection is cut right after its barrier request
/// and the coordinator's end stays open. Rank 1 reconnects and retries: its step 1
/// is one arrival (released with rank 0's step 1, not its step 2), and its step 2 is
/// generation 2.
#[test]
fn a_barrier_retried_after_a_half_open_cut_counts_once() {
    let server = Server::start();
    let proxy = CutProxy::start(&server.addr);
    let via_proxy = |r: u32| {
        let mut command = rallypoint();
        command.args(["barrier", "step", "--addr", &proxy.addr, "--job", "cut", "--rank", &r.to_string()]);
        command.args(["--world-size", "2", "--timeout", "30"]);
        command
    };
    let mut one = spawn(via_proxy(1));
    wait_connected(one.pid());
    assert_code(&exec(server.ranked("cut", 0, 2, &["barrier", "step"])), 0);
    assert_code(&finish(&mut one), 0);

    let mut zero = spawn(server.ranked("cut", 0, 2, &["barrier", "step"]));
    wait_connected(zero.pid());
    let status = exec(server.cmd("cut", &["status"]));
    assert!(
        status.stdout.contains("waiting: barrier 'step' (generation 2)")
            && status.stdout.contains("missing (1): rank 1"),
        "rank 1's retry was counted twice: {status:#?}"
    );
    assert_code(&exec(server.ranked("cut", 1, 2, &["barrier", "step"])), 0);
    assert_code(&finish(&mut zero), 0);
}

/// A node agent on `unix:PATH` carrying its ranks to `server`; the agent's process
/// is killed when the guard goes.
fn agent(server: &Server, path: &std::path::Path) -> Guard {
    let listen = format!("unix:{}", path.display());
    let mut child = spawn({
        let mut command = rallypoint();
        command.args(["agent", "--upstream", &server.addr, "--listen", &listen, "--print-addr"]);
        command
    });
    let stdout = child.0.stdout.take().expect("piped stdout");
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line).expect("the agent printed its address");
    assert_eq!(line.trim(), listen);
    child
}

/// With a reconnect grace far longer than the test may run, a SIGKILLed rank is
/// still lost at once: the coordinator sees that the process, on its own host, is
/// gone; behind a node agent, the agent sees it and says so in its SubClose.
#[test]
fn a_killed_process_is_lost_at_once_whatever_the_reconnect_grace() {
    let server = Server::start_with(&["--reconnect-grace", "120", "--lease", "300"]);
    let dir = std::env::temp_dir().join(format!("rp-grace-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let _agent = agent(&server, &dir.join("agent.sock"));
    let via_agent = |r: u32| {
        let mut command = rallypoint();
        let addr = format!("unix:{}", dir.join("agent.sock").display());
        command.args(["barrier", "b", "--addr", &addr, "--job", "agented", "--rank", &r.to_string()]);
        command.args(["--world-size", "3", "--timeout", "300"]);
        command
    };
    for (job, direct) in [("direct", true), ("agented", false)] {
        let command = |r: u32| {
            if direct {
                server.ranked(job, r, 3, &["barrier", "b", "--timeout", "300"])
            } else {
                via_agent(r)
            }
        };
        let mut zero = spawn(command(0));
        let mut victim = spawn(command(1));
        wait_for_status(&server, job, "2 connected");
        // The status document counts the sessions the agent carries, as the page does.
        let doc = status_json_when(&server, job, |_| true);
        let carried = if direct { 0 } else { 2 };
        assert_eq!(doc["job"]["sessions"]["via_agent"], carried, "{job}: {doc:#}");
        victim.0.kill().expect("SIGKILL rank 1");
        let killed_at = Instant::now();
        let run = finish(&mut zero);
        assert_code(&run, 4);
        assert!(run.stderr.contains(&format!("pid {}, lost: connection dropped", victim.pid())), "{job}: {run:#?}");
        assert!(killed_at.elapsed() < Duration::from_secs(60), "{job}: took {:?}", killed_at.elapsed());
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Ranks on a node agent's Unix socket wait in a barrier through shared memory
/// with the agent (docs/PROTOCOL.md, section 15: a barrier's second call goes as a
/// request that gets the channel, its later ones through the channel); one is
/// SIGKILLed while they wait, and every other one is woken at once with the
/// failure naming it.
#[test]
fn a_rank_killed_in_a_shared_memory_barrier_is_named_by_every_peer() {
    let server = Server::start();
    let dir = std::env::temp_dir().join(format!("rp-shmbar-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let sock = dir.join("agent.sock");
    let _agent = agent(&server, &sock);
    let addr = format!("unix:{}", sock.display());
    let rank = |r: u32, times: u32| {
        let mut command = rallypoint();
        command.args(["barrier", "b", "--times", &times.to_string(), "--addr", &addr, "--job", "shm"]);
        command.args(["--rank", &r.to_string(), "--world-size", "5", "--timeout", "300"]);
        command
    };
    // World of 5: all pass the first two generations (the second gets the channel);
    // rank 4 then leaves, so ranks 0 to 3 wait in the third (through the channel)
    // until rank 1 is killed.
    let mut peers: Vec<Guard> = [0, 2, 3].into_iter().map(|r| spawn(rank(r, 3))).collect();
    let mut victim = spawn(rank(1, 3));
    assert_code(&finish(&mut spawn(rank(4, 2))), 0);
    for pid in peers.iter().map(Guard::pid).chain([victim.pid()]) {
        wait_mapped(pid, "memfd:rallypoint-barrier");
    }
    // Mapped with the second generation's reply; the third arrives at once after.
    thread::sleep(Duration::from_millis(300));
    victim.0.kill().expect("SIGKILL rank 1");
    let killed_at = Instant::now();
    for peer in &mut peers {
        let run = finish(peer);
        assert_code(&run, 4);
        assert!(run.stderr.contains("rank 1"), "the error should name rank 1: {run:#?}");
    }
    // At once, not after the 300 s timeout.
    assert!(killed_at.elapsed() < LIMIT, "peers took {:?}", killed_at.elapsed());
    let _ = std::fs::remove_dir_all(&dir);
}

/// Waits until process `pid` maps a file named `name` (at most [`LIMIT`]).
fn wait_mapped(pid: u32, name: &str) {
    let deadline = Instant::now() + LIMIT;
    while Instant::now() < deadline {
        if std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap_or_default().contains(name) {
            return;
        }
        thread::sleep(Duration::from_millis(20));
    }
    panic!("process {pid} never mapped {name}");
}

/// Waits until `rallypoint status` of `job` says `ranks: WHAT` (e.g. "2 connected"), at most [`LIMIT`].
fn wait_for_status(server: &Server, job: &str, what: &str) {
    let deadline = Instant::now() + LIMIT;
    loop {
        let run = exec(server.cmd(job, &["status"]));
        if run.stdout.contains(&format!("ranks: {what}")) {
            return;
        }
        assert!(Instant::now() < deadline, "job {job} never had ranks: {what}: {run:#?}");
        thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn status_lists_the_jobs_and_refuses_one_the_coordinator_does_not_hold() {
    let server = Server::start();
    assert_code(&exec(server.cmd("alpha", &["set", "k", "v"])), 0);
    let run = exec(server.cmd("alpha", &["status"]));
    assert_code(&run, 0);
    let last = run.stdout.lines().last().unwrap_or_default();
    assert_eq!(last, format!("coordinator {} holds 1 job: 'alpha'", server.addr), "{run:#?}");
    let run = exec(server.cmd("alhpa", &["status"]));
    assert_code(&run, 2);
    assert_eq!(
        run.stderr.trim_end(),
        format!("rallypoint: the coordinator at {} holds no job 'alhpa' (its jobs: 'alpha')", server.addr)
    );
    // Asking about a job made no job of it.
    let run = exec(server.cmd("alpha", &["status"]));
    assert!(run.stdout.ends_with("holds 1 job: 'alpha'\n"), "{run:#?}");
    // A launcher's job (its launchers are in NAME/launch) before any worker connects.
    assert_code(&exec(server.cmd("beta/launch", &["set", "k", "v"])), 0);
    let run = exec(server.cmd("beta", &["status"]));
    assert_code(&run, 0);
    assert!(run.stdout.starts_with("job 'beta'\n"), "{run:#?}");
    // A job reset with nothing in it since: its incarnation is held, and said.
    let reset = exec(server.cmd("gamma", &["reset"]));
    assert_code(&reset, 0);
    let run = exec(server.cmd("gamma", &["status"]));
    assert_code(&run, 0);
    let line = format!("\nincarnation {} (reset to it by pid ", reset.stdout.trim_end());
    assert!(run.stdout.contains(&line), "{run:#?}");
    assert!(
        run.stdout.ends_with("holds 3 jobs: 'alpha', 'beta/launch' (the launchers of job 'beta'), 'gamma'\n"),
        "{run:#?}"
    );
}

#[test]
fn an_address_without_a_port_is_a_usage_error_at_once() {
    for (flag, env) in [(Some("localhost"), None), (None, Some("localhost"))] {
        let run = exec({
            let mut command = rallypoint();
            command.args(["get", "k"]);
            if let Some(addr) = flag {
                command.args(["--addr", addr]);
            }
            if let Some(addr) = env {
                command.env("RALLYPOINT_ADDR", addr);
            }
            command
        });
        assert_code(&run, 2);
        assert!(run.stderr.contains("'localhost' has no port: give HOST:PORT, e.g. localhost:29500"), "{run:#?}");
        assert!(!run.stderr.contains("waiting"), "{run:#?}");
    }
}

#[test]
fn a_key_wait_in_an_empty_job_names_the_job_and_the_others() {
    let server = Server::start();
    assert_code(&exec(server.cmd("run42", &["set", "k", "v"])), 0);
    // The launchers' own job of a launched run42: never one to suggest.
    assert_code(&exec(server.cmd("run42/launch", &["set", "node", "0"])), 0);
    // A mistyped job: the timeout alone would blame the key.
    let run = exec(server.cmd("run24", &["get", "k", "--timeout", "0.5"]));
    assert_code(&run, 3);
    let said = "job 'run24' holds no keys at all (the coordinator's other jobs: 'run42')";
    assert!(run.stderr.contains("waiting for 1 key(s): \"k\"") && run.stderr.contains(said), "{run:#?}");
    let run = exec(server.cmd("run24", &["wait", "k", "--timeout", "0.5"]));
    assert_code(&run, 3);
    assert!(run.stderr.contains(said), "{run:#?}");
    // The right job, the key missing: only the timeout.
    let run = exec(server.cmd("run42", &["get", "other", "--timeout", "0.5"]));
    assert_code(&run, 3);
    assert!(run.stderr.contains("waiting for 1 key(s)") && !run.stderr.contains("holds no keys"), "{run:#?}");
}

#[test]
fn a_verb_waiting_to_connect_says_so() {
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let addr = format!("127.0.0.1:{port}");
    let run = exec({
        let mut command = rallypoint();
        command.args(["get", "k", "--addr", &addr, "--timeout", "2.5"]);
        command
    });
    assert_code(&run, 7);
    // Nothing listens there: the line says so, not only that it waits.
    let waiting = format!("rallypoint: waiting for the coordinator at {addr} (1 s of 2 s): ");
    let line = run.stderr.lines().find(|l| l.starts_with(&waiting));
    assert!(line.is_some_and(|l| l.contains("refused")), "{waiting:?} and why in {run:#?}");
}

#[test]
fn set_reads_the_value_from_stdin_given_a_dash() {
    let server = Server::start();
    let mut command = server.cmd("stdin", &["set", "blob", "-"]);
    command.stdin(Stdio::piped());
    let mut child = spawn(command);
    {
        use std::io::Write;
        let mut stdin = child.0.stdin.take().expect("piped stdin");
        stdin.write_all(b"line one\nline two -\n").expect("write the value");
    }
    assert_code(&finish(&mut child), 0);
    assert_eq!(exec(server.cmd("stdin", &["get", "blob"])).stdout, "line one\nline two -\n\n");

    // Bytes that are no text, given back as they are with --raw.
    let blob = b"\x00\xff\xfe binary\n\x01";
    let mut command = server.cmd("stdin", &["set", "binary", "-"]);
    command.stdin(Stdio::piped());
    let mut child = spawn(command);
    {
        use std::io::Write;
        let mut stdin = child.0.stdin.take().expect("piped stdin");
        stdin.write_all(blob).expect("write the value");
    }
    assert_code(&finish(&mut child), 0);
    let raw = server.cmd("stdin", &["get", "binary", "--raw"]).output().expect("run get --raw");
    assert_eq!(raw.status.code(), Some(0), "{raw:?}");
    assert_eq!(raw.stdout, blob, "byte for byte, no newline");
}

#[test]
fn completions_for_bash_zsh_and_fish() {
    for (shell, marker) in
        [("bash", "complete -F _rallypoint"), ("zsh", "#compdef rallypoint"), ("fish", "complete -c rallypoint")]
    {
        let run = exec({
            let mut command = rallypoint();
            command.args(["completions", shell]);
            command
        });
        assert_code(&run, 0);
        assert!(run.stdout.contains(marker), "{shell}: {marker:?} missing");
        for word in ["launch", "nproc-per-node", "status"] {
            assert!(run.stdout.contains(word), "{shell} completes {word}");
        }
    }
    // bash loads it: `rallypoint` gets its completion function.
    let script = format!("source <({BIN} completions bash) && complete -p rallypoint");
    let loaded = Command::new("bash").args(["-c", &script]).output().expect("bash");
    assert!(String::from_utf8_lossy(&loaded.stdout).contains("_rallypoint"), "{loaded:?}");
    let run = exec({
        let mut command = rallypoint();
        command.args(["completions", "tcsh"]);
        command
    });
    assert_code(&run, 2);
}

#[test]
fn status_finds_a_job_that_holds_nothing_but_its_abort() {
    let server = Server::start();
    assert_code(&exec(server.cmd("stopped", &["abort", "disk full"])), 0);
    // Nothing but the abort: a later barrier of the job fails for it, so status tells it.
    let status = exec(server.cmd("stopped", &["status"]));
    assert_code(&status, 0);
    assert!(status.stdout.contains("aborted by ") && status.stdout.contains("disk full"), "{status:#?}");
}
