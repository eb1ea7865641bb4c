"""Two gloo ranks through the trainer's run-directory and resume steps (tests/trainer/test_run_lock.py).

argv: RESULTS_DIR LOCKED_RUN_DIR RESUME_RUN_DIR VIEWS_DIR. Phase 1: prepare_run_dir on a directory another process
has locked. Phase 2: start_run (resume=auto) where only rank 1's RNG file of the newest checkpoint is damaged.
Phase 3: start_run (resume=auto) where the ranks see different checkpoint directories (VIEWS_DIR/rank<r>: rank 1's
view lags behind rank 0's), then the preemption path's latest_step. Each rank writes what it saw to
RESULTS_DIR/rank<r>.json; the harness's timeout catches a hang."""

import contextlib
import io
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/trainer: test_resume_fallback
from test_resume_fallback import FakeSetup  # noqa: E402

from mcpo_megatron.config import load_config  # noqa: E402
from mcpo_megatron.parallel.distributed import ParallelInfo  # noqa: E402
from mcpo_megatron.trainer import loop, run_dir  # noqa: E402
from mcpo_megatron.trainer.checkpoint import CheckpointManager  # noqa: E402


def main() -> None:
    results, locked, resumed, views = (Path(a) for a in sys.argv[1:5])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    info = ParallelInfo(rank=rank, world_size=world, local_rank=rank, tp=1, pp=1, dp=world, tp_rank=0, pp_rank=0,
                        dp_rank=rank, is_first_stage=True, is_last_stage=True, tp_group=None, pp_group=None,
                        dp_group=None, device=torch.device("cpu"))
    seen = {}
    try:
        run_dir.prepare_run_dir(load_config(None, [f"trainer.output_dir={locked}", "trainer.resume=auto"]), info)
        seen["refusal"] = None
    except Exception as e:  # noqa: BLE001  recorded for the test to check
        seen["refusal"] = [type(e).__name__, str(e)]

    cfg = load_config(None, [f"trainer.output_dir={resumed}", "trainer.resume=auto", "logging.tensorboard=false",
                             "trainer.total_steps=8"])
    s = FakeSetup(cfg=cfg, info=info)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.ExitStack() as closing:
        step, _ = loop.start_run(s, CheckpointManager(resumed / "checkpoints", rank=rank), closing)
    seen.update(step=step, sampler=s.sampler_state, policy_loaded=s.policy_loaded, printed=printed.getvalue())

    cfg = load_config(None, [f"trainer.output_dir={views / 'run'}", "trainer.resume=auto",
                             "logging.tensorboard=false", "trainer.total_steps=8"])
    s = FakeSetup(cfg=cfg, info=info)
    ckpt = CheckpointManager(views / f"rank{rank}", rank=rank)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.ExitStack() as closing:
        step, _ = loop.start_run(s, ckpt, closing)
    seen["views"] = {"step": step, "policy_loaded": s.policy_loaded, "latest_step": ckpt.latest_step()}
    (results / f"rank{rank}.json").write_text(json.dumps(seen))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
