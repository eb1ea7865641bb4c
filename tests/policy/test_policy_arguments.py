"""The policy's settings check their own fields under their own names when they are made, before any model is
built (single process, no process group); the policy checks what needs the layout. The config keys these fields
come from are the schema's to name (tests/config)."""

from types import SimpleNamespace

import pytest
import torch

from mcpo_megatron.models.optim import OptimSettings
from mcpo_megatron.models.policy import MegatronPolicy
from mcpo_megatron.models.policy_settings import PolicySettings


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=0.0), "PolicySettings: temperature=0.0 must be > 0"),
    (dict(moe_aux_loss_coeff=-1.0), "PolicySettings: moe_aux_loss_coeff=-1.0 must be >= 0"),
    (dict(max_tokens_per_microbatch=0), "PolicySettings: max_tokens_per_microbatch=0 must be a positive integer"),
    (dict(max_tokens_per_microbatch=True), "PolicySettings: max_tokens_per_microbatch=True must be a positive integer"),
    (dict(logprob_chunk_size=0), "PolicySettings: logprob_chunk_size=0 must be a positive integer"),
    (dict(dtype="fp16"), "dtype='fp16' must be one of"),
    (dict(moe_routing_replay="r4"), "PolicySettings: moe_routing_replay='r4' must be one of ['off', 'r2', 'r3']"),
    (dict(sequence_packing=True, moe_routing_replay="r2"),
     "PolicySettings: sequence_packing=True with moe_routing_replay='r2': routing replay reads padded"),
    (dict(overlap_param_gather=True, optim=OptimSettings(use_distributed_optimizer=False)),
     "PolicySettings: overlap_param_gather=True needs the distributed optimizer"),
])
def test_bad_settings_are_named_as_the_settings_name_them(kwargs, message):
    with pytest.raises(ValueError) as e:
        PolicySettings(**kwargs)
    assert str(e.value).startswith(message), str(e.value)


def test_a_dtype_name_is_resolved_once_for_the_policy_and_its_reference():
    assert PolicySettings(dtype="bf16").dtype is torch.bfloat16
    assert PolicySettings(dtype="fp32").dtype is torch.float32
    assert PolicySettings().dtype is (torch.bfloat16 if torch.cuda.is_available() else torch.float32)


def test_context_parallelism_needs_packed_sequences():
    layout = SimpleNamespace(cp=2)
    with pytest.raises(ValueError, match="MegatronPolicy: context parallel size 2 needs sequence_packing=True"):
        MegatronPolicy(None, parallel_info=layout)
