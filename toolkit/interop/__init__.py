"""Hugging Face transformers configs and weights."""
