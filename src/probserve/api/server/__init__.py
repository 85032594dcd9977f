"""The server's state and what keeps it: its settings (config.py, limits.py), the served
models (served.py), the state a request looks up (state.py, lookup.py), the field policy
(fields.py), budgets, compiled grammars, metrics and the engines' supervisor."""
