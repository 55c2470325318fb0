"""What each benchmark sends, as data for :mod:`.client`: one function per benchmark,
:func:`default_classes` for ``bench.compare`` (sent by :mod:`.runner`; the mix:
docs/benchmarks.md, "What the simulator models"), :func:`demo_burst` for ``make demo``,
:func:`storm_arrivals` for the disconnect storm (``tests/e2e/test_faults.py``) and
:func:`soak_arrivals` for ``bench.soak``.

The last three take a seed and return ``(t, Call)`` arrivals (wall seconds from the start),
drawn from one random stream in arrival order, so a run is reproducible. The echo backend
(``testing/backend.py``) reads ``x-test-delay-ms`` and ``x-test-chunks``; the simulator
ignores them.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Final

from .client import Call
from .workload import ClassSpec

__all__ = ["default_classes", "demo_burst", "soak_arrivals", "storm_arrivals"]

_INTERACTIVE: Final = {"x-llm-class": "interactive"}


def default_classes(rate: float, *, interactive_share: float = 0.8) -> tuple[ClassSpec, ...]:
    """The standard two-class mix: chat-like interactive traffic and prefill-heavy batch traffic.

    * ``interactive``: streamed chat, 30 s timeout, lengths from ``azure_conv.csv``.
    * ``batch``: non-streamed, 300 s timeout, lengths from ``azure_code.csv`` (long prompts,
      short outputs).
    """
    if not 0.0 <= interactive_share <= 1.0:
        raise ValueError("interactive_share must be in [0, 1]")
    classes = []
    if interactive_share > 0:
        classes.append(
            ClassSpec(
                name="interactive",
                rate=rate * interactive_share,
                trace="azure_conv.csv",
                stream=True,
                timeout_s=30.0,
            )
        )
    if interactive_share < 1:
        classes.append(
            ClassSpec(
                name="batch",
                rate=rate * (1 - interactive_share),
                trace="azure_code.csv",
                stream=False,
                timeout_s=300.0,
            )
        )
    return tuple(classes)


def _demo_word(n: int) -> str:
    """A three-letter word for ``n`` (letters only: the sidecar's estimate charges a digit a
    whole token, so digits would make the prompts look longer than they are)."""
    return "".join(chr(97 + (n // 26**k) % 26) for k in range(3))


def _demo_chat(tokens: int, max_tokens: int, seed: int) -> bytes:
    words = " ".join(_demo_word((seed * 7 + i) % 997) for i in range(tokens))  # 4 chars a word
    text = words[: tokens * 4]  # ``tokens`` tokens at 4 characters each
    return json.dumps(
        {"model": "demo", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens}
    ).encode()


def demo_burst(
    rate: float, seconds: float, batch: int, *, seed: int = 1
) -> list[tuple[float, Call]]:
    """``make demo``'s requests: ``batch`` long batch requests (1000-2000-token prompts,
    max_tokens 4000) and 3 oversize prompts (40,000 tokens) at once, then ``rate * seconds``
    short interactive chats (50-150 tokens, max_tokens 64, ``x-llm-class: interactive``) at
    a fixed spacing of ``1 / rate``. Labels: ``batch``, ``oversize``, ``interactive``."""
    rng = random.Random(seed)
    out = [
        (0.0, Call(body=_demo_chat(rng.randint(1000, 2000), 4000, i), label="batch", give_up_s=300))
        for i in range(batch)
    ]
    out += [
        (0.0, Call(body=_demo_chat(40_000, 64, i), label="oversize", give_up_s=300))
        for i in range(3)
    ]
    for i in range(int(rate * seconds)):
        body = _demo_chat(rng.randint(50, 150), 64, i)
        call = Call(body=body, headers=_INTERACTIVE, label="interactive", give_up_s=300)
        out.append((i / rate, call))
    return out


def _echo_call(
    rng: random.Random,
    headers: dict[str, str],
    *,
    chars: int,
    max_tokens: int,
    stream: bool,
    abort_s: float | None,
) -> Call:
    """A chat of 1-``chars`` characters and 1-``max_tokens`` max_tokens, half of them
    interactive; it aborts after ``abort_s``, or gives up after 60 s."""
    if rng.random() < 0.5:
        headers = headers | _INTERACTIVE
    body = {
        "messages": [{"role": "user", "content": "x" * rng.randint(1, chars)}],
        "max_tokens": rng.randint(1, max_tokens),
        "stream": stream,
    }
    return Call(
        body=json.dumps(body).encode(),
        headers=headers,
        stream=stream,
        give_up_s=60.0 if abort_s is None else abort_s,
        aborts=abort_s is not None,
    )


def storm_arrivals(
    n: int,
    *,
    abort_share: float,
    seed: int = 1,
    max_abort_delay_s: float = 0.3,
    backend_delay_ms: tuple[int, ...] = (0, 10, 50),
) -> list[tuple[float, Call]]:
    """``n`` chat completions, all due at once (the storm's concurrency paces them): streamed
    or not, half interactive, a backend delay from ``backend_delay_ms`` and 1-4 chunks;
    ``abort_share`` of them abort (``Call.aborts``) after a uniform delay up to
    ``max_abort_delay_s``, which lands while the request is queued, admitted, or mid-stream;
    the others give up after 60 s."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        stream = rng.random() < 0.5
        headers = {
            "x-test-delay-ms": str(rng.choice(backend_delay_ms)),
            "x-test-chunks": str(rng.randint(1, 4)),
        }
        abort = rng.uniform(0.0, max_abort_delay_s) if rng.random() < abort_share else None
        call = _echo_call(rng, headers, chars=400, max_tokens=200, stream=stream, abort_s=abort)
        out.append((0.0, call))
    return out


def soak_arrivals(
    rate: float, seconds: float, *, backend_ms: int, abort_share: float, seed: int = 1
) -> Iterator[tuple[float, Call]]:
    """Poisson arrivals at ``rate`` per second for ``seconds``, the first at 0: half
    interactive, half streamed, prompts of 1-800 characters, max_tokens 1-300; every request
    takes ``backend_ms`` at the backend (one chunk when streamed), so capacity is known;
    ``abort_share`` abort after a uniform delay up to twice that, the others give up after
    60 s. Lazy: an hour's arrivals are never all in memory."""
    rng = random.Random(seed)
    headers = {"x-test-delay-ms": str(backend_ms), "x-test-chunks": "1"}
    t = 0.0
    while t < seconds:
        stream = rng.random() < 0.5
        abort = rng.uniform(0, 2 * backend_ms / 1000) if rng.random() < abort_share else None
        yield t, _echo_call(rng, headers, chars=800, max_tokens=300, stream=stream, abort_s=abort)
        t += rng.expovariate(rate)
