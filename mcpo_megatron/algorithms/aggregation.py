"""Loss aggregation: per-token weights that turn every loss term into a plain weighted sum (docs/algorithms.md §4).

A weight is built from counts over the whole mini-batch (all micro-batches, all data-parallel ranks), so the loss
of a micro-batch is its share of the mini-batch loss, and summing micro-batch losses and gradients gives the
full-batch values whatever the split.
"""

from __future__ import annotations

import torch

from ._checks import as_bool, check_choice

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
HINGE_AGGS = ("mastered", "batch")


def local_counts(response_mask: torch.Tensor, mastered: torch.Tensor) -> torch.Tensor:
    """float64 [3]: (tokens, non-empty sequences, non-empty mastered sequences) of this micro-batch on this rank.

    Sum these over micro-batches and all-reduce over data-parallel ranks to get the global counts that
    ``token_weights`` needs. Empty responses (|y| = 0) are excluded from the sequence counts N and |M_B|
    (docs/algorithms.md §4).
    """
    mask = as_bool(response_mask, "response_mask")
    if mask.dim() != 2:
        raise ValueError(f"response_mask: expected [B, T], got shape {tuple(mask.shape)}.")
    lens = mask.sum(dim=-1)
    nonempty = lens > 0
    m = _check_mastered(mastered, mask.shape[0]) & nonempty
    return torch.stack([lens.sum(), nonempty.sum(), m.sum()]).to(torch.float64)


def token_weights(
    response_mask: torch.Tensor,
    mastered: torch.Tensor,
    *,
    loss_agg_mode: str,
    global_counts,
    max_response_length: int | None = None,
    hinge_agg: str = "mastered",
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss weights of a micro-batch from mini-batch-global counts (docs/algorithms.md §4).

    Args:
        response_mask: [B, T] valid response tokens of this micro-batch.
        mastered: [B] bool, the sequence's group is mastered (``mastery.sequence_mastered``).
        loss_agg_mode: how L_PG averages per-token terms; N = non-empty sequences, |y_i| = length:
            ``token-mean`` w = 1/(global tokens) (DAPO's token-level loss); ``seq-mean-token-mean``
            w = 1/(|y_i| N) (MCPO, the default); ``seq-mean-token-sum`` w = 1/N; ``seq-mean-token-sum-norm``
            w = 1/(L_max N) with L_max = ``max_response_length`` (Dr.GRPO: per-sequence token sums over a
            constant length, averaged over sequences. verl divides each micro-batch's token sum by L_max and then
            scales by its micro-batch share, which makes the result depend on the micro-batch size; this form
            does not).
        global_counts: (tokens, sequences, mastered sequences), ``local_counts`` summed over every micro-batch
            and data-parallel rank of the mini-batch (a tensor of 3, or any sequence of 3 numbers).
        hinge_agg: ``mastered`` w = 1/(|y_i| |M_B|) on mastered sequences (MCPO Eq. 11 literally); ``batch``
            uses N instead of |M_B|. If |M_B| = 0 the hinge weights are 0.
        dtype: dtype of the returned weights.

    Returns:
        (pg_weight [B, T], hkl_weight [B, T]), zero on padding and on empty responses.
    """
    check_choice("loss_agg_mode", loss_agg_mode, LOSS_AGG_MODES)
    check_choice("hinge_agg", hinge_agg, HINGE_AGGS)
    mask = as_bool(response_mask, "response_mask")
    if mask.dim() != 2:
        raise ValueError(f"response_mask: expected [B, T], got shape {tuple(mask.shape)}.")
    m = _check_mastered(mastered, mask.shape[0])
    lens = mask.sum(dim=-1)
    m = m & (lens > 0)
    if len(global_counts) != 3:
        raise ValueError(f"global_counts: expected (tokens, sequences, mastered sequences), got {global_counts!r}.")
    n_tok, n_seq, n_mas = (float(x) for x in global_counts)
    loc = local_counts(mask, m).tolist()
    for i, (name, glob, local) in enumerate(zip(("tokens", "sequences", "mastered sequences"),
                                                (n_tok, n_seq, n_mas), loc)):
        if glob < local:
            raise ValueError(
                f"global_counts[{i}] ({name}) = {glob}: smaller than this micro-batch's own count {local}; pass "
                f"local_counts summed over all micro-batches and data-parallel ranks of the mini-batch."
            )
    maskf = mask.to(torch.float64)
    inv_len = 1.0 / lens.clamp(min=1).to(torch.float64)

    def per_seq(scale: torch.Tensor | float) -> torch.Tensor:
        return maskf * scale

    if loss_agg_mode == "token-mean":
        pg = per_seq(1.0 / n_tok if n_tok > 0 else 0.0)
    elif n_seq == 0:
        pg = torch.zeros_like(maskf)
    elif loss_agg_mode == "seq-mean-token-mean":
        pg = per_seq(inv_len[:, None] / n_seq)
    elif loss_agg_mode == "seq-mean-token-sum":
        pg = per_seq(1.0 / n_seq)
    else:
        if not (isinstance(max_response_length, int) and max_response_length > 0):
            raise ValueError(
                f"max_response_length={max_response_length!r}: seq-mean-token-sum-norm needs the configured "
                f"data.max_response_length (a positive int), not the padded width, so weights do not depend on "
                f"the micro-batch split."
            )
        pg = per_seq(1.0 / (max_response_length * n_seq))

    denom = n_mas if hinge_agg == "mastered" else n_seq
    if denom > 0:
        hk = maskf * (m.to(torch.float64) * inv_len)[:, None] / denom
    else:
        hk = torch.zeros_like(maskf)
    return pg.to(dtype), hk.to(dtype)


def _check_mastered(mastered, batch: int) -> torch.Tensor:
    m = torch.as_tensor(mastered)
    if m.shape != (batch,):
        raise ValueError(f"mastered: expected shape [{batch}] (one flag per sequence), got {tuple(m.shape)}.")
    return m if m.dtype == torch.bool else m != 0
