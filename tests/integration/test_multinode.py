"""Multi-node launches on one host, as CPU processes (gloo): two "nodes" of one process each, started the way
a cluster starts them, train one run as global ranks 0 and 1.

* **torchrun** (``python -m torch.distributed.run --nnodes 2 --nproc-per-node 1 --node-rank N`` with the
  static ``--master-addr/--master-port`` rendezvous; the ``c10d`` rendezvous ignores ``--node-rank`` and
  numbers the nodes itself (tried: the node started first became rank 0), so which one writes is not
  known in advance), each node running ``train.py ... trainer=cpu trainer.strategy=ddp trainer.num_nodes=2
  trainer.devices=1``:
  Lightning detects the TorchElastic environment (``TORCHELASTIC_RUN_ID``; ranks from ``RANK``,
  ``LOCAL_RANK``, ``GROUP_RANK``, ``WORLD_SIZE``) and starts no process of its own.
* **srun**: the variables srun sets for 2 tasks on 2 nodes (``SLURM_NTASKS``, ``SLURM_PROCID``,
  ``SLURM_NODEID``, ...), read by Lightning's ``SLURMEnvironment``; the main address comes from
  ``SLURM_NODELIST``.
* **sbatch**: the script submitit writes for ``hydra/launcher=slurm`` (rendered here, not submitted).

Each 2-node run must: finish on both nodes; write only from global rank 0 (its run directory holds exactly
the files of a one-process run with the same global batch; node 1 computes the same run directory and
writes nothing anywhere, nor does either node write into the shared working directory); shard the data by
*global* rank: the validation losses equal the one-process run's (4 rows per rank x 2 = 8 rows) within
``RTOL`` and the two ranks' memory streams differ and together are the one-process streams. That check
was verified by an experiment: sharding by the *local* rank (0 on both nodes, i.e. both nodes reading the
same rows; ``xfam.data.module._dist`` patched to return ``LOCAL_RANK``) gave validation losses off by
1.3e-4, 3.3e-4 and 1.0e-3 (relative) at steps 2, 5 and 8, weights off by up to 1e-2, and bit-identical
memory streams on both ranks, so three of the checks below fail for it.

Stops: both torchrun nodes killed (SIGKILL of the process groups of each node's launcher and ranks:
torchrun starts every rank in a session of its own) after the first checkpoint and relaunched with
``ckpt_path=auto`` continue exactly; in the SLURM job, SIGUSR1 sent to node 1's task alone stops both at
the same step with a checkpoint, rank 0 alone requeues the job, and the requeued tasks continue to the
uninterrupted run's per-step losses bit for bit.

One file over 400 lines: the launch forms share the node environments, the one-process reference and the checks,
read together.

Every start has a deadline: a rendezvous that hangs kills the process groups and fails the test.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from omegaconf import DictConfig

from tests.integration.helpers import ROOT

NODES = 2
#: Lightning's DDP over 2 nodes of 1 process; the processes are started from outside (torchrun or srun).
MULTINODE = ["trainer=cpu", "trainer.strategy=ddp", f"trainer.num_nodes={NODES}", "trainer.devices=1"]
#: Seconds a launch may take before its process groups are killed (a run takes ~20 s on 2 busy cores).
TIMEOUT = 300
JOB = "4242"
#: Variables of a launcher that an outer job (pytest run inside SLURM or torchrun) would leak into the nodes.
LAUNCH_VARS = {
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
}
LAUNCH_PREFIXES = ("SLURM_", "TORCHELASTIC_", "JSM_NAMESPACE_", "OMPI_COMM_WORLD_", "PMI_")


# -- processes ------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_env(runs: Path, **extra: str) -> dict[str, str]:
    """This environment without any launcher's variables, single-threaded, offline, writing runs to ``runs``."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and not k.startswith(LAUNCH_PREFIXES)}
    env.pop("XFAM_DEBUG", None)
    return {
        **env,
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
        "XFAM_RUNS": str(runs),
        **extra,
    }


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (from ``/proc``: Linux)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])  # "pid (comm) state ppid ..."
            children.setdefault(ppid, []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        out.append(todo.pop())
        todo += children.get(out[-1], [])
    return out


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


class Cluster:
    """The processes of one launch: one per node, each in its own process group (a node's whole tree),
    run in a shared working directory, output to ``<logs>/node<N>.txt``."""

    def __init__(self, cwd: Path, logs: Path):
        self.cwd, self.logs = cwd, logs
        cwd.mkdir(parents=True, exist_ok=True)
        logs.mkdir(parents=True, exist_ok=True)
        self.procs: list[subprocess.Popen] = []

    def start(self, args: list[str], env: dict[str, str]) -> subprocess.Popen:
        with open(self.logs / f"node{len(self.procs)}.txt", "w") as out:
            proc = subprocess.Popen(
                args, cwd=self.cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.procs.append(proc)
        return proc

    def output(self, node: int) -> str:
        return (self.logs / f"node{node}.txt").read_text()

    def tails(self) -> str:
        return "\n".join(f"--- node {i}:\n{self.output(i)[-2500:]}" for i in range(len(self.procs)))

    def kill(self) -> None:
        """SIGKILL every node's processes, as a lost allocation: the process group of each process of its
        tree (torchrun starts each rank in a session of its own: killing the launcher's group alone leaves
        the ranks training, and writing, without it)."""
        pids = [pid for proc in self.procs for pid in process_tree(proc.pid)]
        groups = set()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                groups.add(os.getpgid(pid))
        for group in groups:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
        for proc in self.procs:
            proc.wait()
        deadline = time.monotonic() + 30
        while (left := [pid for pid in pids if alive(pid)]) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not left, f"processes {left} survived SIGKILL"

    def wait(self, timeout: float = TIMEOUT) -> list[int]:
        """Every node's exit status; past ``timeout`` all are killed and the test fails."""
        deadline = time.monotonic() + timeout
        try:
            return [p.wait(timeout=max(0.1, deadline - time.monotonic())) for p in self.procs]
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"the nodes did not finish within {timeout} s (a hung rendezvous?):\n{self.tails()}")

    def wait_for(self, ready: Callable[[], bool], what: str, timeout: float = TIMEOUT) -> None:
        """Poll until ``ready()``; a node ending first, or the deadline, fails the test."""
        deadline = time.monotonic() + timeout
        while not ready():
            if any(p.poll() is not None for p in self.procs) or time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"training ended or stalled before {what}:\n{self.tails()}")
            time.sleep(0.02)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        if any(p.poll() is None for p in self.procs):  # a failed assertion or an error: nothing left running
            self.kill()


@contextlib.contextmanager
def cluster(tmp: Path, name: str) -> Iterator[Cluster]:
    with Cluster(tmp / name / "cwd", tmp / name / "logs") as c:
        yield c


def torchrun(node: int, port: int, args: list[str]) -> list[str]:
    """The command of one node of a 2-node, 1-process-per-node torchrun job (static rendezvous)."""
    rdzv = ["--master-addr", "127.0.0.1", "--master-port", str(port)]
    nodes = ["--nnodes", str(NODES), "--nproc-per-node", "1", "--node-rank", str(node)]
    return [sys.executable, "-m", "torch.distributed.run", *nodes, *rdzv, str(ROOT / "train.py"), *args]


def srun_env(runs: Path, node: int, port: int, scontrol: Path, **extra: str) -> dict[str, str]:
    """What srun sets for task ``node`` of a job of 2 nodes x 1 task (``sbatch --nodes=2 --ntasks-per-node=1``),
    and a ``scontrol`` that appends its arguments to ``scontrol`` (the file). No ``MASTER_ADDR``: Lightning
    takes the first host of ``SLURM_NODELIST``."""
    bin_dir = scontrol.parent / "bin"
    if not bin_dir.is_dir():
        bin_dir.mkdir(parents=True)
        (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {scontrol}\n')
        (bin_dir / "scontrol").chmod(0o755)
    env = node_env(runs, **extra)
    return {
        **env,
        "PATH": f"{bin_dir}{os.pathsep}{env['PATH']}",
        "SLURM_JOB_ID": JOB,
        "SLURM_JOB_NAME": "xfam-multinode",  # not "bash"/"interactive": Lightning uses SLURMEnvironment
        "SLURM_NNODES": str(NODES),
        "SLURM_JOB_NUM_NODES": str(NODES),
        "SLURM_NTASKS": str(NODES),  # its presence is how Lightning tells that srun started the process
        "SLURM_NTASKS_PER_NODE": "1",
        "SLURM_PROCID": str(node),
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": str(node),
        "SLURM_NODELIST": "127.0.0.1",
        "SLURM_JOB_NODELIST": "127.0.0.1",
        "MASTER_PORT": str(port),  # (else 15000 + the job id's last 4 digits)
    }


# -- runs -----------------------------------------------------------------------------------------------------
def run_args(corpus: Path, batch: int) -> list[str]:
    """The stateful tiny run of test_distributed (XL memory per rank, Performer features), ``batch`` rows per rank."""
    from tests.integration.test_distributed import STATEFUL, data

    return [*STATEFUL, *data(corpus, batch)]


def the_run(runs: Path) -> Path:
    """The one run directory under ``runs``: every node computed the same one, and none made another."""
    found = sorted(runs.glob("*/*"))
    assert len(found) == 1, found
    return found[0]


def files(run_dir: Path) -> list[Path]:
    return sorted(p.relative_to(run_dir) for p in run_dir.rglob("*"))


def check_two_nodes(runs: Path, c: Cluster, one: Path) -> Path:
    """The assertions every 2-node run shares (see the module docstring); returns its run directory."""
    from tests.integration.test_distributed import trains_as_one_process

    run_dir = the_run(runs)
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in c.output(1), c.tails()  # node 1 is global rank 1
    assert not any(c.cwd.iterdir()), list(c.cwd.iterdir())  # nothing in the shared working directory
    assert files(run_dir) == files(one)  # only rank 0 writes: nothing per rank or per node
    trains_as_one_process(run_dir, one, ranks=NODES)  # each global rank its own rows and memory streams
    return run_dir


@pytest.fixture(scope="module")
def one_process(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same run in one process with the global batch (8 rows): the reference of every 2-node run."""
    from tests.integration.test_distributed import run

    return run(run_args(corpus, 8), tmp_path_factory.mktemp("one"))  # (as name=d)


@pytest.fixture(scope="module")
def torchrun_run(corpus: Path, one_process: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Cluster]:
    """An uninterrupted 2-node torchrun run, 4 rows per rank; its runs folder and nodes."""
    tmp = tmp_path_factory.mktemp("torchrun")
    port, args = free_port(), ["name=d", *run_args(corpus, 4), *MULTINODE]
    with cluster(tmp, "nodes") as c:
        for node in range(NODES):
            c.start(torchrun(node, port, args), node_env(tmp / "runs"))
        assert c.wait() == [0] * NODES, c.tails()
    return tmp / "runs", c


@pytest.mark.slow  # one-process run + 2-node run: ~30 s
def test_torchrun_two_nodes_train_as_one_process_with_the_global_batch(
    torchrun_run: tuple[Path, Cluster], one_process: Path
) -> None:
    check_two_nodes(*torchrun_run, one_process)


@pytest.mark.slow  # killed and resumed 2-node runs: ~40 s
def test_torchrun_nodes_killed_then_relaunched_continue_exactly(
    torchrun_run: tuple[Path, Cluster], corpus: Path, tmp_path: Path
) -> None:
    from tests.integration.test_crash_safety import same_losses
    from tests.integration.test_distributed import val_losses
    from tests.integration.test_train import step_losses

    runs, args = tmp_path / "runs", ["name=d", *run_args(corpus, 4), *MULTINODE]
    with cluster(tmp_path, "killed") as c:
        port = free_port()
        for node in range(NODES):
            c.start(torchrun(node, port, args), node_env(runs))
        c.wait_for(lambda: bool(list(runs.glob("d/*/checkpoints/step-0000003.ckpt"))), "step-0000003.ckpt")
        c.kill()  # both nodes at once, each with its ranks
    run_dir = the_run(runs)
    assert max(step_losses(run_dir)) < 8, "killed mid-run"
    with cluster(tmp_path, "relaunched") as c:  # the same command on both nodes, a new rendezvous
        port = free_port()
        for node in range(NODES):
            c.start(torchrun(node, port, [*args, "ckpt_path=auto"]), node_env(runs))
        assert c.wait() == [0] * NODES, c.tails()
    resumed = re.search(r"resuming from (\S+) at step (\d+)", c.output(0))
    # from last.ckpt, or step-N.ckpt when the kill came before last.ckpt was written
    assert resumed and Path(resumed[1]).parent == run_dir / "checkpoints" and int(resumed[2]) in (3, 6), c.tails()
    assert the_run(runs) == run_dir
    reference = the_run(torchrun_run[0])
    same_losses(step_losses(run_dir), step_losses(reference))
    same_losses(val_losses(run_dir), val_losses(reference))  # a kill after a checkpoint loses its validation row


@pytest.mark.slow  # one 2-node FSDP run (the one-process run is shared): ~25 s
def test_torchrun_two_nodes_train_sharded_as_one_process(corpus: Path, one_process: Path, tmp_path: Path) -> None:
    """``trainer=fsdp`` (FSDP2, the ranks started by torchrun, not by Lightning) over 2 "nodes": the training of one
    process with the global batch, and sharded checkpoints with one shard file per node's rank."""
    from tests.integration.test_distributed import trains_as_one_process

    fsdp = ["trainer=fsdp_cpu", "trainer.strategy=fsdp", "trainer.num_nodes=2", "trainer.devices=1"]
    args = ["name=d", *run_args(corpus, 4), *fsdp]
    with cluster(tmp_path, "fsdp") as c:
        port = free_port()
        for node in range(NODES):
            c.start(torchrun(node, port, args), node_env(tmp_path / "runs"))
        assert c.wait() == [0] * NODES, c.tails()
    run_dir = the_run(tmp_path / "runs")
    assert "units: one unit per block (2)" in c.output(0)
    trains_as_one_process(run_dir, one_process, ranks=NODES)
    shards = sorted(p.name for p in (run_dir / "checkpoints" / "last.ckpt").iterdir())
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]


def srun(c: Cluster, runs: Path, args: list[str], scontrol: Path, **extra: str) -> None:
    """Start the 2 tasks of one SLURM job step."""
    port = free_port()
    for node in range(NODES):
        c.start([sys.executable, str(ROOT / "train.py"), *args], srun_env(runs, node, port, scontrol, **extra))


@pytest.fixture(scope="module")
def slurm_run(corpus: Path, one_process: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Cluster]:
    """An uninterrupted run of a 2-node SLURM job (``ckpt_path=auto``, as hydra/launcher=slurm runs it)."""
    tmp = tmp_path_factory.mktemp("slurm")
    with cluster(tmp, "tasks") as c:
        srun(c, tmp / "runs", ["name=d", *run_args(corpus, 4), *MULTINODE, "ckpt_path=auto"], tmp / "scontrol.txt")
        assert c.wait() == [0] * NODES, c.tails()
    assert not (tmp / "scontrol.txt").exists()  # nothing requeued
    return tmp / "runs", c


@pytest.mark.slow  # one 2-node run (the one-process run is shared): ~20 s
def test_srun_tasks_on_two_nodes_train_as_one_process_with_the_global_batch(
    slurm_run: tuple[Path, Cluster], one_process: Path
) -> None:
    check_two_nodes(*slurm_run, one_process)
    assert not list(slurm_run[0].rglob("hpc_ckpt*"))  # Lightning's SLURM handler stayed off


@pytest.mark.slow  # stopped and requeued 2-node runs: ~40 s
def test_usr1_to_one_node_stops_both_and_the_requeued_job_continues_exactly(
    slurm_run: tuple[Path, Cluster], corpus: Path, tmp_path: Path
) -> None:
    import torch

    from tests.integration.test_train import step_losses

    runs, record = tmp_path / "runs", tmp_path / "scontrol.txt"
    args = ["name=d", *run_args(corpus, 4), *MULTINODE, "ckpt_path=auto"]
    with cluster(tmp_path, "signalled") as c:
        srun(c, runs, args, record)
        c.wait_for(lambda: bool(list(runs.glob("d/*/checkpoints/step-0000003.ckpt"))), "step-0000003.ckpt")
        c.procs[1].send_signal(signal.SIGUSR1)  # to node 1's task only: the ranks agree at the step's end
        codes = c.wait()
    assert codes == [128 + signal.SIGUSR1] * NODES, c.tails()
    run_dir = the_run(runs)
    step = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["global_step"]
    assert 3 < step < 9, step  # stopped mid-run, after the signal
    assert set(step_losses(run_dir)) == set(range(step))  # every trained step logged, none past the checkpoint
    assert record.read_text() == f"requeue {JOB}\n"  # by rank 0 alone, once
    with cluster(tmp_path, "requeued") as c:  # the requeued job: the same tasks, the same command
        srun(c, runs, args, record, SLURM_RESTART_COUNT="1")
        assert c.wait() == [0] * NODES, c.tails()
    assert f"resuming from {run_dir / 'checkpoints' / 'last.ckpt'} at step {step}" in c.output(0)
    assert step_losses(run_dir) == step_losses(the_run(slurm_run[0]))  # bit-identical, every step once
    assert record.read_text() == f"requeue {JOB}\n"


# -- the SLURM submission ---------------------------------------------------------------------------------------
SUBMISSION = ["hydra/launcher=slurm", "trainer=ddp", "hydra.launcher.gpus_per_node=4", "hydra.launcher.nodes=2"]


def hydra_cfg(overrides: list[str]) -> DictConfig:
    """The composed config with its ``hydra`` section (as ``train.py -m <overrides>`` launches it)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from xfam.training.run_names import CONFIG_DIR, register_resolvers

    register_resolvers()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("train", overrides=overrides, return_hydra_config=True)
    GlobalHydra.instance().clear()
    return cfg


class Submitted(Exception):
    """Raised instead of running sbatch: the submission file's text and the executor's requeue budget."""


def sbatch_script(cfg: DictConfig, monkeypatch: pytest.MonkeyPatch) -> tuple[str, int]:
    """The sbatch file the submitit launcher of ``cfg`` writes for one job (through its own ``launch``,
    with ``srun`` taken as present and ``sbatch`` not run), and submitit's ``max_num_timeout``."""
    from hydra.utils import instantiate
    from submitit.slurm.slurm import SlurmExecutor

    def submit(self: SlurmExecutor, command: str) -> None:
        raise Submitted(self._make_submission_file_text(command, "uid"), self.max_num_timeout)

    monkeypatch.setattr(SlurmExecutor, "affinity", classmethod(lambda cls: 2))  # "srun is on PATH"
    monkeypatch.setattr(SlurmExecutor, "_submit_command", submit)
    launcher = instantiate(cfg.hydra.launcher)
    launcher.config = cfg  # what setup() stores; launch() reads nothing else of the Hydra context
    with pytest.raises(Submitted) as sub:
        launcher.launch([["trainer=ddp", "ckpt_path=auto"]], initial_job_idx=0)
    return sub.value.args


def test_slurm_launcher_asks_for_one_task_per_gpu_usr1_before_the_limit_and_runs_through_srun(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    monkeypatch.setenv("XFAM_RUNS", str(tmp_path))  # launch() creates the sweep and submitit folders
    cfg = hydra_cfg(SUBMISSION)
    launcher = cfg.hydra.launcher
    assert (launcher.nodes, launcher.gpus_per_node, launcher.tasks_per_node) == (2, 4, 4)  # one task per GPU
    assert launcher.additional_parameters.signal == f"USR1@{launcher.signal_delay_s}" == "USR1@120"
    script, max_num_timeout = sbatch_script(cfg, monkeypatch)
    flags = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    for flag in ("--nodes=2", "--ntasks-per-node=4", "--gpus-per-node=4", "--signal=USR1@120", "--cpus-per-task=8"):
        assert f"#SBATCH {flag}" in flags, (flag, script)
    assert [f for f in flags if f.startswith("#SBATCH --signal")] == ["#SBATCH --signal=USR1@120"]  # not USR2
    # every task runs the job through srun: 2 x 4 processes, each a Lightning rank (SLURMEnvironment)
    (command,) = [line for line in script.splitlines() if "submitit.core._submit" in line]
    assert command.startswith("srun ") and f"{sys.executable} -u -m submitit.core._submit" in command
    # submitit requeues on its own signal (USR2) only, which this job never gets: max_num_timeout bounds
    # nothing here; xfam's Preemption requeues on USR1 (scontrol requeue), which `#SBATCH --requeue` allows
    # whatever the cluster's JobRequeue default
    assert max_num_timeout == launcher.max_num_timeout == 5
    assert "#SBATCH --requeue" in flags


def test_slurm_nodes_follow_lightnings_num_nodes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    monkeypatch.setenv("XFAM_RUNS", str(tmp_path))
    cfg = hydra_cfg(["hydra/launcher=slurm", "trainer=ddp", "trainer.num_nodes=2", "hydra.launcher.gpus_per_node=4"])
    # each task's Lightning checks num_nodes == SLURM_NNODES and devices == SLURM_NTASKS_PER_NODE (devices=auto:
    # the GPUs a task sees, --gpus-per-node)
    assert cfg.trainer.devices in ("auto", cfg.hydra.launcher.tasks_per_node)
    assert "#SBATCH --nodes=2" in sbatch_script(cfg, monkeypatch)[0]


def test_a_launcher_asking_for_other_nodes_than_the_trainer_is_refused_before_submission(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Lightning's SLURMEnvironment would refuse the mismatch only on the nodes, after the queue."""
    from xfam.core.errors import ConfigError
    from xfam.training.precheck import precheck

    monkeypatch.setattr("xfam.training.precheck.shutil.which", lambda name: f"/usr/bin/{name}")  # a login node

    with pytest.raises(ConfigError, match=r"hydra.launcher.nodes=2 but trainer.num_nodes=1.*Fix: trainer.num_nodes=2"):
        precheck(["-m", *SUBMISSION])  # hydra.launcher.nodes=2, trainer.num_nodes=1
    with pytest.raises(ConfigError, match=r"tasks_per_node=4 but trainer.devices=2"):
        precheck(["-m", "hydra/launcher=slurm", "trainer=ddp", "hydra.launcher.gpus_per_node=4", "trainer.devices=2"])
    with pytest.raises(ConfigError, match="a sweep over trainer.num_nodes"):
        precheck(["-m", "hydra/launcher=slurm", "trainer=ddp", "trainer.num_nodes=1,2"])
    precheck(["-m", "hydra/launcher=slurm", "trainer=ddp", "trainer.num_nodes=2", "hydra.launcher.gpus_per_node=4"])


def test_slurm_from_a_machine_without_slurm_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """submitit would stop in a traceback ('Could not detect "srun"') after Hydra made the sweep's folder."""
    from xfam.core.errors import ConfigError
    from xfam.training.precheck import precheck

    monkeypatch.setattr("xfam.training.precheck.shutil.which", lambda name: None)
    with pytest.raises(ConfigError) as err:
        precheck(["-m", "hydra/launcher=slurm", "trainer=ddp", "pos=rope,alibi"])
    assert len(err.value.problems) == 1 and "no srun on PATH" in str(err.value) and "login node" in str(err.value)
