"""A `raydp-train` command in its own process, stopped with Ctrl-C (SIGINT) as a user does."""

import os
import signal
import subprocess
import sys
from pathlib import Path

from raydp_train.commands.cli import EXIT_INTERRUPTED


def ctrl_c_after(arguments: list[str], cwd: Path, line_start: str, address: str = "") -> str:
    """Everything `raydp-train *arguments` printed, given one Ctrl-C once it printed a line
    starting with `line_start` (on the Ray at `address`, else its own embedded Ray); it must
    exit as interrupted."""
    env = {**os.environ, "RAY_ADDRESS": address} if address else None
    driver = subprocess.Popen([sys.executable, "-m", "raydp_train", *arguments], cwd=cwd,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
    lines = []
    for line in driver.stdout:
        lines.append(line)
        if line.startswith(line_start):
            driver.send_signal(signal.SIGINT)
            break
    output = "".join(lines) + driver.communicate(timeout=180)[0]
    assert driver.returncode == EXIT_INTERRUPTED, output
    return output
