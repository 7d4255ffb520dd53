"""``python -m rallypoint ARGS``: the ``rallypoint`` command installed with this package.

The wheel ships the command as an executable of its own (a Rust binary, installed
into the environment's scripts directory); this finds that file and runs it in
this process's place, so arguments, output, signals and the exit code are the
command's own. It is looked up where this package's installation recorded it, not
on PATH, so that it is the command of the same build as this module.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from typing import List, Optional

NAME = "rallypoint"


def _recorded() -> Optional[str]:
    """The executable named in this distribution's RECORD, if it was installed from a wheel."""
    try:
        from importlib import metadata

        dist = metadata.distribution(NAME)
    except Exception:  # no metadata: running from a source tree
        return None
    for entry in dist.files or ():
        parts = entry.parts
        if len(parts) >= 2 and parts[-1] == NAME and parts[-2] in ("bin", "scripts", "Scripts"):
            path = os.path.realpath(str(dist.locate_file(entry)))
            if os.access(path, os.X_OK):
                return path
    return None


def _candidates() -> List[str]:
    found = _recorded()
    # The scripts directory of the running interpreter's installation scheme: where
    # pip put it when RECORD is unreadable (e.g. a stripped-down image).
    scripts = sysconfig.get_path("scripts")
    return [p for p in (found, scripts and os.path.join(scripts, NAME)) if p]


def executable() -> Optional[str]:
    """The path of the installed ``rallypoint`` command, or None."""
    for path in _candidates():
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


def main(argv: List[str]) -> int:
    path = executable()
    if path is None:
        sys.stderr.write(
            "python -m rallypoint: the rallypoint command is not installed with this package "
            f"(looked for {', '.join(_candidates()) or 'an executable recorded by pip'}).\n"
            "It comes with the wheel (scripts/build-wheel, then pip install dist/rallypoint-*.whl); "
            "a build of the module alone (pip install crates/rallypoint-py, maturin develop) has none. "
            "Or install the command with: cargo install --path crates/rallypoint-cli\n"
        )
        return 2
    try:
        os.execv(path, [NAME, *argv])
    except OSError as e:
        sys.stderr.write(f"python -m rallypoint: cannot run {path}: {e}\n")
        return 126
    return 0  # not reached: execv does not return


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
