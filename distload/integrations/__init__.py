"""Serving engines that load through distload: vLLM's `load_format="distload"` (vllm.py), with each
engine version's param names as data (serving_names.py, configs/serving/<engine>.toml)."""
