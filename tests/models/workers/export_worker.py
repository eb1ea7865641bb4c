"""Worker (torchrun, TP = the number of ranks): a bf16 checkpoint of a tiny Qwen3-MoE trained one step, then
``mcpo export`` of it in these processes (launched with TP x PP ranks, so it runs here), recording whether it
builds the training machinery.

Usage: export_worker.py ROOT SEED.  Writes under ROOT: ``model/`` (the tiny HF model), ``checkpoints/step_000001``
(the policy saved by the trainer's checkpoint manager, bf16, with sequence parallelism at TP > 1 as megatron
trains experts), ``reference/`` (the policy's bf16 weights exported directly from the training policy: what the
checkpoint holds, under Hugging Face names), ``export/`` (the command's output), ``rank_R.json`` (each rank's exit
code and output and the policy / DDP / optimizer constructions it made) and ``compare.json``: the tensor-by-tensor
comparisons of ``export/`` with ``reference/`` and of ``reference/`` with the initial model.
"""

import contextlib
import io
import json
import os
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

from mcpo_megatron import cli  # noqa: E402
from mcpo_megatron.config import load_config, to_yaml  # noqa: E402
from mcpo_megatron.models.batch import SequenceBatch  # noqa: E402
from mcpo_megatron.models.tiny import make_tiny_model_with_tokenizer  # noqa: E402
from mcpo_megatron.parallel.distributed import barrier, init_distributed  # noqa: E402


def make_checkpoint(root: Path, seed: int, tp: int) -> Path:
    """The MoE recipe's rehearsal config at TP=``tp`` (no expert or data parallelism), bf16, on a tiny Qwen3-MoE;
    one optimizer step, then a checkpoint written as the trainer writes it. Returns the checkpoints directory."""
    from mcpo_megatron.models.hf_export import export_hf
    from mcpo_megatron.trainer.checkpoint import CheckpointManager
    from mcpo_megatron.trainer.components import build_policy

    info = init_distributed(tp, 1, seed=seed)
    model = root / "model"
    if info.rank == 0:
        make_tiny_model_with_tokenizer(model, family="qwen3_moe", seed=seed)
    barrier()
    cfg = load_config(str(REPO / "configs/rehearsal/qwen3_30b_a3b_mcpo.yaml"), [
        f"model.path={model}", "model.dtype=bf16", f"parallelism.tensor_model_parallel_size={tp}",
        "parallelism.expert_model_parallel_size=1", f"parallelism.sequence_parallel={str(tp > 1).lower()}",
        "optimizer.lr=1e-2", "optimizer.lr_warmup_steps=0", f"trainer.output_dir={root / 'run'}"])
    policy = build_policy(cfg, model, info)
    gen = torch.Generator().manual_seed(seed)
    ids = [torch.randint(3, policy.vocab_size, (n,), generator=gen) for n in (12, 9, 15)]
    batch = SequenceBatch(input_ids=ids, prompt_lens=torch.tensor([4, 3, 5]),
                          response_lens=torch.tensor([len(x) for x in ids]) - torch.tensor([4, 3, 5]))
    metrics = policy.train_step(batch, lambda logp, entropy, mb: (-(logp * mb.mask).sum() / 30, {}))
    assert metrics["skipped"] == 0.0 and metrics["grad_norm"] > 0, metrics
    export_hf(policy.model_chunks, policy.hf_config, str(root / "reference"), dtype=torch.bfloat16)
    manager = CheckpointManager(root / "checkpoints", rank=info.rank, barrier=barrier)
    manager.save(1, save_policy=policy.save_checkpoint, trainer_state={"step": 1}, config_yaml=to_yaml(cfg))
    # The process groups stay up for the export (the same layout: its init_distributed keeps them); a second
    # process group in one torchrun process would meet the first one's keys in torchrun's store.
    return root / "checkpoints"


def record_training_machinery(calls: list[str]) -> None:
    """Record every construction of the policy, megatron's DDP wrapper and the optimizer (they still run)."""
    from megatron.core.distributed import DistributedDataParallel

    from mcpo_megatron.models import policy

    def recorded(name, original):
        def call(*args, **kwargs):
            calls.append(name)
            return original(*args, **kwargs)
        return call

    policy.MegatronPolicy.__init__ = recorded("MegatronPolicy", policy.MegatronPolicy.__init__)
    DistributedDataParallel.__init__ = recorded("DistributedDataParallel", DistributedDataParallel.__init__)
    policy.build_optimizer = recorded("build_optimizer", policy.build_optimizer)


def main() -> None:
    from mcpo_megatron.models.parity import compare_checkpoints

    root, seed = Path(sys.argv[1]), int(sys.argv[2])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    checkpoints = make_checkpoint(root, seed, tp=world)
    calls: list[str] = []
    record_training_machinery(calls)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(["export", "--checkpoint", str(checkpoints), "--out", str(root / "export")])
    print(out.getvalue() + err.getvalue())
    result = {"rc": rc, "stdout": out.getvalue(), "stderr": err.getvalue(), "training_machinery": calls}
    (root / f"rank_{rank}.json").write_text(json.dumps(result, indent=2))
    if rank == 0:
        compare = {"trained": compare_checkpoints(str(root / "model"), str(root / "reference"), torch.bfloat16)}
        if (root / "export").is_dir():
            compare["config_dtype"] = json.loads((root / "export" / "config.json").read_text())["dtype"]
            compare["export"] = compare_checkpoints(str(root / "reference"), str(root / "export"), torch.bfloat16)
        (root / "compare.json").write_text(json.dumps(compare, indent=2))


if __name__ == "__main__":
    main()
