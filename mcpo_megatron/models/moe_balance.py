"""Expert load of a mixture-of-experts policy per training step, and the optional load-balancing loss.

Both come from forward hooks on megatron's ``TopKRouter`` modules (megatron's own auxiliary loss stays off:
``moe_router_load_balancing_type="none"``), so what is reported and what is optimised are defined here, once,
over real tokens only: the policy passes megatron's ``padding_mask`` (True on padding and on pipeline filler
micro-batches) to the model, and megatron hands it to every router with its input, also when activation
recomputation runs the layer again during the backward pass.  Only forwards with gradients enabled count, so a
recomputed layer (first run without gradients, then again with them) is counted once.

Per MoE layer, over the N real tokens routed in a step (all micro-batches, DP ranks, and with sequence
parallelism all TP ranks), with E experts, top-k routing, router probabilities ``p_t = softmax(z_t)`` (fp32) and
``c_e`` the number of tokens routed to expert e:

    f_e = c_e / (k N)          (fraction of the routed slots; balanced: 1/E)
    P_e = sum_t p_t[e] / N     (mean router probability; balanced: 1/E)
    L   = E * sum_e f_e P_e    (Switch Transformer load-balancing loss, Fedus et al. 2021, Eq. 4-6;
                               megatron's ``switch_load_balancing_loss_func``; 1 when balanced)

Reported per step (``train_step`` metrics): ``moe/aux_loss`` = mean of L over layers (global-batch statistics,
so independent of how the batch is cut into micro-batches), ``moe/max_expert_load`` = max over layers and
experts of ``E f_e`` (1 = balanced; 3 = an expert receives three times its share) and
``moe/min_expert_load``.

Optimised only with ``coeff > 0`` (``model.moe_aux_loss_coeff``): the term added to the loss is
``coeff * sum_layers sum_mb (N_mb / N) * L_mb`` where ``L_mb`` is L over micro-batch mb (megatron's
per-micro-batch definition, token-weighted over the step's micro-batches on all DP ranks).  It enters the
backward pass like megatron's ``MoEAuxLossAutoScaler``: an identity on the router's output probabilities whose
backward also emits the constant gradient ``coeff * N_mb / N`` for the loss term.  With sequence parallelism
each TP rank adds its own tokens' share of ``P_e`` (``c_e`` is summed over TP first), so the TP ranks' terms
add up to L_mb.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mcpo_megatron.parallel.distributed import all_reduce_sum


class _AttachLoss(torch.autograd.Function):
    """Identity on ``output``; the backward also gives ``loss`` the gradient ``weight``."""

    @staticmethod
    def forward(ctx, output, loss, weight: float):
        ctx.weight = weight
        ctx.save_for_backward(loss)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (loss,) = ctx.saved_tensors
        return grad_output, torch.full_like(loss, ctx.weight), None


class LoadBalanceMonitor:
    """Hooks every MoE router of ``model_chunks``; :meth:`begin` / :meth:`finish` bracket one training step.

    Args:
        model_chunks: bare ``GPTModel`` chunks of this rank.
        shape: the model's :class:`~mcpo_megatron.models.registry.MegatronShape` (its layers, experts and top-k).
        coeff: load-balancing loss coefficient (0: report only).
        sequence_parallel: tokens are split over TP inside the MoE layers (counts summed over TP).
        tp_group, dp_group, pp_group: process groups of this rank (None: size 1).
        device: where the statistics accumulate (the model's device).
    """

    def __init__(self, model_chunks, shape, *, coeff: float = 0.0, sequence_parallel: bool = False,
                 tp_group=None, dp_group=None, pp_group=None, device: torch.device | str = "cpu"):
        from megatron.core.transformer.moe.router import TopKRouter

        num_layers, num_experts = shape.num_layers, shape.num_experts
        self.num_experts, self.topk, self.coeff = num_experts, shape.moe_topk, float(coeff)
        self.sequence_parallel = sequence_parallel
        self.tp_group, self.dp_group, self.pp_group = tp_group, dp_group, pp_group
        self.counts = torch.zeros(num_layers, num_experts, dtype=torch.float64, device=device)
        self.prob_sums = torch.zeros(num_layers, num_experts, dtype=torch.float64, device=device)
        self.tokens = torch.zeros(num_layers, dtype=torch.float64, device=device)
        self.active = False
        self._total_tokens = 1.0
        self._handles = [m.register_forward_hook(self._hook, with_kwargs=True) for c in model_chunks
                         for m in c.modules() if isinstance(m, TopKRouter)]

    # ------------------------------------------------------------------ step bracket
    def begin(self, total_tokens: int) -> None:
        """Start a step whose micro-batches hold ``total_tokens`` real tokens over all DP ranks."""
        self.counts.zero_()
        self.prob_sums.zero_()
        self.tokens.zero_()
        self._total_tokens = float(max(total_tokens, 1))
        self.active = True

    def finish(self) -> dict[str, float]:
        """Reduce over ranks and return the step's ``moe/*`` metrics (a collective)."""
        self.active = False
        flat = torch.cat([self.counts.reshape(-1), self.prob_sums.reshape(-1), self.tokens])
        groups = [self.tp_group] if self.sequence_parallel else []
        for group in groups + [self.dp_group, self.pp_group]:
            if group is not None:
                all_reduce_sum(flat, group)  # on the training device
        n_le = self.counts.numel()
        counts = flat[:n_le].view_as(self.counts)
        probs = flat[n_le:2 * n_le].view_as(self.prob_sums)
        tokens = flat[2 * n_le:].clamp(min=1.0).unsqueeze(-1)
        f = counts / (self.topk * tokens)
        p = probs / tokens
        loss = self.num_experts * (f * p).sum(-1)
        load = self.num_experts * f
        return {"moe/aux_loss": float(loss.mean()), "moe/max_expert_load": float(load.max()),
                "moe/min_expert_load": float(load.min())}

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    # ------------------------------------------------------------------ the hook
    def _valid_tokens(self, hidden: torch.Tensor, padding_mask: torch.Tensor | None) -> torch.Tensor:
        """[S_local * b] bool in the router's token order (sequence-major, like ``view(-1, E)``)."""
        s_local, b = hidden.shape[0], hidden.shape[1]
        if padding_mask is None:
            return torch.ones(s_local * b, dtype=torch.bool, device=hidden.device)
        valid = ~padding_mask.to(hidden.device).bool()  # [S, b]
        if valid.shape[0] != s_local:  # sequence parallel: this TP rank's slice of the sequence
            rank = dist.get_rank(self.tp_group)
            valid = valid[rank * s_local:(rank + 1) * s_local]
        return valid.reshape(-1)

    def _hook(self, router, args, kwargs, output):
        if not self.active or router.layer_number is None or not torch.is_grad_enabled():
            return None
        hidden = args[0]
        padding_mask = args[1] if len(args) > 1 else kwargs.get("padding_mask")
        probs, routing_map = output
        valid = self._valid_tokens(hidden, padding_mask)
        layer = router.layer_number - 1
        with torch.no_grad():
            logits = torch.nn.functional.linear(hidden.reshape(-1, hidden.shape[-1]).float(), router.weight.float())
            scores = torch.softmax(logits, dim=-1)
            self.counts[layer] += routing_map[valid].sum(0).double()
            self.prob_sums[layer] += scores[valid].sum(0).double()
            self.tokens[layer] += valid.sum().double()
        if not (self.coeff > 0 and router.training):
            return None
        # The step's loss term of this layer and micro-batch (module docstring).
        count = routing_map[valid].sum(0).float()
        n_mb = valid.sum().float()
        if self.sequence_parallel and self.tp_group is not None and dist.get_world_size(self.tp_group) > 1:
            both = torch.cat([count, n_mb.reshape(1)])
            all_reduce_sum(both, self.tp_group)  # on the training device
            count, n_mb = both[:-1], both[-1]
        if float(n_mb) == 0.0:
            return None
        logits = torch.nn.functional.linear(hidden.reshape(-1, hidden.shape[-1]).float(), router.weight.float())
        local_prob = torch.softmax(logits, dim=-1)[valid].sum(0)
        loss = self.num_experts * (local_prob * count).sum() / (self.topk * n_mb * n_mb)
        weight = self.coeff * float(n_mb) / self._total_tokens
        return _AttachLoss.apply(probs, loss, weight), routing_map
