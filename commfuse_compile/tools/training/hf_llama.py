"""A Hugging Face Llama as the transformers examples (``examples/train_hf_tp.py``,
``examples/generate_hf_tp.py``) load it: ``--model``, or a tiny random one rank 0 writes,
sharded by transformers' own plan (``tp_plan="auto"``) over every rank."""

from __future__ import annotations

import argparse
import tempfile
import warnings
from typing import Any

import torch
import torch.distributed as dist


def tiny_llama(path: str, layers: int) -> None:
    """A random Llama small enough for CPU ranks, written as a checkpoint."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=384,
        hidden_size=96,
        intermediate_size=192,
        num_hidden_layers=layers,
        num_attention_heads=12,
        num_key_value_heads=12,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)


def checkpoint(args: argparse.Namespace) -> str:
    """``--model``, or a tiny Llama rank 0 wrote (its directory sent to every rank)."""
    if args.model:
        return args.model
    path = [tempfile.mkdtemp(prefix="commfuse-tiny-llama-") if dist.get_rank() == 0 else ""]
    if dist.get_rank() == 0:
        tiny_llama(path[0], args.layers)
    dist.broadcast_object_list(path, src=0)
    return path[0]


def load(path: str) -> Any:
    """The checkpoint sharded by transformers' own plan over every rank."""
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():  # 5.x: "pass it in DistributedConfig(tp_plan=...)"
        warnings.filterwarnings("ignore", "Passing `tp_plan`", FutureWarning)
        return AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float32)


def load_vocab(path: str) -> int:
    """The checkpoint's vocabulary size (of its text model)."""
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(path).get_text_config().vocab_size)
