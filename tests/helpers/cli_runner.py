"""`lorp ARGS` in the test's own process: the console script is `lorp.cli:main`, so this
is the same code path without the seconds a fresh interpreter spends on imports. The
console script's own process is tested once, in test_spec."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import traceback
from pathlib import Path


def lorp(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Exit code, stdout and stderr, as `subprocess.run([lorp, *args])` reports them."""
    from lorp.cli import main

    out, err = io.StringIO(), io.StringIO()
    here = Path.cwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except Exception:  # what the interpreter does with it (`--debug` re-raises)
                traceback.print_exc()
                code = 1
    finally:
        os.chdir(here)
    return subprocess.CompletedProcess(["lorp", *args], code, out.getvalue(), err.getvalue())
