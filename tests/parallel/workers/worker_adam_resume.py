"""Worker (a world of one, started as a plain process): Adam's step across a checkpoint of megatron's distributed
optimizer on its torch-Adam path (no Transformer Engine, no Apex: what a GPU without them runs too).

Usage: worker_adam_resume.py OUT_DIR.  A tiny GPTModel in megatron DDP with the project's optimizer and schedule
takes K steps of fixed gradients, is checkpointed (the policy's own save), then takes M more ("uninterrupted").
Two fresh copies load the checkpoint and take the same M steps: one through the policy's load
(``policy_checkpoint.load_state``, "resumed"), one through megatron's load alone ("megatron_only"). Writes
OUT_DIR/result.pt: the initial parameters, every gradient applied, each run's final parameters and the Adam step
of every parameter after the load and at the end.
"""

import sys
from pathlib import Path

import torch

K, M = 3, 2  # steps before the checkpoint, steps after it
VOCAB, SEQ = 64, 8
SETTINGS = dict(lr=1e-2, adam_beta1=0.9, adam_beta2=0.99, adam_eps=1e-8, weight_decay=0.0, clip_grad=0.0)


def build(seed):
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    from mcpo_megatron.models.optim import OptimSettings, build_optimizer, build_scheduler

    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    cfg = TransformerConfig(
        num_layers=2, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32, params_dtype=torch.float32,
        pipeline_dtype=torch.float32, use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
        normalization="RMSNorm", add_bias_linear=False, bias_activation_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
    )
    model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                     vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="rope",
                     share_embeddings_and_output_weights=False)
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                                                      use_distributed_optimizer=True), model)
    settings = OptimSettings(**SETTINGS)
    optimizer = build_optimizer([ddp], settings, bf16=False)
    return ddp, optimizer, build_scheduler(optimizer, settings)


def named_params(ddp) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in ddp.module.named_parameters()}


def gradients(ddp, k: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + k)
    return {name: torch.randn(p.shape, generator=g) for name, p in ddp.module.named_parameters()}


def step(run, k: int) -> None:
    ddp, optimizer, scheduler = run
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    grads = gradients(ddp, k)
    for name, p in ddp.module.named_parameters():
        p.main_grad.copy_(grads[name])
    ok, _, _ = optimizer.step()
    assert ok
    scheduler.step(increment=1)


def adam_steps(optimizer) -> list[torch.Tensor]:
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return [state["step"] for part in parts for state in part.optimizer.state.values()]


def describe(steps: list[torch.Tensor]) -> dict:
    return {"n": len(steps), "distinct_tensors": len({id(s) for s in steps}), "values": [float(s) for s in steps]}


def load_megatron_only(run, directory: Path) -> None:
    """policy_checkpoint.load_state without the repair of Adam's step: megatron's own calls."""
    from megatron.core import dist_checkpointing

    from mcpo_megatron.models.policy_checkpoint import sharded_state_dict

    ddp, optimizer, scheduler = run
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        part._init_optimizer_states_with_dummy_values()
    state = dist_checkpointing.load(sharded_state_dict([ddp.module], optimizer, scheduler, is_loading=True),
                                    str(directory))
    ddp.module.load_state_dict(state["model"])
    with torch.no_grad():
        optimizer.load_state_dict(state["optimizer"])


def main() -> None:
    out = Path(sys.argv[1])
    from mcpo_megatron.parallel import mcore_compat
    from mcpo_megatron.parallel.distributed import destroy_distributed, init_distributed

    init_distributed(1, 1, seed=0)
    from mcpo_megatron.models.policy_checkpoint import load_state, save_state

    uninterrupted = build(seed=1)
    result = {"torch_adam": mcore_compat.uses_torch_adam(), "K": K, "M": M, "settings": SETTINGS,
              "initial": named_params(uninterrupted[0]),
              "grads": [gradients(uninterrupted[0], k) for k in range(K + M)]}
    for k in range(K):
        step(uninterrupted, k)
    save_state([uninterrupted[0].module], uninterrupted[1], uninterrupted[2], out / "ckpt")
    for k in range(K, K + M):
        step(uninterrupted, k)
    result["uninterrupted"] = {"final": named_params(uninterrupted[0]),
                               "steps_end": describe(adam_steps(uninterrupted[1]))}

    for name, load in (("resumed", lambda run: load_state([run[0].module], run[1], run[2], out / "ckpt")),
                       ("megatron_only", lambda run: load_megatron_only(run, out / "ckpt"))):
        run = build(seed=2)
        load(run)
        after_load = describe(adam_steps(run[1]))
        for k in range(K, K + M):
            step(run, k)
        result[name] = {"final": named_params(run[0]), "steps_after_load": after_load,
                        "steps_end": describe(adam_steps(run[1]))}
    torch.save(result, out / "result.pt")
    destroy_distributed()


if __name__ == "__main__":  # the checkpoint writer's helper process imports this module
    main()
