"""llm-extproc: admission control for LLM inference as an Envoy ext_proc sidecar."""

__version__ = "0.1.0"
