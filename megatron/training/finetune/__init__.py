"""Fine-tuning transformers models in FP8 (SFT, DPO): the parts ``examples/finetune/sft.py`` and ``dpo.py`` are
built from, by concern (:mod:`.data`, :mod:`.runtime`, :mod:`.export`, :mod:`.demo`, :mod:`.cli`, :mod:`.loop`).
Nothing runs on import, and importing the package imports none of its modules."""
