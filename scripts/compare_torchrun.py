"""Runs rallypoint launch and torchrun on the same jobs, alternating, and prints
wall time and launcher peak RSS (see scripts/compare-torchrun)."""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

GLOO = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(4) * (dist.get_rank() + 1)
dist.all_reduce(t)
n = dist.get_world_size()
assert t.tolist() == [n * (n + 1) / 2] * 4, t
dist.destroy_process_group()
"""


def vm_hwm_kib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def measure(cmd, env):
    """Wall seconds of `cmd`, and the peak RSS (KiB) of its own process."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peak = 0
    while proc.poll() is None:
        hwm = vm_hwm_kib(proc.pid)
        if hwm:
            peak = max(peak, hwm)
        time.sleep(0.005)
    wall = time.perf_counter() - start
    err = proc.stderr.read().decode(errors="replace")
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} exited {proc.returncode}:\n{err}")
    return wall, peak


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--rallypoint", required=True)
    parser.add_argument("--torchrun", required=True)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="compare-torchrun-") as workdir:
        compare(args, workdir)


def compare(args, workdir):
    script = os.path.join(workdir, "gloo_allreduce.py")
    with open(script, "w") as f:
        f.write(GLOO)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RALLYPOINT_", "MASTER_", "PET_", "SLURM_"))}
    env["PYTHON_EXEC"] = sys.executable  # the venv's python, as torchrun uses its own
    env.pop("OMP_NUM_THREADS", None)

    cases = {
        "true": {
            "rallypoint": [args.rallypoint, "launch", "--nproc-per-node", "4", "--", "true"],
            "torchrun": [args.torchrun, "--nproc-per-node", "4", "--no-python", "true"],
        },
        "gloo": {
            "rallypoint": [args.rallypoint, "launch", "--nproc-per-node", "4", script],
            "torchrun": [args.torchrun, "--nproc-per-node", "4", script],
        },
    }
    results = {(case, tool): [] for case in cases for tool in ("rallypoint", "torchrun")}
    for i in range(args.runs):
        for case, tools in cases.items():
            order = ("rallypoint", "torchrun") if i % 2 == 0 else ("torchrun", "rallypoint")
            for tool in order:
                results[(case, tool)].append(measure(tools[tool], env))

    print(f"{'job':<6} {'launcher':<11} {'wall median (min-max) s':<26} {'launcher peak RSS median MiB':<28}")
    summary = {"runs": args.runs, "cpus": os.cpu_count()}
    for (case, tool), samples in results.items():
        walls = [w for w, _ in samples]
        rss = [r / 1024 for _, r in samples]
        wall_text = f"{statistics.median(walls):.3f} ({min(walls):.3f}-{max(walls):.3f})"
        print(f"{case:<6} {tool:<11} {wall_text:<26} {statistics.median(rss):.1f}")
        summary[f"{case}_{tool}_wall_median_s"] = round(statistics.median(walls), 4)
        summary[f"{case}_{tool}_rss_median_mib"] = round(statistics.median(rss), 1)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
