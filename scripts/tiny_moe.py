"""A small random mixture-of-experts checkpoint to try `compress apply` on (no download).

Writes a Qwen3-MoE, Mixtral or OLMoE model with random weights, the bundled SmolLM2 tokenizer
and its vocabulary, saved by transformers in the hub's layout (experts one by one). With
``--idle-expert`` the router never picks the last expert (router rows w, -w, v, -v, ..., 0:
enough logits are always above its zero), which shows the RTN fallback for starved experts.

    python scripts/tiny_moe.py DIR/qwen3-moe --family qwen3_moe --idle-expert
    compress apply gptq-w4 --model DIR/qwen3-moe --samples 16 --windows 2 --seqlen 256 --output DIR/out

Random weights: the perplexities are meaningless; the token counts, warnings and export are real.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

EXPERTS = {"qwen3_moe": "num_experts", "mixtral": "num_local_experts", "olmoe": "num_experts"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--family", choices=sorted(EXPERTS), default="qwen3_moe")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--idle-expert", action="store_true", help="the router never picks the last expert")
    args = parser.parse_args()
    if args.idle_expert and args.experts % 2 == 0:
        parser.error("--idle-expert needs an odd --experts (pairs w, -w and one idle expert)")

    from compress import models

    tokenizer = AutoTokenizer.from_pretrained(models.resolve("smollm2-135m"))
    config = AutoConfig.for_model(
        args.family,
        hidden_size=128,
        intermediate_size=128,
        moe_intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=len(tokenizer),
        max_position_embeddings=2048,
        num_experts_per_tok=2,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **{EXPERTS[args.family]: args.experts},
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    if args.idle_expert:
        with torch.no_grad():
            for block in model.model.layers:
                w = torch.randn(args.experts // 2, config.hidden_size)
                rows = torch.stack([w, -w], 1).reshape(-1, config.hidden_size)
                block.mlp.gate.weight.copy_(torch.cat([rows, torch.zeros(1, config.hidden_size)]))
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    print(f"wrote {args.out}: {args.family}, {args.experts} experts, 2 per token")


if __name__ == "__main__":
    main()
