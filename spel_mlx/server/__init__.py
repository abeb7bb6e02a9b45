"""An OpenAI-compatible HTTP server over the Python API, and a live page showing
speculation (``python -m spel_mlx.server``; docs/server.md).  FastAPI and uvicorn
come with the `server` extra; they are imported only by app.py and the command."""
