"""The serving engines' plugins, one module each, on top of the pipeline (loader.py) and the engine-neutral
serving/ wing: vllm.py registers `load_format="distload"` in every vLLM process (entry point
vllm.general_plugins). Nothing below this folder imports it."""
