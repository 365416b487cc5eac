"""The engine: request state, paged KV bookkeeping, scheduler, model runner, LLMEngine, LLM."""
