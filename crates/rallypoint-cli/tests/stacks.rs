//! Where every rank is: `rallypoint status --stacks` and `rallypoint launch
//! --hang-timeout`, on one node and on two launchers ("nodes") of one machine. The
//! torch tests need the project's venv (scripts/test makes it) and say so when it is
//! missing; the others use the system's python3.

use std::io::Read;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

mod common;
use common::{torch_python, SCRUB};

const BIN: &str = env!("CARGO_BIN_EXE_rallypoint");
/// Bounds every wait of a test (never asserted on: the machine may be slow).
const LIMIT: Duration = Duration::from_secs(240);

/// What the launchers of a two-node test share.
const SHARED_TOKEN: &str = "stacks-test-token-shared-by-every-node";

/// A torch job of `WORLD_SIZE` ranks: rank 2 sleeps in `load_batch` (line 19)
/// while the others wait for it in `all_reduce` (called at line 27). Until the
/// process group is up, a thread prints now and again: the import of torch takes
/// seconds, and a job that says something is not quiet.
const TORCH_HANG: &str = r#"import threading, time

started = threading.Event()


def starting():
    while not started.wait(0.5):
        print("starting", flush=True)


threading.Thread(target=starting, daemon=True).start()
import torch
import torch.distributed as dist


def load_batch(rank):
    if rank == 2:
        print("rank 2 loads a batch", flush=True)
        time.sleep(3600)
    return torch.ones(1)


def train():
    dist.init_process_group("gloo")
    started.set()
    batch = load_batch(dist.get_rank())
    dist.all_reduce(batch)


train()
"#;
const TORCH_SLEEP_LINE: u32 = 19;
const TORCH_ALL_REDUCE_LINE: u32 = 27;

/// Plain Python: rank 1 is stuck in `stuck` (line 5) while the others wait in
/// `wait_for_peers` (line 9); rank 3, given FAIL, exits with code 3 instead.
// With FAIL, rank 3 exits only once rank 1 is in `stuck` (its marker file), so
// that the summary has a stack of rank 1 to show. Lines 5, 9 and 16 are asserted.
const PY_HANG: &str = r#"import os, sys, time


def stuck():
    open("rank1-stuck", "w").close(); time.sleep(3600)


def wait_for_peers():
    time.sleep(3600)
def wait_for(path, then): return next((then for _ in range(6000) if os.path.exists(path) or time.sleep(0.01)), then)

rank = int(os.environ["RANK"])
print("rank", rank, "ready", flush=True)
if rank == 3 and os.environ.get("FAIL"):
    sys.exit(wait_for("rank1-stuck", then=3))
stuck() if rank == 1 else wait_for_peers()
"#;

/// The system's Python itself: a `python3` first on PATH may be a shell script that
/// runs it (pyenv's shim), slow to start on a loaded machine, whose stack is the shell's.
fn python3() -> &'static str {
    if Path::new("/usr/bin/python3").exists() {
        "/usr/bin/python3"
    } else {
        "python3"
    }
}

/// A running launcher whose output is read as it comes.
struct Job {
    child: Child,
    stdout: Arc<Mutex<String>>,
    stderr: Arc<Mutex<String>>,
    readers: Vec<thread::JoinHandle<()>>,
}

struct Done {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

fn read_into(mut from: impl Read + Send + 'static, into: Arc<Mutex<String>>) -> thread::JoinHandle<()> {
    thread::spawn(move || {
        let mut buf = [0u8; 8192];
        loop {
            match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => into.lock().expect("lock").push_str(&String::from_utf8_lossy(&buf[..n])),
            }
        }
    })
}

impl Job {
    fn start(args: &[&str], dir: &Path, env: &[(&str, &str)]) -> Job {
        let mut cmd = Command::new(BIN);
        for var in SCRUB {
            cmd.env_remove(var);
        }
        cmd.arg("launch").args(args).current_dir(dir).envs(env.iter().copied());
        cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        let mut child = cmd.spawn().expect("start the launcher");
        let (stdout, stderr) = (Arc::default(), Arc::default());
        let readers = vec![
            read_into(child.stdout.take().expect("piped"), Arc::clone(&stdout)),
            read_into(child.stderr.take().expect("piped"), Arc::clone(&stderr)),
        ];
        Job { child, stdout, stderr, readers }
    }

    fn stdout(&self) -> String {
        self.stdout.lock().expect("lock").clone()
    }

    /// Waits (bounded) until stdout has every one of `lines`.
    fn wait_stdout(&mut self, lines: &[String]) {
        let deadline = Instant::now() + LIMIT;
        loop {
            let out = self.stdout();
            if lines.iter().all(|l| out.contains(l.as_str())) {
                return;
            }
            if Instant::now() > deadline || self.child.try_wait().expect("try_wait").is_some() {
                // SIGKILL: the launcher's watchdog takes its workers down.
                let _ = self.child.kill();
                let _ = self.child.wait();
                let stderr = self.stderr.lock().expect("lock").clone();
                panic!("never saw {lines:?}\nstdout:\n{out}\nstderr:\n{stderr}");
            }
            thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits (bounded) for the launcher's end.
    fn finish(mut self) -> Done {
        let deadline = Instant::now() + LIMIT;
        let status = loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                break Some(status);
            }
            if Instant::now() > deadline {
                break None;
            }
            thread::sleep(Duration::from_millis(50));
        };
        if status.is_none() {
            let done = self.stop();
            panic!("the launcher ran past {LIMIT:?}\nstdout:\n{}\nstderr:\n{}", done.stdout, done.stderr);
        }
        self.collect(status.and_then(|s| s.code()))
    }

    /// Ends the launcher (SIGTERM: it takes its workers down) and waits for it.
    fn stop(mut self) -> Done {
        // SAFETY: signals the launcher this test started.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.child.try_wait().expect("try_wait").is_none() {
            if Instant::now() > deadline {
                let _ = self.child.kill();
                break;
            }
            thread::sleep(Duration::from_millis(50));
        }
        let code = self.child.wait().ok().and_then(|s| s.code());
        self.collect(code)
    }

    fn collect(mut self, code: Option<i32>) -> Done {
        for reader in self.readers.drain(..) {
            let _ = reader.join();
        }
        let stdout = self.stdout.lock().expect("lock").clone();
        let stderr = self.stderr.lock().expect("lock").clone();
        Done { code, stdout, stderr }
    }
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("rp-stacks-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("free port")
}

/// `rallypoint status --stacks ARGS` (with the two-node tests' token when given an
/// address; without, the launcher found on this machine tells its own).
fn status(args: &[&str]) -> Done {
    let mut cmd = Command::new(BIN);
    for var in SCRUB {
        cmd.env_remove(var);
    }
    if args.contains(&"--addr") {
        cmd.env("RALLYPOINT_TOKEN", SHARED_TOKEN);
    }
    let out = cmd
        .args(["status", "--stacks", "--timeout", "60"])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run status");
    Done {
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// Asks `status --stacks ARGS` until its output has every one of `want` (the ranks
/// reach where the test needs them a moment after they say they are ready); returns it.
fn status_until(args: &[&str], want: &[String]) -> String {
    let deadline = Instant::now() + LIMIT;
    loop {
        let done = status(args);
        assert_eq!(done.code, Some(0), "status --stacks failed:\n{}\n{}", done.stdout, done.stderr);
        if want.iter().all(|w| done.stdout.contains(w.as_str())) {
            return done.stdout;
        }
        assert!(Instant::now() < deadline, "status --stacks never showed {want:?}; last:\n{}", done.stdout);
        thread::sleep(Duration::from_millis(200));
    }
}

/// The line of `text` that starts (after spaces) with `label`, its spaces squeezed.
fn line_of(text: &str, label: &str) -> String {
    let squeeze = |l: &str| l.split_whitespace().collect::<Vec<_>>().join(" ");
    text.lines()
        .map(squeeze)
        .find(|l| l.starts_with(label))
        .unwrap_or_else(|| panic!("no line starting with {label:?} in:\n{text}"))
}

/// What the torch tests expect of the grouped stacks, given the file's name.
fn torch_groups(text: &str) {
    let odd = line_of(text, "rank 2 (1 of 4):");
    assert!(
        odd.starts_with(&format!("rank 2 (1 of 4): load_batch (hang.py:{TORCH_SLEEP_LINE}) ← train (hang.py:")),
        "rank 2 is named in its sleep, with its file and line: {odd}\n{text}"
    );
    let rest = line_of(text, "ranks 0-1,3 (3 of 4):");
    assert!(
        rest.starts_with("ranks 0-1,3 (3 of 4): all_reduce (torch/distributed/distributed_c10d.py:"),
        "the others wait in all_reduce: {rest}\n{text}"
    );
    assert!(rest.contains(&format!("← train (hang.py:{TORCH_ALL_REDUCE_LINE})")), "{rest}");
    let odd_at = text.find("rank 2 (1 of 4)").expect("rank 2");
    assert!(odd_at < text.find("ranks 0-1,3 (3 of 4)").expect("the others"), "the odd one first:\n{text}");
}

fn ready_lines(ranks: &[u32], what: &str) -> Vec<String> {
    ranks.iter().map(|r| format!("[rank{r}]: {what}")).collect()
}

#[test]
fn status_stacks_groups_a_torch_job_with_the_stuck_rank_first() {
    let Some(python) = torch_python() else {
        eprintln!("skipped: no torch venv at ~/.cache/rallypoint/venv (scripts/test makes it)");
        return;
    };
    let dir = temp_dir("torch-status");
    std::fs::write(dir.join("hang.py"), TORCH_HANG).expect("script");
    let job = format!("torch-status-{}", std::process::id());
    let python = python.to_str().expect("utf-8");
    let mut launched =
        Job::start(&["--job", &job, "--nproc-per-node", "4", "hang.py"], &dir, &[("PYTHON_EXEC", python)]);
    launched.wait_stdout(&ready_lines(&[2], "rank 2 loads a batch"));
    // No address: the launcher of this job on this machine is found.
    let text = status_until(&["--job", &job], &["ranks 0-1,3 (3 of 4)".into()]);
    torch_groups(&text);
    assert!(text.contains("stacks of 4 ranks on 1 node"), "{text}");
    assert!(
        text.contains(&format!("holds 2 jobs: '{job}', '{job}/launch' (the launchers of job '{job}')")),
        "the report and its footer: {text}"
    );
    let done = launched.stop();
    assert!(done.stderr.contains("received SIGTERM"), "{}", done.stderr);
}

#[test]
fn a_hung_torch_job_is_taken_down_and_its_summary_says_where_each_rank_was() {
    let Some(python) = torch_python() else {
        eprintln!("skipped: no torch venv at ~/.cache/rallypoint/venv (scripts/test makes it)");
        return;
    };
    let dir = temp_dir("torch-hang");
    std::fs::write(dir.join("hang.py"), TORCH_HANG).expect("script");
    let logs = dir.join("logs");
    let args = ["--nproc-per-node", "4", "--hang-timeout", "5", "--log-dir", logs.to_str().expect("utf-8"), "hang.py"];
    let done = Job::start(&args, &dir, &[("PYTHON_EXEC", python.to_str().expect("utf-8"))]).finish();
    assert_eq!(done.code, Some(124), "a hang exits 124:\n{}", done.stderr);
    let first = done.stderr.lines().find(|l| l.contains("FAILED")).expect("a summary");
    assert!(
        first.contains("the job hung: no rank wrote output or asked the coordinator anything for")
            && first.contains("(--hang-timeout 5)"),
        "{first}"
    );
    torch_groups(&done.stderr);
    assert!(done.stderr.contains("rank 0: killed by the launcher (SIGTERM) after the job hung"), "{}", done.stderr);
    let file = std::fs::read_to_string(logs.join("attempt1/stacks-node0.txt")).expect("the stacks in --log-dir");
    torch_groups(&file);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn two_nodes_stacks_come_from_both_launchers_and_both_summaries_name_the_hang() {
    let Some(python) = torch_python() else {
        eprintln!("skipped: no torch venv at ~/.cache/rallypoint/venv (scripts/test makes it)");
        return;
    };
    let dir = temp_dir("torch-two-nodes");
    std::fs::write(dir.join("hang.py"), TORCH_HANG).expect("script");
    let python = python.to_str().expect("utf-8");
    let env = [("PYTHON_EXEC", python), ("RALLYPOINT_TOKEN", SHARED_TOKEN)];
    let run = |hang: Option<&str>| {
        let master = format!("127.0.0.1:{}", free_port());
        let job = format!("two-{}-{}", std::process::id(), hang.is_some());
        let mut nodes = Vec::new();
        for node in ["0", "1"] {
            let mut args = vec!["--job", &job, "--nnodes", "2", "--node-rank", node, "--master", &master];
            args.extend(["--nproc-per-node", "2"]);
            if let Some(secs) = hang {
                args.extend(["--hang-timeout", secs]);
            }
            args.push("hang.py");
            nodes.push(Job::start(&args, &dir, &env));
        }
        (master, job, nodes)
    };

    // status --stacks: rank 2 runs on node 1, the others on both nodes.
    let (master, job, mut nodes) = run(None);
    nodes[1].wait_stdout(&ready_lines(&[2], "rank 2 loads a batch"));
    let text = status_until(&["--addr", &master, "--job", &job], &["ranks 0-1,3 (3 of 4)".into()]);
    torch_groups(&text);
    assert!(text.contains("stacks of 4 ranks on 2 nodes"), "{text}");
    for node in nodes {
        node.stop();
    }

    // --hang-timeout: node 0 finds the hang; both summaries say where every rank was.
    let (_, _, nodes) = run(Some("5"));
    let done: Vec<Done> = nodes.into_iter().map(Job::finish).collect();
    for (node, done) in done.iter().enumerate() {
        assert_eq!(done.code, Some(124), "node {node}:\n{}", done.stderr);
        assert!(done.stderr.contains("the job hung"), "node {node}:\n{}", done.stderr);
        torch_groups(&done.stderr);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_hung_python_job_is_named_by_its_stacks_and_a_failure_lists_the_ranks_still_running() {
    let dir = temp_dir("py-hang");
    std::fs::write(dir.join("hang.py"), PY_HANG).expect("script");
    let args = ["--nproc-per-node", "4", "--hang-timeout", "3", "--", python3(), "hang.py"];
    let done = Job::start(&args, &dir, &[]).finish();
    assert_eq!(done.code, Some(124), "{}", done.stderr);
    let odd = line_of(&done.stderr, "rank 1 (1 of 4):");
    assert!(odd.starts_with("rank 1 (1 of 4): stuck (hang.py:5) ← <module> (hang.py:16)"), "{odd}");
    let rest = line_of(&done.stderr, "ranks 0,2-3 (3 of 4):");
    assert!(rest.starts_with("ranks 0,2-3 (3 of 4): wait_for_peers (hang.py:9) ← <module> (hang.py:16)"), "{rest}");

    // A failure: the ranks still running are read before they are killed.
    let _ = std::fs::remove_file(dir.join("rank1-stuck"));
    let args = ["--nproc-per-node", "4", "--hang-timeout", "600", "--", python3(), "hang.py"];
    let done = Job::start(&args, &dir, &[("FAIL", "1")]).finish();
    assert_eq!(done.code, Some(3), "{}", done.stderr);
    assert!(done.stderr.contains("FAILED (attempt 1 of 1): rank 3 exited with code 3"), "{}", done.stderr);
    assert!(
        done.stderr.contains("where this node's ranks still running were when the job was taken down"),
        "{}",
        done.stderr
    );
    // Ranks 0 and 2 may not have reached wait_for_peers yet; rank 3 is gone.
    let stacks: String = done.stderr.lines().filter(|l| l.contains(" of 3):")).collect::<Vec<_>>().join("\n");
    assert!(stacks.contains("stuck (hang.py:5)"), "rank 1's stack: {}", done.stderr);
    assert!(!stacks.contains("rank 3 "), "{stacks}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn workers_that_are_not_python_give_their_native_stack_or_say_so() {
    let dir = temp_dir("not-python");
    let job = format!("not-python-{}", std::process::id());
    let mut launched =
        Job::start(&["--job", &job, "--nproc-per-node", "2", "--", "sh", "-c", "echo up; exec sleep 600"], &dir, &[]);
    launched.wait_stdout(&ready_lines(&[0, 1], "up"));
    let text = status_until(&["--job", &job], &["not a Python process (sleep)".into()]);
    assert_eq!(line_of(&text, "ranks 0-1"), "ranks 0-1 (2 of 2): not a Python process (sleep)", "{text}");
    let native = status(&["--job", &job, "--native"]);
    assert_eq!(native.code, Some(0), "{}", native.stderr);
    let line = line_of(&native.stdout, "ranks 0-1 (2 of 2):");
    if native.stdout.contains("native frames are not in this launcher's build") {
        assert_eq!(line, "ranks 0-1 (2 of 2): not a Python process (sleep)", "{}", native.stdout);
    } else {
        assert!(line.starts_with("ranks 0-1 (2 of 2): not a Python process (sleep): "), "{}", native.stdout);
        assert!(line.contains("sleep"), "sleep's own frames: {line}");
    }
    launched.stop();
}

/// A wrapper script that runs no Python is shown with the program it runs, so that
/// a rank whose script went another way stands apart.
#[test]
fn a_wrapper_that_runs_no_python_is_shown_with_what_it_runs() {
    let dir = temp_dir("wrapper");
    let job = format!("wrapper-{}", std::process::id());
    let script = r#"echo up; if [ "$RANK" = 1 ]; then sleep 600; true; else tail -f /dev/null; true; fi"#;
    let mut launched = Job::start(&["--job", &job, "--nproc-per-node", "2", "--", "sh", "-c", script], &dir, &[]);
    launched.wait_stdout(&ready_lines(&[0, 1], "up"));
    let wanted = ["(sh → sleep)".to_owned(), "(sh → tail)".to_owned()];
    let text = status_until(&["--job", &job], &wanted);
    assert_eq!(line_of(&text, "rank 1 "), "rank 1 (1 of 2): not a Python process (sh → sleep)", "{text}");
    assert_eq!(line_of(&text, "rank 0 "), "rank 0 (1 of 2): not a Python process (sh → tail)", "{text}");
    launched.stop();
}

#[test]
fn stacks_of_a_job_no_launcher_runs_are_refused_by_name() {
    let dir = temp_dir("no-launcher");
    let job = format!("no-launcher-{}", std::process::id());
    let master = format!("127.0.0.1:{}", free_port());
    let args = ["--job", &job, "--master", &master, "--insecure", "--", "sh", "-c", "echo up; exec sleep 600"];
    let mut launched = Job::start(&args, &dir, &[]);
    launched.wait_stdout(&ready_lines(&[0], "up"));
    // A job of that coordinator that no launcher runs.
    let set = Command::new(BIN)
        .args(["set", "--addr", &master, "--job", "plain", "k", "v"])
        .env_remove("RALLYPOINT_TOKEN")
        .status()
        .expect("rallypoint set");
    assert!(set.success());
    let out = Command::new(BIN)
        .args(["status", "--stacks", "--addr", &master, "--job", "plain"])
        .env_remove("RALLYPOINT_TOKEN")
        .output()
        .expect("rallypoint status");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--stacks asks the job's launchers, and job 'plain' has none"), "{stderr}");
    launched.stop();
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn status_stacks_of_many_python_workers_is_one_group_and_timed() {
    let dir = temp_dir("many");
    std::fs::write(
        dir.join("wait.py"),
        "import time\n\n\ndef idle():\n    time.sleep(3600)\n\n\nprint('up', flush=True)\nidle()\n",
    )
    .expect("script");
    let ranks: u32 = std::env::var("RALLYPOINT_STACKS_RANKS").ok().and_then(|n| n.parse().ok()).unwrap_or(64);
    let job = format!("many-{}", std::process::id());
    let nproc = ranks.to_string();
    let mut launched = Job::start(&["--job", &job, "--nproc-per-node", &nproc, "--", python3(), "wait.py"], &dir, &[]);
    launched.wait_stdout(&(0..ranks).map(|r| format!("[rank{r}]: up")).collect::<Vec<_>>());
    let all = format!("ranks 0-{} ({ranks} of {ranks}): idle (wait.py:5)", ranks - 1);
    let started = Instant::now();
    let text = status_until(&["--job", &job], std::slice::from_ref(&all));
    eprintln!("status --stacks of {ranks} Python workers: {:.2} s\n{text}", started.elapsed().as_secs_f64());
    assert_eq!(line_of(&text, "ranks 0-"), format!("{all} ← <module> (wait.py:9)"));
    launched.stop();
}
