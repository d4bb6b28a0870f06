"""Checkpoints: pretrain_gpt.py's sharded, reshardable checkpoints and the Hugging Face export."""
