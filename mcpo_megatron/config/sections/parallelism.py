"""The ``parallelism`` section: the training layout (TP x PP x DP, EP, VPP) and megatron DDP's overlap options;
its rules read the model shape and the ranks that train."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from mcpo_megatron.config.checks import Checks, at_least


@dataclass
class ParallelismConfig:
    # Data-parallel size is derived: world_size / (tensor x pipeline).
    tensor_model_parallel_size: int = at_least(1, 1)
    pipeline_model_parallel_size: int = at_least(1, 1)
    # MoE experts are split over EP ranks taken from the data-parallel dimension (EP must divide DP); inside
    # an expert the weights are split over TP (expert-TP = TP). 1 for dense models.
    expert_model_parallel_size: int = 1
    # Interleaved 1F1B: model chunks per pipeline rank (null or 1: none; needs PP > 1 and
    # num_layers % (PP x VPP) == 0).
    virtual_pipeline_model_parallel_size: Optional[int] = None
    # Context parallelism: each sequence split over CP ranks in 2 x CP load-balanced chunks (the activations of a
    # micro-batch / CP), for responses too long for one rank's activations; needs trainer.sequence_packing=true.
    # Data-parallel size = world_size / (TP x PP x CP).
    context_parallel_size: int = at_least(1, 1)
    use_distributed_optimizer: bool = True
    sequence_parallel: bool = False
    # megatron DDP: overlap the gradient reduction with the backward pass, and the distributed optimizer's
    # parameter all-gather with the next forward (megatron's GPU recipes turn both on). null: on with CUDA, off
    # on CPU (gloo).
    overlap_grad_reduce: Optional[bool] = None
    overlap_param_gather: Optional[bool] = None

    def check(self, c: Checks) -> None:
        tp, pp, world = self.tensor_model_parallel_size, self.pipeline_model_parallel_size, c.world_size
        separate = c.cfg.rollout.placement == "separate"
        if separate and world < 1:
            return  # rollout.ranks leaves no rank to train: said once, by the rollout section
        if self.context_parallel_size > 1:
            self._check_context_parallel(c)
        if world >= 1 and tp >= 1 and pp >= 1 and world % (tp * pp):
            what = (f"the {world} training ranks (world size {c.launch_world_size} less rollout.ranks="
                    f"{c.cfg.rollout.ranks}) = TP x PP x DP" if separate else "world size = TP x PP x DP")
            c.error("world_size", c.launch_world_size if separate else world,
                    f"{what} requires divisibility by tensor_model_parallel_size x "
                    f"pipeline_model_parallel_size = {tp} x {pp} = {tp * pp}",
                    "change the number of ranks" + (" or rollout.ranks" if separate else "") +
                    " or parallelism.tensor_model_parallel_size / pipeline_model_parallel_size")
        shape = c.shape
        if shape is not None:
            src = f"(from {shape.source})"
            for name, value in (("vocab_size", shape.vocab_size), ("ffn_hidden_size", shape.ffn_hidden_size)):
                if tp >= 1 and value % tp:
                    c.error("parallelism.tensor_model_parallel_size", tp, f"must divide {name}={value} {src}",
                            "choose a tensor-parallel size that divides it")
            if tp >= 1 and shape.num_key_value_heads % tp:
                # The HF <-> Megatron mapping pads the attention with all-zero query groups (exact: they add 0
                # to the output and get 0 gradients), at the cost of the extra heads' compute.
                groups = -(-shape.num_key_value_heads // tp) * tp
                extra = 100.0 * (groups - shape.num_key_value_heads) / shape.num_key_value_heads
                c.warn(f"parallelism.tensor_model_parallel_size={tp} does not divide num_key_value_heads="
                       f"{shape.num_key_value_heads} {src}: the attention is padded with zero heads to {groups} "
                       f"query groups (exact, {extra:.0f}% more attention compute); a TP that divides it avoids this")
            if pp >= 1 and shape.num_layers % pp:
                c.error("parallelism.pipeline_model_parallel_size", pp, f"must divide num_layers={shape.num_layers} "
                        f"{src}", "choose a pipeline size that divides it")
        if self.sequence_parallel and tp == 1:
            c.warn("parallelism.sequence_parallel=true has no effect with tensor_model_parallel_size=1")
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            c.error("parallelism.overlap_param_gather", True,
                    "needs parallelism.use_distributed_optimizer=true (the all-gather is the distributed "
                    "optimizer's)", "set parallelism.use_distributed_optimizer=true or overlap_param_gather=false")
        self._check_experts_and_virtual_pipeline(c)

    def _check_context_parallel(self, c: Checks) -> None:
        """Rules of context parallelism: the world splits into TP x PP x CP x DP, sequences are packed, dense
        models only."""
        tp, pp, cp, world = (self.tensor_model_parallel_size, self.pipeline_model_parallel_size,
                             self.context_parallel_size, c.world_size)
        if world >= 1 and tp >= 1 and pp >= 1 and world % (tp * pp * cp):
            c.error("world_size", c.launch_world_size, f"the {world} training ranks = TP x PP x CP x DP require "
                    f"divisibility by {tp} x {pp} x {cp} = {tp * pp * cp}",
                    "change the number of ranks or parallelism.context_parallel_size")
        if not c.cfg.trainer.sequence_packing:
            c.error("parallelism.context_parallel_size", cp, "splits packed sequences only",
                    "set trainer.sequence_packing=true, or parallelism.context_parallel_size=1")
        if c.shape is not None and c.shape.is_moe:
            c.error("parallelism.context_parallel_size", cp, f"is not supported for mixture-of-experts models "
                    f"(from {c.shape.source}) here", "use 1")
        if c.cfg.algorithm.ratio_level == "sequence":
            c.error("parallelism.context_parallel_size", cp, "splits a sequence's tokens over ranks, and the "
                    "sequence-level ratio (algorithm.ratio_level=sequence, GSPO) needs all of them on one",
                    "use algorithm.ratio_level=token, or parallelism.context_parallel_size=1")
        if self.virtual_pipeline_model_parallel_size not in (None, 1):
            c.error("parallelism.context_parallel_size", cp, "is not combined with a virtual pipeline here",
                    "set parallelism.virtual_pipeline_model_parallel_size=null, or context_parallel_size=1")

    def _check_experts_and_virtual_pipeline(self, c: Checks) -> None:
        """Rules of expert parallelism (MoE models) and virtual pipeline stages."""
        tp, pp, ep, vpp = (self.tensor_model_parallel_size, self.pipeline_model_parallel_size,
                           self.expert_model_parallel_size, self.virtual_pipeline_model_parallel_size)
        world = c.world_size
        if ep < 1:
            c.error("parallelism.expert_model_parallel_size", ep, "must be >= 1", "use 1 for dense models")
        elif tp >= 1 and pp >= 1 and world >= 1 and world % (tp * pp) == 0 and (world // (tp * pp)) % ep:
            c.error("parallelism.expert_model_parallel_size", ep,
                    f"must divide the data-parallel size {world // (tp * pp)} (= {world} / ({tp} x {pp})): "
                    "experts are split over ranks of the data-parallel dimension",
                    "choose an EP that divides world_size / (TP x PP)")
        if vpp is not None and vpp < 1:
            c.error("parallelism.virtual_pipeline_model_parallel_size", vpp, "must be >= 1 or null",
                    "use null (no interleaving)")
        elif vpp is not None and vpp > 1 and pp < 2:
            c.error("parallelism.virtual_pipeline_model_parallel_size", vpp,
                    f"interleaving needs parallelism.pipeline_model_parallel_size > 1 (got {pp})",
                    "use null, or PP >= 2")
        elif vpp is not None and vpp > 1 and c.shape is not None and c.shape.num_layers % (pp * vpp):
            c.error("parallelism.virtual_pipeline_model_parallel_size", vpp,
                    f"PP x VPP = {pp} x {vpp} must divide num_layers={c.shape.num_layers} (from {c.shape.source})",
                    "choose a VPP with num_layers % (PP x VPP) == 0")
        shape = c.shape
        if shape is None:
            return
        src = f"(from {shape.source})"
        if not shape.is_moe:
            if ep > 1:
                c.error("parallelism.expert_model_parallel_size", ep,
                        f"needs a mixture-of-experts model; {src} has no experts", "use 1")
            return
        if ep >= 1 and shape.num_experts % ep:
            c.error("parallelism.expert_model_parallel_size", ep, f"must divide num_experts={shape.num_experts} {src}",
                    "choose an EP that divides the number of experts")
        if tp >= 1 and shape.moe_ffn_hidden_size % tp:
            c.error("parallelism.tensor_model_parallel_size", tp,
                    f"must divide moe_ffn_hidden_size={shape.moe_ffn_hidden_size} {src} (experts are split over TP "
                    "too)", "choose a tensor-parallel size that divides it")
        if tp > 1 and not self.sequence_parallel:
            c.error("parallelism.sequence_parallel", False,
                    f"megatron trains mixture-of-experts layers with tensor_model_parallel_size={tp} > 1 only with "
                    "sequence parallelism (tokens are split over TP before they are dispatched to experts)",
                    "set parallelism.sequence_parallel=true")
