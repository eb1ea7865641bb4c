"""Submit a sweep (the cross product of node counts and config values) as one nemo-run Experiment.

    # MCPO vs DAPO at 1, 2 and 4 nodes of 8 GPUs on a SLURM login node:
    python -m launch.sweep --config configs/qwen3_8b_mcpo.yaml --nodes 1,2,4 --set algorithm.name=mcpo,dapo \\
        --sweep-dir runs/sweeps/q8 --executor slurm --account ACCT --partition batch --time 04:00:00
    # print the points only:
    python -m launch.sweep --config configs/cpu_smollm2_arith.yaml --nodes 1,2 --set rollout.n=2,4 --dry-run
    # then:
    mcpo report runs/sweeps/q8 --out runs/sweeps/q8/report
    # three seeds of three algorithms (seed first, so the arms interleave in a sequential sweep):
    python -m launch.sweep --config configs/cpu_study_arith2.yaml --set seed=1,2,3 --set algorithm.name=mcpo,dapo,grpo

The ``seed`` axis is a pseudo-key: value S sets every key of ``--seed-keys`` to S (default ``trainer.seed`` and
``rollout.seed``: Megatron's RNG streams and the rollout sampling). ``data.seed`` is left alone by default, so
every seed trains on the same prompt pool and is evaluated on the same held-out problems (it picks both); add it
to ``--seed-keys`` to resample those too. ``mcpo report`` groups runs that differ only in seed keys and reports
mean +- interval over seeds.

Each point is one task of the Experiment, with its own executor (``--nodes`` of that point) and its own run
directory ``<sweep-dir>/<label>``, where the label names the varying values (``nodes-2_name-dapo``). Before
anything is submitted every point's config is loaded and validated for its world size (nodes x ranks per
node), and written resolved to ``<run dir>/config.yaml`` next to ``sweep_point.json`` (the point's nodes,
world size and overrides, which ``mcpo report`` reads). The trainer writes its metrics into the same directory
(``trainer.output_dir`` is set per point).

Executor options (``--executor``, ``--gpus-per-node``, ``--account``, ``--partition``, ``--time``, tunnel and
container options, ``--env``) are those of ``python -m launch.run``, whose executor and task builders are
reused. Arguments that are not options are ``key=value`` overrides common to every point. ``exp.run()`` does
not raise when a job fails, so the final state of every job is read back; the exit status is 0 only when every
point SUCCEEDED.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import re
import sys
from pathlib import Path

from launch import run as launcher

SWEEP_POINT_FILE = "sweep_point.json"  # read by mcpo_megatron.report.runs
SEED_AXIS = "seed"  # the pseudo-key of ``--set seed=1,2,3``
DEFAULT_SEED_KEYS = ("trainer.seed", "rollout.seed")
KNOWN_SEED_KEYS = ("trainer.seed", "rollout.seed", "data.seed")  # the report's seed keys (report.runs.SEED_KEYS)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m launch.sweep",
        description="Submit the cross product of --nodes and --set values through nemo-run (one Experiment, one "
                    "task per point, Slurm or Local executor), each point in <sweep-dir>/<label>.",
        epilog="Every option of `python -m launch.run` (except --nodes, --job-name, --dryrun) is accepted and "
               "applies to every point, e.g. --executor, --gpus-per-node, --account, --partition, --time, "
               "--container-image, --tunnel, --env. Plain key=value arguments are overrides for every point.",
        formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("--config", required=True, help="YAML config (relative to the repository root, or absolute)")
    p.add_argument("--nodes", default="1", help="comma-separated node counts, e.g. 1,2,4 (default 1)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=V1,V2,...",
                   help="a swept config key and its comma-separated values (repeatable; the sweep is the cross "
                        "product of all --set and --nodes values). KEY=seed is the seed axis: each value sets every "
                        "key of --seed-keys")
    p.add_argument("--seed-keys", default=",".join(DEFAULT_SEED_KEYS), metavar="KEY,...",
                   help="the config keys a value of the seed axis sets (default: trainer.seed,rollout.seed; add "
                        "data.seed to also resample the prompt pool, its order and the held-out problems)")
    p.add_argument("--sweep-dir", default=None,
                   help="parent of the run directories (default: runs/sweeps/<config name>)")
    p.add_argument("--name", default="mcpo-sweep", help="the nemo-run experiment name")
    p.add_argument("--sequential", action=argparse.BooleanOptionalAction, default=None,
                   help="run the points one after the other (default: yes with the local executor, no on SLURM)")
    p.add_argument("--dry-run", "--dryrun", dest="dry_run", action="store_true",
                   help="print the points (label, nodes, overrides, directory) and exit without submitting")
    return p


def _split_values(text: str, what: str) -> list[str]:
    values = [v.strip() for v in text.split(",")]
    if not values or any(not v for v in values):
        raise ValueError(f"{what}={text!r}: give comma-separated non-empty values, e.g. 1,2,4")
    if len(set(values)) != len(values):
        raise ValueError(f"{what}={text!r}: a value is repeated")
    return values


def parse_seed_keys(text: str) -> list[str]:
    """``--seed-keys`` -> the keys a seed value sets; each must be one of the report's seed keys."""
    keys = _split_values(text, "--seed-keys")
    bad = [k for k in keys if k not in KNOWN_SEED_KEYS]
    if bad:
        raise ValueError(f"--seed-keys={text!r}: {', '.join(bad)} is not a seed key; choose from "
                         f"{', '.join(KNOWN_SEED_KEYS)} (the keys mcpo report groups replicates by)")
    return keys


def parse_axes(nodes: str, sets: list[str]) -> tuple[list[int], list[tuple[str, list[str]]]]:
    """``--nodes`` and ``--set`` values -> (node counts, [(key, values)]); clear errors for bad input."""
    try:
        node_counts = [int(v) for v in _split_values(nodes, "--nodes")]
    except ValueError as e:
        raise ValueError(f"--nodes={nodes!r}: must be comma-separated positive integers, e.g. 1,2,4 ({e})") from None
    if any(n < 1 for n in node_counts):
        raise ValueError(f"--nodes={nodes!r}: node counts must be >= 1")
    axes: list[tuple[str, list[str]]] = []
    for s in sets:
        key, sep, values = s.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--set {s!r}: write KEY=V1,V2,... (e.g. --set algorithm.name=mcpo,dapo)")
        if key in (k for k, _ in axes):
            raise ValueError(f"--set {s!r}: key {key} is given twice; put all its values in one --set")
        axes.append((key.strip(), _split_values(values, f"--set {key}")))
    for key, values in axes:
        if key == SEED_AXIS and not all(re.fullmatch(r"-?\d+", v) for v in values):
            raise ValueError(f"--set seed={','.join(values)}: seeds must be integers, e.g. --set seed=1,2,3")
    keys = [k for k, _ in axes]
    if SEED_AXIS in keys:
        clash = [k for k in keys if k in KNOWN_SEED_KEYS]
        if clash:
            raise ValueError(f"--set {clash[0]}=... and --set seed=...: the seed axis already sets the seed keys; "
                             "sweep one of them, or choose the keys with --seed-keys")
    return node_counts, axes


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-")


def make_points(node_counts: list[int], axes: list[tuple[str, list[str]]],
                seed_keys: tuple[str, ...] | list[str] = DEFAULT_SEED_KEYS) -> list[dict]:
    """The cross product, one dict per point: label (from the keys that take more than one value; the last
    component of dotted keys, or the full key when two would clash), nodes, overrides, seed (the value of the
    seed axis, which sets every key of ``seed_keys``; None without one)."""
    varying = [k for k, vals in axes if len(vals) > 1]
    short = {k: k.rsplit(".", 1)[-1] for k in varying}
    if len(set(short.values())) < len(short):
        short = {k: k for k in varying}
    points = []
    for nodes, *values in itertools.product(node_counts, *(vals for _, vals in axes)):
        chosen = dict(zip((k for k, _ in axes), values))
        parts = ([f"nodes-{nodes}"] if len(node_counts) > 1 else []) + [
            f"{short[k]}-{chosen[k]}" for k in varying]
        label = "_".join(_slug(p) for p in parts) or "run"
        overrides = []
        for k, v in chosen.items():
            overrides += [f"{sk}={v}" for sk in seed_keys] if k == SEED_AXIS else [f"{k}={v}"]
        points.append({"label": label, "nodes": nodes, "overrides": overrides,
                       "seed": int(chosen[SEED_AXIS]) if SEED_AXIS in chosen else None})
    return points


def prepare_points(points: list[dict], config: str, common: list[str], sweep_dir: Path,
                   gpus_per_node: int) -> list[str]:
    """Load and validate every point's config for its world size; write ``config.yaml`` (resolved) and
    ``sweep_point.json`` into its run directory. Returns every problem found (nothing is written then)."""
    from mcpo_megatron.config import ConfigError, load_config, to_yaml, validate

    problems, resolved = [], []
    for p in points:
        p["run_dir"] = str(sweep_dir / p["label"])
        p["world_size"] = p["nodes"] * gpus_per_node
        p["all_overrides"] = [*common, *p["overrides"], f"trainer.output_dir={p['run_dir']}"]
        try:
            cfg = load_config(config, p["all_overrides"])
            validate(cfg, p["world_size"])
            resolved.append(to_yaml(cfg))
        except ConfigError as e:
            problems.append(f"point {p['label']} (world size {p['world_size']}): {e}")
    if problems:
        return problems
    for p, text in zip(points, resolved):
        d = Path(p["run_dir"])
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.yaml").write_text(text)
        (d / SWEEP_POINT_FILE).write_text(json.dumps(
            {k: p.get(k) for k in ("label", "nodes", "world_size", "seed", "overrides", "all_overrides")}
            | {"config": config},
            indent=2) + "\n")
    (sweep_dir / "sweep.json").write_text(json.dumps(
        {"config": config, "points": [{k: p.get(k) for k in ("label", "nodes", "world_size", "seed", "overrides",
                                                              "run_dir")} for p in points]}, indent=2) + "\n")
    return []


def slurm_seconds(text: str) -> int:
    """A SLURM time limit (``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH:MM:SS``, ``D-HH``) in seconds."""
    days, _, rest = text.rpartition("-") if "-" in text else ("0", "", text)
    parts = [int(x) for x in rest.split(":")]
    if "-" in text:  # D-HH, D-HH:MM, D-HH:MM:SS
        parts += [0] * (3 - len(parts))
        h, m, sec = parts
    else:
        h, m, sec = {1: (0, parts[0], 0), 2: (0, *parts), 3: tuple(parts)}[len(parts)]
    return int(days or 0) * 86400 + h * 3600 + m * 60 + sec


def main(argv=None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    run_parser = launcher.build_parser()
    try:
        base = run_parser.parse_intermixed_args([*rest, "--config", args.config])
    except SystemExit as e:
        return int(e.code or 2)
    try:
        node_counts, axes = parse_axes(args.nodes, args.sets)
        seed_keys = parse_seed_keys(args.seed_keys)
    except ValueError as e:
        print(f"launch.sweep: {e}", file=sys.stderr)
        return 2
    errors = []
    for n in node_counts:
        point_args = copy.copy(base)
        point_args.nodes = n
        errors += [e for e in launcher._check_args(point_args) if e not in errors]
    config = launcher._config_path(base, launcher.REPO)
    if not Path(config).is_file():
        errors.append(f"--config {args.config}: no such file (relative paths are taken from {launcher.REPO})")
    if errors:
        for e in errors:
            print(f"launch.sweep: {e}", file=sys.stderr)
        return 2

    sweep_dir = Path(args.sweep_dir or launcher.REPO / "runs" / "sweeps" / Path(config).stem).resolve()
    points = make_points(node_counts, axes, seed_keys)
    if args.dry_run:
        print(f"launch.sweep: {len(points)} point(s) of {config} under {sweep_dir} ({base.executor} executor, "
              f"{base.gpus_per_node} ranks per node)")
        for p in points:
            print(f"  {p['label']}: nodes={p['nodes']} {' '.join(p['overrides'] + base.overrides)} "
                  f"-> {sweep_dir / p['label']}")
        return 0

    problems = prepare_points(points, config, base.overrides, sweep_dir, base.gpus_per_node)
    if problems:
        for msg in problems:
            print(f"launch.sweep: {msg}", file=sys.stderr)
        return 2

    import nemo_run as run

    if base.job_dir is None:  # nemo-run's files next to the runs (job_dir = <base>/experiments)
        base.job_dir = str(sweep_dir / "nemo-run")
    sequential = args.sequential if args.sequential is not None else base.executor == "local"
    with run.Experiment(args.name, base_dir=base.job_dir, log_level="WARN", enable_goodbye_message=False) as exp:
        for p in points:
            point_args = copy.copy(base)
            point_args.nodes = p["nodes"]
            point_args.overrides = p["all_overrides"]
            point_args.job_name = p["label"]
            make = launcher.make_slurm_executor if base.executor == "slurm" else launcher.make_local_executor
            executor, _, repo = make(point_args)
            exp.add(launcher.make_task(point_args, repo), executor=executor, name=p["label"])
            print(f"launch.sweep: {p['label']}: {p['nodes']} node(s) x {base.gpus_per_node} ranks -> "
                  f"{p['run_dir']}", flush=True)
        exp.run(sequential=sequential, detach=base.detach and base.executor == "slurm", tail_logs=False)
        if base.detach and base.executor == "slurm":
            print(f"launch.sweep: submitted {len(points)} job(s) (detached) under {base.job_dir}", flush=True)
            return 0
        # exp.run() may return before the jobs end (SLURM dependencies of a sequential sweep): wait for the
        # final states up to the jobs' own time limits.
        try:
            limit = slurm_seconds(base.time)
        except (ValueError, KeyError):
            limit = 4 * 3600
        states = launcher.final_states(exp, timeout_s=limit * (len(points) if sequential else 1) + 300.0)
    failed = [name for name, state in states.items() if state != "SUCCEEDED"]
    for name, state in states.items():
        print(f"launch.sweep: {name}: {state}", flush=True)
    if len(states) != len(points) or failed:
        print(f"launch.sweep: FAILED ({len(failed)} of {len(points)} points); logs under {base.job_dir}",
              file=sys.stderr)
        return 1
    print(f"launch.sweep: all {len(points)} points SUCCEEDED; report with: mcpo report {sweep_dir} "
          f"--out {sweep_dir / 'report'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
