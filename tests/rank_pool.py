"""Rank processes started once per pytest session and reused by every multi-rank scenario that needs real
processes but not a real torchrun.

Starting a rank costs 3-10 s of imports (torch, transformers, datasets, the package) before any work; a
scenario here pays it once per session instead of once per launch. The imports run once, in a fork server
(tests/rank_pool_fork_server.py), and each worker is forked from it, so a replaced worker is ready at once.
Each scenario runs as a fresh process would run it, because between scenarios every worker puts back what a
scenario can change (`FreshState`):

- the process group (destroyed), `os.environ`, the working directory, `sys.argv`, `sys.path`, the umask;
- the random streams (torch's, Python's, NumPy's) where the worker's started (a new process seeds them at
  random; every run and test seeds its own);
- torch's switches (threads, default dtype, grad mode, deterministic algorithms, matmul precision) and
  torch.compile's caches (`torch._dynamo.reset`);
- logging (the package logger's handlers and level, logging.disable, transformers' verbosity and bars);
- every signal handler, and the warning filters with Python's "shown once" registries;
- the package's module globals (a rebound name, the items of a dict, list or set, the attributes of one of
  its own objects such as hang_report.WHERE) and its functools caches.

When one rank fails, the pool sends the others SIGTERM, as torchrun does: a rank with no handler of its own
ends its scenario there, as a process would end (and its worker, stopped at an arbitrary point, is replaced),
and one that handles it (a training run saves, then stops) goes on as under torchrun. A hang still fails fast:
a scenario that outlives its deadline, or a rank still running FAILED_PEER_GRACE_S after another failed, has
its workers killed and replaced, and the test fails with each rank's output. A worker is replaced too, its
state not trusted for the next scenario, when its scenario raised past its entry point or died (a script that
ends its process itself, os._exit(130) after a second Ctrl-C, gives that exit status, as a rank would), when a
collective or the group's forming timed out in it (its output says so, or the scenario asks with
`replace_after`), or when it left a thread or a child process running. A script that ends with a non-zero exit
status after handling its error (a refused setting, a missing file, another rank's failure) leaves a worker
that is reused. What only a fresh process shows (torchrun itself, signals, kill -9, the run lock between
processes, the launch forms) is tested through tests/launch.py's real launches instead.

This module imports only the standard library at the top: the fork server sets a rank's environment (one
thread, offline, the package's deprecations as errors) before torch is imported. What a forked worker shares
with the others, where torchrun's ranks would each draw their own: Python's string-hash salt (a difference
between ranks that comes from it shows only in the real launches).
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import ctypes
import dataclasses
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import pickle
import random
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import warnings
from pathlib import Path

from tests.processes import child_pids, descendants, is_running

REPO_ROOT = Path(__file__).resolve().parents[1]
PROCESS_GROUP_TIMEOUT_S = 30  # collectives of a run_ranks scenario give up after this when a peer is gone
OWN_MODULES = r"((configs|policies|utils|scripts)(\.|$)|(T5_training|summarization_dataset)$)"
OWN_PACKAGES = ("configs", "policies", "utils")
OWN_TOP_MODULES = ("T5_training", "summarization_dataset")
READY_TIMEOUT_S = 180  # the fork server's imports, or a spawned worker's, on a loaded 2-core machine
# The environment pytest started with, before any test changed it: the fork server's, whenever it starts.
ENVIRON_AT_START = dict(os.environ)
# Where the fork server says its imports are done ("ok") or why they failed (a traceback).
SERVER_REPORT_VARIABLE = "RANK_POOL_SERVER_REPORT"
# After one rank fails, how long the others may take to end before they are killed (as torchrun stops them).
FAILED_PEER_GRACE_S = 10
THREAD_GRACE_S = 5  # how long a scenario's own threads and child processes may take to end after it returns
# A collective or the group's forming that timed out, as gloo and the store say it, and as the package reports
# it (utils/distributed/hang_report.py, process_group.GroupNotFormed).
TIMED_OUT = re.compile(
    rb"Timed out waiting \d+ms|wait timeout after \d+ms|a collective did not complete within|did not form within"
)


# ------------------------------------------------------------------------------------------- the worker


def die_with_parent() -> None:
    """Linux: this process gets SIGKILL when the one that started it dies (the fork server, pytest's child, and
    each worker, the fork server's: no orphaned ranks)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)


def own_module_names(folders: tuple[str, ...] = OWN_PACKAGES) -> list[str]:
    """The module names of this package's top modules and of its code under `folders`."""
    names = list(OWN_TOP_MODULES)
    for package in folders:
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            parts = path.relative_to(REPO_ROOT).with_suffix("").parts
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def own_deprecations_as_errors() -> str:
    """PYTHONWARNINGS that turns a DeprecationWarning or FutureWarning raised from this package's own calls
    into an error (CI fails on it), module by module (the variable takes exact module names, no patterns): the
    package's code and its scripts, as imported (the entry point run as a script is __main__, which would also
    name torchrun's agent, so it is left out)."""
    return ",".join(
        f"error::{category}:{module}"
        for module in own_module_names((*OWN_PACKAGES, "scripts"))
        for category in ("DeprecationWarning", "FutureWarning")
    )


def offline_env(extra: dict | None = None) -> dict:
    """The test environment of a run: no hub access, one thread per rank (2 ranks share 2 cores), and this
    package's own deprecations as errors."""
    environment = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", **(extra or {}))
    environment["PYTHONWARNINGS"] = own_deprecations_as_errors()
    return environment


def _is_own(module_name: str) -> bool:
    return module_name in OWN_TOP_MODULES or module_name.split(".")[0] in OWN_PACKAGES


def _is_package_object(value) -> bool:
    """An instance (not a class) of one of the package's own classes, with attributes of its own."""
    return _is_own(type(value).__module__) and not isinstance(value, type) and hasattr(value, "__dict__")


@dataclasses.dataclass
class FreshState:
    """What a new process has, taken once in a worker after its imports, and put back after every scenario."""

    environ: dict
    cwd: str
    argv: list
    path: list
    umask: int
    torch_rng: object
    python_rng: object
    numpy_rng: object
    torch_switches: dict
    logging_state: dict
    signal_handlers: dict
    warning_filters: list
    module_globals: dict  # module name: its __dict__ (a shallow copy)
    containers: dict  # id: (a dict, list or set held in a module global, a copy of its items)
    object_attributes: dict  # id: (object, its __dict__): the package's own objects held in module globals
    threads: set

    @classmethod
    def capture(cls) -> FreshState:
        import numpy
        import torch

        umask = os.umask(0)
        os.umask(umask)
        module_globals, containers, object_attributes = {}, {}, {}
        for name, module in list(sys.modules.items()):
            if module is None or not _is_own(name):
                continue
            module_globals[name] = dict(vars(module))
            for value in vars(module).values():
                if type(value) in (dict, list, set):
                    containers[id(value)] = (value, copy.copy(value))
                elif _is_package_object(value):
                    object_attributes[id(value)] = (value, dict(vars(value)))
        return cls(
            environ=dict(os.environ),
            cwd=os.getcwd(),
            argv=list(sys.argv),
            path=list(sys.path),
            umask=umask,
            torch_rng=torch.get_rng_state(),
            python_rng=random.getstate(),
            numpy_rng=numpy.random.get_state(),
            torch_switches=_torch_switches(),
            logging_state=_logging_state(),
            signal_handlers=_signal_handlers(),
            warning_filters=list(warnings.filters),
            module_globals=module_globals,
            containers=containers,
            object_attributes=object_attributes,
            threads=set(threading.enumerate()),
        )

    def restore(self) -> None:
        import numpy
        import torch
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()  # in place: modules hold os.environ itself (e.g. as a default argument)
        os.environ.update(self.environ)
        os.chdir(self.cwd)
        sys.argv[:] = self.argv
        sys.path[:] = self.path
        os.umask(self.umask)
        torch.set_rng_state(self.torch_rng)
        random.setstate(self.python_rng)
        numpy.random.set_state(self.numpy_rng)
        _set_torch_switches(self.torch_switches)
        if "torch._dynamo" in sys.modules:
            torch._dynamo.reset()
        _set_logging_state(self.logging_state)
        for signum, handler in self.signal_handlers.items():
            if signal.getsignal(signum) is not handler:
                signal.signal(signum, handler)
        warnings.resetwarnings()  # also makes Python forget which warnings it has shown once
        warnings.filters[:] = self.warning_filters
        warnings.onceregistry.clear()
        for name, saved in self.module_globals.items():
            module = sys.modules.get(name)
            if module is None:
                continue
            namespace = vars(module)
            for key in set(namespace) - set(saved):
                del namespace[key]
            namespace.update(saved)
        for value, saved in self.containers.values():  # in place: other modules may hold the same object
            if isinstance(value, list):
                value[:] = saved
            else:
                value.clear()
                value.update(saved)
        for value, saved in self.object_attributes.values():
            vars(value).clear()
            vars(value).update(saved)
        for name, module in list(sys.modules.items()):
            if module is not None and _is_own(name):
                for value in list(vars(module).values()):
                    if callable(getattr(value, "cache_clear", None)):
                        value.cache_clear()

    def left_running(self) -> list[str]:
        """The threads and child processes a scenario started that still run after a grace period, less the
        helpers a library starts on first use and keeps for the process's life, as in any process: tqdm's
        monitor thread, multiprocessing's resource sharer thread (which hands file descriptors, and so shared
        tensors, to other processes) and resource tracker process."""
        from multiprocessing import resource_sharer

        from tqdm._monitor import TMonitor

        sharer = getattr(resource_sharer._resource_sharer, "_thread", None)
        deadline = time.monotonic() + THREAD_GRACE_S
        while True:
            threads = [
                t.name
                for t in threading.enumerate()
                if t not in self.threads and t.is_alive() and t is not sharer and not isinstance(t, TMonitor)
            ]
            children = [f"child process {pid}" for pid in _child_pids()]
            if not (threads or children) or time.monotonic() > deadline:
                return threads + children
            time.sleep(0.05)


def _child_pids() -> list[int]:
    """This process's children still running, less multiprocessing's resource tracker."""
    from multiprocessing import resource_tracker

    tracker = getattr(resource_tracker._resource_tracker, "_pid", None)
    return [pid for pid in child_pids(os.getpid()) if pid != tracker and is_running(pid)]


def _torch_switches() -> dict:
    import torch

    return {
        "threads": torch.get_num_threads(),
        "dtype": torch.get_default_dtype(),
        "grad": torch.is_grad_enabled(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "matmul_precision": torch.get_float32_matmul_precision(),
    }


def _set_torch_switches(switches: dict) -> None:
    import torch

    torch.set_num_threads(switches["threads"])
    torch.set_default_dtype(switches["dtype"])
    torch.set_grad_enabled(switches["grad"])
    torch.use_deterministic_algorithms(switches["deterministic"])
    torch.set_float32_matmul_precision(switches["matmul_precision"])


def _logging_state() -> dict:
    import logging

    from transformers.utils import logging as hf_logging

    from utils.base.log import get_logger

    package, root = get_logger(), logging.getLogger()
    return {
        "package": (list(package.handlers), package.level, package.propagate, package.disabled),
        "root": (list(root.handlers), root.level),
        "disable": logging.root.manager.disable,
        "hf_verbosity": hf_logging.get_verbosity(),
        "hf_bars": hf_logging.is_progress_bar_enabled(),
    }


def _set_logging_state(state: dict) -> None:
    import logging

    from transformers.utils import logging as hf_logging

    from utils.base.log import get_logger

    package, root = get_logger(), logging.getLogger()
    handlers, level, package.propagate, package.disabled = state["package"]
    package.handlers[:] = handlers
    package.setLevel(level)  # setLevel, not the attribute: it clears the loggers' cached levels
    root.handlers[:] = state["root"][0]
    root.setLevel(state["root"][1])
    logging.disable(state["disable"])
    hf_logging.set_verbosity(state["hf_verbosity"])
    (hf_logging.enable_progress_bar if state["hf_bars"] else hf_logging.disable_progress_bar)()


def _signal_handlers() -> dict:
    handlers = {}
    for signum in signal.valid_signals():
        if signum in (signal.SIGKILL, signal.SIGSTOP):
            continue
        with contextlib.suppress(OSError, ValueError):
            handler = signal.getsignal(signum)
            if handler is not None:
                handlers[signum] = handler
    return handlers


def set_up_as_a_rank(environ: dict) -> None:
    """What a rank process has before its first import: the test environment (one thread, offline), the
    repository as its working directory and on its path, and the package's own deprecations as errors."""
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(REPO_ROOT)
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    for category in (DeprecationWarning, FutureWarning):  # this package's own, as pyproject.toml says
        warnings.filterwarnings("error", category=category, module=OWN_MODULES)


def preload() -> None:
    """Import what every scenario needs, once: the package (every module, so that its globals are saved before
    any scenario runs) and the rank functions tests share (a test module's own come with it, on first use)."""
    import importlib

    for name in own_module_names():
        importlib.import_module(name)
    importlib.import_module("tests.dist_workers")


class Terminated(BaseException):  # noqa: N818 - named for the signal, as KeyboardInterrupt is
    """The pool's SIGTERM, in a scenario that has no handler of its own for it: the scenario ends here, as its
    process would have ended."""


_scenario_running = False  # in a worker: whether a scenario's own code is running (the pool's SIGTERM ends it)


def _terminate_the_scenario(_signum, _frame) -> None:
    """A worker's SIGTERM handler (a scenario may install its own; FreshState puts this one back after it)."""
    if _scenario_running:
        raise Terminated


def _default_sigterm_in_a_child() -> None:
    """A process a scenario forks (a DataLoader's or a datasets pool's worker) has SIGTERM as a forked child of a
    rank has it: the default, unless the rank's own code installed a handler."""
    global _scenario_running
    _scenario_running = False
    if signal.getsignal(signal.SIGTERM) is _terminate_the_scenario:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _serve(conn, environ: dict) -> None:
    """A worker's life, forked from the fork server (its imports done there; spawned where there is none): set up
    as a rank process with random streams of its own and the interpreter's default way of starting processes,
    as a new process has them, then run scenarios until told to stop."""
    die_with_parent()
    set_up_as_a_rank(environ)  # before torch is imported, where the worker was spawned
    import datasets.fingerprint
    import numpy
    import torch

    # A new process seeds torch's, Python's, NumPy's and datasets' streams at random: a forked child of the server
    # would share the server's, but for Python's, which reseeds itself in a forked child.
    torch.seed()
    numpy.random.seed()
    datasets.fingerprint.fingerprint_rng.seed()  # random fingerprints of unhashable transforms
    multiprocessing.set_start_method(None, force=True)  # a forkserver child's would be the forkserver
    os.register_at_fork(after_in_child=_default_sigterm_in_a_child)
    with open(os.devnull, "wb") as devnull:  # between scenarios output goes nowhere (not into a test's capture)
        os.dup2(devnull.fileno(), 1)
        os.dup2(devnull.fileno(), 2)
    preload()  # a spawned worker's imports (a forked one has them from the server: nothing left to do)
    signal.signal(signal.SIGTERM, _terminate_the_scenario)
    fresh = FreshState.capture()
    conn.send(("ready", os.getpid()))
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        if job is None:
            return
        try:
            outcome = _run_scenario(job, fresh)
        except Terminated:  # it landed in the pool's own code after the scenario: the state is not trusted
            outcome = Outcome("terminated", STOPPED_BY_A_FAILED_PEER, False, 0.0)
        conn.send(outcome)


def _run_scenario(job: Scenario, fresh: FreshState) -> Outcome:
    global _scenario_running
    started = time.monotonic()
    os.environ.clear()  # the launching test's environment, as a process it started would inherit it
    os.environ.update(job.environ)
    kind, value, left = "error", None, []
    with _output_to(job.stdout_path, job.stderr_path):
        try:
            _scenario_running = True
            if job.script is not None:
                kind, value = "exit", _run_script(job.script, job.args)
            else:
                kind, value = "ok", _run_ranks_function(job)
        except Terminated:
            kind, value = "terminated", STOPPED_BY_A_FAILED_PEER
        except BaseException:  # noqa: BLE001 - a rank's failure, whatever it is, is the test's to report
            kind, value = "error", traceback.format_exc()
        finally:
            _scenario_running = False
            try:
                left = fresh.left_running()
                fresh.restore()
            except BaseException:  # noqa: BLE001 - the worker is then replaced
                left = [traceback.format_exc()]
    try:
        pickle.dumps(value)
    except Exception as err:  # noqa: BLE001 - an unpicklable result is the test's error, not the pool's
        kind, value = "error", f"the result cannot be sent back: {err!r}"
    timed_out = any(TIMED_OUT.search(read_bytes(path)) for path in (job.stdout_path, job.stderr_path))
    # A scenario ended by the pool's SIGTERM stopped at an arbitrary point (a lock held, a handler half run).
    clean = kind not in ("error", "terminated") and not left and not timed_out and not job.replace_after
    return Outcome(kind, value, clean, time.monotonic() - started, left)


def _run_ranks_function(job: Scenario):
    import datetime

    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        rank=job.rank,
        world_size=job.world_size,
        timeout=datetime.timedelta(seconds=PROCESS_GROUP_TIMEOUT_S),
    )
    return job.function(job.rank, job.world_size, *job.args)


def _run_script(script: str, args: list[str]) -> int:
    """`python script args` in this process: the script as __main__ (so that a process started from it, such as
    DCP's background checkpoint writer, imports it as torchrun's ranks would), its exit status returned."""
    import runpy

    sys.argv[:] = [script, *args]
    try:
        runpy.run_path(str(REPO_ROOT / script), run_name="__main__")
    except SystemExit as done:
        code = done.code
        return 0 if code is None else code if isinstance(code, int) else 1
    return 0


@contextlib.contextmanager
def _output_to(stdout_path: str, stderr_path: str):
    """File descriptors 1 and 2 (Python's, C's and child processes' output) into the scenario's files."""
    sys.stdout.flush()
    sys.stderr.flush()
    with open(stdout_path, "wb") as out, open(stderr_path, "wb") as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            with open(os.devnull, "wb") as devnull:
                os.dup2(devnull.fileno(), 1)
                os.dup2(devnull.fileno(), 2)


# ---------------------------------------------------------------------------------------- the scenarios


@dataclasses.dataclass
class Scenario:
    """One rank's part: `function(rank, world_size, *args)` in a gloo group the pool forms, or `script` with
    `args` as its command line (it forms its own group from the torchrun-like environment). `environ`: the
    whole environment (the launching test's, with the rank's variables), as a started process would have it;
    what a library reads once at import (HF_HUB_OFFLINE, PYTHONWARNINGS) is the pool's (`offline_env`)."""

    rank: int
    world_size: int
    environ: dict
    stdout_path: str
    stderr_path: str
    function: object = None
    script: str | None = None
    args: tuple | list = ()
    replace_after: bool = False


STOPPED_BY_A_FAILED_PEER = "ended by SIGTERM after another rank failed (torchrun stops the others so)"


@dataclasses.dataclass
class Outcome:
    # "ok" (a function's result), "exit" (a script's exit status), "error" (a traceback), "terminated" (the pool's
    # SIGTERM after another rank failed), "died"
    kind: str
    value: object
    clean: bool  # the worker may run the next scenario
    seconds: float
    left_running: list = dataclasses.field(default_factory=list)  # threads and processes it did not end
    ended_its_process: bool = False  # a script's os._exit: its status read from the process's end


class _Worker:
    def __init__(self, context, environ: dict):
        self.conn, child_end = context.Pipe()
        self.process = context.Process(target=_serve, args=(child_end, environ), name="rank-pool-worker")
        try:
            self.process.start()
        except (EOFError, OSError) as err:
            died = f"the rank pool could not start a worker ({err!r}): its fork server died"
            raise AssertionError(died) from None
        child_end.close()
        self.ready = False
        self.ran = False  # a scenario: its heap may hold that scenario's freed memory

    def wait_ready(self) -> None:
        if self.ready:
            return
        if not self.conn.poll(READY_TIMEOUT_S):
            self.kill()
            raise AssertionError(f"a rank pool worker did not start within {READY_TIMEOUT_S} s")
        try:
            message = self.conn.recv()
        except EOFError:
            self.process.join(5)
            raise AssertionError(f"a rank pool worker died starting (exit code {self.process.exitcode})") from None
        assert message[0] == "ready", message
        self.ready = True

    def kill(self) -> None:
        """SIGKILL the worker and every process it started (a checkpoint writer, DataLoader workers): they
        would outlive it, using the CPU the next scenarios need."""
        for pid in [*descendants(self.process.pid), self.process.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.process.join(30)
        self.conn.close()

    def stop(self) -> None:
        with contextlib.suppress(OSError, BrokenPipeError):
            self.conn.send(None)
        self.process.join(10)
        if self.process.is_alive():
            self.kill()


class RankPool:
    """Worker processes, one per rank of the largest group asked for so far; worker i plays rank i."""

    def __init__(self) -> None:
        # Workers are forked from a server that has done a rank's imports once (tests/rank_pool_fork_server.py):
        # a worker, a replacement included, is ready in a fraction of a second instead of 3-5 s of imports. On
        # Linux only: elsewhere (macOS) forking a process that loaded torch is not safe, and each worker is
        # spawned and does its own imports.
        self.forked = sys.platform == "linux"
        self._context = multiprocessing.get_context("forkserver" if self.forked else "spawn")
        if self.forked:
            self._context.set_forkserver_preload(["tests.rank_pool_fork_server"])
        self._workers: list[_Worker] = []
        self.started = 0  # workers started, replacements included
        self.replaced: list[str] = []  # why, one line per replaced worker
        self._server_report: Path | None = None  # once the fork server is started

    def _start_worker(self) -> _Worker:
        """A worker set up as tests/launch.py sets up torchrun's ranks: offline, one thread, and this package's
        own deprecations as errors (also in the processes a rank starts: DataLoader workers, checkpoint
        writers)."""
        self.started += 1
        self.start_imports()
        self._wait_for_the_imports()
        return _Worker(self._context, offline_env())

    def _wait_for_the_imports(self) -> None:
        """Until the fork server has done its imports (a worker's start would wait without a bound): a failure
        within READY_TIMEOUT_S fails the test that asked, with the server's traceback."""
        if self._server_report is None:
            return
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self._server_report.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        report = self._server_report.read_text() if self._server_report.exists() else ""
        if report != "ok":
            why = f"failed:\n{report}" if report else f"did not finish within {READY_TIMEOUT_S} s"
            raise AssertionError(f"the rank pool's fork server's imports (tests/rank_pool_fork_server.py) {why}")

    def start_imports(self) -> None:
        """The fork server started, not waited for: its imports run beside what the session does first (the
        first worker's start waits for them). It starts from the repository (Python 3.11's fork server imports
        from its working directory) with the environment pytest started with, whichever test is running."""
        if self._server_report is not None or not self.forked:
            return
        self._server_report = Path(tempfile.mkdtemp(prefix="rank_pool_server_")) / "report"
        saved = dict(os.environ)
        os.environ.clear()
        os.environ.update(ENVIRON_AT_START, **{SERVER_REPORT_VARIABLE: str(self._server_report)})
        try:
            with contextlib.chdir(REPO_ROOT):
                multiprocessing.forkserver.ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(saved)

    def _take(self, count: int) -> list[_Worker]:
        while len(self._workers) < count:
            self._workers.append(self._start_worker())
        workers = self._workers[:count]
        for worker in workers:
            worker.wait_ready()
        return workers

    def _replace(self, index: int) -> None:
        self._workers[index].kill()
        self._workers[index] = self._start_worker()  # starts now; the next scenario waits until it is ready

    def run(self, scenarios: list[Scenario], timeout_s: float, fresh_workers: bool = False) -> list[Outcome]:
        """Each scenario on the worker of its rank; every rank's outcome, in rank order. When a rank fails, the
        others get SIGTERM, as torchrun sends it. A rank that does not end within `timeout_s`, or within
        FAILED_PEER_GRACE_S after another rank failed, is killed ("died"). `fresh_workers`: on workers that ran
        no scenario before, whose memory is a new process's after its imports (what a memory measure needs: a
        reused worker's heap may hold an earlier scenario's freed tensors, which a new allocation then reuses
        without raising the resident memory)."""
        if fresh_workers:
            for rank, worker in enumerate(self._workers[: len(scenarios)]):
                if worker.ran:
                    self.replaced.append(f"rank {rank}: the next scenario measures memory (fresh_workers)")
                    self._replace(rank)
        workers = self._take(len(scenarios))
        for worker, scenario in zip(workers, scenarios, strict=True):
            worker.ran = True
            worker.conn.send(scenario)
        deadline = time.monotonic() + timeout_s
        outcomes: list[Outcome | None] = [None] * len(scenarios)
        pending = set(range(len(scenarios)))
        peer_failed = False
        while pending:
            ready = multiprocessing.connection.wait(
                [workers[rank].conn for rank in pending], timeout=max(0.0, deadline - time.monotonic())
            )
            if not ready:
                break
            for rank in [rank for rank in pending if workers[rank].conn in ready]:
                pending.discard(rank)
                try:
                    outcomes[rank] = workers[rank].conn.recv()
                except (EOFError, ConnectionError):
                    workers[rank].process.join(5)
                    code = workers[rank].process.exitcode
                    # The script ended its process itself (os._exit), as it would end a rank's: its status (255 is
                    # what the fork server's death leaves its children).
                    if scenarios[rank].script is not None and code is not None and 0 <= code < 255:
                        outcomes[rank] = Outcome("exit", code, False, 0.0, ended_its_process=True)
                    else:
                        outcomes[rank] = Outcome("died", f"the rank's process died (exit code {code})", False, 0.0)
                if _failed(outcomes[rank]) and pending and not peer_failed:  # the others: SIGTERM, then a grace
                    peer_failed = True
                    deadline = min(deadline, time.monotonic() + FAILED_PEER_GRACE_S)
                    for other in pending:
                        if workers[other].process.exitcode is None:  # a dead one's pid may be another's now
                            with contextlib.suppress(ProcessLookupError):
                                os.kill(workers[other].process.pid, signal.SIGTERM)
        for rank in pending:
            if peer_failed:
                why = f"was still running {FAILED_PEER_GRACE_S:g} s after another rank failed"
            else:
                why = f"did not finish within {timeout_s:g} s (hang?)"
            outcomes[rank] = Outcome("died", f"rank {rank} {why}: killed", False, 0.0)
        for rank, outcome in enumerate(outcomes):
            if not outcome.clean:
                self.replaced.append(f"rank {rank}: {_why_replaced(outcome)}")
                self._replace(rank)
        return outcomes

    def close(self) -> None:
        for worker in self._workers:
            worker.stop()
        self._workers = []
        if self._server_report is not None:
            shutil.rmtree(self._server_report.parent, ignore_errors=True)


def _failed(outcome: Outcome) -> bool:
    """A rank that raised, died, or exited non-zero: torchrun would stop the others."""
    return outcome.kind in ("error", "died") or (outcome.kind == "exit" and outcome.value != 0)


def _why_replaced(outcome: Outcome) -> str:
    if outcome.kind in ("error", "died", "terminated"):
        return str(outcome.value).strip().splitlines()[-1][:200]
    if outcome.ended_its_process:
        return f"the script ended its process (exit status {outcome.value})"
    if outcome.left_running:
        return f"left running: {', '.join(outcome.left_running)}"[:200]
    return "a collective or the group timed out in it, or it asked to be replaced"


_POOL: RankPool | None = None


def pool() -> RankPool:
    """The session's pool, started on first use and stopped when pytest exits."""
    global _POOL
    if _POOL is None:
        _POOL = RankPool()
        atexit.register(_POOL.close)
    return _POOL


def summary() -> list[str]:
    """What the session's pool did, for pytest's closing summary (tests/conftest.py)."""
    if _POOL is None:
        return []
    lines = [f"rank pool: {_POOL.started} worker processes started, {len(_POOL.replaced)} of them replacements"]
    return lines + [f"  replaced: {line}" for line in _POOL.replaced]


@contextlib.contextmanager
def scenario_files(world_size: int):
    """Each rank's stdout and stderr file paths, in a folder removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="rank_pool_") as folder:
        yield [
            (os.path.join(folder, f"rank{rank}.out"), os.path.join(folder, f"rank{rank}.err"))
            for rank in range(world_size)
        ]


def read_text(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()
