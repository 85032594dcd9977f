"""Each route's request-to-plan mapping: the body checked and converted, once, into the `Plan`
the request pipeline runs (api/pipeline/run.py) and the shape its answer takes.

One module a route (completion, chat, responses, score, distributions); `LogprobsAsk` is the
one home of how any of them asks for logprobs, and `sampling` of how their fields become the
engine's sampling parameters."""
