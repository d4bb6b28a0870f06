"""What a run reports and watches: its terminal/JSON log and loss curves (``log``), TensorBoard and W&B scalars
(``scalar_writers``), FP8 numerics statistics and their alarms (``fp8_numerics``), the skipped-step limit
(``health``) and its output paths checked at start-up (``output_paths``)."""
