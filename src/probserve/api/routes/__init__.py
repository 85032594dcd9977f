"""The API's routes, each turning its body into a plan (api/plans/) and its candidates into
its own answer shapes, and the one request pipeline they share (run.py, generation.py)."""
