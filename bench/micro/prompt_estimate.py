"""The prompt estimate without a tokenizer, against real tokenizers, text by text:
``python -m bench.micro.prompt_estimate`` (the test extra brings the tokenizers).

The estimate is ``extproc.request.classify``'s (docs/policy.md, "Notes on the keys", the prompt
estimate); the latest figures: docs/performance.md, "Conclusions from earlier measurements".
This compares it, and the old characters / 4, with the two tokenizers PyPI's ``mistral-common``
carries in its wheel (nothing is downloaded): Mistral 7B's SentencePiece BPE (32k pieces with
byte fallback, the Llama 2 family's design) and Tekken (the tiktoken-style BPE of 131k tokens
of Mistral NeMo and later). The texts are written for this benchmark, each repeated to a few
hundred characters; the adversarial strings come from a fixed seed.

Targets, on natural and mixed text, against the larger real count: at least 0.9x, so a prompt
is never let past ``max_prompt_tokens`` or the token bound at a fraction of its cost, and at
most 3x. Adversarial strings get no target: random text tokenizes at up to about one token per
byte, and only a tokenizer counts it exactly.
"""

from __future__ import annotations

import argparse
import os
import random
import string
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from bench.common.table import format_table
from extproc.config.policy import TokenPolicy
from extproc.request.classify import token_counter

__all__ = ["ADVERSARIAL", "NATURAL", "Row", "cost_us_per_kib", "main", "measure"]

SAFE = 0.9
ABSURD = 3.0

NATURAL: dict[str, str] = {
    "english": "The gateway keeps the backend within its capacity while requests wait their turn.",
    "code": "def admit(q):\n    return [t for t in q if t.cost <= budget and not t.gone]\n",
    "german": "Die Zulassungskontrolle hält das Backend innerhalb seiner Kapazität, während "
    "Anfragen in der Warteschlange auf einen freien Platz warten müssen.",
    "french": "Le contrôle d'admission garde le serveur dans sa capacité pendant que les "
    "requêtes attendent leur tour dans la file.",
    "russian": "Контроль допуска удерживает сервер в пределах его мощности, пока запросы ждут "
    "своей очереди.",
    "greek": "Ο έλεγχος εισδοχής κρατά τον διακομιστή εντός της χωρητικότητάς του ενώ τα "
    "αιτήματα περιμένουν τη σειρά τους.",
    "arabic": "يحافظ التحكم في القبول على الخادم ضمن سعته بينما تنتظر الطلبات دورها في الطابور.",
    "hebrew": "בקרת הקבלה שומרת על השרת בתוך הקיבולת שלו בזמן שהבקשות ממתינות בתור.",
    "hindi": "प्रवेश नियंत्रण सर्वर को उसकी क्षमता के भीतर रखता है जबकि अनुरोध कतार में अपनी "
    "बारी की प्रतीक्षा करते हैं।",
    "thai": "การควบคุมการรับเข้าทำให้เซิร์ฟเวอร์อยู่ในขีดความสามารถในขณะที่คำขอรอคิวของตน",
    "chinese": "准入控制使服务器保持在其容量之内，请求在队列中等待，直到轮到它们为止。",
    "japanese": "アドミッション制御はサーバーを容量内に保ち、"
    "リクエストは順番が来るまでキューで待ちます。",
    "korean": "승인 제어는 요청이 대기열에서 차례를 기다리는 동안 서버를 용량 내로 유지합니다.",
    "vietnamese": "Kiểm soát truy cập giữ máy chủ trong giới hạn công suất trong khi các yêu cầu "
    "chờ đến lượt.",
    "mixed_cjk_latin": "在 vLLM 中，max_num_seqs 决定了批处理的大小；Envoy 的 ext_proc 过滤器"
    "把请求交给 sidecar 处理。",
    "mixed_chat_emoji": "Great news 🎉 the deploy went fine 👍🏽 see you at 10:30 ☕️ "
    "merci beaucoup! 😀",
    "mixed_json": '{"user_id": 48213, "items": [{"sku": "A-1093", "qty": 2}], "note": "ok"}',
}


def _adversarial(seed: int = 1) -> dict[str, str]:
    rng = random.Random(seed)

    def pick(chars: str, n: int) -> str:
        return "".join(rng.choice(chars) for _ in range(n))

    def span(lo: int, hi: int, n: int) -> str:
        return "".join(chr(rng.randint(lo, hi)) for _ in range(n))

    return {
        "random_letters": pick(string.ascii_letters, 800),
        "random_punctuation": pick(string.punctuation, 800),
        "random_ascii": pick(string.printable[:94], 800),
        "digits": pick(string.digits, 800),
        "hex": pick("0123456789abcdef", 800),
        "rare_cjk": span(0x4E00, 0x9FFF, 300),
        "emoji": span(0x1F300, 0x1F5FF, 300),
        "private_use": span(0xE000, 0xF8FF, 300),
        "cjk_ext_b": span(0x20000, 0x2A6DF, 300),
    }


ADVERSARIAL = _adversarial()


@dataclass(frozen=True, slots=True, kw_only=True)
class Row:
    name: str
    chars: int
    estimate: int
    old: int  # characters / 4, rounded up: the estimate before
    spm: int
    tekken: int

    @property
    def ratio(self) -> float:
        return self.estimate / max(1, self.spm, self.tekken)


def _tokenizers() -> tuple[Callable[[str], int], Callable[[str], int]]:
    try:
        import mistral_common
        import sentencepiece
        from mistral_common.tokens.tokenizers.tekken import Tekkenizer
    except ImportError:
        sys.exit("needs the test extra's tokenizers: pip install -e '.[test]'")
    data = os.path.join(os.path.dirname(mistral_common.__file__), "data")
    spm = sentencepiece.SentencePieceProcessor(model_file=os.path.join(data, "tokenizer.model.v1"))
    tek = Tekkenizer.from_file(os.path.join(data, "tekken_240911.json"))
    return (lambda t: len(spm.encode(t))), (lambda t: len(tek.encode(t, bos=False, eos=False)))


def measure(texts: dict[str, str], length: int = 400) -> list[Row]:
    """One row per text, each repeated to at least ``length`` characters."""
    spm, tekken = _tokenizers()
    estimate = token_counter(TokenPolicy())
    rows = []
    for name, text in texts.items():
        long = text * max(1, -(-length // len(text)))
        rows.append(
            Row(
                name=name,
                chars=len(long),
                estimate=estimate((long,)),
                old=-(-len(long) // 4),
                spm=spm(long),
                tekken=tekken(long),
            )
        )
    return rows


def _table(rows: list[Row], target: bool) -> str:
    head = ["text", "chars", "sentencepiece", "tekken", "chars/4", "estimate", "estimate/real"]
    if target:
        head.append("target")
    out = []
    for r in rows:
        line = [r.name, str(r.chars), str(r.spm), str(r.tekken), str(r.old), str(r.estimate)]
        line.append(f"{r.ratio:.2f}")
        if target:
            line.append("PASS" if SAFE <= r.ratio <= ABSURD else "MISS")
        out.append(line)
    return format_table(head, out)


def cost_us_per_kib(text: str, n: int = 2000) -> float:
    """The estimate's cost on ``text`` repeated to 16 KiB of UTF-8: the median of ``n`` calls,
    in microseconds per KiB."""
    estimate = token_counter(TokenPolicy())
    long = text * max(1, 16384 // len(text.encode()))
    kib = len(long.encode()) / 1024
    times = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        estimate((long,))
        times.append(time.perf_counter_ns() - t0)
    times.sort()
    return times[len(times) // 2] / 1000 / kib


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--length", type=int, default=400, help="characters per text, at least")
    args = ap.parse_args(argv)
    natural = measure(NATURAL, args.length)
    print(f"natural and mixed text (target: {SAFE} <= estimate / real <= {ABSURD}):")
    print(_table(natural, target=True))
    print("\nadversarial strings (no target: only a tokenizer counts them exactly):")
    print(_table(measure(ADVERSARIAL, args.length), target=False))
    print("\ncost (median of 2,000 calls on 16 KiB; no target):")
    for name in ("english", "russian", "chinese"):
        print(f"  {name:8} {cost_us_per_kib(NATURAL[name]):6.2f} us per KiB")
    misses = sum(not SAFE <= r.ratio <= ABSURD for r in natural)
    print(f"\n{len(natural) - misses} PASS, {misses} MISS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
