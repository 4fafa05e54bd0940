"""FSDP policies of the tutorial: mixed precision, auto-wrap, activation checkpointing."""
