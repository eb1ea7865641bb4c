"""Worker (run under torchrun): tiny megatron GPTModel, local spec, one pipeline forward-backward.

Usage: worker_gpt_tp_pp.py OUT_DIR TP PP.  Writes OUT_DIR/rank{R}.json with the
loss seen on this rank (last stage only) and the grad norm of its parameters.
"""

import json
import math
import sys
from functools import partial
from pathlib import Path

import torch

from mcpo_megatron.parallel.distributed import destroy_distributed, init_distributed


def main() -> None:
    out_dir, tp, pp = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    info = init_distributed(tp, pp, seed=1234)

    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer import TransformerConfig

    vocab, seq, mbs, n_micro = 64, 8, 2, 2
    cfg = TransformerConfig(
        num_layers=2 * pp,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=64,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32,
        params_dtype=torch.float32,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
    )
    model = GPTModel(
        config=cfg,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=vocab,
        max_sequence_length=seq,
        pre_process=info.is_first_stage,
        post_process=info.is_last_stage,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
    )

    g = torch.Generator().manual_seed(7)  # identical data on every rank
    batches = [
        {
            "tokens": torch.randint(0, vocab, (mbs, seq), generator=g),
            "labels": torch.randint(0, vocab, (mbs, seq), generator=g),
        }
        for _ in range(n_micro)
    ]
    data_iter = iter(batches)
    position_ids = torch.arange(seq).unsqueeze(0).expand(mbs, seq)

    def loss_func(output_tensor):
        loss = output_tensor.float().mean()
        # clone: the schedule divides output_tensor in place by num_microbatches
        return loss, {"loss": loss.detach().clone()}

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        out = model(batch["tokens"], position_ids, None, labels=batch["labels"])
        return out, loss_func

    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=data_iter,
        model=[model],
        num_microbatches=n_micro,
        seq_length=seq,
        micro_batch_size=mbs,
        forward_only=False,
    )
    grad_sq = sum(float(p.grad.double().pow(2).sum()) for p in model.parameters() if p.grad is not None)
    n_grads = sum(1 for p in model.parameters() if p.grad is not None)
    result = {
        "rank": info.rank,
        "tp_rank": info.tp_rank,
        "pp_rank": info.pp_rank,
        "is_last_stage": info.is_last_stage,
        "losses": [float(x["loss"]) for x in losses] if info.is_last_stage else [],
        "grad_norm": math.sqrt(grad_sq),
        "n_params": sum(1 for _ in model.parameters()),
        "n_grads": n_grads,
    }
    (out_dir / f"rank{info.rank}.json").write_text(json.dumps(result))
    destroy_distributed()


if __name__ == "__main__":
    main()
