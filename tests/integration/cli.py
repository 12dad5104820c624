"""The ``lmcache`` command run as a user runs it: ``python -m lmcache_cli`` in a new process (exit
code, stdout, stderr), for every test that checks a command's output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


class Result:
    def __init__(self, proc: subprocess.CompletedProcess[str]) -> None:
        self.code = proc.returncode
        self.out = proc.stdout
        self.err = proc.stderr

    def json(self) -> Any:
        return json.loads(self.out)

    def one_error_line(self) -> str:
        lines = [line for line in self.err.splitlines() if line.strip()]
        assert "Traceback" not in self.err, self.err
        assert len(lines) == 1 and lines[0].startswith("error: "), self.err
        return lines[0]


def cli(*args: str, env: dict[str, str] | None = None, stdin: str | None = None,
        importtime: bool = False, timeout: float = 60) -> Result:
    """``lmcache <args>`` in the checkout, without the caller's ``LMCACHE_*`` variables."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_")}
    cmd = [sys.executable, *(["-X", "importtime"] if importtime else []), "-m", "lmcache_cli", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, input=stdin,
                          cwd=ROOT, env={**base, "COLUMNS": "200", **(env or {})})
    return Result(proc)


def assert_no_torch(result: Result) -> None:
    """Neither torch (nor numpy) nor redis was imported: the command starts in well under a second."""
    modules = {line.split("|")[-1].strip() for line in result.err.splitlines()
               if line.startswith("import time:")}
    assert modules, "run with importtime=True"
    assert not {"torch", "numpy", "redis"} & modules, sorted(modules)
