import pytest

from mcpo_megatron.algorithms import literal_policy_loss, policy_loss


@pytest.fixture(params=[policy_loss, literal_policy_loss], ids=["fused", "literal"])
def loss_fn(request):
    """The tests that take it run on both implementations of the loss: the fused one training calls and the
    literal definition."""
    return request.param
