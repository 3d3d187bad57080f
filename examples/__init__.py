"""Runnable training scripts; `dflash/` holds the online drafter-training example's models
and loops."""
