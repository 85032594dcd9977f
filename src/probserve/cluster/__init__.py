"""Serving on a Ray Serve cluster: one deployment of engine replicas per model behind the same
FastAPI app as ingress (app.py), prefix-aware routing (router.py), failover (ray_engine.py)."""
