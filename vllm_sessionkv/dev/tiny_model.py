"""Generate a tiny random Llama that vLLM's CPU build can serve.

No model can be downloaded in CI, so tests and the CPU demo build one: a byte-level
BPE trained on a seeded synthetic corpus, a chat template, and a 2-layer Llama with
head_dim 64 (the CPU attention backend refuses head_dim 16).  Everything derives from
``--seed``; the same seed gives the same files.

    sessionkv-tiny-model OUT_DIR [--seed 0] [--perturb]

``--perturb`` writes a copy whose k_proj/v_proj weights are scaled by -3: the negative
control for "D really decodes on the KV it received".
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
from pathlib import Path

__all__ = ["BENCH_MODEL_SIZE", "CHAT_TEMPLATE", "SPECIAL_TOKENS", "generate_tiny_model", "main"]

logger = logging.getLogger(__name__)

SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|im_start|>", "<|im_end|>",
                  "<think>", "</think>"]

# ChatML-style.  Reasoning traces are passed through as written: whether a client keeps
# or strips <think>...</think> from history is the client's choice, and exactly the
# case our connector must survive.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_SYLLABLES = ["ka", "to", "ri", "mu", "sen", "lo", "va", "qu", "zi", "pe", "dra", "mon",
              "el", "ix", "or", "un", "sha", "te", "bo", "gal", "fi", "nu", "ter", "wy"]


def _corpus(seed: int, n_lines: int = 4000) -> list[str]:
    rng = random.Random(seed)
    words = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3)))
             for _ in range(600)]
    words += ["the", "a", "is", "of", "and", "to", "in", "user", "assistant", "tool",
              "call", "result", "def", "return", "print", "(", ")", ":", ",", ".", "?"]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(4, 24)))
            for _ in range(n_lines)]


def _train_tokenizer(seed: int, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    return tok


# The agent benchmark's model: the same tokenizer and init, wider and deeper, so that
# prefill compute (not per-request overhead) dominates on a 2-core CPU.  3,072 KV
# bytes per token in bfloat16 (6 layers x 2 KV heads x 64 x K and V x 2 bytes).
BENCH_MODEL_SIZE = {"hidden_size": 384, "intermediate_size": 1536, "num_hidden_layers": 6,
                    "num_attention_heads": 6, "num_key_value_heads": 2}


def generate_tiny_model(out_dir: str | os.PathLike, seed: int = 0, perturb: bool = False,
                        vocab_size: int = 1024, max_position_embeddings: int = 8192,
                        hidden_size: int = 128, intermediate_size: int = 256,
                        num_hidden_layers: int = 2, num_attention_heads: int = 2,
                        num_key_value_heads: int = 2) -> Path:
    """Write an HF model directory vLLM can load; returns its path.  The defaults are
    the tests' tiny model; ``**BENCH_MODEL_SIZE`` gives the benchmark's."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = _train_tokenizer(seed, vocab_size)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>",
        pad_token="<|pad|>", additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    hf_tok.chat_template = CHAT_TEMPLATE
    hf_tok.model_max_length = max_position_embeddings
    hf_tok.save_pretrained(out)

    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=hidden_size,
        intermediate_size=intermediate_size, num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads,
        head_dim=64,
        max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-5,
        # A wider init than the default 0.02 keeps the random model's next-token
        # distribution from being nearly flat, so greedy outputs vary with the prompt.
        initializer_range=0.5, tie_word_embeddings=False,
        bos_token_id=tok.token_to_id("<|bos|>"), eos_token_id=tok.token_to_id("<|eos|>"),
        pad_token_id=tok.token_to_id("<|pad|>"), torch_dtype="bfloat16")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    if perturb:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.k_proj.weight.mul_(-3.0)
                layer.self_attn.v_proj.weight.mul_(-3.0)
    model.save_pretrained(out, safe_serialization=True)
    (out / "sessionkv_tiny_model.json").write_text(
        json.dumps({"seed": seed, "perturbed": perturb, "vocab_size": vocab_size,
                    "hidden_size": hidden_size, "num_hidden_layers": num_hidden_layers}))
    logger.info("tiny model written to %s (seed=%d perturbed=%s)", out, seed, perturb)
    return out


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sessionkv-tiny-model", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bench", action="store_true",
                        help="the agent benchmark's larger model (BENCH_MODEL_SIZE)")
    parser.add_argument("--perturb", action="store_true",
                        help="scale k_proj/v_proj by -3 (negative control)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    generate_tiny_model(args.out_dir, seed=args.seed, perturb=args.perturb,
                        **(BENCH_MODEL_SIZE if args.bench else {}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
