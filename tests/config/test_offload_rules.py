"""trainer.offload: what null resolves to (on with GPUs and colocated engines that sleep, off on CPU and with
separate placement), the combinations refused, and what `mcpo config` says it resolves to."""

import pytest

from mcpo_megatron.config import load_config, offload_enabled

from config_cases import TINY, ok, problems


@pytest.mark.parametrize("overrides,on_gpu,on_cpu", [
    ([], True, False),                                                        # null: the GPU default
    (["trainer.offload.enable=true"], True, True),                            # forced (CPU rehearsals, tests)
    (["trainer.offload.enable=false"], False, False),
    (["rollout.placement=separate", "rollout.ranks=1"], False, False),        # no engine on the training GPUs
    (["rollout.engine=vllm", "rollout.enable_sleep_mode=false"], False, False),  # the engine never lets go
    (["rollout.engine=vllm"], True, False),
])
def test_null_resolves_by_device_and_placement(overrides, on_gpu, on_cpu):
    cfg = load_config(None, TINY + overrides)
    assert (offload_enabled(cfg, cuda=True), offload_enabled(cfg, cuda=False)) == (on_gpu, on_cpu)


def test_defaults_offload_every_part_when_on():
    o = load_config(None, TINY).trainer.offload
    assert o.enable is None and (o.buffers, o.master_weights, o.moments, o.reference) == (True, True, True, True)


def test_forced_on_where_nothing_would_use_the_memory_is_refused():
    assert problems(["trainer.offload.enable=true", "rollout.placement=separate", "rollout.ranks=1"],
                    world_size=2) == [
        "trainer.offload.enable=True: with rollout.placement=separate no engine shares the training GPUs, so "
        "nothing would use the memory offloading frees; set trainer.offload.enable=null (or false)"]
    assert problems(["trainer.offload.enable=true", "rollout.engine=vllm", "rollout.enable_sleep_mode=false"]) == [
        "trainer.offload.enable=True: needs rollout.enable_sleep_mode=true: the colocated engine must release its "
        "memory for the training state to come back; set rollout.enable_sleep_mode=true, or "
        "trainer.offload.enable=null"]
    ok(["rollout.placement=separate", "rollout.ranks=1"], world_size=2)  # null there: off, no error


def test_every_part_off_warns():
    warnings = ok(["trainer.offload.enable=true", "trainer.offload.buffers=false",
                   "trainer.offload.master_weights=false", "trainer.offload.moments=false",
                   "trainer.offload.reference=false"])
    assert any("nothing is offloaded" in w for w in warnings)


def test_mcpo_config_says_what_it_resolves_to():
    from mcpo_megatron.commands.config import describe_offload

    assert describe_offload(load_config(None, TINY), check_devices=False) == \
        "trainer.offload.enable=null resolves to on with GPUs, off on CPU"
    assert describe_offload(load_config(None, TINY + ["trainer.offload.enable=false"]), check_devices=False) == \
        "trainer.offload.enable=false resolves to off with GPUs, off on CPU"
