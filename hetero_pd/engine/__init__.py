"""The engine: requests, KV block pool, scheduler, model runner, sampler."""
