"""Worker (run under torchrun): megatron DDP + distributed optimizer + dist_checkpointing on CPU.

Usage: worker_ddp_optim_ckpt.py OUT_DIR TP PP.  Builds a tiny GPTModel, wraps it
in megatron DDP (grad buffers) and the distributed optimizer, runs one pipeline
forward-backward and one optimizer step, saves a dist checkpoint (model +
dp-reshardable optimizer), loads it into a freshly built model/optimizer and
writes OUT_DIR/rank{R}.json with what it saw.
"""

import json
import math
import sys
from pathlib import Path

import torch

from mcpo_megatron.parallel import mcore_compat
from mcpo_megatron.parallel.distributed import barrier, destroy_distributed, init_distributed


def build(info, tp, pp, vocab, seq):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    cfg = TransformerConfig(
        num_layers=2 * pp, hidden_size=32, num_attention_heads=4, num_query_groups=2,
        ffn_hidden_size=64, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32, params_dtype=torch.float32, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, normalization="RMSNorm",
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
    )
    model = GPTModel(
        config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=vocab, max_sequence_length=seq, pre_process=info.is_first_stage,
        post_process=info.is_last_stage, share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
    )
    ddp = DistributedDataParallel(
        cfg,
        DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=True
        ),
        model,
    )
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=True, clip_grad=1.0),
        [ddp],
    )
    return ddp, opt


def main() -> None:
    out_dir, tp, pp = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    info = init_distributed(tp, pp, seed=99)
    from megatron.core import dist_checkpointing
    from megatron.core.pipeline_parallel import get_forward_backward_func

    vocab, seq, mbs = 64, 8, 2
    ddp, opt = build(info, tp, pp, vocab, seq)
    g = torch.Generator().manual_seed(100 + info.dp_rank)  # each DP rank its own data
    batches = [
        {"tokens": torch.randint(0, vocab, (mbs, seq), generator=g),
         "labels": torch.randint(0, vocab, (mbs, seq), generator=g)}
        for _ in range(2)
    ]
    position_ids = torch.arange(seq).unsqueeze(0).expand(mbs, seq)

    def forward_step(data_iterator, model):
        b = next(data_iterator)
        out = model(b["tokens"], position_ids, None, labels=b["labels"])
        return out, lambda t: (t.float().mean(), {"loss": t.float().mean().detach().clone()})

    ddp.zero_grad_buffer()
    opt.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(batches), model=[ddp],
        num_microbatches=2, seq_length=seq, micro_batch_size=mbs, forward_only=False,
    )
    ddp.finish_grad_sync()
    before = {k: v.detach().clone() for k, v in ddp.module.state_dict().items() if torch.is_tensor(v)}
    update_successful, grad_norm, _ = opt.step()
    after = {k: v.detach().clone() for k, v in ddp.module.state_dict().items() if torch.is_tensor(v)}
    changed = sum(1 for k in before if not torch.equal(before[k], after[k]))

    ckpt = out_dir / "ckpt"
    if info.rank == 0:
        ckpt.mkdir(exist_ok=True)
    barrier()
    model_sd = ddp.module.sharded_state_dict()
    state = {
        "model": model_sd,
        "optimizer": opt.sharded_state_dict(
            model_sd, metadata={"distrib_optim_sharding_type": "dp_reshardable"}
        ),
    }
    dist_checkpointing.save(state, str(ckpt))
    barrier()

    # A fresh model (different seed) restored from the checkpoint must equal the trained one.
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(12345)
    ddp2, opt2 = build(info, tp, pp, vocab, seq)
    # torch's Adam (no Apex/TE here) creates its state lazily; megatron's loader
    # needs it to exist (it reads 'step'), so materialise it with a zero-grad step.
    for o in getattr(opt2, "chained_optimizers", [opt2]):
        o._init_optimizer_states_with_dummy_values()
    model_sd2 = ddp2.module.sharded_state_dict()
    to_load = {
        "model": model_sd2,
        "optimizer": opt2.sharded_state_dict(
            model_sd2, is_loading=True, metadata={"distrib_optim_sharding_type": "dp_reshardable"}
        ),
    }
    differs_before_load = any(
        not torch.equal(v, after[k]) for k, v in ddp2.module.state_dict().items()
        if torch.is_tensor(v) and k in after
    )
    loaded = dist_checkpointing.load(to_load, str(ckpt))
    ddp2.module.load_state_dict(loaded["model"])
    with torch.no_grad():  # fp32 main params are views of leaf parameters
        opt2.load_state_dict(loaded["optimizer"])
    mcore_compat.restore_adam_steps(opt2, loaded["optimizer"])  # torch's Adam here: megatron shares its step
    restored = {k: v for k, v in ddp2.module.state_dict().items() if torch.is_tensor(v)}
    max_diff = max(float((restored[k].float() - after[k].float()).abs().max()) for k in after if
                   restored[k].numel())


    # One more identical step from the original and from the restored state must agree.
    def step(ddp_, opt_):
        ddp_.zero_grad_buffer()
        opt_.zero_grad()
        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(batches), model=[ddp_],
            num_microbatches=2, seq_length=seq, micro_batch_size=mbs, forward_only=False,
        )
        ddp_.finish_grad_sync()
        opt_.step()
        return {k: v for k, v in ddp_.module.state_dict().items() if torch.is_tensor(v)}

    p1, p2 = step(ddp, opt), step(ddp2, opt2)
    second_step_max_diff = max(float((p1[k].float() - p2[k].float()).abs().max()) for k in p1
                               if p1[k].numel())

    result = {
        "rank": info.rank, "dp": info.dp, "dp_rank": info.dp_rank,
        "losses": [float(x["loss"]) for x in losses] if info.is_last_stage else [],
        "update_successful": bool(update_successful),
        "grad_norm": float(grad_norm) if grad_norm is not None else None,
        "n_tensors": len(before), "n_changed": changed,
        "differs_before_load": differs_before_load, "restore_max_diff": max_diff,
        "second_step_max_diff": second_step_max_diff,
    }
    (out_dir / f"rank{info.rank}.json").write_text(json.dumps(result))
    destroy_distributed()


if __name__ == "__main__":
    main()
