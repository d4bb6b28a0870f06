"""Worker of tests/e2e/test_hf_export.py: the megatron-core model's logits for fixed tokens, with a
``pretrain_gpt.py`` checkpoint loaded (``--load``, any saved layout, resharded to this launch's), through
``pretrain_gpt.py``'s own set-up (``training.TrainingRun``) and ``load_checkpoint``.

    python tests/hf_export_worker.py OUT.pt TOKENS_JSON PRETRAIN_GPT_FLAGS...
"""

from __future__ import annotations

import json
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron.training.checkpointing.checkpoint import load_checkpoint  # noqa: E402
from tests.spawn import megatron_run  # noqa: E402


def main() -> None:
    out, tokens, flags = sys.argv[1], torch.tensor(json.loads(sys.argv[2])), sys.argv[3:]
    cfg, run, _ = megatron_run(flags, world=1)
    load_checkpoint(cfg.checkpoint.load, run)
    (chunk,) = run.bare_chunks
    chunk.eval()
    position_ids = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        logits = chunk(tokens, position_ids, None)  # [batch, seq, padded vocab]
    torch.save(logits.float().cpu(), out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
