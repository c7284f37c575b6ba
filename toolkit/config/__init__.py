"""Typed configuration schema and Hydra composition helpers."""
