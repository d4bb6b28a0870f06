"""Planning: the per-GPU memory planner and pretrain_gpt.py's --dry-run."""
