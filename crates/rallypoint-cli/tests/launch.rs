//! `rallypoint launch` end to end: real worker processes (shell scripts calling the
//! `rallypoint` verbs), real signals, and two launchers on loopback as two nodes.

use std::io::Read;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::ChildStdout;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

mod common;
use common::SCRUB;

const BIN: &str = env!("CARGO_BIN_EXE_rallypoint");
/// No launcher in these tests may run longer than this.
const LIMIT: Duration = Duration::from_secs(60);

/// The token the launchers of a test's multi-node job share (a job of several
/// nodes needs one given to each; one node makes its own).
const SHARED_TOKEN: &str = "launch-test-token-shared-by-every-node";

struct Launched {
    child: Child,
    stdout: thread::JoinHandle<String>,
    stderr: thread::JoinHandle<String>,
}

struct Finished {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

/// `rallypoint launch ARGS` with the test's environment scrubbed; a job of
/// several nodes gets the token all its launchers share.
fn launcher(args: &[&str]) -> Command {
    let mut cmd = Command::new(BIN);
    for var in SCRUB {
        cmd.env_remove(var);
    }
    if args.windows(2).any(|pair| pair[0] == "--nnodes" && pair[1] != "1") {
        cmd.env("RALLYPOINT_TOKEN", SHARED_TOKEN);
    }
    cmd.arg("launch").args(args);
    cmd
}

fn launch(args: &[&str], script: &str, dir: &Path) -> Launched {
    let mut cmd = launcher(args);
    cmd.arg("--").args(["sh", "-c", script]);
    cmd.env("RP", BIN).env("DIR", dir).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("start the launcher");
    let mut out = child.stdout.take().expect("piped");
    let mut err = child.stderr.take().expect("piped");
    Launched {
        child,
        stdout: thread::spawn(move || {
            let mut s = String::new();
            let _ = out.read_to_string(&mut s);
            s
        }),
        stderr: thread::spawn(move || {
            let mut s = String::new();
            let _ = err.read_to_string(&mut s);
            s
        }),
    }
}

impl Launched {
    fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    fn finish(mut self) -> Finished {
        let status = wait_bounded(&mut self.child);
        let stdout = self.stdout.join().unwrap_or_default();
        let stderr = self.stderr.join().unwrap_or_default();
        let status = status.unwrap_or_else(|stacks| {
            panic!("the launcher ran past {LIMIT:?}\nstdout:\n{stdout}\nstderr:\n{stderr}\nits stacks then:\n{stacks}")
        });
        Finished { code: status.code(), stdout, stderr }
    }
}

/// Waits for the launcher to exit, at most [`LIMIT`]; past it, kills it and returns
/// where its threads were (see [`common::stacks_of`]).
fn wait_bounded(child: &mut Child) -> Result<std::process::ExitStatus, String> {
    let deadline = Instant::now() + LIMIT;
    loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            return Ok(status);
        }
        if Instant::now() > deadline {
            let stacks = common::stacks_of(child.id());
            let _ = child.kill();
            let _ = child.wait();
            return Err(stacks);
        }
        thread::sleep(Duration::from_millis(20));
    }
}

/// The launcher's stderr lines after its start line (where its coordinator is).
fn messages(stderr: &str) -> impl Iterator<Item = &str> {
    stderr.lines().filter(|l| !(l.starts_with("rallypoint: job '") && l.contains("': coordinator at ")))
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("rp-launch-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

/// Waits (bounded) until every file exists; returns their contents.
fn wait_for_files(dir: &Path, names: &[String]) -> Vec<String> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let contents: Vec<Option<String>> = names.iter().map(|n| std::fs::read_to_string(dir.join(n)).ok()).collect();
        if contents.iter().all(|c| c.as_deref().is_some_and(|s| s.ends_with('\n'))) {
            return contents.into_iter().flatten().map(|s| s.trim().to_owned()).collect();
        }
        assert!(Instant::now() < deadline, "files {names:?} never all appeared in {}", dir.display());
        thread::sleep(Duration::from_millis(20));
    }
}

fn alive(pid: &str) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| s.contains(") Z "))
}

fn signal(pid: i32, sig: i32) {
    // SAFETY: plain syscall on a pid this test started.
    unsafe {
        libc::kill(pid, sig);
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("free port")
}

#[test]
fn every_rank_gets_torchrun_variables_prefixed_output_and_a_working_coordinator() {
    let dir = temp_dir("env");
    let script = r#"
        echo "env $RANK $LOCAL_RANK $WORLD_SIZE $LOCAL_WORLD_SIZE $GROUP_RANK $GROUP_WORLD_SIZE $ROLE_RANK $ROLE_NAME $ROLE_WORLD_SIZE $TORCHELASTIC_RUN_ID $TORCHELASTIC_RESTART_COUNT $TORCHELASTIC_MAX_RESTARTS $TORCHELASTIC_USE_AGENT_STORE $RALLYPOINT_JOB $OMP_NUM_THREADS"
        echo "addr $RALLYPOINT_ADDR $MASTER_ADDR:$MASTER_PORT"
        echo "to stderr $RANK" >&2
        "$RP" barrier start --timeout 30 || exit 11
        "$RP" all-gather "v$RANK" --timeout 30 | tr '\n' ' ' | sed 's/^/gathered /'; echo
    "#;
    let done = launch(&["--nproc-per-node", "3", "--job", "envtest"], script, &dir).finish();
    assert_eq!(done.code, Some(0), "stderr:\n{}", done.stderr);
    let last = done.stderr.lines().last().unwrap_or_default();
    let expected = "rallypoint: job 'envtest' succeeded (attempt 1 of 1): ranks 0-2 on this node exited with code 0";
    assert_eq!(last, expected, "{}", done.stderr);
    for r in 0..3 {
        let expected = format!("[rank{r}]: env {r} {r} 3 3 0 1 {r} default 3 envtest 0 0 True envtest 1");
        assert!(done.stdout.lines().any(|l| l == expected), "missing {expected:?} in\n{}", done.stdout);
        assert!(done.stderr.lines().any(|l| l == format!("[rank{r}]: to stderr {r}")), "{}", done.stderr);
        assert!(done.stdout.lines().any(|l| l == format!("[rank{r}]: gathered v0 v1 v2 ")), "{}", done.stdout);
        let addr = done.stdout.lines().find(|l| l.starts_with(&format!("[rank{r}]: addr "))).expect("addr line");
        let parts: Vec<&str> = addr.split_whitespace().collect();
        assert_eq!(parts[2], parts[3], "RALLYPOINT_ADDR equals MASTER_ADDR:MASTER_PORT");
        assert!(parts[2].starts_with("127.0.0.1:"), "{addr}");
    }
}

#[test]
fn a_failing_rank_takes_the_job_down_and_the_summary_names_it() {
    let dir = temp_dir("fail");
    let script = r#"
        echo $$ > "$DIR/pid$RANK.tmp" && mv "$DIR/pid$RANK.tmp" "$DIR/pid$RANK"
        if [ "$RANK" = 1 ]; then
            i=0; while [ ! -f "$DIR/pid0" ] || [ ! -f "$DIR/pid2" ]; do i=$((i+1)); [ $i -gt 400 ] && break; sleep 0.05; done
            echo "loading batch 17" >&2
            echo "fatal: bad batch" >&2
            exit 3
        fi
        exec sleep 30
    "#;
    let done = launch(&["--nproc-per-node", "3", "--grace", "2"], script, &dir).finish();
    assert_eq!(done.code, Some(3), "stderr:\n{}", done.stderr);
    let first_line = messages(&done.stderr).find(|l| l.starts_with("rallypoint: ")).unwrap_or_default();
    assert!(first_line.contains("FAILED") && first_line.contains("rank 1 exited with code 3"), "{}", done.stderr);
    assert!(!done.stderr.contains("succeeded"), "{}", done.stderr);
    assert!(done.stderr.contains("rank 1 (local rank 1, node 0, host "), "{}", done.stderr);
    assert!(done.stderr.contains("    | fatal: bad batch"), "{}", done.stderr);
    assert!(done.stderr.contains("rank 0: killed by the launcher (SIGTERM) after rank 1 failed"), "{}", done.stderr);
    assert!(done.stderr.contains("rank 2: killed by the launcher (SIGTERM) after rank 1 failed"), "{}", done.stderr);
    for pid in wait_for_files(&dir, &["pid0".into(), "pid2".into()]) {
        assert!(!alive(&pid), "worker {pid} survived its job");
    }
}

#[test]
fn a_worker_killed_by_sigkill_exits_137_and_its_peers_barriers_name_it() {
    let dir = temp_dir("sigkill");
    let script = r#"
        if [ "$RANK" = 1 ]; then
            echo $$ > "$DIR/pid.tmp" && mv "$DIR/pid.tmp" "$DIR/pid1"
            # Holds rank 1 (key-value verbs connect without a rank): a barrier rank 0 never joins.
            exec "$RP" barrier hold --ranks 0,1 --timeout 60
        fi
        echo > "$DIR/arriving$RANK"
        "$RP" barrier step --timeout 60
        echo "barrier exit $?"
        sleep 5
    "#;
    let launched = launch(&["--nproc-per-node", "3", "--grace", "5"], script, &dir);
    let pid = wait_for_files(&dir, &["pid1".into(), "arriving0".into(), "arriving2".into()]).remove(0);
    // Let rank 1's `get` connect (its death is then a lost rank) and ranks 0 and 2
    // reach their barrier: a rank not yet in it when rank 1 dies has only the
    // launcher's 100 ms notice to get there before SIGTERM, and prints nothing.
    // Generous, for a loaded machine: 300 ms once fell short there.
    thread::sleep(Duration::from_millis(1_000));
    signal(pid.parse().expect("pid"), libc::SIGKILL);
    let done = launched.finish();
    assert_eq!(done.code, Some(137), "stderr:\n{}", done.stderr);
    assert!(done.stderr.contains("rank 1 was killed by SIGKILL"), "{}", done.stderr);
    for r in [0, 2] {
        let exit_line = format!("[rank{r}]: barrier exit ");
        let line = done
            .stdout
            .lines()
            .find(|l| l.starts_with(&exit_line))
            .unwrap_or_else(|| panic!("no {exit_line:?} in stdout:\n{}\nstderr:\n{}", done.stdout, done.stderr));
        assert!(line.ends_with(" 4") || line.ends_with(" 5"), "peer lost (4) or aborted (5): {line}");
        let why = done.stderr.lines().find(|l| l.starts_with(&format!("[rank{r}]: rallypoint: "))).unwrap_or_default();
        assert!(why.contains("rank 1"), "rank {r}'s barrier error must name rank 1: {why:?}\n{}", done.stderr);
    }
}

/// SIGINT to the launcher reaches every worker, whose handlers get the grace to
/// finish; `times` SIGINTs 50 ms apart (`timeout` sends one to the launcher and
/// another to its process group) are taken as one.
fn sigint_reaches_every_worker(name: &str, times: usize) {
    let dir = temp_dir(name);
    let script = r#"
        trap 'sleep 1.5; echo int > "$DIR/int$RANK"; exit 0' INT
        echo ready > "$DIR/ready$RANK"
        i=0; while [ $i -lt 600 ]; do i=$((i+1)); sleep 0.1; done
    "#;
    let launched = launch(&["--nproc-per-node", "2"], script, &dir);
    wait_for_files(&dir, &["ready0".into(), "ready1".into()]);
    for _ in 0..times {
        signal(launched.pid(), libc::SIGINT);
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let done = launched.finish();
    assert_eq!(done.code, Some(130), "stderr:\n{}", done.stderr);
    wait_for_files(&dir, &["int0".into(), "int1".into()]);
    assert!(done.stderr.contains("received SIGINT") && !done.stderr.contains("SIGKILL"), "{}", done.stderr);
}

#[test]
fn sigint_to_the_launcher_reaches_every_worker() {
    sigint_reaches_every_worker("sigint", 1);
}

#[test]
fn a_signal_delivered_twice_at_once_keeps_the_grace() {
    sigint_reaches_every_worker("sigint2", 2);
}

#[test]
fn what_a_rank_raised_in_its_torch_error_file_heads_the_summary() {
    // What torch's @record writes to TORCHELASTIC_ERROR_FILE; the noise after it on
    // stderr is what may push the exception's line out of a stderr tail.
    let dir = temp_dir("error-file");
    let parent = dir.join("parent.json");
    let script = r#"
        case "$TORCHELASTIC_ERROR_FILE" in "$DIR"/logs/attempt1/rank"$RANK".error.json) ;; *) exit 8 ;; esac
        if [ "$RANK" = 1 ]; then
            i=0; while [ ! -f "$DIR/ready0" ]; do i=$((i+1)); [ $i -gt 400 ] && break; sleep 0.05; done
            if [ "$WRITE" = 1 ]; then
                printf '%s' '{"message": {"message": "ValueError: bad lr\nlr must be positive", "extraInfo": {"py_callstack": "Traceback", "timestamp": "1"}}}' > "$TORCHELASTIC_ERROR_FILE"
            elif [ "$WRITE" = fifo ]; then
                mkfifo "$TORCHELASTIC_ERROR_FILE"
            fi
            echo "warning: shutting down" >&2
            exit 1
        fi
        touch "$DIR/ready0"
        "$RP" barrier step --timeout 30 2>&1; echo "barrier exit $?"
    "#;
    let logs = dir.join("logs");
    let args = ["--nproc-per-node", "2", "--grace", "5", "--tee", "3", "--log-dir", logs.to_str().expect("utf-8")];
    let parent_var = parent.to_str().expect("utf-8");
    let env = [("WRITE", "1"), ("TORCHELASTIC_ERROR_FILE", parent_var)];
    let done = start(&args, script, &dir, &env, true).finish();
    assert_eq!(done.code, Some(1), "stdout:\n{}\nstderr:\n{}", done.stdout, done.stderr);
    let first_line = messages(&done.stderr).find(|l| l.starts_with("rallypoint: ")).unwrap_or_default();
    assert!(first_line.contains("rank 1 exited with code 1: ValueError: bad lr"), "{}", done.stderr);
    assert!(
        done.stderr.contains("  it raised (its error file says): ValueError: bad lr\n    lr must be positive\n"),
        "{}",
        done.stderr
    );
    // The launcher's own error file (a scheduler's) gets the root cause's.
    let passed = std::fs::read_to_string(&parent).expect("the root cause's error file passed on");
    assert!(passed.contains("ValueError: bad lr") && passed.contains(r#""errorCode":1"#), "{passed}");

    // The same log directory again: the old file is not taken for the new failure.
    std::fs::remove_file(dir.join("ready0")).expect("ready0");
    std::fs::remove_file(&parent).expect("parent");
    let done = start(&args, script, &dir, &[("WRITE", "0"), ("TORCHELASTIC_ERROR_FILE", parent_var)], true).finish();
    assert_eq!(done.code, Some(1), "stderr:\n{}", done.stderr);
    assert!(!done.stderr.contains("ValueError"), "{}", done.stderr);
    assert!(!parent.exists(), "nothing raised, nothing passed on");

    // A FIFO where the file should be: read without waiting for a writer, not passed on.
    std::fs::remove_file(dir.join("ready0")).expect("ready0");
    let done = start(&args, script, &dir, &[("WRITE", "fifo"), ("TORCHELASTIC_ERROR_FILE", parent_var)], true).finish();
    assert_eq!(done.code, Some(1), "stderr:\n{}", done.stderr);
    assert!(done.stderr.contains("rank1.error.json is not a regular file)"), "{}", done.stderr);
    assert!(!parent.exists(), "not a file @record wrote, not passed on");
}

#[test]
fn restarts_run_the_whole_group_again_in_a_fresh_job() {
    let dir = temp_dir("restart");
    let script = r#"
        echo "attempt $TORCHELASTIC_RESTART_COUNT job $RALLYPOINT_JOB"
        "$RP" barrier step --timeout 30 || exit 9
        "$RP" barrier step --timeout 30 || exit 9
        if [ "$TORCHELASTIC_RESTART_COUNT" -lt 2 ] && [ "$RANK" = 0 ]; then exit 5; fi
        echo "done in attempt $TORCHELASTIC_RESTART_COUNT"
    "#;
    let done = launch(&["--nproc-per-node", "2", "--max-restarts", "2", "--grace", "2"], script, &dir).finish();
    assert_eq!(done.code, Some(0), "stdout:\n{}\nstderr:\n{}", done.stdout, done.stderr);
    for (attempt, job) in [(0, "default"), (1, "default.restart1"), (2, "default.restart2")] {
        let line = format!("[rank1]: attempt {attempt} job {job}");
        assert!(done.stdout.lines().any(|l| l == line), "missing {line:?}\n{}", done.stdout);
    }
    assert!(done.stdout.lines().any(|l| l == "[rank1]: done in attempt 2"), "{}", done.stdout);
    assert!(done.stderr.contains("restarting (1 of 2 restarts)"), "{}", done.stderr);
    assert!(done.stderr.contains("restarting (2 of 2 restarts)"), "{}", done.stderr);

    // Out of restarts: the last failure's code.
    let done = launch(&["--nproc-per-node", "2", "--max-restarts", "1"], "exit 6", &dir).finish();
    assert_eq!(done.code, Some(6), "{}", done.stderr);
    assert!(done.stderr.contains("attempt 2 of 2"), "{}", done.stderr);
}

#[test]
fn two_nodes_a_failure_on_node_1_takes_node_0_down() {
    let dir = temp_dir("twonode");
    let master = format!("127.0.0.1:{}", free_port());
    let script = r#"
        echo "node $GROUP_RANK rank $RANK of $WORLD_SIZE"
        echo $$ > "$DIR/pid$RANK.tmp" && mv "$DIR/pid$RANK.tmp" "$DIR/pid$RANK"
        if [ "$RANK" = 3 ]; then
            i=0; while [ ! -f "$DIR/pid0" ] || [ ! -f "$DIR/pid1" ]; do i=$((i+1)); [ $i -gt 400 ] && break; sleep 0.05; done
            echo "node 1 worker failing" >&2
            exit 7
        fi
        exec sleep 30
    "#;
    let common =
        ["--nnodes", "2", "--nproc-per-node", "2", "--master", master.as_str(), "--job", "two", "--grace", "2"];
    let node0 = launch(&[&common[..], &["--node-rank", "0"]].concat(), script, &dir);
    let node1 = launch(&[&common[..], &["--node-rank", "1"]].concat(), script, &dir);
    let (n0, n1) = (node0.finish(), node1.finish());
    assert_eq!(n1.code, Some(7), "node 1 stderr:\n{}", n1.stderr);
    assert_eq!(n0.code, Some(7), "node 0 stderr:\n{}", n0.stderr);
    assert!(
        n0.stdout.contains("[rank0]: node 0 rank 0 of 4") && n1.stdout.contains("[rank3]: node 1 rank 3 of 4"),
        "{}\n{}",
        n0.stdout,
        n1.stdout
    );
    assert!(n0.stderr.contains("rank 3 exited with code 7"), "node 0 names the root cause:\n{}", n0.stderr);
    assert!(n0.stderr.contains("    | node 1 worker failing"), "{}", n0.stderr);
    assert!(n0.stderr.contains("rank 0: killed by the launcher (SIGTERM) after rank 3 failed"), "{}", n0.stderr);
    for pid in wait_for_files(&dir, &["pid0".into(), "pid1".into(), "pid2".into()]) {
        assert!(!alive(&pid), "worker {pid} survived its job");
    }
}

/// A job of two nodes on this machine, two workers each running `script`, to its end.
fn two_nodes_of_two(script: &str, dir: &Path, job: &str) -> (Finished, Finished) {
    let master = format!("127.0.0.1:{}", free_port());
    let common = ["--nnodes", "2", "--nproc-per-node", "2", "--master", master.as_str(), "--job", job, "--grace", "2"];
    let node0 = launch(&[&common[..], &["--node-rank", "0"]].concat(), script, dir);
    let node1 = launch(&[&common[..], &["--node-rank", "1"]].concat(), script, dir);
    (node0.finish(), node1.finish())
}

/// A rank killed on node 1 while node 0's ranks wait in a barrier: node 1's launcher
/// aborts the job, and node 0's ranks fail for the abort, at times before node 1's
/// report of the kill reaches node 0. Both nodes name the killed rank, not a rank the
/// abort ended. (The order varies from run to run: three runs.)
#[test]
fn two_nodes_name_a_rank_killed_elsewhere_not_the_ranks_its_abort_ended() {
    let script = r#"
        "$RP" barrier a || exit $?
        if [ "$RANK" = 3 ]; then kill -9 $$; fi
        exec "$RP" barrier b
    "#;
    for run in 0..3 {
        let dir = temp_dir(&format!("abortorder{run}"));
        let (n0, n1) = two_nodes_of_two(script, &dir, "order");
        for (node, done) in [(0, &n0), (1, &n1)] {
            let headline = done.stderr.lines().find(|l| l.contains("FAILED")).unwrap_or_default();
            assert!(headline.ends_with("rank 3 was killed by SIGKILL"), "run {run}, node {node}:\n{}", done.stderr);
            assert_eq!(done.code, Some(137), "run {run}, node {node}:\n{}", done.stderr);
        }
    }
}

#[test]
fn workers_do_not_outlive_a_killed_launcher() {
    let dir = temp_dir("orphans");
    let launched = launch(
        &["--nproc-per-node", "2"],
        r#"echo $$ > "$DIR/p.tmp$RANK" && mv "$DIR/p.tmp$RANK" "$DIR/pid$RANK"; exec sleep 30"#,
        &dir,
    );
    let pids = wait_for_files(&dir, &["pid0".into(), "pid1".into()]);
    signal(launched.pid(), libc::SIGKILL);
    let _ = launched.finish();
    let deadline = Instant::now() + Duration::from_secs(5);
    while pids.iter().any(|p| alive(p)) {
        assert!(Instant::now() < deadline, "workers {pids:?} outlived their launcher");
        thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn usage_errors_exit_2() {
    let dir = temp_dir("usage");
    let done = launch(&["--nnodes", "2", "--node-rank", "0"], "true", &dir).finish();
    assert_eq!(done.code, Some(2), "{}", done.stderr);
    assert!(done.stderr.contains("--master"), "{}", done.stderr);
    let done = launch(&["--nnodes", "2", "--node-rank", "2", "--master", "127.0.0.1:1"], "true", &dir).finish();
    assert_eq!(done.code, Some(2), "{}", done.stderr);
    assert!(done.stderr.contains("--node-rank 2 is out of range"), "{}", done.stderr);
    // A job name the launch's own suffixes would take past a coordinator's limit:
    // refused before anything starts.
    let long = "j".repeat(1018);
    let done = launch(&["--job", &long, "--max-restarts", "12"], "true", &dir).finish();
    assert_eq!(done.code, Some(2), "{}", done.stderr);
    assert!(done.stderr.contains("--job: a name of 1018 bytes is too long: at most 1014"), "{}", done.stderr);
    assert!(!done.stderr.contains("coordinator at"), "{}", done.stderr);
    // A bad value from torchrun's variable is said to come from it, not from the flag.
    let from_env = |args: &[&str]| {
        let mut cmd = launcher(args);
        cmd.env("PET_SHUTDOWN_TIMEOUT", "soon").args(["--", "true"]);
        let out = cmd.output().expect("launcher");
        (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let (code, stderr) = from_env(&[]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("invalid value 'soon' for '--grace <SECS>' (from $PET_SHUTDOWN_TIMEOUT)"), "{stderr}");
    let (code, stderr) = from_env(&["--shutdown-timeout", "later"]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("invalid value 'later' for '--grace <SECS>':"), "{stderr}");
}

#[test]
fn a_lost_node_launcher_takes_the_other_node_down_naming_it() {
    let dir = temp_dir("nodelost");
    let master = format!("127.0.0.1:{}", free_port());
    let script = r#"echo $$ > "$DIR/p$RANK.tmp" && mv "$DIR/p$RANK.tmp" "$DIR/pid$RANK"; exec sleep 30"#;
    let common =
        ["--nnodes", "2", "--nproc-per-node", "1", "--master", master.as_str(), "--job", "lost", "--grace", "2"];
    let node0 = launch(&[&common[..], &["--node-rank", "0"]].concat(), script, &dir);
    let node1 = launch(&[&common[..], &["--node-rank", "1"]].concat(), script, &dir);
    let pids = wait_for_files(&dir, &["pid0".into(), "pid1".into()]);
    signal(node1.pid(), libc::SIGKILL);
    let _ = node1.finish();
    let n0 = node0.finish();
    assert_eq!(n0.code, Some(1), "node 0 stderr:\n{}", n0.stderr);
    assert!(n0.stderr.contains("node 1 (") && n0.stderr.contains("was lost"), "{}", n0.stderr);
    let deadline = Instant::now() + Duration::from_secs(5);
    while pids.iter().any(|p| alive(p)) {
        assert!(Instant::now() < deadline, "workers {pids:?} survived the lost node");
        thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn two_nodes_restart_together_after_a_failure() {
    let dir = temp_dir("tworestart");
    let master = format!("127.0.0.1:{}", free_port());
    let script = r#"
        if [ "$TORCHELASTIC_RESTART_COUNT" = 0 ] && [ "$RANK" = 1 ]; then exit 4; fi
        "$RP" barrier together --timeout 30 || exit 9
        echo "rank $RANK done in attempt $TORCHELASTIC_RESTART_COUNT of job $RALLYPOINT_JOB"
    "#;
    let common = [
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--master",
        master.as_str(),
        "--job",
        "tr",
        "--max-restarts",
        "1",
        "--grace",
        "2",
    ];
    let node0 = launch(&[&common[..], &["--node-rank", "0"]].concat(), script, &dir);
    let node1 = launch(&[&common[..], &["--node-rank", "1"]].concat(), script, &dir);
    let (n0, n1) = (node0.finish(), node1.finish());
    assert_eq!(n0.code, Some(0), "node 0 stderr:\n{}", n0.stderr);
    assert_eq!(n1.code, Some(0), "node 1 stderr:\n{}", n1.stderr);
    assert!(n0.stdout.contains("[rank0]: rank 0 done in attempt 1 of job tr.restart1"), "{}", n0.stdout);
    assert!(n1.stdout.contains("[rank1]: rank 1 done in attempt 1 of job tr.restart1"), "{}", n1.stdout);
    assert!(n0.stderr.contains("restarting (1 of 1 restarts)") && n1.stderr.contains("restarting (1 of 1 restarts)"));
    for n in [&n0, &n1] {
        let last = n.stderr.lines().last().unwrap_or_default();
        assert!(last.starts_with("rallypoint: job 'tr' succeeded (attempt 2 of 2): rank "), "{}", n.stderr);
        assert!(last.ends_with(" on this node exited with code 0"), "{}", n.stderr);
    }
}

/// The `unix:PATH` a worker printed as `addr RALLYPOINT_ADDR MASTER_ADDR:MASTER_PORT`;
/// checks that MASTER_* still names the coordinator.
fn node_agent_socket(stdout: &str, rank: u32, master: &str) -> PathBuf {
    let prefix = format!("[rank{rank}]: addr ");
    let line = stdout
        .lines()
        .find(|l| l.starts_with(&prefix))
        .unwrap_or_else(|| panic!("no addr line of rank {rank}:\n{stdout}"));
    let parts: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(parts[3], master, "MASTER_ADDR:MASTER_PORT must stay the coordinator's: {line}");
    let path = parts[2]
        .strip_prefix("unix:")
        .unwrap_or_else(|| panic!("RALLYPOINT_ADDR must be the node agent's Unix socket: {line}"));
    PathBuf::from(path)
}

#[test]
fn two_nodes_behind_node_agents_pass_barriers_and_all_gathers() {
    let dir = temp_dir("nodeagent");
    let master = format!("127.0.0.1:{}", free_port());
    let script = r#"
        echo "addr $RALLYPOINT_ADDR $MASTER_ADDR:$MASTER_PORT"
        exec "$RP" demo-worker --rounds 3
    "#;
    let common = ["--nnodes", "2", "--nproc-per-node", "2", "--master", master.as_str(), "--job", "na", "--node-agent"];
    let node0 = launch(&[&common[..], &["--node-rank", "0"]].concat(), script, &dir);
    let node1 = launch(&[&common[..], &["--node-rank", "1"]].concat(), script, &dir);
    let (n0, n1) = (node0.finish(), node1.finish());
    assert_eq!(n0.code, Some(0), "node 0 stderr:\n{}", n0.stderr);
    assert_eq!(n1.code, Some(0), "node 1 stderr:\n{}", n1.stderr);
    for (node, ranks) in [(&n0, [0, 1]), (&n1, [2, 3])] {
        let sockets: Vec<PathBuf> = ranks.iter().map(|&r| node_agent_socket(&node.stdout, r, &master)).collect();
        assert_eq!(sockets[0], sockets[1], "one node agent per node");
        let socket_dir = sockets[0].parent().expect("the socket lives in a directory");
        assert!(!socket_dir.exists(), "the node agent's directory {} outlived its launcher", socket_dir.display());
        for r in ranks {
            // Step 3's losses are 2/4 + 0.01 * rank: every rank saw all four, in rank order.
            let gathered = "all-gather 'loss': [0.500, 0.510, 0.520, 0.530]";
            let line = format!("[rank{r}]: [rank {r}] step 3: barrier 'step' passed");
            assert!(
                node.stdout.lines().any(|l| l.starts_with(&line) && l.contains(gathered)),
                "missing {line:?} with {gathered:?} in\n{}",
                node.stdout
            );
        }
    }
    let (s0, s1) = (node_agent_socket(&n0.stdout, 0, &master), node_agent_socket(&n1.stdout, 2, &master));
    assert_ne!(s0, s1, "each node's launcher hosts its own node agent");
}

#[test]
fn a_worker_killed_behind_a_node_agent_is_named_on_the_other_node() {
    let dir = temp_dir("nodeagentkill");
    let master = format!("127.0.0.1:{}", free_port());
    // Rank 3, the last, is on node 1: it kills itself with SIGKILL while the others
    // wait for it in a barrier.
    let script = r#"exec "$RP" demo-worker --rounds 1 --kill-last"#;
    let common = [
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--master",
        master.as_str(),
        "--job",
        "nak",
        "--grace",
        "2",
        "--node-agent",
    ];
    let node0 = launch(&[&common[..], &["--node-rank", "0"]].concat(), script, &dir);
    let node1 = launch(&[&common[..], &["--node-rank", "1"]].concat(), script, &dir);
    let (n0, n1) = (node0.finish(), node1.finish());
    assert_eq!(n1.code, Some(137), "node 1 stderr:\n{}", n1.stderr);
    assert_eq!(n0.code, Some(137), "node 0 stderr:\n{}", n0.stderr);
    assert!(n1.stderr.contains("rank 3 was killed by SIGKILL"), "node 1's summary names rank 3:\n{}", n1.stderr);
    assert!(n0.stderr.contains("rank 3 was killed by SIGKILL"), "node 0's summary names rank 3:\n{}", n0.stderr);
    for (r, node) in [(0, &n0), (1, &n0), (2, &n1)] {
        // The barrier fails with PeerLost through the node agent, naming the dead
        // rank, its host and its pid, whether the coordinator heard first of the
        // closed connection or of the launcher's report of the death (which node 1's
        // launcher makes before it aborts the job): never with the abort.
        let told = format!("[rank{r}]: [rank {r}] told");
        let why = node.stdout.lines().find(|l| l.starts_with(&told)).unwrap_or_else(|| {
            panic!("rank {r} was not told rank 3 was lost\nstdout:\n{}\nstderr:\n{}", node.stdout, node.stderr)
        });
        let about = why.split_once("rank 3 (").map_or("", |(_, rest)| rest);
        let named = about.contains("pid ") && about.contains("host ") && about.contains("lost: ");
        assert!(named, "rank {r} must name rank 3 with its pid, host and loss: {why:?}");
    }
}

#[test]
fn a_worker_that_dies_before_connecting_is_named_lost_by_the_peers_waiting_for_it() {
    let dir = temp_dir("earlydeath");
    // Rank 1 (a crash at import, say) exits before it ever connects, while the others
    // wait for it in a barrier.
    let script = r#"if [ "$RANK" = 1 ]; then sleep 0.5; exit 3; fi; exec "$RP" barrier b --timeout 30"#;
    let run = launch(&["--nproc-per-node", "3", "--job", "early"], script, &dir).finish();
    assert_eq!(run.code, Some(3), "{}", run.stderr);
    for r in [0, 2] {
        let told = format!("[rank{r}]: rallypoint: ");
        let why = run.stderr.lines().find(|l| l.starts_with(&told)).unwrap_or_else(|| panic!("{}", run.stderr));
        assert!(
            why.contains("rank 1 (host ") && why.contains("exited with code 3)") && why.contains("lost: worker pid "),
            "{why}"
        );
        assert!(run.stderr.contains(&format!("rank {r}: exited with code 4 after rank 1 failed")), "{}", run.stderr);
    }
    assert!(run.stderr.contains("FAILED (attempt 1 of 1): rank 1 exited with code 3"), "{}", run.stderr);
}

/// Each of `peers` is summed up as having failed for `cause` ("rank 1 was lost"):
/// peer lost (4), or aborted by the launcher (5) if it got there later.
fn peers_failed_for<const N: usize>(stderr: &str, peers: [u32; N], cause: &str) {
    for r in peers {
        let line = [4, 5].map(|code| format!("  rank {r}: exited with code {code} after {cause}"));
        assert!(stderr.lines().any(|l| line.contains(&l.to_owned())), "missing {line:?}:\n{stderr}");
    }
}

/// Every rank passes barrier `start`; then `rank` exits 0 while the others call
/// barrier `final`.
fn done_after_start(rank: u32) -> String {
    format!(
        r#""$RP" barrier start --timeout 60 || exit $?
        if [ "$RANK" = {rank} ]; then exit 0; fi
        exec "$RP" barrier final --timeout 60"#
    )
}

/// Rank 1 exits 0 without the barrier its peers wait in (a loop one step short, say):
/// they fail at once naming it, not at their timeout, and the summary blames it.
#[test]
fn a_rank_that_exits_0_while_its_peers_wait_for_it_is_named_as_the_root_cause() {
    let dir = temp_dir("finishedearly");
    let run = launch(&["--nproc-per-node", "3", "--job", "short"], &done_after_start(1), &dir).finish();
    // The first peer to fail was told of rank 1 (4); a later one may be told of the abort (5).
    assert_eq!(run.code, Some(4), "{}", run.stderr);
    let headline = run.stderr.lines().find(|l| l.contains("FAILED")).unwrap_or_default();
    assert!(
        headline.contains("): rank 1 exited with code 0 at ") && headline.ends_with("while its peers still needed it"),
        "{}",
        run.stderr
    );
    assert!(
        run.stderr.contains(") exited with code 0 while a barrier or collective of its peers still needed it"),
        "{}",
        run.stderr
    );
    let told = run.stderr.lines().filter(|l| l.contains("barrier 'final' (generation 1) failed: rank 1 (host "));
    let told: Vec<&str> = told.collect();
    assert!(
        !told.is_empty()
            && told
                .iter()
                .all(|l| l.contains(", finished: worker pid ") && l.ends_with("finished before it completed")),
        "{}",
        run.stderr
    );
    assert!(!run.stderr.contains("timed out"), "{}", run.stderr);
    peers_failed_for(&run.stderr, [0, 2], "rank 1 finished early");
}

/// A rank that aborts the job is its root cause, not the first peer to exit for
/// the abort; a process of no rank that aborts it is named by pid and host.
#[test]
fn a_job_aborted_by_a_rank_names_that_rank_first() {
    let dir = temp_dir("abortedbyrank");
    let script = r#"
        if [ "$RANK" = 2 ]; then sleep 0.3; "$RP" abort "loss is NaN"; exec sleep 30; fi
        exec "$RP" barrier b --timeout 60
    "#;
    let run = launch(&["--nproc-per-node", "3", "--grace", "2", "--job", "abl"], script, &dir).finish();
    assert_eq!(run.code, Some(5), "{}", run.stderr);
    let headline = run.stderr.lines().find(|l| l.contains("FAILED")).unwrap_or_default();
    assert!(headline.ends_with("): rank 2 aborted the job: loss is NaN"), "{}", run.stderr);
    assert!(run.stderr.contains("  rank 2 (node 0, host "), "{}", run.stderr);
    assert!(run.stderr.contains("was aborted by rank 2 (host "), "{}", run.stderr);
    assert!(run.stderr.contains("exited with code 5 after rank 2 aborted the job"), "{}", run.stderr);

    let script = r#"
        if [ "$RANK" = 1 ]; then sleep 0.3; env -u RANK "$RP" abort "operator says stop"; exec sleep 30; fi
        exec "$RP" barrier b --timeout 60
    "#;
    let run = launch(&["--nproc-per-node", "2", "--grace", "2", "--job", "abt"], script, &dir).finish();
    assert_eq!(run.code, Some(5), "{}", run.stderr);
    let headline = run.stderr.lines().find(|l| l.contains("FAILED")).unwrap_or_default();
    assert!(
        headline.contains("): pid ") && headline.ends_with(" aborted the job: operator says stop"),
        "{}",
        run.stderr
    );
    assert!(run.stderr.contains("a process of no rank (a tool, or a command), aborted the job"), "{}", run.stderr);

    // Ranks that live through the abort and exit 0: the success says it was aborted.
    let script = r#"
        if [ "$RANK" = 1 ]; then "$RP" abort "stop now"; fi
        "$RP" barrier b --timeout 60; exit 0
    "#;
    let run = launch(&["--nproc-per-node", "2", "--job", "abs"], script, &dir).finish();
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    let success = run.stderr.lines().find(|l| l.contains("succeeded")).unwrap_or_default();
    assert!(success.contains("; but the job was aborted by rank 1 (host "), "{}", run.stderr);
}

/// Rank 2 exits 0 early under collectives the coordinator does not see (torch's
/// own: a peer left behind fails with "Connection closed by peer", naming no rank):
/// the first failure is shown with the early end before it.
#[test]
fn a_failure_after_a_rank_exited_0_early_is_shown_with_that_end() {
    let dir = temp_dir("earlyend");
    let script = r#"
        if [ "$RANK" = 2 ]; then exit 0; fi
        if [ "$RANK" = 1 ]; then sleep 0.5; echo "Connection closed by peer" >&2; exit 1; fi
        exec sleep 30
    "#;
    let run = launch(&["--nproc-per-node", "3", "--grace", "2"], script, &dir).finish();
    assert_eq!(run.code, Some(1), "{}", run.stderr);
    let headline = run.stderr.lines().find(|l| l.contains("FAILED")).unwrap_or_default();
    assert!(headline.ends_with("): rank 1 exited with code 1"), "{}", run.stderr);
    let context = run.stderr.lines().find(|l| l.contains(" s before it, rank 2 (node 0, host ")).unwrap_or_default();
    assert!(context.contains(") exited with code 0 while its peers ran on"), "{}", run.stderr);

    // Not when every rank ran to its end first.
    let script = r#"
        if [ "$RANK" = 1 ]; then exit 1; fi
        exec sleep 30
    "#;
    let run = launch(&["--nproc-per-node", "3", "--grace", "2"], script, &dir).finish();
    assert!(!run.stderr.contains("before it,"), "{}", run.stderr);
}

/// Rank 2 exits 0 at once, before any rank connected and stated the world size: its
/// peers still fail at once when they call the barrier, naming it.
#[test]
fn a_rank_that_exits_0_before_any_rank_connected_is_named_by_the_peers_waiting_for_it() {
    let dir = temp_dir("finishedfirst");
    let script = r#"
        if [ "$RANK" = 2 ]; then exit 0; fi
        sleep 1
        exec "$RP" barrier final --timeout 60
    "#;
    let run = launch(&["--nproc-per-node", "3", "--job", "first"], script, &dir).finish();
    assert_eq!(run.code, Some(4), "{}", run.stderr);
    let headline = run.stderr.lines().find(|l| l.contains("FAILED")).unwrap_or_default();
    assert!(headline.contains("): rank 2 exited with code 0 at "), "{}", run.stderr);
    assert!(run.stderr.contains(", finished: worker pid "), "{}", run.stderr);
    assert!(!run.stderr.contains("timed out"), "{}", run.stderr);
}

/// Rank 2's client dies without a clean leave while its peers wait, then its worker
/// exits 0 before they do: the rank whose drop failed them is named, not a peer.
#[test]
fn a_rank_that_dropped_its_connection_then_exited_0_is_named_not_its_peers() {
    let dir = temp_dir("droppedthendone");
    let script = r#"
        "$RP" barrier start --timeout 60 || exit $?
        if [ "$RANK" = 2 ]; then
            "$RP" barrier only-mine --timeout 60 & client=$!
            sleep 0.3; kill -9 $client; exit 0
        fi
        "$RP" barrier final --timeout 60; rc=$?
        sleep 1; exit $rc
    "#;
    let run = launch(&["--nproc-per-node", "3", "--job", "dropped"], script, &dir).finish();
    assert_eq!(run.code, Some(4), "{}", run.stderr);
    let headline = run.stderr.lines().find(|l| l.contains("FAILED")).unwrap_or_default();
    assert!(headline.contains("): rank 2 "), "{}", run.stderr);
}

/// A rank done early fails nothing that does not need it: its peers' barrier of the
/// two of them passes, and the job succeeds.
#[test]
fn a_rank_that_exits_0_early_fails_nothing_that_does_not_need_it() {
    let dir = temp_dir("finishedalone");
    let script = r#"
        "$RP" barrier start --timeout 60 || exit $?
        if [ "$RANK" = 1 ]; then exit 0; fi
        sleep 0.5
        exec "$RP" barrier pair --ranks 0,2 --times 3 --timeout 60
    "#;
    let run = launch(&["--nproc-per-node", "3", "--job", "alone"], script, &dir).finish();
    assert_eq!(run.code, Some(0), "{}", run.stderr);
}

/// The same across nodes: rank 3 on node 1 is done early, node 0's ranks wait for it;
/// both nodes' summaries name it.
#[test]
fn a_rank_that_exits_0_on_another_node_is_named_on_both_nodes() {
    let dir = temp_dir("finishedtwo");
    let (n0, n1) = two_nodes_of_two(&done_after_start(3), &dir, "two");
    for (node, done) in [(0, &n0), (1, &n1)] {
        let headline = done.stderr.lines().find(|l| l.contains("FAILED")).unwrap_or_default();
        assert!(headline.contains("): rank 3 exited with code 0 at "), "node {node}:\n{}", done.stderr);
        assert!(!done.stderr.contains("timed out"), "node {node}:\n{}", done.stderr);
    }
}

/// A launcher whose stdout the test reads as it comes, or never (a console that does
/// not read); killed if the test fails before it ends.
struct Watched {
    child: Child,
    stdout: Arc<Mutex<Vec<u8>>>,
    /// The read end of an stdout nobody reads, kept open until the launcher ends.
    unread: Option<ChildStdout>,
    stderr: Option<thread::JoinHandle<String>>,
}

fn start(args: &[&str], script: &str, dir: &Path, env: &[(&str, &str)], read_stdout: bool) -> Watched {
    let mut cmd = launcher(args);
    cmd.env_remove("PYTHONUNBUFFERED");
    cmd.arg("--").args(["sh", "-c", script]);
    cmd.env("RP", BIN).env("DIR", dir).envs(env.iter().copied());
    cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("start the launcher");
    let mut out = child.stdout.take().expect("piped");
    let mut err = child.stderr.take().expect("piped");
    let stdout = Arc::new(Mutex::new(Vec::new()));
    let unread = if read_stdout {
        let sink = Arc::clone(&stdout);
        thread::spawn(move || {
            let mut buf = [0u8; 8192];
            while let Ok(n @ 1..) = out.read(&mut buf) {
                sink.lock().expect("stdout buffer").extend_from_slice(&buf[..n]);
            }
        });
        None
    } else {
        Some(out)
    };
    let stderr = thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    Watched { child, stdout, unread, stderr: Some(stderr) }
}

impl Watched {
    fn stdout_text(&self) -> String {
        String::from_utf8_lossy(&self.stdout.lock().expect("stdout buffer")).into_owned()
    }

    /// Waits (bounded) until the console shows `needle`.
    fn wait_stdout(&self, needle: &str) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !self.stdout_text().contains(needle) {
            assert!(Instant::now() < deadline, "{needle:?} never appeared on the console:\n{:?}", self.stdout_text());
            thread::sleep(Duration::from_millis(10));
        }
    }

    fn finish(mut self) -> Finished {
        let status = wait_bounded(&mut self.child);
        self.unread = None;
        let stderr = self.stderr.take().map(|h| h.join().unwrap_or_default()).unwrap_or_default();
        // The reader thread ends at EOF, soon after the launcher.
        thread::sleep(Duration::from_millis(50));
        let stdout = self.stdout_text();
        let status = status.unwrap_or_else(|stacks| {
            panic!("the launcher ran past {LIMIT:?}\nstdout:\n{stdout}\nstderr:\n{stderr}\nits stacks then:\n{stacks}")
        });
        Finished { code: status.code(), stdout, stderr }
    }
}

impl Drop for Watched {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Waits (bounded) until none of `pids` is alive.
fn wait_gone(pids: &[String], what: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while let Some(pid) = pids.iter().find(|p| alive(p)) {
        if Instant::now() > deadline {
            for p in pids {
                signal(p.parse().unwrap_or(0), libc::SIGKILL);
            }
            panic!("{what}: process {pid} survived (all of {pids:?} killed now)");
        }
        thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_console_that_does_not_read_stalls_neither_the_coordinator_nor_the_teardown() {
    let dir = temp_dir("stuckconsole");
    // More output than the pipe and the launcher's console buffer hold, from more ranks
    // than the launcher has runtime threads; then the workers need the coordinator.
    let script = r#"
        seq 1 300000
        "$RP" barrier flooded --timeout 30 || exit 9
        echo $$ > "$DIR/p$RANK.tmp" && mv "$DIR/p$RANK.tmp" "$DIR/passed$RANK"
        exec sleep 60
    "#;
    let launched = start(&["--nproc-per-node", "4", "--grace", "2"], script, &dir, &[], false);
    let names: Vec<String> = (0..4).map(|r| format!("passed{r}")).collect();
    let pids = wait_for_files(&dir, &names);
    signal(launched.child.id() as i32, libc::SIGTERM);
    let done = launched.finish();
    assert_eq!(done.code, Some(128 + libc::SIGTERM), "stderr:\n{}", done.stderr);
    assert!(done.stderr.contains("received SIGTERM"), "{}", done.stderr);
    let dropped = done.stderr.lines().find(|l| l.contains("dropped: console not reading")).unwrap_or_default();
    assert!(dropped.starts_with("rallypoint: ") && dropped.contains(" lines of rank "), "{}", done.stderr);
    wait_gone(&pids, "a worker of a launcher stopped with SIGTERM");
}

#[test]
fn log_files_are_byte_exact_copies_of_what_workers_wrote() {
    let dir = temp_dir("exactlogs");
    // Binary noise (NULs, lone carriage returns, invalid UTF-8), a 200 kB line, and no
    // newline at the end.
    let script = r#"
        { head -c 100000 /dev/urandom; head -c 200000 /dev/zero | tr '\0' x; printf '\nprogress\rend'; } > "$DIR/expect$RANK"
        cat "$DIR/expect$RANK"
        cat "$DIR/expect$RANK" >&2
    "#;
    for tee in [false, true] {
        let logs = dir.join(format!("logs-tee-{tee}"));
        let logs_arg = logs.to_str().expect("utf-8 path");
        let mut args = vec!["--nproc-per-node", "2", "--log-dir", logs_arg];
        if tee {
            args.push("--tee");
        }
        let done = start(&args, script, &dir, &[], true).finish();
        assert_eq!(done.code, Some(0), "stderr:\n{}", done.stderr);
        for rank in 0..2 {
            let expected = std::fs::read(dir.join(format!("expect{rank}"))).expect("the worker's own copy");
            for stream in ["stdout", "stderr"] {
                let path = logs.join("attempt1").join(format!("rank{rank}.{stream}"));
                let got = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
                assert!(
                    got == expected,
                    "{} differs from what rank {rank} wrote ({} bytes, expected {})",
                    path.display(),
                    got.len(),
                    expected.len()
                );
            }
        }
        if tee {
            assert!(done.stdout.contains("[rank1]: progress\r"), "the console shows the output too");
        }
    }
}

#[test]
fn output_is_shown_as_written_python_unbuffered_and_progress_lines_as_they_change() {
    let dir = temp_dir("live");
    let have_python = Command::new("python3").arg("--version").output().is_ok_and(|o| o.status.success());
    // Each step waits until the test saw the previous one on the console.
    let script = r#"
        seen() { i=0; while [ ! -f "$DIR/seen$1" ]; do i=$((i+1)); [ $i -gt 400 ] && exit 8; sleep 0.05; done; }
        printf 'loading 1/2\r'; seen 1
        printf 'loading 2/2\r'; seen 2
        if [ "$HAVE_PYTHON" = 1 ]; then
            python3 -c 'print("python says hi")
import os, time
for _ in range(400):
    if os.path.exists(os.environ["DIR"] + "/seen3"): break
    time.sleep(0.05)
else:
    raise SystemExit(8)'
        fi
        echo "done, PYTHONUNBUFFERED=$PYTHONUNBUFFERED"
    "#;
    let env = [("HAVE_PYTHON", if have_python { "1" } else { "0" })];
    let launched = start(&[], script, &dir, &env, true);
    launched.wait_stdout("[rank0]: loading 1/2\r");
    std::fs::write(dir.join("seen1"), "").expect("seen1");
    launched.wait_stdout("[rank0]: loading 2/2\r");
    std::fs::write(dir.join("seen2"), "").expect("seen2");
    if have_python {
        launched.wait_stdout("[rank0]: python says hi\n");
        std::fs::write(dir.join("seen3"), "").expect("seen3");
    } else {
        eprintln!("python3 not found: the Python part of this test did not run");
    }
    let done = launched.finish();
    assert_eq!(done.code, Some(0), "stderr:\n{}", done.stderr);
    assert!(done.stdout.contains("[rank0]: done, PYTHONUNBUFFERED=1\n"), "{:?}", done.stdout);

    // A user's own setting is kept.
    let done = start(&[], r#"echo "u=$PYTHONUNBUFFERED""#, &dir, &[("PYTHONUNBUFFERED", "")], true).finish();
    assert_eq!(done.stdout, "[rank0]: u=\n", "stderr:\n{}", done.stderr);
}

#[test]
fn progress_lines_of_one_rank_never_split_another_ranks_lines() {
    let dir = temp_dir("interleave");
    let script = r#"
        k=1
        while [ $k -le 30 ]; do
            if [ "$RANK" = 0 ]; then printf '\rstep %d of 30' $k; else echo "line $k of 30"; fi
            k=$((k+1)); sleep 0.01
        done
        [ "$RANK" = 0 ] && echo
        true
    "#;
    let done = start(&["--nproc-per-node", "2"], script, &dir, &[], true).finish();
    assert_eq!(done.code, Some(0), "stderr:\n{}", done.stderr);
    let mut steps = 0;
    let mut lines = 0;
    for piece in done.stdout.split(['\n', '\r']).filter(|p| !p.is_empty()) {
        let body = piece.strip_prefix("[rank0]: step ").or_else(|| piece.strip_prefix("[rank1]: line "));
        let whole = body.is_some_and(|b| b.ends_with(" of 30") && b.trim_end_matches(" of 30").parse::<u32>().is_ok());
        assert!(whole, "a piece of the console mixes ranks or lacks its prefix: {piece:?}\n{:?}", done.stdout);
        if piece.starts_with("[rank0]") {
            steps += 1;
        } else {
            lines += 1;
        }
    }
    assert_eq!(lines, 30, "{:?}", done.stdout);
    assert!(steps >= 1 && done.stdout.contains("[rank0]: step 30 of 30"), "{:?}", done.stdout);
}

/// A worker as a wrapper script: a grandchild in its group, one in a session of its
/// own (setsid), and an orphan whose parent exited; their pids in files.
const FAMILY: &str = r#"
    sleep 300 & echo $! > "$DIR/child$RANK.tmp"; mv "$DIR/child$RANK.tmp" "$DIR/child$RANK"
    setsid sleep 300 & echo $! > "$DIR/setsid$RANK.tmp"; mv "$DIR/setsid$RANK.tmp" "$DIR/setsid$RANK"
    sh -c 'sleep 300 & echo $! > "$DIR/orphan$RANK.tmp"; mv "$DIR/orphan$RANK.tmp" "$DIR/orphan$RANK"'
    echo $$ > "$DIR/worker$RANK.tmp"; mv "$DIR/worker$RANK.tmp" "$DIR/worker$RANK"
"#;

fn family_pids(dir: &Path, ranks: u32) -> Vec<String> {
    let names: Vec<String> =
        (0..ranks).flat_map(|r| ["child", "setsid", "orphan", "worker"].map(|n| format!("{n}{r}"))).collect();
    wait_for_files(dir, &names)
}

#[test]
fn nothing_a_worker_started_outlives_a_launcher_killed_with_sigkill() {
    let dir = temp_dir("sigkillfamily");
    let script = format!("{FAMILY}\nwait");
    let launched = start(&["--nproc-per-node", "2"], &script, &dir, &[], true);
    let pids = family_pids(&dir, 2);
    signal(launched.child.id() as i32, libc::SIGKILL);
    let _ = launched.finish();
    wait_gone(&pids, "after the launcher was killed with SIGKILL");
}

#[test]
fn processes_that_left_their_workers_group_end_with_the_job() {
    let dir = temp_dir("escapees");
    // The workers succeed, leaving their family behind.
    let done = start(&["--nproc-per-node", "2"], FAMILY, &dir, &[], true).finish();
    assert_eq!(done.code, Some(0), "stderr:\n{}", done.stderr);
    wait_gone(&family_pids(&dir, 2), "after the job ended");
}

/// Waits (bounded) until rank `rank`'s process `pid` is connected to the coordinator
/// at `addr`, asking the coordinator itself: a barrier of this rank and `prober`
/// names it, with its pid, as connected but not arrived when it times out. The
/// probe proves the job's token, given as the variable `token` (name, value).
fn wait_connected(addr: &str, world: u32, prober: u32, rank: u32, pid: &str, token: (&str, &str)) {
    let deadline = Instant::now() + Duration::from_secs(20);
    let ranks = format!("{prober},{rank}");
    let world = world.to_string();
    let prober = prober.to_string();
    for probe in 0.. {
        let out = Command::new(BIN)
            .args(["barrier", &format!("probe{probe}"), "--ranks", &ranks, "--timeout", "0.3", "--addr", addr])
            .args(["--job", "default", "--rank", &prober, "--world-size", &world])
            .env(token.0, token.1)
            .output()
            .expect("run the probe");
        let stderr = String::from_utf8_lossy(&out.stderr);
        if stderr.contains(&format!("pid {pid}, connected")) {
            return;
        }
        assert!(Instant::now() < deadline, "rank {rank} (pid {pid}) never connected: {stderr}");
    }
}

#[test]
fn a_stopped_rank_is_named_as_the_root_cause_not_the_peers_that_failed_for_it() {
    let dir = temp_dir("stopped");
    let script = r#"
        if [ "$RANK" = 1 ]; then
            echo "$RALLYPOINT_TOKEN_FILE" > "$DIR/token.tmp" && mv "$DIR/token.tmp" "$DIR/tokenfile"
            echo "$RALLYPOINT_ADDR" > "$DIR/addr.tmp" && mv "$DIR/addr.tmp" "$DIR/addr"
            echo $$ > "$DIR/pid.tmp" && mv "$DIR/pid.tmp" "$DIR/pid1"
            # Holds rank 1 (key-value verbs connect without a rank): a barrier rank 0 never joins.
            exec "$RP" barrier hold --ranks 0,1 --timeout 60
        fi
        i=0; while [ ! -f "$DIR/stopped" ]; do i=$((i+1)); [ $i -gt 400 ] && exit 8; sleep 0.05; done
        "$RP" barrier step --timeout 60 || exit $?
    "#;
    let launched = start(&["--nproc-per-node", "3", "--lease", "2", "--grace", "1"], script, &dir, &[], true);
    let found = wait_for_files(&dir, &["addr".into(), "pid1".into(), "tokenfile".into()]);
    let (addr, pid) = (&found[0], &found[1]);
    wait_connected(addr, 3, 0, 1, pid, ("RALLYPOINT_TOKEN_FILE", &found[2]));
    signal(pid.parse().expect("pid"), libc::SIGSTOP);
    std::fs::write(dir.join("stopped"), "").expect("stopped");
    let done = launched.finish();
    assert_eq!(done.code, Some(4), "the peers' code (peer lost); stderr:\n{}", done.stderr);
    let first = messages(&done.stderr).find(|l| l.starts_with("rallypoint: job ")).unwrap_or_default();
    assert!(first.contains("FAILED (attempt 1 of 1): rank 1 stopped heartbeating at "), "{}", done.stderr);
    assert!(first.contains("(process alive, state T (stopped))"), "{}", done.stderr);
    assert!(done.stderr.contains("  rank 1 (local rank 1, node 0, host "), "{}", done.stderr);
    assert!(done.stderr.contains(&format!(", pid {pid}) stopped heartbeating at ")), "{}", done.stderr);
    peers_failed_for(&done.stderr, [0, 2], "rank 1 was lost");
    assert!(!done.stderr.contains("after rank 0 failed") && !done.stderr.contains("after rank 2 failed"));
}

#[test]
fn a_stopped_rank_on_another_node_is_named_on_both_nodes() {
    let dir = temp_dir("stoppedremote");
    let master = format!("127.0.0.1:{}", free_port());
    let script = r#"
        if [ "$RANK" = 3 ]; then
            echo $$ > "$DIR/pid.tmp" && mv "$DIR/pid.tmp" "$DIR/pid3"
            # Holds rank 3 (key-value verbs connect without a rank): a barrier rank 0 never joins.
            exec "$RP" barrier hold --ranks 0,3 --timeout 60
        fi
        i=0; while [ ! -f "$DIR/stopped" ]; do i=$((i+1)); [ $i -gt 400 ] && exit 8; sleep 0.05; done
        "$RP" barrier step --timeout 60 || exit $?
    "#;
    let common =
        ["--nnodes", "2", "--nproc-per-node", "2", "--master", master.as_str(), "--lease", "2", "--grace", "1"];
    let node0 = start(&[&common[..], &["--node-rank", "0"]].concat(), script, &dir, &[], true);
    let node1 = start(&[&common[..], &["--node-rank", "1"]].concat(), script, &dir, &[], true);
    let pid = wait_for_files(&dir, &["pid3".into()]).remove(0);
    wait_connected(&master, 4, 0, 3, &pid, ("RALLYPOINT_TOKEN", SHARED_TOKEN));
    signal(pid.parse().expect("pid"), libc::SIGSTOP);
    std::fs::write(dir.join("stopped"), "").expect("stopped");
    let (n0, n1) = (node0.finish(), node1.finish());
    for (node, done) in [(0, &n0), (1, &n1)] {
        assert_eq!(done.code, Some(4), "node {node} stderr:\n{}", done.stderr);
        let first = messages(&done.stderr).find(|l| l.starts_with("rallypoint: job ")).unwrap_or_default();
        assert!(first.contains("rank 3 stopped heartbeating at "), "node {node}:\n{}", done.stderr);
        assert!(done.stderr.contains(&format!("pid {pid}) stopped heartbeating")), "node {node}:\n{}", done.stderr);
    }
    assert!(n1.stderr.contains("(process alive, state T (stopped))"), "node 1 sees the process:\n{}", n1.stderr);
    assert!(n0.stderr.contains("  rank 3 (local rank 1, node 1, host "), "{}", n0.stderr);
}

#[test]
fn a_rank_whose_connection_dropped_while_its_worker_lives_is_named() {
    let dir = temp_dir("dropped");
    // Rank 1's worker is a wrapper whose client process dies; the wrapper lives on.
    let script = r#"
        if [ "$RANK" = 1 ]; then
            echo "$RALLYPOINT_TOKEN_FILE" > "$DIR/token.tmp" && mv "$DIR/token.tmp" "$DIR/tokenfile"
            echo "$RALLYPOINT_ADDR" > "$DIR/addr.tmp" && mv "$DIR/addr.tmp" "$DIR/addr"
            "$RP" barrier hold --ranks 0,1 --timeout 60 &
            echo $! > "$DIR/pid.tmp" && mv "$DIR/pid.tmp" "$DIR/client1"
            wait
            exec sleep 30
        fi
        i=0; while [ ! -f "$DIR/killed" ]; do i=$((i+1)); [ $i -gt 400 ] && exit 8; sleep 0.05; done
        "$RP" barrier step --timeout 60 || exit $?
    "#;
    let launched = start(&["--nproc-per-node", "3", "--grace", "1"], script, &dir, &[], true);
    let found = wait_for_files(&dir, &["addr".into(), "client1".into(), "tokenfile".into()]);
    let (addr, client) = (&found[0], &found[1]);
    wait_connected(addr, 3, 0, 1, client, ("RALLYPOINT_TOKEN_FILE", &found[2]));
    signal(client.parse().expect("pid"), libc::SIGKILL);
    std::fs::write(dir.join("killed"), "").expect("killed");
    let done = launched.finish();
    assert_eq!(done.code, Some(4), "stderr:\n{}", done.stderr);
    let first = messages(&done.stderr).find(|l| l.starts_with("rallypoint: job ")).unwrap_or_default();
    assert!(first.contains("): rank 1 dropped its connection without a clean leave at "), "{}", done.stderr);
    assert!(first.contains("(process alive, state "), "the wrapper still ran:\n{}", done.stderr);
    peers_failed_for(&done.stderr, [0, 2], "rank 1 was lost");
}

/// Issue #14, story 4's launcher half: a launched job is authenticated with no
/// configuration. Its workers find the token in a private file (not in their
/// environment), a process without it is refused (exit 9), and the file is gone
/// once the launcher is.
#[test]
fn a_launched_job_is_authenticated_with_no_configuration() {
    let dir = temp_dir("token");
    let script = r#"
        echo "$RALLYPOINT_TOKEN_FILE" > "$DIR/t.tmp" && mv "$DIR/t.tmp" "$DIR/tokenfile"
        { stat -c %a "$RALLYPOINT_TOKEN_FILE"; stat -c %a "$(dirname "$RALLYPOINT_TOKEN_FILE")"; echo "[$RALLYPOINT_TOKEN]"; } > "$DIR/m.tmp"
        mv "$DIR/m.tmp" "$DIR/modes"
        "$RP" set secret 42 || exit 3
        echo "$RALLYPOINT_ADDR" > "$DIR/a.tmp" && mv "$DIR/a.tmp" "$DIR/addr"
        i=0; while [ ! -f "$DIR/probed" ]; do i=$((i+1)); [ $i -gt 400 ] && exit 8; sleep 0.05; done
    "#;
    let launched = launch(&["--nproc-per-node", "1"], script, &dir);
    let found = wait_for_files(&dir, &["tokenfile".into(), "addr".into()]);
    let (token_file, addr) = (&found[0], &found[1]);
    let modes = std::fs::read_to_string(dir.join("modes")).expect("modes");
    assert_eq!(modes.lines().collect::<Vec<_>>(), ["600", "700", "[]"], "file, directory, token variable");

    let get = |env: &[(&str, &str)]| {
        let mut cmd = Command::new(BIN);
        for var in SCRUB {
            cmd.env_remove(var);
        }
        cmd.args(["get", "secret", "--addr", addr, "--timeout", "10"]).envs(env.iter().copied());
        cmd.output().expect("run get")
    };
    let refused = get(&[]);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(9), "stderr: {stderr}");
    assert!(
        stderr.contains("requires a token: set RALLYPOINT_TOKEN or RALLYPOINT_TOKEN_FILE (or --token-file)"),
        "{stderr}"
    );
    let wrong = get(&[("RALLYPOINT_TOKEN", "not-the-job-token")]);
    let stderr = String::from_utf8_lossy(&wrong.stderr);
    assert_eq!(wrong.status.code(), Some(9), "stderr: {stderr}");
    assert!(stderr.contains("wrong token") && stderr.contains("--token-file"), "{stderr}");
    let allowed = get(&[("RALLYPOINT_TOKEN_FILE", token_file.as_str())]);
    assert_eq!(String::from_utf8_lossy(&allowed.stdout), "42\n", "{}", String::from_utf8_lossy(&allowed.stderr));

    std::fs::write(dir.join("probed"), "").expect("probed");
    let done = launched.finish();
    assert_eq!(done.code, Some(0), "stderr:\n{}", done.stderr);
    assert!(!Path::new(token_file).exists(), "the token file outlived the launcher");
}

#[test]
fn a_master_beyond_loopback_or_several_nodes_need_a_shared_token_or_insecure() {
    let dir = temp_dir("exposed");
    // Refused before anything is bound or started.
    let done = launch(&["--master", "0.0.0.0:29400"], "true", &dir).finish();
    assert_eq!(done.code, Some(2), "stderr:\n{}", done.stderr);
    assert!(done.stderr.contains("listens beyond this machine"), "{}", done.stderr);
    assert!(done.stderr.contains("--token-file") && done.stderr.contains("--insecure"), "{}", done.stderr);
    let no_token = [("RALLYPOINT_TOKEN", "")];
    let args = ["--nnodes", "2", "--node-rank", "1", "--master", "127.0.0.1:1"];
    let done = start(&args, "true", &dir, &no_token, false).finish();
    assert_eq!(done.code, Some(2), "stderr:\n{}", done.stderr);
    assert!(done.stderr.contains("needs a token that all of its launchers share"), "{}", done.stderr);
    // --insecure: no token at all, so nothing to hand to the workers.
    let script = r#"echo "[$RALLYPOINT_TOKEN_FILE]" > "$DIR/t.tmp" && mv "$DIR/t.tmp" "$DIR/tokenfile"; "$RP" set k v"#;
    let done = launch(&["--insecure"], script, &dir).finish();
    assert_eq!(done.code, Some(0), "stderr:\n{}", done.stderr);
    assert_eq!(wait_for_files(&dir, &["tokenfile".into()]), ["[]"]);
}

/// Runs `rallypoint launch ARGS` (the worker command included) to its end.
fn launch_argv(args: &[&str], dir: &Path, env: &[(&str, &str)]) -> Finished {
    let mut cmd = launcher(args);
    cmd.env("RP", BIN).env("DIR", dir).envs(env.iter().copied()).current_dir(dir);
    cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let child = cmd.spawn().expect("start the launcher");
    let out = wait_output(child);
    Finished { code: out.status.code(), stdout: out.stdout, stderr: out.stderr }
}

struct Output {
    status: std::process::ExitStatus,
    stdout: String,
    stderr: String,
}

/// Waits (bounded by LIMIT) for a child whose stdout and stderr are piped.
fn wait_output(mut child: Child) -> Output {
    let mut out = child.stdout.take().expect("piped");
    let mut err = child.stderr.take().expect("piped");
    let stdout = thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let stderr = thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let deadline = Instant::now() + LIMIT;
    let status = loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            break Some(status);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        thread::sleep(Duration::from_millis(20));
    };
    let stdout = stdout.join().unwrap_or_default();
    let stderr = stderr.join().unwrap_or_default();
    let status = status.unwrap_or_else(|| panic!("ran past {LIMIT:?}\nstdout:\n{stdout}\nstderr:\n{stderr}"));
    Output { status, stdout, stderr }
}

#[test]
fn a_command_that_cannot_start_is_reported_as_such() {
    let dir = temp_dir("nostart");
    let done = launch_argv(&["--nproc-per-node", "2", "--", "python3x-no-such-command", "a.py"], &dir, &[]);
    assert_eq!(done.code, Some(127), "as a shell reports a missing command:\n{}", done.stderr);
    let first = messages(&done.stderr).find(|l| l.starts_with("rallypoint: job ")).unwrap_or_default();
    assert!(
        first.ends_with("rank 0 could not start: python3x-no-such-command: No such file or directory"),
        "{}",
        done.stderr
    );
    assert!(!done.stderr.contains("code 127"), "{}", done.stderr);
    // Found but not executable: 126, as a shell says.
    std::fs::write(dir.join("not-executable"), "#!/bin/sh\n").expect("write");
    let done = launch_argv(&["--", "./not-executable"], &dir, &[]);
    assert_eq!(done.code, Some(126), "{}", done.stderr);
    assert!(done.stderr.contains("rank 0 could not start: ./not-executable: Permission denied"), "{}", done.stderr);
}

#[test]
fn log_dir_runs_say_where_the_logs_are_and_attempts_count_like_their_folders() {
    let dir = temp_dir("logsay");
    let logs = dir.join("logs");
    let logs_arg = logs.to_str().expect("utf-8 path");
    let done = launch(&["--nproc-per-node", "2", "--log-dir", logs_arg], "echo hi $RANK", &dir).finish();
    assert_eq!(done.code, Some(0), "{}", done.stderr);
    let attempt1 = logs.join("attempt1");
    let expected = format!(
        "rallypoint: job 'default' succeeded (attempt 1 of 1): ranks 0-1 on this node exited with code 0; \
         their logs are in {}",
        attempt1.display()
    );
    assert!(done.stderr.lines().any(|l| l == expected), "{expected:?} in\n{}", done.stderr);
    assert_eq!(std::fs::read_to_string(attempt1.join("rank1.stdout")).ok().as_deref(), Some("hi 1\n"));

    // The first attempt fails, the second succeeds: folders and messages agree.
    let script = r#"[ "$TORCHELASTIC_RESTART_COUNT" = 0 ] && [ "$RANK" = 0 ] && exit 3; echo "attempt $TORCHELASTIC_RESTART_COUNT""#;
    let done = launch(&["--log-dir", logs_arg, "--max-restarts", "1", "--job", "again"], script, &dir).finish();
    assert_eq!(done.code, Some(0), "{}", done.stderr);
    assert!(
        done.stderr.contains("rallypoint: job 'again' attempt 1 of 2 failed (rank 0 exited with code 3)"),
        "{}",
        done.stderr
    );
    assert!(
        done.stderr.contains(&format!("logs of this node's ranks: {}\n", logs.join("attempt1").display())),
        "the failed attempt's summary says where its logs are:\n{}",
        done.stderr
    );
    assert!(done.stderr.contains("succeeded (attempt 2 of 2)"), "{}", done.stderr);
    assert_eq!(std::fs::read_to_string(logs.join("attempt2/rank0.stdout")).ok().as_deref(), Some("attempt 1\n"));
    // Without --log-dir a success is said all the same, with no logs to point at.
    let done = launch(&[], "true", &dir).finish();
    let last = done.stderr.lines().last().unwrap_or_default();
    assert_eq!(last, "rallypoint: job 'default' succeeded (attempt 1 of 1): rank 0 on this node exited with code 0");
}

/// `rallypoint ARGS` with the test's environment scrubbed, plus `env`.
fn verb(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(BIN);
    for var in SCRUB {
        cmd.env_remove(var);
    }
    cmd.args(args).envs(env.iter().copied()).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    wait_output(cmd.spawn().expect("start rallypoint"))
}

#[test]
fn the_launcher_says_where_its_coordinator_is_and_status_finds_it() {
    let dir = temp_dir("discover");
    let run_dir = dir.join("run");
    std::fs::create_dir_all(&run_dir).expect("runtime dir");
    let xdg = run_dir.to_str().expect("utf-8 path");
    let env = [("XDG_RUNTIME_DIR", xdg)];
    let script = r#"
        echo "$RALLYPOINT_COORDINATOR $RALLYPOINT_TOKEN_FILE" > "$DIR/coord.$RALLYPOINT_JOB.tmp" && mv "$DIR/coord.$RALLYPOINT_JOB.tmp" "$DIR/coord.$RALLYPOINT_JOB"
        "$RP" get go --timeout 30 >/dev/null
    "#;
    let first = start(&["--nproc-per-node", "2", "--job", "first"], script, &dir, &env, true);
    let found = wait_for_files(&dir, &["coord.first".into()]).remove(0);
    let coordinator = found.split(' ').next().unwrap_or_default().to_owned();
    // The workers wait for key 'go'; `status` with no address finds their launcher.
    let status = verb(&["status"], &env);
    assert_eq!(status.status.code(), Some(0), "{}", status.stderr);
    assert!(status.stdout.starts_with("job 'first'\n"), "{}", status.stdout);
    assert!(status.stdout.contains(&format!("coordinator {coordinator} holds ")), "{}", status.stdout);

    // A second launcher: status asks which one.
    let second = start(&["--job", "second"], script, &dir, &env, true);
    wait_for_files(&dir, &["coord.second".into()]);
    let status = verb(&["status"], &env);
    assert_eq!(status.status.code(), Some(2), "{}", status.stderr);
    assert!(status.stderr.contains("2 `rallypoint launch` of this user run on this machine; pick one with --job"));
    assert!(status.stderr.contains("--job first  (coordinator ") && status.stderr.contains("--job second  ("));
    let status = verb(&["status", "--job", "second"], &env);
    assert_eq!(status.status.code(), Some(0), "{}", status.stderr);
    assert!(status.stdout.starts_with("job 'second'\n"), "{}", status.stdout);

    // A launcher whose workers never connect: its job is shown, and why it is empty.
    let idle_script = r#"
        echo "$RALLYPOINT_COORDINATOR $RALLYPOINT_TOKEN_FILE" > "$DIR/coord.$RALLYPOINT_JOB.tmp" && mv "$DIR/coord.$RALLYPOINT_JOB.tmp" "$DIR/coord.$RALLYPOINT_JOB"
        for i in $(seq 600); do [ -e "$DIR/stop.idle" ] && break; sleep 0.1; done
    "#;
    let idle = start(&["--job", "idle"], idle_script, &dir, &env, true);
    wait_for_files(&dir, &["coord.idle".into()]);
    let status = verb(&["status", "--job", "idle"], &env);
    assert_eq!(status.status.code(), Some(0), "{}", status.stderr);
    assert!(
        status.stdout.contains("no process of job 'idle' has connected to the coordinator: its launchers run it"),
        "{}",
        status.stdout
    );
    assert!(status.stdout.contains("(`rallypoint status --stacks` shows what they run)"), "{}", status.stdout);
    // Asked for the stacks, it shows them rather than pointing to itself.
    let stacks = verb(&["status", "--job", "idle", "--stacks"], &env);
    assert_eq!(stacks.status.code(), Some(0), "{}", stacks.stderr);
    assert!(stacks.stdout.contains("has connected to the coordinator"), "{}", stacks.stdout);
    assert!(!stacks.stdout.contains("shows what they run"), "{}", stacks.stdout);
    std::fs::write(dir.join("stop.idle"), b"").expect("stop the idle worker");
    assert_eq!(idle.finish().code, Some(0));
    std::fs::remove_file(dir.join("coord.idle")).expect("the idle launcher's file");
    // Once the first's workers are connected (waiting for 'go'), no such line.
    let connected = (0..100).any(|_| {
        let status = verb(&["status", "--job", "first"], &env);
        let waiting = status.stdout.contains("has connected to the coordinator");
        if waiting {
            thread::sleep(Duration::from_millis(100));
        }
        !waiting
    });
    assert!(connected, "status of a job whose workers are connected says none is");

    // Let the workers go; the launchers end and leave no file behind.
    for (job, launched) in [("first", first), ("second", second)] {
        let found = std::fs::read_to_string(dir.join(format!("coord.{job}"))).expect("coordinator");
        let (addr, token_file) = found.trim().split_once(' ').expect("address and token file");
        // The command the launcher's first line gives works as given: status finds the
        // token the launcher made for its job.
        let inspect = verb(&["status", "--addr", addr, "--job", job], &env);
        assert_eq!(inspect.status.code(), Some(0), "{}", inspect.stderr);
        assert!(inspect.stdout.starts_with(&format!("job '{job}'\n")), "{}", inspect.stdout);
        let go = verb(&["set", "go", "1", "--addr", addr, "--job", job], &[("RALLYPOINT_TOKEN_FILE", token_file)]);
        assert_eq!(go.status.code(), Some(0), "{}", go.stderr);
        let done = launched.finish();
        assert_eq!(done.code, Some(0), "{}", done.stderr);
        let line = done.stderr.lines().next().unwrap_or_default();
        assert!(line.starts_with("rallypoint: job '"), "the first line says where the coordinator is: {line:?}");
        assert!(line.contains(": coordinator at 127.0.0.1:") && line.contains("(hosted by this launcher)"), "{line}");
        let addr = line.split("coordinator at ").nth(1).and_then(|r| r.split(' ').next()).unwrap_or_default();
        assert!(
            line.ends_with(&format!("inspect it with: rallypoint status --addr {addr} --job first"))
                || line.ends_with(&format!("inspect it with: rallypoint status --addr {addr} --job second")),
            "{line}"
        );
    }
    let left: Vec<_> = std::fs::read_dir(run_dir.join("rallypoint")).expect("discovery dir").flatten().collect();
    assert!(left.is_empty(), "launchers left files behind: {left:?}");
    let status = verb(&["status"], &env);
    assert_eq!(status.status.code(), Some(2));
    assert!(status.stderr.contains("no `rallypoint launch` of this user runs on this machine"), "{}", status.stderr);
}

/// A launcher whose stderr the test can read while it runs.
struct Live {
    child: Child,
    stderr: Arc<Mutex<String>>,
    stdout: thread::JoinHandle<String>,
}

fn live(args: &[&str], script: &str, dir: &Path) -> Live {
    let mut cmd = launcher(args);
    cmd.arg("--").args(["sh", "-c", script]);
    cmd.env("RP", BIN).env("DIR", dir).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("start the launcher");
    let mut out = child.stdout.take().expect("piped");
    let mut err = child.stderr.take().expect("piped");
    let stderr = Arc::new(Mutex::new(String::new()));
    let sink = Arc::clone(&stderr);
    thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n @ 1..) = err.read(&mut buf) {
            sink.lock().expect("stderr buffer").push_str(&String::from_utf8_lossy(&buf[..n]));
        }
    });
    let stdout = thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    Live { child, stderr, stdout }
}

impl Live {
    fn wait_stderr(&self, needle: &str) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let text = self.stderr.lock().expect("stderr buffer").clone();
            if text.contains(needle) {
                return;
            }
            assert!(Instant::now() < deadline, "{needle:?} never appeared on stderr:\n{text}");
            thread::sleep(Duration::from_millis(20));
        }
    }

    fn finish(mut self) -> Finished {
        let status = wait_bounded(&mut self.child);
        let stdout = self.stdout.join().unwrap_or_default();
        thread::sleep(Duration::from_millis(50));
        let stderr = self.stderr.lock().expect("stderr buffer").clone();
        let status = status.unwrap_or_else(|stacks| {
            panic!("ran past {LIMIT:?}\nstdout:\n{stdout}\nstderr:\n{stderr}\nits stacks then:\n{stacks}")
        });
        Finished { code: status.code(), stdout, stderr }
    }
}

#[test]
fn a_launcher_waiting_for_other_nodes_says_which_are_missing() {
    let dir = temp_dir("waitnodes");
    let master = format!("127.0.0.1:{}", free_port());
    let common = ["--nnodes", "3", "--master", master.as_str(), "--job", "late"];
    let node0 = live(&[&common[..], &["--node-rank", "0"]].concat(), "echo rank $RANK", &dir);
    node0.wait_stderr("rallypoint: waiting for nodes 1, 2 of 3 (");
    let node2 = live(&[&common[..], &["--node-rank", "2"]].concat(), "echo rank $RANK", &dir);
    node0.wait_stderr("rallypoint: waiting for node 1 of 3 (");
    let node1 = launch(&[&common[..], &["--node-rank", "1"]].concat(), "echo rank $RANK", &dir);
    let (n0, n1, n2) = (node0.finish(), node1.finish(), node2.finish());
    for (n, done) in [(0, &n0), (1, &n1), (2, &n2)] {
        assert_eq!(done.code, Some(0), "node {n}:\n{}", done.stderr);
        assert!(done.stdout.contains(&format!("[rank{n}]: rank {n}")), "node {n}:\n{}", done.stdout);
    }
    let line = n0.stderr.lines().find(|l| l.starts_with("rallypoint: waiting for node 1 of 3 (")).unwrap_or_default();
    assert!(line.ends_with(" s of 300 s)"), "{line}");
}

#[test]
fn nodes_started_with_different_nnodes_are_told_so() {
    let dir = temp_dir("nnodesdiff");
    let master = format!("127.0.0.1:{}", free_port());
    let node0 = launch(&["--nnodes", "2", "--node-rank", "0", "--master", &master, "--job", "j"], "true", &dir);
    let node1 = launch(&["--nnodes", "3", "--node-rank", "1", "--master", &master, "--job", "j"], "true", &dir);
    let (n0, n1) = (node0.finish(), node1.finish());
    assert_eq!(n0.code, Some(2), "{}", n0.stderr);
    assert_eq!(n1.code, Some(2), "{}", n1.stderr);
    assert!(
        n0.stderr.contains("rallypoint: node 1 (host ") && n0.stderr.contains(
            ") was started with --nnodes 3, this node with --nnodes 2: every node of job 'j' must give the same --nnodes"
        ),
        "{}",
        n0.stderr
    );
    assert!(n1.stderr.contains("was started with --nnodes 2, this node with --nnodes 3"), "{}", n1.stderr);
    assert!(!n0.stderr.contains("all-gather") && !n1.stderr.contains("all-gather"), "{}{}", n0.stderr, n1.stderr);
}

/// Node 1 started alone: node 0's coordinator never answers, and the join gives up
/// at its timeout (exit 3), saying so.
#[test]
fn a_node_whose_node_0_never_comes_gives_up_at_the_join_timeout() {
    let dir = temp_dir("nonode0");
    let master = format!("127.0.0.1:{}", free_port());
    let args = ["--nnodes", "2", "--master", master.as_str(), "--node-rank", "1", "--insecure", "--join-timeout", "2"];
    let run = launch(&args, "true", &dir).finish();
    assert_eq!(run.code, Some(3), "{}", run.stderr);
    let said = format!("rallypoint: gave up after 2 s (--join-timeout) waiting for node 0's coordinator at {master}");
    assert!(run.stderr.lines().any(|l| l.starts_with(&said)), "{said:?} in\n{}", run.stderr);
}

#[test]
fn nodes_started_with_different_jobs_are_told_so() {
    let dir = temp_dir("jobdiff");
    let master = format!("127.0.0.1:{}", free_port());
    let common = ["--nnodes", "2", "--master", master.as_str()];
    let node0 =
        live(&[&common[..], &["--node-rank", "0", "--job", "alpha", "--join-timeout", "8"]].concat(), "true", &dir);
    node0.wait_stderr("coordinator at");
    // Node 1 gives up first, while node 0 (and its coordinator) still wait.
    let node1 =
        launch(&[&common[..], &["--node-rank", "1", "--job", "beta", "--join-timeout", "2"]].concat(), "true", &dir);
    let n1 = node1.finish();
    let n0 = node0.finish();
    let hint = |other: &str| {
        format!("; launchers of another job wait on this coordinator ('{other}'): every node must give the same --job")
    };
    assert_eq!(n1.code, Some(3), "{}", n1.stderr);
    let expected = format!(
        "rallypoint: gave up after 2 s (--join-timeout) waiting for node 0 of 2 to join job 'beta'{}",
        hint("alpha")
    );
    assert!(n1.stderr.lines().any(|l| l == expected), "{expected:?} in\n{}", n1.stderr);
    assert_eq!(n0.code, Some(3), "{}", n0.stderr);
    let expected = format!(
        "rallypoint: gave up after 8 s (--join-timeout) waiting for node 1 of 2 to join job 'alpha'{}",
        hint("beta")
    );
    assert!(n0.stderr.lines().any(|l| l == expected), "{expected:?} in\n{}", n0.stderr);
    let waiting =
        n0.stderr.lines().find(|l| l.starts_with("rallypoint: waiting for node 1 of 2 (")).unwrap_or_default();
    assert!(waiting.ends_with(&format!(" s of 8 s){}", hint("beta"))), "{}", n0.stderr);
}

/// Node 0's launcher killed, with the coordinator it hosted: node 1 names node 0 by
/// the host its claim said, though the coordinator is gone and cannot say it.
#[test]
fn a_node_whose_launcher_and_coordinator_died_is_named_with_its_host() {
    let dir = temp_dir("node0killed");
    let master = format!("127.0.0.1:{}", free_port());
    let common = ["--nnodes", "2", "--nproc-per-node", "1", "--master", master.as_str(), "--job", "k0"];
    let script = r#""$RP" barrier a || exit $?; exec sleep 60"#;
    let node0 = live(&[&common[..], &["--node-rank", "0"]].concat(), script, &dir);
    let node1 = live(&[&common[..], &["--node-rank", "1"]].concat(), script, &dir);
    // Both nodes joined and started their worker.
    node0.wait_stderr("worker on this node");
    node1.wait_stderr("worker on this node");
    thread::sleep(Duration::from_millis(500));
    signal(node0.child.id() as i32, libc::SIGKILL);
    let n1 = node1.finish();
    let _ = node0.finish();
    let lost = n1.stderr.lines().find(|l| l.contains("node 0 (")).unwrap_or_default();
    assert!(lost.contains("was lost") && !lost.contains("node 0 (?)"), "{}", n1.stderr);
    assert!(!lost.contains("node 0 ()"), "{}", n1.stderr);
}

/// `status` while a node has not joined names the nodes that did and the one
/// awaited, not workers that never connected; `--stacks` asks no node then.
#[test]
fn status_while_a_node_has_not_joined_says_whom_the_launchers_wait_for() {
    let dir = temp_dir("joining");
    let master = format!("127.0.0.1:{}", free_port());
    let args =
        ["--nnodes", "2", "--master", master.as_str(), "--node-rank", "0", "--job", "half", "--join-timeout", "4"];
    let node0 = live(&args, "true", &dir);
    node0.wait_stderr("coordinator at");
    for stacks in [false, true] {
        let mut cmd = Command::new(BIN);
        for var in SCRUB {
            cmd.env_remove(var);
        }
        cmd.env("RALLYPOINT_TOKEN", SHARED_TOKEN).args([
            "status",
            "--addr",
            &master,
            "--job",
            "half",
            "--timeout",
            "5",
        ]);
        if stacks {
            cmd.arg("--stacks");
        }
        let out = cmd.output().expect("run status");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{out:?}");
        let pid = node0.child.id();
        let said = text.lines().any(|l| {
            l.starts_with(
                "job 'half' has not started: its launchers wait for node 1 of 2 to join (joined: node 0 on host ",
            ) && l.ends_with(&format!(", pid {pid}; job 'half/launch'), and start no worker until every node has"))
        });
        assert!(said, "stacks: {stacks}\n{text}");
        assert!(!text.contains("stacks:") && !text.contains("never connect"), "{text}");
    }
    assert_eq!(node0.finish().code, Some(3));
}

#[test]
fn two_launchers_claiming_one_node_rank_are_told_so() {
    let dir = temp_dir("samerank");
    let master = format!("127.0.0.1:{}", free_port());
    let common = ["--nnodes", "3", "--master", master.as_str(), "--join-timeout", "20"];
    let node0 = live(&[&common[..], &["--node-rank", "0"]].concat(), "true", &dir);
    node0.wait_stderr("coordinator at");
    let first = live(&[&common[..], &["--node-rank", "1"]].concat(), "true", &dir);
    first.wait_stderr("coordinator at");
    // Wait until the first one holds node 1: node 0 then misses only node 2.
    node0.wait_stderr("waiting for node 2 of 3");
    let second = launch(&[&common[..], &["--node-rank", "1"]].concat(), "true", &dir).finish();
    assert_eq!(second.code, Some(2), "{}", second.stderr);
    assert!(
        second.stderr.contains("node rank 1 of job 'default' is taken by host ")
            && second.stderr.contains("every node needs its own --node-rank"),
        "{}",
        second.stderr
    );
    // The job goes on when the real node 2 comes.
    let node2 = launch(&[&common[..], &["--node-rank", "2"]].concat(), "true", &dir);
    for done in [node0.finish(), first.finish(), node2.finish()] {
        assert_eq!(done.code, Some(0), "{}", done.stderr);
    }
}

#[test]
fn without_node_ranks_the_launcher_that_hosts_is_node_0_and_the_others_take_the_next() {
    let dir = temp_dir("autorank");
    let master = format!("127.0.0.1:{}", free_port());
    let script = r#"echo "node $GROUP_RANK rank $RANK of $WORLD_SIZE"; "$RP" barrier all --timeout 30 || exit 9"#;
    let args = ["--nnodes", "3", "--nproc-per-node", "2", "--master", master.as_str()];
    let nodes: Vec<Launched> = (0..3).map(|_| launch(&args, script, &dir)).collect();
    let done: Vec<Finished> = nodes.into_iter().map(Launched::finish).collect();
    let mut seen = Vec::new();
    for d in &done {
        assert_eq!(d.code, Some(0), "{}", d.stderr);
        for line in d.stdout.lines() {
            let words: Vec<&str> = line.split_whitespace().collect();
            assert_eq!(words[6], "6", "{line}");
            seen.push((words[2].to_owned(), words[4].parse::<u32>().expect("rank")));
        }
    }
    seen.sort_by_key(|(_, rank)| *rank);
    let ranks: Vec<u32> = seen.iter().map(|(_, r)| *r).collect();
    assert_eq!(ranks, [0, 1, 2, 3, 4, 5], "{seen:?}");
    for (node, rank) in &seen {
        assert_eq!(node.parse::<u32>().ok(), Some(rank / 2), "{seen:?}");
    }
    let joined = done.iter().filter(|d| d.stderr.contains("rallypoint: this launcher is node ")).count();
    assert_eq!(joined, 2, "the two that did not host say which node they are");
}
