"""The engine worker's torch side: the engine (engine.py: schedule, run, sample, update), its
scheduler, KV block pool, sequences, prompt scoring, sampler, logprobs and row math, the step's
data (step.py) and the runners (runners/). Only the worker process (and the inline host,
async_engine.py) imports it; the API side speaks to it through engine/'s face (types, info,
config, client, wire, worker_client)."""
