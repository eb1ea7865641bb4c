"""Submit mcpo-megatron training through nemo-run (0.11.1): SLURM (SSH or local tunnel) or this machine.

    # on a SLURM login node (local tunnel), 4 nodes x 8 GPUs:
    python -m launch.run --config configs/qwen3_32b_mcpo.yaml --executor slurm --nodes 4 --gpus-per-node 8 \\
        --account ACCT --partition batch --time 04:00:00
    # from a laptop (SSH tunnel; the repository is checked out on the cluster at --remote-repo):
    python -m launch.run --config configs/qwen3_8b_mcpo.yaml --executor slurm --tunnel ssh --host login.example \\
        --user me --job-dir /lustre/me/nemo-run --remote-repo /lustre/me/mcpo-megatron --account ACCT
    # this machine, torchrun with 2 processes:
    python -m launch.run --config configs/cpu_smollm2_arith.yaml --executor local --gpus-per-node 2
    # asynchronous RL: 3 nodes train, the last one generates, generation overlapping training by one step:
    python -m launch.run --config configs/qwen3_8b_mcpo.yaml --executor slurm --nodes 4 --rollout-nodes 1 \
        trainer.max_staleness=1

Both executors run the same program as ``slurm/train.sbatch``: the SLURM executor starts one srun task per GPU
through ``slurm/task.sh`` (rank layout from SLURM, rendezvous on the first node); the local executor runs
torchrun with ``--gpus-per-node`` processes. Arguments after the options are ``key=value`` config overrides.

``exp.run()`` does not raise when a job fails, so the launcher reads the job's final state and exits 0 only on
SUCCEEDED (1 otherwise, 2 on bad arguments). Automatic checkpoint-and-requeue on preemption is the sbatch
script's job (``slurm/train.sbatch``); a job launched here resumes from ``latest`` when launched again with the
same ``trainer.output_dir`` (``trainer.resume=auto``).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m launch.run",
        description="Submit `mcpo train CONFIG [overrides]` through nemo-run's SlurmExecutor "
                    "(one srun task per GPU) or LocalExecutor (torchrun), wait for it, and exit non-zero unless "
                    "it SUCCEEDED.",
        epilog="Overrides go after the options, e.g. `... --executor local trainer.total_steps=3`.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", required=True, help="YAML config (path relative to the repository root or absolute)")
    p.add_argument("--executor", choices=("slurm", "local"), default="slurm")
    p.add_argument("--nodes", type=int, default=1, help="nodes")
    p.add_argument("--gpus-per-node", type=int, default=8,
                   help="ranks per node (one per GPU; on CPU clusters the number of processes)")
    p.add_argument("--gpus", dest="request_gpus", action=argparse.BooleanOptionalAction, default=None,
                   help="request --gpus-per-node GPUs from SLURM (default: yes unless --container-image is "
                        "unset and the partition has none; pass --no-gpus on CPU clusters)")
    p.add_argument("--rollout-nodes", type=int, default=0,
                   help="give the last N nodes to the rollout engines (rollout.placement=separate, "
                        "rollout.ranks=N x --gpus-per-node); with the local executor, N x --gpus-per-node of the "
                        "processes must be fewer than all of them, so use --rollout-ranks there")
    p.add_argument("--rollout-ranks", type=int, default=0,
                   help="give the last R ranks to the rollout engines (rollout.placement=separate, rollout.ranks=R)")
    p.add_argument("--job-name", default="mcpo-train")
    p.add_argument("--account", default=None, help="SLURM account")
    p.add_argument("--partition", default=None, help="SLURM partition")
    p.add_argument("--time", default="04:00:00", help="SLURM time limit")
    p.add_argument("--container-image", default=None, help="pyxis/enroot image (srun --container-image)")
    p.add_argument("--container-mounts", default="", help="extra mounts src:dst[,src:dst]")
    p.add_argument("--tunnel", choices=("local", "ssh"), default="local",
                   help="local: this machine is a SLURM login node; ssh: submit over SSH to --host")
    p.add_argument("--host", default=None, help="SSH login host (--tunnel ssh)")
    p.add_argument("--user", default=os.environ.get("USER"), help="SSH user (--tunnel ssh)")
    p.add_argument("--identity", default=None, help="SSH private key (--tunnel ssh)")
    p.add_argument("--job-dir", default=None,
                   help="nemo-run base directory on the cluster; experiments go to <job-dir>/experiments "
                        "(default: <repository>/runs/nemo-run)")
    p.add_argument("--remote-repo", default=None,
                   help="repository checkout on the cluster (default: this repository's path, i.e. a shared "
                        "filesystem)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment for the ranks (repeatable), e.g. MCPO_VENV=/path/to/venv")
    p.add_argument("--detach", action="store_true", help="(slurm) submit and return without waiting")
    p.add_argument("--dryrun", action="store_true", help="print what would be submitted and exit")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    return p


def _check_args(args) -> list[str]:
    errors = []
    if args.nodes < 1:
        errors.append(f"--nodes={args.nodes} must be >= 1")
    if args.gpus_per_node < 1:
        errors.append(f"--gpus-per-node={args.gpus_per_node} must be >= 1")
    if args.executor == "local" and args.nodes != 1:
        errors.append(f"--nodes={args.nodes}: the local executor runs on this machine only; use --nodes 1")
    if args.executor == "slurm" and args.tunnel == "ssh" and not args.host:
        errors.append("--tunnel ssh needs --host (the cluster's login node)")
    if args.rollout_nodes and args.rollout_ranks:
        errors.append("--rollout-nodes and --rollout-ranks say the same thing: give one")
    if args.rollout_nodes and not 0 < args.rollout_nodes < args.nodes:
        errors.append(f"--rollout-nodes={args.rollout_nodes} must leave nodes to train: 1 to {args.nodes - 1} of "
                      f"--nodes={args.nodes}")
    if args.rollout_ranks and not 0 < args.rollout_ranks < args.nodes * args.gpus_per_node:
        errors.append(f"--rollout-ranks={args.rollout_ranks} must leave ranks to train: 1 to "
                      f"{args.nodes * args.gpus_per_node - 1}")
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        errors.append(f"overrides {bad} must be written key=value")
    for kv in args.env:
        errors += _env_errors(kv, args.executor)
    return errors


def _env_errors(kv: str, executor: str) -> list[str]:
    key, sep, _ = kv.partition("=")
    if not sep:
        return [f"--env {kv!r} must be KEY=VALUE"]
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
        return [f"--env {kv!r}: {key!r} is not an environment variable name (letters, digits and _, not starting "
                "with a digit)"]
    if executor == "slurm" and key != key.upper():
        return [f"--env {kv!r}: the SLURM script nemo-run writes exports it as {key.upper()}; write the name in "
                "capitals"]
    return []


def _config_path(args, repo: Path) -> str:
    path = Path(args.config)
    return str(path if path.is_absolute() else repo / path)


def make_slurm_executor(args):
    """nemo-run ``SlurmExecutor``: one task per GPU, ``job_dir`` = ``<base>/experiments`` on the cluster."""
    import nemo_run as run

    base = args.job_dir or str(REPO / "runs" / "nemo-run")
    job_dir = os.path.join(base, "experiments")
    if args.tunnel == "ssh":
        tunnel = run.SSHTunnel(host=args.host, user=args.user, job_dir=job_dir, identity=args.identity)
    else:
        os.makedirs(job_dir, exist_ok=True)
        tunnel = run.LocalTunnel(job_dir=job_dir)
    repo = args.remote_repo or str(REPO)
    env = {"MCPO_REPO": repo, "GPUS_PER_NODE": str(args.gpus_per_node)}
    env.update(dict(kv.split("=", 1) for kv in args.env))
    # nemo-run writes `export KEY=value` into the sbatch script as given: quoted here for that shell, so that a
    # space does not cut a value and $(...) in one is not run on the node
    env = {key: shlex.quote(value) for key, value in env.items()}
    request_gpus = args.request_gpus if args.request_gpus is not None else True
    executor = run.SlurmExecutor(
        account=args.account or "",
        job_name_prefix="nemo-",          # nemo-run derives a prefix from the account otherwise
        partition=args.partition,
        time=args.time,
        nodes=args.nodes,
        ntasks_per_node=args.gpus_per_node,
        gpus_per_node=args.gpus_per_node if request_gpus else None,
        container_image=args.container_image,
        container_mounts=[m for m in args.container_mounts.split(",") if m]
        + ([f"{repo}:{repo}"] if args.container_image else []),
        tunnel=tunnel,
        packager=run.Packager(),          # the code is already on the cluster (shared filesystem / checkout)
        env_vars=env,
        srun_args=["--kill-on-bad-exit=1"],
        monitor_group_job=False,
        poll_estimated_start_time=False,
    )
    if not args.account:
        executor.account = None  # no --account line: the cluster's default account
    return executor, base, repo


def make_local_executor(args):
    """nemo-run ``LocalExecutor`` running torchrun (``--gpus-per-node`` processes on this machine)."""
    import nemo_run as run

    from mcpo_megatron.parallel.threads import threads_per_process

    env = {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        # the venv's python/torchrun first, whatever shell started us
        "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]),
        # the threads `mcpo train` gives each process (1 left a core idle for a single process on a CPU machine)
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(threads_per_process(args.gpus_per_node))),
    }
    env.update(dict(kv.split("=", 1) for kv in args.env))
    executor = run.LocalExecutor(ntasks_per_node=1, env_vars=env)   # one torchrun, which starts the ranks
    base = args.job_dir or str(REPO / "runs" / "nemo-run")
    return executor, base, str(REPO)


def placement_overrides(args) -> list[str]:
    """``--rollout-nodes`` / ``--rollout-ranks`` as config overrides (the engines take the launch's last ranks)."""
    ranks = getattr(args, "rollout_ranks", 0) or getattr(args, "rollout_nodes", 0) * args.gpus_per_node
    return ["rollout.placement=separate", f"rollout.ranks={ranks}"] if ranks else []


def make_task(args, repo: str):
    """The program: ``python -m mcpo_megatron.cli train CONFIG overrides`` (through slurm/task.sh on SLURM)."""
    import nemo_run as run

    config = args.config if os.path.isabs(args.config) else os.path.join(repo, args.config)
    overrides = [*placement_overrides(args), *args.overrides]
    if args.executor == "slurm":
        # nemo-run writes the arguments into the sbatch script as they are: quoted here for its shell
        return run.Script(path=os.path.join(repo, "slurm", "task.sh"), entrypoint="bash",
                          args=["-m", "mcpo_megatron.cli", "train", *map(shlex.quote, [config, *overrides])])
    # torchrun as the program, not nemo-run's torchrun launcher: that launcher shell-quotes every argument
    # while torchx's local scheduler starts it without a shell, so an override holding a space or one of
    # |&;<>()$ arrived with its quotes ("'data.train=..." read as an unknown key)
    return run.Script(path="torch.distributed.run", m=True, entrypoint="python",
                      args=["--standalone", f"--nproc-per-node={args.gpus_per_node}",
                            "-m", "mcpo_megatron.cli", "train", config, *overrides])


def final_states(exp, timeout_s: float = 120.0) -> dict[str, str]:
    """``{job id: state name}`` after ``exp.run()`` returned (it does not raise on a failed job).

    The scheduler is asked again (sacct for SLURM) until every job is in a terminal state, because the job
    objects can still hold the state seen at submission.
    """
    import time

    from torchx.specs import AppState, is_terminal

    deadline = time.monotonic() + timeout_s
    while True:
        states = {}
        for job in exp.jobs:
            state = job.status(runner=exp._runner)
            if not is_terminal(state) and is_terminal(getattr(job, "state", AppState.UNKNOWN)):
                state = job.state
            states[job.id] = state
        if all(is_terminal(s) for s in states.values()) or time.monotonic() > deadline:
            return {k: getattr(v, "name", str(v)) for k, v in states.items()}
        time.sleep(2)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_intermixed_args(argv)
    errors = _check_args(args)
    if not Path(_config_path(args, REPO)).is_file() and not (args.remote_repo and args.tunnel == "ssh"):
        errors.append(f"--config {args.config}: no such file (relative paths are taken from {REPO})")
    if errors:
        for e in errors:
            print(f"launch.run: {e}", file=sys.stderr)
        return 2

    import nemo_run as run

    if args.executor == "slurm":
        executor, base, repo = make_slurm_executor(args)
    else:
        executor, base, repo = make_local_executor(args)
    task = make_task(args, repo)
    print(f"launch.run: {args.executor} executor, {args.nodes} node(s) x {args.gpus_per_node} ranks: "
          f"{shlex.join([task.path, *task.args])}", flush=True)
    with run.Experiment(args.job_name, base_dir=base, log_level="WARN", enable_goodbye_message=False) as exp:
        exp.add(task, executor=executor, name=args.job_name)
        if args.dryrun:
            exp.dryrun(log=True)
            return 0
        exp.run(detach=args.detach and args.executor == "slurm", tail_logs=False)
        if args.detach and args.executor == "slurm":
            print(f"launch.run: submitted (detached); experiment {exp._id} under {base}", flush=True)
            return 0
        states = final_states(exp)
    ok = bool(states) and all(s == "SUCCEEDED" for s in states.values())
    for name, state in states.items():
        print(f"launch.run: job {name}: {state}", flush=True)
    if not ok:
        print(f"launch.run: FAILED; logs under {base}/experiments (or {base})", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
