"""What checkpoints cost a run, seen from outside its processes: training time lost to saves, and host memory
of a resume.

    python scripts/checkpoint_costs.py stall --model t5-small [--repo CONTROL_CHECKOUT] --out bench/stall
    python scripts/checkpoint_costs.py resume --model t5-base [--repo CONTROL_CHECKOUT] --out bench/resume
    python scripts/checkpoint_costs.py writer --model t5-small --out bench/writer

`stall` and `resume` launch T5_training.py through torchrun on --nproc ranks (2 by default; fp32, random
weights of the published shape, scripts/make_random_t5.py) and watch it from this process, without any hook
in the run; `writer` launches this script's own worker:

- `stall`: the arrival time of every step record in metrics.jsonl (one record per step, read every --poll_s
  seconds). Training time lost to a checkpoint is measured two ways: the wall time from the first save's step
  to the last step of a run that saves every --save_every steps, minus that of the same run without
  checkpoints, per save; and, within each run (steadier on a machine whose speed drifts between runs), the
  time of the two steps after each save over two of that run's median step. Cases: no checkpoints;
  synchronous SHARDED_STATE_DICT saves; --async_checkpoint true. FSDP2 (or --fsdp_version). `--nproc 1` leaves
  a core of this 2-core machine to the background writer, as a GPU node does; with 2 ranks every core trains.
  Whether the machine left that core free is read at each step's arrival: its busy and idle time (/proc/stat),
  the CPU of the run's own processes (this watcher, torchrun, the ranks, DCP's writer processes) and the time
  rank 0's main thread has waited to run (its schedstat). A case during whose steps other processes took more
  than 0.2 of a core (FREE_CORE_MARGIN) had no core free for the writer: its figures then measure the
  machine's other load as much as the background save. --repeats runs the cases in turn (A B C A B C), so a
  load that drifts falls on each alike.
- `resume`: each rank's peak resident memory (the highest VmHWM read from /proc: the run resets VmHWM at
  each epoch's start, --track_memory, so the last reading would leave the load phase out) until rank 0 logs
  "training steps ..." (the load phase: data, model, sharding, the restore) and over the whole run, for a
  fresh run of 2 steps that saves, its resume to step 3, and the control of equal length (the same 3 steps
  uninterrupted), per checkpoint type and backend (FSDP1 and FSDP2, one after the other; --fsdp_version for
  one alone), as multiples of the fp32 model.

- `writer`: who pays for a background save, on an otherwise idle machine: the CPU seconds of the training
  process (staging, handing over, and a writer thread's write) and of DCP's writer processes, per save, for
  each background writer DCP offers (a thread, a process) and each backend: the choice of
  utils/checkpoint/background.py, and its control, the other writer.

`--repo` runs another checkout's T5_training.py (the control: the same measurement without the change).
"""

import argparse
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from configs.paths import REPO_ROOT  # noqa: E402
from scripts.benchmark import markdown_table  # noqa: E402
from scripts.make_random_t5 import make  # noqa: E402

BATCH = 4
COMMON = ["--mixed_precision", "false", "--run_validation", "false", "--eval_rouge", "false",
          "--max_source_length", "128", "--max_target_length", "32", "--batch_size_training", str(BATCH),
          "--log_every_n_steps", "1"]  # fmt: skip
TRAINING_STARTS = re.compile(r"INFO training steps \d+-\d+")  # the load phase is over
FREE_CORE_MARGIN = 0.2  # cores other processes may take before --nproc 1's spare core is no longer spare


class Load(NamedTuple):
    """CPU seconds since boot at one moment: the machine's busy and idle time (all cores), that of the watched
    run's processes, and the time rank 0's main thread has waited to run (runnable, not running)."""

    busy_s: float
    idle_s: float
    run_s: float
    rank0_waited_s: float


def launch(repo: Path, args: list[str], log: Path, nproc: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--standalone",
               str(repo / "T5_training.py"), *args]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    return subprocess.Popen(command, cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                            text=True, errors="replace", bufsize=1)  # fmt: skip


def children(pid: int) -> list[int]:
    """The process's children, those of all its threads (the agent's are the ranks)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(child) for child in (task / "children").read_text().split()]
        except OSError:
            pass
    return sorted(found)


def rank_zero(ranks: list[int]) -> int | None:
    """Which of the ranks' processes is rank 0, from the RANK torchrun sets in each one's environment."""
    for pid in ranks:
        try:
            if b"\0RANK=0\0" in b"\0" + Path(f"/proc/{pid}/environ").read_bytes():
                return pid
        except OSError:
            pass
    return None


def machine_ticks() -> tuple[int, int]:
    """The machine's busy and idle time since boot, all cores together, in clock ticks (/proc/stat). A core
    another guest holds (steal) counts as busy, one waiting for the disk (iowait) as idle."""
    first_line = Path("/proc/stat").read_text().split("\n", 1)[0]
    user, nice, system, idle, iowait, irq, softirq, steal = (int(field) for field in first_line.split()[1:9])
    return user + nice + system + irq + softirq + steal, idle + iowait


def process_tree_ticks(root: int) -> int:
    """CPU time of `root` and every process under it, in clock ticks: each one's own (utime, stime) and that of
    its children already reaped (cutime, cstime), so a process that ends still counts, once."""
    total, pending = 0, [root]
    while pending:
        pid = pending.pop()
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended since its parent listed it
        total += sum(int(field) for field in fields[11:15])
        pending += children(pid)
    return total


def waited_to_run_s(pid: int) -> float:
    """Seconds the process's main thread has spent runnable but not running (its schedstat's second field)."""
    return int(Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()[1]) / 1e9


def load_now(rank0: int) -> Load:
    """The machine's CPU time, that of this watcher and everything under it (torchrun, the ranks, DCP's writer
    processes: the run, with the watcher counted once), and rank 0's wait to run."""
    tick = os.sysconf("SC_CLK_TCK")
    busy, idle = machine_ticks()
    return Load(busy / tick, idle / tick, process_tree_ticks(os.getpid()) / tick, waited_to_run_s(rank0))


def peak_rss(pid: int) -> int | None:
    """VmHWM: the process's resident-memory high-water mark, in bytes."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def run_and_watch(
    repo: Path, args: list[str], log: Path, nproc: int, poll_s: float, metrics: Path | None = None
) -> dict:
    """One run: every step record's arrival time and the machine's load then (with `metrics`), each rank's
    highest VmHWM reading until training starts (rank 0 logs "training steps ...") and over the whole run, read
    every `poll_s` seconds (the run resets VmHWM at each epoch's start: the last reading would miss the load
    phase)."""
    process = launch(repo, args, log, nproc)
    lines: list[str] = []
    training_seen = threading.Event()

    def read_output() -> None:
        for line in process.stdout:
            lines.append(line)
            if TRAINING_STARTS.search(line):
                training_seen.set()

    reader = threading.Thread(target=read_output, daemon=True)
    reader.start()
    arrivals: dict[int, float] = {}
    loads: dict[int, Load] = {}  # at each step's arrival
    unread = b""  # metrics.jsonl's last line, until it is complete
    load_peaks: dict[int, int] = {}
    run_peaks: dict[int, int] = {}
    pids: list[int] = []
    rank0 = None
    with contextlib.ExitStack() as files:
        records = None  # metrics.jsonl, read from where the last poll stopped
        while process.poll() is None:
            pids = pids if len(pids) == nproc else children(process.pid)
            if rank0 is None and len(pids) == nproc:
                rank0 = rank_zero(pids)
            for pid in pids:
                peak = peak_rss(pid)
                if peak is not None:
                    run_peaks[pid] = max(peak, run_peaks.get(pid, 0))
                    if training_seen.is_set() and pid not in load_peaks:
                        load_peaks[pid] = run_peaks[pid]
            if records is None and metrics is not None and metrics.exists():
                records = files.enter_context(metrics.open("rb"))
            if records is not None:
                complete, _, unread = (unread + records.read()).rpartition(b"\n")
                now = time.perf_counter()
                read = [json.loads(line) for line in complete.decode().splitlines()]
                arrived = [r["step"] for r in read if r.get("type") == "step" and r["step"] not in arrivals]
                load = load_now(rank0) if arrived else None
                for step in arrived:
                    arrivals[step], loads[step] = now, load
            time.sleep(poll_s)
    reader.join(10)
    log.write_text("".join(lines))
    if process.returncode != 0:
        raise SystemExit(f"run failed (exit {process.returncode}): see {log}")
    return {
        "arrivals": arrivals,
        "loads": loads,
        "load_peaks": [load_peaks.get(pid) for pid in pids],
        "run_peaks": [run_peaks.get(pid) for pid in pids],
    }


WRITERS = {  # case: (FSDP version, DCP's writer, staged into shared memory)
    "FSDP2, writer process, shared memory (the package's)": (2, "process", True),
    "FSDP2, writer thread (the control)": (2, "thread", False),
    "FSDP1, writer thread (the package's)": (1, "thread", False),
    "FSDP1, writer process (the control)": (1, "process", False),
}
SAVES = 4


def writer(args, work: Path) -> list[dict]:
    model = str(work / "model")
    make(args.model, model)
    results = []
    for case in WRITERS:
        out = work / f"writer{len(results)}"
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc),
                   "--standalone", __file__, "writer_worker", "--case", case, "--model", model,
                   "--out", str(out)]  # fmt: skip
        env = dict(os.environ, OMP_NUM_THREADS="1")
        done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"{case} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        result = json.loads((out / "result.json").read_text())
        shutil.rmtree(out)  # its checkpoints: GBs each
        results.append({"case": case, **result})
        print(f"{case}: {result}", flush=True)
    return results


def writer_worker(args) -> None:
    """One rank: the model sharded, one optimizer step, then SAVES background saves of its state (the first,
    which starts a writer process, left out of the figures)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import BlockingAsyncStager, DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    from configs.fsdp import FSDPConfig
    from policies.mixed_precision import Precision
    from utils.checkpoint.integrity import RecordingWriter
    from utils.checkpoint.state_dicts import model_and_optimizer_state, tensor_only_optimizer_state
    from utils.fsdp.parallelism import parallelism_for
    from utils.model.loading import load_model

    dist.init_process_group("gloo")
    version, kind, shared = WRITERS[args.case]
    cpu = torch.device("cpu")
    config = FSDPConfig(fsdp_version=version, mixed_precision=False, fsdp_activation_checkpointing=False)
    parallelism = parallelism_for(config, dist.get_world_size())
    model = parallelism.wrap(load_model(args.model), precision=Precision("fp32_policy"), device=cpu)
    optimizer = torch.optim.AdamW(model.parameters())
    ids = torch.randint(2, 1000, (2, 16))
    model(input_ids=ids, labels=ids[:, :8].clone()).loss.backward()
    optimizer.step()
    model_state, optim_state = model_and_optimizer_state(model, optimizer, False, cpu, parallelism)
    payload = {"model": model_state, "optim": tensor_only_optimizer_state(optim_state)}
    group = dist.new_group(backend="gloo")
    stager = DefaultStager(StagingOptions(False, True, False, False)) if shared else BlockingAsyncStager()
    writer_type = AsyncCheckpointerType.PROCESS if kind == "process" else AsyncCheckpointerType.THREAD
    main_cpu, child_cpu, stalls = [], [], []
    for save in range(SAVES + 1):
        children_before = _children_cpu()
        before, started = time.process_time(), time.perf_counter()
        writer = RecordingWriter(str(Path(args.out) / str(save)))
        future = dcp.async_save(payload, storage_writer=writer, process_group=group,
                                async_checkpointer_type=writer_type, async_stager=stager)  # fmt: skip
        stall = time.perf_counter() - started
        future.result()
        if save:  # the first save starts the writer process: left out
            main_cpu.append(time.process_time() - before)
            child_cpu.append(_children_cpu() - children_before)
            stalls.append(stall)
        dist.barrier()
    if dist.get_rank() == 0:
        result = {"stall_s": statistics.median(stalls), "training_process_cpu_s": statistics.median(main_cpu),
                  "writer_process_cpu_s": statistics.median(child_cpu)}  # fmt: skip
        (Path(args.out) / "result.json").write_text(json.dumps(result))
    dist.barrier()
    stager.close()
    dist.destroy_process_group()


def _children_cpu() -> float:
    """CPU seconds of this process's children (DCP's writer process), from /proc."""
    total = 0.0
    for task in Path(f"/proc/{os.getpid()}/task").glob("*"):
        try:
            children = (task / "children").read_text().split()
        except OSError:
            continue
        for pid in children:
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def stall(args, work: Path) -> list[dict]:
    model = str(work / "model")
    make(args.model, model)
    base = ["--model_name", model, "--fsdp_version", str(args.fsdp_version or 2), "--epochs", "1",
            "--num_train_samples", str(args.steps * BATCH * args.nproc), *COMMON]  # fmt: skip
    saving = ["--checkpoint_type", "SHARDED_STATE_DICT", "--save_every_n_steps", str(args.save_every),
              "--keep_last_n", "2"]  # fmt: skip
    cases = {
        "no checkpoints": ["--keep_last_n", "0"],
        "synchronous saves": saving,
        "--async_checkpoint true": [*saving, "--async_checkpoint", "true"],
    }
    chosen = {
        case: flags for case, flags in cases.items()
        if not args.cases or case in args.cases or case == "no checkpoints"
    }  # fmt: skip
    results = []
    # The cases in turn, A B C A B C: a load that drifts over the hour falls on each alike
    for round_ in range(1, args.repeats + 1):
        for case, case_args in chosen.items():
            out = work / f"stall{len(results)}"
            watched = run_and_watch(
                args.repo, [*base, *case_args, "--output_dir", str(out)], work / f"{out.name}.log", args.nproc,
                args.poll_s, metrics=out / "metrics.jsonl",
            )  # fmt: skip
            shutil.rmtree(out)
            result = {"case": case, "round": round_, **stall_figures(case, watched, args)}
            results.append(result)
            print(f"{case}, round {round_}: {result['wall_s']:.2f} s from step {args.save_every} to {args.steps}; "
                  f"cores: the run's {result['run_cores']:.2f}, others' {result['others_cores']:.2f}, idle "
                  f"{result['idle_cores']:.2f}; rank 0 waited to run {seconds(result['rank0_waited_s'])} s in "
                  "the two steps after each save", flush=True)  # fmt: skip
    for result in results:
        plain = next(r for r in results if r["round"] == result["round"] and r["case"] == "no checkpoints")
        result["lost_s"] = result["wall_s"] - plain["wall_s"]
        result["lost_per_save_s"] = result["lost_s"] / result["saves"] if result["saves"] else 0.0
    return results


def stall_figures(case: str, watched: dict, args) -> dict:
    """One run's figures, from the step of the first save (the writer process's start is left out) to the last:
    its time and step gaps, the two steps after each save over two of its usual ones, and meanwhile the cores
    it took, those other processes took and those left idle, and rank 0's wait to run after each save."""
    arrivals, loads, first, steps = watched["arrivals"], watched["loads"], args.save_every, args.steps
    gaps = [arrivals[step + 1] - arrivals[step] for step in range(first, steps)]
    all_gaps = {step: arrivals[step] - arrivals[step - 1] for step in range(2, steps + 1)}
    save_steps = [step for step in range(first, steps) if step % args.save_every == 0]
    after = {step + k for step in save_steps for k in (1, 2)}
    usual = statistics.median(gap for step, gap in all_gaps.items() if step > 2 and step not in after)
    wall = arrivals[steps] - arrivals[first]
    start, end = loads[first], loads[steps]
    run_cores = (end.run_s - start.run_s) / wall
    others_cores = (end.busy_s - start.busy_s) / wall - run_cores
    return {
        "wall_s": wall,
        "median_gap_s": statistics.median(gaps),
        "saves": 0 if case == "no checkpoints" else len(save_steps),
        "two_steps_after_a_save_s": statistics.mean(
            all_gaps[step + 1] + all_gaps.get(step + 2, usual) - 2 * usual for step in save_steps
        ),
        "gaps": all_gaps,
        "run_cores": run_cores,
        "others_cores": others_cores,
        "idle_cores": (end.idle_s - start.idle_s) / wall,
        "rank0_waited_s": [
            loads[min(step + 2, steps)].rank0_waited_s - loads[step].rank0_waited_s for step in save_steps
        ],
        # --nproc 1's premise: the background writer has a core of its own; with 2 ranks every core trains
        "core_free_for_writer": others_cores <= FREE_CORE_MARGIN if args.nproc == 1 else None,
    }


def resume(args, work: Path) -> list[dict]:
    model = str(work / "model")
    parameters = make(args.model, model)
    model_bytes = 4 * parameters
    results = []
    for version in [args.fsdp_version] if args.fsdp_version else [1, 2]:
        base = ["--model_name", model, "--fsdp_version", str(version), "--epochs", "1", "--num_train_samples",
                str(4 * BATCH * args.nproc), "--save_every_n_steps", "2", *COMMON]  # fmt: skip
        for checkpoint_type in ("FULL_STATE_DICT", "SHARDED_STATE_DICT"):
            out = work / f"resume_fsdp{version}_{checkpoint_type}"
            # The control of equal length: a resume to step 3 trains one step and saves once more than the run
            # it continues; the same 3 steps uninterrupted, in a folder of their own, do as much.
            control = work / f"{out.name}_control"
            for folder in (out, control):  # a failed invocation's leftovers would refuse the fresh runs
                shutil.rmtree(folder, ignore_errors=True)
            runs = [  # (run, output_dir, flags, whether its folder is removed after it)
                ("fresh, 2 steps", out, ["--max_steps", "2"], False),  # the resume continues in its folder
                ("resumed to step 3", out, ["--max_steps", "3", "--resume", "true"], True),
                ("uninterrupted to step 3", control, ["--max_steps", "3"], True),
            ]
            for run, folder, extra, done in runs:
                run_args = [*base, "--checkpoint_type", checkpoint_type, "--output_dir", str(folder), *extra]
                watched = run_and_watch(args.repo, run_args, work / f"{out.name}_{len(results)}.log", args.nproc,
                                        args.poll_s)  # fmt: skip
                results.append({"fsdp_version": version, "checkpoint_type": checkpoint_type, "run": run,
                                "model_bytes": model_bytes, "load_peaks": watched["load_peaks"],
                                "run_peaks": watched["run_peaks"]})  # fmt: skip
                print(f"FSDP{version} {checkpoint_type} {run}: load {watched['load_peaks']}, "
                      f"run {watched['run_peaks']}", flush=True)  # fmt: skip
                if done:
                    shutil.rmtree(folder)
    return results


def stall_markdown(results: list[dict], args) -> str:
    def case(r: dict) -> str:
        return r["case"] if args.repeats == 1 else f"{r['case']}, round {r['round']}"

    free = {True: "yes", False: "no", None: "-"}
    rows = [
        f"| {case(r)} | {r['wall_s']:.2f} | {r['median_gap_s']:.3f} | {r['saves']} | {r['lost_s']:.2f} "
        f"| {r['lost_per_save_s']:.2f} | {r['two_steps_after_a_save_s']:.2f} | {r['others_cores']:.2f} "
        f"| {r['idle_cores']:.2f} | {seconds(r['rank0_waited_s'])} | {free[r['core_free_for_writer']]} |"
        for r in results
    ]
    header = (
        f"| {args.model}, FSDP{args.fsdp_version or 2}, steps {args.save_every}-{args.steps} | wall (s) | median "
        "step gap (s) | saves | lost to saves (s) | lost per save (s) | two steps after a save, over the run's "
        "usual (s) | cores other processes took | idle cores | rank 0 waited to run, two steps after each save "
        "(s) | a core free for the writer |"
    )
    crowded = [r for r in results if r["core_free_for_writer"] is False]
    if not crowded:
        return markdown_table(header, rows)
    cases = "; ".join(f"{case(r)} ({r['others_cores']:.2f})" for r in crowded)
    return markdown_table(header, rows) + (
        f"\nNo core free for the writer: other processes took more than {FREE_CORE_MARGIN} of a core during the "
        f"steps of {cases}. The background save's cost against a synchronous one is then not that of a spare "
        "core (--nproc 1's premise): discard it, or run again when the machine is quieter.\n"
    )


def seconds(values: list[float]) -> str:
    """Several durations in one cell: "0.12, 3.40"."""
    return ", ".join(f"{value:.2f}" for value in values)


def resume_markdown(results: list[dict], args) -> str:
    def multiples(peaks: list, model_bytes: int) -> str:
        return " / ".join("-" if peak is None else f"{peak / model_bytes:.2f}" for peak in peaks)

    rows = [
        f"| FSDP{r['fsdp_version']} | {r['checkpoint_type']} | {r['run']} "
        f"| {multiples(r['load_peaks'], r['model_bytes'])} | {multiples(r['run_peaks'], r['model_bytes'])} |"
        for r in results
    ]
    ranks = " / ".join(f"rank {rank}" for rank in range(args.nproc))
    header = (
        f"| {args.model} (fp32 model = 1) | checkpoint type | run | load-phase peak, {ranks} | whole-run peak, "
        f"{ranks} |"
    )
    return markdown_table(header, rows)


def writer_markdown(results: list[dict], args) -> str:
    rows = [
        f"| {r['case']} | {r['stall_s']:.2f} | {r['training_process_cpu_s']:.2f} "
        f"| {r['writer_process_cpu_s']:.2f} |"
        for r in results
    ]
    header = (
        f"| {args.model}, per save, rank 0 (median of {SAVES}) | training stopped (s) | training process CPU (s) "
        "| writer process CPU (s) |"
    )
    return markdown_table(header, rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("measure", choices=["stall", "resume", "writer", "writer_worker"])
    parser.add_argument("--case", help="writer_worker: the case (run by `writer` under torchrun)")
    parser.add_argument("--model", default="t5-small", help="a scripts/make_random_t5.py shape")
    parser.add_argument(
        "--fsdp_version", type=int, choices=[1, 2],
        help="stall: the backend (2 by default); resume: this one alone (by default both, one after the other)",
    )  # fmt: skip
    parser.add_argument("--nproc", type=int, default=2, help="ranks (torchrun's --nproc_per_node); 1 on one GPU")
    parser.add_argument("--steps", type=int, default=20, help="stall: steps of each run")
    parser.add_argument("--save_every", type=int, default=4, help="stall: a checkpoint every N steps")
    parser.add_argument("--cases", nargs="+", help="stall: only these cases (besides the run without checkpoints)")
    parser.add_argument(
        "--repeats", type=int, default=1,
        help="stall: rounds of the cases, run in turn (A B C A B C); each round's losses are against its own run "
        "without checkpoints",
    )  # fmt: skip
    parser.add_argument(
        "--poll_s", type=float, default=0.02,
        help="stall, resume: seconds between two readings of the run (metrics.jsonl's new records, /proc). The "
        "watcher's CPU comes out of the ranks' where no core is spare: every 5 ms it took 0.09 of a core here "
        "(reading the whole file then); every 20 ms a step's arrival is known to 0.02 s of a 5 s CPU step. On a "
        "GPU, whose steps take 0.1-0.2 s, use 0.005",
    )  # fmt: skip
    parser.add_argument(
        "--repo", type=Path, default=REPO_ROOT, help="the checkout to run (a control: another one)"
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.measure == "writer_worker":
        writer_worker(args)
        return 0
    args.repo = args.repo.resolve()
    measure, markdown = {"stall": (stall, stall_markdown), "resume": (resume, resume_markdown),
                         "writer": (writer, writer_markdown)}[args.measure]  # fmt: skip
    results = measure(args, args.out)
    table = markdown(results, args)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    (args.out / "table.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
