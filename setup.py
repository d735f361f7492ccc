import runpy
from pathlib import Path

from setuptools import find_packages, setup

# The supported torch and transformers releases, from the table RL2 checks when imported.
requirement = runpy.run_path(str(Path(__file__).parent / "RL2" / "versions.py"))["requirement"]

setup(
    name="RL2",
    version="0.1.0",
    description="Ray Less Reinforcement Learning: SFT, DPO, reward modelling and RL for language models under torchrun",
    packages=find_packages(include=["RL2", "RL2.*"]),
    package_data={"RL2": ["trainer/config/*.yaml", "native/*.c", "native/include/*.h", "viewer/static/*"]},
    python_requires=">=3.10",
    install_requires=[
        # Ranges, so that `pip install -e .` keeps the torch a machine has (a CUDA build on GPUs; SGLang
        # 0.5.23 pins torch 2.14.1 and transformers 5.19.0, so both share one environment). The CPU quick
        # start installs torch==2.13.0 explicitly: without a torch, pip would pull the newest CUDA build in
        # the range. The lower bounds are releases the tests ran with (RL2/versions.py).
        requirement("torch"),
        requirement("transformers"),
        "datasets>=3.0",
        "omegaconf>=2.3",
        "safetensors",
        "tqdm",
        "numpy",
        "wandb",
        # Loading the embedded model's GGUF file.
        "gguf",
        "accelerate",
        # The learning-curve PNG of every run.
        "matplotlib",
        # Agents: the endpoint each rank serves during rollouts, and the clients agents use (OpenAI's, Anthropic's).
        "aiohttp",
        "openai",
        "anthropic",
        # The SGLang engine's client of its servers.
        "httpx",
    ],
    extras_require={
        # Optional kernels: without them attention runs torch's own varlen kernel or exact SDPA.
        "gpu": ["flash-attn", "ring-flash-attn"],
        "gem": ["gem-llm"],
        "math": ["math-verify"],
        # trainer.use_tensorboard=true: TensorBoard event files next to metrics.jsonl.
        "tensorboard": ["tensorboard"],
        # MCP_SERVERS in an environment or agent script: the tools of MCP servers (the 2.x client API).
        "mcp": ["mcp>=2.3"],
        # The test run covers the GEM adapter, math-verify answers, TensorBoard files, MCP servers' tools and
        # loading LoRA adapter folders with peft too; pytest-xdist runs it on two workers (the README's test
        # command), after ruff (a minor release of its own, whose rules ruff.toml's selection keeps). Playwright
        # drives the system's Chromium in the viewer's browser tests (its own browsers are never downloaded).
        "test": ["pytest", "pytest-xdist", "gem-llm", "math-verify", "tensorboard", "mcp>=2.3", "peft",
                 "ruff>=0.17,<0.18", "playwright"],
    },
)
