"""How a streaming conversion is spread over processes and nodes, and how their results meet.

Every process plans the same checkpoint (the plan is deterministic; digests are compared) and
writes its own share of the chunks as `__{worker}_{n}.distcp` into the shared staging directory.
Worker 0 (node 0's first process) is the coordinator: once every other worker has handed back
its write results, it writes `.metadata`, meta and side files and renames the directory into place.

* One node, `--workers N`: the coordinator starts workers 1..N-1 as local processes.
* Several nodes (`--nodes M --node-rank R --run-id ID`, one launch per node, e.g. `srun`): node R
  leads workers R·N..R·N+N-1 and starts its own N-1 local helpers. The staging directory must be on
  storage all nodes share. Node 0 prepares it and stamps it with the run id; other nodes wait for
  that stamp before writing, so a stale directory from an earlier attempt is never mixed in.

Each worker > 0 leaves `.moe_sft_worker_{i}.results` (written atomically: temp file + rename)
with its run id, plan digest and write results, or `.moe_sft_worker_{i}.failed` with its error.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import subprocess
import sys
import time
import traceback
from pathlib import Path

from moe_sft.conversion.mcore_io import CONVERT_STAMP as RUN_STAMP
from moe_sft.conversion.mcore_io import staging_stamp

POLL_S = 2.0
_LAUNCHER_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)


@dataclasses.dataclass
class WorkerSpec:
    """`count` workers in all, `count // nodes` per node; this process is worker `index`."""

    count: int = 1
    index: int = 0
    hf_path: str | None = None  # workers > 0 re-read the same checkpoint
    digest: str | None = None  # a local helper's leader's plan digest, checked by the helper
    nodes: int = 1
    run_id: str = "local"
    node_timeout_s: float = 24 * 3600

    def __post_init__(self):
        if self.count < 1 or self.nodes < 1 or self.count % self.nodes:
            raise ValueError(
                f"{self.count} workers over {self.nodes} nodes: use the same number of "
                "workers (1 or more) on every node"
            )

    @property
    def per_node(self) -> int:
        return self.count // self.nodes

    @property
    def leads_node(self) -> bool:
        """Started by the user (or srun), not by another worker: it starts this node's helpers."""
        return self.index % self.per_node == 0

    def local_helpers(self) -> range:
        return range(self.index + 1, self.index + self.per_node) if self.leads_node else range(0)


# ------------------------------------------------------------------------------------------------
# The shared staging directory
# ------------------------------------------------------------------------------------------------


def _stamped_run(stamp: Path) -> str | None:
    """The run id in a staging stamp (its first line; the second names the HF source)."""
    try:
        return stamp.read_text().partition("\n")[0]
    except FileNotFoundError:
        return None


def prepare_staging(staging: Path, spec: WorkerSpec) -> None:
    """Node 0 makes the directory (replacing what an interrupted run left: mcore_io.check_output
    has made sure it is one) and stamps it; other nodes wait."""
    import shutil

    stamp = Path(staging) / RUN_STAMP
    if spec.index == 0:
        left = staging_stamp(staging) if Path(staging).is_dir() else None
        if _stamped_run(stamp) != spec.run_id:
            if Path(staging).exists():
                print(f"replacing {staging}: {left or 'left by an earlier write'}", file=sys.stderr, flush=True)
            shutil.rmtree(staging, ignore_errors=True)
        else:
            print(f"reusing {staging}: {left} (the same --run-id)", file=sys.stderr, flush=True)
        Path(staging).mkdir(parents=True, exist_ok=True)
        _write_atomic(stamp, f"{spec.run_id}\n{spec.hf_path or ''}".encode())
        return
    _wait(
        lambda: _stamped_run(stamp) == spec.run_id,
        spec.node_timeout_s,
        f"node 0 to prepare {staging} for run {spec.run_id!r} (is the output on shared storage, "
        "and was node 0 started with the same --output and --run-id?)",
    )


def _results_file(staging, worker: int) -> Path:
    return Path(staging) / f".moe_sft_worker_{worker}.results"


def _failed_file(staging, worker: int) -> Path:
    return Path(staging) / f".moe_sft_worker_{worker}.failed"


def _log_file(staging, worker: int) -> Path:
    return Path(staging) / f".moe_sft_worker_{worker}.log"


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def hand_back(staging, spec: WorkerSpec, digest: str, results: list) -> None:
    """A worker > 0 leaves its write results for the coordinator."""
    _write_atomic(
        _results_file(staging, spec.index), pickle.dumps({"run_id": spec.run_id, "digest": digest, "results": results})
    )


def report_failure(staging, spec: WorkerSpec) -> None:
    """Called with an exception in flight: the coordinator raises it with this text."""
    if spec.index > 0 and Path(staging).is_dir():
        _write_atomic(_failed_file(staging, spec.index), traceback.format_exc()[-3000:].encode())


# ------------------------------------------------------------------------------------------------
# Local helper processes
# ------------------------------------------------------------------------------------------------


def threads_per_worker(spec: WorkerSpec) -> int | None:
    """torch threads for each of several workers on a node: the cores shared out, unless
    OMP_NUM_THREADS says otherwise (processes parallelise reading, transposing and writing better
    than torch's intra-op threads: docs/conversion_at_scale.md)."""
    if spec.per_node <= 1 or "OMP_NUM_THREADS" in os.environ:
        return None
    return max(1, (os.cpu_count() or 1) // spec.per_node)


def start_local_helpers(
    staging, spec: WorkerSpec, digest: str, max_chunk_bytes: int, threads: int | None = None
) -> dict[int, subprocess.Popen]:
    """This node's other workers, as processes running `moe_sft.conversion.convert_worker`."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_ENV}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    repo = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([repo] + [p for p in [env.get("PYTHONPATH")] if p])
    procs = {}
    for index in spec.local_helpers():
        cmd = [
            sys.executable,
            "-m",
            "moe_sft.conversion.convert_worker",
            "--hf-path",
            spec.hf_path,
            "--staging",
            str(staging),
            "--worker",
            str(index),
            "--workers",
            str(spec.count),
            "--nodes",
            str(spec.nodes),
            "--run-id",
            spec.run_id,
            "--digest",
            digest,
            "--max-chunk-bytes",
            str(max_chunk_bytes),
        ]
        with open(_log_file(staging, index), "w") as log_file:
            procs[index] = subprocess.Popen(cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    return procs


def check_helpers(staging, procs: dict[int, subprocess.Popen]) -> None:
    """Fail fast (during the writes) when a local helper has died."""
    for index, proc in procs.items():
        if proc.poll() not in (None, 0):
            raise _worker_failed(staging, index, f"exit {proc.returncode}")


def wait_local_helpers(staging, procs: dict[int, subprocess.Popen]) -> None:
    for index, proc in procs.items():
        if proc.wait() != 0:
            raise _worker_failed(staging, index, f"exit {proc.returncode}")
        _log_file(staging, index).unlink(missing_ok=True)


def stop(procs: dict[int, subprocess.Popen]) -> None:
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _worker_failed(staging, index: int, how: str) -> RuntimeError:
    """The worker's own output goes into the message: its files go with the staging dir."""
    text = ""
    for path in (_failed_file(staging, index), _log_file(staging, index)):
        if path.exists():
            text = path.read_text()[-3000:]
            break
    return RuntimeError(f"conversion worker {index} failed ({how}):\n{text}")


# ------------------------------------------------------------------------------------------------
# The coordinator collects everyone's results
# ------------------------------------------------------------------------------------------------


def collect_results(staging, spec: WorkerSpec, digest: str, procs: dict[int, subprocess.Popen]) -> list[list]:
    """Write results of workers 1..count-1: local ones once their process exits, other nodes' when
    their results file appears (or their .failed file, or the timeout)."""
    wait_local_helpers(staging, procs)
    collected = []
    for index in range(1, spec.count):
        path, failed = _results_file(staging, index), _failed_file(staging, index)

        def arrived() -> bool:
            if failed.is_file():
                raise _worker_failed(staging, index, "on its node")
            return path.is_file()

        _wait(arrived, spec.node_timeout_s, f"worker {index} (node {index // spec.per_node}) of run {spec.run_id!r}")
        handed = pickle.loads(path.read_bytes())
        if handed["run_id"] != spec.run_id or handed["digest"] != digest:
            raise RuntimeError(
                f"worker {index} planned {handed['digest']} for run "
                f"{handed['run_id']!r}, the coordinator {digest} for {spec.run_id!r}: "
                "different code, input or --run-id on that node"
            )
        collected.append(handed["results"])
        path.unlink()
    return collected


def _wait(ready, timeout_s: float, what: str) -> None:
    started = last_note = time.time()
    while not ready():
        now = time.time()
        if now - started > timeout_s:
            raise TimeoutError(f"waited {timeout_s:.0f}s for {what}")
        if now - last_note > 60:
            print(f"  still waiting for {what} ({now - started:.0f}s)", file=sys.stderr, flush=True)
            last_note = now
        time.sleep(POLL_S)
