"""radix_runtime: an SGLang-style LLM serving runtime around a radix tree of KV-cache pages."""

from setuptools import find_packages, setup

setup(
    name="radix_runtime",
    version="0.1.0",
    description="LLM serving runtime with a radix-tree KV cache (tokenizer / scheduler / worker over ZeroMQ)",
    python_requires=">=3.10",
    packages=find_packages(include=["radix_runtime", "radix_runtime.*"]),
    package_data={"radix_runtime": ["worker/model_configs/*.json"]},
    install_requires=[
        # a range the CPU wheel on the dev machines (2.13) and the H200's torch (2.11) satisfy
        "torch>=2.4,<2.14",
        "numpy",
        "pyzmq>=25",
        "msgspec>=0.18",
        "fastapi",
        "uvicorn",
        "uvloop",
        "sentencepiece",
        "tokenizers>=0.19",
        "gguf>=0.10",
        "jinja2",
        "tqdm",
        "setproctitle",
        "safetensors",
        "psutil",
    ],
    extras_require={
        "gpu": ["flashinfer-python==0.5.3", "triton"],
        "test": [
            "pytest",
            "pytest-timeout",
            "hypothesis",
            "ruff",
            "openai>=1.0",
            "httpx",
            "transformers",
            "matplotlib",
        ],
        "bench": ["matplotlib", "httpx"],
    },
    entry_points={"console_scripts": ["radix-runtime=radix_runtime.cli:main"]},
)
