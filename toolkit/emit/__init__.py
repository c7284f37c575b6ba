"""Emitters: DeepSpeed JSON, Megatron-core configs, Megatron-LM arguments, launch scripts."""
