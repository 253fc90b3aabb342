"""Checkpoint conversion between Hugging Face safetensors and moetext.

`moetext.convert.hf.load_model(hf_dir, dtype)` returns (Config, model) with an HF Qwen3-MoE
checkpoint's weights; `safetensors_io` reads (memory-mapped) and writes sharded safetensors.
"""
