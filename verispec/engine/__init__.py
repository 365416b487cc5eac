"""The engine: request state, scheduler, LLMEngine, LLM (the paged KV cache and model runner it drives are in runtime/)."""
