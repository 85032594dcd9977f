"""The HTTP edge: the server (uvicorn, its header deadline and connection bound), the ASGI
middleware (scope guard, auth, body limits, the access line), disconnects, SSE, and the
loading front that answers while the models load."""
