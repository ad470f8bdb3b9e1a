"""Engine adapters, each imported only by its engine: `tract.integrations.vllm`
(vLLM's KV connector v1)."""
