"""Hugging Face models on megatron-core: registry, weight mapping, loading/export, sources, policy.

Submodules are imported on use (megatron-core and transformers are heavy):
``registry`` (HF config -> validated ``MegatronShape``), ``megatron_config`` (shape -> TransformerConfig + layer
spec), ``builder`` (``build_gpt_model``, ``build_model_chunks``), ``weights`` (HF <-> Megatron mapping), ``hf_io``
(load safetensors shards / export HF), ``sources`` (``resolve_model_path``, ``make_tiny_hf_model``), ``policy``
(the trainable policy) with ``passes`` (micro-batches through the pipeline schedule, the log-prob pass) and
``policy_checkpoint``, ``reference`` (the frozen reference policy), ``local_norm`` (the local spec's
sequence-parallel RMSNorm), ``moe_balance`` (expert load and load-balancing loss).
"""
