"""Experiment configuration: typed schema (pydantic) and YAML loading."""
