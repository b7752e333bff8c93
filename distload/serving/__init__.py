"""Serving engines: naming profiles per engine version, what a save must hold for an engine, and the engines'
plugins (vllm.py: `load_format="distload"`)."""
