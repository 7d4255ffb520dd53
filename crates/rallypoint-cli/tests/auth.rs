//! Issue #14, story 4: an unprivileged local user must not read the keys of an
//! authenticated job with a TCPStore LIST_KEYS, abort it, or claim one of its ranks.
//!
//! Privileges: the coordinator runs as the test's user and the intruder as `nobody`
//! (uid 65534, through `setpriv`), so the test needs root to switch users. CI runs
//! it as root; run as another user it says so and checks nothing (it cannot make a
//! second user). The intruder is plain `python3` (its TCPStore client, a dozen
//! lines of socket code below) and this crate's `rallypoint` binary, copied where
//! `nobody` may run it.

use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

mod common;
use common::SCRUB;

const BIN: &str = env!("CARGO_BIN_EXE_rallypoint");
const NOBODY: u32 = 65534;

/// A TCPStore client as torch's: VALIDATE, PING (echoed), then LIST_KEYS. Prints
/// `refused` if the connection closes before the echo, else the keys it got.
const TCPSTORE_LIST_KEYS: &str = r#"
import socket, struct, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=20)
s.sendall(b"\x00" + struct.pack("<I", 0x3C85F7CE) + b"\x0d" + struct.pack("<I", 4242) + b"\x11")
def read(n):
    data = b""
    while len(data) < n:
        try:
            chunk = s.recv(n - len(data))
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            print("refused"); sys.exit(0)
        data += chunk
    return data
assert struct.unpack("<I", read(4))[0] == 4242
keys = [read(struct.unpack("<Q", read(8))[0]).decode() for _ in range(struct.unpack("<q", read(8))[0])]
print("keys:", ",".join(sorted(keys)))
"#;

struct Dir(PathBuf);

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A directory `nobody` may enter and read (the binary and the script), holding a
/// token file only this user may read.
fn setup() -> (Dir, PathBuf, PathBuf) {
    let dir = std::env::temp_dir().join(format!("rallypoint-story4-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("directory");
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let bin = dir.join("rallypoint");
    std::fs::copy(BIN, &bin).expect("copy the binary");
    std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    std::fs::write(dir.join("list_keys.py"), TCPSTORE_LIST_KEYS).expect("script");
    let token = dir.join("token");
    std::fs::write(&token, "story-4-token-0123456789abcdef\n").expect("token");
    std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    (Dir(dir), bin, token)
}

fn command(program: &Path, as_nobody: bool) -> Command {
    let mut cmd = if as_nobody {
        let mut cmd = Command::new("setpriv");
        cmd.args([
            format!("--reuid={NOBODY}"),
            format!("--regid={NOBODY}"),
            "--clear-groups".to_owned(),
            "--".to_owned(),
        ]);
        cmd.arg(program);
        cmd
    } else {
        Command::new(program)
    };
    for var in SCRUB {
        cmd.env_remove(var);
    }
    cmd.stdin(Stdio::null());
    cmd
}

fn run(mut cmd: Command) -> Output {
    let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("start");
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while child.try_wait().expect("wait").is_none() {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            panic!("{cmd:?} did not finish within 60 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().expect("output")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// A `python3` that `nobody` can run (a python under root's home, such as a pyenv
/// shim, is not one): the first on PATH, then /usr/bin's, that runs as nobody.
fn python_for_nobody() -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let candidates =
        std::env::split_paths(&path).map(|dir| dir.join("python3")).chain([PathBuf::from("/usr/bin/python3")]);
    for python in candidates.filter(|p| p.exists()) {
        let mut probe = command(&python, true);
        probe.args(["-c", "pass"]);
        if run(probe).status.success() {
            return python;
        }
    }
    panic!("no python3 that the user nobody can run (the intruder's TCPStore client needs one)");
}

struct Serving(Child);

impl Drop for Serving {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn an_unprivileged_user_cannot_read_abort_or_join_an_authenticated_job() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: this test runs its intruder as the user nobody, which needs root (CI runs as root)");
        return;
    }
    let (_dir, bin, token) = setup();
    let mut serve = command(&bin, false);
    serve.args(["serve", "--listen", "127.0.0.1:0", "--print-addr", "--token-file"]).arg(&token);
    let mut child = serve.stdout(Stdio::piped()).stderr(Stdio::null()).spawn().expect("serve");
    let mut stdout = child.stdout.take().expect("piped");
    let _serving = Serving(child);
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    while stdout.read(&mut byte).expect("read the address") == 1 && byte[0] != b'\n' {
        line.push(byte[0]);
    }
    let addr = text(&line);
    let port = addr.rsplit_once(':').expect("host:port").1.to_owned();

    // The job's own process (this user, with the token) stores a secret in the job
    // TCPStore clients join.
    let mut set = command(&bin, false);
    set.args(["set", "secret", "hunter2", "--addr", &addr, "--job", "default", "--token-file"]).arg(&token);
    let out = run(set);
    assert!(out.status.success(), "the job's own set failed: {}", text(&out.stderr));

    // Control: this user's TCPStore client (a torch worker of the job) reads the keys.
    let mut ours = command(Path::new("python3"), false);
    ours.arg(bin.with_file_name("list_keys.py")).args(["127.0.0.1", &port]);
    let out = run(ours);
    assert_eq!(text(&out.stdout).trim(), "keys: secret", "stderr: {}", text(&out.stderr));

    // nobody's TCPStore LIST_KEYS: closed before anything is answered.
    let mut theirs = command(&python_for_nobody(), true);
    theirs.arg(bin.with_file_name("list_keys.py")).args(["127.0.0.1", &port]);
    let out = run(theirs);
    assert_eq!(text(&out.stdout).trim(), "refused", "nobody read the keys; stderr: {}", text(&out.stderr));

    // nobody's abort, and nobody claiming rank 1: refused for want of the token (exit 9).
    for verb in
        [&["abort", "aborted by pid 4242 on host evil"][..], &["barrier", "step", "--rank", "1", "--world-size", "2"]]
    {
        let mut cmd = command(&bin, true);
        cmd.args(verb).args(["--addr", &addr, "--job", "default", "--timeout", "20"]);
        let out = run(cmd);
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(9), "nobody's {verb:?}: {stderr}");
        assert!(stderr.contains("requires a token"), "{stderr}");
    }
    // Nor can nobody read the token file.
    let mut cmd = command(&bin, true);
    cmd.args(["abort", "evil", "--addr", &addr, "--timeout", "20", "--token-file"]).arg(&token);
    let out = run(cmd);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("Permission denied"), "{}", text(&out.stderr));

    // The job is untouched: not aborted, the secret still there.
    let mut get = command(&bin, false);
    get.args(["get", "secret", "--addr", &addr, "--job", "default", "--timeout", "20", "--token-file"]).arg(&token);
    let out = run(get);
    assert_eq!(text(&out.stdout), "hunter2\n", "stderr: {}", text(&out.stderr));
    let _ = std::io::stderr().flush();
}
