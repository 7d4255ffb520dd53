"""The wheel users install: the module and the `rallypoint` command, in a fresh venv.

Takes the wheel from RALLYPOINT_WHEEL (scripts/test builds it once), else builds one
with scripts/build-wheel. Installs it offline into a new venv and runs what a new
user would: the command from PATH, `python -m rallypoint`, a real launch whose
workers import the package and meet at a barrier, and `rallypoint.__version__`.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Dict, List, Optional

import pytest

ROOT = Path(__file__).resolve().parents[3]


def crate_version() -> str:
    text = (ROOT / "Cargo.toml").read_text()
    section = text.split("[workspace.package]", 1)[1]
    found = re.search(r'^version\s*=\s*"([^"]+)"', section, re.MULTILINE)
    assert found, "no version in [workspace.package] of Cargo.toml"
    return found.group(1)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    given = os.environ.get("RALLYPOINT_WHEEL")
    if given:
        return Path(given)
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([str(ROOT / "scripts" / "build-wheel"), str(out)], check=True, timeout=3600)
    (found,) = out.glob("rallypoint-*.whl")
    return found


class Venv:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.bin = path / "bin"
        self.python = self.bin / "python"
        # Only the venv and the system's basics: the command must come from the venv.
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("RALLYPOINT_", "VIRTUAL_ENV", "PYTHON"))}
        self.env["PATH"] = f"{self.bin}{os.pathsep}/usr/bin{os.pathsep}/bin"

    def run(self, args: List[str], timeout: float = 60, env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
        full = dict(self.env)
        full.update(env or {})
        return subprocess.run(args, env=full, capture_output=True, text=True, timeout=timeout, cwd=self.path)


# What each worker of the launch runs: the installed package, a barrier and an all-gather.
WORKER = """
import rallypoint as rp
with rp.Client.from_env(timeout=60) as c:
    c.barrier("ready")
    ranks = c.all_gather(str(c.rank).encode())
    print(f"worker {c.rank} of {c.world_size} passed; gathered {b','.join(ranks).decode()}; {rp.__version__}")
"""


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory):
    """A fresh venv with the wheel installed, and the seconds from `pip install` to the
    end of a first launch in it (printed: pytest -s shows it)."""
    venv = Venv(tmp_path_factory.mktemp("venv") / "v")
    subprocess.run([sys.executable, "-m", "venv", str(venv.path)], check=True, timeout=300)
    started = time.monotonic()
    pip = venv.run([str(venv.python), "-m", "pip", "install", "--no-index", "--no-deps", "--quiet", str(wheel)], timeout=300)
    assert pip.returncode == 0, pip.stderr
    installed_at = time.monotonic()
    launch = venv.run(["rallypoint", "launch", "--nproc-per-node", "2", "--", str(venv.python), "-c", WORKER], timeout=120)
    done = time.monotonic()
    print(
        f"\nwheel {wheel.name}: {wheel.stat().st_size / 1e6:.1f} MB; pip install {installed_at - started:.2f} s; "
        f"pip install to the end of a first 2-worker launch {done - started:.2f} s"
    )
    return venv, launch


def elf_glibc_needs(data: bytes) -> List[str]:
    """The GLIBC_x.y symbol versions an ELF file references (from its version strings)."""
    return sorted(set(m.decode() for m in re.findall(rb"GLIBC_(\d+\.\d+(?:\.\d+)?)\x00", data)))


def version_tuple(v: str):
    return tuple(int(p) for p in v.split("."))


def test_wheel_ships_module_and_command_but_no_benchmarks(wheel):
    version = crate_version()
    tag = wheel.name[: -len(".whl")].split("-")
    assert tag[:2] == ["rallypoint", version], wheel.name
    python_tag, abi_tag, platform_tag = tag[-3:]
    assert (python_tag, abi_tag) == ("cp39", "abi3"), wheel.name
    platform = re.fullmatch(r"manylinux_(\d+)_(\d+)_\w+", platform_tag)
    assert platform, f"not a manylinux wheel: {wheel.name}"
    tagged = (int(platform.group(1)), int(platform.group(2)))

    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        command = f"rallypoint-{version}.data/scripts/rallypoint"
        assert command in names, names
        assert "rallypoint/_native.abi3.so" in names, names
        assert "rallypoint/__main__.py" in names, names
        assert not [n for n in names if "bench" in n.rsplit("/", 1)[-1]], names
        # The command is stored executable, so that pip installs it so.
        assert (z.getinfo(command).external_attr >> 16) & 0o111, oct(z.getinfo(command).external_attr >> 16)
        # maturin picks the manylinux tag from the extension alone; the command must
        # need no newer glibc than the tag promises, or pip would install a command that
        # cannot start.
        for name in (command, "rallypoint/_native.abi3.so"):
            needs = elf_glibc_needs(z.read(name))
            assert needs, f"{name}: no GLIBC symbol versions found"
            newest = max(needs, key=version_tuple)
            assert version_tuple(newest)[:2] <= tagged, f"{name} needs GLIBC_{newest}, the wheel is tagged {platform_tag}"


def test_command_is_on_the_venv_path(installed):
    venv, _ = installed
    assert shutil.which("rallypoint", path=venv.env["PATH"]) == str(venv.bin / "rallypoint")
    out = venv.run(["rallypoint", "--version"])
    assert (out.returncode, out.stdout.strip()) == (0, f"rallypoint {crate_version()}"), out


def test_python_dash_m_runs_the_same_command(installed):
    venv, _ = installed
    out = venv.run([str(venv.python), "-m", "rallypoint", "--version"])
    assert (out.returncode, out.stdout.strip()) == (0, f"rallypoint {crate_version()}"), out
    # Arguments and the exit code pass through: a worker's exit code is the launcher's.
    out = venv.run([str(venv.python), "-m", "rallypoint", "launch", "--nproc-per-node", "1", "--", "sh", "-c", "exit 3"])
    assert out.returncode == 3, out
    assert "exited with code 3" in out.stderr, out.stderr
    # A usage error is the command's own (clap: exit 2, usage on stderr).
    out = venv.run([str(venv.python), "-m", "rallypoint", "no-such-verb"])
    assert out.returncode == 2 and "no-such-verb" in out.stderr, out


def test_launch_runs_workers_that_import_the_package(installed):
    _, launch = installed
    assert launch.returncode == 0, launch.stdout + launch.stderr
    for rank in (0, 1):
        assert f"[rank{rank}]: worker {rank} of 2 passed; gathered 0,1; {crate_version()}" in launch.stdout, launch.stdout


def test_version_attribute_matches_the_crate(installed):
    venv, _ = installed
    out = venv.run([str(venv.python), "-c", "import rallypoint; print(rallypoint.__version__)"])
    assert (out.returncode, out.stdout.strip()) == (0, crate_version()), out


def test_python_dash_m_without_the_command_says_so(installed):
    venv, _ = installed
    command = venv.bin / "rallypoint"
    aside = venv.path / "rallypoint.aside"
    command.rename(aside)
    try:
        out = venv.run([str(venv.python), "-m", "rallypoint", "--version"])
    finally:
        aside.rename(command)
    assert out.returncode == 2, out
    assert "the rallypoint command is not installed with this package" in out.stderr, out.stderr
    assert str(command) in out.stderr, out.stderr


def test_verbs_as_slurm_tasks(installed):
    """docs/DEPLOY.md's Slurm recipe without a launcher: `rallypoint serve`, and tasks
    that only Slurm's variables tell who they are."""
    venv, _ = installed
    command = str(venv.bin / "rallypoint")
    serve = subprocess.Popen(
        [command, "serve", "--listen", "127.0.0.1:0", "--print-addr"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=venv.env,
    )
    try:
        addr = serve.stdout.readline().strip()
        assert addr, "rallypoint serve printed no address"
        task_env = {"RALLYPOINT_ADDR": addr, "RALLYPOINT_TIMEOUT": "60", "SLURM_NTASKS": "3", "SLURM_JOB_ID": "4242"}
        tasks = [
            subprocess.Popen(
                [command, "all-gather", f"from-{i}"],
                env={**venv.env, **task_env, "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i)},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for i in range(3)
        ]
        for task in tasks:
            out, err = task.communicate(timeout=90)
            assert task.returncode == 0, err
            assert out.split() == ["from-0", "from-1", "from-2"]
        # The job was SLURM_JOB_ID's: a key set by a task is in job 4242.
        out = venv.run([command, "set", "k", "v"], env={**task_env, "SLURM_PROCID": "0"})
        assert out.returncode == 0, out.stderr
        out = venv.run([command, "get", "k", "--addr", addr, "--job", "4242", "--timeout", "10"])
        assert (out.returncode, out.stdout.strip()) == (0, "v"), out
    finally:
        serve.terminate()
        serve.wait(10)
