"""A tiny random-weight Llama model and its tokenizer, made on the spot for a real vLLM to serve
(no model hub is reachable from the test machines): ``python testing/tiny_model.py DIR``.

Run with a Python that has ``transformers`` and ``tokenizers`` (the vLLM CPU engine brings
both; this project's own venv needs only ``tokenizers``). The tokenizer is a byte-level BPE
trained on this repository's docs, so it is the same on every machine; the chat template is a
plain one (``<|role|>`` lines). The weights are random (seeded): the text it writes is noise, and
only ``"ignore_eos": true`` makes it write exactly ``max_tokens``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VOCAB = 2048
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL = ["<s>", "</s>", "<unk>", "<pad>"]


def make(out: Path, *, hidden: int = 128, layers: int = 2, seed: int = 0) -> Path:
    """Write the model and tokenizer into ``out`` (created); return it."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    texts = [p.read_text(encoding="utf-8") for p in sorted((REPO / "docs").glob("*.md"))]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        # vLLM's CPU attention takes head sizes of 32 and up (16 fails at the first step).
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
        max_position_embeddings=8192,  # the tests serve 2048; make demo-vllm 8192
        bos_token_id=tok.token_to_id("<s>"),
        eos_token_id=tok.token_to_id("</s>"),
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out)
    (out / "made_by.json").write_text(json.dumps({"by": "testing/tiny_model.py", "seed": seed}))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    make(ap.parse_args().out)


if __name__ == "__main__":
    main()
