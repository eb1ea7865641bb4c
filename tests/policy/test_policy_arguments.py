"""MegatronPolicy checks its own arguments under their own names before it builds anything (single process, no
process group). The config keys these arguments come from are the schema's to name (tests/config)."""

from types import SimpleNamespace

import pytest

from mcpo_megatron.models.optim import OptimSettings
from mcpo_megatron.models.policy import MegatronPolicy

NO_LAYOUT = SimpleNamespace()  # the checks come before the layout is read


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=0.0), "MegatronPolicy: temperature=0.0 must be > 0"),
    (dict(moe_aux_loss_coeff=-1.0), "MegatronPolicy: moe_aux_loss_coeff=-1.0 must be >= 0"),
    (dict(max_tokens_per_microbatch=0), "MegatronPolicy: max_tokens_per_microbatch=0 must be a positive integer"),
    (dict(dtype="fp16"), "dtype='fp16' must be one of"),
    (dict(overlap_param_gather=True, optim=OptimSettings(use_distributed_optimizer=False)),
     "MegatronPolicy: overlap_param_gather=True needs the distributed optimizer"),
])
def test_bad_arguments_are_named_as_the_policy_names_them(kwargs, message):
    with pytest.raises(ValueError) as e:
        MegatronPolicy(None, parallel_info=NO_LAYOUT, **kwargs)
    assert str(e.value).startswith(message), str(e.value)


def test_context_parallelism_needs_packed_sequences():
    layout = SimpleNamespace(cp=2)
    with pytest.raises(ValueError, match="MegatronPolicy: context parallel size 2 needs sequence_packing=True"):
        MegatronPolicy(None, parallel_info=layout)
