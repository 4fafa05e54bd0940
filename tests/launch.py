"""How tests launch T5_training.py (or a wrapper of it): through torchrun in the foreground (`torchrun`), or in
the background to be signalled or killed mid-run (`Background`); or on the session's pooled rank processes
(`pooled`), which skips torchrun's start and every rank's imports (tests/rank_pool.py).

A test uses a real torchrun where torchrun or a fresh process is what it checks: restarts, signals, Ctrl-C,
kill -9, the launch forms, torchrun's closing report, the run lock between processes, the README demo, and one
resume into a new process per checkpoint type and backend. Everything else runs pooled."""

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from configs.paths import REPO_ROOT
from tests.processes import child_pids, is_running
from tests.rank_pool import Scenario, offline_env, pool, read_text, scenario_files
from utils.distributed.process_group import free_port

DEFAULT_TIMEOUT_S = 300
# torchrun options for one restart of the whole group after a rank fails, noticed within a second.
RESTARTING = ["--max_restarts", "1", "--monitor_interval", "1"]


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    # A pooled run's error files by rank (what torchrun's closing report would show, TORCHELASTIC_ERROR_FILE),
    # for the ranks that wrote one; None for a run through torchrun.
    error_files: dict[int, str] | None = None

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def describe(self) -> str:
        return (
            f"exit {self.returncode} after {self.seconds:.1f} s\n"
            f"--- stdout (tail)\n{self.stdout[-12000:]}\n--- stderr (tail)\n{self.stderr[-6000:]}"
        )


def torchrun_command(
    args: list[str], nproc: int = 2, script: str = "T5_training.py", launcher: list[str] | None = None
) -> list[str]:
    """torchrun's command line: `launcher` (torchrun's own options) replaces the default one-node static
    rendezvous on a free port, e.g. ["--standalone", "--max_restarts", "1"]."""
    launcher = ["--master_port", str(free_port())] if launcher is None else launcher
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        *launcher,
        script,
        *args,
    ]


def torchrun(
    args: list[str],
    nproc: int = 2,
    script: str = "T5_training.py",
    timeout: float = DEFAULT_TIMEOUT_S,
    env: dict | None = None,
    launcher: list[str] | None = None,
) -> Run:
    """Run `script` on nproc CPU ranks, offline, one thread per rank, and wait for it to end."""
    start = time.monotonic()
    done = subprocess.run(
        torchrun_command(args, nproc, script, launcher),
        cwd=REPO_ROOT,
        env=offline_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return Run(done.returncode, done.stdout, done.stderr, time.monotonic() - start)


def ranks_environment(rank: int, nproc: int, port: int) -> dict[str, str]:
    """What torchrun's one agent gives rank `rank` of `nproc` in its environment (less its own store, restarts
    and error file)."""
    return {
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1",
        "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(nproc), "ROLE_NAME": "default",
        "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
    }  # fmt: skip


def pooled(
    args: list[str],
    nproc: int = 2,
    timeout: float = DEFAULT_TIMEOUT_S,
    env: dict | None = None,
    script: str = "T5_training.py",
    fresh_workers: bool = False,
) -> Run:
    """`torchrun --nproc_per_node nproc T5_training.py args` (or another `script`: a path from the repository's
    root, or an absolute one) on the pooled rank processes: each rank runs it
    as __main__ with this process's environment (`env` added) and what torchrun gives its ranks (without an
    agent: rank 0 hosts the store, and no torchrun restart is possible), offline, one thread per rank. The
    result reads as torchrun's, each rank's stdout (then stderr) after the other's; torchrun's own lines and
    closing report are absent. When a rank exits non-zero, the others get SIGTERM, as torchrun sends it; a rank
    still running `timeout` s after the start, or 10 s after another failed, is killed. The run's exit status is
    the first non-zero one of a rank that was not stopped by that SIGTERM. `fresh_workers`: on workers that ran
    nothing before, whose memory is a new rank's after its imports (tests/rank_pool.py)."""
    start = time.monotonic()
    port = free_port()
    with scenario_files(nproc) as files:
        error_files = [f"{out}.error.json" for out, _ in files]
        scenarios = [
            Scenario(
                rank=rank,
                world_size=nproc,
                environ={
                    **offline_env(env),
                    **ranks_environment(rank, nproc, port),
                    "TORCHELASTIC_ERROR_FILE": error_files[rank],
                },
                stdout_path=stdout,
                stderr_path=stderr,
                script=script,  # one that patched torch or a class (not the package's globals) would leave it so
                args=list(args),
            )
            for rank, (stdout, stderr) in enumerate(files)
        ]
        outcomes = pool().run(scenarios, timeout, fresh_workers)
        stdout = "".join(read_text(out) for out, _ in files)
        stderr = "".join(read_text(err) for _, err in files)
        written = {rank: read_text(path) for rank, path in enumerate(error_files) if os.path.exists(path)}
    for outcome in outcomes:
        if outcome.kind != "exit":  # the rank raised past the script, or was killed: say it as torchrun would
            stderr += f"\n{outcome.value}\n"
    # A rank stopped by the SIGTERM after another's failure has no status of its own: the failed one's is the run's
    ended = [outcome for outcome in outcomes if outcome.kind != "terminated"]
    codes = [outcome.value if outcome.kind == "exit" else 1 for outcome in ended]
    returncode = next((code for code in codes if code != 0), 0)
    return Run(returncode, stdout, stderr, time.monotonic() - start, written)


def program_tracebacks(output: str) -> list[str]:
    """Python tracebacks in the output, except torchrun's own report that a child exited non-zero.

    torchrun (the launcher, not this program) always ends with a ChildFailedError traceback when a rank
    exits non-zero; the program's ranks must print none for a user error.
    """
    found = []
    for block in output.split("Traceback (most recent call last):")[1:]:
        exception_line = next((line for line in block.splitlines() if line and not line[0].isspace()), "")
        if not exception_line.startswith("torch.distributed.elastic.multiprocessing.errors.ChildFailedError"):
            # Cut to 2000 characters, the exception line kept: callers tell tracebacks apart by it (torchrun's
            # SignalException on Ctrl-C sits past 2000 characters when the signal lands deep in its stack).
            found.append("Traceback (most recent call last):" + block[:2000] + f"\n... {exception_line}")
    return found


class Background:
    """A torchrun run in the background, its output (stdout and stderr) in a file.

    torchrun starts in its own process group, and starts every rank in a process group of its own; each
    group is ended by its id, so nothing else on the machine is touched.
    """

    def __init__(
        self,
        args: list[str],
        log_path: Path,
        nproc: int = 2,
        script: str = "T5_training.py",
        launcher: list[str] | None = None,
        env: dict | None = None,
    ):
        self.log_path = log_path
        self.log = open(log_path, "w", encoding="utf-8")  # noqa: SIM115 - closed in finish()
        self.start = time.monotonic()
        self.proc = subprocess.Popen(
            torchrun_command(args, nproc, script, launcher),
            cwd=REPO_ROOT,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=offline_env(env),
            start_new_session=True,
        )

    def workers(self) -> list[int]:
        """The ranks' pids (each leads its own process group)."""
        return child_pids(self.proc.pid)

    def wait_for(self, condition, what: str, timeout: float = 120) -> None:
        """Poll `condition` until it holds; fail if the run ends first or it takes too long."""
        deadline = time.monotonic() + timeout
        while not condition():
            if self.proc.poll() is not None:
                pytest.fail(
                    f"the run ended (exit {self.proc.returncode}) before {what}\n{self.finish().describe()}"
                )
            if time.monotonic() > deadline:
                pytest.fail(f"no {what} within {timeout} s\n{self.log_path.read_text(errors='replace')[-5000:]}")
            time.sleep(0.02)

    def kill(self) -> None:
        """SIGKILL every rank's process group, then torchrun's, and wait until all are gone."""
        groups = [*self.workers(), self.proc.pid]
        for group in groups:
            try:
                os.killpg(group, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(30)
        deadline = time.monotonic() + 30
        while any(is_running(pid) for pid in groups):
            assert time.monotonic() < deadline, f"processes {groups} survived SIGKILL"
            time.sleep(0.05)

    def finish(self, timeout: float = DEFAULT_TIMEOUT_S) -> Run:
        """Wait for the run to end (killing it if it does not within `timeout`); its result."""
        try:
            self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.kill()
            self.log.close()
        output = self.log_path.read_text(errors="replace")
        return Run(self.proc.returncode, output, "", time.monotonic() - self.start)
